"""HunyuanVideo 1.5 text-to-video (``HunyuanVideo15Pipeline``): an 8.3B dual-stream 3-D transformer (54 blocks, patch
1) on the 5-D latents ``[B, C, F, h, w]`` of a causal video VAE (32 channels, 16× spatial and 4× temporal
compression), text from two encoders (the Qwen2.5-VL-7B text model behind a chat template, and a ByT5 glyph encoder
for quoted text), true classifier-free guidance through the pipeline's ``guider`` and a fixed flow shift.

What the adapter reproduces from ``HunyuanVideo15Pipeline.__call__`` (diffusers 0.42.1,
``pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5.py``):

- prompts: ``pipeline.encode_prompt``, both encoders. ``_get_mllm_prompt_embeds``: the chat template (the pipeline's
  video-description system message, the prompt as the user turn, ``add_generation_prompt``) right-padded to
  1000 + 108 tokens, the text model's third-to-last hidden state (``hidden_states[-3]``), the first 108 positions
  (the template's system turn and ``<|im_start|>user\\n``) cropped, so 1000 tokens with their mask.
  ``_get_byt5_prompt_embeds``: the quoted spans of the prompt (``"..."`` or ``“...”``) joined as
  ``Text "a". Text "b". `` through the ByT5 encoder, 256 tokens with their mask; a prompt without quotes gets 256
  zero rows and an all-zero mask. Both are cached per prompt with the sample axis first, masks beside them. With
  ``plugin.max_sequence_length`` m below 1000 the cached rows are cut to m Qwen2.5-VL tokens and min(m, 256) glyph
  tokens, refused in one line when a prompt has real tokens past them. Only padding goes: the transformer moves each
  row's real tokens to the front of its text sequence, zeroes and masks the padding, and masks it out of attention as
  query and as key (and out of the token refiner's mean pooling), so no real token depends on it (tested: equal to
  the uncut pipeline).
- noise ``[C, (F − 1)/4 + 1, H/16, W/16]`` per sample (``prepare_latents``; C the VAE's ``latent_channels``, the
  factors the VAE's ``temporal_compression_ratio`` and ``spatial_compression_ratio``), one draw per sample generator.
  The pipeline draws it in the transformer's dtype and steps in it; the plugin keeps latents in float32 (equal in
  float32).
- the transformer input: ``[latents; zeros (C channels: the condition latents); zeros (1 channel: the condition
  mask)]`` along the channels (``prepare_cond_latents_and_mask``: all zero for text-to-video; the released
  ``in_channels`` is 2·32 + 1 = 65), ``image_embeds`` zeros ``[n, 729, image_embed_dim]`` (the pipeline's
  ``vision_num_semantic_tokens``; all-zero marks text-to-video, and the transformer masks those slots), the timestep
  t (in [0, 1000], not t / 1000) in the latents' dtype, both encoders' embeddings with their masks.
- σ: ``np.linspace(1, 0, S + 1)[:-1]`` passed as ``sigmas`` to the scheduler, which shifts them with its fixed
  ``shift`` (5 for the 480p checkpoints, 9 for 720p: σ' = s·σ/(1 + (s − 1)·σ)) and appends σ = 0; timesteps
  1000·σ'. That is DanceGRPO's static-shift grid exactly (``static_shift: 5`` would give the same numbers).
- guidance: the pipeline's ``guider`` (``ClassifierFreeGuidance``, scale 6.0 in the released non-distilled
  checkpoints, 1.0 in the step-distilled ones) calls the transformer once for the prompt and once for the negative
  prompt (``None``: the empty prompt, which the template writes as ``" "``) and combines
  v_u + w·(v_c − v_u) (``use_original_formulation``: v_c + w·(v_c − v_u)), then rescales it to the conditional
  velocity's standard deviation when ``guidance_rescale`` > 0. The adapter reads those settings from the guider:
  the default scale, whether a null ``plugin.cfg`` guides (not where the guider is disabled or its scale leaves the
  conditional velocity alone), the formulation and the rescale; one ``[uncond; cond]`` call, combined in float32.
  A guider that guides only some steps (``start`` > 0 or ``stop`` < 1) or another guider class is refused in one line.
- decode: latents / ``scaling_factor`` (no shift), the VAE one video at a time (its mid-block attention
  fails on more than one in diffusers 0.42.1, the pipeline's own batches included),
  ``(x / 2 + 0.5).clamp(0, 1)`` as ``postprocess_video(output_type="pt")``, channels second: ``[N, 3, F, H, W]``.

LoRA default targets: the image and text streams' attention projections (``attn.to_q/k/v``, ``attn.to_out.0``,
``attn.add_q/k/v_proj``, ``attn.to_add_out``) and both feed-forwards (``ff.net.0.proj``, ``ff.net.2``,
``ff_context.net.0.proj``, ``ff_context.net.2``) of every transformer block. The suffixes ``attn.to_*`` and
``ff.net.*`` also name the two blocks of the text token refiner (``context_embedder.token_refiner.refiner_blocks``),
which therefore train too; the modulation, embedders, ByT5 projection and ``proj_out`` stay frozen. The pipeline has
no LoRA loader mixin: an exported adapter loads with ``pipe.transformer.load_lora_adapter(folder,
prefix="transformer", weight_name="pytorch_lora_weights.safetensors")``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning, FlowAdapter, refuse_other_pipelines


class HunyuanVideo15Adapter(FlowAdapter):
    """Adapter for ``HunyuanVideo15Pipeline``: HunyuanVideo 1.5 text-to-video (hunyuanvideo-community/
    HunyuanVideo-1.5-480p_t2v, the pipeline's example; the 720p and step-distilled conversions; fine-tunes with the
    same pipeline class). Image-to-video (``HunyuanVideo15ImageToVideoPipeline``: the condition channels and SigLIP
    ``image_embeds`` filled from an input image) is :class:`~mmrl.plugins.flow.adapters.hunyuan_video15_i2v.
    HunyuanVideo15ImageToVideoAdapter`."""

    name = "hunyuan_video15"
    pipeline_classes = ("HunyuanVideo15Pipeline",)
    # Both streams' attention projections and feed-forwards of every dual-stream block (diffusers' names:
    # transformer_blocks.N.attn.to_q/.../to_add_out, .ff.net.0.proj/.net.2, .ff_context.net.0.proj/.net.2).
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
                           "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
    #: The released non-distilled checkpoints' guider scale; an instance takes its own pipeline's guider's.
    default_guidance_scale = 6.0
    supports_cfg = True
    default_max_sequence_length = 1000  # HunyuanVideo15Pipeline.tokenizer_max_length: Qwen2.5-VL tokens kept
    output = "videos"
    default_num_frames = 121  # HunyuanVideo15Pipeline.__call__'s num_frames

    def __init__(self, pipeline: Any, device: torch.device):
        refuse_other_pipelines(type(self), pipeline)  # before anything reads the pipeline's components
        super().__init__(pipeline, device)
        channels = int(pipeline.vae.config.latent_channels)
        expected = 2 * channels + 1
        in_channels = int(pipeline.transformer.config.in_channels)
        if in_channels != expected:
            raise ValueError(f"{self.name} adapter: the transformer takes {in_channels} input channels; "
                             f"it needs 2 x {channels} + 1 = {expected} (latents, condition latents and mask, as "
                             "the HunyuanVideo 1.5 pipelines concatenate them)")
        guider = pipeline.guider
        if type(guider).__name__ != "ClassifierFreeGuidance":
            raise ValueError(f"{self.name} adapter: the pipeline's guider is {type(guider).__name__}; the adapter "
                             "reproduces ClassifierFreeGuidance only")
        start, stop = float(guider.config.start), float(guider.config.stop)
        if start != 0.0 or stop != 1.0:
            raise ValueError(f"{self.name} adapter: the pipeline's guider guides steps from {start} to {stop} of "
                             "the schedule; the plugin guides every step or none, so its start must be 0 and stop 1")
        #: The guider's formulation: v_c + w·(v_c − v_u) instead of v_u + w·(v_c − v_u).
        self.original_formulation = bool(guider.config.use_original_formulation)
        #: The guider's rescale of the guided velocity toward the conditional one's standard deviation (0: off).
        self.guidance_rescale = float(guider.config.guidance_rescale)
        # The plugin reads these per instance: they follow this pipeline's guider.
        self.unguided_scale = 0.0 if self.original_formulation else 1.0
        scale = float(guider.config.guidance_scale)
        self.cfg_by_default = bool(guider.config.enabled) and not math.isclose(scale, self.unguided_scale)
        # A guider that does not guide (the step-distilled checkpoints: scale 1.0) leaves the class's 6.0 for cfg: true
        self.default_guidance_scale = scale if self.cfg_by_default else type(self).default_guidance_scale

    # ------------------------------------------------------------------ geometry
    @property
    def vae_scale_factor(self) -> int:
        return int(self.vae.config.spatial_compression_ratio)  # HunyuanVideo15Pipeline.vae_scale_factor_spatial

    @property
    def temporal_scale_factor(self) -> int:
        return int(self.vae.config.temporal_compression_ratio)  # HunyuanVideo15Pipeline.vae_scale_factor_temporal

    def resolution_multiple(self) -> int:
        # prepare_latents floors H and W to the VAE factor (no check_inputs refusal) and the transformer patchifies
        # patch_size × patch_size (1 in the released models): both must divide each side for the frames to keep it.
        return self.vae_scale_factor * int(self.transformer.config.patch_size)

    def image_seq_len(self) -> int:
        patch = int(self.transformer.config.patch_size)
        h, w = self.latent_size()
        return self.latent_frames(self.num_frames) * (h // patch) * (w // patch)

    # ------------------------------------------------------------------ prompts
    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> Conditioning:
        """Both encoders' rows of ``pipeline.encode_prompt`` (the pipeline's own lengths, 1000 and 256 tokens, cut to
        ``max_sequence_length`` and min(``max_sequence_length``, 256) where that drops padding only):
        ``prompt_embeds [n, L, D]`` and ``prompt_embeds_mask [n, L]`` (Qwen2.5-VL), ``prompt_embeds_2 [n, L2, D2]``
        and ``prompt_embeds_mask_2 [n, L2]`` (ByT5 glyphs)."""
        pipeline = self.pipeline
        limit = int(pipeline.tokenizer_max_length)
        if max_sequence_length > limit:
            raise ValueError(f"plugin.max_sequence_length is {max_sequence_length}; HunyuanVideo 1.5 encodes at most "
                             f"{limit} Qwen2.5-VL tokens per prompt (the pipeline's tokenizer_max_length)")
        embeds, mask, embeds_2, mask_2 = pipeline.encode_prompt(
            prompt=list(prompts), device=self.device, dtype=self.transformer.dtype, batch_size=len(prompts),
            num_videos_per_prompt=1,
        )  # [n, 1000, D], [n, 1000], [n, 256, D2], [n, 256]: the masks in the transformer's dtype, as the pipeline
        glyph_length = min(max_sequence_length, embeds_2.shape[1])
        self._check_cut(prompts, mask, max_sequence_length, "its template's prompt part is", "Qwen2.5-VL")
        self._check_cut(prompts, mask_2, glyph_length, "its quoted text is", "ByT5")
        return {
            # [n, L, D]: the padding rows hold the text model's states at the pad tokens, as the pipeline's do (the
            # transformer zeroes and masks them)
            "prompt_embeds": embeds[:, :max_sequence_length],
            "prompt_embeds_mask": mask[:, :max_sequence_length],  # [n, L], 1 = a real token (a prefix)
            "prompt_embeds_2": embeds_2[:, :glyph_length],  # [n, L2, D2], all zero for a prompt without quotes
            "prompt_embeds_mask_2": mask_2[:, :glyph_length],  # [n, L2]
        }

    @staticmethod
    def _check_cut(prompts: list[str], mask: Tensor, length: int, what: str, encoder: str) -> None:
        """Refuse cutting a row of ``mask [n, L]`` to ``length`` tokens where that would drop a real token."""
        dropped = mask[:, length:].sum(dim=1)  # [n]
        for prompt, tokens, count in zip(prompts, mask.sum(dim=1).tolist(), dropped.tolist(), strict=True):
            if count > 0:
                raise ValueError(f"plugin.max_sequence_length is {length}, but for {prompt[:40]!r} {what} "
                                 f"{int(tokens)} {encoder} tokens: raise it")

    # ------------------------------------------------------------------ latents, schedule, transformer
    def noise_shape(self) -> tuple[int, ...]:
        # [C, F_lat, H/16, W/16], as HunyuanVideo15Pipeline.prepare_latents (C: the VAE's latent_channels)
        return (int(self.vae.config.latent_channels), self.latent_frames(self.num_frames), *self.latent_size())

    def default_sigmas(self, num_steps: int) -> list[float]:
        return np.linspace(1.0, 0.0, num_steps + 1)[:-1].tolist()  # as HunyuanVideo15Pipeline.__call__; shifted later

    def condition_inputs(self, latents: Tensor, conditioning: Conditioning) -> tuple[Tensor, Tensor]:
        """The transformer's condition channels ``[n, C + 1, F_lat, h, w]`` (condition latents, then the mask) and
        ``image_embeds [n, T, D_image]`` for ``latents [n, C, F_lat, h, w]``: text-to-video's all-zero ones
        (``prepare_cond_latents_and_mask`` and the zero image slots); image-to-video fills them from the image."""
        n, channels, frames, height, width = latents.shape  # [n, C, F_lat, h, w]
        # prepare_cond_latents_and_mask: condition latents (C channels) and mask (1 channel), all zero for t2v
        condition = latents.new_zeros(n, channels + 1, frames, height, width)
        config = self.transformer.config
        # all zero: the transformer's text-to-video switch (is_t2v), which zeroes and masks these slots
        image_embeds = latents.new_zeros(n, int(self.pipeline.vision_num_semantic_tokens), int(config.image_embed_dim))
        return condition, image_embeds

    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        condition, image_embeds = self.condition_inputs(latents, conditioning)
        return module(
            hidden_states=torch.cat([latents, condition], dim=1),  # [n, 2C + 1, F_lat, h, w]
            image_embeds=image_embeds,  # [n, 729, D_image]
            timestep=timesteps.to(latents.dtype),  # [n] raw t in [0, 1000], in the latents' dtype as the pipeline
            encoder_hidden_states=conditioning["prompt_embeds"],
            encoder_attention_mask=conditioning["prompt_embeds_mask"],
            encoder_hidden_states_2=conditioning["prompt_embeds_2"],
            encoder_attention_mask_2=conditioning["prompt_embeds_mask_2"],
            return_dict=False,
        )[0]  # [n, C, F_lat, h, w]

    def combine_guidance(self, uncond: Tensor, cond: Tensor, guidance_scale: float | Tensor) -> Tensor:
        """ClassifierFreeGuidance.forward with this pipeline's guider settings on float32 ``[n, C, F, h, w]``
        velocities: v_u + w·(v_c − v_u) (or v_c + w·(v_c − v_u) with ``use_original_formulation``), then with
        ``guidance_rescale`` φ > 0 diffusers' ``rescale_noise_cfg``: the guided velocity scaled to the conditional
        one's standard deviation over each sample's elements, mixed φ : 1 − φ with itself."""
        from diffusers.guiders.guider_utils import rescale_noise_cfg

        base = cond if self.original_formulation else uncond
        guided = base + guidance_scale * (cond - uncond)
        if self.guidance_rescale > 0:
            guided = rescale_noise_cfg(guided, cond, self.guidance_rescale)
        return guided

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        vae = self.vae
        videos = []
        # One video per call: it bounds memory (a 121-frame 480p video's decoder activations take many GB), and the
        # VAE's mid-block attention (diffusers 0.42.1) builds a [b, T, T] causal mask that does not broadcast against
        # its [b, 1, T, c] queries for b > 1, so the pipeline itself decodes a batch of one only.
        for part in latents.to(vae.dtype).split(1):  # [1, C, F_lat, h, w]
            part = part / vae.config.scaling_factor  # the pipeline's only un-normalisation: no shift, no statistics
            videos.append(vae.decode(part, return_dict=False)[0].float())  # [1, 3, F, H, W] in about [-1, 1]
        return (torch.cat(videos) / 2 + 0.5).clamp(0, 1)  # [N, 3, F, H, W]
