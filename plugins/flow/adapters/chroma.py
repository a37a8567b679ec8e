"""Chroma (``ChromaPipeline``: lodestones/Chroma1-HD, Chroma1-Base): an 8.9B derivative of FLUX.1-schnell. What it
shares with FLUX.1, and takes from :class:`~mmrl.plugins.flow.adapters.flux.FluxAdapter`: the 16-channel VAE with
its shift and scale, latents packed into 2×2 patches, the (0, row, column) rotary ids of the image tokens and the
zero ids of the text tokens, the σ grid ``linspace(1, 1/S, S)`` with FLUX's ``calculate_shift`` of the image tokens
(passed to a dynamically shifting scheduler), the transformer's timestep σ in the latents' dtype. What differs, and
is this file (diffusers 0.42.1, ``pipelines/chroma/pipeline_chroma.py`` and
``models/transformers/transformer_chroma.py``):

- **Text**: T5 only (no CLIP, no pooled projection). ``_get_t5_prompt_embeds`` (pipeline lines 208-262) pads every
  prompt to ``max_sequence_length`` (at most 512, ``check_inputs`` line 468), runs T5 *with* the tokenizer's
  attention mask (FLUX runs it without), and builds the transformer's text mask from the real tokens (EOS included)
  **plus the first padding token** (lines 248-251: position ≤ number of real tokens). The cached rows keep that
  mask (``prompt_attention_mask`` ``[n, L]``, 1 = attended); every prompt has the same padded length, so a row does
  not depend on the prompts encoded or batched with it.
- **The mask at the transformer**: ``_prepare_attention_mask`` (lines 545-561) appends ones for the image tokens, and
  each block multiplies it into a ``[n, 1, S, S]`` pair mask (transformer lines 244-245, 312-313) handed to
  ``scaled_dot_product_attention``. In diffusers 0.42.1 the text mask is created in the text encoder's float dtype,
  and SDPA reads a float mask as an additive bias, not as keep/drop: kept pairs get +1 on their score, the others +0,
  so padding is down-weighted by a factor e, not removed (huggingface/diffusers#12116, closed, and reported still
  present in #13619). The adapter hands the transformer the mask in the dtype the pipeline gives it (float here: the
  same bias; bool, were diffusers to fix it: a real mask), so it reproduces the installed pipeline either way; the
  pipeline-equality test fails when the mask is dropped or made boolean. ``plugin.adapter_options: {text_mask:
  boolean}`` gives the transformer a boolean mask instead, padding after the first pad token removed from attention,
  as the Chroma authors' trainer builds it (lodestone-rock/flow@bb5274c ``src/models/chroma/model.py:57-87`` unmasks
  ``attn_padding`` = 1 pad token, ``:228-250`` makes the pair mask boolean; for one sample, its ``mask.T @ mask``
  being a union over a batch) and ChromaPipeline samples when handed a boolean ``prompt_attention_mask``; images then
  differ from the plain pipeline's.
- **Guidance**: no guidance embedding (Chroma pruned it; the approximator ``distilled_guidance_layer`` produces every
  block's modulation from the timestep alone) but true CFG: a second call on the negative prompt (default ``""``,
  ``encode_prompt`` line 328) with its own mask, v = v_u + w·(v_c − v_u), default w = 5.0 (``__call__`` line 597;
  CFG whenever w > 1, line 573). The pipeline makes two calls and combines in the model's dtype; the plugin one
  [uncond; cond] call combined in float32.
- **Gradient checkpointing**: ``ChromaTransformer2DModel.forward`` passes no attention mask to its single-stream
  blocks when it checkpoints them (transformer line 589), so a checkpointed training forward would differ from the
  rollout (no grad, no checkpointing) and the ratio would not be 1. While the model checkpoints, the adapter hands
  those blocks the mask the uncheckpointed forward gives them (:meth:`ChromaAdapter._masked_checkpointing`).

LoRA targets: FLUX.1's (Flow-GRPO's FLUX set: the attention projections of both streams and the feed-forward layers
of the double-stream blocks), the same module names in Chroma's blocks; the approximator is left frozen. A LoRA
trained here loads with ``ChromaPipeline.load_lora_weights`` (its ``FluxLoraLoaderMixin``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning
from mmrl.plugins.flow.adapters.flux import FluxAdapter

#: ``ChromaPipeline.check_inputs`` refuses a longer ``max_sequence_length`` (pipeline_chroma.py:468).
MAX_T5_TOKENS = 512
#: ``adapter_options.text_mask``: the mask as ChromaPipeline builds it, or a boolean keep/drop mask.
TEXT_MASKS = ("pipeline", "boolean")


class ChromaAdapter(FluxAdapter):
    """Adapter for ``ChromaPipeline`` (Chroma1-HD, Chroma1-Base and fine-tunes): FLUX.1's latents, ids, σ grid and
    decode, with T5-only masked text and true classifier-free guidance instead of the guidance embedding."""

    name = "chroma"
    pipeline_classes = ("ChromaPipeline",)
    default_guidance_scale = 5.0  # ChromaPipeline.__call__'s guidance_scale
    supports_cfg = True
    guidance_embedded = False
    default_max_sequence_length = 512  # ChromaPipeline's default (also its maximum)

    def __init__(self, pipeline: Any, device: torch.device):
        # By name (plugin.adapter: chroma) any checkpoint reaches here; FluxAdapter.__init__ refuses another class
        # than ChromaPipeline (a FLUX.1 one would otherwise fail only at the first prompt, inside
        # FluxPipeline.encode_prompt: no negative_prompt keyword, a TypeError)
        super().__init__(pipeline, device)
        #: The dtype of the text mask ChromaPipeline builds (its text encoder's float dtype in diffusers 0.42.1,
        #: bool were it fixed), read at the first :meth:`encode_prompts`: the transformer gets the mask so.
        self._pipeline_mask_boolean: bool | None = None
        #: ``adapter_options.text_mask`` (:data:`TEXT_MASKS`).
        self.text_mask = "pipeline"

    def configure(self, options: dict[str, Any], *, cfg: bool) -> None:
        """``plugin.adapter_options``: ``text_mask`` only, ``pipeline`` (the default: ChromaPipeline's mask in the
        dtype it builds it, an additive bias in diffusers 0.42.1) or ``boolean`` (padding after the first pad token
        removed from attention, as the Chroma authors' trainer masks it)."""
        unknown = [key for key in options if key != "text_mask"]
        if unknown:
            raise ValueError(f"keys of text_mask (the {self.name} adapter's); {unknown[0]!r} is not one")
        value = options.get("text_mask", "pipeline")
        if value not in TEXT_MASKS:
            raise ValueError(f"text_mask: 'pipeline' (ChromaPipeline's mask as diffusers builds it) or 'boolean' (a "
                             f"keep/drop mask, as the Chroma authors' trainer); got {value!r}")
        self.text_mask = value

    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> Conditioning:
        if not 1 <= max_sequence_length <= MAX_T5_TOKENS:
            raise ValueError(f"plugin.max_sequence_length is {max_sequence_length}; ChromaPipeline takes 1 to "
                             f"{MAX_T5_TOKENS} T5 tokens")
        prompt_embeds, _, mask, _, _, _ = self.pipeline.encode_prompt(
            prompt=prompts, negative_prompt=None, device=self.device, num_images_per_prompt=1,
            do_classifier_free_guidance=False, max_sequence_length=max_sequence_length,
        )
        self._pipeline_mask_boolean = mask.dtype == torch.bool
        # prompt_embeds [n, L, D_t5], L = max_sequence_length; mask [n, L]: 1 on the real tokens and the first pad.
        # Stored as 0/1 floats: the sampler casts every conditioning tensor to the transformer's input dtype.
        return {"prompt_embeds": prompt_embeds, "prompt_attention_mask": mask.to(prompt_embeds.dtype)}

    def _attention_mask(self, text_mask: Tensor, image_tokens: int, like: Tensor) -> Tensor:
        """The transformer's ``attention_mask`` ``[n, L + T]`` as ``ChromaPipeline._prepare_attention_mask`` builds it
        from the text mask ``[n, L]`` (0/1) and ``image_tokens`` T image tokens (always attended): in the pipeline's
        dtype for the text mask, which decides how SDPA reads it (a float: an additive bias; bool: keep/drop), or
        boolean with ``text_mask: boolean``."""
        if self.text_mask == "boolean":
            return self.pipeline._prepare_attention_mask(batch_size=text_mask.shape[0], sequence_length=image_tokens,
                                                         dtype=like.dtype, attention_mask=text_mask > 0.5)
        if self._pipeline_mask_boolean is None:
            raise RuntimeError("chroma adapter: no prompt encoded yet, so the pipeline's text-mask dtype is unknown; "
                               "call encode_prompts before the transformer")
        text_mask = text_mask > 0.5 if self._pipeline_mask_boolean else text_mask.to(like.dtype)
        return self.pipeline._prepare_attention_mask(batch_size=text_mask.shape[0], sequence_length=image_tokens,
                                                     dtype=like.dtype, attention_mask=text_mask)

    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        # guidance_scale is unused here: Chroma has no guidance embedding; CFG is the base adapter's velocity()
        text = conditioning["prompt_embeds"]  # [n, L, D_t5]
        image_ids, text_ids = self._position_ids(latents.shape[1], text.shape[1], latents)
        mask = self._attention_mask(conditioning["prompt_attention_mask"], latents.shape[1], latents)  # [n, L+T]
        with self._masked_checkpointing(module, mask):
            return module(
                hidden_states=latents,  # [n, T, 4C]
                timestep=timesteps.to(latents.dtype) / 1000,  # as ChromaPipeline: σ in the latents' dtype
                encoder_hidden_states=text,
                txt_ids=text_ids,
                img_ids=image_ids,
                attention_mask=mask,
                return_dict=False,
            )[0]

    @staticmethod
    @contextmanager
    def _masked_checkpointing(module: nn.Module, mask: Tensor) -> Iterator[None]:
        """While ``module`` (a ``ChromaTransformer2DModel``, or a wrapper holding one) checkpoints with gradients on,
        give its checkpointed single-stream blocks the ``attention_mask`` its forward passes them uncheckpointed.

        diffusers 0.42.1 ``transformer_chroma.py:589`` calls ``_gradient_checkpointing_func(block, hidden_states,
        temb, image_rotary_emb)`` for those blocks, dropping the mask the uncheckpointed call passes (line 601): the
        training forward would then compute other velocities than the rollout. The checkpoint function is wrapped
        for the duration of one call so that it appends the mask (the block's fourth positional argument) to exactly
        those calls; a diffusers that passes it itself is left alone."""
        from diffusers.models.transformers.transformer_chroma import (
            ChromaSingleTransformerBlock,
            ChromaTransformer2DModel,
        )

        model = None
        if torch.is_grad_enabled():
            model = next((m for m in module.modules() if isinstance(m, ChromaTransformer2DModel)), None)
        if model is None or not model.gradient_checkpointing:
            yield
            return
        checkpoint = model._gradient_checkpointing_func

        def with_mask(block: nn.Module, *args: Any) -> Any:
            if isinstance(block, ChromaSingleTransformerBlock) and len(args) == 3:
                return checkpoint(block, *args, mask)  # hidden_states, temb, image_rotary_emb, attention_mask
            return checkpoint(block, *args)

        model._gradient_checkpointing_func = with_mask
        try:
            yield
        finally:
            model._gradient_checkpointing_func = checkpoint
