"""Pref-GRPO win rate: hand-computed win rates with ties, judges, group-wise scoring through RewardScorer."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from mmrl.config import ConfigError, load_config
from mmrl.reward import RewardError, RewardInput, RewardScorer, build_reward
from mmrl.rewards import reward_functions
from mmrl.rewards.preference import PairwiseJudge, PrefWinRate, pairwise_judges, win_rates
from tests.helpers import BASE


def row_score(batch: RewardInput, *, field: str = "score") -> list[float]:
    """Test reward: the row's ``score`` field.

    Args:
        field: Row field holding the score.
    """
    return [float(value) for value in batch.column(field)]


def _register(name: str, obj) -> None:
    if name not in reward_functions:
        reward_functions.register(name, obj)


_register("test_row_score", row_score)


@pairwise_judges.register("test_first_wins")
class FirstWins(PairwiseJudge):
    """A judge with total position bias: the first of each pair always wins."""

    def compare(self, batch, pairs):
        return [1.0] * len(pairs)


@pairwise_judges.register("test_fixed")
class FixedAnswer(PairwiseJudge):
    """Returns ``value`` for every pair (or ``count`` values)."""

    def __init__(self, value: float = 0.5, count: int = -1):
        self.value, self.count = value, count

    def compare(self, batch, pairs):
        return [self.value] * (len(pairs) if self.count < 0 else self.count)


def scored_batch(scores, group_ids=None) -> RewardInput:
    rows = [{"score": s} for s in scores]
    ids = torch.zeros(len(rows), dtype=torch.long) if group_ids is None else torch.tensor(group_ids)
    return RewardInput(rows=rows, payload={}, group_ids=ids)


def winrate(**judge_args) -> PrefWinRate:
    return PrefWinRate(judge_args={"reward": "test_row_score", **judge_args})


def reference_win_rates(scores, tolerance=0.0):
    """R_i = (1/(G−1)) Σ_{j≠i} [1(i≻j) + ½·1(i~j)], with exact fractions."""
    g = len(scores)
    result = []
    for i in range(g):
        total = Fraction(0)
        for j in range(g):
            if i == j:
                continue
            if abs(scores[i] - scores[j]) <= tolerance:
                total += Fraction(1, 2)
            elif scores[i] > scores[j]:
                total += 1
        result.append(float(total / (g - 1)) if g > 1 else 0.5)
    return result


def test_hand_computed_win_rates_with_ties():
    # pairs: 0>1, 0~2, 0>3, 2>1, 1>3, 2>3  →  R = [2.5/3, 1/3, 2.5/3, 0]
    scores = winrate()(scored_batch([3.0, 1.0, 3.0, 0.0]))
    assert scores == pytest.approx([5 / 6, 1 / 3, 5 / 6, 0.0], abs=1e-12)
    assert sum(scores) == pytest.approx(2.0)  # win rates of a group always sum to G/2


def test_tolerance_turns_close_scores_into_ties():
    scores = winrate(tolerance=0.1)(scored_batch([1.0, 1.05, 2.0]))
    # 0~1 (|Δ| = 0.05), 2 beats both
    assert scores == pytest.approx([0.25, 0.25, 1.0])
    assert winrate()(scored_batch([1.0, 1.05, 2.0])) == pytest.approx([0.0, 0.5, 1.0])


@pytest.mark.parametrize("seed", range(5))
def test_win_rates_match_the_formula_on_random_groups(seed):
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 4, size=int(rng.integers(2, 9))).astype(float).tolist()  # many ties
    assert winrate()(scored_batch(scores)) == pytest.approx(reference_win_rates(scores))


def test_group_of_one_scores_one_half_and_empty_scores_nothing():
    assert winrate()(scored_batch([7.0])) == [0.5]
    assert winrate()(scored_batch([])) == []


def test_nan_member_is_left_out_of_the_others_win_rates():
    scores = winrate()(scored_batch([2.0, float("nan"), 1.0, 0.0]))
    assert math.isnan(scores[1])
    assert scores[0] == pytest.approx(1.0) and scores[2] == pytest.approx(0.5) and scores[3] == pytest.approx(0.0)
    assert all(math.isnan(v) for v in win_rates({(0, 1): math.nan}, 2))  # no judged pair at all


def test_groupwise_scoring_through_the_scorer():
    # Two interleaved groups: the scorer must call the reward once per group with only that group's samples.
    scores = [5.0, 0.0, 1.0, 3.0, 9.0, 2.0, 1.0, 3.0]
    group_ids = [0, 1, 0, 1, 0, 1, 0, 1]
    reward = build_reward("pref_winrate", {"judge_args": {"reward": "test_row_score"}})
    scorer = RewardScorer(["pref_winrate"], [reward], [1.0])
    assert scorer.groupwise
    column = scorer.score(scored_batch(scores, group_ids)).scores[:, 0]
    first = reference_win_rates([5.0, 1.0, 9.0, 1.0])
    second = reference_win_rates([0.0, 3.0, 2.0, 3.0])
    expected = [first[0], second[0], first[1], second[1], first[2], second[2], first[3], second[3]]
    assert column.tolist() == pytest.approx(expected)


def test_nan_win_rate_follows_on_nonfinite():
    reward = build_reward("pref_winrate", {"judge_args": {"reward": "test_row_score"}})
    batch = scored_batch([1.0, float("nan"), 0.0, 2.0, 3.0], [0, 0, 0, 1, 1])
    with pytest.raises(RewardError, match=r"reward 'pref_winrate' returned NaN .* samples \[1\]"):
        RewardScorer(["pref_winrate"], [reward], [1.0], on_nonfinite="error").score(batch)
    scored = RewardScorer(["pref_winrate"], [reward], [1.0], on_nonfinite="skip").score(batch)
    assert scored.valid.tolist() == [True, False, True, True, True]
    assert scored.scores[:, 0].tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0, 1.0])
    # In a pair whose other member is NaN nothing can be judged: both members are NaN (the group has no
    # comparison left; with on_nonfinite=skip both are dropped).
    pair = build_reward("pref_winrate", {"judge_args": {"reward": "test_row_score"}})(scored_batch([1.0, math.nan]))
    assert all(math.isnan(v) for v in pair)


def test_symmetric_judging_cancels_position_bias():
    batch = scored_batch([0.0, 0.0, 0.0])
    biased = PrefWinRate(judge="test_first_wins")(batch)
    assert biased == pytest.approx([1.0, 0.5, 0.0])  # i < j always wins
    assert PrefWinRate(judge="test_first_wins", symmetric=True)(batch) == pytest.approx([0.5, 0.5, 0.5])


def test_judge_mistakes_are_clear_errors():
    batch = scored_batch([0.0, 1.0, 2.0])
    with pytest.raises(RewardError, match=r"judge 'test_fixed' returned p=1.5 for pair \(0, 1\); preferences must"):
        PrefWinRate(judge="test_fixed", judge_args={"value": 1.5})(batch)
    with pytest.raises(RewardError, match=r"returned 1 preferences for 3 pairs"):
        PrefWinRate(judge="test_fixed", judge_args={"count": 1})(batch)
    with pytest.raises(ConfigError, match=r"judge_args\.valu.*options of pairwise judge 'test_fixed'"):
        PrefWinRate(judge="test_fixed", judge_args={"valu": 1.0})
    with pytest.raises(KeyError, match=r"unknown pairwise judge 'nope'; registered: .*pointwise"):
        PrefWinRate(judge="nope")
    with pytest.raises(RewardError, match=r"reward 'pref_winrate' is group-wise|cannot judge itself"):
        PrefWinRate(judge_args={"reward": "pref_winrate"})
    with pytest.raises(ConfigError, match=r"judge_args\.args\.quality.*an integer"):
        PrefWinRate(judge_args={"reward": "jpeg_incompressibility", "args": {"quality": "best"}})


def test_pointwise_judge_on_an_image_reward():
    flat = torch.full((1, 3, 32, 32), 0.5)
    noise = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    stripes = torch.zeros(1, 3, 32, 32)
    stripes[..., ::2] = 1.0
    images = torch.cat([flat, noise, stripes])
    batch = RewardInput(rows=[{"prompt": "x"}] * 4, payload={"images": images}, group_ids=torch.zeros(4))
    sizes = build_reward("jpeg_incompressibility", {})(batch).tolist()
    rates = PrefWinRate(judge_args={"reward": "jpeg_incompressibility"})(batch)
    assert rates == pytest.approx(reference_win_rates(sizes))
    assert rates[0] == 0.0  # the flat image is the most compressible: it loses every comparison


def test_pref_winrate_in_a_run_config_validates():
    data = {**BASE, "rewards": {"functions": [{"name": "pref_winrate", "args": {
        "judge_args": {"reward": "jpeg_incompressibility", "tolerance": 0.01}, "symmetric": True}}]}}
    config = load_config(data)
    spec = config.rewards.functions[0]
    assert spec.args["symmetric"] is True and spec.args["judge_args"]["tolerance"] == 0.01
    with pytest.raises(ConfigError, match=r"args\.symmetric.*true or false"):
        load_config({**BASE, "rewards": {"functions": [{"name": "pref_winrate", "args": {"symmetric": "yes"}}]}})
