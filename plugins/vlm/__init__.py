"""GRPO for vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4.1V/4.5V, InternVL): see
:mod:`.plugin` and docs/vlm.md.

Import-light: importing this package loads neither transformers nor peft; the names below are imported on first
access.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "VLMPlugin": "mmrl.plugins.vlm.plugin",
    "VLMPluginConfig": "mmrl.plugins.vlm.plugin",
    "selective_log_softmax": "mmrl.plugins.vlm.logprobs",
    "vlm_adapters": "mmrl.plugins.vlm.adapters",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
