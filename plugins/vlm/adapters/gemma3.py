"""Gemma 3 (4B, 12B, 27B) through transformers' ``Gemma3ForConditionalGeneration``: a SigLIP tower on a fixed square
image whose patch features a projector average-pools into a fixed number of soft tokens (256 in the released
checkpoints) and projects into a language model with sliding-window and full-attention layers and plain 1-D rotary
positions.

Registered when the installed transformers has ``transformers.models.gemma3``. What differs from the Qwen-VL
conventions of the base class, against transformers 5.25's ``models/gemma3/modeling_gemma3.py``,
``processing_gemma3.py`` and ``image_processing_gemma3.py`` (line numbers of that release):

- **Fixed-size images, no pixel bounds.** The image processor resizes every image to the tower's square
  (``size``: 896 × 896 in the released ``preprocessor_config.json``, aspect ratio not kept) and the projector pools
  its 64 × 64 patches into ``mm_tokens_per_image`` soft tokens (``Gemma3MultiModalProjector``), so an image is always
  ``\\n\\n<start_of_image>`` + 256 ``<image_soft_token>`` + ``<end_of_image>\\n\\n`` (``processing_gemma3.py:49``) and
  ``pixel_values`` is ``[images, 3, 896, 896]`` with no grid. The tower's position embeddings fix that size, so no
  pixel bound can be honoured: the plugin refuses a ``plugin.min_pixels`` or ``plugin.max_pixels`` other than the
  config's default at start-up (:attr:`unused_pixel_bounds`, :meth:`pixel_bounds_refusal`) rather than ignore it, and
  :meth:`resized_size` is the processor's square.
- **Pan-and-scan** (Gemma 3's optional crops of a long image, each resized to the square and written after the
  image as its own soft-token block: ``replace_image_token``, ``processing_gemma3.py:154``) follows the checkpoint's
  image-processor config (``do_pan_and_scan`` and the ``pan_and_scan_*`` settings of its ``preprocessor_config.json``
  or ``processor_config.json``; unset, so off, in the released ones). transformers' ``Gemma3Processor`` passes its
  own defaults (``do_pan_and_scan: False``, ``images_kwargs``, ``processing_gemma3.py:26-33``) over the image
  processor's attributes, so the adapter passes the checkpoint's settings at every call. Each prompt keeps the
  ``pixel_values`` rows of its soft-token blocks (an image, then its crops), counted from its ``<image_soft_token>``
  ids (``mm_tokens_per_image`` per row), so prompts of one batch may hold different numbers of rows and tokens.
- **Bidirectional attention inside images.** ``token_type_ids`` (1 on soft tokens) make the tokens of one image
  block attend to each other both ways on every layer (``get_block_sequence_ids_for_mask`` and
  ``create_masks_for_vision_model``, ``modeling_gemma3.py:671-744``, used by ``Gemma3Model.forward`` at ``:875``);
  without them the model is causal throughout. The processor writes them under the name ``mm_token_type_ids`` and
  renames them ``token_type_ids`` (``processing_gemma3.py:71``): prompts keep the plugin's key
  ``mm_token_type_ids`` (replayed, and read by the shared prompt forward's checks), and :meth:`collate` hands them to
  the model as ``token_type_ids`` (0 over completions and padding) in every pass that runs a prompt: the
  teacher-forced pass, the decode loop's prefill, the shared prompt forward's prompt pass, and transformers'
  ``generate``. A prompt ends in text (the opened model turn; the processor also writes ``<end_of_image>`` and a
  blank line after every block), so its image blocks end inside it: its states depend on the prompt alone, and the
  completion tokens, text, attend causally. The passes that continue a prompt's cache (decode steps, the shared
  forward's completions) run without token types, which is causal attention, as transformers' own
  ``prepare_inputs_for_generation`` drops them after the first step (``:1015-1026``).
- **Plain rotary positions.** Without position ids the language model numbers positions from the first column,
  padding included (``Gemma3TextModel.forward``), so the adapter (``mrope`` false) passes each left-padded row's
  positions from its padding mask, as ``generate`` does.
- **No logit soft-capping.** Gemma 3 replaced Gemma 2's soft-capping by QK-norm: the released configs leave
  ``final_logit_softcapping`` unset (``Gemma3TextConfig``'s default is null), and
  ``Gemma3ForConditionalGeneration.forward`` does not apply it even when set (``:997``; only the text-only
  ``Gemma3ForCausalLM`` does, ``:616-620``). The plugin's fused head and decode steps apply a configured cap
  themselves (:func:`~mmrl.plugins.vlm.adapters.base.logit_softcap`), which would then score another distribution
  than the model's ``logits`` (at ratio 1, so nothing else would show it): a checkpoint whose text config sets one
  is refused in one line, naming the fix (set it to null: the model's outputs do not change).
- **The feature cache** keeps ``get_image_features``'s ``pooler_output`` (tower and projector, ``:762-769``: one
  ``[mm_tokens_per_image, hidden]`` per row, kept per prompt as ``[tokens_i, hidden]``), which the model takes back
  through ``mm_encoder_outputs["image"].pooler_output`` and scatters into the soft tokens (``:855-863``). Since the
  projector is inside what is cached, ``freeze_vision`` freezes ``multi_modal_projector`` with the tower
  (:meth:`vision_modules`) and LoRA keeps off both (the tower's attention names its projections ``q_proj`` /
  ``k_proj`` / ``v_proj``, like the language model's).
- **The chat.** ``<bos><start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n``; Gemma 3 has no system
  role, and its template writes a system message's text and a blank line at the start of the first user turn. The
  template writes ``<bos>`` and Gemma 3's tokenizer adds one to every text it encodes (``add_bos_token``), so
  :meth:`encode` tokenizes a rendered chat without special tokens, as transformers' ``apply_chat_template`` does
  (``processing_utils.py:2515-2517``; the rule every family's ``encode`` shares,
  :meth:`~mmrl.plugins.vlm.adapters.base.VLMAdapter.adds_special_tokens`); a plain processor call would start every
  prompt with two. A
  completion ends at ``<end_of_turn>`` or ``<eos>`` (the released ``generation_config.json``: ``eos_token_id [1,
  106]``).
- **No videos.** Gemma 3's processor takes images only; video rows are refused.
- **Boxes** in pixels of the image the model sees. Google documents no grounding output format for Gemma 3
  (PaliGemma's ``<locXXXX>`` tokens are not part of its documented use), and the model sees every image as the
  tower's square, without its original size, which a prompt template cannot state (it has ``{question}`` only). So
  the family declares the ``qwen2_5_vl`` convention: boxes in pixels of the resized model input, here the 896 × 896
  square (a row's ``resized_size``, :meth:`resized_size`), scaled back to the original image by its width and
  height; prompt the model for JSON ``bbox_2d`` on that square. With pan-and-scan the frame is still the whole
  image's square, not a crop's.
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
    cache_argument,
    find_submodule,
    open_unresized,
    select_cache_rows,
)

PAN_AND_SCAN_SETTINGS = ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                         "pan_and_scan_min_ratio_to_activate")
"""The image-processor settings of pan-and-scan (``Gemma3ImageProcessorKwargs``, transformers 5.25
``image_processing_gemma3.py``) that the adapter passes to every processor call when the checkpoint sets them."""


class Gemma3Adapter(VLMAdapter):
    """Gemma 3 (``model_type: gemma3``) through ``transformers.Gemma3ForConditionalGeneration`` (see the module
    docstring)."""

    name = "gemma3"
    model_types = ("gemma3",)
    model_class = "Gemma3ForConditionalGeneration"
    box_convention = "qwen2_5_vl"  # pixels of the 896 × 896 input square (module docstring)
    vision_attributes: ClassVar[tuple[str, ...]] = ("model.vision_tower",)
    projector_attributes: ClassVar[tuple[str, ...]] = ("model.multi_modal_projector",)
    # The tower's attention names its projections like the language model's: the pattern keeps LoRA off the tower and
    # the projector whose output the feature cache keeps.
    vision_module_pattern: ClassVar[str] = r".*(^|\.)(vision_tower|multi_modal_projector)(\.|$).*"
    # The soft-token placeholder the model fills with features (a sampled one would be taken for an image slot when
    # fed back) and the image delimiters.
    vision_tokens: ClassVar[tuple[str, ...]] = ("<image_soft_token>", "<start_of_image>", "<end_of_image>")
    end_of_turn: ClassVar[str] = "<end_of_turn>"
    supports_videos = False
    video_refusal = "Gemma 3's processor takes images only"
    mrope = False
    #: The plugin's pixel bounds this family cannot honour: every image becomes the tower's square (module docstring).
    #: The plugin refuses a value other than the config's default for each (:meth:`pixel_bounds_refusal`).
    unused_pixel_bounds: ClassVar[tuple[str, ...]] = ("min_pixels", "max_pixels")

    def __init__(self, model: str, *, min_pixels: int, max_pixels: int, video_min_pixels: int | None = None,
                 video_max_pixels: int | None = None, video_total_pixels: float | None = None):
        super().__init__(model, min_pixels=min_pixels, max_pixels=max_pixels, video_min_pixels=video_min_pixels,
                         video_max_pixels=video_max_pixels, video_total_pixels=video_total_pixels)
        cap = getattr(self.checkpoint_text_config(), "final_logit_softcapping", None)
        if cap is not None:
            raise ValueError(f"gemma3: {self.model_path} sets text_config.final_logit_softcapping {cap}, which "
                             "Gemma3ForConditionalGeneration does not apply but the plugin's fused head would; set it "
                             "to null (the released Gemma 3 checkpoints have none)")
        # The checkpoint's pan-and-scan settings, which Gemma3Processor's own defaults would override (module docstring)
        image_processor = self.processor.image_processor
        self.pan_and_scan = {key: getattr(image_processor, key) for key in PAN_AND_SCAN_SETTINGS
                             if getattr(image_processor, key, None) is not None}
        # Gemma3Processor.image_token_id is the <start_of_image> id; the model fills the tokenizer's soft tokens
        self.image_token_id = int(self.tokenizer.image_token_id)
        self.tokens_per_image = int(self.processor.image_seq_length)

    # ------------------------------------------------------------------ loading, sizes and images
    def load_processor(self) -> Any:
        """``AutoProcessor.from_pretrained`` as the checkpoint ships it: the image size is the tower's (the base
        class's pixel bounds would replace it with a ``shortest_edge`` / ``longest_edge`` range the tower cannot
        take)."""
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(self.model_path)

    def resized_size(self, image_size: Sequence[float]) -> tuple[int, int]:
        """``(width, height)`` the processor resizes any image to: the tower's square (``image_processor.size``),
        whatever ``image_size`` and the pixel bounds."""
        from mmrl.rewards.boxes import checked_size

        checked_size(image_size, "image_size")
        size = self.processor.image_processor.size
        return int(size["width"]), int(size["height"])

    def pixel_bounds_refusal(self) -> str:
        """Why :attr:`unused_pixel_bounds` cannot be honoured, for the plugin's one-line refusal."""
        width, height = self.resized_size((1, 1))
        return (f"gemma3 resizes every image to the checkpoint's square ({width} x {height}; the tower's position "
                "embeddings fix it), so no pixel bound can be honoured")

    def load_images(self, images: Sequence[Any], *, use_qwen_vl_utils: bool | None = None) -> list[Any]:
        """Open the images of one prompt as RGB, unresized: Gemma 3's processor resizes them (and cuts pan-and-scan
        crops from the original).

        Raises:
            ValueError: ``use_qwen_vl_utils=True`` (a Qwen helper; Gemma 3 does not use it).
        """
        return open_unresized(images, use_qwen_vl_utils=use_qwen_vl_utils,
                              resized_by="Gemma 3 images are resized by Gemma 3's processor")

    # ------------------------------------------------------------------ prompts
    def encode(self, texts: Sequence[str], images: Sequence[Sequence[Any]],
               videos: Sequence[Sequence[Sequence[Any]]] | None = None,
               video_fps: Sequence[Sequence[float]] | None = None, *, video_entries: bool = False
               ) -> list[PromptInputs]:
        """Run the processor once on a batch of prompts and give each prompt its own images' rows.

        The batch's ``pixel_values`` hold one row per soft-token block in text order (an image, then its
        pan-and-scan crops if any), and the model fills the soft tokens with the rows' features in the same order,
        so prompt i owns the next ``soft tokens_i / mm_tokens_per_image`` rows.

        Returns:
            Per prompt ``{"input_ids": [P_i], "mm_token_type_ids": [P_i], "pixel_values": [rows_i, 3, S, S]}``
            (tokens unpadded; the processor's ``token_type_ids`` kept under the plugin's key).

        Raises:
            ValueError: videos, soft tokens that do not fill whole images, or rows that do not match the batch's.
        """
        if len(texts) != len(images):
            raise ValueError(f"encode: {len(texts)} texts but {len(images)} image lists")
        self.refuse_videos(video_entries or any(group for group in videos or []))
        # Gemma3Processor takes the images nested per text (make_nested_list_of_images) and checks each text's count
        nested = [list(group) for group in images] if any(images) else None
        # The chat template writes <bos> and Gemma 3's tokenizer adds one to every text (add_bos_token): a rendered chat
        # is tokenized without special tokens, transformers' own rule (adds_special_tokens)
        batch = self.processor(text=list(texts), images=nested, padding=True, padding_side="left",
                               return_tensors="pt", add_special_tokens=self.adds_special_tokens(texts),
                               **self.pan_and_scan)
        attention = batch["attention_mask"].bool()  # [B, P]
        if nested is not None:
            pixels = batch["pixel_values"]  # [Σ rows, 3, S, S]
        else:
            size = self.processor.image_processor.size
            pixels = torch.zeros(0, 3, int(size["height"]), int(size["width"]))
        prompts: list[PromptInputs] = []
        start = 0
        for i in range(len(texts)):
            ids = batch["input_ids"][i][attention[i]]  # [P_i]
            types = batch["token_type_ids"][i][attention[i]]  # [P_i]
            soft = int((ids == self.image_token_id).sum())
            rows, rest = divmod(soft, self.tokens_per_image)
            if rest:
                raise ValueError(f"gemma3: prompt {i} holds {soft} image soft tokens, not a multiple of "
                                 f"{self.tokens_per_image} per image")
            prompts.append({"input_ids": ids, "mm_token_type_ids": types, "pixel_values": pixels[start:start + rows]})
            start += rows
        if start != pixels.shape[0]:
            raise ValueError(f"gemma3: the prompts' soft tokens make {start} images, the processor gave "
                             f"{pixels.shape[0]}")
        return prompts

    def image_features(self, model: nn.Module, prompts: Sequence[PromptInputs]) -> list[PromptInputs]:
        """The prompts with ``pixel_values`` replaced by ``image_embeds [tokens_i, hidden]``: ``get_image_features``
        (SigLIP tower and projector) on all prompts' rows in one call, no gradients; valid for every pass of a step
        while the tower and the projector are frozen."""
        result = [dict(prompt) for prompt in prompts]
        hf_model = _base_model(model)
        device = next(hf_model.parameters()).device
        holding = [p["pixel_values"] for p in prompts if p["pixel_values"].shape[0]]
        features = torch.zeros(0, self.tokens_per_image, 0)
        if holding:
            with torch.no_grad():
                output = hf_model.get_image_features(pixel_values=torch.cat(holding).to(device), return_dict=True)
            features = output.pooler_output  # [Σ rows, tokens_per_image, hidden]
        start = 0
        for updated in result:
            count = int(updated.pop("pixel_values").shape[0])
            taken = features[start:start + count]  # [rows_i, tokens_per_image, hidden]
            updated["image_embeds"] = taken.reshape(-1, taken.shape[-1]) if count else torch.zeros(0, 0)
            start += count
        return result

    # ------------------------------------------------------------------ batching
    def collate(self, prompts: Sequence[PromptInputs], completions: Sequence[Tensor] | None = None,
                device: torch.device | str | None = None) -> tuple[dict[str, Tensor], int]:
        """The base class's token collation (prompts left-padded, completions right-padded) with the token types
        handed over as the model's ``token_type_ids [n, P + C]`` (0 over padding and completions: the image blocks'
        bidirectional mask) and the samples' rows concatenated in sample order, the order in which the model assigns
        features to soft tokens: ``pixel_values [Σ rows, 3, S, S]`` or, for prompts carrying cached features,
        ``mm_encoder_outputs`` whose ``"image"`` entry's ``pooler_output`` is ``[Σ soft tokens, hidden]`` (the model
        scatters its elements into the soft tokens' embeddings in order).

        Raises:
            ValueError: a batch that mixes prompts with cached features and prompts with pixels, or prompts without
                token types.
        """
        if not all("mm_token_type_ids" in p for p in prompts):
            raise ValueError("gemma3: every prompt needs its token types (mm_token_type_ids), which make the image "
                             "tokens attend bidirectionally; encode prompts with this adapter")
        inputs, width = super().collate(prompts, completions, device)
        inputs["token_type_ids"] = inputs.pop("mm_token_type_ids")  # [n, P + C]
        device = inputs["input_ids"].device
        if self.put_cached_image_features(prompts, inputs):
            return inputs, width
        holding = [p["pixel_values"].to(device) for p in prompts if p["pixel_values"].shape[0]]
        if holding:
            inputs["pixel_values"] = torch.cat(holding)  # [Σ rows, 3, S, S]
        return inputs, width

    def generate(self, model: nn.Module, prompts: Sequence[PromptInputs], generation_config: Any, *,
                 share_prefill: bool = True, device: torch.device | str | None = None, decoder: str = "mmrl",
                 output_scores: bool = False) -> tuple[Any, int]:
        """The base class's :meth:`~mmrl.plugins.vlm.adapters.base.VLMAdapter.generate`; with ``decoder: hf`` and
        repeated prompts the shared prefill is done here, since the token types travel as ``token_type_ids`` (the
        base class trims ``mm_token_type_ids`` with the prompts' last column): each distinct prompt but its last
        token runs once with its token types, its cache is copied to its samples, and ``generate`` continues from
        the last prompt token with the whole prompts' token types, which transformers' Gemma 3 reads on its first
        step only (``prepare_inputs_for_generation``)."""
        from mmrl.plugins.vlm.decode import check_decoder

        unique = list({id(p): p for p in prompts}.values())
        if (check_decoder(decoder) == "mmrl" or not share_prefill or not self.supports_shared_prefill
                or len(unique) == len(prompts)):
            return super().generate(model, prompts, generation_config, share_prefill=share_prefill, device=device,
                                    decoder=decoder, output_scores=output_scores)
        inputs, width = self.collate(prompts, device=device)
        unique_inputs, _ = self.collate(unique, device=inputs["input_ids"].device)
        per_token = ("input_ids", "attention_mask", "token_type_ids")
        prefix = {key: value[:, :-1] if key in per_token else value for key, value in unique_inputs.items()}
        positions = self.rope_positions(model, prefix)  # [u, P - 1]
        output = model(**prefix, position_ids=positions, use_cache=True, logits_to_keep=1)  # only the cache is used
        cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
        slots = {id(p): k for k, p in enumerate(unique)}
        select_cache_rows(cache, torch.tensor([slots[id(p)] for p in prompts], device=inputs["input_ids"].device))
        rest = {key: value for key, value in inputs.items() if key not in ("pixel_values", "mm_encoder_outputs")}
        name = cache_argument(_base_model(model))
        return model.generate(**rest, **{name: cache}, generation_config=generation_config), width

    def image_token_count(self, prompt: PromptInputs) -> float:
        """The prompt's ``<image_soft_token>`` tokens (``mm_tokens_per_image`` per image and pan-and-scan crop)."""
        return float((prompt["input_ids"] == self.image_token_id).sum())

    # ------------------------------------------------------------------ modules and tokens
    def vision_modules(self, model: nn.Module) -> list[nn.Module]:
        """The SigLIP tower and ``multi_modal_projector`` (pooling, norm and projection into the language model):
        together they make the features the cache keeps."""
        projector = find_submodule(_base_model(model), self.projector_attributes, what="gemma3 multi-modal projector")
        return [self.vision_tower(model), projector]

    def generation_eos_ids(self, model: nn.Module) -> list[int]:
        """The base class's EOS ids (the checkpoint's generation EOS ids, the tokenizer's ``<eos>``) and the end of
        the turn, ``<end_of_turn>``, which the instruction-tuned checkpoints stop at (google/gemma-3-4b-it
        ``generation_config.json``: ``eos_token_id [1, 106]``) should a generation config lack it."""
        ids = set(super().generation_eos_ids(model))
        end = self.tokenizer.get_vocab().get(self.end_of_turn)
        if end is not None:
            ids.add(int(end))
        return sorted(ids)


__all__ = ["PAN_AND_SCAN_SETTINGS", "Gemma3Adapter"]
