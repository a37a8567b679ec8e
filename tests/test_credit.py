"""The credit step on gathered tensors: invalid samples, clipping, per-action credit."""

import math

import torch

from mmrl.algos import advantage_estimators
from mmrl.trainer.credit import action_advantages, sample_advantages

GRPO = advantage_estimators["grpo"]


def test_invalid_samples_get_zero_and_stay_out_of_group_statistics():
    scores = torch.tensor([[1.0], [2.0], [3.0], [100.0]])
    valid = torch.tensor([True, True, True, False])
    groups = torch.tensor([0, 0, 0, 0])
    credit = sample_advantages(scores, valid, groups, torch.tensor([1.0]), GRPO, {"eps": 0.0},
                               order="sum_then_normalize", clip=None)
    torch.testing.assert_close(credit.advantages, torch.tensor([-1.0, 0.0, 1.0, 0.0]))


def test_advantage_clip():
    scores = torch.tensor([[0.0], [0.0], [0.0], [10.0]])
    credit = sample_advantages(scores, torch.ones(4, dtype=torch.bool), torch.zeros(4, dtype=torch.long),
                               torch.tensor([1.0]), advantage_estimators["dr_grpo"], {}, order="sum_then_normalize",
                               clip=5.0)
    torch.testing.assert_close(credit.advantages, torch.tensor([-2.5, -2.5, -2.5, 5.0]))


def test_action_advantages_normalise_per_group_and_action_position():
    # Two groups of two samples, three action positions; only the active positions enter the statistics.
    rewards = torch.tensor([[1.0, 0.0, 5.0], [3.0, 0.0, 9.0], [2.0, 4.0, 0.0], [2.0, 6.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    groups = torch.tensor([7, 7, 8, 8])
    got = action_advantages(rewards, mask, groups, GRPO, {"eps": 0.0}, clip=None)
    a = 1.0 / math.sqrt(2.0)  # (r - mean) / unbiased std for a pair differing by 2 (or 4)
    expected = torch.tensor([[-a, 0.0, -a], [a, 0.0, a], [0.0, -a, 0.0], [0.0, a, 0.0]])
    torch.testing.assert_close(got, expected)
