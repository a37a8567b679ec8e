"""The estimators taken from verl: grpo_passk, reinforce_pp_baseline, gpg.

Each is checked against an independent restatement of verl's function (volcengine/verl@b178a3c,
``verl/trainer/ppo/core_algos.py``), written here from its formulas and looping over groups as verl does, on verl's
inputs (token-level rewards with the outcome on the last response token, a response mask, group ids), against the
papers' authors' code where it differs from verl (GPG: AMAP-ML/GPG@e096da8), and against hand-computed values.
"""

import math
import statistics
from collections import defaultdict

import pytest
import torch

from mmrl.algos import advantage_estimators
from mmrl.config import ConfigError, load_config
from tests.helpers import BASE

NAMES = ["grpo_passk", "reinforce_pp_baseline", "gpg"]


# ------------------------------------------------------------------------------------ restatements of verl's functions
def verl_inputs(rewards: torch.Tensor, lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``token_level_rewards`` and ``response_mask`` [N, width]: the outcome on the last response token."""
    mask = torch.zeros(len(lengths), width, dtype=torch.float64)
    token_rewards = torch.zeros(len(lengths), width, dtype=torch.float64)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1.0
        token_rewards[i, length - 1] = rewards[i]
    return token_rewards, mask


def verl_passk(token_rewards, mask, index, epsilon=1e-6, norm=True):
    """compute_grpo_passk_outcome_advantage (L361-420): topk(2) per group, the gap at topk's first index."""
    scores = token_rewards.sum(-1)
    advantages = torch.zeros_like(scores)
    members = defaultdict(list)
    for i, gid in enumerate(index):
        members[gid].append(i)
    for rows in members.values():
        group = scores[rows]
        if group.numel() < 2:
            raise ValueError("Pass@k requires at least 2 samples per group")
        top, where = torch.topk(group, 2)
        gap = top[0] - top[1]
        if norm:
            gap = gap / (torch.std(group) + epsilon)
        advantages[rows[where[0].item()]] = gap
    return advantages.unsqueeze(-1) * mask


def verl_masked_whiten(values, mask):
    """verl_F.masked_whiten (torch_functional.py L287-340): masked mean, Bessel-corrected masked variance."""
    total = mask.sum()
    mean = (values * mask).sum() / (total + 1e-8)
    variance = (((values - mean) ** 2) * mask).sum() / (total + 1e-8)
    variance = variance * total / (total - 1)
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def verl_reinforce_pp_baseline(token_rewards, mask, index):
    """compute_reinforce_plus_plus_baseline_outcome_advantage (L425-474): group mean off, tile, whiten over tokens."""
    scores = token_rewards.sum(-1)
    groups = defaultdict(list)
    for i, gid in enumerate(index):
        groups[gid].append(scores[i])
    means = {gid: torch.stack(v).mean() if len(v) > 1 else torch.tensor(0.0, dtype=scores.dtype)
             for gid, v in groups.items()}
    centered = torch.stack([scores[i] - means[gid] for i, gid in enumerate(index)])
    tiled = centered.unsqueeze(-1).tile([1, mask.shape[1]]) * mask
    return verl_masked_whiten(tiled, mask) * mask


def verl_gpg(token_rewards, mask, index, f_norm=1.0):
    """compute_gpg_outcome_advantage (L658-718): α = bsz / count_nonzero(rewards), α·(r − mean)/f_norm."""
    scores = token_rewards.sum(-1)
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
    groups = defaultdict(list)
    for i, gid in enumerate(index):
        groups[gid].append(scores[i])
    means = {gid: torch.stack(v).mean() if len(v) > 1 else torch.tensor(0.0, dtype=scores.dtype)
             for gid, v in groups.items()}
    values = torch.stack([alpha * (scores[i] - means[gid]) / f_norm for i, gid in enumerate(index)])
    return values.unsqueeze(-1) * mask


def gpg_authors(rewards, group_size, scale_rewards=False):
    """AMAP-ML/GPG open-r1 gpg_trainer.py L541-551, L614-626, L315-316: groups of equal size; the loss divided by
    inverse_alpha = groups with std > 0 / groups, i.e. the advantages multiplied by its inverse. With TRL's
    ``scale_rewards`` (L622-623) the centred rewards are divided by the group's torch.std (Bessel) + 1e-4."""
    grouped = rewards.view(-1, group_size)
    valid_groups = int((grouped.std(dim=1) > 0).sum())
    inverse_alpha = min(1.0, valid_groups / grouped.shape[0])
    advantages = rewards - grouped.mean(dim=1).repeat_interleave(group_size)
    if scale_rewards:
        advantages = advantages / (grouped.std(dim=1).repeat_interleave(group_size) + 1e-4)
    return advantages / inverse_alpha


def random_batch(seed: int, groups: int, group_size: int, levels: int | None = None):
    """Shuffled group ids (verl's uid order is arbitrary too) and rewards; integer levels produce ties."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.arange(groups).repeat_interleave(group_size)[torch.randperm(groups * group_size, generator=generator)]
    if levels is None:
        rewards = torch.randn(groups * group_size, generator=generator, dtype=torch.float64)
    else:
        rewards = torch.randint(0, levels, (groups * group_size,), generator=generator).to(torch.float64)
    return rewards, ids * 5 + 3  # arbitrary, non-contiguous ids


# ------------------------------------------------------------------------------------------------------------ pass@k
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize(("seed", "levels"), [(0, None), (1, 2), (2, 3)])
def test_passk_matches_verl(seed, levels, norm):
    rewards, ids = random_batch(seed, groups=12, group_size=5, levels=levels)
    lengths = torch.randint(1, 7, (rewards.numel(),), generator=torch.Generator().manual_seed(seed)).tolist()
    token_rewards, mask = verl_inputs(rewards, lengths, width=6)
    expected = verl_passk(token_rewards, mask, ids.tolist(), norm=norm)  # [N, 6]
    got = advantage_estimators["grpo_passk"](rewards, ids, norm_by_std=norm)
    torch.testing.assert_close(got.unsqueeze(-1) * mask, expected, rtol=0, atol=1e-12)
    if levels is not None:  # ties at the top occur and are all zero
        assert (got == 0).sum() > rewards.numel() - 12


def test_passk_hand_values():
    # A = [1, 3, 2]: the best (3) gets 3 − 2 = 1, ÷ Bessel std 1. B = [0, 5]: 5 − 0 = 5, ÷ std 5/sqrt(2).
    rewards = torch.tensor([1.0, 3.0, 2.0, 0.0, 5.0])
    ids = torch.tensor([4, 4, 4, 9, 9])
    got = advantage_estimators["grpo_passk"](rewards, ids, eps=0.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 1.0, 0.0, 0.0, math.sqrt(2.0)]))
    plain = advantage_estimators["grpo_passk"](rewards, ids, norm_by_std=False)
    torch.testing.assert_close(plain, torch.tensor([0.0, 1.0, 0.0, 0.0, 5.0]))
    with_eps = advantage_estimators["grpo_passk"](rewards, ids, eps=1.0)
    assert with_eps[1].item() == pytest.approx(1.0 / (1.0 + 1.0))


def test_passk_shared_maximum_gives_the_whole_group_zero_in_any_order():
    """The tie rule: A_i = max r − max_{j≠i} r, so a maximum held by two samples credits neither of them."""
    rewards = torch.tensor([3.0, 1.0, 3.0, 2.0, 0.0, 2.0, 2.0, 1.0])
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])  # group 2 is a single sample
    base = advantage_estimators["grpo_passk"](rewards, ids, norm_by_std=False)
    assert torch.equal(base, torch.zeros(8))
    for seed in range(5):
        order = torch.randperm(8, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(advantage_estimators["grpo_passk"](rewards[order], ids[order], norm_by_std=False),
                           torch.zeros(8))
    # Break the tie in group 0 and the remaining 3 alone gets the gap 3 − 1 (the runner-up below it).
    rewards[0] = 1.0
    got = advantage_estimators["grpo_passk"](rewards, ids, norm_by_std=False)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, 2.0, 0, 0, 0, 0, 0]))


def test_passk_is_the_leave_one_out_gain_of_the_maximum():
    """Tang et al. 2025 (arXiv:2503.19595): A_i = max_j r_j − max_{j≠i} r_j, computed here sample by sample."""
    rewards, ids = random_batch(3, groups=20, group_size=4, levels=4)
    got = advantage_estimators["grpo_passk"](rewards, ids, norm_by_std=False)
    for i in range(rewards.numel()):
        members = [r for r, g in zip(rewards.tolist(), ids.tolist(), strict=True) if g == ids[i].item()]
        others = [r for j, (r, g) in enumerate(zip(rewards.tolist(), ids.tolist(), strict=True))
                  if g == ids[i].item() and j != i]
        assert got[i].item() == max(members) - max(others)


def test_passk_singleton_and_no_spread_groups_are_exactly_zero_even_with_eps_zero():
    rewards = torch.full((5,), 0.1, dtype=torch.float64)  # in float64, 0.1 + 0.1 + 0.1 != 3 × 0.1
    got = advantage_estimators["grpo_passk"](rewards, torch.tensor([0, 0, 0, 1, 2]), eps=0.0)
    assert torch.equal(got, torch.zeros(5, dtype=torch.float64))


# --------------------------------------------------------------------------------------------- REINFORCE++-baseline
@pytest.mark.parametrize("length", [1, 3, 50])
def test_reinforce_pp_baseline_equals_verl_for_equal_lengths_up_to_the_token_bessel_factor(length):
    """Equal lengths L, T = N·L tokens: verl's token variance is v·T/(T−1), hence the exact identity
    A_verl = sqrt((T−1)/T) · A_mmrl(eps = 1e-8·(T−1)/T)."""
    rewards, ids = random_batch(4, groups=6, group_size=4)
    tokens = rewards.numel() * length
    token_rewards, mask = verl_inputs(rewards, [length] * rewards.numel(), width=length)
    expected = verl_reinforce_pp_baseline(token_rewards, mask, ids.tolist())  # [N, L], constant along a row
    scaled = advantage_estimators["reinforce_pp_baseline"](rewards, ids, eps=1e-8 * (tokens - 1) / tokens)
    scaled = scaled * math.sqrt((tokens - 1) / tokens)
    torch.testing.assert_close(scaled.unsqueeze(-1).expand_as(expected), expected, rtol=1e-9, atol=1e-9)
    # With its default eps mmrl is within the factor 1 − 1/(2T) of verl.
    default = advantage_estimators["reinforce_pp_baseline"](rewards, ids)
    torch.testing.assert_close(default, expected[:, 0], rtol=1.0 / tokens, atol=1e-9)


def test_reinforce_pp_baseline_hand_values():
    # Groups [1, 2, 3] and [0, 1]: c = [-1, 0, 1, -0.5, 0.5], Σc² = 2.5, v = 2.5/5 = 0.5 -> A = c / sqrt(0.5).
    rewards = torch.tensor([1.0, 2.0, 3.0, 0.0, 1.0])
    ids = torch.tensor([2, 2, 2, 8, 8])
    got = advantage_estimators["reinforce_pp_baseline"](rewards, ids, eps=0.0)
    expected = [c / math.sqrt(0.5) for c in (-1.0, 0.0, 1.0, -0.5, 0.5)]
    torch.testing.assert_close(got, torch.tensor(expected), rtol=0, atol=1e-6)
    # Adding an all-equal group and a singleton: their c is 0 and they count in N (v = 2.5/9).
    rewards = torch.cat([rewards, torch.tensor([4.0, 4.0, 4.0, 7.0])])
    ids = torch.cat([ids, torch.tensor([5, 5, 5, 1])])
    got = advantage_estimators["reinforce_pp_baseline"](rewards, ids, eps=0.0)
    expected = [c / math.sqrt(2.5 / 9) for c in (-1.0, 0.0, 1.0, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0)]
    torch.testing.assert_close(got, torch.tensor(expected), rtol=0, atol=1e-6)


def test_reinforce_pp_baseline_has_zero_mean_and_unit_population_std():
    rewards, ids = random_batch(5, groups=16, group_size=8)
    got = advantage_estimators["reinforce_pp_baseline"](rewards, ids, eps=0.0)
    assert abs(statistics.fmean(got.tolist())) < 1e-12
    assert statistics.pstdev(got.tolist()) == pytest.approx(1.0, abs=1e-12)


def test_reinforce_pp_baseline_without_spread_is_exactly_zero_even_with_eps_zero():
    rewards = torch.full((7,), 0.1, dtype=torch.float64)  # the rounded group mean is not 0.1
    got = advantage_estimators["reinforce_pp_baseline"](rewards, torch.tensor([0, 0, 0, 1, 1, 1, 2]), eps=0.0)
    assert torch.equal(got, torch.zeros(7, dtype=torch.float64))
    # With spread elsewhere in the batch the no-spread groups must still be exactly 0, not rounding / std.
    rewards = torch.cat([rewards, torch.tensor([0.0, 1.0], dtype=torch.float64)])
    got = advantage_estimators["reinforce_pp_baseline"](rewards, torch.tensor([0, 0, 0, 1, 1, 1, 2, 3, 3]))
    assert torch.equal(got[:7], torch.zeros(7, dtype=torch.float64)) and got[8] > 0


# -------------------------------------------------------------------------------------------------------------- GPG
@pytest.mark.parametrize("f_norm", [1.0, 0.5])
@pytest.mark.parametrize(("seed", "levels"), [(0, None), (1, 2), (2, 3)])
def test_gpg_nonzero_rewards_matches_verl(seed, levels, f_norm):
    rewards, ids = random_batch(seed, groups=10, group_size=4, levels=levels)
    lengths = torch.randint(1, 5, (rewards.numel(),), generator=torch.Generator().manual_seed(seed)).tolist()
    token_rewards, mask = verl_inputs(rewards, lengths, width=4)
    expected = verl_gpg(token_rewards, mask, ids.tolist(), f_norm=f_norm)
    got = advantage_estimators["gpg"](rewards, ids, f_norm=f_norm, alpha_count="nonzero_rewards")
    torch.testing.assert_close(got.unsqueeze(-1) * mask, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("seed", "levels"), [(0, 2), (1, 3), (2, None)])
def test_gpg_default_matches_the_authors_code(seed, levels):
    rewards, ids = random_batch(seed, groups=10, group_size=4, levels=levels)
    order = torch.argsort(ids, stable=True)  # the authors' code holds each group's samples contiguously
    rewards, ids = rewards[order], ids[order]
    expected = gpg_authors(rewards, group_size=4)
    torch.testing.assert_close(advantage_estimators["gpg"](rewards, ids), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("seed", "levels"), [(0, 2), (1, 3), (2, None)])
def test_gpg_scale_rewards_matches_the_authors_code(seed, levels):
    """F_norm = the group std (+ 1e-4), the authors' scale_rewards; α unchanged."""
    rewards, ids = random_batch(seed, groups=10, group_size=4, levels=levels)
    order = torch.argsort(ids, stable=True)
    rewards, ids = rewards[order], ids[order]
    expected = gpg_authors(rewards, group_size=4, scale_rewards=True)
    got = advantage_estimators["gpg"](rewards, ids, scale_rewards=True)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got, advantage_estimators["gpg"](rewards, ids))  # the std does divide


