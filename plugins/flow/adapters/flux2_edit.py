"""FLUX.2 image editing with a reference image (``Flux2Pipeline(image=...)`` and ``Flux2KleinPipeline(image=...)``):
the same pipelines as the ``flux2`` and ``flux2_klein`` adapters, each sample conditioned on its row's image. These
adapters are chosen by name (``plugin.adapter: flux2_edit`` / ``flux2_klein_edit``); ``auto`` picks the
text-to-image ones.

What the adapters reproduce from the pipelines' ``__call__`` (diffusers 0.42) besides FLUX.2's prompts, noise, σ
grid, guidance and decode (:class:`~mmrl.plugins.flow.adapters.flux2.Flux2Adapter`,
:class:`~mmrl.plugins.flow.adapters.flux2_klein.Flux2KleinAdapter`):

- the reference image: preprocessed by the pipeline's image processor at the run's ``height`` × ``width`` with
  ``resize_mode="crop"`` (scaled to cover, centre-cropped), encoded by the pipeline's ``_encode_vae_image`` (the VAE's
  mode, 2×2 patchify, the VAE's batch-norm statistics), packed into tokens; position ids from the pipeline's
  ``_prepare_image_ids``: (T = 10, row, column, 0), the first reference image's time coordinate.
- each step: ``[generated tokens; reference tokens]`` with ``[ids; reference ids]``; only the generated tokens' output
  is kept. μ of the σ shift counts the generated tokens only, as the pipelines do.

Where mmrl differs: the pipelines keep a reference image at its own size (floored to a multiple of 16, scaled down
to 1024² pixels when larger) whatever the output size; here it is brought to one size for the run,
``plugin.condition_size`` (null: the output size), so the rows of a batch share one shape (the pipelines given a
reference image of that size compute the same, which the tests check). With ``plugin.buckets``
(:mod:`~mmrl.plugins.flow.buckets`) a row's output and references take the bucket nearest the first reference's
aspect ratio, the image whose size the pipelines give the output when no height and width are passed.

Several reference images per row (the pipelines' ``image=[...]``): a row's ``"image"`` may be a list of paths; the
transformer then sees ``[generated tokens; image 1's tokens; image 2's; ...]`` with the pipelines' position ids, time
coordinate T = 10, 20, ... for the first, second, ... image. A batch whose rows name different numbers of images
makes one transformer call per number (:func:`~mmrl.plugins.flow.adapters.base.by_image_count`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning, by_image_count
from mmrl.plugins.flow.adapters.flux2 import Flux2Adapter
from mmrl.plugins.flow.adapters.flux2_klein import Flux2KleinAdapter


class _ReferenceImage:
    """The reference-image conditioning both FLUX.2 pipelines share (mixed into their adapters)."""

    image_conditioned = True
    condition_size_free = True
    max_condition_images = None  # the pipelines set no limit
    #: The pipeline class the adapter edits with (chosen by name, so checked when it loads).
    edits_with: str

    def __init__(self, pipeline: Any, device: torch.device):
        if type(pipeline).__name__ != self.edits_with:
            other = "flux2_edit" if self.edits_with == "Flux2KleinPipeline" else "flux2_klein_edit"
            raise ValueError(f"{self.name} adapter: {type(pipeline).__name__} is not a {self.edits_with}; use "
                             f"adapter {other} for the other FLUX.2 pipeline")
        super().__init__(pipeline, device)
        self._reference_ids_cache: dict[tuple[Any, ...], Tensor] = {}

    def encode_condition_images(self: Any, images: list[Any]) -> tuple[Conditioning, Tensor]:
        height, width = self.condition_size
        pixels = self.pipeline.image_processor.preprocess(images, height=height, width=width, resize_mode="crop")
        pixels = pixels.to(self.device, self.vae.dtype)  # [n, 3, H, W] in [-1, 1]
        latents = self.pipeline._encode_vae_image(image=pixels, generator=None)  # [n, 4C, h/2, w/2], normalised
        return {"image_latents": self.pipeline._pack_latents(latents)}, (pixels.float() / 2 + 0.5).clamp(0, 1)

    def _reference_ids(self: Any, like: Tensor, count: int = 1) -> Tensor:
        """``[1, count·h/2·w/2, 4]``: (10·i, row, column, 0) for the i-th of ``count`` images on the token grid of
        :attr:`condition_size`, ``_prepare_image_ids`` of ``count`` images; cached with the other position ids."""
        rows, columns = self.condition_grid(2)
        key = (rows, columns, count, like.device)
        if key not in self._reference_ids_cache:
            self._reference_ids_cache[key] = self.pipeline._prepare_image_ids(
                [like.new_empty(1, 1, rows, columns)] * count).to(like.device)
        return self._reference_ids_cache[key]

    def call_transformer(self: Any, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        tokens = latents.shape[1]  # latents [n, h/2·w/2, 4C]
        image_ids, text_ids = self._position_ids(tokens, conditioning["prompt_embeds"].shape[1], latents)

        def call(latents: Tensor, timesteps: Tensor, conditioning: Conditioning, count: int) -> Tensor:
            reference = conditioning["image_latents"].to(latents.dtype)  # [m, k·T_in, 4C]
            ids = torch.cat([image_ids, self._reference_ids(image_ids, count)], dim=1)  # [1, T + k·T_in, 4]
            both = torch.cat([latents, reference], dim=1)  # [m, T + k·T_in, 4C]
            return self._transformer(module, both, ids, text_ids, timesteps, conditioning, guidance_scale)[:, :tokens]

        return by_image_count(call, latents, timesteps, conditioning)


class Flux2EditAdapter(_ReferenceImage, Flux2Adapter):
    """``Flux2Pipeline`` (FLUX.2 [dev]) editing each row's reference image; select with ``adapter: flux2_edit``."""

    name = "flux2_edit"
    pipeline_classes = ()  # chosen by name: auto picks the text-to-image flux2 adapter
    edits_with = "Flux2Pipeline"


class Flux2KleinEditAdapter(_ReferenceImage, Flux2KleinAdapter):
    """``Flux2KleinPipeline`` (FLUX.2 [klein], base or distilled) editing each row's reference image; select with
    ``adapter: flux2_klein_edit``."""

    name = "flux2_klein_edit"
    pipeline_classes = ()  # chosen by name: auto picks the text-to-image flux2_klein adapter
    edits_with = "Flux2KleinPipeline"
