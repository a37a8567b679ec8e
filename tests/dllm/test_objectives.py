"""wd1 and SPG objectives against hand-computed values, and their registration before config validation."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmrl.algos import advantage_estimators, policy_losses
from mmrl.plugins.dllm.objectives import spg_policy_loss, wd1_policy_loss, wd1_weights

ROOT = Path(__file__).resolve().parents[2]


def _softmax(values: list[float]) -> list[float]:
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


def test_wd1_weights_by_hand():
    # Group 0: rewards (1, 0, 0) → A = (2/3, −1/3, −1/3); group 1: rewards (0.5, 1.5) → A = (−0.5, 0.5);
    # group 2 has one sample, group 3 no spread.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 1.5, 7.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3])
    weights = wd1_weights(rewards, groups)
    a0 = [2 / 3, -1 / 3, -1 / 3]
    expected0 = [p - n for p, n in zip(_softmax(a0), _softmax([-a for a in a0]), strict=True)]
    expected1 = [p - n for p, n in zip(_softmax([-0.5, 0.5]), _softmax([0.5, -0.5]), strict=True)]
    assert weights[:3].tolist() == pytest.approx(expected0, abs=1e-6)
    assert weights[3:5].tolist() == pytest.approx(expected1, abs=1e-6)
    assert weights[5:].tolist() == [0.0, 0.0, 0.0]
    assert float(weights[:3].sum()) == pytest.approx(0.0, abs=1e-6)  # w⁺ and w⁻ both sum to 1 per group
    positive_only = wd1_weights(rewards, groups, negatives=False)
    assert positive_only[:3].tolist() == pytest.approx(_softmax(a0), abs=1e-6)
    sharp = wd1_weights(rewards, groups, temperature=0.5)
    expected_sharp = [p - n for p, n in zip(_softmax([2 * a for a in a0]), _softmax([-2 * a for a in a0]),
                                            strict=True)]
    assert sharp[:3].tolist() == pytest.approx(expected_sharp, abs=1e-6)
    assert advantage_estimators.get("wd1") is wd1_weights


def test_wd1_loss_is_the_weighted_likelihood_and_its_gradient_is_minus_the_weight():
    logp = torch.tensor([[-3.0], [-5.0], [-4.0]], requires_grad=True)
    weights = torch.tensor([0.4, -0.3, -0.1])
    loss, metrics = wd1_policy_loss(logp, logp.detach() + 0.1, weights, torch.ones(3, 1))
    assert loss.squeeze(1).tolist() == pytest.approx([1.2, -1.5, -0.4])
    loss.sum().backward()
    assert logp.grad.squeeze(1).tolist() == pytest.approx([-0.4, 0.3, 0.1])
    assert float(metrics["weight_positive_fraction"]) == pytest.approx(1 / 3)
    assert float(metrics["approx_kl"]) == pytest.approx(0.005, rel=1e-5)
    assert policy_losses.get("wd1") is wd1_policy_loss
    with pytest.raises(ValueError, match="advantage: wd1"):
        wd1_policy_loss(logp, logp.detach(), torch.tensor([1.7, -0.5, 0.0]), torch.ones(3, 1))


def test_spg_uses_the_lower_bound_for_positive_and_the_mix_for_other_advantages():
    logp = torch.tensor([[-2.0, -1.5], [-3.0, -2.0], [-4.0, -3.5]], requires_grad=True)  # (ELBO, EUBO)
    adv = torch.tensor([0.5, -0.5, 0.0])
    loss, metrics = spg_policy_loss(logp, logp.detach(), adv, torch.ones(3, 2), mix=0.5)
    # A > 0: −A·ELBO on column 0; A ≤ 0: −A·(1−ω)·ELBO and −A·ω·EUBO.
    expected = torch.tensor([[1.0, 0.0], [0.5 * 0.5 * -3.0, 0.5 * 0.5 * -2.0], [0.0, 0.0]])
    torch.testing.assert_close(loss.detach(), expected)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, 0.0], [0.25, 0.25], [0.0, 0.0]]))
    assert float(metrics["positive_fraction"]) == pytest.approx(1 / 3)
    assert float(metrics["bound_gap"]) == pytest.approx((0.5 + 1.0 + 0.5) / 3)
    eubo_only, _ = spg_policy_loss(logp.detach(), logp.detach(), adv, torch.ones(3, 2), mix=1.0)
    assert eubo_only[1].tolist() == pytest.approx([0.0, 0.5 * -2.0])
    elbo_only, _ = spg_policy_loss(logp.detach(), logp.detach(), adv, torch.ones(3, 2), mix=0.0)
    assert elbo_only[:, 1].tolist() == [0.0, 0.0, 0.0]
    assert policy_losses.get("spg") is spg_policy_loss


def test_spg_needs_two_columns():
    with pytest.raises(ValueError, match="plugin.objective: spg"):
        spg_policy_loss(torch.zeros(3, 1), torch.zeros(3, 1), torch.zeros(3), torch.ones(3, 1))
    with pytest.raises(ValueError, match="mix"):
        spg_policy_loss(torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(3), torch.ones(3, 2), mix=1.5)


def test_a_fresh_process_validates_wd1_and_spg_configs_through_the_plugin_import():
    # Config validation reads `plugin` before `algorithm`: importing the plugin class registers the losses.
    script = (
        "import sys\n"
        "from mmrl.config import load_config\n"
        "assert 'mmrl.plugins.dllm.objectives' not in sys.modules\n"
        "c = load_config('configs/dllm/toy.yaml', ['plugin.objective=wd1', 'algorithm.policy_loss=wd1',\n"
        "                                           'algorithm.advantage=wd1'])\n"
        "s = load_config('configs/dllm/toy.yaml', ['plugin.objective=spg', 'algorithm.policy_loss=spg',\n"
        "                'algorithm.policy_loss.mix=1.0', 'algorithm.advantage=dr_grpo'])\n"
        "print(c.algorithm.policy_loss.name, c.algorithm.advantage.name, s.algorithm.policy_loss.to_dict())\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "wd1 wd1 {'name': 'spg', 'mix': 1.0}"