def test_gpg_scale_rewards_hand_values():
    # Groups [1, 0, 0, 0] (mean 1/4, Bessel std = sqrt(1/4) = 1/2) and [2, 2, 2, 2] (no spread): α = 8/4 = 2.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0], dtype=torch.float64)
    got = advantage_estimators["gpg"](rewards, ids, scale_rewards=True, eps=0.0)
    torch.testing.assert_close(got, 2 * centred / 0.5, rtol=0, atol=1e-12)
    # eps is added to the std; f_norm divides on top (verl's constant)
    got = advantage_estimators["gpg"](rewards, ids, scale_rewards=True, eps=0.5, f_norm=2.0)
    torch.testing.assert_close(got, 2 * centred / (0.5 + 0.5) / 2.0, rtol=0, atol=1e-12)
    # a group without spread stays exactly 0 with eps = 0 (no 0/0)
    assert torch.equal(advantage_estimators["gpg"](torch.ones(4), torch.zeros(4, dtype=torch.long),
                                                   scale_rewards=True, eps=0.0), torch.zeros(4))


def test_gpg_hand_values_where_the_two_counts_differ():
    # Groups [0, 0, 0, 0] (no spread) and [1, 0, 0, 0]: centred [0]*4 + [0.75, -0.25, -0.25, -0.25].
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    centred = torch.tensor([0.0, 0, 0, 0, 0.75, -0.25, -0.25, -0.25])
    # The paper: 4 of 8 samples have spread, α = 2. verl: 1 nonzero reward, α = 8.
    torch.testing.assert_close(advantage_estimators["gpg"](rewards, ids), 2.0 * centred)
    torch.testing.assert_close(advantage_estimators["gpg"](rewards, ids, alpha_count="nonzero_rewards"), 8.0 * centred)
    torch.testing.assert_close(advantage_estimators["gpg"](rewards, ids, f_norm=4.0), 0.5 * centred)
    # ±1 rewards: verl counts every sample, α = 1; the paper's α stays 2.
    signed = 2 * rewards - 1
    torch.testing.assert_close(advantage_estimators["gpg"](signed, ids, alpha_count="nonzero_rewards"), 2 * centred)
    torch.testing.assert_close(advantage_estimators["gpg"](signed, ids), 4 * centred)


