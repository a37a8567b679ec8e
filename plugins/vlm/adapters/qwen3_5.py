"""Qwen3.5: a natively multimodal Qwen whose language model mixes Gated DeltaNet (linear attention) layers with
full-attention layers (``config.text_config.layer_types``), with Qwen3-VL's vision input (16-pixel patches merged
2×2, per-frame video timestamps) and no deepstack features.

Registered only when the installed transformers has ``transformers.models.qwen3_5``.
"""

from __future__ import annotations

from mmrl.plugins.vlm.adapters.base import DEFAULT_LORA_TARGETS, VLMAdapter


class Qwen35Adapter(VLMAdapter):
    """Qwen3.5 (dense) through ``transformers.Qwen3_5ForConditionalGeneration``."""

    name = "qwen3_5"
    model_types = ("qwen3_5",)
    model_class = "Qwen3_5ForConditionalGeneration"
    box_convention = "qwen3_vl"
    # Gated DeltaNet layers (linear_attn.*): their query/key/value, gate and output projections, beside the
    # attention and MLP projections of every layer.
    lora_target_modules = DEFAULT_LORA_TARGETS + ("in_proj_qkv", "in_proj_z", "out_proj")
    # The continuation of a cached prompt updates the linear-attention states in place (transformers 5.25
    # LinearAttentionLayer.update_recurrent_state / update_conv_state): no gradients through a shared prompt.
    cache_keeps_gradients = False
