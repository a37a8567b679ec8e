"""LTX-2 image-to-audio-video (``LTX2ImageToVideoPipeline``): the text-to-audio-video model of
:mod:`~mmrl.plugins.flow.adapters.ltx2` (LTX-2, "LTX-2: Efficient Joint Audio-Visual Foundation Model",
arXiv:2601.03233) with the video's first latent frame given by an input image, the first frame of the video.

What the adapter reproduces from ``LTX2ImageToVideoPipeline.__call__`` (diffusers 0.42.1,
``pipelines/ltx2/pipeline_ltx2_image2video.py``) besides what it shares with text-to-audio-video (prompts through
Gemma 3 and the connectors, the σ grid, the x0-space guidance terms, the audio stream, decode and the payload's audio
``"audios"``/``"audio_sample_rate"`` for audio rewards, decoded from the finalized latents: :class:`LTX2Adapter`):

- the image: re-compressed as one H.264 frame at ``image_crf`` (``apply_image_conditioning_crf``, through PyAV; the
  default ``resolve_default_image_crf`` of the text encoder: 33 for the Gemma 3 checkpoints LTX-2 / LTX-2.3, 18 for
  Gemma 4 ones; 0 skips it), then ``video_processor.preprocess(image, height, width)``: resized to the video's size
  without keeping its aspect ratio (bilinear, the pipeline's processor) and scaled to [-1, 1]. One image per row.
- its latent (``prepare_latents``): the image through the video VAE as a one-frame video, the posterior's mode
  (``"argmax"``), normalised with the VAE's ``latents_mean``/``latents_std`` (``_normalize_latents`` with its default
  scaling factor 1, as the pipeline calls it; decoding divides by ``scaling_factor``, which is 1 in the released VAEs),
  in float32, packed to the first latent frame's h·w tokens ``[n, T_g, C]`` (T_g = h·w).
- the initial latents: the pipeline draws the whole video's noise ``[C, F_lat, h, w]`` from each generator (the
  first latent frame's too), then the audio's, and writes the image latent over the first latent frame
  (``init·mask + noise·(1 − mask)``, the conditioning mask 1 on the first latent frame's tokens). The same draw here
  (:meth:`LTX2Adapter.noise_shape`); :meth:`~LTX2ImageToVideoAdapter.pack` drops the first frame's noise.
- each transformer call: the image tokens in place, the per-token video timestep ``t·(1 − mask)`` ``[n, T_v]`` (the
  image's tokens at t = 0, the others at t), the audio at t (``audio_timestep``), ``sigma`` = t, as the pipeline
  passes them in its conditional, unconditional, STG and modality-isolation passes alike.
- guidance: in x0 space over all video tokens, the image's included (x̂₀ = x − σ·v with the step's σ for every
  token, so the guidance rescale's standard deviation counts them), as ``__call__`` combines it.
- the step: the pipeline unpacks the video, steps latent frames 1.. with the scheduler and puts frame 0 (the image
  latent, never changed) back in front, every step: the image's tokens stay the image latent from the first step to
  the last and are decoded as they are.

The latent contract: what the SDE and the log-prob cover. The pipeline holds the image's tokens fixed at every step,
so their transition is deterministic: x_next = x. Noise added to them would leave the pipeline's distribution, and a
Gaussian log-density on an action that is not sampled means nothing. So the adapter's latent, the tensor the
plugin's sampler, SDE, log-probs, KL and credit strategies see, holds only what the policy generates: the video
tokens of latent frames 1.. and the audio tokens, packed as text-to-audio-video packs them (``[n, T_v − T_g + T_a,
C]`` for equal token widths, else flat). The image's tokens live in the conditioning (``image_latents``):
:meth:`~LTX2ImageToVideoAdapter.velocity` puts them in front of the generated video tokens for the transformer and
the guidance, and returns the generated tokens' velocities; :meth:`~LTX2ImageToVideoAdapter.finalize` puts them back
for decoding. The plugin's per-element mean of the step's log-density is thus over the N_v − N_g + N_a generated
elements. No change to the sampler, the SDE or the plugin was needed: the excluded elements are simply not in the
latent.

Differences from Flow-Factory's LTX-2 image-to-audio-video adapter (X-GenGroup/Flow-Factory@a0b2bc5
``src/flow_factory/models/ltx2/ltx2_i2av.py``): it also keeps the first latent frame out of the SDE step (its
scheduler steps latent frames 1.. and frame 0 is put back), gives the image's tokens timestep 0 and combines the
guidance in x0 space over all tokens; but it steps the audio with a deterministic ODE outside the log-prob, where
mmrl makes the audio stochastic and scores it (as the ltx2 adapter, for the same reason: the policy's action is the
joint step). It preprocesses the image without the H.264 re-compression; mmrl re-compresses it as the pipeline does
(``adapter_options.image_crf: 0`` gives Flow-Factory's). Its ``use_cross_timestep`` defaults to False, the
pipeline's to True (mmrl's): with the video's per-token timesteps the two differ here (the video side of the
audio-to-video cross-attention is modulated by the audio's σ with it on, by each video token's timestep with it off).

Not reproduced: prompt enhancement (``enable_prompt_enhancement``), ``motion_speed`` (1: ``frame_rate`` is also the
RoPE rate), the two-stage path with given ``latents``; transformers with patch sizes other than 1 are refused (the
pipeline's conditioning mask and frame slicing assume one token per latent pixel).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import (
    Conditioning,
    GuidanceScale,
    encoded_latents,
    load_pipeline,
    refuse_other_pipelines,
)
from mmrl.plugins.flow.adapters.ltx2 import OPTIONS, LTX2Adapter

I2V_OPTIONS: dict[str, str] = {
    **OPTIONS,
    "image_crf": "the H.264 CRF the input image is re-compressed at before resizing, as the pipeline does (an "
                 "integer 0 to 51, 0 = none; default the text encoder's: 33 for Gemma 3, 18 for Gemma 4)",
}
"""``plugin.adapter_options`` keys of the ltx2_i2v adapter: the ltx2 adapter's and ``image_crf``."""


