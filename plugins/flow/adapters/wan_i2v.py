"""Wan image-to-video (``WanImageToVideoPipeline``): Wan 2.1 I2V (one transformer that also cross-attends to CLIP
image features), Wan 2.2 I2V-A14B (two experts, no image encoder) and Wan 2.2 TI2V-5B given an image. The video
starts from an input image. Wan 2.1 and Wan 2.2 A14B: the image, followed by black frames, is encoded by the video
VAE into a condition video that is concatenated with the noisy latents along the channels, together with a mask
that marks the first frame as given. TI2V-5B (``expand_timesteps``): the image's latent frame replaces the first
latent frame of the model's input at every step, those tokens get timestep 0, and it is put back before decoding.

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
- TI2V-5B (``expand_timesteps``): the condition is the image alone encoded as a one-frame video ``[C, 1, h, w]``;
  the model's input is ``(1 − m)·condition + m·latents`` with ``m`` zero on the first latent frame, its timesteps
  ``m[:, ::2, ::2]·t`` per token (0 for the first frame's tokens), and the sampled latents get the condition frame
  back before the VAE (:meth:`WanImageToVideoAdapter.finalize`). The SDE steps, and the log-probs count, every
  latent element, the first frame's too, as the pipeline's scheduler steps them and Flow-Factory's log-probs count
  them (its ``wan2_i2v.py`` ``forward``): those elements never reach the video, so they are noise in the ratio, not
  signal.

First and last frame (the pipeline's ``last_image``; Wan-AI/Wan2.1-FLF2V-14B-720P-Diffusers, and Wan 2.2 I2V-A14B):
a row's ``"last_image"`` ends the condition video, ``[image, F − 2 black frames, last image]``, encoded together, and
the mask is one on the last frame too (``prepare_latents``); Wan2.1-FLF2V's transformer reads both images' CLIP
features side by side (``encode_image([image, last_image])``: its image embedder joins each pair with a learned
position embedding, ``pos_embed_seq_len``), so every one of its rows needs a last image; rows with and without one
mix in a batch for Wan 2.2 I2V-A14B. Refused for TI2V-5B, whose pipeline ignores ``last_image``, and for Wan 2.1 I2V,
whose image embedder reads one image. Flow-Factory trains Wan image-to-video the same
way (X-GenGroup/Flow-Factory@a0b2bc5, ``src/flow_factory/models/wan/wan2_i2v.py``); its LoRA targets, like this
adapter's, are the Wan text-to-video adapter's (the image cross-attention's ``add_k_proj``/``add_v_proj`` of Wan 2.1
I2V are not adapted by default: add them to ``lora.target_modules``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning, load_pipeline
from mmrl.plugins.flow.adapters.wan import WanAdapter


class WanImageToVideoAdapter(WanAdapter):
    """Adapter for ``WanImageToVideoPipeline``: Wan-AI/Wan2.1-I2V-14B-480P-Diffusers (and 720P), Wan-AI/Wan2.2-I2V-
    A14B-Diffusers, Wan-AI/Wan2.2-TI2V-5B-Diffusers (``expand_timesteps``) and fine-tunes; one input image per row,
    the first frame of the video."""

    name = "wan_i2v"
    pipeline_classes = ("WanImageToVideoPipeline",)
    image_conditioned = True
    takes_last_image = True

    @classmethod
    def from_pretrained(cls, model: str, *, dtype: torch.dtype, device: torch.device) -> WanImageToVideoAdapter:
        """Load the pipeline at ``model``; a ``WanPipeline`` with ``expand_timesteps`` (Wan 2.2 TI2V-5B, whose
        ``model_index.json`` names ``WanPipeline``: one checkpoint for text- and image-to-video) becomes a
        ``WanImageToVideoPipeline`` of the same components and config, as ``WanImageToVideoPipeline.from_pretrained``
        loads it (Flow-Factory's image-to-video model does so for TI2V-5B: X-GenGroup/Flow-Factory@a0b2bc5,
        ``src/flow_factory/models/wan/wan2_i2v.py:84-85``, ``examples/grpo/lora/wan22/i2v.yaml:34``). Any other
        class reaches the adapter as loaded, and one it does not drive is refused there, naming the adapter that
        drives it (a Wan 2.1 text-to-video ``WanPipeline``: ``wan``, its transformer takes no image condition)."""
        pipeline = load_pipeline(model, dtype)
        if type(pipeline).__name__ == "WanPipeline" and pipeline.config.get("expand_timesteps", False):
            from diffusers import WanImageToVideoPipeline

            pipeline = WanImageToVideoPipeline(**pipeline.components, expand_timesteps=True,
                                               boundary_ratio=pipeline.config.get("boundary_ratio"))
            pipeline.set_progress_bar_config(disable=True)
        return cls(pipeline, device)

    @property
    def reads_image_pairs(self) -> bool:
        """Whether the transformer's image embedder reads two images' CLIP features per sample (Wan2.1-FLF2V:
        ``pos_embed_seq_len``)."""
        return self.pipeline.transformer.config.get("pos_embed_seq_len") is not None

    def last_image_problem(self, with_last: int, rows: int) -> str | None:
        """Why ``with_last`` of the run's ``rows`` prompt rows naming a ``"last_image"`` cannot run, or None."""
        if self.reads_image_pairs and with_last < rows:
            return (f"{rows - with_last} of {rows} rows have no 'last_image', which this transformer (Wan2.1-FLF2V: "
                    "two images' features per sample) needs in every row")
        if with_last and self.num_frames < 2:
            return (f"rows name a 'last_image', but a video of {self.num_frames} frame has no last frame apart from "
                    "its first: plugin.num_frames must be larger")
        if with_last and self.expand_timesteps:
            return "rows name a 'last_image', which Wan 2.2 TI2V-5B's pipeline ignores (it conditions on the first"\
                   " frame only)"
        if with_last and self.pipeline.transformer.config.image_dim is not None and not self.reads_image_pairs:
            return ("rows name a 'last_image', but this transformer's image embedder reads one image per sample "
                    "(Wan 2.1 I2V; first-and-last-frame needs Wan2.1-FLF2V or Wan 2.2 I2V-A14B)")
        return None

    def noise_shape(self) -> tuple[int, ...]:
        # prepare_latents draws z_dim channels; the transformer's in_channels also count the condition and its mask
        return (self.vae.config.z_dim, self.latent_frames(self.num_frames), *self.latent_size())

    def encode_condition_images(self, images: list[Any], last_images: list[Any] | None = None
                                ) -> tuple[Conditioning, Tensor]:
        """The rows' conditioning from their first frames ``images`` and, where given, their last frames
        (``last_images[i]``: a PIL image or None); the images as the model saw them, ``[n, 3, H, W]``, or with
        ``last_images`` ``[n, 2, 3, H, W]`` (first, last; zeros where a row has none)."""
        height, width = self.size
        frames, vae = self.num_frames, self.vae
        processor = self.pipeline.video_processor
        pixels = processor.preprocess(images, height=height, width=width)
        pixels = pixels.to(self.device, torch.float32)  # [n, 3, H, W] in [-1, 1]
        n = pixels.shape[0]
        has_last = [False] * n if last_images is None else [image is not None for image in last_images]
        last = pixels.new_zeros(n, 3, height, width)  # [n, 3, H, W]: the given last frames, zero elsewhere
        if any(has_last):
            given = [i for i in range(n) if has_last[i]]
            assert last_images is not None
            last[given] = processor.preprocess([last_images[i] for i in given], height=height,
                                               width=width).to(self.device, torch.float32)
        video = pixels.unsqueeze(2)  # [n, 3, 1, H, W]: TI2V-5B encodes the image alone
        if not self.expand_timesteps:  # the image, then black frames (the last one the last image where given)
            video = torch.cat([video, pixels.new_zeros(n, 3, frames - 1, height, width)], dim=2)
            if any(has_last):
                video[:, :, -1] = last  # zero where a row has none: the black (0) frame the pipeline puts there
        latents = vae.encode(video.to(vae.dtype)).latent_dist.mode().float()  # [n, C, F_lat, h, w]
        mean, inverse_std = self.latent_statistics(latents.device, torch.float32)
        latents = (latents - mean) * inverse_std  # the pipeline's order of operations, in float32
        if self.expand_timesteps:  # [n, C, 1, h, w]: the first latent frame of every step's input
            return {"image_condition": latents}, (pixels / 2 + 0.5).clamp(0, 1)
        temporal, (h, w) = self.temporal_scale_factor, latents.shape[3:]
        mask = torch.zeros(n, 1, frames, h, w, device=latents.device)  # [n, 1, F, h, w]: 1 on the given frames
        mask[:, :, 0] = 1
        mask[torch.tensor(has_last, device=latents.device), :, -1] = 1
        mask = torch.cat([mask[:, :, :1].repeat_interleave(temporal, dim=2), mask[:, :, 1:]], dim=2)
        mask = mask.view(n, -1, temporal, h, w).transpose(1, 2)  # [n, t, F_lat, h, w]
        conditioning = {"image_condition": torch.cat([mask, latents], dim=1)}  # [n, t + C, F_lat, h, w]
        if self.reads_image_pairs:  # Wan2.1-FLF2V: both images' CLIP features, first then last, per row
            if not all(has_last):
                raise ValueError("Wan2.1-FLF2V reads a last image for every sample; a row has none")
            assert last_images is not None
            pairs = [image for pair in zip(images, last_images, strict=True) for image in pair]
            features = self.pipeline.encode_image(pairs, self.device)  # [2n, 257, D_image]
            conditioning["image_embeds"] = features.view(n, 2, *features.shape[1:])  # [n, 2, 257, D_image]
        elif self.pipeline.transformer.config.image_dim is not None:  # Wan 2.1 I2V: the original image's features
            conditioning["image_embeds"] = self.pipeline.encode_image(images, self.device)  # [n, 257, D_image]
        seen = (pixels / 2 + 0.5).clamp(0, 1)
        if last_images is None:
            return conditioning, seen
        return conditioning, torch.stack([seen, (last / 2 + 0.5).clamp(0, 1) * torch.tensor(
            has_last, device=last.device, dtype=last.dtype).view(n, 1, 1, 1)], dim=1)  # [n, 2, 3, H, W]

    def _first_frame_mask(self, latents: Tensor) -> Tensor:
        """``[1, 1, F_lat, h, w]``: 0 on the first latent frame (given by the image), 1 elsewhere (TI2V-5B)."""
        mask = torch.ones(1, 1, *latents.shape[2:], device=latents.device, dtype=torch.float32)
        mask[:, :, 0] = 0
        return mask

    def finalize(self, latents: Tensor, conditioning: Conditioning) -> Tensor:
        """TI2V-5B: the first latent frame becomes the image's again, as the pipeline does after its loop."""
        if not self.expand_timesteps:
            return latents
        mask = self._first_frame_mask(latents)
        return (1 - mask) * conditioning["image_condition"].to(latents) + mask * latents

    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        if self.expand_timesteps:  # the condition frame in the input, its tokens at timestep 0
            mask = self._first_frame_mask(latents)
            given = (1 - mask) * conditioning["image_condition"].float() + mask * latents.float()
            per_token = mask[0, 0, :, ::2, ::2].flatten()  # [F_lat · ⌈h/2⌉ · ⌈w/2⌉], as the pipeline's temp_ts
            return module(hidden_states=given.to(latents.dtype), timestep=timesteps.float()[:, None] * per_token,
                          encoder_hidden_states=conditioning["prompt_embeds"], return_dict=False)[0]
        both = torch.cat([latents, conditioning["image_condition"].to(latents.dtype)], dim=1)  # [n, 2C + t, ...]
        image = conditioning.get("image_embeds")
        if image is not None and image.dim() == 4:  # Wan2.1-FLF2V: [n, 2, 257, D] → [2n, 257, D], pairs in order
            image = image.flatten(0, 1)
        return module(
            hidden_states=both,
            timestep=timesteps,  # [n] raw t in [0, 1000], as the pipeline passes t.expand(batch)
            encoder_hidden_states=conditioning["prompt_embeds"],
            **({} if image is None else {"encoder_hidden_states_image": image.to(latents.dtype)}),
            return_dict=False,
        )[0]
