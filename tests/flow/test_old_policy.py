"""The old policy of the flow plugin's ratio through the trainer: ``algorithm.recompute_old_logp`` (which replaces the
sampler's old log-probs by a pass of the training forward) with and without GRPO-Guard's RatioNorm."""

from __future__ import annotations

import pytest
import torch

from mmrl.trainer import Trainer


def _parameters(trainer):
    return {name: p.detach().clone() for name, p in trainer.plugin.policy().named_parameters() if p.requires_grad}


@pytest.mark.parametrize("credit", [{}, {"ratio_norm": True}], ids=["plain", "ratio_norm"])
def test_recompute_old_logp_with_one_optimizer_step_per_rollout_trains_like_the_sampler_old_logp(
        train_config, tmp_path, credit):
    """μ = 1 and one mini-batch: the learner hands the forward old_logp=None (its training forward is the old
    policy), which the flow forward used to index (TypeError: 'NoneType' object is not subscriptable). It now trains
    exactly as a run that keeps the sampler's old log-probs, which are the same policy."""
    common = ("run.max_steps=1", "eval.save_samples=false")
    initial = _parameters(Trainer(train_config("sd3", tmp_path / "initial", *common, credit=credit)))
    plain = Trainer(train_config("sd3", tmp_path / "plain", *common, credit=credit))
    plain.train()
    recomputed = Trainer(train_config("sd3", tmp_path / "recomputed", *common, "algorithm.recompute_old_logp=true",
                                      credit=credit))
    assert recomputed.runtime.needs_old_logp is False
    history = recomputed.train().history
    assert history[0]["loss/first_step_ratio_deviation"] == 0.0  # the old policy is the training forward itself
    expected, got = _parameters(plain), _parameters(recomputed)
    assert any((expected[name] - initial[name]).abs().max() > 1e-4 for name in expected)  # it trained
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6)
