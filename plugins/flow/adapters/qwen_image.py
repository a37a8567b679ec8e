"""Qwen-Image (``QwenImagePipeline``): a 60-block MMDiT on packed latents (2×2 patches of the 16-channel latents of a
causal 3-D VAE, one frame), text from the last hidden layer of Qwen2.5-VL run on a chat template whose system turn is
dropped, true classifier-free guidance (``true_cfg_scale``) with a per-token norm rescale, and FLUX-style
resolution-dependent shifting of the σ grid.

What the adapter reproduces from ``QwenImagePipeline.__call__`` (diffusers 0.42):

- prompts: ``pipeline.encode_prompt`` (template, ``drop_idx`` 34, the last hidden state), then zero-padded to
  ``max_sequence_length`` with ``prompt_embeds_mask`` marking the real tokens. The pipeline pads to the longest
  prompt of its batch instead; the plugin caches prompts one by one and batches cached rows, so they need one
  length. The transformer masks padded text keys, and RoPE gives text tokens consecutive positions from the
  start of the text, so the real tokens see the same attention either way (up to float rounding).
- noise ``[1, C, h, w]`` per sample (the pipeline's ``[B, 1, C, h, w]``, a frame axis of one) packed to
  ``[h/2·w/2, 4C]``; σ from ``linspace(1, 1/S, S)`` shifted with μ = ``calculate_shift(h/2·w/2, ...)`` from the
  scheduler config (Qwen-Image: base 0.5 at 256 tokens to 0.9 at 8192, exponential, ``shift_terminal`` 0.02);
  the transformer gets ``t / 1000`` in the latents' dtype and ``img_shapes`` ``[(1, h/2, w/2)]`` per sample.
- guidance: v = v_u + w·(v_c − v_u) rescaled token by token to the norm of v_c (over the channel axis),
  v ← v·‖v_c‖/‖v‖, exactly as the pipeline does after combining (computed here in float32; the pipeline computes
  it in the latents' dtype). Flow-Factory's Qwen-Image adapter does the same rescale in rollouts and training
  (X-GenGroup/Flow-Factory, src/flow_factory/models/qwen_image/qwen_image.py, commit 15d5ed5d).
- decode: latents·std + mean per channel (``vae.config.latents_mean``/``latents_std``), the VAE's first frame.

Defaults: ``true_cfg_scale`` 4.0 (the pipeline's default, also Flow-Factory's Qwen-Image guidance scale) and LoRA on
the attention projections of both streams plus both linears of both feed-forwards. Flow-Factory lists the same
attention modules and ``{img,txt}_mlp.net.0.proj`` / ``{img,txt}_mlp.net.2.proj`` (same file, commit 15d5ed5d);
``net.2`` is itself the output Linear of diffusers' FeedForward and has no ``proj`` child, so here it is named
``net.2``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning, FlowAdapter, refuse_other_pipelines


class QwenImageAdapter(FlowAdapter):
    """Adapter for ``QwenImagePipeline`` (Qwen/Qwen-Image and fine-tunes with the same pipeline class)."""

    name = "qwen_image"
    pipeline_classes = ("QwenImagePipeline",)
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                           "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")
    default_guidance_scale = 4.0  # QwenImagePipeline.__call__'s true_cfg_scale
    supports_cfg = True
    default_max_sequence_length = 512  # QwenImagePipeline.__call__'s default

    def __init__(self, pipeline: Any, device: torch.device):
        refuse_other_pipelines(type(self), pipeline)  # before anything reads the pipeline's components
        super().__init__(pipeline, device)

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** len(self.vae.temperal_downsample)  # as QwenImagePipeline.__init__ (the 3-D VAE's spatial factor)

    def resolution_multiple(self) -> int:
        return self.vae_scale_factor * 2  # latents are packed in 2×2 patches

    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> Conditioning:
        limit = self.pipeline.tokenizer_max_length  # 1024: QwenImagePipeline.check_inputs refuses longer
        if max_sequence_length > limit:
            raise ValueError(f"plugin.max_sequence_length is {max_sequence_length}; Qwen-Image takes at most {limit} "
                             "text tokens (and pads every prompt to this length: set it near the longest prompt)")
        embeds, mask = self.pipeline.encode_prompt(
            prompt=prompts, device=self.device, num_images_per_prompt=1, max_sequence_length=max_sequence_length,
        )
        return padded_text(embeds, mask, max_sequence_length)  # L: the longest prompt of the batch (≤ the limit)

    def noise_shape(self) -> tuple[int, ...]:
        return (1, self.transformer.config.in_channels // 4, *self.latent_size())  # [frames = 1, C, h, w]

    def pack(self, noise: Tensor) -> Tensor:
        n, _, channels, height, width = noise.shape
        return self.pipeline._pack_latents(noise, n, channels, height, width)  # [n, h/2·w/2, 4C]

    def unpack(self, latents: Tensor) -> Tensor:
        height, width = self.size
        return self.pipeline._unpack_latents(latents, height, width, self.vae_scale_factor)  # [n, C, 1, h, w]

    def image_seq_len(self) -> int:
        rows, columns = self._token_grid()
        return rows * columns

    def _token_grid(self) -> tuple[int, int]:
        """``(h/2, w/2)``: rows and columns of the packed tokens, the pipeline's ``img_shapes`` entry."""
        h, w = self.latent_size()
        return h // 2, w // 2

    def default_sigmas(self, num_steps: int) -> list[float]:
        return np.linspace(1.0, 1 / num_steps, num_steps).tolist()  # as QwenImagePipeline.__call__

    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        return self._transformer(module, latents, [self._checked_grid(latents)], timesteps, conditioning,
                                 guidance_scale)

    def _checked_grid(self, latents: Tensor) -> tuple[int, int, int]:
        """``(1, h/2, w/2)``, the ``img_shapes`` entry of the generated image, checked against ``latents``."""
        rows, columns = self._token_grid()
        if rows * columns != latents.shape[1]:
            raise ValueError(f"Qwen-Image adapter: {latents.shape[1]} latent tokens, but a {self.height}x{self.width} "
                             f"image has {rows * columns} ({rows} x {columns})")
        return 1, rows, columns

    def _transformer(self, module: nn.Module, tokens: Tensor, shapes: list[tuple[int, int, int]], timesteps: Tensor,
                     conditioning: Conditioning, guidance_scale: float) -> Tensor:
        """The transformer on image ``tokens`` ``[n, T, 4C]`` laid out as ``shapes`` (the images in sequence)."""
        n = tokens.shape[0]
        guidance = None
        if self.transformer.config.guidance_embeds:  # as the pipeline; no released Qwen-Image is guidance-distilled
            guidance = torch.full((n,), guidance_scale, device=tokens.device, dtype=torch.float32)
        return module(
            hidden_states=tokens,
            timestep=timesteps.to(tokens.dtype) / 1000,  # QwenImagePipeline passes t/1000 in the latents' dtype
            guidance=guidance,
            encoder_hidden_states=conditioning["prompt_embeds"],
            encoder_hidden_states_mask=conditioning["prompt_embeds_mask"].bool(),
            img_shapes=[shapes] * n,  # as QwenImagePipeline: (frames, h/2, w/2) per image, per sample
            return_dict=False,
        )[0]

    def combine_guidance(self, uncond: Tensor, cond: Tensor, guidance_scale: float) -> Tensor:
        """Qwen-Image's rescale of the guided velocity: each token's guided velocity (``[n, tokens, 4C]``) is scaled
        to the norm of its conditional velocity (QwenImagePipeline.__call__)."""
        guided = super().combine_guidance(uncond, cond, guidance_scale)
        return guided * (cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        vae = self.vae
        latents = self.unpack(latents).to(vae.dtype)  # [n, C, 1, h, w]
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        latents = latents / inverse_std + mean  # the pipeline's order of operations
        images = vae.decode(latents, return_dict=False)[0][:, :, 0]  # [n, 3, H, W], the only frame
        return (images.float() / 2 + 0.5).clamp(0, 1)


def padded_text(embeds: Tensor, mask: Tensor | None, max_sequence_length: int) -> Conditioning:
    """The pipeline's text encoding ``[n, L, D]`` (and its mask ``[n, L]``, None when the pipeline dropped an
    all-ones one) zero-padded to ``max_sequence_length`` ≥ L, with ``prompt_embeds_mask`` marking the real tokens."""
    n, length, width = embeds.shape
    if mask is None:
        mask = torch.ones(n, length, dtype=torch.long, device=embeds.device)
    padded = embeds.new_zeros(n, max_sequence_length, width)  # [n, L_max, D]
    padded[:, :length] = embeds
    padded_mask = mask.new_zeros(n, max_sequence_length)  # [n, L_max], 1 = a real token
    padded_mask[:, :length] = mask
    return {"prompt_embeds": padded, "prompt_embeds_mask": padded_mask}
