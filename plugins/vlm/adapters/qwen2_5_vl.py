"""Qwen2.5-VL (arXiv:2502.13923): JSON boxes ``{"bbox_2d": [x1, y1, x2, y2]}`` in pixels of the resized input."""

from __future__ import annotations

from mmrl.plugins.vlm.adapters.base import VLMAdapter


class Qwen25VLAdapter(VLMAdapter):
    """Qwen2.5-VL-3B/7B/32B/72B-Instruct through ``transformers.Qwen2_5_VLForConditionalGeneration``.

    Boxes are absolute pixels of the image *as resized by the processor* (smart_resize within
    [min_pixels, max_pixels]); dataset rows therefore carry ``resized_size`` next to ``image_size`` and the box
    rewards map predictions back to original pixels with the ``qwen2_5_vl`` convention.
    """

    name = "qwen2_5_vl"
    model_types = ("qwen2_5_vl",)
    model_class = "Qwen2_5_VLForConditionalGeneration"
    box_convention = "qwen2_5_vl"
