"""Samples cut short by the generation budget (``Rollout.truncated``) and DAPO's overlong filtering
(``algorithm.mask_truncated``; TRL ``mask_truncated_completions``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmrl.config import ConfigError, load_config
from mmrl.plugins.toy.plugin import ToyPlugin
from mmrl.reward import reward_functions
from mmrl.rollout import Rollout, RolloutError
from mmrl.trainer import Trainer
from mmrl.trainer.updates import NoUpdateError
from tests.helpers import toy_config


def _rollout(n=4, truncated=None):
    return Rollout(group_ids=torch.arange(n) // 2, old_logp=None, mask=torch.ones(n, 3), truncated=truncated)


def test_the_rollout_carries_truncated_per_sample():
    rollout = _rollout(truncated=torch.tensor([True, False, False, True])).validate()
    assert rollout.select([3, 1]).truncated.tolist() == [True, False]
    joined = Rollout.concat([rollout, _rollout(2, torch.tensor([False, True]))])
    assert joined.truncated.tolist() == [True, False, False, True, False, True]
    with pytest.raises(RolloutError, match="truncated must be a bool"):
        _rollout(truncated=torch.tensor([1, 0, 0, 1])).validate()
    with pytest.raises(RolloutError, match="truncated must be a bool"):
        _rollout(truncated=torch.tensor([True, False])).validate()


def _first_batch(tmp_path, *overrides):
    trainer = Trainer(toy_config(tmp_path, "run.max_steps=1", *overrides))
    batches = []
    collect = trainer.collector.collect

    def recorded(*args, **kwargs):
        batches.append(collect(*args, **kwargs))
        return batches[-1]

    trainer.collector.collect = recorded
    history = trainer.train().history
    return batches[0], history[0]


def test_mask_truncated_leaves_the_cut_samples_out_of_the_loss_after_the_advantages(tmp_path):
    # The untrained toy policy says EOS within its 5 tokens for about half of the samples (6/7 per token not).
    plain, plain_metrics = _first_batch(tmp_path / "plain")
    masked, masked_metrics = _first_batch(tmp_path / "masked", "algorithm.mask_truncated=true")
    truncated = plain.rollout.truncated
    assert 0 < int(truncated.sum()) < len(truncated)
    assert torch.equal(masked.rollout.truncated, truncated)  # the same samples: only the loss mask differs
    torch.testing.assert_close(masked.advantages, plain.advantages)  # their rewards still count in their groups
    assert torch.equal(masked.rollout.mask, plain.rollout.mask * (~truncated).float().unsqueeze(1))
    assert (masked.rollout.mask[truncated] == 0).all() and (plain.rollout.mask[truncated].sum(1) > 0).all()
    share = float(truncated.float().mean())
    assert plain_metrics["samples/truncated"] == pytest.approx(share)
    assert masked_metrics["samples/truncated"] == pytest.approx(share)
    assert plain_metrics["samples/trained"] == len(truncated)
    assert masked_metrics["samples/trained"] == len(truncated) - int(truncated.sum())


ORIGINAL_ROLLOUT = ToyPlugin.rollout


def _untold(self, policy, batch):  # a plugin that does not say which samples were cut short
    return dataclasses.replace(ORIGINAL_ROLLOUT(self, policy, batch), truncated=None)


def _all_cut(self, policy, batch):
    rollout = ORIGINAL_ROLLOUT(self, policy, batch)
    return dataclasses.replace(rollout, truncated=torch.ones(len(rollout), dtype=torch.bool))


def test_mask_truncated_needs_a_plugin_that_says_which_samples_were_cut(tmp_path, monkeypatch):
    monkeypatch.setattr(ToyPlugin, "rollout", _untold)
    with pytest.raises(RolloutError, match=r"algorithm\.mask_truncated needs rollout\.truncated.*'toy'"):
        Trainer(toy_config(tmp_path, "run.max_steps=1", "algorithm.mask_truncated=true")).train()
    history = Trainer(toy_config(tmp_path / "off", "run.max_steps=1")).train().history  # off: nothing asked
    assert "samples/truncated" not in history[0]


def test_a_run_whose_samples_are_all_cut_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(ToyPlugin, "rollout", _all_cut)
    with pytest.raises(NoUpdateError, match="ran out of the generation budget"):
        Trainer(toy_config(tmp_path, "run.max_steps=2", "algorithm.mask_truncated=true")).train()


def test_the_flow_plugin_refuses_mask_truncated_when_the_config_is_loaded():
    from pathlib import Path

    shapes = str(Path(__file__).resolve().parents[1] / "configs" / "flow" / "shapes.yaml")
    with pytest.raises(ConfigError, match=r"algorithm\.mask_truncated.*plugin flow"):
        load_config(shapes, ["algorithm.mask_truncated=true"])


@reward_functions.register("test_spread_in_even_groups")
def _spread_in_even_groups(batch):
    """Groups with an even id get rewards with spread, the others a constant (dropped by dynamic sampling)."""
    return [float(int(g) % 2 == 0 and i % 2 == 1) for i, g in enumerate(batch.group_ids.tolist())]


def test_padded_samples_are_not_counted_as_truncated(tmp_path):
    # Dynamic sampling that runs out of rounds pads with dropped samples (mask 0): the truncated counts and
    # samples/trained cover the kept samples only, so a padded sample is never subtracted twice.
    trainer = Trainer(toy_config(tmp_path, "rewards.functions=[{name: test_spread_in_even_groups}]", "run.max_steps=1",
                                 "rollout.dynamic_sampling.enabled=true", "rollout.dynamic_sampling.max_rounds=1",
                                 "algorithm.mask_truncated=true"))
    batch = trainer.collector.collect(trainer.policy, trainer.step, {})
    rollout, metrics = batch.rollout, batch.metrics
    padded = int(metrics["samples/padded"])
    assert 0 < padded < len(rollout)
    entered = rollout.mask.sum(dim=1) > 0  # kept and finished
    kept = len(rollout) - padded
    assert 0 < metrics["samples/truncated_masked"] == kept - int(entered.sum())
    assert metrics["samples/truncated"] == pytest.approx(metrics["samples/truncated_masked"] / kept)
