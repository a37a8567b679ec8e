"""Mistral 3 (Mistral-Small-3.1/3.2-24B-Instruct, Ministral-3 3B/8B/14B, Magistral-Small-1.2) through transformers'
``Mistral3ForConditionalGeneration``: a Pixtral vision tower with 2-D rotary positions on images kept at (about) their
own aspect ratio, a projector that merges 2 × 2 patches into one token, and a Mistral (Mistral Small, Magistral) or
Ministral 3 language model with plain 1-D rotary positions.

Registered when the installed transformers has ``transformers.models.mistral3``. What differs from the Qwen-VL
conventions of the base class, against transformers 5.25's ``models/mistral3/modeling_mistral3.py``,
``models/pixtral/processing_pixtral.py``, ``image_processing_pixtral.py``, ``modeling_pixtral.py`` and
``models/ministral3/modeling_ministral3.py`` (line numbers of that release):

- **Images of their own size, one edge bound.** Pixtral's image processor shrinks an image whose longest side
  exceeds ``size["longest_edge"]`` (aspect ratio kept, sides floored) and rounds both sides *up* to multiples of
  patch × merge (``get_resize_output_image_size``, ``image_processing_pixtral.py:49-86``; the processor passes
  patch × merge as the patch, ``processing_pixtral.py:87-89``), resizing the image to that size: beyond that rounding
  (less than one cell a side) it never enlarges one. The plugin's bounds are areas, so the adapter maps
  ``max_pixels`` to the largest ``longest_edge`` that is a multiple of patch × merge and whose square is at most
  ``max_pixels``, capped at the checkpoint's own ``longest_edge`` (1540 in Mistral Small 3.1's
  ``preprocessor_config.json``, the tower's ``image_size``, which bounds its rotary table): every image then has at
  most ``max_pixels`` pixels, and sides up to that edge (:meth:`longest_edge_for`). ``min_pixels`` cannot be
  honoured: Pixtral does not enlarge an image beyond the rounding up to whole cells (the processor has no lower
  bound), so the plugin refuses a ``plugin.min_pixels`` other than the config's default at start-up
  (:attr:`unused_pixel_bounds`) rather than ignore it. :meth:`resized_size` is the processor's size; images reach
  the processor unresized.
- **An image is rows of tokens.** The processor writes an image of ``h × w`` tokens (``h = H / (patch·merge)``) as
  ``h`` rows of ``w`` ``[IMG]``, each row ended by ``[IMG_BREAK]`` and the last by ``[IMG_END]`` instead
  (``replace_image_token``, ``processing_pixtral.py:91-99``); the model fills the ``[IMG]`` tokens only with the
  image's merged patch features in row-major order (``get_placeholder_mask``, ``modeling_mistral3.py:224-246``); the
  break and end tokens are ordinary embeddings.
- **Pixels are padded images with sizes.** ``pixel_values`` is ``[images, 3, H_max, W_max]`` padded with zeros to the
  batch's largest image and ``image_sizes [images, 2]`` (height, width) says what of each is the image
  (``_pad_for_batching``, ``image_processing_pixtral.py:161-183``): the tower cuts each image's patches to its size
  before anything else (``PixtralVisionModel.forward``, ``modeling_pixtral.py:416-420``) and runs all images of a call
  as one sequence with a block-diagonal mask (``generate_block_attention_mask``, ``:360-375``), so an image's
  features do not depend on the others of the call. A prompt keeps its images cut to its own largest one, and
  :meth:`collate` pads the samples' images to the pass's largest. The sizes are not stored: a prompt's ``[IMG]`` /
  ``[IMG_BREAK]`` / ``[IMG_END]`` ids state each image's rows and columns of tokens, so :meth:`image_sizes` reads
  them from its ids (:meth:`encode` checks they are the processor's ``image_sizes``), and the replay needs no extra
  key.
- **Plain rotary positions.** Without position ids the language model numbers positions from the first column,
  padding included, so the adapter (``mrope`` false) passes each left-padded row's positions from its padding mask,
  as ``generate`` does. Ministral 3 also scales its queries by ``1 + β · log(1 + ⌊position /
  original_max_position_embeddings⌋)`` (``get_llama_4_attn_scale``, ``modeling_ministral3.py``), a function of the
  position ids, which a row at shifted positions would get wrong.
- **The feature cache** keeps ``get_image_features``'s ``pooler_output`` (tower, norm, patch merger and MLP
  projector, one ``[h·w, hidden]`` per image, ``modeling_mistral3.py:195-222``), kept per prompt as ``[Σ h·w,
  hidden]``, which the model takes back through ``mm_encoder_outputs["image"].pooler_output`` (``:275-291``). The
  projector (with the patch merger) is inside what is cached, so ``freeze_vision`` freezes ``multi_modal_projector``
  with the tower (:meth:`vision_modules`) and LoRA keeps off both (Pixtral's attention and MLP name their layers
  ``q_proj`` ... ``down_proj``, like the language model's).
- **The chat.** ``<s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]``, the images' ``[IMG]`` where the user turn
  puts them; the assistant answers right after ``[/INST]`` (no generation prompt) and ends with ``</s>`` (the
  released ``generation_config.json``: ``eos_token_id`` 2). The released templates write a default system prompt
  (with the day's date, ``strftime_now``) when the chat has none: set ``plugin.system_prompt`` to keep the prompts
  fixed across days. The template writes ``<s>``, so :meth:`encode` tokenizes a rendered chat without special tokens
  when the text starts with it, as transformers' ``apply_chat_template`` does (the base class's
  :meth:`~mmrl.plugins.vlm.adapters.base.VLMAdapter.adds_special_tokens`): one ``<s>`` whether or not the tokenizer
  adds BOS.
- **No videos.** Pixtral's processor takes images only; video rows are refused.
- **Boxes** in pixels of the image the model sees. Mistral documents no grounding output format for these models, so
  the family declares the ``qwen2_5_vl`` convention: boxes in pixels of the resized model input (a row's
  ``resized_size``, :meth:`resized_size`, which the processor keeps close to the image's aspect ratio), scaled back to
  the original image by its width and height; prompt the model for JSON ``bbox_2d`` in those pixels.
"""

