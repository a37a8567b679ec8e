"""DeepSeek-V3.2's unbiased KL estimate (``algorithm.kl_importance_weighted``; arXiv:2512.02556, "Unbiased KL
Estimate"; TRL ``use_bias_correction_kl``): the KL term of each action is multiplied by the policy loss's importance
ratio, with its gradient."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmrl.algos import kl_estimators, log_ratio
from mmrl.config import ConfigError, load_config
from mmrl.trainer import Trainer
from tests.helpers import record_gradients, toy_config, trainable_gradients

BETA = 0.5


def _expected_gradients(tmp_path, loss_name: str, weighted: bool):
    """Run two steps (one micro-batch each, on the sampling weights: ratio 1 in value) and return the second's
    gradient and the gradient of −Σ A·r + β·w·k3 over the active actions / their count, written out here (w = the
    ratio at the loss's level when weighted, else 1). The first step trains on the reference's own weights, where
    k3 and its gradient are 0 and weighting changes nothing; the second starts off the reference."""
    overrides = ["run.max_steps=2", f"algorithm.kl_coef={BETA}", "optim.max_grad_norm=null",
                 f"algorithm.policy_loss.name={loss_name}", f"algorithm.kl_importance_weighted={str(weighted).lower()}"]
    if loss_name == "gspo":  # on-policy the clip is inactive whatever ε: the paper's small ε are fine
        overrides.append("algorithm.aggregation=token_mean")
    trainer = Trainer(toy_config(tmp_path, *overrides))
    policy, plugin = trainer.policy, trainer.plugin
    expected = {}
    collect = trainer.collector.collect
    level = "sequence" if loss_name == "gspo" else "token"  # vespo's weight: the token ratio, as TRL

    calls = []

    def recorded(*args, **kwargs):
        batch = collect(*args, **kwargs)
        calls.append(None)
        if len(calls) == 1:
            return batch
        rollout = batch.rollout.to(trainer.accelerator.device)
        output = plugin.forward(policy, rollout, need_reference=True)
        mask = rollout.mask
        ratio = log_ratio(output.logp, output.logp.detach(), mask, level=level).exp()  # [N, A], 1 in value
        kl = kl_estimators.get("k3")(output.logp, output.ref_logp.float())
        weight = ratio if weighted else torch.ones_like(ratio)
        per_action = -batch.advantages.unsqueeze(1) * ratio + BETA * weight * kl
        loss = (per_action * mask).sum() / mask.sum()
        expected.update(trainable_gradients(loss, plugin.model))
        return batch

    trainer.collector.collect = recorded
    steps = record_gradients(trainer, plugin.model)
    trainer.train()
    return steps[1], expected


@pytest.mark.parametrize("loss_name", ["grpo", "gspo", "vespo"])
def test_the_kl_term_carries_the_ratio_and_its_gradient(tmp_path, loss_name):
    for weighted in (True, False):
        got, expected = _expected_gradients(tmp_path / str(weighted), loss_name, weighted)
        assert expected
        for name, grad in expected.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6)


def test_weighting_changes_the_gradient_once_the_policy_left_the_reference(tmp_path):
    # Two steps: after the first the policy differs from the reference, so k3 > 0 and its ratio term k3·∇log π adds
    # a gradient the unweighted KL lacks.
    def second_step(weighted):
        trainer = Trainer(toy_config(tmp_path / str(weighted), "run.max_steps=2", f"algorithm.kl_coef={BETA}",
                                     "optim.max_grad_norm=null",
                                     f"algorithm.kl_importance_weighted={str(weighted).lower()}"))
        steps = record_gradients(trainer, trainer.plugin.model)
        trainer.train()
        return steps[1]

    plain, weighted = second_step(False), second_step(True)
    gap = max(float((weighted[n] - plain[n]).abs().max()) for n in plain)
    scale = max(float(plain[n].abs().max()) for n in plain)
    assert gap > 1e-3 * scale


def test_refusals():
    with pytest.raises(ConfigError, match=r"kl_importance_weighted.*kl_coef"):
        toy_config("/tmp/unused", "algorithm.kl_importance_weighted=true")
    with pytest.raises(ConfigError, match=r"kl_importance_weighted.*k2_seq"):
        toy_config("/tmp/unused", "algorithm.kl_importance_weighted=true", "algorithm.kl_coef=0.1",
                   "algorithm.kl_estimator=k2_seq")
    shapes = str(Path(__file__).resolve().parents[2] / "configs/flow/shapes.yaml")
    with pytest.raises(ConfigError, match=r"kl_importance_weighted.*plugin flow"):
        load_config(shapes, ["algorithm.kl_importance_weighted=true", "algorithm.kl_coef=0.1"])


def test_a_plugins_own_kl_is_refused_at_the_first_step(tmp_path):
    from dataclasses import replace

    from mmrl.rollout import RolloutError

    trainer = Trainer(toy_config(tmp_path, "run.max_steps=1", f"algorithm.kl_coef={BETA}",
                                 "algorithm.kl_importance_weighted=true"))
    forward = trainer.plugin.forward

    def own_kl(*args, **kwargs):
        output = forward(*args, **kwargs)
        return replace(output, kl=torch.zeros_like(output.logp))

    trainer.plugin.forward = own_kl
    with pytest.raises(RolloutError, match=r"kl_importance_weighted.*PolicyOutput.kl"):
        trainer.train()
