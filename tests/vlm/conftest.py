"""Fixtures of the VLM plugin tests: tiny Qwen2-VL and Qwen2.5-VL checkpoints built once per session (offline,
random weights, saved and loaded back through from_pretrained), plugin configs and prompt batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mmrl.config.schema import from_dict
from mmrl.plugin import PromptBatch, Runtime

FAMILIES = ("qwen2_vl", "qwen2_5_vl")

# Small enough for a loaded 2-core CPU: 56..160-pixel images resized to at most 16·28² pixels (≤ 16 image tokens).
PLUGIN_BASE: dict[str, Any] = {
    "attn_implementation": "eager",
    "min_pixels": 4 * 28 * 28,
    "max_pixels": 16 * 28 * 28,
    "max_new_tokens": 10,
    "lora": {"rank": 4, "alpha": 8.0},
    "data": {"synthetic": {"train_size": 12, "eval_size": 4, "tasks": ["grounding"], "seed": 2}},
    "prompt_template": "{question} Output the thinking process in <think> </think> and final answer in <answer> "
                       "</answer> tags.",
}


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: avoid oversubscription
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    from mmrl.plugins.vlm.testing import build_tiny_model

    root = tmp_path_factory.mktemp("tiny_vlms")
    return {family: build_tiny_model(family, root / family) for family in FAMILIES}


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


def plugin_options(model: Path | str, **overrides: Any) -> dict[str, Any]:
    options = {**PLUGIN_BASE, "model": str(model)}
    options.update(overrides)
    return options


def make_plugin(model: Path | str, runtime: Runtime | None = None, **overrides: Any):
    from mmrl.plugins.vlm.plugin import VLMPlugin, VLMPluginConfig

    config = from_dict(VLMPluginConfig, plugin_options(model, **overrides), "plugin")
    return VLMPlugin(config, runtime or Runtime())


@pytest.fixture(scope="session")
def lora_plugins(tiny_models):
    """One LoRA plugin per family, shared by tests that only sample and recompute (they never change weights)."""
    return {family: make_plugin(path) for family, path in tiny_models.items()}


def prompt_batch(rows: list[dict[str, Any]], group_size: int, *, seed: int = 0, training: bool = True
                 ) -> PromptBatch:
    """Each row repeated group_size times (group ids 0..len(rows)-1), one seed per sample."""
    repeated = [row for row in rows for _ in range(group_size)]
    n = len(repeated)
    return PromptBatch(
        rows=repeated,
        group_ids=torch.arange(len(rows)).repeat_interleave(group_size),
        group_size=group_size,
        seeds=torch.arange(n, dtype=torch.long) + 1000 * seed,
        generator=torch.Generator().manual_seed(seed),
        training=training,
    )
