"""Qwen-Image-Edit (``QwenImageEditPipeline``: Qwen/Qwen-Image-Edit) and Qwen-Image-Edit-2509/2511
(``QwenImageEditPlusPipeline``): Qwen-Image's MMDiT editing an input image that it sees twice, through the
Qwen2.5-VL text encoder, which reads the image with the instruction, and as VAE latents appended to the generated
tokens as a second image of ``img_shapes``.

What the adapter reproduces from the two pipelines' ``__call__`` (diffusers 0.42) besides Qwen-Image's noise, σ
grid, guidance rescale and decode (:class:`~mmrl.plugins.flow.adapters.qwen_image.QwenImageAdapter`):

- prompts: ``pipeline.encode_prompt(prompt, image)``: the edit template (a system turn describing the task, the
  image's vision tokens, then the instruction; the Plus template labels the image "Picture 1:"), the processor
  expanding the image into its vision tokens, the last hidden state with the first 64 tokens dropped; zero-padded
  here to ``max_sequence_length`` with a mask (the image's vision tokens count: a prompt that does not fit is
  refused in one line). Each (prompt, image) pair is encoded alone and cached, and with CFG each image is encoded
  with the negative prompt too: the pipelines pass the image to the negative prompt's encoding as well, so every row
  has its own negative (:meth:`FlowAdapter.velocity` takes it from ``negative_prompt_embeds``).
- the text encoder's image: Qwen-Image-Edit's is the VAE image (below); the Plus pipeline's is resized to an area of
  384² at the same aspect ratio (``CONDITION_IMAGE_SIZE``, ``calculate_dimensions``).
- the VAE image: resized and normalised by the pipeline's image processor, encoded with the VAE's mode as a one-frame
  video, normalised with ``latents_mean``/``latents_std``, packed; each step the transformer sees
  ``[generated tokens; image tokens]`` with ``img_shapes`` ``[(1, h/2, w/2), (1, h/2, w/2)]`` and the output is cut
  back to the generated tokens. μ of the σ shift counts the generated tokens only, as the pipelines do.

Where mmrl differs: the pipelines size the input image themselves, at about 1024² pixels whatever the output size
(``calculate_dimensions(1024 * 1024, ratio)``; the Plus pipeline's ``VAE_IMAGE_SIZE``), with the input's aspect
ratio. Here the VAE image is resized to one size for the run, ``plugin.condition_size`` (null: the output's
``height`` × ``width``), so that the rows of a batch share one shape; its ``img_shapes`` entry is that size's grid.
With ``plugin.buckets`` (:mod:`~mmrl.plugins.flow.buckets`) each row's output, and its input at the output's size
or at ``condition_size``'s area, take the bucket nearest the first image's aspect ratio (the Plus pipeline's: the
last image's, :attr:`aspect_image`), the pipelines' rule up to the snapping to a bucket.
With a dataset whose images have that aspect ratio and ``plugin.condition_size`` at the pipelines' ~1024² (e.g.
``[1024, 1024]``), the computation is the pipeline's whatever the output size (the tests check it with the
pipelines' size rules set to the test's size). Flow-Factory likewise sizes its Qwen-Image-Edit-Plus condition
images from its config (X-GenGroup/Flow-Factory@a0b2bc5, ``src/flow_factory/models/qwen_image/
qwen_image_edit_plus.py``).

Several input images per row (the Plus pipeline's ``image=[...]``, "Picture 1: ... Picture 2: ..."): a row's
``"image"`` may be a list of paths. As the Plus pipeline does, the text encoder reads every image after its
"Picture i:" label, and the transformer sees ``[generated tokens; image 1's tokens; image 2's; ...]`` with one
``img_shapes`` entry per image. Each image is brought to the run's size, so every entry is the generated image's
grid (the pipeline gives each image its own size at its own aspect ratio). A batch whose rows name different numbers
of images makes one transformer call per number (:func:`~mmrl.plugins.flow.adapters.base.by_image_count`).
``QwenImageEditPipeline`` takes one image per row.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning, by_image_count
from mmrl.plugins.flow.adapters.qwen_image import QwenImageAdapter, padded_text


class QwenImageEditAdapter(QwenImageAdapter):
    """Adapter for ``QwenImageEditPipeline`` and ``QwenImageEditPlusPipeline`` (Qwen/Qwen-Image-Edit,
    Qwen/Qwen-Image-Edit-2509, Qwen/Qwen-Image-Edit-2511 and fine-tunes): image editing, one input image per row
    (the Plus pipeline: one or several)."""

    name = "qwen_image_edit"
    pipeline_classes = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")
    image_conditioned = True
    prompt_sees_image = True
    condition_size_free = True

    @property
    def plus(self) -> bool:
        """Whether the pipeline is ``QwenImageEditPlusPipeline`` (2509 and later)."""
        return type(self.pipeline).__name__ == "QwenImageEditPlusPipeline"

    @property
    def aspect_image(self) -> str:  # type: ignore[override]
        """The image whose aspect ratio the output takes: the Plus pipeline's last (``image[-1].size``), the first
        otherwise (``image[0].size``; diffusers 0.42 ``__call__``)."""
        return "last" if self.plus else "first"

    @property
    def max_condition_images(self) -> int | None:  # type: ignore[override]
        """Any number of input images per row with the Plus pipeline (it sets no limit), one without."""
        return None if self.plus else 1

    def encode_condition_images(self, images: list[Any]) -> tuple[Conditioning, Tensor]:
        height, width = self.condition_size
        processor, vae = self.pipeline.image_processor, self.vae
        pixels = processor.preprocess([processor.resize(image, height, width) for image in images], height, width)
        pixels = pixels.to(self.device, vae.dtype)  # [n, 3, H, W] in [-1, 1]
        latents = vae.encode(pixels.unsqueeze(2)).latent_dist.mode()  # [n, C, 1, h, w]: sample_mode="argmax"
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        n, channels, _, h, w = latents.shape  # packed as the pipeline packs it: the frame axis of one is free
        packed = self.pipeline._pack_latents((latents - mean) / std, n, channels, h, w)  # [n, h/2·w/2, 4C]
        return {"image_latents": packed}, (pixels.float() / 2 + 0.5).clamp(0, 1)

    def _text_image(self, image: Any) -> Any:
        """The image as the text encoder's processor gets it: the VAE image's size (:attr:`condition_size`), or for
        the Plus pipeline an area of 384² (``CONDITION_IMAGE_SIZE``) at that size's aspect ratio."""
        height, width = self.condition_size
        if self.plus:
            from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
                CONDITION_IMAGE_SIZE,
                calculate_dimensions,
            )

            width, height = calculate_dimensions(CONDITION_IMAGE_SIZE, width / height)
        return self.pipeline.image_processor.resize(image, height, width)

    def encode_prompts_with_images(self, prompts: list[str], images: list[list[Any]], max_sequence_length: int
                                   ) -> Conditioning:
        rows = []
        for prompt, row_images in zip(prompts, images, strict=True):  # alone: the Plus template numbers the images
            text_images = [self._text_image(image) for image in row_images]
            if not self.plus and len(text_images) != 1:
                raise ValueError(f"QwenImageEditPipeline reads one input image per prompt, not {len(text_images)}")
            embeds, mask = self.pipeline.encode_prompt(prompt=[prompt], image=text_images if self.plus
                                                       else text_images[0], device=self.device)
            if embeds.shape[1] > max_sequence_length:
                what = "its image is" if len(text_images) == 1 else f"its {len(text_images)} images is"
                raise ValueError(f"plugin.max_sequence_length is {max_sequence_length}, but {prompt[:40]!r} with "
                                 f"{what} {embeds.shape[1]} text tokens (the image's vision tokens count): raise it")
            rows.append(padded_text(embeds, mask, max_sequence_length))
        return {key: torch.cat([row[key] for row in rows]) for key in rows[0]}

    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        grid = self._checked_grid(latents)  # (1, h/2, w/2)
        image_grid = (1, *self.condition_grid(2))  # every input image's: (1, h_in/2, w_in/2)

        def call(latents: Tensor, timesteps: Tensor, conditioning: Conditioning, count: int) -> Tensor:
            images = conditioning["image_latents"].to(latents.dtype)  # [m, k·T_in, 4C]
            both = torch.cat([latents, images], dim=1)  # [m, T + k·T_in, 4C]
            output = self._transformer(module, both, [grid] + [image_grid] * count, timesteps, conditioning,
                                       guidance_scale)
            return output[:, :latents.shape[1]]

        return by_image_count(call, latents, timesteps, conditioning)
