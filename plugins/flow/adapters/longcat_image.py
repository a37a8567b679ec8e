"""LongCat-Image (``LongCatImagePipeline``: meituan-longcat/LongCat-Image, LongCat-Image-Dev): a 6B FLUX-style MMDiT
(10 double-stream and 20 single-stream blocks of width 3072) on FLUX's packed latents (2×2 patches of a 16-channel
``AutoencoderKL`` with shift and scale), text from the last hidden layer of Qwen2.5-VL-7B read inside a chat template
whose system turn is cut away, true classifier-free guidance with LongCat's "cfg renorm" of the guided velocity, and
FLUX's resolution-dependent σ shift.

Source: diffusers 0.42.1, ``pipelines/longcat_image/pipeline_longcat_image.py`` (line numbers below are of that file)
and ``models/transformers/transformer_longcat_image.py``. What it shares with FLUX.1, and takes from
:class:`~mmrl.plugins.flow.adapters.flux.FluxAdapter`: the VAE factor, ``_pack_latents``/``_unpack_latents``, the noise
``[16, h, w]`` per sample, the σ grid ``linspace(1, 1/S, S)`` with μ of ``calculate_shift`` of the image tokens passed
to the scheduler (602-617; LongCat's own ``calculate_shift`` has FLUX's formula and defaults: base 0.5 at 256 tokens,
1.15 at 4096), the decode ``latents / scaling_factor + shift_factor`` (686-693). What differs, and is this file:

- **Prompts** (``_encode_prompt`` 274-333, ``encode_prompt`` 335-357): each prompt is cut by ``split_quotation``
  (75-106) into quoted and unquoted parts; a quoted part is tokenized character by character (so that the model reads
  text to render letter by letter), the rest as it is, without special tokens, truncated to ``tokenizer_max_length``
  (512) tokens and right-padded to exactly 512 with an attention mask; the template's system turn (``"As an image
  captioning expert, ..."``) and ``<|im_start|>user\\n`` go in front, ``<|im_end|>\\n<|im_start|>assistant\\n`` after
  the padding; Qwen2.5-VL runs with the mask, and its last hidden state without the template's tokens is the
  conditioning: ``prompt_embeds [n, 512, D]``, the padding positions' states included. The adapter calls the
  pipeline's own ``encode_prompt``, so all of this is the pipeline's code. The transformer gets **no text mask**
  (its forward has no mask argument): it attends to the 512 positions whatever the prompt's length, so the length is
  part of the model and ``plugin.max_sequence_length`` takes 512 (or null) only. Every prompt has the same padded
  length and Qwen2.5-VL is causal with the mask's own position ids, so a row does not depend on the prompts encoded
  or batched with it.
- **Prompt rewriting**: ``__call__`` defaults to ``enable_prompt_rewrite=True`` (573-575), which has the text encoder
  *generate* a rewritten prompt (``rewire_prompt`` 242-272, the instructions of ``system_messages.py``) before
  encoding it. That is a sampled LLM step outside the denoiser, not part of the trained policy: the adapter encodes
  the prompt as given, i.e. the pipeline with ``enable_prompt_rewrite=False``, as the other adapters leave prompt
  upsamplers out. Rewrite the prompt file beforehand to train on rewritten prompts.
- **Negative prompt** (577-588): ``""`` by default, encoded exactly as a prompt (same template and padding), so the
  base :meth:`FlowAdapter.encode_negative_prompt` is the pipeline's.
- **Guidance** (655-661): true CFG whenever ``guidance_scale`` > 1 (``do_classifier_free_guidance`` 381-383), default
  4.5, v = v_u + w·(v_c − v_u), then with ``enable_cfg_renorm`` (default True) each token's guided velocity is scaled
  by ``clamp(‖v_c‖ / (‖v‖ + 1e-8), cfg_renorm_min, 1)`` (norms over the packed channel axis; ``cfg_renorm_min``
  default 0.0): with the default floor the guided velocity is never longer than the conditional one; unlike
  Qwen-Image's rescale (always to ‖v_c‖) it only shortens. ``plugin.cfg: false`` is the pipeline's unguided pass
  (its ``guidance_scale`` ≤ 1); with ``cfg: true`` the plugin combines at the scale given, also ≤ 1, where the
  pipeline would switch CFG off. The renorm is part of the policy: rollouts, log-probs and the training forward all step
  with the renormed velocity (:meth:`LongCatImageAdapter.combine_guidance`). The pipeline makes two transformer calls
  and combines in the latents' dtype; the plugin one ``[uncond; cond]`` call combined in float32 (rounding only:
  no mask, no batch-dependent op). ``plugin.adapter_options``: ``enable_cfg_renorm`` (bool) and ``cfg_renorm_min``
  (in [0, 1]; 1 turns the renorm off as the pipeline documents), the pipeline's keywords.
- **The transformer call** (632-653): ``timestep = t / 1000`` in the latents' dtype (the model multiplies it back by
  1000, transformer line 500), no guidance embedding (``guidance=None``; the model has none), rotary ids of three
  axes: text ``(0, i, i)`` for i < 512, image tokens ``(1, 512 + row, 512 + column)`` on the h/2 × w/2 grid (the
  pipeline's ``prepare_pos_ids`` 109-130 with ``start = tokenizer_max_length``, 401-407): the modality axis and the
  offset keep image positions apart from text positions, unlike FLUX's zero text ids.
- **Sizes**: ``check_inputs`` (448-451) only warns on a size that is not a multiple of 16 and floors it
  (``prepare_latents`` 398-399); the adapter requires multiples of ``vae_scale_factor·2`` (16 for the released VAE)
  instead of generating another size than asked.

LoRA targets: FLUX.1's (Flow-GRPO's FLUX set: the attention projections of both streams and both feed-forwards of the
double-stream blocks), the same module names in LongCat's blocks. ``LongCatImagePipeline`` has no LoRA loader mixin
(no ``load_lora_weights``, diffusers 0.42.1): load an exported adapter into its transformer with
``pipe.transformer.load_lora_adapter(folder, prefix="transformer", weight_name="pytorch_lora_weights.safetensors")``
(its ``PeftAdapterMixin``; tested).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning
from mmrl.plugins.flow.adapters.flux import FluxAdapter

#: ``adapter_options`` keys: ``LongCatImagePipeline.__call__``'s renorm keywords, and what each takes.
OPTIONS = {"enable_cfg_renorm": "true or false (scale the guided velocity down to the conditional one's norm)",
           "cfg_renorm_min": "a number in [0, 1] (the smallest renorm factor; 1 turns the renorm off)"}


class LongCatImageAdapter(FluxAdapter):
    """Adapter for ``LongCatImagePipeline`` (LongCat-Image, LongCat-Image-Dev; text-to-image, true CFG with renorm)."""

    name = "longcat_image"
    pipeline_classes = ("LongCatImagePipeline",)
    default_guidance_scale = 4.5  # LongCatImagePipeline.__call__'s guidance_scale
    supports_cfg = True
    guidance_embedded = False
    default_max_sequence_length = 512  # the pipeline's tokenizer_max_length: every prompt is padded to it

    def __init__(self, pipeline: Any, device: torch.device):
        super().__init__(pipeline, device)  # FluxAdapter.__init__ refuses another class than pipeline_classes
        #: ``adapter_options.enable_cfg_renorm`` / ``cfg_renorm_min``: the pipeline's defaults.
        self.enable_cfg_renorm = True
        self.cfg_renorm_min = 0.0

    def configure(self, options: dict[str, Any], *, cfg: bool) -> None:
        """``plugin.adapter_options``: ``enable_cfg_renorm`` (bool, default true) and ``cfg_renorm_min`` (a number in
        [0, 1], default 0.0), as ``LongCatImagePipeline.__call__`` takes them. Both shape the CFG velocity only, so
        they are refused with ``plugin.cfg`` false (there is no guided velocity to renorm)."""
        unknown = [key for key in options if key not in OPTIONS]
        if unknown:
            raise ValueError(f"keys of {', '.join(OPTIONS)} (the {self.name} adapter's); {unknown[0]!r} is not one")
        if "enable_cfg_renorm" in options:
            value = options["enable_cfg_renorm"]
            if not isinstance(value, bool):
                raise ValueError(f"enable_cfg_renorm: {OPTIONS['enable_cfg_renorm']}; got {value!r}")
            self.enable_cfg_renorm = value
        if "cfg_renorm_min" in options:
            value = options["cfg_renorm_min"]
            if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
                    or not 0.0 <= value <= 1.0):
                raise ValueError(f"cfg_renorm_min: {OPTIONS['cfg_renorm_min']}; got {value!r}")
            self.cfg_renorm_min = float(value)
        if options and not cfg:
            raise ValueError(f"{', '.join(options)}: unset with plugin.cfg false (the renorm scales the CFG velocity, "
                             "and without the unconditional pass there is none)")

    def _check_length(self, max_sequence_length: int) -> None:
        """``max_sequence_length`` must be the pipeline's fixed text length (``tokenizer_max_length``)."""
        length = int(self.pipeline.tokenizer_max_length)  # 512 in diffusers 0.42.1
        if max_sequence_length != length:
            raise ValueError(f"plugin.max_sequence_length is {max_sequence_length}; {self.pipeline_classes[0]} pads "
                             f"every prompt to exactly {length} tokens and its transformer attends to all of them (no "
                             f"text mask), so only {length} (or null) reproduces it")

    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> Conditioning:
        self._check_length(max_sequence_length)
        embeds, _ = self.pipeline.encode_prompt(prompt=prompts, num_images_per_prompt=1)
        return {"prompt_embeds": embeds.to(self.device)}  # [n, 512, D]: template cut, padding positions kept

    def _position_ids(self, image_tokens: int, text_tokens: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """LongCat's rotary ids, cached: image tokens ``[h/2·w/2, 3]`` = (1, 512 + row, 512 + column), row-major as
        ``_pack_latents`` lays them out, and text tokens ``[L, 3]`` = (0, i, i), both float32 as the pipeline builds
        them (``prepare_pos_ids``; the transformer reads them as float)."""
        from diffusers.pipelines.longcat_image.pipeline_longcat_image import prepare_pos_ids

        rows, columns = (side // 2 for side in self.latent_size())
        if rows * columns != image_tokens:
            raise ValueError(f"longcat_image adapter: {image_tokens} latent tokens, but a {self.height}x{self.width} "
                             f"image has {rows * columns} ({rows} x {columns})")
        start = int(self.pipeline.tokenizer_max_length)  # the image ids start after the text's, as prepare_latents
        key = (rows, columns, text_tokens, like.device)
        if key not in self._ids:
            image = prepare_pos_ids(modality_id=1, type="image", start=(start, start), height=rows, width=columns)
            text = prepare_pos_ids(modality_id=0, type="text", start=(0, 0), num_token=text_tokens)
            self._ids[key] = (image.to(like.device), text.to(like.device))
        return self._ids[key]

    def _transformer(self, module: nn.Module, tokens: Tensor, image_ids: Tensor, text_ids: Tensor, timesteps: Tensor,
                     conditioning: Conditioning, guidance_scale: float) -> Tensor:
        # guidance_scale is unused: LongCat has no guidance embedding; CFG is the base adapter's velocity()
        return module(
            hidden_states=tokens,  # [n, T, 4C]
            timestep=timesteps.to(tokens.dtype) / 1000,  # as the pipeline: t/1000 in the latents' dtype
            encoder_hidden_states=conditioning["prompt_embeds"],  # [n, 512, D], no mask
            txt_ids=text_ids,
            img_ids=image_ids,
            return_dict=False,
        )[0]

    def combine_guidance(self, uncond: Tensor, cond: Tensor, guidance_scale: float | Tensor) -> Tensor:
        """v = v_u + w·(v_c − v_u), then (``enable_cfg_renorm``) each token (``[n, tokens, 4C]``) scaled by
        ``clamp(‖v_c‖ / (‖v‖ + 1e-8), cfg_renorm_min, 1)`` as ``LongCatImagePipeline.__call__`` (655-661)."""
        guided = super().combine_guidance(uncond, cond, guidance_scale)
        if not self.enable_cfg_renorm:
            return guided
        scale = cond.norm(dim=-1, keepdim=True) / (guided.norm(dim=-1, keepdim=True) + 1e-8)  # [n, tokens, 1]
        return guided * scale.clamp(min=self.cfg_renorm_min, max=1.0)
