"""Wan 2.1 text-to-video (``WanPipeline``): a 3-D diffusion transformer on 5-D latents ``[B, C, F, h, w]`` of a causal
video VAE (8× spatial, 4× temporal compression: F frames become (F − 1)/4 + 1 latent frames), text from a UMT5
encoder, true classifier-free guidance and a fixed flow shift.

What the adapter reproduces from ``WanPipeline.__call__`` (diffusers 0.42):

- prompts: ``pipeline.encode_prompt`` (``prompt_clean``, UMT5 with the attention mask, the real tokens kept and
  zero-padded to ``max_sequence_length``; the transformer sees no mask, as in the pipeline). Every prompt is padded
  to the same length by the pipeline itself, so cached rows are the pipeline's rows.
- noise ``[C, (F − 1)/t + 1, h, w]`` per sample (``prepare_latents``: h = H / ``scale_factor_spatial``,
  t = ``scale_factor_temporal`` of the VAE config), float32, one draw per sample generator.
- schedule: the released Wan checkpoints ship ``UniPCMultistepScheduler`` (a second-order multistep solver with
  ``use_flow_sigmas`` and ``flow_shift``: 3.0 for Wan2.1-T2V-1.3B). The plugin's sampler is a first-order SDE/ODE,
  so the adapter builds ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)`` from it and takes σ and timesteps
  from that, as the pipeline does with this scheduler swapped in (the equality test swaps it the same way). A
  pipeline that already ships the Euler scheduler is used as is.
- the transformer gets the raw timestep t (in [0, 1000], not t / 1000) and the padded text embeddings.
- guidance: v = v_u + w·(v_c − v_u) (the base class's one ``[uncond; cond]`` call; the pipeline makes two calls).
  The pipeline guides when ``guidance_scale > 1``; the plugin when ``plugin.cfg`` is on (default: on, scale 5.0).
- decode: latents·std + mean per channel (``latents_mean``/``latents_std``), the VAE decode one sample at a time
  (a 33-frame 480×832 video's decoder activations dominate memory), ``[N, 3, F, H, W]`` in [0, 1] as
  ``output_type="pt"`` (which returns ``[N, F, 3, H, W]``: the plugin keeps the channel axis second).

- size: frames of ``plugin.height`` × ``plugin.width`` pixels (Wan 2.1's native 480p is 480 × 832), each a multiple
  of 16: ``WanPipeline.check_inputs`` refuses anything else, and 16 is also the VAE factor × patch of the released
  models (``__call__``'s ``h_multiple_of``/``w_multiple_of``).

Not covered: Wan 2.2's two-expert pipelines (``transformer_2`` with ``boundary_ratio``) and its per-token timesteps
(``expand_timesteps``, TI2V-5B); both are refused when the adapter is built.

DanceGRPO's released Wan 2.1 trainer runs the same model with the same guidance combination and raw integer
timesteps (XueZeyue/DanceGRPO, fastvideo/train_grpo_wan_2_1.py, ``run_sample_step``, commit 15cc71d5).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning, FlowAdapter


class WanAdapter(FlowAdapter):
    """Adapter for ``WanPipeline`` (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, Wan2.1-T2V-14B-Diffusers and fine-tunes)."""

    name = "wan"
    pipeline_classes = ("WanPipeline",)
    # Self- and cross-attention projections and both feed-forward linears of every block (diffusers' Wan LoRA
    # layout: blocks.N.attn1/attn2.to_q/k/v/out.0, blocks.N.ffn.net.0.proj/net.2).
    lora_target_modules = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                           "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
                           "ffn.net.0.proj", "ffn.net.2")
    default_guidance_scale = 5.0  # WanPipeline.__call__'s guidance_scale
    supports_cfg = True
    default_max_sequence_length = 512  # WanPipeline.__call__'s default
    output = "videos"
    default_num_frames = 33
    #: Videos per VAE decode call. One bounds memory (a 33-frame 480×832 video's decoder activations take GBs);
    #: for tiny videos, where the per-call overhead dominates, a larger value decodes as the pipeline does.
    decode_batch_size = 1

    def __init__(self, pipeline: Any, device: torch.device):
        super().__init__(pipeline, device)
        config = pipeline.config
        if getattr(pipeline, "transformer_2", None) is not None or config.get("boundary_ratio") is not None:
            raise ValueError("wan adapter: this WanPipeline has two experts (transformer_2, boundary_ratio: Wan 2.2); "
                             "only single-transformer Wan 2.1 pipelines are supported")
        if config.get("expand_timesteps", False):
            raise ValueError("wan adapter: this WanPipeline uses per-token timesteps (expand_timesteps: Wan 2.2 "
                             "TI2V); only Wan 2.1 text-to-video pipelines are supported")
        self.scheduler = euler_scheduler_for(pipeline.scheduler)

    # ------------------------------------------------------------------ geometry
    @property
    def vae_scale_factor(self) -> int:
        return int(self.vae.config.scale_factor_spatial)  # WanPipeline.vae_scale_factor_spatial

    @property
    def temporal_scale_factor(self) -> int:
        return int(self.vae.config.scale_factor_temporal)  # WanPipeline.vae_scale_factor_temporal

    def resolution_multiple(self) -> int:
        _, patch_h, patch_w = self.transformer.config.patch_size  # (frames, height, width)
        # WanPipeline.check_inputs refuses sides that are not multiples of 16 whatever the model, and __call__ rounds
        # each side down to a multiple of VAE factor × patch (h_multiple_of, w_multiple_of): both must hold.
        return math.lcm(16, self.vae_scale_factor * patch_h, self.vae_scale_factor * patch_w)

    def image_seq_len(self) -> int:
        _, patch_h, patch_w = self.transformer.config.patch_size
        h, w = self.latent_size()
        return self.latent_frames(self.num_frames) * (h // patch_h) * (w // patch_w)

    # ------------------------------------------------------------------ the five operations
    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> Conditioning:
        embeds, _ = self.pipeline.encode_prompt(
            prompt=prompts, do_classifier_free_guidance=False, num_videos_per_prompt=1,
            max_sequence_length=max_sequence_length, device=self.device,
        )
        return {"prompt_embeds": embeds}  # [n, max_sequence_length, D], zeros after each prompt's tokens

    def noise_shape(self) -> tuple[int, ...]:
        # [C, F_lat, H/8, W/8], as WanPipeline.prepare_latents
        return (self.transformer.config.in_channels, self.latent_frames(self.num_frames), *self.latent_size())

    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        return module(
            hidden_states=latents,  # [n, C, F_lat, h, w]
            timestep=timesteps,  # [n] raw t in [0, 1000], as WanPipeline passes t.expand(batch)
            encoder_hidden_states=conditioning["prompt_embeds"],
            return_dict=False,
        )[0]

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        vae = self.vae
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, vae.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, vae.dtype)
        videos = []
        for part in latents.to(vae.dtype).split(self.decode_batch_size):  # [b, C, F_lat, h, w]
            part = part / inverse_std + mean  # the pipeline's order of operations
            videos.append(vae.decode(part, return_dict=False)[0].float())  # [b, 3, F, H, W] in about [-1, 1]
        return (torch.cat(videos) / 2 + 0.5).clamp(0, 1)  # [N, 3, F, H, W]


def euler_scheduler_for(scheduler: Any) -> Any:
    """A first-order ``FlowMatchEulerDiscreteScheduler`` with the flow shift of ``scheduler``: the scheduler itself
    if it is one, else a new one built from the ``flow_shift`` and ``num_train_timesteps`` of its config (Wan's
    ``UniPCMultistepScheduler``); a scheduler with neither is refused."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return scheduler.__class__.from_config(scheduler.config)
    config = scheduler.config
    if config.get("flow_shift") is None or config.get("prediction_type") != "flow_prediction":
        raise ValueError(f"wan adapter: {type(scheduler).__name__} has no flow_shift with prediction_type "
                         "'flow_prediction'; expected Wan's UniPCMultistepScheduler or FlowMatchEulerDiscreteScheduler")
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=config.num_train_timesteps,
                                           shift=float(config.flow_shift))
