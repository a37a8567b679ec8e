"""FLUX.1 (``FluxPipeline``): a rectified-flow transformer on packed latents (2×2 patches of the 16-channel VAE
latents become tokens), text from CLIP (pooled) and T5 (sequence), and, for the guidance-distilled FLUX.1-dev, the
guidance scale given to the model through its guidance embedding instead of a second (unconditional) pass.

Defaults: guidance 3.5 (the FLUX.1-dev default, also used by DanceGRPO, arXiv:2505.07818) and Flow-GRPO's FLUX
LoRA targets, which add the feed-forward layers of both streams to the attention projections.

The adapter and its subclasses (``chroma``, ``flux_kontext``, ``longcat_image``, ``longcat_image_edit``) refuse, when
built, a pipeline of a class they do not drive (:func:`refuse_other_pipelines`): by name (``plugin.adapter: flux``)
any checkpoint reaches the adapter, and a Chroma, Kontext or LongCat checkpoint would otherwise fail only at the first
prompt (``ChromaPipeline.encode_prompt`` takes no ``prompt_2``: a TypeError) or, worse, run with the wrong inputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning, FlowAdapter, refuse_other_pipelines


class FluxAdapter(FlowAdapter):
    """Adapter for ``FluxPipeline`` (FLUX.1-dev, FLUX.1-schnell and fine-tunes)."""

    name = "flux"
    pipeline_classes = ("FluxPipeline",)
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                           "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
    default_guidance_scale = 3.5
    supports_cfg = False
    guidance_embedded = True
    default_max_sequence_length = 512  # FluxPipeline's default

    def __init__(self, pipeline: Any, device: torch.device):
        refuse_other_pipelines(type(self), pipeline)  # before anything reads the pipeline's components
        super().__init__(pipeline, device)
        self._ids: dict[tuple[Any, ...], tuple[Tensor, Tensor]] = {}

    def resolution_multiple(self) -> int:
        return self.vae_scale_factor * 2  # latents are packed in 2×2 patches

    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> Conditioning:
        prompt_embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, num_images_per_prompt=1,
            max_sequence_length=max_sequence_length,
        )
        # prompt_embeds [n, L, D_t5]; pooled [n, D_clip]
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def noise_shape(self) -> tuple[int, ...]:
        return (self.transformer.config.in_channels // 4, *self.latent_size())  # [C, h, w], h = H/8 even

    def pack(self, noise: Tensor) -> Tensor:
        n, channels, height, width = noise.shape
        return self.pipeline._pack_latents(noise, n, channels, height, width)  # [n, h/2·w/2, 4C]

    def unpack(self, latents: Tensor) -> Tensor:
        height, width = self.size
        return self.pipeline._unpack_latents(latents, height, width, self.vae_scale_factor)  # [n, C, h, w]

    def default_sigmas(self, num_steps: int) -> list[float]:
        return np.linspace(1.0, 1 / num_steps, num_steps).tolist()  # as FluxPipeline.__call__

    def _position_ids(self, image_tokens: int, text_tokens: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """FLUX's rotary position ids of the image tokens ``[h/2·w/2, 3]`` (0, row, column on the h/2 × w/2 grid of
        :attr:`size`, row-major as ``_pack_latents`` lays the tokens out) and of the text tokens (zeros), cached."""
        rows, columns = (side // 2 for side in self.latent_size())
        if rows * columns != image_tokens:
            raise ValueError(f"FLUX adapter: {image_tokens} latent tokens, but a {self.height}x{self.width} image has "
                             f"{rows * columns} ({rows} x {columns})")
        key = (rows, columns, text_tokens, like.device, like.dtype)
        if key not in self._ids:
            self._ids[key] = (self.pipeline._prepare_latent_image_ids(1, rows, columns, like.device, like.dtype),
                              torch.zeros(text_tokens, 3, device=like.device, dtype=like.dtype))
        return self._ids[key]

    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        image_ids, text_ids = self._position_ids(latents.shape[1], conditioning["prompt_embeds"].shape[1], latents)
        return self._transformer(module, latents, image_ids, text_ids, timesteps, conditioning, guidance_scale)

    def _transformer(self, module: nn.Module, tokens: Tensor, image_ids: Tensor, text_ids: Tensor, timesteps: Tensor,
                     conditioning: Conditioning, guidance_scale: float) -> Tensor:
        """The transformer on image ``tokens`` ``[n, T, 4C]`` with their ids ``[T, 3]`` and the prompt's."""
        n = tokens.shape[0]
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((n,), guidance_scale, device=tokens.device, dtype=torch.float32)
        return module(
            hidden_states=tokens,
            timestep=timesteps.to(tokens.dtype) / 1000,  # FluxPipeline passes σ in the latents' dtype
            guidance=guidance,
            pooled_projections=conditioning["pooled_prompt_embeds"],
            encoder_hidden_states=conditioning["prompt_embeds"],
            txt_ids=text_ids,
            img_ids=image_ids,
            return_dict=False,
        )[0]
