"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``): an MMDiT on 16-channel latents, text from two CLIP
encoders (pooled + hidden states) and T5, true classifier-free guidance with a negative prompt.

Defaults follow Flow-GRPO's SD3.5-Medium recipes (Liu et al. 2025, arXiv:2505.05470): guidance 4.5 and LoRA on
the joint-attention projections of the image and text streams.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning, FlowAdapter, refuse_other_pipelines


class SD3Adapter(FlowAdapter):
    """Adapter for ``StableDiffusion3Pipeline`` (SD3-Medium, SD3.5-Medium/Large/Turbo)."""

    name = "sd3"
    pipeline_classes = ("StableDiffusion3Pipeline",)
    # Flow-GRPO's SD3.5 LoRA targets: q/k/v/out of the image stream and of the added (text) stream.
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
    default_guidance_scale = 4.5
    supports_cfg = True
    default_max_sequence_length = 256  # StableDiffusion3Pipeline's default

    def __init__(self, pipeline: Any, device: torch.device):
        refuse_other_pipelines(type(self), pipeline)  # before anything reads the pipeline's components
        super().__init__(pipeline, device)

    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> Conditioning:
        prompt_embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, num_images_per_prompt=1,
            do_classifier_free_guidance=False, max_sequence_length=max_sequence_length,
        )
        # prompt_embeds [n, 77 + L, D_joint] (CLIP hidden states padded to T5's width, then T5); pooled [n, D_pool]
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def noise_shape(self) -> tuple[int, ...]:
        return (self.transformer.config.in_channels, *self.latent_size())  # [C, H/8, W/8]

    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        return module(
            hidden_states=latents,  # [n, C, h, w]
            timestep=timesteps,  # [n], σ·1000
            encoder_hidden_states=conditioning["prompt_embeds"],
            pooled_projections=conditioning["pooled_prompt_embeds"],
            return_dict=False,
        )[0]
