"""InternVL (InternVL3, InternVL3.5 and the other "-hf" checkpoints) through transformers'
``InternVLForConditionalGeneration``: a ViT on fixed-size tiles, pixel shuffle and an MLP projector in front of a
Qwen2/Qwen3 language model with plain 1-D rotary positions, or, in InternVL3.5's MoE checkpoints
(InternVL3_5-30B-A3B-HF, -241B-A28B-HF; Wang et al., "InternVL3.5", arXiv:2508.18265), a Qwen3-MoE one.

Registered when the installed transformers has ``transformers.models.internvl``. What differs from the Qwen-VL
conventions of the base class, against transformers 5.25's ``models/internvl/modeling_internvl.py`` and
``processing_internvl.py``, the image processor they use (``models/got_ocr2/image_processing_got_ocr2.py``) and,
for the MoE checkpoints, ``models/qwen3_moe/modeling_qwen3_moe.py``:

- **Images are tiles.** The processor resizes each image to the grid of ``S × S`` tiles (``S`` = the image
  processor's ``size``, 448 in the released checkpoints) whose aspect ratio is closest to the image's, among grids of
  ``min_patches`` to ``max_patches`` tiles (``get_optimal_tiled_canvas``), cuts it into those tiles and, when there
  is more than one, appends a thumbnail of the whole image (``crop_image_to_patches``). ``pixel_values`` is
  ``[tiles, 3, S, S]`` for the whole batch, images in text order; there is no ``image_grid_thw``. An image becomes
  ``<img>`` + ``image_seq_length`` ``<IMG_CONTEXT>`` tokens per tile + ``</img>`` (``replace_image_token``), and the
  model fills the ``<IMG_CONTEXT>`` tokens with the tiles' features in order (``get_placeholder_mask``). A prompt's
  tiles are therefore the next ``<IMG_CONTEXT>`` count / ``image_seq_length`` tiles of the batch (:meth:`encode`).
- **Pixel bounds become tile bounds.** ``plugin.min_pixels`` / ``max_pixels`` bound the tiled canvas's area, so the
  adapter sets ``min_patches = ⌈min_pixels / S²⌉`` and ``max_patches = ⌊max_pixels / S²⌋`` (at least one tile;
  the thumbnail comes on top). :meth:`resized_size` is the canvas, ``(columns·S, rows·S)``. Images reach the
  processor unresized (its tiling reads their own aspect ratio).
- **Plain rotary positions.** The language model numbers positions 0, 1, 2, ... from the first column when none are
  given, so left-padded rows would start past their padding; the adapter passes ``attention_mask.cumsum − 1`` (what
  ``generate`` computes) to every call (:attr:`~VLMAdapter.mrope` false), so a batched row sees the positions it has
  alone.
- **The feature cache** keeps ``get_image_features``'s output (vision tower, pixel shuffle and projector:
  ``[tiles, image_seq_length, hidden]`` per batch, kept per prompt as ``[tiles·image_seq_length, hidden]``), which
  the model takes back through ``mm_encoder_outputs["image"].pooler_output``. Because the projector is part of what
  is cached, ``freeze_vision`` freezes it with the tower (:meth:`vision_modules`) and excludes both from LoRA.
- **Mixture of experts** (InternVL3.5-30B-A3B, -241B-A28B: ``text_config.model_type: qwen3_moe``). One
  ``model_type: internvl`` covers dense and MoE checkpoints, so :attr:`moe` is read per checkpoint from the text
  config's model type (:data:`MOE_TEXT_MODEL_TYPES`). Each sparse layer (``decoder_sparse_step``, less
  ``mlp_only_layers``) holds a router ``mlp.gate`` (``Qwen3MoeTopKRouter``: softmax of its logits in float32, top
  ``num_experts_per_tok``, renormalised when ``norm_topk_prob``) and fused experts ``mlp.experts.gate_up_proj [E, 2·I,
  H]`` and ``mlp.experts.down_proj [E, H, I]`` (parameters, not linear modules: LoRA's default module targets adapt the
  attention projections, and the dense MLPs of any ``mlp_only_layers``; ``lora.target_parameters`` reaches the
  experts). peft's rewrite of MoE module targets (its transformers-v4 mapping) keys on the top config's
  ``model_type``, ``internvl``, which it maps to no MoE pattern, so the defaults pass through unchanged.
- **The router loss through the wrapper.** ``InternVLModel.forward`` hands ``output_router_logits`` on to the language
  model, whose output recording (``_can_record_outputs["router_logits"]``: output 0 of every ``Qwen3MoeTopKRouter``,
  the router logits) fills ``router_logits``; but ``InternVLModelOutputWithPast(**outputs)`` has no such field (a
  ``TypeError``) and ``InternVLForConditionalGeneration`` returns no ``aux_loss``. For a call that asks for them
  (the training pass with ``plugin.router_aux_loss_coef > 0``) the adapter therefore takes the recorded logits out of
  the language model's output and hands them to the wrapper's output as ``router_logits`` (forward hooks held for that
  call only, :meth:`carry_router_logits`), and :meth:`router_load_balancing_loss` computes transformers'
  ``load_balancing_loss_func`` from them over the real tokens of the attention mask (softmax of each layer's logits,
  then :func:`~mmrl.plugins.vlm.adapters.base.switch_load_balancing` with ``num_experts_per_tok``). mmrl differs in
  one rounding: it softmaxes the logits in float32, as the router itself does before its top-k, where
  ``load_balancing_loss_func`` softmaxes them in their own dtype (bfloat16 in a bfloat16 model); the assignments it
  counts are thus the router's. The ``gpt_oss`` language model of InternVL3.5-GPT-OSS-20B-A4B is refused: its
  attention sinks and sliding-window layers are untested in the plugin's decode loop and shared passes.
- **No videos.** InternVL's processor writes a video as ``Frame k: <img>…</img>`` lines of image tokens with its
  frames among the image tiles; the plugin's video bookkeeping (``video_grid_thw``, frame rates, T-GRPO) does not
  describe that, so this family takes image rows only (:attr:`~VLMAdapter.supports_videos` false).
- **Boxes** are ``<ref>label</ref><box>[[x1, y1, x2, y2]]</box>`` on a 0–1000 grid of the image: InternVL's own
  RefCOCO evaluation reads the first ``[[x1,y1,x2,y2]]`` of the answer, divides by 1000 and multiplies by the image's
  width and height (OpenGVLab/InternVL@0355722 ``internvl_chat/eval/refcoco/evaluate_grounding.py``; the chat data
  format of internvl.readthedocs.io, "Grounding Detection Data"). That is the ``qwen2_vl`` convention of
  :mod:`mmrl.rewards.boxes` (x_abs = x / 1000 · W); its parser reads the list inside ``<box>[[…]]</box>`` as a plain
  list, several boxes included.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from mmrl.plugins.vlm.adapters.base import (
    PromptInputs,
    VLMAdapter,
    _base_model,
    find_submodule,
    lifted_router_logits,
    open_unresized,
    switch_load_balancing,
)

MOE_TEXT_MODEL_TYPES = ("qwen3_moe",)
"""Text-config model types of InternVL's mixture-of-experts checkpoints (InternVL3.5-30B-A3B-HF, -241B-A28B-HF)."""
REFUSED_TEXT_MODEL_TYPES = {"gpt_oss": "InternVL3.5-GPT-OSS's gpt_oss language model (attention sinks, sliding-window "
                                       "layers) is untested with the plugin's decode loop and shared passes"}
