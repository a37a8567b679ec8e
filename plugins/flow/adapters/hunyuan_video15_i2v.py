"""HunyuanVideo 1.5 image-to-video (``HunyuanVideo15ImageToVideoPipeline``): the text-to-video model's transformer
layout (:mod:`~mmrl.plugins.flow.adapters.hunyuan_video15`) with its condition channels and image slots filled from an
input image, the video's first frame.

What the adapter reproduces from ``HunyuanVideo15ImageToVideoPipeline.__call__`` (diffusers 0.42.1,
``pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5_image2video.py``) besides what it shares with text-to-video
(prompts of both encoders, noise, σ grid, the guider's CFG, decode: :class:`HunyuanVideo15Adapter`):

- the image's size: ``video_processor.resize(image, height, width, resize_mode="crop")`` (scaled to cover the
  size, then centre-cropped). The pipeline takes no height and width: it picks them from the image's aspect ratio,
  the nearest of ``calculate_default_height_width``'s buckets at area ``transformer.config.target_size``² (480 or 720
  px, multiples of 16). mmrl generates at the run's ``height`` × ``width`` (or, with ``plugin.buckets``, at the
  bucket nearest the image's aspect ratio) and crops the image to that size the same way; listing the pipeline's own
  buckets in ``plugin.buckets`` gives its sizes (``get_closest_ratio`` looks on the square side of the image's ratio
  only, mmrl on both, so a row between two buckets can take the neighbouring one).
- the condition latents (``prepare_cond_latents_and_mask`` and ``_get_image_latents``): the cropped image through
  ``video_processor.preprocess`` (to [-1, 1]), one frame through the VAE, its mode (``sample_mode="argmax"``:
  deterministic) times ``scaling_factor``, on the first latent frame of the C condition channels and zeros on the
  others; the mask channel is one on the first latent frame and zero after it. Each step's input is
  ``[latents; condition latents; mask]`` along the channels, the same in both halves of the CFG call.
- ``image_embeds`` (``encode_image`` / ``_get_image_embeds``): the image encoder's (SigLIP,
  ``SiglipVisionModel``) ``last_hidden_state`` of the cropped image after the pipeline's ``feature_extractor``
  (``SiglipImageProcessor``, which resizes it to its own input size), in the transformer's dtype: 729 tokens of 1152
  for the released SigLIP. Non-zero, so the transformer attends to them (its ``is_t2v`` switch is off). The same
  features condition both halves of the CFG call, as the pipeline's guider passes them.
- after sampling: nothing. The pipeline decodes the sampled latents as they are (the first latent frame is not put
  back to the image's), so :meth:`~mmrl.plugins.flow.adapters.base.FlowAdapter.finalize` stays the identity and the
  video's first frame is the model's rendering of the image.

The image's VAE latents ``[1, C, 1, h, w]`` and SigLIP features ``[1, T, D]`` are encoded once per image and size by
the plugin's condition-image cache (:mod:`~mmrl.plugins.flow.condition_images`); the condition channels are built
from them at each call, at the video's latent frame count. Not reproduced: ``use_meanflow`` transformers (the
pipeline passes the next step's timestep as ``timestep_r``, which a per-step transformer call does not know: the
``480p_i2v_step_distilled`` conversion) are refused in one line.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mmrl.plugins.flow.adapters.base import Conditioning
from mmrl.plugins.flow.adapters.hunyuan_video15 import HunyuanVideo15Adapter


class HunyuanVideo15ImageToVideoAdapter(HunyuanVideo15Adapter):
    """Adapter for ``HunyuanVideo15ImageToVideoPipeline``: hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v (the
    pipeline's example), the 720p and CFG-distilled conversions and fine-tunes with the same pipeline class; one
    input image per row, the first frame of the video."""

    name = "hunyuan_video15_i2v"
    pipeline_classes = ("HunyuanVideo15ImageToVideoPipeline",)
    image_conditioned = True

    def __init__(self, pipeline: Any, device: torch.device):
        super().__init__(pipeline, device)
        if bool(pipeline.transformer.config.get("use_meanflow", False)):
            raise ValueError(f"{self.name} adapter: the transformer has use_meanflow, for which the pipeline passes "
                             "the next step's timestep as timestep_r; the adapter reproduces transformers without it")
        for component in ("image_encoder", "feature_extractor"):
            if getattr(pipeline, component, None) is None:
                raise ValueError(f"{self.name} adapter: the pipeline has no {component}; image-to-video needs the "
                                 "image encoder (SigLIP) and its feature_extractor for image_embeds")

    def encode_condition_images(self, images: list[Any]) -> tuple[Conditioning, Tensor]:
        """The rows' conditioning from their first frames ``images`` (PIL) at :attr:`size`: ``image_latents
        [n, C, 1, h, w]`` (the VAE latents of the cropped image times ``scaling_factor``, float32) and
        ``image_embeds [n, T, D_image]`` (the image encoder's last hidden state, in the transformer's dtype); and
        the cropped images as the model saw them, ``[n, 3, H, W]`` in [0, 1]."""
        height, width = self.size
        pipeline = self.pipeline
        processor = pipeline.video_processor
        # __call__'s crop to its (height, width), here the run's or the row's bucket's
        cropped = [processor.resize(image.convert("RGB"), height=height, width=width, resize_mode="crop")
                   for image in images]
        # One image per VAE call, as the pipeline encodes it: the VAE's mid-block attention (diffusers 0.42.1) does
        # not take a batch of several videos.
        latents = torch.cat([
            pipeline._get_image_latents(vae=self.vae, image_processor=processor, image=image, height=height,
                                        width=width, device=self.device).float()
            for image in cropped
        ])  # [n, C, 1, h, w], already times scaling_factor
        embeds = pipeline.encode_image(image=cropped, batch_size=1, device=self.device,
                                       dtype=self.transformer.dtype)  # [n, T, D_image]
        pixels = processor.preprocess(cropped, height=height, width=width).to(self.device, torch.float32)
        return {"image_latents": latents, "image_embeds": embeds}, (pixels / 2 + 0.5).clamp(0, 1)  # [n, 3, H, W]

    def condition_inputs(self, latents: Tensor, conditioning: Conditioning) -> tuple[Tensor, Tensor]:
        """``prepare_cond_latents_and_mask``'s ``[condition latents; mask]`` ``[n, C + 1, F_lat, h, w]``: the image's
        latents on the first latent frame, zeros after it, the mask one on the first latent frame only; and the
        image's features as ``image_embeds``, both in the latents' dtype (the pipeline's transformer dtype)."""
        n, channels, frames, height, width = latents.shape  # [n, C, F_lat, h, w]
        first = conditioning["image_latents"].to(latents.dtype)  # [n, C, 1, h, w]
        if first.shape[1:] != (channels, 1, height, width):
            raise ValueError(f"{self.name} adapter: the image latents are {tuple(first.shape[1:])}, the video's "
                             f"latents need ({channels}, 1, {height}, {width}); encode the image at the video's size")
        condition = torch.cat([first, latents.new_zeros(n, channels, frames - 1, height, width)], dim=2)
        mask = latents.new_zeros(n, 1, frames, height, width)  # [n, 1, F_lat, h, w]
        mask[:, :, 0] = 1  # the first latent frame is given
        return torch.cat([condition, mask], dim=1), conditioning["image_embeds"].to(latents.dtype)
