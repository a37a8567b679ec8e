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


def stat_tracker_reference(prompts: list[str], rewards: torch.Tensor, global_std: bool,
                           eps: float = 1e-4) -> torch.Tensor:
    """Flow-GRPO's PerPromptStatTracker.update (yifan123/flow_grpo ac4c86e, flow_grpo/stat_tracking.py:11-31) on a
    reward matrix [N, A], as TempFlow-GRPO calls it with one reward per branch step (scripts/train_sd3_pr.py at
    e66824e): the mean per prompt and column, the population std per column over all rows (global_std) or over the
    prompt's rows, plus eps (1e-4 there)."""
    rewards = rewards.double()
    advantages = torch.zeros_like(rewards)
    for prompt in sorted(set(prompts)):
        rows = torch.tensor([p == prompt for p in prompts])
        mean = rewards[rows].mean(dim=0, keepdim=True)
        pool = rewards if global_std else rewards[rows]
        std = pool.std(dim=0, unbiased=False, keepdim=True) + eps
        advantages[rows] = (rewards[rows] - mean) / std
    return advantages


def test_action_advantages_take_the_std_per_action_column():
    # Spread 1.0 at the early branch point and 0.05 at the late one (issue 20, item 2). Flow-GRPO's and
    # TempFlow-GRPO's stat trackers take the std per column: both columns get |A| ≈ 1. Pooling the two columns into
    # one batch std (what batch_std did here: 0.4263 over all 16 rewards) gave the late column 0.059 and the early
    # one 1.17.
    early = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    late = torch.tensor([0.0, 0.05, 0.0, 0.05, 0.05, 0.0, 0.05, 0.0])
    rewards = torch.stack([early, late], dim=1)  # [8, 2], every entry active
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    batch_std = advantage_estimators["batch_std"]
    got = action_advantages(rewards, torch.ones(8, 2), groups, batch_std, {"eps": 1e-4}, clip=None)
    # by hand: the group means are 0.5 (early) and 0.025 (late), the population stds of the columns 0.5 and 0.025
    sign = torch.tensor([-1.0, 1.0, -1.0, 1.0, 1.0, -1.0, 1.0, -1.0])
    expected = torch.stack([sign * 0.5 / (0.5 + 1e-4), sign * 0.025 / (0.025 + 1e-4)], dim=1)
    torch.testing.assert_close(got, expected)
    prompts = ["a"] * 4 + ["b"] * 4
    torch.testing.assert_close(got.double(), stat_tracker_reference(prompts, rewards, global_std=True))
    # per (group, column) std: grpo's Bessel-corrected std is sqrt(G/(G−1)) times the tracker's population std
    grpo = action_advantages(rewards, torch.ones(8, 2), groups, GRPO, {"eps": 0.0}, clip=None)
    reference = stat_tracker_reference(prompts, rewards, global_std=False, eps=0.0)
    torch.testing.assert_close(grpo.double(), reference * math.sqrt(3 / 4))


def test_action_advantages_batch_std_only_counts_a_columns_active_entries():
    # Column 1 is active on the last two samples only: its std is theirs, not the batch's.
    rewards = torch.tensor([[0.0, 9.0], [4.0, 9.0], [1.0, 2.0], [1.0, 4.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    groups = torch.tensor([0, 0, 1, 1])
    got = action_advantages(rewards, mask, groups, advantage_estimators["batch_std"], {"eps": 0.0}, clip=None)
    # column 0: rewards 0, 4, 1, 1 (mean 1.5, population std 1.5), group-centred −2, 2, 0, 0;
    # column 1: rewards 2, 4 (std 1), centred −1, 1
    r = 2 / 1.5
    torch.testing.assert_close(got, torch.tensor([[-r, 0.0], [r, 0.0], [0.0, -1.0], [0.0, 1.0]]))
