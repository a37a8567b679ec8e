"""FLUX.2 (``Flux2Pipeline``, FLUX.2-dev): a rectified-flow transformer (double- then single-stream blocks) on packed
latents whose 2×2 patches are drawn directly as channels, text from three hidden layers of Mistral-3 stacked along
the width, and guidance through the guidance embedding (guidance-distilled: no unconditional pass).

What the adapter reproduces from ``Flux2Pipeline.__call__`` (diffusers 0.42), text-to-image only:

- prompts: ``pipeline.encode_prompt`` (the system message and chat template of its processor, padded to
  ``max_sequence_length`` tokens, hidden layers 10/20/30 → ``[n, L, 3·D]``); the padded length is fixed, so cached
  prompts batch as they are, and, as in the pipeline, the transformer attends to the padding tokens too.
- noise ``[4C, h/2, w/2]`` per sample (already patchified) packed to ``[h/2·w/2, 4C]``; position ids of the image
  tokens (t, h, w, l) and of the text tokens (0, 0, 0, l) from the pipeline's own helpers;
- σ = ``linspace(1, 1/S, S)`` shifted with μ = ``compute_empirical_mu(tokens, S)``, which depends on the number of
  steps as well as the image size (FLUX.2's fit, black-forest-labs/flux2 ``sampling.py``);
- the transformer gets t/1000 in the latents' dtype and the guidance scale (float32) for every sample;
- decode: un-pack by the position ids, un-normalise with the VAE's batch-norm running statistics, un-patchify,
  decode.

Defaults: guidance 4.0 (the pipeline's default) and Flow-Factory's FLUX.2 LoRA targets (X-GenGroup/Flow-Factory,
src/flow_factory/models/flux/flux2.py, commit 15d5ed5d): the attention projections and SwiGLU linears of the
double-stream blocks and the fused QKV+MLP input projection of the single-stream blocks. Their list also names
``attn.to_out.0``, which exists only in the double-stream blocks; the single-stream output projection
(``attn.to_out``, a Linear) is not adapted there nor here (the suffix ``attn.to_out`` would also match the
double-stream blocks' ``to_out`` ModuleList, which peft cannot wrap).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning, FlowAdapter, refuse_other_pipelines


class Flux2Adapter(FlowAdapter):
    """Adapter for ``Flux2Pipeline`` (FLUX.2-dev and fine-tunes; text-to-image)."""

    name = "flux2"
    pipeline_classes = ("Flux2Pipeline",)
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                           "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
                           "attn.to_qkv_mlp_proj")
    default_guidance_scale = 4.0  # Flux2Pipeline.__call__'s default
    supports_cfg = False
    guidance_embedded = True
    default_max_sequence_length = 512  # Flux2Pipeline's default

    def __init__(self, pipeline: Any, device: torch.device):
        refuse_other_pipelines(type(self), pipeline)  # before anything reads the pipeline's components
        super().__init__(pipeline, device)
        self._ids: dict[tuple[Any, ...], tuple[Tensor, Tensor]] = {}

    def resolution_multiple(self) -> int:
        return self.vae_scale_factor * 2  # 2×2 patches of the VAE latents

    def _token_grid(self) -> tuple[int, int]:
        """``(rows, columns)`` of the packed tokens: the pixel size over (VAE factor × 2)."""
        height, width = self.size
        return height // (self.vae_scale_factor * 2), width // (self.vae_scale_factor * 2)

    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> Conditioning:
        prompt_embeds, _ = self.pipeline.encode_prompt(
            prompt=prompts, device=self.device, num_images_per_prompt=1, max_sequence_length=max_sequence_length,
        )
        return {"prompt_embeds": prompt_embeds}  # [n, L, 3·D], L = max_sequence_length (padded by the processor)

    def noise_shape(self) -> tuple[int, ...]:
        return (self.transformer.config.in_channels, *self._token_grid())  # [4C, h/2, w/2], as prepare_latents

    def pack(self, noise: Tensor) -> Tensor:
        return self.pipeline._pack_latents(noise)  # [n, h/2·w/2, 4C]

    def unpack(self, latents: Tensor) -> Tensor:
        image_ids, _ = self._position_ids(latents.shape[1], 1, latents)
        ids = image_ids.expand(latents.shape[0], -1, -1)
        return self.pipeline._unpack_latents_with_ids(latents, ids)  # [n, 4C, h/2, w/2]

    def image_seq_len(self) -> int:
        rows, columns = self._token_grid()
        return rows * columns

    def default_sigmas(self, num_steps: int) -> list[float]:
        return np.linspace(1.0, 1 / num_steps, num_steps).tolist()  # as Flux2Pipeline.__call__

    def dynamic_shift_mu(self, num_steps: int) -> float:
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        return compute_empirical_mu(image_seq_len=self.image_seq_len(), num_steps=num_steps)

    def _position_ids(self, image_tokens: int, text_tokens: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """Image ids ``[1, h/2·w/2, 4]`` (0, row, column, 0) on the token grid of :attr:`size` and text ids
        ``[1, L, 4]`` (0, 0, 0, position), cached."""
        rows, columns = self._token_grid()
        if rows * columns != image_tokens:
            raise ValueError(f"FLUX.2 adapter: {image_tokens} latent tokens, but a {self.height}x{self.width} image "
                             f"has {rows * columns} ({rows} x {columns})")
        key = (rows, columns, text_tokens, like.device)
        if key not in self._ids:
            grid = torch.empty(1, 1, rows, columns)  # only its shape is read
            self._ids[key] = (self.pipeline._prepare_latent_ids(grid).to(like.device),
                              self.pipeline._prepare_text_ids(torch.empty(1, text_tokens, 1)).to(like.device))
        return self._ids[key]

    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        image_ids, text_ids = self._position_ids(latents.shape[1], conditioning["prompt_embeds"].shape[1], latents)
        return self._transformer(module, latents, image_ids, text_ids, timesteps, conditioning, guidance_scale)

    def _transformer(self, module: nn.Module, tokens: Tensor, image_ids: Tensor, text_ids: Tensor, timesteps: Tensor,
                     conditioning: Conditioning, guidance_scale: float) -> Tensor:
        """The transformer on image ``tokens`` ``[n, T, 4C]`` with their ids ``[1, T, 4]`` and the prompt's."""
        n = tokens.shape[0]
        return module(
            hidden_states=tokens,
            timestep=timesteps.to(tokens.dtype) / 1000,  # Flux2Pipeline passes t/1000 in the latents' dtype
            guidance=self._guidance_input(n, guidance_scale, tokens.device),
            encoder_hidden_states=conditioning["prompt_embeds"],
            txt_ids=text_ids.expand(n, -1, -1),
            img_ids=image_ids.expand(n, -1, -1),
            return_dict=False,
        )[0]

    def _guidance_input(self, n: int, guidance_scale: float, device: torch.device) -> Tensor | None:
        """The transformer's ``guidance`` argument: the scale (float32) for every sample, FLUX.2 [dev]'s embedding."""
        return torch.full((n,), guidance_scale, device=device, dtype=torch.float32)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        return decode_flux2_latents(self.vae, self.unpack(latents), self.pipeline._unpatchify_latents)


@torch.no_grad()
def decode_flux2_latents(vae: nn.Module, latents: Tensor, unpatchify: Any) -> Tensor:
    """FLUX.2's VAE decode (FLUX.3 shares the VAE) of unpacked latents ``[n, 4C, h/2, w/2]``: the VAE's batch-norm
    statistics undone, ``unpatchify`` (the pipeline's 2×2 ``_unpatchify_latents``) to ``[n, C, h, w]``, decoded, and
    mapped to images ``[n, 3, H, W]`` in [0, 1]."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device,
                                                                                            latents.dtype)
    latents = unpatchify(latents * std + mean)  # [n, C, h, w]
    images = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
    return (images.float() / 2 + 0.5).clamp(0, 1)
