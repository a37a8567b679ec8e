"""Fixtures of the flow plugin tests: tiny SD3 and FLUX pipelines saved once per session, and config builders.

The pipelines are built from config classes with random weights and local tokenizers
(:mod:`mmrl.plugins.flow.testing`), written with ``save_pretrained`` and loaded back by the plugin through
``from_pretrained``, the code path a hub id takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mmrl.reward import RewardInput, reward_functions


def brightness(batch: RewardInput) -> torch.Tensor:
    """Test reward: the mean pixel value of each image, ``[N]``."""
    return batch.output("images").float().mean(dim=(1, 2, 3)).cpu()


reward_functions.register("test_brightness", brightness)

PROMPTS = ["a cat", "a dog", "a red car", "a blue house"]
EVAL_PROMPTS = ["a green tree", "a small dog"]


@pytest.fixture(autouse=True)
def _one_thread():
    """The tiny models are far faster on one thread than on two contended ones (shared 2-core machines)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def pipelines(tmp_path_factory) -> dict[str, Path]:
    """``{"sd3": folder, "flux": folder}``: tiny pipelines saved with ``save_pretrained``."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    root = tmp_path_factory.mktemp("flow_pipelines")
    return {kind: save_tiny_pipeline(kind, root / f"tiny-{kind}") for kind in ("sd3", "flux")}


def plugin_options(pipeline: Path, **overrides: Any) -> dict[str, Any]:
    """The ``plugin:`` section of a tiny run on ``pipeline``: 16 px, 4 steps (3 trained), rank-4 LoRA."""
    options = {
        "name": "flow", "model": str(pipeline), "prompts": list(PROMPTS), "eval_prompts": list(EVAL_PROMPTS),
        "resolution": 16, "num_steps": 4, "eval_num_steps": 3, "max_sequence_length": 8,
        "lora": {"rank": 4, "alpha": 8},
    }
    options.update(overrides)
    return options


@pytest.fixture
def make_plugin(pipelines):
    """``make_plugin(kind, runtime=None, **plugin options)`` → a FlowPlugin on a tiny pipeline."""
    from mmrl.config import from_dict
    from mmrl.plugin import Runtime
    from mmrl.plugins.flow.plugin import FlowPlugin, FlowPluginConfig

    def build(kind: str, runtime: Runtime | None = None, **overrides: Any) -> FlowPlugin:
        options = plugin_options(pipelines[kind], **overrides)
        options.pop("name")
        return FlowPlugin(from_dict(FlowPluginConfig, options, "plugin"), runtime or Runtime())

    return build


@pytest.fixture
def train_config(pipelines):
    """``train_config(kind, output_dir, *overrides, **plugin options)`` → a validated TrainConfig of 2 steps."""
    from mmrl.config import load_config

    def build(kind: str, output_dir: Path, *overrides: str, **plugin: Any):
        base = {
            "plugin": plugin_options(pipelines[kind], **plugin),
            "run": {"output_dir": str(output_dir), "max_steps": 2, "seed": 0, "progress": False, "cpu": True},
            "rollout": {"prompts_per_step": 2, "group_size": 4},
            "algorithm": {"micro_batch_size": 3, "action_chunk_size": 1, "advantage": "batch_std",
                          "advantage_clip": 5.0},
            "optim": {"lr": 1e-2},
            "rewards": {"functions": [{"name": "test_brightness"}]},
            "eval": {"at_start": False},
        }
        return load_config(base, list(overrides))

    return build


def prompt_batch(prompts: list[str], group_size: int, *, first_seed: int = 100, training: bool = True,
                 first_group: int = 0):
    """A PromptBatch of each prompt repeated ``group_size`` times with consecutive seeds and group ids."""
    from mmrl.plugin import PromptBatch

    rows = [{"prompt": prompt} for prompt in prompts for _ in range(group_size)]
    groups = [first_group + g for g in range(len(prompts)) for _ in range(group_size)]
    return PromptBatch(
        rows=rows, group_ids=torch.tensor(groups, dtype=torch.long), group_size=group_size,
        seeds=torch.arange(first_seed, first_seed + len(rows), dtype=torch.long), generator=torch.Generator(),
        training=training,
    )
