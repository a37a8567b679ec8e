"""Qwen3-VL MoE (Qwen3-VL-30B-A3B, -235B-A22B): Qwen3-VL with sparse mixture-of-experts MLPs in the language model.

Registered only when the installed transformers has ``transformers.models.qwen3_vl_moe``. Everything the plugin does
with Qwen3-VL applies (its deepstack features are cached with the pooled ones). The experts are fused parameters
(``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``, one 3-D tensor per layer in transformers 5.x), not
linear modules, so LoRA's module-name targets reach the attention projections only; full fine-tuning trains the
experts and the routers. The training pass adds the routers' load-balancing loss (``plugin.router_aux_loss_coef``).
"""

from __future__ import annotations

from mmrl.plugins.vlm.adapters.qwen3_vl import Qwen3VLAdapter


class Qwen3VLMoeAdapter(Qwen3VLAdapter):
    """Qwen3-VL MoE through ``transformers.Qwen3VLMoeForConditionalGeneration``."""

    name = "qwen3_vl_moe"
    model_types = ("qwen3_vl_moe",)
    model_class = "Qwen3VLMoeForConditionalGeneration"
    moe = True