class LTX2ImageToVideoAdapter(LTX2Adapter):
    """Adapter for ``LTX2ImageToVideoPipeline``: LTX-2 / LTX-2.3 image-to-audio-video (Lightricks/LTX-2 and the
    diffusers conversions of LTX-2.3 loaded as this pipeline class); one input image per row, the video's first
    frame. The latent holds the generated tokens only (module docstring)."""

    name = "ltx2_i2v"
    pipeline_classes = ("LTX2ImageToVideoPipeline",)
    image_conditioned = True
    option_docs: ClassVar[dict[str, str]] = I2V_OPTIONS

    def __init__(self, pipeline: Any, device: torch.device):
        super().__init__(pipeline, device)
        config = pipeline.transformer.config
        if int(config.patch_size) != 1 or int(config.patch_size_t) != 1:
            raise ValueError(f"{self.name} adapter: the transformer's patch sizes are {config.patch_size} and "
                             f"{config.patch_size_t}; LTX2ImageToVideoPipeline's conditioning mask and first-frame "
                             "step take one token per latent pixel (both 1)")
        from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

        self.image_crf = int(resolve_default_image_crf(pipeline.text_encoder))  # __call__'s image_crf=None

    @classmethod
    def from_pretrained(cls, model: str, *, dtype: torch.dtype, device: torch.device) -> LTX2ImageToVideoAdapter:
        """Load the pipeline at ``model``; an ``LTX2Pipeline`` folder (Lightricks/LTX-2's model_index.json names it)
        becomes an ``LTX2ImageToVideoPipeline`` of the same components, as diffusers' example loads the checkpoint
        (``LTX2ImageToVideoPipeline.from_pretrained("Lightricks/LTX-2")``). The conversion comes before the adapter is
        built, so the pipeline-class check of :class:`LTX2Adapter` (``refuse_other_pipelines``) sees the class this
        adapter drives; another class is refused here, before anything is built."""
        pipeline = load_pipeline(model, dtype)
        name = type(pipeline).__name__
        if name == "LTX2Pipeline":
            from diffusers import LTX2ImageToVideoPipeline

            pipeline = LTX2ImageToVideoPipeline(**pipeline.components)
            pipeline.set_progress_bar_config(disable=True)
        else:  # another class: refused as every adapter refuses one, naming the adapter that drives it
            refuse_other_pipelines(cls, pipeline, accepted=(*cls.pipeline_classes, "LTX2Pipeline"))
        return cls(pipeline, device)

    def configure(self, options: dict[str, Any], *, cfg: bool) -> None:
        """The ltx2 adapter's options (:meth:`LTX2Adapter.configure`) and ``image_crf``; a CRF other than 0 needs
        PyAV (``pip install av``), checked here."""
        rest = dict(options)
        if "image_crf" in rest:
            value = rest.pop("image_crf")
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 51:
                raise ValueError(f"image_crf: {I2V_OPTIONS['image_crf']}; got {value!r}")
            self.image_crf = int(value)
        super().configure(rest, cfg=cfg)
        if self.image_crf:
            from diffusers.utils import is_av_available

            if not is_av_available():
                raise ValueError(f"image_crf: 0, or PyAV installed (pip install av) for the H.264 re-compression at "
                                 f"CRF {self.image_crf} that LTX2ImageToVideoPipeline applies to the input image")

    # ------------------------------------------------------------------ the generated tokens
    def given_tokens(self) -> int:
        """T_g, the video tokens the image gives: the first latent frame's h·w (patch size 1)."""
        height, width = self.latent_size()
        return height * width

    def strip(self, full: Tensor) -> Tensor:
        """All tokens packed (``[n, T_v + T_a, C]`` or flat, :meth:`LTX2Adapter.join`) → the generated ones: the video
        tokens after the first latent frame's and the audio tokens, packed the same way."""
        video, audio = self.split(full)  # [n, T_v, C_v], [n, T_a, C_a]
        return self.join(video[:, self.given_tokens():], audio)

    def fill(self, latents: Tensor, conditioning: Conditioning) -> Tensor:
        """The generated tokens ``latents`` → all tokens, the rows' image tokens (``conditioning["image_latents"]``
        ``[n, T_g, C_v]``) in front of the video's, in the latents' dtype."""
        video_width, _ = self.stream_widths()
        video, audio = self.split(latents, self.video_tokens() - self.given_tokens())  # the generated tokens
        image = conditioning["image_latents"].to(device=latents.device, dtype=latents.dtype)  # [n, T_g, C_v]
        if image.shape[1:] != (self.given_tokens(), video_width):
            raise ValueError(f"{self.name} adapter: the image latents are {tuple(image.shape[1:])}, the video's first "
                             f"latent frame needs ({self.given_tokens()}, {video_width}); encode the image at the "
                             "video's size")
        return self.join(torch.cat([image, video], dim=1), audio)  # video [n, T_v, C_v]

    def pack(self, noise: Tensor) -> Tensor:
        """``[N, N_v + N_a]`` noise (:meth:`LTX2Adapter.noise_shape`: the pipeline's draw of the whole video's noise,
        the first latent frame's too, then the audio's) → the generated tokens: both streams packed as text-to-video
        packs them, the first latent frame's tokens dropped (the image's latent takes their place)."""
        return self.strip(super().pack(noise))

    def finalize(self, latents: Tensor, conditioning: Conditioning) -> Tensor:
        """The sampled generated tokens → all tokens for decoding: the image's latent as the first latent frame,
        which the pipeline never changes."""
        return self.fill(latents, conditioning)

    # ------------------------------------------------------------------ the image
    def encode_condition_images(self, images: list[Any]) -> tuple[Conditioning, Tensor]:
        """The rows' first frames ``images`` (PIL) at :attr:`size`: ``image_latents [n, T_g, C_v]`` (the packed,
        normalised VAE latents of the re-compressed and resized image, float32), and the images as the model saw
        them, ``[n, 3, H, W]`` in [0, 1]."""
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf
        from PIL import Image

        height, width = self.size
        pipeline = self.pipeline
        vae = self.vae
        pixels = []
        for image in images:
            image = image.convert("RGB")
            if self.image_crf:  # __call__: H.264 at the image's own size, before the resize
                image = Image.fromarray(apply_image_conditioning_crf(np.array(image), self.image_crf))
            pixels.append(pipeline.video_processor.preprocess(image, height=height, width=width))  # [1, 3, H, W]
        pixels = torch.cat(pixels).to(self.device, torch.float32)  # [n, 3, H, W] in [-1, 1]
        latents = []
        for pixel in pixels:  # one image per VAE call, as prepare_latents encodes them
            output = vae.encode(pixel[None, :, None].to(vae.dtype))  # a one-frame video [1, 3, 1, H, W]
            latents.append(encoded_latents(output, vae).float())  # [1, C, 1, h, w], the posterior's mode
        latents = pipeline._normalize_latents(torch.cat(latents), vae.latents_mean, vae.latents_std)  # scaling 1
        tokens = pipeline._pack_latents(latents, 1, 1)  # [n, h·w, C]: the first latent frame's tokens
        return {"image_latents": tokens}, (pixels / 2 + 0.5).clamp(0, 1)

    # ------------------------------------------------------------------ transformer
    def video_timesteps(self, timesteps: Tensor) -> Tensor:
        """``t·(1 − mask)`` ``[n, T_v]``: the image's tokens at 0, the generated ones at the step's raw t."""
        per_token = timesteps[:, None].expand(-1, self.video_tokens()).clone()  # [n, T_v]
        per_token[:, :self.given_tokens()] = 0
        return per_token

    def velocity(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning, *,
                 guidance_scale: GuidanceScale, negative: Conditioning | None = None) -> Tensor:
        """The guided velocity of the generated tokens ``[n, ...]`` (float32, ``latents``' layout): every pass and
        the x0-space guidance on all tokens, the image's in place (:meth:`LTX2Adapter.velocity`), the image's
        tokens' velocities dropped."""
        full = self.fill(latents, conditioning)  # [n, T_v + T_a, C] or flat
        return self.strip(super().velocity(module, full, timesteps, conditioning, guidance_scale=guidance_scale,
                                           negative=negative))

    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float, *, isolate_modalities: bool = False,
                         stg_blocks: list[int] | None = None) -> Tensor:
        """One transformer call on all tokens (the image's in place: :meth:`velocity` fills them), the video at the
        per-token timesteps of :meth:`video_timesteps`; the raw velocities of all tokens, packed."""
        video_width, audio_width = self.stream_widths()
        expected = self.video_tokens() * video_width + self.audio_frames() * audio_width
        if latents[0].numel() != expected:
            raise ValueError(f"{self.name} adapter: call_transformer takes all {expected} latent elements of a sample "
                             f"(the image's tokens included: fill() puts them in); got {latents[0].numel()}")
        return super().call_transformer(module, latents, timesteps, conditioning, guidance_scale,
                                        isolate_modalities=isolate_modalities, stg_blocks=stg_blocks)
