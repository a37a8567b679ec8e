"""Which steps a flow rollout trains (:mod:`mmrl.plugins.flow.schedule`) and how the config validates them."""

from __future__ import annotations

import pytest
import torch

from mmrl.config import ConfigError, from_dict
from mmrl.plugins.flow.plugin import FlowPluginConfig
from mmrl.plugins.flow.schedule import plan_steps, trained_step_count


def _plan(selection, num_steps=10, n=6, group_size=3, **kwargs):
    options = {"timestep_fraction": 0.99, "window_size": 3, **kwargs}
    return plan_steps(selection, num_steps, seeds=torch.arange(1000, 1000 + n),
                      group_ids=torch.arange(n) // group_size, run_seed=7, **options)


def test_fraction_trains_the_first_steps_and_drops_the_last():
    plan = _plan("fraction")  # Flow-GRPO: 10 steps × 0.99 → 9 trained, the last (near-deterministic) dropped
    assert plan.num_actions == 9
    assert torch.equal(plan.step_index, torch.arange(9).expand(6, 9))
    assert plan.stochastic.all()  # every step is an SDE step, trained or not


def test_random_trains_a_per_sample_subset_without_the_last_step():
    plan = _plan("random", timestep_fraction=0.6)  # DanceGRPO: int(0.6 · 9) = 5 of the steps 0..8
    assert plan.num_actions == 5
    assert plan.stochastic.all()
    for row in plan.step_index:
        assert len(set(row.tolist())) == 5 and row.max() <= 8 and torch.equal(row, row.sort().values)
    assert len({tuple(row.tolist()) for row in plan.step_index}) > 1  # samples draw their own subsets


def test_random_subset_depends_only_on_the_sample_seed():
    seeds = torch.tensor([5, 6, 7, 8])
    whole = plan_steps("random", 10, seeds=seeds, group_ids=torch.zeros(4), run_seed=0, timestep_fraction=0.6,
                       window_size=3)
    half = plan_steps("random", 10, seeds=seeds[2:], group_ids=torch.zeros(2), run_seed=0, timestep_fraction=0.6,
                      window_size=3)
    assert torch.equal(whole.step_index[2:], half.step_index)


def test_window_is_sde_inside_and_ode_outside_and_shared_by_a_group():
    plan = _plan("window", num_steps=10, n=12, group_size=3, window_range=(0, 6))
    assert plan.num_actions == 3
    starts = plan.step_index[:, 0]
    assert ((starts >= 0) & (starts <= 3)).all()
    for n in range(12):
        expected = torch.zeros(10, dtype=torch.bool)
        expected[starts[n]:starts[n] + 3] = True
        assert torch.equal(plan.stochastic[n], expected)
        assert torch.equal(plan.step_index[n], starts[n] + torch.arange(3))
    groups = starts.reshape(4, 3)
    assert (groups == groups[:, :1]).all()  # one window per group
    assert len(set(groups[:, 0].tolist())) > 1  # groups draw their own windows


def test_default_window_is_the_high_noise_half():
    plan = _plan("window", num_steps=10, n=40, group_size=1)
    assert plan.step_index.max() <= 4  # within [0, 5)


def test_trained_step_counts_match_the_papers():
    assert trained_step_count("fraction", 10, timestep_fraction=0.99, window_size=3) == 9  # Flow-GRPO SD3.5
    assert trained_step_count("random", 16, timestep_fraction=0.6, window_size=3) == 9  # DanceGRPO FLUX
    assert trained_step_count("window", 10, timestep_fraction=0.99, window_size=2) == 2


def _config(**options):
    return from_dict(FlowPluginConfig, {"model": "unused", "prompts": ["a"], **options}, "plugin")


@pytest.mark.parametrize(("options", "key"), [
    ({"num_steps": 1, "timestep_fraction": 0.5}, "plugin.timestep_fraction"),
    ({"train_steps": "window", "num_steps": 4, "window_size": 5}, "plugin.window_size"),
    ({"train_steps": "window", "num_steps": 6, "window_size": 3, "window_range": [2, 4]}, "plugin.window_range"),
    ({"sde": "cps", "noise_level": 1.5}, "plugin.noise_level"),
    ({"dataset": "prompts.txt"}, "plugin.dataset"),
    ({"adapter": "sdxl"}, "plugin.adapter"),
])
def test_impossible_step_settings_are_config_errors(options, key):
    with pytest.raises(ConfigError) as error:
        _config(**options)
    assert error.value.key == key
    assert "\n" not in str(error.value)


def test_full_fine_tuning_is_lora_null():
    assert _config(lora=None).lora is None
    assert _config(lora={"rank": 8}).lora.rank == 8
