"""Qwen3-VL: JSON boxes on a relative 0–1000 grid; 16-pixel patches merged 2×2 (images resize to multiples of 32).

Registered only when the installed transformers has ``transformers.models.qwen3_vl``. The patch size is read from
the checkpoint's image processor, so the shared base class needs nothing else. The 0–1000 convention follows the
model card's grounding examples; check it against the checkpoint you train.
"""

from __future__ import annotations

from mmrl.plugins.vlm.adapters.base import VLMAdapter


class Qwen3VLAdapter(VLMAdapter):
    """Qwen3-VL (dense) through ``transformers.Qwen3VLForConditionalGeneration``."""

    name = "qwen3_vl"
    # Its vision tower also feeds intermediate ("deepstack") features into the language model's first layers: the
    # feature cache keeps them beside the pooled features (image_deepstack / video_deepstack, [layers, tokens,
    # hidden]) and hands both back through mm_encoder_outputs, as transformers 5.25's get_image_features returns them.
    model_types = ("qwen3_vl",)
    model_class = "Qwen3VLForConditionalGeneration"
    box_convention = "qwen3_vl"
