"""FLUX.2 [klein] (``Flux2KleinPipeline``): FLUX.2's transformer and VAE at 4B and 9B, text from three hidden layers
of a Qwen3 encoder, and no guidance embedding: the base models ("klein-base") take true classifier-free guidance,
the step-distilled ones (``is_distilled`` in ``model_index.json``; 4 steps) no guidance at all.

What differs from FLUX.2 [dev] (:class:`~mmrl.plugins.flow.adapters.flux2.Flux2Adapter`, whose latents, position
ids, σ grid with ``compute_empirical_mu`` and decode this adapter keeps), as ``Flux2KleinPipeline.__call__``
(diffusers 0.42) does it:

- prompts: ``pipeline.encode_prompt``: Qwen3's chat template with ``enable_thinking=False`` (the generation prompt
  ends with an empty ``<think>\\n\\n</think>\\n\\n``), padded to ``max_sequence_length``, hidden layers 9, 18 and 27
  stacked along the width (``[n, L, 3·D]``); as for FLUX.2 [dev] the transformer attends to the padding too.
- the transformer gets ``guidance=None``.
- guidance: the base models run CFG whenever ``guidance_scale`` > 1 (default 4.0) with the empty negative prompt,
  v = v_u + w·(v_c − v_u) (the pipeline makes two calls and combines in the model's dtype; here one [uncond; cond]
  call, combined in float32). The distilled models never run it and ignore the scale (the pipeline only warns):
  here ``plugin.cfg: true`` is refused for them in one line, ``cfg`` defaults to off, and the scale resolves to 1.0
  with anything else refused.

Flow-Factory's klein adapter (X-GenGroup/Flow-Factory@a0b2bc5, ``src/flow_factory/models/flux/flux2_klein.py``) has
the same LoRA targets as its FLUX.2 [dev] one, which are this adapter's too, and its examples train the distilled
4/9B at guidance 1.0 with 4 rollout steps and the base models at guidance 4.0 (``examples/grpo/lora/flux2_klein*/``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mmrl.plugins.flow.adapters.flux2 import Flux2Adapter


class Flux2KleinAdapter(Flux2Adapter):
    """Adapter for ``Flux2KleinPipeline`` (black-forest-labs/FLUX.2-klein-4B, -9B, -base-4B, -base-9B and fine-tunes
    with the same pipeline class; text-to-image)."""

    name = "flux2_klein"
    pipeline_classes = ("Flux2KleinPipeline",)
    default_guidance_scale = 4.0  # Flux2KleinPipeline.__call__'s default (base models)
    guidance_embedded = False
    cfg_refusal = ("is step-distilled (is_distilled in its model_index.json): Flux2KleinPipeline runs no "
                   "unconditional pass for it")

    def __init__(self, pipeline: Any, device: torch.device):
        super().__init__(pipeline, device)
        #: Whether the checkpoint is step-distilled (no guidance at all), from the pipeline's config.
        self.distilled = bool(pipeline.config.get("is_distilled", False))

    @property
    def supports_cfg(self) -> bool:  # type: ignore[override]  # per checkpoint: the base models only
        return not self.distilled

    def _guidance_input(self, n: int, guidance_scale: float, device: torch.device) -> Tensor | None:
        return None  # no guidance embedding: Flux2KleinPipeline passes guidance=None
