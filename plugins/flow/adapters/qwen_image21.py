"""Qwen-Image 2.1 (``QwenImage21Pipeline``): a single-stream, block-causal transformer on one joint sequence of text
(and condition-image) tokens followed by the target image's latent tokens, text from the pre-norm last hidden state of
a Qwen3-VL encoder run on a raw chat template whose system turn is dropped, a 64-channel RGBA 3-D VAE with a spatial
factor of 16, FLUX-style resolution-dependent shifting of the σ grid, and no guidance by default.

What the adapter reproduces from ``QwenImage21Pipeline.__call__`` (diffusers 0.42.1,
``pipelines/qwenimage21/pipeline_qwenimage21.py``) with ``use_kv_cache=False``:

- prompts: ``pipeline.encode_prompt`` (``_get_qwen_prompt_embeds``: the text-to-image template
  ``<|im_start|>system ... <|im_end|><|im_start|>user\\n{prompt}<|im_end|><|im_start|>assistant\\n``, the input of the
  text model's final norm, which the pipeline takes with a forward hook, each prompt's real tokens with the
  ``_drop_idx`` tokens of the system turn dropped). Each prompt is encoded alone and zero-padded here to
  ``max_sequence_length`` with ``prompt_embeds_mask`` marking its real tokens, since the plugin caches prompts one
  by one with the sample axis first. The pipeline has no length limit; a longer prompt is refused in one line.
- the transformer call: every row is cut back to its real tokens before the call, and rows of one length share a
  call, so each sees exactly the sequence the pipeline builds for it alone. This matters: the transformer's RoPE
  advances the position of every text token, padding included, and puts the image after the last one, so padded
  text moves the image relative to its words (the pipeline given a batch of prompts of unequal lengths pads them to
  the longest, and a short prompt's image then depends on its companions; the adapter computes each prompt as the
  pipeline does alone). A batch whose rows have different lengths costs one transformer call per length.
  ``img_mask`` is the prompt's ``image_pad_mask`` (no image slot in text-to-image) with one slot appended per 2×2
  group of target tokens, ``img_shapes`` ``[(1, h, w)]`` in latent tokens, the timestep ``t / 1000`` in the latents'
  dtype, and the output cut to the last ``h·w`` tokens (``[:, -latents.size(1):]``).
- noise ``[1, C, h, w]`` per sample (the pipeline's ``[B, 1, C, h, w]``, C = ``transformer.in_channels``,
  h = 2·⌊H/32⌋ = H/16), packed by a plain flatten to ``[h·w, C]`` (``_pack_latents``: 2.1 takes its latents
  unpatched); ``height`` and ``width`` must each be a multiple of 32 (VAE factor 16 × the 2×2 latent tokens of an
  image slot; the pipeline would round a side down).
- σ: the pipeline config's ``sample_sigmas`` when it is set and has ``num_steps`` entries, else
  ``linspace(1, 1/S, S)``, shifted with μ = ``calculate_shift(h·w, ...)`` from the scheduler config. A configured
  grid fixes the pipeline's number of steps (it then ignores ``num_inference_steps``); for another number of steps
  (rollouts are usually shorter than evaluations) the adapter takes the linspace grid, the pipeline's with
  ``sigmas=np.linspace(1, 1/S, S)``, and warns once.
- guidance: the pipeline's default ``true_cfg_scale`` is 1.0 (Qwen-Image 2.1 is sampled without guidance), so a
  null ``plugin.cfg`` is off here (:attr:`~FlowAdapter.cfg_by_default`); with ``plugin.cfg: true`` the pipeline's
  plain v = v_u + w·(v_c − v_u), combined in float32 from one [uncond; cond] call grouped by text length (the
  pipeline makes two calls).
- decode: latents·std + mean per channel (``vae.config.latents_mean``/``latents_std``), the VAE's only frame, then
  ``(x / 2 + 0.5).clamp(0, 1)`` as ``output_type="pt"``. The released VAE decodes RGBA (4 channels), which the
  pipeline hands back as they are; the rewards take RGB, so an alpha channel is composited over white here
  (rgb·α + 1 − α), the background the pipeline composites input images' alpha over for its text encoder.

The prompt/condition K/V cache (``use_kv_cache=True``, the pipeline's default) is an inference optimisation: under
``causal_condition`` the text tokens are modulated from t = 0, so their keys and values do not change across steps and
the pipeline computes them once; without it every step recomputes the same numbers, so the two differ only by
rounding (the pipeline's docstring: equally valid, not bit-identical). The plugin needs gradients through the whole
sequence at the trained steps and recomputes every step, so it runs the uncached path, and the tests compare it with
the pipeline called with ``use_kv_cache=False``.

LoRA defaults: the attention projections ``attn.to_q/k/v``, ``attn.to_out.0`` and the three SwiGLU feed-forward
linears ``img_mlp.proj``, ``img_mlp.gate_layer``, ``img_mlp.out`` of every block (the layers the transformer's
tensor-parallel plan shards; the shared ``modulation``, ``txt_in``, ``img_in`` and ``proj_out`` stay frozen).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning, FlowAdapter, call_per_group, refuse_other_pipelines
from mmrl.plugins.flow.adapters.qwen_image import padded_text

#: Latent tokens per image slot of the text encoder's sequence: a 2×2 group (the transformer's
#: ``_IMG_TOKENS_PER_SLOT``).
TOKENS_PER_SLOT = 4


class QwenImage21Adapter(FlowAdapter):
    """Adapter for ``QwenImage21Pipeline`` (Qwen/Qwen-Image-2.1 and fine-tunes with the same pipeline class),
    text-to-image. The pipeline's image-conditioned path (``image=``) is the ``qwen_image21_edit`` adapter
    (:mod:`~mmrl.plugins.flow.adapters.qwen_image21_edit`), whose condition-image tokens and slots
    :meth:`_by_text_length` lays out."""

    name = "qwen_image21"
    pipeline_classes = ("QwenImage21Pipeline",)
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "img_mlp.proj", "img_mlp.gate_layer", "img_mlp.out")
    default_guidance_scale = 4.0  # only with plugin.cfg true: the pipeline's own default, 1.0, is no guidance
    supports_cfg = True
    cfg_by_default = False  # QwenImage21Pipeline.__call__'s true_cfg_scale 1.0: sampled without guidance
    default_max_sequence_length = 512  # the pipeline has no limit; this only bounds the cached prompt tensors

    def __init__(self, pipeline: Any, device: torch.device):
        refuse_other_pipelines(type(self), pipeline)  # before anything reads the pipeline's components
        super().__init__(pipeline, device)
        #: Step counts the configured ``sample_sigmas`` did not fit (warned once each).
        self._warned_steps: set[int] = set()

    @property
    def vae_scale_factor(self) -> int:
        return int(self.pipeline.vae_scale_factor)  # 16, fixed by QwenImage21Pipeline.__init__

    def resolution_multiple(self) -> int:
        return self.vae_scale_factor * 2  # a text-encoder image slot covers 2×2 latent tokens

    # ------------------------------------------------------------------ prompts
    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> Conditioning:
        rows = []
        for prompt in prompts:  # alone: a batch would be left-padded in the text encoder and right-padded after it
            embeds, mask, image_pad_mask = self.pipeline.encode_prompt(prompt=[prompt], device=self.device)
            rows.append(self._padded(prompt, embeds, mask, image_pad_mask, max_sequence_length, "its"))
        return {key: torch.cat([row[key] for row in rows]) for key in rows[0]}

    def _padded(self, prompt: str, embeds: Tensor, mask: Tensor | None, image_pad_mask: Tensor,
                max_sequence_length: int, what: str) -> Conditioning:
        """One prompt's encoding ``[1, L, D]`` zero-padded to ``max_sequence_length`` with ``prompt_embeds_mask`` and
        ``image_pad_mask`` (``[1, L_max]``, 1 at the text encoder's image slots) beside it."""
        length = embeds.shape[1]
        if length > max_sequence_length:
            raise ValueError(f"plugin.max_sequence_length is {max_sequence_length}, but {prompt[:40]!r} with {what} "
                             f"template is {length} text tokens: raise it")
        padded = padded_text(embeds, mask, max_sequence_length)  # [1, L_max, D], [1, L_max]
        slots = torch.zeros(1, max_sequence_length, dtype=torch.long, device=embeds.device)  # [1, L_max]
        slots[:, :length] = image_pad_mask.long()
        return {**padded, "image_pad_mask": slots}

    # ------------------------------------------------------------------ latents and schedule
    def noise_shape(self) -> tuple[int, ...]:
        return (1, self.transformer.config.in_channels, *self.latent_size())  # [frames = 1, C, h, w]

    def pack(self, noise: Tensor) -> Tensor:
        n, _, channels, height, width = noise.shape  # [n, 1, C, h, w]
        return noise.reshape(n, channels, height * width).transpose(1, 2)  # [n, h·w, C], raster order

    def unpack(self, latents: Tensor) -> Tensor:
        h, w = self.latent_size()
        n, _, channels = latents.shape  # [n, h·w, C]
        return latents.transpose(1, 2).reshape(n, channels, 1, h, w)  # [n, C, 1, h, w]

    def image_seq_len(self) -> int:
        h, w = self.latent_size()
        return h * w  # the pipeline's μ reads latents.shape[1]: every latent token, unpatched

    def default_sigmas(self, num_steps: int) -> list[float]:
        configured = self.pipeline.config.get("sample_sigmas")
        if configured is not None and len(configured) == num_steps:
            return [float(sigma) for sigma in configured]
        if configured is not None and num_steps not in self._warned_steps:
            self._warned_steps.add(num_steps)
            warnings.warn(f"qwen_image21 adapter: the pipeline's sample_sigmas has {len(configured)} steps; "
                          f"{num_steps} steps use linspace(1, 1/{num_steps}, {num_steps}) instead", stacklevel=2)
        return np.linspace(1.0, 1 / num_steps, num_steps).tolist()  # as QwenImage21Pipeline.__call__

    # ------------------------------------------------------------------ the transformer
    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        return self._by_text_length(module, latents, timesteps, conditioning)

    def _target_shape(self, latents: Tensor) -> tuple[int, int, int]:
        """``(1, h, w)``, the target image's ``img_shapes`` entry in latent tokens, checked against ``latents``."""
        h, w = self.latent_size()
        if h * w != latents.shape[1]:
            raise ValueError(f"Qwen-Image 2.1 adapter: {latents.shape[1]} latent tokens, but a {self.height}x"
                             f"{self.width} image has {h * w} ({h} x {w})")
        return 1, h, w

    def _by_text_length(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                        condition_tokens: Tensor | None = None,
                        condition_shapes: list[tuple[int, int, int]] | None = None) -> Tensor:
        """The transformer on each group of rows whose prompts have one text layout (length and image slots), each
        row cut back to its real tokens as the pipeline encodes a prompt alone; the outputs ``[n, h·w, C]`` back in
        the rows' order. ``condition_tokens`` ``[n, T_in, C]`` (editing) go before the target tokens, laid out as
        ``condition_shapes``."""
        target = self._target_shape(latents)
        mask = conditioning["prompt_embeds_mask"].long()  # [n, L_max], 1 = a real token (a prefix)
        slots = conditioning["image_pad_mask"].long()  # [n, L_max], 1 = an image slot of the text encoder
        layout = torch.cat([mask.sum(dim=1, keepdim=True), slots], dim=1)  # [n, 1 + L_max]: equal rows share a call
        layouts, group = torch.unique(layout, dim=0, return_inverse=True)  # group [n]

        def call(rows: Tensor | None, key: Tensor) -> Tensor:
            pick = (lambda value: value) if rows is None else (lambda value: value.index_select(0, rows))
            length = int(key[0])
            tokens = pick(latents)  # [m, h·w, C]
            if condition_tokens is not None:
                tokens = torch.cat([pick(condition_tokens).to(tokens.dtype), tokens], dim=1)  # [m, T_in + h·w, C]
            m = tokens.shape[0]
            text = pick(conditioning["prompt_embeds"])[:, :length]  # [m, L, D]: the real tokens only
            target_slots = latents.shape[1] // TOKENS_PER_SLOT
            img_mask = torch.cat([key[1:1 + length].bool().expand(m, length),
                                  torch.ones(m, target_slots, dtype=torch.bool, device=key.device)], dim=1)
            output = module(
                hidden_states=tokens,
                encoder_hidden_states=text,
                timestep=pick(timesteps).to(tokens.dtype) / 1000,  # the pipeline passes t/1000 in the latents' dtype
                img_shapes=[[*(condition_shapes or []), target]] * m,  # condition images first, the target last
                img_mask=img_mask,  # [m, L + h·w/4]: the pipeline's image_pad_mask with the target slots appended
                encoder_hidden_states_mask=None,  # every kept token is real: the pipeline drops an all-ones mask
                return_dict=False,
            )[0]
            return output[:, -latents.shape[1]:]  # [m, h·w, C]: the target image's tokens

        return call_per_group(group, lambda rows, index: call(rows, layouts[index]))

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        vae = self.vae
        latents = self.unpack(latents).to(vae.dtype)  # [n, C, 1, h, w]
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        images = vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]  # [n, 3 or 4, H, W], the frame
        return over_white((images.float() / 2 + 0.5).clamp(0, 1))


def over_white(images: Tensor) -> Tensor:
    """``[n, 3, H, W]`` images in [0, 1]: RGB as it is, RGBA ``[n, 4, H, W]`` composited over white."""
    if images.shape[1] == 3:
        return images
    if images.shape[1] != 4:
        raise ValueError(f"Qwen-Image 2.1 adapter: the VAE decoded {images.shape[1]} channels; RGB (3) or RGBA (4) "
                         "are allowed")
    rgb, alpha = images[:, :3], images[:, 3:]  # [n, 3, H, W], [n, 1, H, W]
    return rgb * alpha + (1 - alpha)
