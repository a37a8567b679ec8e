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


def assert_old_logp_is_a_plain_forward(plugin, rollout, rows, group, processor_inputs, atol=1e-5):
    """Each sample's old log-probs (sample i of ``rollout`` asks ``rows[i // group]``) equal a plain transformers
    forward of ``processor_inputs(row)`` (the processor's output for the row's hand-written chat) with the completion
    appended: the prompt ids match the replay's, and the tempered log-softmax of the logits (the plugin's suppressed
    ids removed) gives each completion token its old log-prob, within ``atol``."""
    model = plugin.policy()
    replay = rollout.replay
    for i in range(len(rollout.group_ids)):
        inputs = processor_inputs(rows[i // group])
        prompt_ids = inputs["input_ids"][0]
        assert torch.equal(replay["input_ids"][i], prompt_ids)
        completion = replay["completion_ids"][i]
        inputs["input_ids"] = torch.cat([prompt_ids, completion]).unsqueeze(0)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        if "mm_token_type_ids" in inputs:  # InternVL's processor writes none
            types = inputs["mm_token_type_ids"][0]
            inputs["mm_token_type_ids"] = torch.cat([types, torch.zeros_like(completion)])[None]
        with torch.no_grad():
            logits = model(**inputs).logits[0, len(prompt_ids) - 1:-1].float()  # [C, V]
        logits[:, plugin.adapter.suppressed_token_ids()] = -torch.inf
        expected = (logits / plugin.config.temperature).log_softmax(-1).gather(-1, completion.unsqueeze(-1))[:, 0]
        torch.testing.assert_close(rollout.old_logp[i, :len(completion)], expected, rtol=0, atol=atol)
