"""Every credit strategy end to end through ``mmrl.trainer.Trainer`` on the tiny SD3 pipeline (CPU, 2 steps)."""

from __future__ import annotations

import pytest
import torch

from mmrl.config import ConfigError
from mmrl.rollout import RolloutError
from mmrl.trainer import Trainer

WHOLE_GROUPS = ("rollout.layout=contiguous", "rollout.batch_size=4")
RUNS = {
    "step": ({"strategy": "step", "noise_weighting": True}, ()),
    "chunk": ({"strategy": "chunk", "chunk": {"sizes": [1, 2], "sample": "weighted"}},
              ("algorithm.policy_loss.ratio_level=chunk", "algorithm.action_chunk_size=null")),
    "branch": ({"strategy": "branch", "branch": {"points": [0, 2]}, "noise_weighting": True}, WHOLE_GROUPS),
    "sliding_window": ({"strategy": "sliding_window",  # 4 steps: windows at steps 0-1 and 1-2, never the last
                        "sliding_window": {"size": 2, "shift_every": 1, "solver": "dpm2m", "window_range": [0, 3]}},
                       ()),
    "tree": ({"strategy": "tree", "tree": {"split_points": [0, 2]}}, (*WHOLE_GROUPS, "algorithm.advantage=grpo")),
    "guard": ({"strategy": "step", "ratio_norm": True, "ratio_norm_reweight": True}, ()),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_each_strategy_trains_the_adapter_with_ratio_one(train_config, name, tmp_path):
    credit, overrides = RUNS[name]
    config = train_config("sd3", tmp_path, "eval.save_samples=false", "run.save_every=0", *overrides, credit=credit)
    trainer = Trainer(config)
    lora = {n: p.detach().clone() for n, p in trainer.plugin.policy().named_parameters() if "lora_" in n}
    history = trainer.train().history
    assert [record["step"] for record in history] == [1, 2]
    for record in history:
        assert record["loss/first_step_ratio_deviation"] < 1e-5
        assert record["reward/std"] > 0
        assert record["rollout/model_evals_per_sample"] > 0
    moved = [n for n, p in trainer.plugin.policy().named_parameters() if "lora_" in n and not torch.equal(p, lora[n])]
    assert moved, "the adapter did not move"
    if name == "sliding_window":  # the window moved on between the two steps
        assert [record["rollout/window_start"] for record in history] == [0.0, 1.0]


def test_misconfigurations_fail_with_one_line(train_config, tmp_path):
    chunk, _ = RUNS["chunk"]
    # The base config keeps token ratios (it back-propagates per step): chunk ids would be silently ignored.
    with pytest.raises(ConfigError, match="ratio_level"):
        Trainer(train_config("sd3", tmp_path / "a", credit=chunk)).train()
    tree, _ = RUNS["tree"]
    with pytest.raises(RolloutError, match="whole groups"):
        Trainer(train_config("sd3", tmp_path / "b", "rollout.batch_size=3", credit=tree)).train()