def test_gpg_singletons_and_no_spread_groups_are_exactly_zero():
    rewards = torch.tensor([0.1, 0.1, 0.1, 3.0, 1.0, 2.0], dtype=torch.float64)  # the rounded mean is not 0.1
    got = advantage_estimators["gpg"](rewards, torch.tensor([0, 0, 0, 1, 2, 2]))
    # n = 2 (group 2), α = 6/2 = 3; group 2 centred ±0.5.
    assert torch.equal(got[:4], torch.zeros(4, dtype=torch.float64))
    torch.testing.assert_close(got[4:], torch.tensor([-1.5, 1.5], dtype=torch.float64))
    assert torch.equal(advantage_estimators["gpg"](torch.zeros(4), torch.tensor([0, 0, 1, 1])), torch.zeros(4))
    # Dividing by the group std (scale_rewards): a singleton's Bessel std is undefined (NaN), a flat group's 0; both
    # still get exactly 0, and group 2 is ±0.5 / (std 1/√2 + 1e-4) · α 3.
    scaled = advantage_estimators["gpg"](rewards, torch.tensor([0, 0, 0, 1, 2, 2]), scale_rewards=True)
    assert torch.equal(scaled[:4], torch.zeros(4, dtype=torch.float64))
    expected = 3 * 0.5 / (2**-0.5 + 1e-4)
    torch.testing.assert_close(scaled[4:], torch.tensor([-expected, expected], dtype=torch.float64))


