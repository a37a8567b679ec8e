"""Qwen2-VL (arXiv:2409.12191): boxes as ``<|box_start|>(x1,y1),(x2,y2)<|box_end|>`` in [0, 1000) of the image."""

from __future__ import annotations

from mmrl.plugins.vlm.adapters.base import VLMAdapter


class Qwen2VLAdapter(VLMAdapter):
    """Qwen2-VL-2B/7B/72B-Instruct through ``transformers.Qwen2VLForConditionalGeneration``.

    Box coordinates are relative to the image on a 0–1000 grid; the box tokens are special tokens, so decode with
    ``skip_special_tokens: false`` (the plugin's default) to keep them for the rewards.
    """

    name = "qwen2_vl"
    model_types = ("qwen2_vl",)
    model_class = "Qwen2VLForConditionalGeneration"
    box_convention = "qwen2_vl"