"""Text-config model types the adapter refuses, and why."""


class InternVLAdapter(VLMAdapter):
    """InternVL3 / InternVL3.5 (``-hf`` checkpoints, ``model_type: internvl``) through
    ``transformers.InternVLForConditionalGeneration`` (see the module docstring)."""

    name = "internvl"
    model_types = ("internvl",)
    model_class = "InternVLForConditionalGeneration"
    box_convention = "qwen2_vl"
    vision_attributes: ClassVar[tuple[str, ...]] = ("model.vision_tower",)
    projector_attributes: ClassVar[tuple[str, ...]] = ("model.multi_modal_projector",)
    # The ViT's attention names its projections q_proj/k_proj/v_proj like the language model's: the pattern keeps
    # LoRA off the tower and the projector (linear_1/linear_2).
    vision_module_pattern: ClassVar[str] = r".*(^|\.)(vision_tower|multi_modal_projector)(\.|$).*"
    vision_tokens: ClassVar[tuple[str, ...]] = ("<img>", "</img>", "<IMG_CONTEXT>", "<video>")
    supports_videos = False
    video_refusal = "its processor writes frames as image tiles the plugin does not track"
    mrope = False

    def __init__(self, model: str, *, min_pixels: int, max_pixels: int, video_min_pixels: int | None = None,
                 video_max_pixels: int | None = None, video_total_pixels: float | None = None):
        super().__init__(model, min_pixels=min_pixels, max_pixels=max_pixels, video_min_pixels=video_min_pixels,
                         video_max_pixels=video_max_pixels, video_total_pixels=video_total_pixels)
        self.image_seq_length = int(self.processor.image_seq_length)
        self.image_token_id = int(self.processor.image_token_id)
        # Dense (Qwen2/Qwen3) or MoE (Qwen3-MoE) per checkpoint, not per family: one model_type covers both
        text_config = self.checkpoint_text_config()
        text_type = str(getattr(text_config, "model_type", ""))
        if text_type in REFUSED_TEXT_MODEL_TYPES:
            raise ValueError(f"internvl: {REFUSED_TEXT_MODEL_TYPES[text_type]}; use a Qwen2/Qwen3/Qwen3-MoE checkpoint")
        self.moe = text_type in MOE_TEXT_MODEL_TYPES
        self.num_experts_per_tok = int(text_config.num_experts_per_tok) if self.moe else 0

    # ------------------------------------------------------------------ loading and sizes
    def load_processor(self) -> Any:
        """``AutoProcessor.from_pretrained`` with the tile bounds set from [min_pixels, max_pixels] (module
        docstring)."""
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(self.model_path)
        image_processor = processor.image_processor
        tile = self._tile_size(image_processor)
        area = tile[0] * tile[1]
        image_processor.max_patches = max(1, self.max_pixels // area)
        image_processor.min_patches = min(image_processor.max_patches, max(1, math.ceil(self.min_pixels / area)))
        return processor

    @staticmethod
    def _tile_size(image_processor: Any) -> tuple[int, int]:
        """``(height, width)`` of one tile: the image processor's ``size`` (a ``SizeDict`` or a dict)."""
        size = image_processor.size
        height = size.get("height") if isinstance(size, dict) else getattr(size, "height", None)
        width = size.get("width") if isinstance(size, dict) else getattr(size, "width", None)
        if not height or not width:
            raise ValueError(f"internvl: the image processor's size {size!r} has no tile height and width")
        return int(height), int(width)

    def tile_grid(self, image_size: Sequence[float]) -> tuple[int, int]:
        """``(columns, rows)`` of tiles the processor cuts an image of ``image_size`` ``(width, height)`` into
        (transformers' ``get_optimal_tiled_canvas`` within the adapter's tile bounds; a thumbnail is added when
        there is more than one tile)."""
        from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas

        from mmrl.rewards.boxes import checked_size

        width, height = checked_size(image_size, "image_size")
        image_processor = self.processor.image_processor
        columns, rows = get_optimal_tiled_canvas((int(height), int(width)), self._tile_size(image_processor),
                                                 int(image_processor.min_patches), int(image_processor.max_patches))
        return int(columns), int(rows)

    def tiles_per_image(self, image_size: Sequence[float]) -> int:
        """How many tiles (the thumbnail included) the processor makes of an image of ``image_size``."""
        columns, rows = self.tile_grid(image_size)
        return columns * rows + (1 if columns * rows > 1 else 0)

    def resized_size(self, image_size: Sequence[float]) -> tuple[int, int]:
        """``(width, height)`` of the tiled canvas the processor resizes an image of ``image_size`` to before cutting
        it into tiles: ``(columns·S, rows·S)``."""
        columns, rows = self.tile_grid(image_size)
        tile_height, tile_width = self._tile_size(self.processor.image_processor)
        return columns * tile_width, rows * tile_height

    def load_images(self, images: Sequence[Any], *, use_qwen_vl_utils: bool | None = None) -> list[Any]:
        """Open the images of one prompt as RGB, unresized: InternVL's processor tiles them from their own size.

        Raises:
            ValueError: ``use_qwen_vl_utils=True`` (a Qwen helper; InternVL does not use it).
        """
        return open_unresized(images, use_qwen_vl_utils=use_qwen_vl_utils,
                              resized_by="InternVL images are tiled by InternVL's processor")

    # ------------------------------------------------------------------ prompts
    def encode(self, texts: Sequence[str], images: Sequence[Sequence[Any]],
               videos: Sequence[Sequence[Sequence[Any]]] | None = None,
               video_fps: Sequence[Sequence[float]] | None = None, *, video_entries: bool = False
               ) -> list[PromptInputs]:
        """Run the processor once on a batch of prompts and give each prompt its own tiles.

        The batch's ``pixel_values`` hold every image's tiles in text order (the processor concatenates them in the
        order its image placeholders appear in the texts), and the model fills the ``<IMG_CONTEXT>`` tokens with the
        tiles' features in the same order, ``image_seq_length`` per tile. Prompt i's tiles are thus the next
        (its ``<IMG_CONTEXT>`` count) / ``image_seq_length`` tiles, however many the dynamic tiling gave each of its
        images.

        Returns:
            Per prompt ``{"input_ids": [P_i], "pixel_values": [tiles_i, 3, S, S]}`` (no padding).

        Raises:
            ValueError: videos, or a processor output whose image tokens do not account for its tiles.
        """
        if len(texts) != len(images):
            raise ValueError(f"encode: {len(texts)} texts but {len(images)} image lists")
        self.refuse_videos(video_entries or any(group for group in videos or []))
        flat = [image for group in images for image in group]
        batch = self.processor(text=list(texts), images=flat or None, padding=True, padding_side="left",
                               return_tensors="pt", add_special_tokens=self.adds_special_tokens(texts))
        attention = batch["attention_mask"].bool()  # [B, P]
        tile_height, tile_width = self._tile_size(self.processor.image_processor)
        pixels = batch["pixel_values"] if flat else torch.zeros(0, 3, tile_height, tile_width)  # [Σ tiles, 3, S, S]
        prompts: list[PromptInputs] = []
        start = 0
        for i in range(len(texts)):
            ids = batch["input_ids"][i][attention[i]]  # [P_i]
            tokens = int((ids == self.image_token_id).sum())
            tiles, rest = divmod(tokens, self.image_seq_length)
            if rest:
                raise ValueError(f"internvl: prompt {i} holds {tokens} image tokens, not a multiple of "
                                 f"image_seq_length {self.image_seq_length}")
            prompts.append({"input_ids": ids, "pixel_values": pixels[start:start + tiles]})
            start += tiles
        if start != pixels.shape[0]:
            raise ValueError(f"internvl: the prompts' image tokens describe {start} tiles, the processor made "
                             f"{pixels.shape[0]}")
        return prompts

    def image_features(self, model: nn.Module, prompts: Sequence[PromptInputs]) -> list[PromptInputs]:
        """The prompts with ``pixel_values`` replaced by ``image_embeds`` ``[tiles_i·image_seq_length, hidden]``:
        ``get_image_features`` (vision tower, pixel shuffle, projector) on all prompts' tiles in one call, no
        gradients; valid for every pass of a step while the tower and projector are frozen."""
        result = [dict(prompt) for prompt in prompts]
        hf_model = _base_model(model)
        device = next(hf_model.parameters()).device
        holding = [p["pixel_values"] for p in prompts if p["pixel_values"].numel()]
        features = None
        if holding:
            with torch.no_grad():
                output = hf_model.get_image_features(pixel_values=torch.cat(holding).to(device), return_dict=True)
            features = output.pooler_output  # [Σ tiles, image_seq_length, hidden]
        start = 0
        for updated in result:
            tiles = int(updated.pop("pixel_values").shape[0])
            if tiles and features is not None:
                updated["image_embeds"] = features[start:start + tiles].flatten(0, 1)  # [tiles·seq, hidden]
            else:
                updated["image_embeds"] = torch.zeros(0, 0)
            start += tiles
        return result

    # ------------------------------------------------------------------ batching
    def collate(self, prompts: Sequence[PromptInputs], completions: Sequence[Tensor] | None = None,
                device: torch.device | str | None = None) -> tuple[dict[str, Tensor], int]:
        """The base class's token collation (prompts left-padded, completions right-padded) with the samples' tiles
        concatenated in sample order, ``pixel_values [Σ tiles, 3, S, S]`` — the order in which the model assigns
        tile features to image tokens — or, for prompts carrying cached features, ``mm_encoder_outputs`` whose
        ``"image"`` entry's ``pooler_output`` is ``[Σ image tokens, hidden]`` (the model scatters it into the image
        tokens as it scatters its own ``[tiles, image_seq_length, hidden]``)."""
        inputs, width = super().collate(prompts, completions, device)
        device = inputs["input_ids"].device
        if self.put_cached_image_features(prompts, inputs):
            return inputs, width
        tiles = [p["pixel_values"].to(device) for p in prompts if p["pixel_values"].numel()]
        if tiles:
            inputs["pixel_values"] = torch.cat(tiles)  # [Σ tiles, 3, S, S]
        return inputs, width

    def image_token_count(self, prompt: PromptInputs) -> float:
        """The prompt's ``<IMG_CONTEXT>`` tokens (tiles × ``image_seq_length``)."""
        return float((prompt["input_ids"] == self.image_token_id).sum())

    # ------------------------------------------------------------------ mixture of experts
    def completion_logits(self, model: nn.Module, inputs: dict[str, Tensor], num_completion: int) -> Tensor:
        """The base class's, with the router logits carried to the output when ``inputs`` asks for them
        (:meth:`carry_router_logits`)."""
        with self.carry_router_logits(model, inputs) as carried:
            return super().completion_logits(model, carried, num_completion)

    def completion_hidden(self, model: nn.Module, inputs: dict[str, Tensor], num_completion: int
                          ) -> tuple[Tensor, nn.Module]:
        """The base class's, with the router logits carried to the output when ``inputs`` asks for them
        (:meth:`carry_router_logits`)."""
        with self.carry_router_logits(model, inputs) as carried:
            return super().completion_hidden(model, carried, num_completion)

    @contextmanager
    def carry_router_logits(self, model: nn.Module, inputs: dict[str, Tensor]) -> Iterator[dict[str, Tensor]]:
        """For the duration, a forward of ``model`` called with ``output_router_logits=True`` returns the language
        model's router logits as its output's ``router_logits`` (one ``[n·L, E]`` per sparse layer) instead of
        failing on them (module docstring); yields ``inputs``. A no-op for other calls and dense checkpoints.

        ``InternVLModel`` passes the flag on to the language model, which records the logits itself (transformers'
        ``capture_outputs``, as ``Qwen3MoeForCausalLM`` gets them); one forward hook takes them out of the language
        model's output before ``InternVLModelOutputWithPast`` is built from it, another, put before any other hook on
        the outer model (:class:`~mmrl.plugins.vlm.adapters.base.RouterAuxLoss`'s), sets them on the wrapper's
        output. The hooks are removed on exit, so a backward that recomputes checkpointed layers records nothing."""
        if not (self.moe and inputs.get("output_router_logits")):
            yield inputs
            return
        with lifted_router_logits(model, what="internvl language model"):
            yield inputs

    def router_load_balancing_loss(self, output: Any, attention_mask: Tensor | None) -> Tensor | None:
        """transformers' ``load_balancing_loss_func`` (``modeling_qwen3_moe.py``) from the output's ``router_logits``
        (:meth:`carry_router_logits`) over the real tokens of ``attention_mask [n, L]``: each layer's logits
        softmaxed (in float32, as the router does) and :func:`~mmrl.plugins.vlm.adapters.base.switch_load_balancing`
        with ``num_experts_per_tok``. None when the output has none."""
        logits = getattr(output, "router_logits", None)
        if not logits:
            return None
        probabilities = [torch.softmax(layer.float(), dim=-1) for layer in logits]  # [n·L, E] per sparse layer
        return switch_load_balancing(probabilities, attention_mask, self.num_experts_per_tok)

    # ------------------------------------------------------------------ modules
    def vision_modules(self, model: nn.Module) -> list[nn.Module]:
        """The vision tower and the projector (pixel shuffle has no weights): together they make the features the
        cache keeps."""
        projector = find_submodule(_base_model(model), self.projector_attributes, what="internvl projector")
        return [self.vision_tower(model), projector]


__all__ = ["MOE_TEXT_MODEL_TYPES", "REFUSED_TEXT_MODEL_TYPES", "InternVLAdapter"]
