"""Qwen-Image 2.1 image editing (``QwenImage21Pipeline(image=...)``): the same pipeline as the ``qwen_image21``
adapter, each sample conditioned on its row's input image(s), which the model sees twice: through the Qwen3-VL text
encoder, which reads them with the instruction, and as VAE latents put into the image slots the text encoder reserved
for them, before the target image's tokens. This adapter is chosen by name (``plugin.adapter: qwen_image21_edit``);
``auto`` picks the text-to-image one.

What the adapter reproduces from ``QwenImage21Pipeline.__call__`` (diffusers 0.42.1,
``pipelines/qwenimage21/pipeline_qwenimage21.py``) with ``use_kv_cache=False``, besides the text-to-image adapter's
noise, σ grid, guidance and decode (:class:`~mmrl.plugins.flow.adapters.qwen_image21.QwenImage21Adapter`):

- the input images: each converted to RGBA (an RGB image gets an opaque alpha) and resized once
  (``image_processor.resize``); that one resized image feeds both encoders, as in the pipeline's step 1.
- prompts: ``pipeline.encode_prompt(prompt, image=[...])`` (``_get_qwen_prompt_embeds``): the image-conditioned
  template ``<image1><|vision_start|><|image_pad|><|vision_end|>{prompt}`` (`` <image2>...`` for a second image, and
  so on), each image composited over white for the vision tower, the processor expanding each ``<|image_pad|>`` into
  the image's merged vision tokens, the pre-norm last hidden state of the real tokens with the system turn dropped,
  and ``image_pad_mask`` marking those vision tokens: the transformer's image slots. Each (prompt, images) is encoded
  alone, zero-padded to ``max_sequence_length`` with ``prompt_embeds_mask`` and ``image_pad_mask`` (the vision tokens
  count: a prompt that does not fit is refused in one line). With CFG the negative prompt is encoded with the same
  images, as the pipeline does (``encode_prompt(image=input_images, prompt=negative_prompt)``), so every row has its
  own negative (:meth:`FlowAdapter.velocity` takes it from the ``negative_`` keys).
- the VAE latents: ``image_processor.preprocess`` (4 channels in [-1, 1]), ``_encode_vae_image`` (the VAE's mode of
  a one-frame video, normalised with ``latents_mean``/``latents_std``), ``_pack_latents`` (a plain flatten to
  ``[h_in·w_in, C]``); a row's images' tokens one after the other (``torch.cat(all_image_latents, dim=1)``).
- the transformer call: ``[image 1's tokens; image 2's; ...; target tokens]`` (the pipeline's
  ``torch.cat([input_images_latents, latents], dim=1)``: the transformer drops the condition tokens into the text's
  image slots, four latent tokens per slot, and appends the target's), ``img_shapes`` with one ``(1, h_in, w_in)``
  entry per input image first and the target's ``(1, h, w)`` last, ``img_mask`` the prompt's ``image_pad_mask`` with
  the target's slots appended, and the output cut to the last ``h·w`` tokens. Rows are cut to their real text tokens
  and grouped by text layout as in the text-to-image adapter (:meth:`QwenImage21Adapter._by_text_length`), and by
  image count (:func:`~mmrl.plugins.flow.adapters.base.by_image_count`). μ of the σ shift counts the target tokens
  only (the pipeline's ``latents.shape[1]``).

Where mmrl differs: the pipeline sizes each input image itself, ``calculate_dimensions(output_resolution², ratio)``
(an area of ``output_resolution``² at the image's own aspect ratio, sides rounded to multiples of 32), and, when no
``height``/``width`` is given, the output at that area with the last image's aspect ratio. Here every input image is
brought to one size for the run, ``plugin.condition_size`` (null: the output's ``height`` × ``width``), so that the
rows of a batch share one shape; each input's ``img_shapes`` entry is that size's grid. With ``plugin.buckets``
(:mod:`~mmrl.plugins.flow.buckets`) each row's output, and its inputs at the output's size or at
``condition_size``'s area, take the bucket nearest the last image's aspect ratio (:attr:`aspect_image`), the
pipeline's rule up to the snapping to a bucket. Given input images of the size its ``calculate_dimensions`` makes of
them, the pipeline computes what the adapter does (the tests choose ``output_resolution`` and image sizes so). Input
files are read as RGB (:mod:`~mmrl.plugins.flow.condition_images`), so an image's own alpha channel is dropped where
the pipeline would keep it for the VAE and composite it over white for the text encoder.

The text encoder's processor must give each input image exactly one vision token per 2×2 latent tokens, which the
Qwen3-VL processor does for any multiple of 32 inside its pixel bounds (``min_pixels``/``max_pixels``); a
``condition_size`` outside them is refused in one line (the pipeline's transformer would refuse the mismatched
``img_shapes`` too).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning, by_image_count
from mmrl.plugins.flow.adapters.qwen_image21 import TOKENS_PER_SLOT, QwenImage21Adapter, over_white


class QwenImage21EditAdapter(QwenImage21Adapter):
    """``QwenImage21Pipeline`` (Qwen/Qwen-Image-2.1) editing each row's input image(s), one or several per row
    (``image=[...]``); select with ``adapter: qwen_image21_edit``."""

    name = "qwen_image21_edit"
    pipeline_classes = ()  # chosen by name: auto picks the text-to-image qwen_image21 adapter
    image_conditioned = True
    prompt_sees_image = True
    condition_size_free = True
    max_condition_images = None  # the pipeline sets no limit: "<image1>", " <image2>", ... in its template
    aspect_image = "last"  # __call__ sizes the output by image[-1].size

    def __init__(self, pipeline: Any, device: torch.device):
        if type(pipeline).__name__ != "QwenImage21Pipeline":
            raise ValueError(f"{self.name} adapter: {type(pipeline).__name__} is not a QwenImage21Pipeline; the "
                             "adapter edits with Qwen-Image 2.1's pipeline only")
        super().__init__(pipeline, device)

    def _input_image(self, image: Any) -> Any:
        """``image`` as the pipeline's step 1 makes it: RGBA, resized once to :attr:`condition_size` (PIL)."""
        height, width = self.condition_size
        if image.mode != "RGBA":
            image = image.convert("RGBA")  # an opaque alpha: the VAE reads four channels
        return self.pipeline.image_processor.resize(image, height=height, width=width)

    def encode_condition_images(self, images: list[Any]) -> tuple[Conditioning, Tensor]:
        """Input images → ``{"image_latents": [n, h_in·w_in, C]}`` and the images as the VAE saw them, RGB in [0, 1]
        (alpha composited over white: opaque for the RGB files the plugin reads). Diffusers 0.42.1
        ``QwenImage21Pipeline.__call__`` step 1 (``image_processor.preprocess``) and ``prepare_latents``
        (``_encode_vae_image``, argmax; ``_pack_latents``).

        Args:
            images: PIL images, each brought to :attr:`condition_size`.
        """
        height, width = self.condition_size
        processor = self.pipeline.image_processor
        pixels = processor.preprocess([self._input_image(image) for image in images], height=height, width=width)
        pixels = pixels.to(self.device, self.vae.dtype)  # [n, 4, H, W] in [-1, 1], RGBA
        latents = self.pipeline._encode_vae_image(pixels.unsqueeze(2), generator=None)  # [n, C, 1, h, w], normalised
        n, channels, _, h, w = latents.shape
        packed = self.pipeline._pack_latents(latents, n, channels, h, w)  # [n, h·w, C]
        return {"image_latents": packed}, over_white((pixels.float() / 2 + 0.5).clamp(0, 1))  # [n, 3, H, W]

    def encode_prompts_with_images(self, prompts: list[str], images: list[list[Any]], max_sequence_length: int
                                   ) -> Conditioning:
        """Each prompt read with its row's input images by ``QwenImage21Pipeline.encode_prompt(prompt, image=[...])``
        (diffusers 0.42.1, ``_get_qwen_prompt_embeds`` with the image-conditioned template), alone, zero-padded to
        ``max_sequence_length``: ``prompt_embeds`` ``[n, L_max, D]``, ``prompt_embeds_mask`` and ``image_pad_mask``
        ``[n, L_max]``.

        Args:
            prompts: One instruction per row (the negative prompt for CFG's rows).
            images: Each row's PIL input images, in the order the template numbers them.
            max_sequence_length: The cached length; a longer encoding is refused in one line.
        """
        rows = []
        for prompt, row_images in zip(prompts, images, strict=True):  # alone: a batch would share one image list
            inputs = [self._input_image(image) for image in row_images]
            embeds, mask, image_pad_mask = self.pipeline.encode_prompt(prompt=[prompt], image=inputs,
                                                                       device=self.device)
            self._check_slots(prompt, image_pad_mask, len(inputs))
            what = "its image and its" if len(inputs) == 1 else f"its {len(inputs)} images and its"
            rows.append(self._padded(prompt, embeds, mask, image_pad_mask, max_sequence_length, what))
        return {key: torch.cat([row[key] for row in rows]) for key in rows[0]}

    def _check_slots(self, prompt: str, image_pad_mask: Tensor, count: int) -> None:
        """The text encoder's image slots ``image_pad_mask`` ``[1, L]`` must hold the ``count`` input images' latent
        tokens, four per slot: the processor's resize must keep :attr:`condition_size`."""
        rows, columns = self.condition_grid()
        needed = count * rows * columns // TOKENS_PER_SLOT
        slots = int(image_pad_mask.sum())
        if slots != needed:
            height, width = self.condition_size
            raise ValueError(f"{self.name} adapter: the processor gave {prompt[:40]!r}'s {count} input image(s) of "
                             f"{height}x{width} px {slots} vision tokens where the transformer needs {needed}, one "
                             "per 2x2 latent tokens: plugin.condition_size must lie within the processor's "
                             "min_pixels/max_pixels")

    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        """The velocity of the target tokens ``[n, h·w, C]``: the transformer on ``[inputs' tokens; target tokens]``
        per image count and text layout (``QwenImage21Pipeline.__call__``'s denoising loop, diffusers 0.42.1)."""
        shape = (1, *self.condition_grid())  # every input image's img_shapes entry, in latent tokens (unpatched)

        def call(latents: Tensor, timesteps: Tensor, conditioning: Conditioning, count: int) -> Tensor:
            return self._by_text_length(module, latents, timesteps, conditioning,
                                        condition_tokens=conditioning["image_latents"],  # [m, count·T_in, C]
                                        condition_shapes=[shape] * count)

        return by_image_count(call, latents, timesteps, conditioning)
