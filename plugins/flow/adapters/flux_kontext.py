"""FLUX.1 Kontext (``FluxKontextPipeline``): FLUX.1's transformer editing an input image. The image's VAE latents,
packed into 2×2-patch tokens like the generated latents, are appended to the generated tokens with position ids
whose first coordinate is 1 (the generated image's are 0), and the transformer's output is cut back to the
generated tokens: the condition image is context, never denoised.

What the adapter reproduces from ``FluxKontextPipeline.__call__`` (diffusers 0.42) besides FLUX.1's prompts,
noise, σ grid and guidance embedding (:class:`~mmrl.plugins.flow.adapters.flux.FluxAdapter`):

- the condition image: resized to the run's size (``plugin.height`` × ``plugin.width``) with the pipeline's image
  processor (``resize``, then ``preprocess`` to [-1, 1]), encoded with the VAE's mode (``retrieve_latents`` with
  ``sample_mode="argmax"``: deterministic), shifted and scaled ((x − shift)·scale), packed; position ids from
  ``_prepare_latent_image_ids`` with the first coordinate set to 1.
- each step: ``hidden_states = [generated; condition]`` tokens, ``img_ids = [generated ids; condition ids]``, and
  the output's first h/2·w/2 tokens; μ of the σ shift from the generated tokens only, as the pipeline computes it.

Where mmrl differs: the pipeline sizes the condition image itself (with ``_auto_resize``, the default, the
``PREFERRED_KONTEXT_RESOLUTIONS`` entry nearest its aspect ratio; without, its own size rounded down to a multiple
of 16), independently of the output size. Here every condition image is resized to one size, ``plugin.
condition_size`` (null: the output size), so that the rows of a batch share one shape (the pipeline with
``_auto_resize=False`` and a condition image of that size is the same computation, which the tests check); its
tokens get their own grid's position ids. With ``plugin.buckets`` (:mod:`~mmrl.plugins.flow.buckets`) each row is
generated, and its input brought, to the bucket nearest its input's aspect ratio, as the pipeline's
``_auto_resize`` picks from its list (``buckets`` can be that list; the pipeline compares the ratios, mmrl their
logarithms). Flow-Factory likewise sizes condition images from its config
(X-GenGroup/Flow-Factory@a0b2bc5, ``src/flow_factory/models/flux/flux1_kontext.py``, ``condition_image_size``);
its LoRA targets are FLUX.1's attention and feed-forward linears, this adapter's too. The pipeline's optional true
CFG (``true_cfg_scale`` > 1 with a negative prompt; off by default) is not offered: Kontext [dev] is
guidance-distilled like FLUX.1-dev.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning, encoded_latents
from mmrl.plugins.flow.adapters.flux import FluxAdapter


class FluxKontextAdapter(FluxAdapter):
    """Adapter for ``FluxKontextPipeline`` (black-forest-labs/FLUX.1-Kontext-dev and fine-tunes): image editing."""

    name = "flux_kontext"
    pipeline_classes = ("FluxKontextPipeline",)
    default_guidance_scale = 3.5  # FluxKontextPipeline.__call__'s default
    image_conditioned = True
    condition_size_free = True

    def __init__(self, pipeline: Any, device: torch.device):
        super().__init__(pipeline, device)
        self._condition_ids_cache: dict[tuple[Any, ...], Tensor] = {}

    def encode_condition_images(self, images: list[Any]) -> tuple[Conditioning, Tensor]:
        height, width = self.condition_size
        processor, vae = self.pipeline.image_processor, self.vae
        resized = [processor.resize(image, height, width) for image in images]  # as the pipeline resizes
        pixels = processor.preprocess(resized, height, width).to(self.device, vae.dtype)  # [n, 3, H, W] in [-1, 1]
        return {"image_latents": self.image_tokens(pixels)}, (pixels.float() / 2 + 0.5).clamp(0, 1)

    def image_tokens(self, pixels: Tensor) -> Tensor:
        """``[n, h/2·w/2, 4C]`` packed latent tokens of images ``[n, 3, H, W]`` in [-1, 1] (any size on the packing's
        grid; the plugin's are at :attr:`condition_size`): the VAE's deterministic latents
        (``retrieve_latents(sample_mode="argmax")``), shifted and scaled as the pipeline does."""
        vae = self.vae
        latents = encoded_latents(vae.encode(pixels), vae)  # [n, C, h, w]
        return self.pack((latents - vae.config.shift_factor) * vae.config.scaling_factor)

    def _condition_ids(self, tokens: int, like: Tensor) -> Tensor:
        """Position ids of the condition image's tokens ``[h/2·w/2, 3]``: (1, row, column) on its own grid at
        :attr:`condition_size`, as the pipeline's ``_prepare_latent_image_ids`` of the image latents with the first
        coordinate set to 1; cached by grid (an evaluation size may have as many tokens on another grid)."""
        rows, columns = self.condition_grid(2)
        if rows * columns != tokens:
            raise ValueError(f"FLUX.1 Kontext adapter: {tokens} condition tokens, but a {self.condition_size[0]}x"
                             f"{self.condition_size[1]} input image has {rows * columns} ({rows} x {columns})")
        key = (rows, columns, like.device, like.dtype)
        if key not in self._condition_ids_cache:
            ids = self.pipeline._prepare_latent_image_ids(1, rows, columns, like.device, like.dtype).clone()
            ids[:, 0] = 1
            self._condition_ids_cache[key] = ids
        return self._condition_ids_cache[key]

    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        tokens = latents.shape[1]  # latents [n, h/2·w/2, 4C]
        condition = conditioning["image_latents"].to(latents.dtype)  # [n, T_in, 4C]
        image_ids, text_ids = self._position_ids(tokens, conditioning["prompt_embeds"].shape[1], latents)
        ids = torch.cat([image_ids, self._condition_ids(condition.shape[1], latents)])  # [T + T_in, 3]
        both = torch.cat([latents, condition], dim=1)  # [n, T + T_in, 4C]
        return self._transformer(module, both, ids, text_ids, timesteps, conditioning, guidance_scale)[:, :tokens]