@pytest.mark.parametrize(("options", "match"), [
    ({"f_norm": 0.0}, "f_norm must be > 0"), ({"f_norm": -1.0}, "f_norm must be > 0"),
    ({"alpha_count": "nonzero_advantages"}, "alpha_count must be one of"),
])
def test_gpg_refuses_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        advantage_estimators["gpg"](torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), **options)


# ------------------------------------------------------------------------------------------------------ all three
@pytest.mark.parametrize("name", NAMES)
def test_permuting_samples_permutes_advantages(name):
    rewards, ids = random_batch(6, groups=5, group_size=4, levels=3)
    base = advantage_estimators[name](rewards, ids)
    order = torch.randperm(rewards.numel(), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(advantage_estimators[name](rewards[order], ids[order]), base[order], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_singleton_group_gets_zero_and_others_keep_their_values(name):
    rewards = torch.tensor([3.0, 1.0, 2.0, 0.0])
    got = advantage_estimators[name](rewards, torch.tensor([0, 1, 1, 1]))
    assert got[0].item() == 0.0 and (got[1:] != 0).any()


@pytest.mark.parametrize("name", NAMES)
def test_float32_in_float32_out_with_float64_statistics(name):
    rewards, ids = random_batch(7, groups=8, group_size=4)
    got32 = advantage_estimators[name](rewards.float(), ids)
    got64 = advantage_estimators[name](rewards.float().double(), ids)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32, got64.float(), rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_non_finite_and_misshapen_rewards_are_refused(name):
    with pytest.raises(ValueError, match="finite"):
        advantage_estimators[name](torch.tensor([1.0, float("inf")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="rewards"):
        advantage_estimators[name](torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long))


@pytest.mark.parametrize(("options", "key", "allowed"), [
    ({"name": "grpo_passk", "eps": -1e-6}, "eps", "a number >= 0"),
    ({"name": "grpo_passk", "norm_by_std": 1}, "norm_by_std", "true or false"),
    ({"name": "reinforce_pp_baseline", "eps": -1e-9}, "eps", "a number >= 0"),
    ({"name": "gpg", "f_norm": 0.0}, "f_norm", "a number > 0"),
    ({"name": "gpg", "alpha_count": "nonzero_advantages"}, "alpha_count",
     "one of 'samples_with_spread', 'nonzero_rewards'"),
])
def test_config_refuses_bad_options_in_one_line(options, key, allowed):
    data = {**BASE, "algorithm": {**BASE["algorithm"], "advantage": options}}
    with pytest.raises(ConfigError) as info:
        load_config(data)
    assert info.value.key == f"algorithm.advantage.{key}" and info.value.allowed == allowed, str(info.value)


def test_config_binds_the_options():
    data = {**BASE, "algorithm": {**BASE["algorithm"],
                                  "advantage": {"name": "gpg", "f_norm": 2, "alpha_count": "nonzero_rewards"}}}
    bound = load_config(data).algorithm.advantage
    assert bound.name == "gpg" and bound.options == {"f_norm": 2.0, "alpha_count": "nonzero_rewards"}


def test_gpg_alpha_counts_samples_not_groups_when_group_sizes_differ():
    """α = B/(B − M) with M the samples of groups without spread (arXiv:2504.02546): groups of 4 (spread), 2 and 3
    (none) give α = 9/4; counting groups (1 of 3), which equals it only for equal sizes, would give 3. Unequal sizes
    occur when samples with non-finite rewards leave their groups (mmrl.trainer.credit.sample_advantages)."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2])
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(advantage_estimators["gpg"](rewards, ids), 9 / 4 * centred, rtol=0, atol=1e-12)
    # verl's count: 3 nonzero rewards of 9, α = 3
    torch.testing.assert_close(advantage_estimators["gpg"](rewards, ids, alpha_count="nonzero_rewards"),
                               3 * centred, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["gpg", "reinforce_pp_baseline"])
def test_batch_statistics_with_dynamic_sampling_are_estimated_on_the_kept_batch(name):
    """Estimating on a round and then dropping the groups without spread differs from estimating on the kept batch
    (verl's DAPO order) by the round's share of samples with spread: here half, so gpg's α (2 vs 1) and
    reinforce_pp_baseline's scale (sqrt 2). The trainer estimates on the kept batch (tests/test_dynamic_credit.py),
    so the config accepts both estimators with dynamic sampling (it used to refuse them)."""
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 1, 0])
    ids = torch.arange(4).repeat_interleave(4)
    kept = torch.tensor([True] * 4 + [False] * 8 + [True] * 4)  # the groups with spread
    round_then_filter = advantage_estimators[name](rewards, ids)[kept]
    filter_then_round = advantage_estimators[name](rewards[kept], ids[kept])
    factor = 2.0 if name == "gpg" else math.sqrt(2.0)
    torch.testing.assert_close(round_then_filter, factor * filter_then_round)
    data = {**BASE, "algorithm": {**BASE["algorithm"], "advantage": name},
            "rollout": {**BASE["rollout"], "dynamic_sampling": {"enabled": True}}}
    assert load_config(data).algorithm.advantage.name == name
