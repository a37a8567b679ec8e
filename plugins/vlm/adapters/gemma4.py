"""Gemma 4 (E2B, E4B, 31B, 26B-A4B) through transformers' ``Gemma4ForConditionalGeneration``: a ViT on a fixed
budget of patches per image, pooled into soft tokens and projected into a language model with sliding-window and
full-attention layers, plain 1-D rotary positions and soft-capped logits.

Registered when the installed transformers has ``transformers.models.gemma4``. What differs from the Qwen-VL
conventions of the base class, against transformers 5.25's ``models/gemma4/modeling_gemma4.py``,
``processing_gemma4.py`` and ``image_processing_gemma4.py``:

- **Images are padded patch sets.** The image processor resizes each image, keeping its aspect ratio, to the largest
  size whose sides are multiples of ``patch_size · pooling_kernel_size`` and whose patches fit in ``max_soft_tokens ·
  pooling_kernel_size²`` (``get_aspect_ratio_preserving_size``: small images are enlarged to fill the budget), cuts it
  into patches and pads every image's patches to that budget: ``pixel_values [images, max_patches, 3·patch²]`` with
  ``image_position_ids [images, max_patches, 2]``, the (x, y) patch of each row and ``(-1, -1)`` on padding. There is
  no grid; an image is ``<|image>`` + its soft tokens (real patches / pooling²) ``<|image|>`` + ``<image|>``, and
  the model fills the ``<|image|>`` tokens with the images' features in order. Each prompt keeps its own images'
  rows (:meth:`encode`), and :meth:`collate` concatenates them, re-padding to the widest patch set of the batch if
  prompts were encoded under different budgets (padding rows are zero with position ``(-1, -1)``, which the tower
  masks out and the pooler ignores).
- **Pixel bounds become a soft-token budget.** The processor supports 70, 140, 280, 560 or 1,120 soft tokens per
  image; the adapter takes the largest whose area (``tokens · (patch · pooling)²``, 2,304 pixels a token in the
  released checkpoints) fits in ``max_pixels``. ``min_pixels`` holds by construction up to the smallest area the
  processor makes under that budget, and cannot be met above it, so a larger one is refused in one line
  (:meth:`smallest_area`, as SmolVLM's adapter treats its smallest canvas). That area is not the budget's: every
  image is scaled to fill the budget and then each side is rounded *down* to whole soft tokens, so a square image
  under 280 tokens gets 16 × 16 = 256 and one whose ideal height is just under two tokens loses almost half its
  width's tokens (:func:`smallest_resized_area`). :meth:`resized_size` is the processor's resized size.
- **Plain rotary positions.** Without position ids the model numbers positions from the first column, padding
  included (``Gemma4Model.forward``), so left-padded rows would sit past their padding; the adapter (``mrope``
  false) passes each row's positions from the padding mask, as ``generate`` computes them.
- **Bidirectional attention inside images** (``use_bidirectional_attention: "vision"``, the 31B and 26B-A4B models):
  on sliding-window layers the tokens of one image attend to each other both ways (``create_masks_for_vision_model``,
  blocks from ``mm_token_type_ids``). A prompt's blocks end inside the prompt (it ends in text), so its hidden states
  and keys still depend on the prompt alone: the shared prompt prefill and the shared prompt forward stay exact
  (tested against the plain per-sample forward), and the completion, text, attends causally.
- **Sliding-window layers** keep only their window in the cache; the decode loop hands them the 2D padding mask
  (:mod:`mmrl.plugins.vlm.decode`), not the 4D one every layer would take whole.
- **Soft-capped logits.** Every released variant caps its logits, ``30 · tanh(logits / 30)``
  (``final_logit_softcapping``). The fused LM head and the decode steps apply the head themselves, so they apply the
  cap too (:func:`~mmrl.plugins.vlm.adapters.base.logit_softcap`); without it the log-probs would be those of another
  distribution at ratio 1.
- **The feature cache** keeps ``get_image_features``'s output (vision tower, pooling and the ``embed_vision``
  projection into the language model: one ``[tokens_k, hidden]`` per image, kept per prompt as ``[tokens_i,
  hidden]``), which the model takes back through ``mm_encoder_outputs["image"].pooler_output``. Since the projection
  is inside what is cached, ``freeze_vision`` freezes ``embed_vision`` with the tower (:meth:`vision_modules`) and
  keeps LoRA off both (the tower's MLP also names its projections ``gate_proj``/``up_proj``/``down_proj``).
- **Mixture of experts** (26B-A4B: ``enable_moe_block`` in the text config). Every decoder layer adds to its dense
  MLP a router (``router.proj``, ``router.scale``, ``router.per_expert_scale``) and fused experts
  (``experts.gate_up_proj [E, 2·I, H]``, ``experts.down_proj [E, H, I]``: parameters, not linear modules; LoRA
  reaches them through ``lora.target_parameters``). :attr:`moe` is read from each checkpoint's config, so the dense
  variants stay dense. With ``output_router_logits`` the model returns each layer's ``router_logits``, which are the
  router's softmax probabilities (``Gemma4TextRouter.forward`` returns them first, and ``Gemma4TextModel`` records
  that output), and no ``aux_loss``: :meth:`router_load_balancing_loss` computes Switch load balancing from them
  (:func:`~mmrl.plugins.vlm.adapters.base.switch_load_balancing`, top-k over the same probabilities the router picks
  from).
- **One ``<bos>``.** The released chat template writes ``<bos>`` (``{{- bos_token }}`` at its start; llama.cpp keeps a
  copy of google/gemma-4-31B-it's as ``models/templates/google-gemma-4-31B-it-interleaved.jinja``), and the released
  tokenizer does not add one: transformers' ``convert_gemma4_weights.py`` builds it as ``GemmaTokenizer(...,
  add_bos_token=False)`` (huggingface/transformers@0f3f0632, ``main``; the script is not in the 5.25 wheel). So the
  processor called on a rendered chat gives one ``<bos>`` either way; :meth:`encode` still tokenizes a chat that starts
  with ``<bos>`` without special tokens (:meth:`~mmrl.plugins.vlm.adapters.base.VLMAdapter.adds_special_tokens`,
  transformers' rule in ``apply_chat_template(tokenize=True)``), so a checkpoint whose tokenizer adds BOS, as Gemma
  3's does, gets one too.
- **No videos, no audio.** Gemma 4 writes a video as ``mm:ss`` timestamps before each frame's image tokens and
  encodes frames with their own position ids and frame counts, which the plugin's video bookkeeping
  (``video_grid_thw``, frame rates, T-GRPO) does not describe: this family takes image rows only. Audio inputs are
  not part of the plugin.
- **Boxes.** No grounding output format of Gemma 4 is documented by Google or transformers that this adapter could
  cite (third-party write-ups describe JSON on a 0–1000 grid, without the axis order), so the family declares the
  ``absolute`` convention: prompt the model for JSON ``bbox_2d`` in pixels of the original image. Its native format
  is not read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from mmrl.plugins.vlm.adapters.base import (
    PromptInputs,
    VLMAdapter,
    _base_model,
    find_submodule,
    open_unresized,
    switch_load_balancing,
)

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)
"""The soft-token budgets per image Gemma 4's image processor accepts (``_SUPPORTED_SOFT_TOKENS``, transformers 5.25
``image_processing_gemma4.py``)."""


class Gemma4Adapter(VLMAdapter):
    """Gemma 4 (``model_type: gemma4``) through ``transformers.Gemma4ForConditionalGeneration`` (see the module
    docstring)."""

    name = "gemma4"
    pooled_features_as_tuple = True  # the model concatenates pooler_output (torch.cat)
    model_types = ("gemma4",)
    model_class = "Gemma4ForConditionalGeneration"
    box_convention = "absolute"
    vision_attributes: ClassVar[tuple[str, ...]] = ("model.vision_tower",)
    embedder_attributes: ClassVar[tuple[str, ...]] = ("model.embed_vision",)
    # The tower's MLP names its projections like the language model's: the pattern keeps LoRA off the tower, the
    # embedder that projects its output, and (E2B/E4B) the audio tower and its embedder, which the plugin never feeds.
    vision_module_pattern: ClassVar[str] = r".*(^|\.)(vision_tower|embed_vision|audio_tower|embed_audio)(\.|$).*"
    # The placeholders the model fills with features (a sampled one would be embedded as PAD when fed back, not as the
    # token the decode step saw) and the image and audio delimiters.
    vision_tokens: ClassVar[tuple[str, ...]] = ("<|image|>", "<|image>", "<image|>", "<|video|>", "<|audio|>",
                                                "<|audio>", "<audio|>")
    end_of_turn: ClassVar[str] = "<turn|>"
    supports_videos = False
    video_refusal = "its processor writes timestamped frames the plugin does not track"
    mrope = False

    def __init__(self, model: str, *, min_pixels: int, max_pixels: int, video_min_pixels: int | None = None,
                 video_max_pixels: int | None = None, video_total_pixels: float | None = None):
        super().__init__(model, min_pixels=min_pixels, max_pixels=max_pixels, video_min_pixels=video_min_pixels,
                         video_max_pixels=video_max_pixels, video_total_pixels=video_total_pixels)
        image_processor = self.processor.image_processor
        self.merge_size = int(image_processor.pooling_kernel_size)  # soft token = pooling² patches
        self.image_token_id = int(self.processor.image_token_id)
        # Dense (E2B, E4B, 31B) or MoE (26B-A4B) per checkpoint, not per family: one model_type covers both
        text_config = self.checkpoint_text_config()
        self.moe = bool(getattr(text_config, "enable_moe_block", False))
        self.top_k_experts = int(text_config.top_k_experts) if self.moe else 0
        smallest = self.smallest_area
        if self.min_pixels > smallest:
            raise ValueError(f"gemma4: min_pixels {self.min_pixels} exceeds the smallest image the processor makes "
                             f"under its {image_processor.max_soft_tokens}-token budget ({smallest} pixels: every "
                             "image is scaled to the budget and its sides rounded down to whole soft tokens); set "
                             f"plugin.min_pixels to at most {smallest}")

    # ------------------------------------------------------------------ loading and sizes
    def load_processor(self) -> Any:
        """``AutoProcessor.from_pretrained`` with ``max_soft_tokens`` set from ``max_pixels`` (module docstring).

        Raises:
            ValueError: ``max_pixels`` below the smallest budget's area.
        """
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(self.model_path)
        image_processor = processor.image_processor
        image_processor.max_soft_tokens = soft_token_budget(self.max_pixels, int(image_processor.patch_size),
                                                            int(image_processor.pooling_kernel_size))
        return processor

    @property
    def max_patches(self) -> int:
        """Patch rows per image as the processor pads them: ``max_soft_tokens · pooling²``."""
        image_processor = self.processor.image_processor
        return int(image_processor.max_soft_tokens) * int(image_processor.pooling_kernel_size) ** 2

    @property
    def smallest_area(self) -> int:
        """The smallest resized area (pixels) the processor gives any image under the adapter's budget
        (:func:`smallest_resized_area`): every image has at least this many, none need have more."""
        image_processor = self.processor.image_processor
        return smallest_resized_area(int(image_processor.max_soft_tokens),
                                     int(image_processor.patch_size) * int(image_processor.pooling_kernel_size))

    def resized_size(self, image_size: Sequence[float]) -> tuple[int, int]:
        """``(width, height)`` the processor resizes an image of ``image_size`` ``(width, height)`` to
        (``get_aspect_ratio_preserving_size`` under the adapter's budget)."""
        from transformers.models.gemma4.image_processing_gemma4 import get_aspect_ratio_preserving_size

        from mmrl.rewards.boxes import checked_size

        width, height = checked_size(image_size, "image_size")
        image_processor = self.processor.image_processor
        new_height, new_width = get_aspect_ratio_preserving_size(
            height=int(height), width=int(width), patch_size=int(image_processor.patch_size),
            max_patches=self.max_patches, pooling_kernel_size=int(image_processor.pooling_kernel_size))
        return int(new_width), int(new_height)

    def load_images(self, images: Sequence[Any], *, use_qwen_vl_utils: bool | None = None) -> list[Any]:
        """Open the images of one prompt as RGB, unresized: Gemma 4's processor scales them to its budget.

        Raises:
            ValueError: ``use_qwen_vl_utils=True`` (a Qwen helper; Gemma 4 does not use it).
        """
        return open_unresized(images, use_qwen_vl_utils=use_qwen_vl_utils,
                              resized_by="Gemma 4 images are resized by Gemma 4's processor")

    # ------------------------------------------------------------------ prompts
    def encode(self, texts: Sequence[str], images: Sequence[Sequence[Any]],
               videos: Sequence[Sequence[Sequence[Any]]] | None = None,
               video_fps: Sequence[Sequence[float]] | None = None, *, video_entries: bool = False
               ) -> list[PromptInputs]:
        """Run the processor once on a batch of prompts and give each prompt its own images' patch rows.

        The batch's ``pixel_values`` and ``image_position_ids`` hold one padded patch set per image in text order,
        and the model fills the ``<|image|>`` tokens with the images' soft tokens in the same order, so prompt i's
        images are the next ``len(images[i])`` of the batch. Each image's soft tokens (its real patches over
        pooling²) are checked against the prompt's ``<|image|>`` count.

        Returns:
            Per prompt ``{"input_ids": [P_i], "mm_token_type_ids": [P_i], "pixel_values": [images_i, max_patches,
            3·patch²], "image_position_ids": [images_i, max_patches, 2]}`` (tokens unpadded).

        Raises:
            ValueError: videos, or image tokens that do not account for the prompt's images.
        """
        if len(texts) != len(images):
            raise ValueError(f"encode: {len(texts)} texts but {len(images)} image lists")
        self.refuse_videos(video_entries or any(group for group in videos or []))
        # Gemma4Processor takes the images nested per text (make_nested_list_of_images) and checks each text's count
        nested = [list(group) for group in images] if any(images) else None
        # One <bos>, the template's, whichever way the tokenizer is set (adds_special_tokens: transformers' rule)
        batch = self.processor(text=list(texts), images=nested, padding=True, padding_side="left",
                               return_tensors="pt", add_special_tokens=self.adds_special_tokens(texts))
        attention = batch["attention_mask"].bool()  # [B, P]
        if nested is not None:
            pixels, positions = batch["pixel_values"], batch["image_position_ids"]  # [Σ images, M, D], [Σ, M, 2]
        else:
            patch = int(self.processor.image_processor.patch_size)
            pixels = torch.zeros(0, self.max_patches, 3 * patch * patch)
            positions = torch.zeros(0, self.max_patches, 2, dtype=torch.long)
        pooling = int(self.processor.image_processor.pooling_kernel_size) ** 2
        tokens_per_image = ((positions != -1).all(-1).sum(-1) // pooling).tolist()  # [Σ images]
        prompts: list[PromptInputs] = []
        start = 0
        for i, group in enumerate(images):
            ids = batch["input_ids"][i][attention[i]]  # [P_i]
            count = len(group)
            expected = int(sum(tokens_per_image[start:start + count]))
            found = int((ids == self.image_token_id).sum())
            if found != expected:
                raise ValueError(f"gemma4: prompt {i} holds {found} image tokens, its {count} images make {expected}")
            prompts.append({"input_ids": ids, "mm_token_type_ids": batch["mm_token_type_ids"][i][attention[i]],
                            "pixel_values": pixels[start:start + count],
                            "image_position_ids": positions[start:start + count]})
            start += count
        return prompts

    def image_features(self, model: nn.Module, prompts: Sequence[PromptInputs]) -> list[PromptInputs]:
        """The prompts with ``pixel_values`` and ``image_position_ids`` replaced by ``image_embeds [tokens_i,
        hidden]``: ``get_image_features`` (vision tower, pooling, ``embed_vision``) on all prompts' images in one
        call, no gradients; valid for every pass of a step while the tower and the embedder are frozen."""
        result = [dict(prompt) for prompt in prompts]
        hf_model = _base_model(model)
        device = next(hf_model.parameters()).device
        holding = [p for p in prompts if p["pixel_values"].shape[0]]
        per_image: list[Tensor] = []
        if holding:
            pixels, positions = pad_patches(holding)  # [Σ images, M, D], [Σ images, M, 2]
            with torch.no_grad():
                output = hf_model.get_image_features(pixel_values=pixels.to(device),
                                                     image_position_ids=positions.to(device), return_dict=True)
            per_image = list(output.pooler_output)  # one [tokens_k, hidden] per image
        for prompt, updated in zip(prompts, result, strict=True):
            updated.pop("pixel_values")
            updated.pop("image_position_ids")
            count = int(prompt["pixel_values"].shape[0])
            taken, per_image = per_image[:count], per_image[count:]
            updated["image_embeds"] = torch.cat(taken) if taken else torch.zeros(0, 0)  # [tokens_i, hidden]
        return result

    # ------------------------------------------------------------------ batching
    def collate(self, prompts: Sequence[PromptInputs], completions: Sequence[Tensor] | None = None,
                device: torch.device | str | None = None) -> tuple[dict[str, Tensor], int]:
        """The base class's token collation (prompts left-padded, completions right-padded, ``mm_token_type_ids``
        0 over completions) with the samples' images concatenated in sample order — the order in which the model
        assigns image features to image tokens: ``pixel_values [Σ images, M, D]`` and ``image_position_ids [Σ
        images, M, 2]`` (re-padded to the widest patch set, :func:`pad_patches`), or, for prompts carrying cached
        features, ``mm_encoder_outputs`` whose ``"image"`` entry's ``pooler_output`` is ``([Σ image tokens,
        hidden],)`` (the model concatenates its entries and scatters them into the image tokens)."""
        inputs, width = super().collate(prompts, completions, device)
        device = inputs["input_ids"].device
        if self.put_cached_image_features(prompts, inputs):
            return inputs, width
        holding = [p for p in prompts if p["pixel_values"].shape[0]]
        if holding:
            pixels, positions = pad_patches(holding)
            inputs["pixel_values"], inputs["image_position_ids"] = pixels.to(device), positions.to(device)
        return inputs, width

    def image_token_count(self, prompt: PromptInputs) -> float:
        """The prompt's ``<|image|>`` tokens (its images' soft tokens)."""
        return float((prompt["input_ids"] == self.image_token_id).sum())

    def router_load_balancing_loss(self, output: Any, attention_mask: Tensor | None) -> Tensor | None:
        """Switch load balancing (:func:`~mmrl.plugins.vlm.adapters.base.switch_load_balancing`) from the output's
        ``router_logits``, one ``[n·L, E]`` per layer that holds the router's softmax probabilities (module
        docstring), over the real tokens of ``attention_mask [n, L]``; None when the output has none. transformers'
        Gemma 4 computes no ``aux_loss`` of its own."""
        probabilities = getattr(output, "router_logits", None)
        if not probabilities:
            return None
        return switch_load_balancing(probabilities, attention_mask, self.top_k_experts)

    # ------------------------------------------------------------------ modules and tokens
    def vision_modules(self, model: nn.Module) -> list[nn.Module]:
        """The vision tower and ``embed_vision`` (the projection into the language model): together they make the
        features the cache keeps."""
        embedder = find_submodule(_base_model(model), self.embedder_attributes, what="gemma4 vision embedder")
        return [self.vision_tower(model), embedder]

    def suppressed_token_ids(self) -> list[int]:
        """The base class's (the :attr:`vision_tokens` in the vocabulary, the processor's image and video ids) and the
        processor's audio placeholder id."""
        ids = set(super().suppressed_token_ids())
        audio = getattr(self.processor, "audio_token_id", None)
        if isinstance(audio, int):
            ids.add(audio)
        return sorted(ids)

    def generation_eos_ids(self, model: nn.Module) -> list[int]:
        """The base class's EOS ids (the checkpoint's generation EOS ids, the tokenizer's ``<eos>``) and the end of
        the turn, ``<turn|>``, which the instruction-tuned checkpoints stop at (transformers'
        ``convert_gemma4_weights.py`` writes ``eos_token_id [1, 106]``) should a generation config lack it."""
        ids = set(super().generation_eos_ids(model))
        end = self.tokenizer.get_vocab().get(self.end_of_turn)
        if end is not None:
            ids.add(int(end))
        return sorted(ids)


def soft_token_budget(max_pixels: int, patch_size: int, pooling_kernel_size: int) -> int:
    """The largest of :data:`SOFT_TOKEN_BUDGETS` whose images fit in ``max_pixels``: a soft token covers
    ``(patch_size · pooling_kernel_size)²`` pixels (2,304 in the released checkpoints: 280 tokens ≈ 645k pixels).

    Raises:
        ValueError: ``max_pixels`` below the smallest budget's area.
    """
    per_token = (patch_size * pooling_kernel_size) ** 2
    fitting = [budget for budget in SOFT_TOKEN_BUDGETS if budget * per_token <= max_pixels]
    if not fitting:
        raise ValueError(f"gemma4: max_pixels {max_pixels} is below the smallest soft-token budget, "
                         f"{SOFT_TOKEN_BUDGETS[0]} tokens of {per_token} pixels; set max_pixels to at least "
                         f"{SOFT_TOKEN_BUDGETS[0] * per_token}")
    return max(fitting)


def smallest_resized_area(tokens: int, side: int) -> int:
    """The smallest area (pixels) ``get_aspect_ratio_preserving_size`` (transformers 5.25
    ``models/gemma4/image_processing_gemma4.py:33-84``) resizes any image to under a budget of ``tokens`` soft
    tokens of ``side × side`` pixels (``side = patch_size · pooling_kernel_size``).

    The function scales an image to the budget's area, ``tokens · side²``, keeping its aspect ratio, then rounds each
    side *down* to a multiple of ``side``. In soft tokens the ideal sides are ``a`` and ``b = tokens / a``; with
    ``a ≥ 1`` and ``b ≥ 1`` the image gets ``⌊a⌋ · ⌊b⌋`` tokens. For ``⌊a⌋ = k`` (``1 ≤ k < tokens``) ``b`` ranges
    over ``(tokens / (k + 1), tokens / k]``, whose smallest floor is ``⌊tokens / (k + 1)⌋``, reached as ``a``
    approaches ``k + 1`` from below. Where ``tokens / (k + 1)`` is a whole number ``m``, an image whose ideal sides are
    exactly ``k + 1`` and ``m`` tokens (e.g. 595 × 34 pixels, width × height, under 70 tokens: 35 and 2) can have
    both computed a rounding error below (``sqrt`` and products in float64), so both floors drop to ``k · (m − 1)``
    tokens, ``k`` fewer than the exact infimum, and the function reaches it (tests/vlm/test_gemma4.py sweeps images
    through it). So the fewest tokens are ``min k · (⌈tokens / (k + 1)⌉ − 1)`` over ``1 ≤ k < tokens − 1`` (for
    ``m = 1`` the dropped side is the next case): about half the budget, at ``k = 1``, an image about ``tokens / 4``
    times as wide as high (or the transpose). A side whose ideal length is below one token
    (``a < 1``: an image more than ``tokens`` times as wide as high) becomes one token and the other
    ``min(⌊aspect⌋, tokens) = tokens``: the whole budget; so does a side computed just below one token.

    Args:
        tokens: The soft-token budget (``max_soft_tokens``).
        side: Pixels per soft token along a side.

    Returns:
        The smallest area in pixels, ``side²`` times the fewest soft tokens.
    """
    # k + 1 < tokens: at k + 1 = tokens the dropped side would be 0 tokens, which the function widens to the budget
    fewest = min([tokens] + [k * (-(-tokens // (k + 1)) - 1) for k in range(1, tokens - 1)])
    return fewest * side * side


def pad_patches(prompts: Sequence[PromptInputs]) -> tuple[Tensor, Tensor]:
    """The prompts' images concatenated in order, each padded to the widest patch set among them: ``(pixel_values
    [Σ images, M, D], image_position_ids [Σ images, M, 2])``. Padding rows are zero at position ``(-1, -1)``, as the
    image processor pads (``pad_along_first_dim``): the tower masks them out and the pooler skips them."""
    width = max(int(p["pixel_values"].shape[1]) for p in prompts)
    pixels, positions = [], []
    for prompt in prompts:
        missing = width - int(prompt["pixel_values"].shape[1])
        pixels.append(nn.functional.pad(prompt["pixel_values"], (0, 0, 0, missing), value=0.0))
        positions.append(nn.functional.pad(prompt["image_position_ids"], (0, 0, 0, missing), value=-1))
    return torch.cat(pixels), torch.cat(positions)


__all__ = ["SOFT_TOKEN_BUDGETS", "Gemma4Adapter", "pad_patches", "smallest_resized_area", "soft_token_budget"]
