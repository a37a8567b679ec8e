"""LTX-2 text-to-audio-video (``LTX2Pipeline``): Lightricks' joint audio-video diffusion transformer (LTX-2, "LTX-2:
Efficient Joint Audio-Visual Foundation Model", arXiv:2601.03233; the checkpoints Lightricks/LTX-2 and the LTX-2.3
conversions). One transformer denoises two latent streams together, video tokens (a causal video VAE, 32× spatial and
8× temporal compression, 128 channels, patch 1) and audio tokens (a mel-spectrogram VAE: 8 channels × 16 latent mel
bins per audio latent frame, 25 latent frames per second), which attend to each other in every block; text comes from
Gemma 3 (every layer's hidden states) through the pipeline's two text connectors, one per stream.

What the adapter reproduces from ``LTX2Pipeline.__call__`` (diffusers 0.42.1, ``pipelines/ltx2/pipeline_ltx2.py``):

- prompts: ``pipeline.encode_prompt`` (Gemma 3, prompts stripped, left-padded to ``max_sequence_length`` tokens, all
  hidden states stacked and flattened to ``[n, L, D·(layers + 1)]``), then ``pipeline.connectors`` with the
  tokenizer's padding side, which give the video stream's text ``prompt_embeds [n, L, D_v]``, the audio stream's
  ``audio_prompt_embeds [n, L, D_a]`` and their mask ``[n, L]``, cached per prompt. The pipeline runs the connectors
  on the ``[negative; prompt]`` batch, the plugin on each prompt's own rows (row-independent: equal in float32).
- latents: the two streams packed into one tensor per sample (the contract's one latent per sample, see below). The
  initial noise is one ``torch.randn`` of N_v + N_a elements per sample generator, the video's
  ``[C, (F − 1)/8 + 1, H/32, W/32]`` (``prepare_latents``) first and the audio's ``[C_a, L_a, M]``
  (``prepare_audio_latents``; L_a = round(F / frame_rate · sample_rate / hop / 4), M = mel_bins / 4) after it. The
  pipeline draws the two from each generator one after the other; torch's CPU normal sampler fills blocks of 16, so
  one draw of N_v + N_a equals the two whenever N_v is a multiple of 16 and N_a ≥ 16 (always for the released models:
  C = 128, C_a·M = 128; tested). Both are kept in float32, as the pipeline keeps them.
- schedule: ``np.linspace(1, 1/S, S)`` as ``sigmas`` with μ = ``calculate_shift`` of the video tokens (base and max
  sequence length 1024 and 4096, shifts 0.95 and 2.05, the pipeline's fallbacks for the scheduler config) for the
  dynamically shifting scheduler, which appends σ = 0 (and stretches to its ``shift_terminal``). The pipeline steps the
  audio with a deep copy of the scheduler set to the same σ and μ: both streams share one σ grid, so the packed latent
  takes one Euler/SDE step.
- the transformer gets both streams' tokens, the raw timestep t (in [0, 1000]) as ``timestep`` and as ``sigma`` (the
  LTX-2.3 prompt modulation reads it), the same t for audio, both texts with the connectors' mask, the latent video
  size, the audio length and ``fps`` = ``frame_rate`` (RoPE coordinates built by the transformer from them, as the
  pipeline precomputes them), ``use_cross_timestep=True`` (the pipeline's default; with one timestep for both streams
  it changes nothing).
- guidance, per stream and in x0 space (x̂₀ = x − σ·v, σ = t / 1000), as ``__call__`` combines it:
  x̂₀ = x̂₀_c + (w − 1)(x̂₀_c − x̂₀_u) + s (x̂₀_c − x̂₀_stg) + (m − 1)(x̂₀_c − x̂₀_iso), then
  ``rescale_noise_cfg`` toward x̂₀_c with φ when φ > 0, and back to v = (x − x̂₀)/σ. The CFG term uses the unconditional
  pass (``plugin.cfg``; w = ``plugin.guidance_scale`` for video, ``audio_guidance_scale`` for audio), the STG term an
  extra conditional pass with the self-attention of ``stg_blocks`` perturbed, the modality term an extra conditional
  pass with the audio↔video cross-attention off (``isolate_modalities``). Each term is on exactly where the pipeline
  turns it on (CFG: the pass; STG: either stream's scale > 0; isolation: either stream's scale > 1). The defaults are
  ``__call__``'s, which turn all of them on: video CFG 3.0, audio 7.0, rescale 0.7 (both), STG 1.0 (both) at block 28,
  modality isolation 3.0 (both): four transformer passes per step, in rollouts and the training forward alike.
  ``plugin.adapter_options`` changes them (:data:`OPTIONS`). A transformer built without perturbed attention
  (``perturbed_attn: false``, the config class's default) computes the STG pass exactly as the conditional one (the
  term is 0 in the pipeline), so the adapter skips that pass there.
- decode: the video latents unpacked, un-normalised with the VAE's ``latents_mean``/``latents_std`` and
  ``scaling_factor``, decoded one video at a time (with ``timestep_conditioning`` at the pipeline's default decode
  timestep 0 and decode noise scale 0, which leave the latents as they are), ``(x / 2 + 0.5).clamp(0, 1)`` as
  ``output_type="pt"``, channels second: ``[N, 3, F, H, W]``. :meth:`LTX2Adapter.decode_audio` gives the pipeline's
  waveform (audio latents un-normalised, unpacked, the audio VAE's mel spectrogram, the vocoder).

The latent contract. The plugin's SDE, log-probs, KL and credit strategies treat one tensor per sample, so the adapter
packs both streams into one: ``[n, T_v + T_a, C]`` (video tokens, then audio tokens) when the transformer's video and
audio token widths agree (128 and 8·16 = 128 in the released models, as Flow-Factory concatenates them), else a flat
``[n, T_v·C + T_a·C_a]`` that :meth:`LTX2Adapter.split` cuts the same way. The policy generates both streams, so both
take the SDE step and both enter the log-prob; the plugin reduces a step's log-density as the mean over the sample's
elements, so the packed log-prob is the joint log-density of the (video, audio) step divided by N_v + N_a: every
latent element weighs the same whichever stream it belongs to (the same per-element normalisation as every other
adapter's latents; a mean of per-stream means would instead weigh one audio element like N_v / N_a video elements).
The payload holds both decoded streams: ``"videos"`` for the frame rewards and, through
:meth:`LTX2Adapter.decode_extra`, ``"audios"`` (the pipeline's waveforms ``[N, channels, samples]``) with
``"audio_sample_rate"`` ``[N]`` for audio rewards (``clap``: text-audio similarity, :mod:`mmrl.rewards.audio`). The
audio is decoded for every rollout; the evaluation samples written to the run folder are the frames only (no audio
file).

Differences from Flow-Factory's LTX-2 adapter (X-GenGroup/Flow-Factory@a0b2bc5
``src/flow_factory/models/ltx2/ltx2_t2av.py``): it also concatenates the two streams on the token axis and combines
the three guidance terms in x0 space as the pipeline does, but steps the audio with a deterministic ODE outside the
log-prob (video-only SDE): mmrl makes both streams stochastic and scores both in the ratio, since the policy's action
is the joint (video, audio) step and an ODE audio stream would leave the audio half of the transformer's output
untouched by the policy gradient except through cross-attention. Flow-Factory's ``use_cross_timestep`` defaults to
False (no effect here: one timestep for both streams). Its LoRA targets are the same attention and feed-forward
projections of both streams and of the cross-modal attentions.

LoRA default targets: every block's video and audio self-attention (``attn1``, ``audio_attn1``), text cross-attention
(``attn2``, ``audio_attn2``) and cross-modal attention (``audio_to_video_attn``, ``video_to_audio_attn``) projections
``to_q/k/v``, ``to_out.0``, and both feed-forwards (``ff.net.0.proj``, ``ff.net.2``, ``audio_ff.net.0.proj``,
``audio_ff.net.2``); the connectors, the Gemma encoder, the VAEs and the vocoder stay frozen.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning, FlowAdapter, GuidanceScale, refuse_other_pipelines

OPTIONS: dict[str, str] = {
    "audio_guidance_scale": "the audio stream's CFG scale (a number >= 0; LTX2Pipeline's default 7.0)",
    "guidance_rescale": "the video stream's x0-space guidance rescale phi (in [0, 1]; default 0.7)",
    "audio_guidance_rescale": "the audio stream's guidance rescale phi (in [0, 1]; default 0.7)",
    "stg_scale": "the video stream's spatio-temporal guidance scale (>= 0, 0 = off; default 1.0)",
    "audio_stg_scale": "the audio stream's spatio-temporal guidance scale (>= 0, 0 = off; default 1.0)",
    "stg_blocks": "the transformer blocks STG perturbs (a non-empty list of block indices; default [28])",
    "modality_scale": "the video stream's modality-isolation guidance scale (>= 0, 1 = off; default 3.0)",
    "audio_modality_scale": "the audio stream's modality-isolation guidance scale (>= 0, 1 = off; default 3.0)",
    "frame_rate": "frames per second of the video, which sets the audio length and the RoPE time axis (> 0; "
                  "default 24.0)",
}
"""``plugin.adapter_options`` keys of the ltx2 adapter; the defaults are ``LTX2Pipeline.__call__``'s."""


