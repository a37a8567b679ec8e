"""``Rollout.action_weights`` scale the policy term of each action only, not the KL (nor the entropy) term."""

from __future__ import annotations

import pytest
import torch

from mmrl.algos import aggregation_counts
from mmrl.trainer import Trainer
from tests.helpers import toy_config


def test_action_weights_scale_the_policy_term_and_leave_the_kl_coefficient_alone(tmp_path):
    """loss(w) = w·P + β·K for uniform weights w: TempFlow-GRPO multiplies its policy loss by the step weight and adds
    β·kl_loss unweighted (``loss = policy_loss + beta * kl_loss``), as verl-omni's GRPO-Guard loss divides only the
    policy term by Δt. Weighting the KL as well made β vary per step by the weights (0.29–1.93 under GRPO-Guard's
    reweighting); then loss(0) was 0 instead of β·K."""
    beta = 0.1
    trainer = Trainer(toy_config(tmp_path, f"algorithm.kl_coef={beta}", "algorithm.entropy_coef=0.0"))
    batch = trainer.collector.collect(trainer.policy, 0, {})
    rollout, advantages = batch.rollout, batch.advantages
    with torch.no_grad():  # move the policy away from the reference so that the KL is not 0
        generator = torch.Generator().manual_seed(0)
        for parameter in trainer.plugin.model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    num_actions, num_sequences = aggregation_counts(rollout.mask)
    lengths = rollout.mask.to(torch.float64).sum(dim=1)
    losses, kls = {}, {}
    for weight in (0.0, 1.0, 2.0):
        rollout.action_weights = torch.full_like(rollout.mask, weight)
        with torch.no_grad():
            loss, metrics, _, _ = trainer.learner._micro_loss(rollout, advantages, True, num_actions, num_sequences,
                                                              trainer.plugin.max_actions(), None, lengths)
        losses[weight], kls[weight] = float(loss), float(metrics["policy/kl"])
    assert kls[0.0] > 1e-4 and kls[0.0] == kls[2.0]
    # token_mean: loss = Σ_mask (w·policy + β·kl) / Σ_mask, and policy/kl is the masked mean of kl
    assert losses[0.0] == pytest.approx(beta * kls[0.0], rel=1e-5)
    # A difference of float32 losses: its error is that of the terms (sums over every action, ~1e-7 relative on each,
    # and kernel-dependent), not of the small difference, so the tolerance scales with the terms.
    scale = abs(losses[2.0]) + 2 * abs(losses[1.0])
    assert losses[2.0] - 2 * losses[1.0] == pytest.approx(-beta * kls[0.0], abs=1e-5 * scale)
