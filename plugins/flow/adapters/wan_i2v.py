"""Wan image-to-video (``WanImageToVideoPipeline``): Wan 2.1 I2V (one transformer that also cross-attends to CLIP
image features) and Wan 2.2 I2V-A14B (two experts, no image encoder). The video starts from an input image: the
image, followed by black frames, is encoded by the video VAE into a condition video that is concatenated with the
noisy latents along the channels, together with a mask that marks the first frame as given.

What the adapter reproduces from ``WanImageToVideoPipeline.__call__`` (diffusers 0.42) besides Wan's prompts,
schedule, experts, guidance and decode (:class:`~mmrl.plugins.flow.adapters.wan.WanAdapter`):

- the condition (``prepare_latents``): the image resized to the run's ``height`` × ``width`` by the pipeline's video
  processor, then ``[image, F − 1 black frames]`` encoded with the VAE's mode (``sample_mode="argmax"``:
  deterministic), normalised by (x − mean)/std in float32; the mask ``[n, t, F_lat, h, w]`` (t the VAE's temporal
  factor: the first frame's mask repeated t times so that it fills the first latent frame) is one on the first
  latent frame and zero after it; ``condition = [mask; latents of the condition video]``.
- each step: the transformer's ``hidden_states`` are ``[noisy latents; condition]`` along the channels (its
  ``in_channels`` = 2·C + t), and with an image encoder (Wan 2.1 I2V) ``encoder_hidden_states_image`` is the CLIP
  vision tower's second-to-last hidden state of the original image (``encode_image``), the same in both halves of
  the CFG call.
- noise ``[C, F_lat, h, w]`` with C the VAE's ``z_dim`` (the transformer's ``in_channels`` counts the condition too).

Not supported: ``expand_timesteps`` (Wan 2.2 TI2V-5B image-to-video, where the first latent frame is replaced by the
image and its tokens get timestep 0; train TI2V-5B text-to-video with the ``wan`` adapter) and ``last_image``
(first-and-last-frame interpolation). Flow-Factory trains Wan image-to-video the same way (X-GenGroup/Flow-Factory@
a0b2bc5, ``src/flow_factory/models/wan/wan2_i2v.py``); its LoRA targets, like this adapter's, are the Wan
text-to-video adapter's (the image cross-attention's ``add_k_proj``/``add_v_proj`` of Wan 2.1 I2V are not adapted
by default: add them to ``lora.target_modules``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning
from mmrl.plugins.flow.adapters.wan import WanAdapter


class WanImageToVideoAdapter(WanAdapter):
    """Adapter for ``WanImageToVideoPipeline``: Wan-AI/Wan2.1-I2V-14B-480P-Diffusers (and 720P), Wan-AI/Wan2.2-I2V-
    A14B-Diffusers and fine-tunes; one input image per row, the first frame of the video."""

    name = "wan_i2v"
    pipeline_classes = ("WanImageToVideoPipeline",)
    image_conditioned = True

    def __init__(self, pipeline: Any, device: torch.device):
        super().__init__(pipeline, device)
        if self.expand_timesteps:
            raise ValueError("wan_i2v adapter: this pipeline has expand_timesteps (Wan 2.2 TI2V-5B image-to-video: the "
                             "first latent frame replaced by the image at timestep 0), which is not supported; train "
                             "TI2V-5B text-to-video with the wan adapter")

    def noise_shape(self) -> tuple[int, ...]:
        # prepare_latents draws z_dim channels; the transformer's in_channels also count the condition and its mask
        return (self.vae.config.z_dim, self.latent_frames(self.num_frames), *self.latent_size())

    def encode_condition_images(self, images: list[Any]) -> tuple[Conditioning, Tensor]:
        height, width = self.size
        frames, vae = self.num_frames, self.vae
        pixels = self.pipeline.video_processor.preprocess(images, height=height, width=width)
        pixels = pixels.to(self.device, torch.float32)  # [n, 3, H, W] in [-1, 1]
        n = pixels.shape[0]
        video = torch.cat([pixels.unsqueeze(2), pixels.new_zeros(n, 3, frames - 1, height, width)], dim=2)
        latents = vae.encode(video.to(vae.dtype)).latent_dist.mode().float()  # [n, C, F_lat, h, w]
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device)
        latents = (latents - mean) * inverse_std  # the pipeline's order of operations, in float32
        temporal, (h, w) = self.temporal_scale_factor, latents.shape[3:]
        mask = torch.zeros(n, 1, frames, h, w, device=latents.device)  # [n, 1, F, h, w]: 1 on the given frame
        mask[:, :, 0] = 1
        mask = torch.cat([mask[:, :, :1].repeat_interleave(temporal, dim=2), mask[:, :, 1:]], dim=2)
        mask = mask.view(n, -1, temporal, h, w).transpose(1, 2)  # [n, t, F_lat, h, w]
        conditioning = {"image_condition": torch.cat([mask, latents], dim=1)}  # [n, t + C, F_lat, h, w]
        if self.pipeline.transformer.config.image_dim is not None:  # Wan 2.1 I2V: CLIP features of the original image
            conditioning["image_embeds"] = self.pipeline.encode_image(images, self.device)  # [n, 257, D_image]
        return conditioning, (pixels / 2 + 0.5).clamp(0, 1)

    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        both = torch.cat([latents, conditioning["image_condition"].to(latents.dtype)], dim=1)  # [n, 2C + t, ...]
        image = conditioning.get("image_embeds")
        return module(
            hidden_states=both,
            timestep=timesteps,  # [n] raw t in [0, 1000], as the pipeline passes t.expand(batch)
            encoder_hidden_states=conditioning["prompt_embeds"],
            **({} if image is None else {"encoder_hidden_states_image": image.to(latents.dtype)}),
            return_dict=False,
        )[0]