class LTX2Adapter(FlowAdapter):
    """Adapter for ``LTX2Pipeline``: LTX-2 / LTX-2.3 text-to-audio-video (Lightricks/LTX-2 and the diffusers
    conversions of LTX-2.3). Image-to-audio-video (``LTX2ImageToVideoPipeline``) is the ``ltx2_i2v`` subclass
    (:mod:`~mmrl.plugins.flow.adapters.ltx2_i2v`); the other LTX-2 pipelines are not covered."""

    name = "ltx2"
    pipeline_classes = ("LTX2Pipeline",)
    # The projections of all six attentions of every block (attn1, attn2, audio_attn1, audio_attn2,
    # audio_to_video_attn, video_to_audio_attn: the transformer's only to_q/k/v/out modules) and both feed-forwards.
    # The modules of Flow-Factory's 28-name list, written as the 8 suffixes that match exactly them.
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0",
                           "ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2")
    default_guidance_scale = 3.0  # LTX2Pipeline.__call__'s guidance_scale (video)
    supports_cfg = True
    default_max_sequence_length = 1024  # LTX2Pipeline.__call__'s max_sequence_length
    output = "videos"
    default_num_frames = 121  # LTX2Pipeline.__call__'s num_frames for checkpoints without a duration head
    #: Videos per VAE decode call (one bounds memory: 121 frames at 512×768 decode to several GB of activations).
    decode_batch_size = 1
    #: ``plugin.adapter_options`` keys and what each takes (:meth:`configure`; a subclass adds its own).
    option_docs: ClassVar[dict[str, str]] = OPTIONS

    def __init__(self, pipeline: Any, device: torch.device):
        refuse_other_pipelines(type(self), pipeline)  # before anything reads the pipeline's components
        super().__init__(pipeline, device)
        config = pipeline.transformer.config
        if int(config.audio_patch_size) != 1 or int(config.audio_patch_size_t) != 1:
            raise ValueError(f"{self.name} adapter: the transformer's audio patch sizes are {config.audio_patch_size} "
                             f"and {config.audio_patch_size_t}; LTX2Pipeline packs audio latents one latent frame per "
                             "token (both 1)")
        # LTX2Pipeline.__call__'s defaults; plugin.adapter_options changes them (configure)
        self.audio_guidance_scale = 7.0
        self.guidance_rescale = 0.7
        self.audio_guidance_rescale = 0.7
        self.stg_scale = 1.0
        self.audio_stg_scale = 1.0
        self.stg_blocks: list[int] = [28]
        self.modality_scale = 3.0
        self.audio_modality_scale = 3.0
        self.frame_rate = 24.0

    # ------------------------------------------------------------------ options
    def configure(self, options: dict[str, Any], *, cfg: bool) -> None:
        """``plugin.adapter_options``: any key of :data:`OPTIONS`; each refusal names the key and what it takes. An
        audio CFG scale other than 1 is refused with ``cfg`` off (no unconditional pass to scale), as the plugin
        refuses such a ``guidance_scale``."""
        unknown = [key for key in options if key not in OPTIONS]
        if unknown:
            raise ValueError(f"keys of {', '.join(self.option_docs)} (the {self.name} adapter's); {unknown[0]!r} is "
                             "not one")
        for key, value in options.items():
            if key == "stg_blocks":
                if not isinstance(value, list) or not value or not all(
                        isinstance(block, int) and not isinstance(block, bool) and block >= 0 for block in value):
                    raise ValueError(f"stg_blocks: {OPTIONS[key]}; got {value!r}")
                setattr(self, key, [int(block) for block in value])
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{key}: {OPTIONS[key]}; got {value!r}")
            low, high = (0.0, 1.0) if key.endswith("guidance_rescale") else (0.0, math.inf)
            if key == "frame_rate" and value <= 0 or not low <= value <= high:
                raise ValueError(f"{key}: {OPTIONS[key]}; got {value!r}")
            setattr(self, key, float(value))
        if not cfg and "audio_guidance_scale" in options and self.audio_guidance_scale != 1.0:
            raise ValueError(f"audio_guidance_scale: unset or 1.0 with plugin.cfg false (the audio CFG scale needs the "
                             f"unconditional pass); got {self.audio_guidance_scale}")
        layers = len(self.pipeline.transformer.transformer_blocks)
        if self.stg_on and self.stg_perturbs and max(self.stg_blocks) >= layers:
            raise ValueError(f"stg_blocks: indices of the transformer's {layers} blocks (0 to {layers - 1}) while STG "
                             f"is on; got {self.stg_blocks}")

    @property
    def stg_on(self) -> bool:
        """Whether ``__call__`` would run the STG pass: either stream's STG scale above 0."""
        return self.stg_scale > 0.0 or self.audio_stg_scale > 0.0

    @property
    def stg_perturbs(self) -> bool:
        """Whether the STG pass differs from the conditional one: the transformer has perturbed attention
        (``perturbed_attn`` in its config); without it the pipeline's STG term is exactly 0 and the adapter skips the
        pass."""
        return bool(getattr(self.pipeline.transformer.config, "perturbed_attn", False))

    @property
    def isolation_on(self) -> bool:
        """Whether ``__call__`` would run the modality-isolation pass: either stream's scale above 1."""
        return self.modality_scale > 1.0 or self.audio_modality_scale > 1.0

    # ------------------------------------------------------------------ geometry
    @property
    def vae_scale_factor(self) -> int:
        return int(self.vae.spatial_compression_ratio)  # LTX2Pipeline.vae_spatial_compression_ratio

    @property
    def temporal_scale_factor(self) -> int:
        return int(self.vae.temporal_compression_ratio)  # LTX2Pipeline.vae_temporal_compression_ratio

    def resolution_multiple(self) -> int:
        # LTX2Pipeline.check_inputs refuses sides that are not multiples of 32 whatever the VAE; prepare_latents floors
        # each side to the VAE factor and the transformer patchifies patch_size x patch_size (1 in the released models)
        return math.lcm(32, self.vae_scale_factor * int(self.transformer.config.patch_size))

    def video_grid(self) -> tuple[int, int, int]:
        """``(F_lat, h, w)`` of the video latents at :attr:`size` and :attr:`num_frames`."""
        return (self.latent_frames(self.num_frames), *self.latent_size())

    def video_tokens(self) -> int:
        """T_v, the video tokens the transformer sees (the pipeline's ``latents.shape[1]``)."""
        frames, height, width = self.video_grid()
        config = self.transformer.config
        patch = int(config.patch_size)
        return (frames // int(config.patch_size_t)) * (height // patch) * (width // patch)

    def audio_frames(self) -> int:
        """L_a, the audio latent frames of a :attr:`num_frames` video at :attr:`frame_rate` (``__call__``'s
        ``round(duration · sample_rate / hop / temporal compression)``)."""
        pipeline = self.pipeline
        per_second = pipeline.audio_sampling_rate / pipeline.audio_hop_length / float(
            pipeline.audio_vae_temporal_compression_ratio)
        return round(self.num_frames / self.frame_rate * per_second)

    def audio_mel_bins(self) -> int:
        """M, the latent mel bins (``mel_bins`` over the audio VAE's mel compression)."""
        return int(self.pipeline.audio_vae.config.mel_bins) // int(self.pipeline.audio_vae_mel_compression_ratio)

    def stream_widths(self) -> tuple[int, int]:
        """Token widths ``(C_v, C_a)``: the packed video token (channels × patch) and audio token (channels × M)."""
        config = self.transformer.config
        video = int(self.vae.config.latent_channels) * int(config.patch_size_t) * int(config.patch_size) ** 2
        return video, int(self.pipeline.audio_vae.config.latent_channels) * self.audio_mel_bins()

    def image_seq_len(self) -> int:
        return self.video_tokens()

    # ------------------------------------------------------------------ packing
    def split(self, latents: Tensor, video_tokens: int | None = None) -> tuple[Tensor, Tensor]:
        """Packed latents → ``(video [n, T_v, C_v], audio [n, T_a, C_a])``, the transformer's token layouts;
        ``video_tokens`` the video tokens they hold (default T_v; image-to-video's generated tokens are fewer)."""
        tokens = self.video_tokens() if video_tokens is None else video_tokens
        video_width, audio_width = self.stream_widths()
        if latents.ndim == 3:  # [n, T_v + T_a, C]: one token width
            return latents[:, :tokens], latents[:, tokens:]
        cut = tokens * video_width  # [n, T_v·C_v + T_a·C_a]
        return (latents[:, :cut].reshape(latents.shape[0], tokens, video_width),
                latents[:, cut:].reshape(latents.shape[0], -1, audio_width))

    def join(self, video: Tensor, audio: Tensor) -> Tensor:
        """``video [n, T_v, C_v]`` and ``audio [n, T_a, C_a]`` → the packed latents: ``[n, T_v + T_a, C]`` when the
        widths agree, else ``[n, T_v·C_v + T_a·C_a]``."""
        if video.shape[-1] == audio.shape[-1]:
            return torch.cat([video, audio], dim=1)
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)

    def noise_shape(self) -> tuple[int, ...]:
        # one draw of N_v + N_a per sample: the video noise [C, F_lat, h, w] of prepare_latents, then the audio noise
        # [C_a, L_a, M] of prepare_audio_latents, as the pipeline draws them one after the other from each generator
        video = int(self.vae.config.latent_channels) * math.prod(self.video_grid())
        audio = int(self.pipeline.audio_vae.config.latent_channels) * self.audio_frames() * self.audio_mel_bins()
        return (video + audio,)

    def pack(self, noise: Tensor) -> Tensor:
        """``[N, N_v + N_a]`` noise → packed latents: each stream reshaped to its VAE layout and packed into tokens
        with the pipeline's ``_pack_latents`` / ``_pack_audio_latents``."""
        pipeline = self.pipeline
        n = noise.shape[0]
        channels = int(self.vae.config.latent_channels)
        video_size = channels * math.prod(self.video_grid())
        video = noise[:, :video_size].reshape(n, channels, *self.video_grid())  # [N, C, F_lat, h, w]
        audio = noise[:, video_size:].reshape(n, int(pipeline.audio_vae.config.latent_channels), self.audio_frames(),
                                              self.audio_mel_bins())  # [N, C_a, L_a, M]
        config = self.transformer.config
        video = pipeline._pack_latents(video, int(config.patch_size), int(config.patch_size_t))  # [N, T_v, C_v]
        return self.join(video, pipeline._pack_audio_latents(audio))  # audio [N, L_a, C_a·M]

    # ------------------------------------------------------------------ prompts, schedule
    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> Conditioning:
        """``pipeline.encode_prompt`` (Gemma 3, every hidden state) and ``pipeline.connectors``: ``prompt_embeds
        [n, L, D_v]`` (video stream), ``audio_prompt_embeds [n, L, D_a]`` and ``prompt_attention_mask [n, L]``."""
        pipeline = self.pipeline
        embeds, mask, _, _ = pipeline.encode_prompt(
            prompt=list(prompts), do_classifier_free_guidance=False, num_videos_per_prompt=1,
            max_sequence_length=max_sequence_length, device=self.device, dtype=self.transformer.dtype,
        )  # [n, L, D·(layers + 1)], [n, L]
        padding_side = getattr(pipeline.tokenizer, "padding_side", "left")  # as __call__ passes it
        video, audio, connector_mask = pipeline.connectors(embeds, mask, padding_side=padding_side)
        return {"prompt_embeds": video, "audio_prompt_embeds": audio, "prompt_attention_mask": connector_mask}

    def default_sigmas(self, num_steps: int) -> list[float]:
        return np.linspace(1.0, 1 / num_steps, num_steps).tolist()  # LTX2Pipeline.__call__'s sigmas

    def dynamic_shift_mu(self, num_steps: int) -> float:
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.scheduler.config  # LTX2Pipeline.__call__'s fallbacks for a config without them
        return calculate_shift(self.video_tokens(), config.get("base_image_seq_len", 1024),
                               config.get("max_image_seq_len", 4096), config.get("base_shift", 0.95),
                               config.get("max_shift", 2.05))

    # ------------------------------------------------------------------ transformer and guidance
    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float, *, isolate_modalities: bool = False,
                         stg_blocks: list[int] | None = None) -> Tensor:
        """One transformer call on packed ``latents`` (``[n, T_v + T_a, C]`` or flat): the raw velocities of both
        streams packed the same way. ``isolate_modalities`` turns the audio↔video cross-attention off and
        ``stg_blocks`` perturbs those blocks' self-attention (the pipeline's modality-isolation and STG passes)."""
        video, audio = self.split(latents)
        frames, height, width = self.video_grid()
        config = self.transformer.config
        t = timesteps.to(latents.dtype)  # [n] raw t in [0, 1000]
        video_out, audio_out = module(
            hidden_states=video,  # [n, T_v, C_v]
            audio_hidden_states=audio,  # [n, T_a, C_a]
            encoder_hidden_states=conditioning["prompt_embeds"],  # [n, L, D_v]
            audio_encoder_hidden_states=conditioning["audio_prompt_embeds"],  # [n, L, D_a]
            timestep=self.video_timesteps(t),  # [n], or [n, T_v] per token (image-to-video)
            audio_timestep=t,  # the transformer's default for a [n] timestep; explicit for a per-token one
            sigma=t,  # as LTX2Pipeline passes it (LTX-2.3's prompt modulation)
            encoder_attention_mask=conditioning["prompt_attention_mask"],  # [n, L]
            audio_encoder_attention_mask=conditioning["prompt_attention_mask"],
            num_frames=frames // int(config.patch_size_t),
            height=height // int(config.patch_size),
            width=width // int(config.patch_size),
            fps=self.frame_rate,
            audio_num_frames=audio.shape[1],
            isolate_modalities=isolate_modalities,
            spatio_temporal_guidance_blocks=stg_blocks,
            use_cross_timestep=True,
            return_dict=False,
        )
        return self.join(video_out, audio_out)

    def video_timesteps(self, timesteps: Tensor) -> Tensor:
        """The video stream's ``timestep`` for the transformer from the rows' raw ``timesteps [n]``: the same for
        every video token (``LTX2Pipeline``); the image-to-video subclass gives its given tokens 0."""
        return timesteps

    def velocity(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning, *,
                 guidance_scale: GuidanceScale, negative: Conditioning | None = None) -> Tensor:
        """The guided velocity of both streams, packed, float32: ``LTX2Pipeline.__call__``'s x0-space combination of
        CFG (with ``negative``: one ``[uncond; cond]`` call), STG and modality isolation (one more conditional call
        each where on), the guidance rescale, and back to velocities (module docstring)."""
        scale = float(self.guidance_for(timesteps, guidance_scale))
        rows = {key: value for key, value in conditioning.items() if not key.startswith("negative_")}
        n = latents.shape[0]
        if negative is None:
            cond = self.call_transformer(module, latents, timesteps, rows, scale).float()  # [n, ...]
            uncond = None
        else:
            both = {key: torch.cat([negative[key].expand(n, *negative[key].shape[1:]) if key in negative else value,
                                    value]) for key, value in rows.items()}
            output = self.call_transformer(module, torch.cat([latents, latents]), torch.cat([timesteps, timesteps]),
                                           both, scale).float()
            uncond, cond = output.chunk(2)  # [n, ...] each
        perturbed = isolated = None
        if self.stg_on and self.stg_perturbs:
            perturbed = self.call_transformer(module, latents, timesteps, rows, scale,
                                              stg_blocks=self.stg_blocks).float()
        if self.isolation_on:
            isolated = self.call_transformer(module, latents, timesteps, rows, scale, isolate_modalities=True).float()
        return self.combine(latents.float(), timesteps, cond, uncond, perturbed, isolated, scale)

    def combine(self, latents: Tensor, timesteps: Tensor, cond: Tensor, uncond: Tensor | None, perturbed: Tensor | None,
                isolated: Tensor | None, guidance_scale: float) -> Tensor:
        """The guided packed velocity from the float32 packed velocities of the passes (None: a pass not run), per
        stream in x0 space with that stream's scales, as ``LTX2Pipeline.__call__``."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

        sigma = timesteps.float() / float(self.scheduler.config.get("num_train_timesteps", 1000))  # [n]
        stream_scales = ((guidance_scale, self.stg_scale, self.modality_scale, self.guidance_rescale),
                         (self.audio_guidance_scale, self.audio_stg_scale, self.audio_modality_scale,
                          self.audio_guidance_rescale))
        parts = []
        for index, (cfg_scale, stg_scale, modality_scale, rescale) in enumerate(stream_scales):
            x = self.split(latents)[index]  # [n, T, C] of this stream

            def x0(velocity: Tensor | None, x: Tensor = x, index: int = index) -> Tensor | None:
                if velocity is None:
                    return None
                return x - self.split(velocity)[index] * sigma.view(-1, 1, 1)  # [n, T, C]

            x0_cond = x0(cond)
            guided = x0_cond
            if uncond is not None:
                guided = guided + (cfg_scale - 1) * (x0_cond - x0(uncond))
            if self.stg_on and perturbed is not None:
                guided = guided + stg_scale * (x0_cond - x0(perturbed))
            if isolated is not None:
                guided = guided + (modality_scale - 1) * (x0_cond - x0(isolated))
            if rescale > 0:
                guided = rescale_noise_cfg(guided, x0_cond, guidance_rescale=rescale)
            parts.append((x - guided) / sigma.view(-1, 1, 1))  # back to a velocity, [n, T, C]
        return self.join(*parts)

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Packed final latents → videos ``[N, 3, F, H, W]`` in [0, 1], as ``__call__`` with ``output_type="pt"``."""
        pipeline = self.pipeline
        vae = self.vae
        config = self.transformer.config
        video, _ = self.split(latents)
        video = pipeline._unpack_latents(video, *self.video_grid(), int(config.patch_size),
                                         int(config.patch_size_t))  # [N, C, F_lat, h, w]
        timestep = None
        if vae.config.timestep_conditioning:  # decode_timestep 0 and decode noise scale 0: the latents unchanged
            timestep = torch.zeros(1, device=video.device, dtype=video.dtype)
        video = pipeline._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        videos = []
        for part in video.to(vae.dtype).split(self.decode_batch_size):  # [b, C, F_lat, h, w]
            step = None if timestep is None else timestep.expand(part.shape[0]).to(part.dtype)
            videos.append(vae.decode(part, step, return_dict=False)[0].float())  # [b, 3, F, H, W] in about [-1, 1]
        return (torch.cat(videos) / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def decode_audio(self, latents: Tensor) -> Tensor:
        """Packed final latents → the pipeline's waveforms ``[N, channels, samples]`` (audio latents un-normalised,
        unpacked to ``[N, C_a, L_a, M]``, the audio VAE's mel spectrogram, the vocoder)."""
        pipeline = self.pipeline
        audio_vae = pipeline.audio_vae
        _, audio = self.split(latents)
        audio = pipeline._denormalize_audio_latents(audio, audio_vae.latents_mean, audio_vae.latents_std)
        audio = pipeline._unpack_audio_latents(audio, audio.shape[1], num_mel_bins=self.audio_mel_bins())
        mel = audio_vae.decode(audio.to(audio_vae.dtype), return_dict=False)[0]
        return pipeline.vocoder(mel).float()

    @property
    def audio_sample_rate(self) -> int:
        """Samples per second of :meth:`decode_audio`'s waveforms: the vocoder's ``output_sampling_rate`` (24 kHz for
        LTX-2, 48 kHz for LTX-2.3's vocoder with bandwidth extension), what the pipeline's own examples pass on when
        they write the audio."""
        return int(self.pipeline.vocoder.config.output_sampling_rate)

    def decode_extra(self, latents: Tensor) -> dict[str, Tensor]:
        """The audio of the final latents for the payload: ``"audios"`` ``[N, channels, samples]`` float32 waveforms
        (:meth:`decode_audio`, the pipeline's) and ``"audio_sample_rate"`` ``[N]`` int64 (:attr:`audio_sample_rate`,
        per sample as the payload contract wants every entry). Decoded for every rollout whatever the rewards read:
        the audio VAE and the vocoder cost little next to the video VAE's decode."""
        audios = self.decode_audio(latents)
        rate = torch.full((audios.shape[0],), self.audio_sample_rate, dtype=torch.int64, device=audios.device)
        return {"audios": audios, "audio_sample_rate": rate}