from __future__ import annotations

import math
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
)


class Mistral3Adapter(VLMAdapter):
    """Mistral 3 (``model_type: mistral3``) through ``transformers.Mistral3ForConditionalGeneration`` (see the module
    docstring)."""

    name = "mistral3"
    pooled_features_as_tuple = True  # the model concatenates pooler_output (torch.cat)
    model_types = ("mistral3",)
    model_class = "Mistral3ForConditionalGeneration"
    box_convention = "qwen2_5_vl"  # pixels of the resized model input (module docstring)
    vision_attributes: ClassVar[tuple[str, ...]] = ("model.vision_tower",)
    projector_attributes: ClassVar[tuple[str, ...]] = ("model.multi_modal_projector",)
    # Pixtral's layers are named like the language model's: the pattern keeps LoRA off the tower and the projector
    # whose output the feature cache keeps.
    vision_module_pattern: ClassVar[str] = r".*(^|\.)(vision_tower|multi_modal_projector)(\.|$).*"
    # The placeholder the model fills with features (a sampled one would be taken for an image slot when fed back)
    # and the row and image ends, which only the processor writes.
    vision_tokens: ClassVar[tuple[str, ...]] = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
    supports_videos = False
    video_refusal = "Pixtral's processor takes images only"
    mrope = False
    #: The plugin's pixel bound this family cannot honour (Pixtral never enlarges an image): the plugin refuses a value
    #: other than the config's default (:meth:`pixel_bounds_refusal`).
    unused_pixel_bounds: ClassVar[tuple[str, ...]] = ("min_pixels",)

    def __init__(self, model: str, **bounds: Any):
        # The base class's pixel bounds (videos are refused: the video bounds are only validated and kept)
        super().__init__(model, **bounds)
        self.image_token_id = int(self.processor.image_token_id)
        self.break_token_id = int(self.processor.image_break_token_id)
        self.end_token_id = int(self.processor.image_end_token_id)

    def patch_geometry(self) -> tuple[int, int]:
        """Pixtral's image processor holds ``patch_size`` as a {height, width} dict, which its processor replaces by
        patch × merge at every call: the patch and merge are the processor's (``PixtralProcessor.patch_size`` /
        ``spatial_merge_size``)."""
        return int(self.processor.patch_size), int(self.processor.spatial_merge_size)

    # ------------------------------------------------------------------ loading, sizes and images
    def load_processor(self) -> Any:
        """``AutoProcessor.from_pretrained`` with the image processor's ``longest_edge`` set from ``max_pixels``
        (:meth:`longest_edge_for`).

        Raises:
            ValueError: ``max_pixels`` below one token's cell (patch × merge squared).
        """
        from transformers import AutoProcessor
        from transformers.image_utils import SizeDict

        processor = AutoProcessor.from_pretrained(self.model_path)
        image_processor = processor.image_processor
        checkpoint_edge = int(image_processor.size.longest_edge)
        factor = int(processor.patch_size) * int(processor.spatial_merge_size)
        # A SizeDict, as the image processor keeps its size after __init__ (Pixtral's resize reads .longest_edge)
        image_processor.size = SizeDict(longest_edge=self.longest_edge_for(self.max_pixels, factor, checkpoint_edge))
        return processor

    def pixel_bounds_refusal(self) -> str:
        """Why :attr:`unused_pixel_bounds` cannot be honoured, for the plugin's one-line refusal."""
        return ("mistral3 never enlarges an image (Pixtral's processor only shrinks it to longest_edge "
                f"{self.longest_edge}, which plugin.max_pixels sets, and rounds its sides up to {self.image_factor}), "
                "so no lower bound can be honoured")

    @staticmethod
    def longest_edge_for(max_pixels: int, factor: int, checkpoint_edge: int) -> int:
        """The ``longest_edge`` that bounds every image's area by ``max_pixels``: the largest multiple of ``factor``
        (patch × merge) whose square is at most ``max_pixels``, at most ``checkpoint_edge`` (the checkpoint's own
        bound, the tower's rotary table). Pixtral's resize keeps both sides at most a ``factor`` multiple
        ``longest_edge`` (sides floored to it, then rounded up to ``factor`` multiples), so the area is at most its
        square.

        Raises:
            ValueError: ``max_pixels`` below ``factor²`` (no image fits).
        """
        edge = math.isqrt(int(max_pixels)) // factor * factor
        if edge < factor:
            raise ValueError(f"mistral3: max_pixels {max_pixels} is below one image token's {factor} x {factor} "
                             f"pixels; set plugin.max_pixels to at least {factor * factor}")
        return min(edge, checkpoint_edge)

    @property
    def image_factor(self) -> int:
        """Resized image sides are multiples of this (patch size × spatial merge)."""
        return self.patch_size * self.merge_size

    @property
    def longest_edge(self) -> int:
        """The image processor's ``longest_edge`` (:meth:`longest_edge_for`)."""
        return int(self.processor.image_processor.size.longest_edge)

    def resized_size(self, image_size: Sequence[float]) -> tuple[int, int]:
        """``(width, height)`` Pixtral's processor resizes an image of ``image_size`` ``(width, height)`` to: shrunk
        (aspect kept, sides floored) when a side exceeds ``longest_edge``, then both sides rounded up to multiples of
        patch × merge (``get_resize_output_image_size``, ``image_processing_pixtral.py:49-86``)."""
        from mmrl.rewards.boxes import checked_size

        width, height = checked_size(image_size, "image_size")
        edge, factor = self.longest_edge, self.image_factor
        ratio = max(height / edge, width / edge)
        if ratio > 1:
            height, width = math.floor(height / ratio), math.floor(width / ratio)
        return math.ceil(width / factor) * factor, math.ceil(height / factor) * factor

    def load_images(self, images: Sequence[Any], *, use_qwen_vl_utils: bool | None = None) -> list[Any]:
        """Open the images of one prompt as RGB, unresized: Pixtral's processor resizes them.

        Raises:
            ValueError: ``use_qwen_vl_utils=True`` (a Qwen helper; Mistral 3 does not use it).
        """
        return open_unresized(images, use_qwen_vl_utils=use_qwen_vl_utils,
                              resized_by="Mistral 3 images are resized by Pixtral's processor")

    # ------------------------------------------------------------------ prompts
    def image_sizes(self, input_ids: Tensor) -> Tensor:
        """``[images, 2]`` (height, width) in pixels of each image of a prompt, read from its ids: an image is ``h``
        rows of ``w`` ``[IMG]``, each row ended by ``[IMG_BREAK]`` and the last by ``[IMG_END]``
        (``replace_image_token``), so ``(h, w)`` tokens are ``(h·f, w·f)`` pixels with ``f`` = patch × merge.

        Raises:
            ValueError: ids that do not form whole images (rows of different widths, ``[IMG]`` outside a row).
        """
        sizes: list[tuple[int, int]] = []
        rows, width, run = 0, None, 0
        for token in input_ids.tolist():
            if token == self.image_token_id:
                run += 1
                continue
            if token in (self.break_token_id, self.end_token_id):
                if run == 0 or (width is not None and run != width):
                    raise ValueError(f"mistral3: an image row of {run} [IMG] tokens in an image whose rows have "
                                     f"{width}; the prompt was not written by Pixtral's processor")
                width, rows, run = run, rows + 1, 0
                if token == self.end_token_id:
                    sizes.append((rows * self.image_factor, width * self.image_factor))
                    rows, width = 0, None
                continue
            if run or rows:
                raise ValueError("mistral3: an image's [IMG] rows are not ended by [IMG_BREAK] / [IMG_END]; the "
                                 "prompt was not written by Pixtral's processor")
        if run or rows:
            raise ValueError("mistral3: the prompt ends inside an image (no [IMG_END])")
        return torch.tensor(sizes, dtype=torch.long).reshape(-1, 2)

    def encode(self, texts: Sequence[str], images: Sequence[Sequence[Any]],
               videos: Sequence[Sequence[Sequence[Any]]] | None = None,
               video_fps: Sequence[Sequence[float]] | None = None, *, video_entries: bool = False
               ) -> list[PromptInputs]:
        """Run the processor once on a batch of prompts and give each prompt its own images.

        Returns:
            Per prompt ``{"input_ids": [P_i], "pixel_values": [images_i, 3, H_i, W_i]}``: tokens unpadded, its images
            in text order cut to its own largest height and width (zeros beyond each image, as the processor pads).

        Raises:
            ValueError: videos, or image sizes in the ids that are not the processor's ``image_sizes``.
        """
        if len(texts) != len(images):
            raise ValueError(f"encode: {len(texts)} texts but {len(images)} image lists")
        self.refuse_videos(video_entries or any(group for group in videos or []))
        flat = [image for group in images for image in group]
        # The chat template writes <s>; a tokenizer that adds BOS would write a second one: transformers' own rule
        batch = self.processor(text=list(texts), images=flat or None, padding=True, padding_side="left",
                               return_tensors="pt", add_special_tokens=self.adds_special_tokens(texts))
        attention = batch["attention_mask"].bool()  # [B, P]
        if flat:
            pixels = batch["pixel_values"]  # [Σ images, 3, H_max, W_max]
            processor_sizes = torch.as_tensor(batch["image_sizes"], dtype=torch.long).reshape(-1, 2)  # [Σ images, 2]
        else:
            pixels, processor_sizes = torch.zeros(0, 3, 0, 0), torch.zeros(0, 2, dtype=torch.long)
        prompts: list[PromptInputs] = []
        start = 0
        for i, group in enumerate(images):
            ids = batch["input_ids"][i][attention[i]]  # [P_i]
            sizes = self.image_sizes(ids)  # [images_i, 2]
            count = len(group)
            if sizes.shape[0] != count or not torch.equal(sizes, processor_sizes[start:start + count]):
                raise ValueError(f"mistral3: prompt {i}'s image tokens make images of {sizes.tolist()} pixels, the "
                                 f"processor's image_sizes are {processor_sizes[start:start + count].tolist()}")
            height, width = (sizes.amax(0).tolist() if count else (0, 0))
            prompts.append({"input_ids": ids, "pixel_values": pixels[start:start + count, :, :height, :width]})
            start += count
        return prompts

    def image_features(self, model: nn.Module, prompts: Sequence[PromptInputs]) -> list[PromptInputs]:
        """The prompts with ``pixel_values`` replaced by ``image_embeds [Σ h·w, hidden]``: ``get_image_features``
        (Pixtral tower, patch merger and projector) on all prompts' images in one call, no gradients; valid for every
        pass of a step while the tower and the projector are frozen."""
        result = [dict(prompt) for prompt in prompts]
        hf_model = _base_model(model)
        device = next(hf_model.parameters()).device
        holding = [p for p in prompts if p["pixel_values"].shape[0]]
        per_image: list[Tensor] = []
        if holding:
            pixels, sizes = self._pixels_and_sizes(holding, device)
            with torch.no_grad():
                output = hf_model.get_image_features(pixel_values=pixels, image_sizes=sizes, return_dict=True)
            per_image = list(output.pooler_output)  # one [h·w, hidden] per image
        for updated in result:
            count = int(updated.pop("pixel_values").shape[0])
            taken, per_image = per_image[:count], per_image[count:]
            updated["image_embeds"] = torch.cat(taken) if taken else torch.zeros(0, 0)
        return result

    # ------------------------------------------------------------------ batching
    def _pixels_and_sizes(self, prompts: Sequence[PromptInputs], device: torch.device | str) -> tuple[Tensor, Tensor]:
        """The prompts' images padded with zeros to the largest height and width among them, ``[Σ images, 3, H, W]``,
        and their ``image_sizes [Σ images, 2]`` read from the prompts' ids, both in sample order."""
        pixels = [p["pixel_values"] for p in prompts]
        height = max(int(p.shape[2]) for p in pixels)
        width = max(int(p.shape[3]) for p in pixels)
        padded = [nn.functional.pad(p.to(device), (0, width - p.shape[3], 0, height - p.shape[2])) for p in pixels]
        sizes = torch.cat([self.image_sizes(p["input_ids"]) for p in prompts]).to(device)  # [Σ images, 2]
        return torch.cat(padded), sizes

    def collate(self, prompts: Sequence[PromptInputs], completions: Sequence[Tensor] | None = None,
                device: torch.device | str | None = None) -> tuple[dict[str, Tensor], int]:
        """The base class's token collation (prompts left-padded, completions right-padded) with the samples' images
        in sample order, the order in which the model fills the ``[IMG]`` tokens: ``pixel_values [Σ images, 3, H,
        W]`` padded with zeros to the largest image and ``image_sizes [Σ images, 2]`` (:meth:`image_sizes`), or, for
        prompts carrying cached features, ``mm_encoder_outputs`` whose ``"image"`` entry's ``pooler_output`` is
        ``([Σ [IMG] tokens, hidden],)``.

        Raises:
            ValueError: a batch that mixes prompts with cached features and prompts with pixels.
        """
        inputs, width = super().collate(prompts, completions, device)
        device = inputs["input_ids"].device
        if self.put_cached_image_features(prompts, inputs):
            return inputs, width
        holding = [p for p in prompts if p["pixel_values"].shape[0]]
        if holding:
            inputs["pixel_values"], inputs["image_sizes"] = self._pixels_and_sizes(holding, device)
        return inputs, width

    def image_token_count(self, prompt: PromptInputs) -> float:
        """The prompt's ``[IMG]`` tokens (``h·w`` per image; the row and image ends are not counted)."""
        return float((prompt["input_ids"] == self.image_token_id).sum())

    # ------------------------------------------------------------------ modules
    def vision_modules(self, model: nn.Module) -> list[nn.Module]:
        """The Pixtral tower and ``multi_modal_projector`` (norm, patch merger and MLP into the language model):
        together they make the features the cache keeps."""
        projector = find_submodule(_base_model(model), self.projector_attributes, what="mistral3 multi-modal projector")
        return [self.vision_tower(model), projector]


__all__ = ["Mistral3Adapter"]
