"""Per-action credit (``Plugin.action_rewards``) with several reward functions honours ``rewards.multi_reward``."""

from __future__ import annotations

import torch

from mmrl.trainer import Trainer
from tests.helpers import toy_config


def _pair_values(rewards, width):
    """A linear per-action credit, like BranchGRPO's tree nodes: column 0 is the sample's own reward, the other
    columns the mean reward of its pair of consecutive samples (a node above two leaves). ``[n]`` → ``[n, width]``."""
    pairs = rewards.reshape(-1, 2).mean(dim=1).repeat_interleave(2)  # [n]
    per_action = pairs.unsqueeze(1).expand(len(rewards), width).clone()
    per_action[:, 0] = rewards
    return per_action


def _pair_credit(rollout, rewards):
    rollout.metrics["credited"] = float(rewards.sum())  # what the hook sets on the rollout (e.g. the tree's pruning)
    return _pair_values(rewards, rollout.num_actions)


def _credit(tmp_path, order, scores):
    trainer = Trainer(toy_config(
        tmp_path / order, "rewards.functions=[{name: exact_match}, {name: token_accuracy, weight: 0.5}]",
        f"rewards.multi_reward={order}", "algorithm.advantage=dr_grpo", "algorithm.advantage_clip=null"))
    trainer.plugin.action_rewards = _pair_credit
    rollout = trainer.collector.collect(trainer.policy, 0, {}).rollout.select(torch.arange(8))
    rollout.group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])  # two whole groups of 4
    rollout.mask = torch.ones_like(rollout.mask)
    advantages, _, _ = trainer.collector.credit(rollout, scores, torch.ones(8, dtype=torch.bool))
    # the rollout keeps what the hook set from the combined reward, not from a single reward's column
    assert rollout.metrics["credited"] == float((scores @ trainer.collector.scorer.weights).sum())
    return advantages, rollout.num_actions


def test_per_action_credit_normalises_each_reward_first_with_normalize_then_sum(tmp_path):
    """GDPO (normalize_then_sum): each reward's per-action credit is normalised per (group, column), the results are
    weighted and summed, then whitened over the batch. Per-action credit used to sum the rewards first whatever
    rewards.multi_reward said (mmrl/trainer/collect.py)."""
    exact = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    accuracy = torch.tensor([0.9, 0.2, 0.5, 0.1, 0.8, 0.7, 0.3, 0.6])
    scores = torch.stack([exact, accuracy], dim=1)  # [8, K = 2]
    weights = [1.0, 0.5]
    got, width = _credit(tmp_path, "normalize_then_sum", scores)
    assert got.shape == (8, width) and width >= 2

    # By hand: dr_grpo per (group, column) is r − mean; then Σ_k w_k·A_k, whitened with the Bessel std + 1e-4.
    def centred(per_action):  # [8, A]
        groups = per_action.reshape(2, 4, -1).double()
        return (groups - groups.mean(dim=1, keepdim=True)).reshape(8, -1)

    summed = sum(w * centred(_pair_values(column, width)) for w, column in zip(weights, scores.T, strict=True))
    expected = (summed - summed.mean()) / (summed.std() + 1e-4)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)

    # sum_then_normalize keeps the old behaviour: the per-action credit of the weighted sum, centred per column.
    combined, _ = _credit(tmp_path, "sum_then_normalize", scores)
    plain = centred(_pair_values(scores @ torch.tensor(weights), width))
    torch.testing.assert_close(combined.double(), plain, rtol=1e-5, atol=1e-6)
    assert (got.double() - plain).abs().max() > 0.1  # the two orders differ here
