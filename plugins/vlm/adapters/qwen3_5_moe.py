"""Qwen3.5 MoE (Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B): Qwen3.5's Gated DeltaNet and full-attention layers with
sparse mixture-of-experts MLPs beside a shared expert.

Registered only when the installed transformers has ``transformers.models.qwen3_5_moe``. Everything the plugin does
with Qwen3.5 applies (linear-attention cache states: no gradients through a shared prompt). The routed experts are
fused parameters (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``), not linear modules, so LoRA's module-name
targets reach the attention, Gated DeltaNet and shared-expert projections; full fine-tuning trains the experts too.
The training pass adds the routers' load-balancing loss (``plugin.router_aux_loss_coef``).
"""

from __future__ import annotations

from mmrl.plugins.vlm.adapters.qwen3_5 import Qwen35Adapter


class Qwen35MoeAdapter(Qwen35Adapter):
    """Qwen3.5 MoE through ``transformers.Qwen3_5MoeForConditionalGeneration``."""

    name = "qwen3_5_moe"
    model_types = ("qwen3_5_moe",)
    model_class = "Qwen3_5MoeForConditionalGeneration"
    moe = True
