"""Advantage estimators against hand-computed values (DeepSeekMath eq. 3; Dr.GRPO; RLOO; Flow-GRPO global std)."""

import math
import statistics

import pytest
import torch

from mmrl.algos import advantage_estimators, multi_reward_advantages

# Three groups of unequal size: A = [1, 2, 3], B = [4, 4, 4] (no spread), C = [0, 1].
REWARDS = torch.tensor([1.0, 2.0, 3.0, 4.0, 4.0, 4.0, 0.0, 1.0])
GROUPS = torch.tensor([7, 7, 7, 3, 3, 3, 11, 11])  # arbitrary, non-contiguous ids


def test_grpo_hand_values():
    # A: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1. B: std 0 -> 0. C: mean 0.5, unbiased std sqrt(0.5).
    expected = [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0, -0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5)]
    got = advantage_estimators["grpo"](REWARDS, GROUPS, eps=0.0)
    torch.testing.assert_close(got, torch.tensor(expected), rtol=0, atol=1e-6)


def test_grpo_eps_enters_the_denominator():
    got = advantage_estimators["grpo"](REWARDS, GROUPS, eps=1.0)
    assert got[2].item() == pytest.approx(1.0 / (1.0 + 1.0))


def test_dr_grpo_hand_values():
    expected = [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0, -0.5, 0.5]
    torch.testing.assert_close(advantage_estimators["dr_grpo"](REWARDS, GROUPS), torch.tensor(expected))


def test_rloo_hand_values():
    # A: 1 - (2+3)/2 = -1.5, 2 - (1+3)/2 = 0, 3 - (1+2)/2 = 1.5. C: 0 - 1 = -1, 1 - 0 = 1.
    expected = [-1.5, 0.0, 1.5, 0.0, 0.0, 0.0, -1.0, 1.0]
    torch.testing.assert_close(advantage_estimators["rloo"](REWARDS, GROUPS), torch.tensor(expected))


def test_batch_std_hand_values():
    # Population std of all 8 rewards: mean 19/8, sum of squared deviations 17.875 -> std sqrt(17.875 / 8).
    std = math.sqrt(17.875 / 8)
    group_means = [2, 2, 2, 4, 4, 4, 0.5, 0.5]
    expected = [(r - m) / std for r, m in zip(REWARDS.tolist(), group_means, strict=True)]
    got = advantage_estimators["batch_std"](REWARDS, GROUPS, eps=0.0)
    torch.testing.assert_close(got, torch.tensor(expected), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "batch_std"])
def test_estimators_match_a_python_loop_on_random_groups(name):
    generator = torch.Generator().manual_seed(0)
    group_ids = torch.randint(0, 9, (200,), generator=generator)
    rewards = torch.randn(200, generator=generator, dtype=torch.float64)
    got = advantage_estimators[name](rewards, group_ids)
    everything = rewards.tolist()
    for i, (reward, gid) in enumerate(zip(rewards.tolist(), group_ids.tolist(), strict=True)):
        members = [r for r, g in zip(everything, group_ids.tolist(), strict=True) if g == gid]
        mean = statistics.fmean(members)
        if name == "grpo":
            std = statistics.stdev(members) if len(members) > 1 else 0.0
            expected = (reward - mean) / (std + 1e-6)
        elif name == "dr_grpo":
            expected = reward - mean
        elif name == "rloo":
            expected = reward - (sum(members) - reward) / (len(members) - 1) if len(members) > 1 else 0.0
        else:
            expected = (reward - mean) / (statistics.pstdev(everything) + 1e-4)
        assert got[i].item() == pytest.approx(expected, abs=1e-9), (name, i)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "batch_std"])
def test_permuting_samples_permutes_advantages(name):
    permutation = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4])
    base = advantage_estimators[name](REWARDS, GROUPS)
    permuted = advantage_estimators[name](REWARDS[permutation], GROUPS[permutation])
    torch.testing.assert_close(permuted, base[permutation])


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_singleton_group_gets_zero_advantage(name):
    got = advantage_estimators[name](torch.tensor([3.0, 1.0, 2.0]), torch.tensor([0, 1, 1]))
    assert got[0].item() == 0.0


def test_identical_rewards_give_exactly_zero():
    rewards = torch.full((6,), 0.1, dtype=torch.float32)  # 0.1 is inexact in binary: the float64 path must cope
    got = advantage_estimators["grpo"](rewards, torch.tensor([0, 0, 0, 1, 1, 1]))
    assert torch.equal(got, torch.zeros(6))


def test_non_finite_rewards_are_refused():
    with pytest.raises(ValueError, match="finite"):
        advantage_estimators["grpo"](torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))


def test_multi_reward_orders_hand_values():
    # One group of two samples, rewards r1 = [1, 0], r2 = [0, 1], weights [2, 1].
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    weights = torch.tensor([2.0, 1.0])
    groups = torch.tensor([0, 0])
    grpo = advantage_estimators["grpo"]
    # Weight then normalise: combined [2, 1], mean 1.5, unbiased std sqrt(0.5).
    summed, combined = multi_reward_advantages(rewards, weights, groups, grpo, order="sum_then_normalize", eps=0.0)
    torch.testing.assert_close(combined, torch.tensor([2.0, 1.0]))
    torch.testing.assert_close(summed, torch.tensor([0.5, -0.5]) / math.sqrt(0.5))
    # Normalise each then weight (GDPO): A1 = [+a, -a], A2 = [-a, +a] with a = 0.5/sqrt(0.5); 2*A1 + A2 = [a, -a],
    # whitened over the batch (Bessel std a*sqrt(2), as GDPO's code) -> [1, -1] / sqrt(2).
    gdpo, _ = multi_reward_advantages(rewards, weights, groups, grpo, order="normalize_then_sum", eps=0.0,
                                      whiten_eps=0.0)
    torch.testing.assert_close(gdpo, torch.tensor([1.0, -1.0]) / math.sqrt(2.0))


def test_gdpo_keeps_combinations_apart_that_sum_then_normalize_merges():
    # GDPO's motivating case: (1, 0) and (0, 1) reward combinations with equal weights collapse when summed.
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    groups = torch.tensor([0, 0, 1, 1])
    weights = torch.tensor([1.0, 1.0])
    grpo = advantage_estimators["grpo"]
    summed, _ = multi_reward_advantages(rewards, weights, groups, grpo, order="sum_then_normalize")
    assert summed[0] == summed[1] == 0
    with pytest.raises(ValueError, match="order"):
        multi_reward_advantages(rewards, weights, groups, grpo, order="average")
