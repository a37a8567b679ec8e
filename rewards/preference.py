"""Pairwise preference rewards: Pref-GRPO's win rate within each group.

``pref_winrate`` judges pairs of samples of one group with a *pairwise judge* and gives each sample its win rate
against the other members (Pref-GRPO; see docs/rewards.md)::

    R_i = (1 / (G − 1)) · Σ_{j ≠ i} p(i ≻ j),   p ∈ {0, ½, 1} for a hard judge (win, tie, loss)

Judges live in the :data:`pairwise_judges` registry. A judge is a class constructed with its options that
implements ``compare(batch, pairs) -> list[float]``: for each pair ``(i, j)`` of indices into ``batch`` (one group)
the probability that ``i`` is preferred to ``j`` (1 = i wins, 0 = j wins, 0.5 = tie; any value in [0, 1] for soft
judges), or NaN when the pair cannot be judged. Each unordered pair is judged once (``p(j ≻ i) = 1 − p(i ≻ j)``),
i.e. G(G−1)/2 judgements per group; ``symmetric: true`` also judges the swapped order and averages, which cancels a
judge's position bias at twice the cost.

The built-in ``pointwise`` judge compares the scores of any registered pointwise reward (ties within a tolerance),
so the win rate can sit on top of PickScore, HPSv2 or a remote reward. A VLM judge (Pref-GRPO uses UnifiedReward)
is a judge class that asks the model "which of these two images better matches the prompt" for each pair and maps
the answer to 1, 0 or 0.5; register it with ``pairwise_judges.register("my_vlm", MyJudge)`` or through the
entry-point group ``mmrl.pairwise_judges``.
"""

from __future__ import annotations

import inspect
import math
from typing import Annotated, Any, ClassVar

from torch import Tensor

from mmrl.registry import Range, Registry, RegistryError
from mmrl.reward import Reward, RewardError, RewardInput, _as_scores, build_reward

pairwise_judges: Registry[Any] = Registry("pairwise judge", entry_point_group="mmrl.pairwise_judges")


class PairwiseJudge:
    """Base class of pairwise judges: ``compare(batch, pairs)`` returns p(i ≻ j) per pair (NaN: not judged)."""

    def compare(self, batch: RewardInput, pairs: list[tuple[int, int]]) -> list[float]:
        raise NotImplementedError


@pairwise_judges.register("pointwise")
class PointwiseJudge(PairwiseJudge):
    """Prefer the sample with the higher score under a pointwise reward; scores within ``tolerance`` tie.

    The reward scores the group once (not once per pair). A sample with a NaN score cannot be compared: its pairs
    are NaN, so its own win rate is NaN and the others' win rates are taken over the remaining members.
    """

    def __init__(self, reward: str = "pickscore", args: dict[str, Any] | None = None,
                 tolerance: Annotated[float, Range(0)] = 0.0):
        """Options (the config's ``args``).

        Args:
            reward: Name of a registered pointwise reward (e.g. pickscore, hpsv2, clip_score, remote).
            args: Options of that reward, as in rewards.functions[].args.
            tolerance: Scores that differ by at most this much are a tie (½ to each).
        """
        from mmrl.config.schema import bind_options
        from mmrl.rewards import reward_functions

        if not tolerance >= 0:
            raise RewardError(f"pairwise judge 'pointwise': tolerance must be >= 0, got {tolerance!r}")
        if reward == "pref_winrate":
            raise RewardError("pairwise judge 'pointwise': reward 'pref_winrate' cannot judge itself; name a "
                              "pointwise reward")
        entry = reward_functions.get(reward)
        bound = bind_options(entry, dict(args or {}), "judge_args.args", f"reward {reward!r}")
        self.name = reward
        self.reward = build_reward(reward, bound)
        if getattr(self.reward, "groupwise", False):
            raise RewardError(f"pairwise judge 'pointwise': reward {reward!r} is group-wise; name a pointwise reward")
        self.tolerance = tolerance

    @classmethod
    def bind_nested_options(cls, options: dict[str, Any], key: str) -> dict[str, Any]:
        """Check ``args`` against the named reward's options when the config loads (called by ``bind_options``)."""
        from mmrl.config.schema import ConfigError, bind_options
        from mmrl.rewards import reward_functions

        reward = options.get("reward", _default(cls, "reward"))
        try:
            entry = reward_functions.get(reward)
        except RegistryError:
            raise ConfigError(f"{key}.reward", reward, f"one of {', '.join(reward_functions.names())}") from None
        args = bind_options(entry, dict(options.get("args") or {}), f"{key}.args", f"reward {reward!r}")
        return options if options.get("args") is None else {**options, "args": args}

    def scores(self, batch: RewardInput) -> Tensor:
        return _as_scores(self.reward(batch), len(batch), self.name)

    def compare(self, batch: RewardInput, pairs: list[tuple[int, int]]) -> list[float]:
        scores = self.scores(batch).tolist()
        result = []
        for i, j in pairs:
            a, b = scores[i], scores[j]
            if not (math.isfinite(a) and math.isfinite(b)):
                result.append(math.nan)
            elif abs(a - b) <= self.tolerance:
                result.append(0.5)
            else:
                result.append(1.0 if a > b else 0.0)
        return result


def _default(cls: type, name: str) -> Any:
    """The default of the constructor parameter ``name`` of ``cls``."""
    return inspect.signature(cls).parameters[name].default


def win_rates(preferences: dict[tuple[int, int], float], size: int) -> list[float]:
    """Win rate of each of ``size`` members from p(i ≻ j) of pairs ``i < j``.

    R_i = mean over judged pairs containing i of p(i ≻ j) (with p(j ≻ i) = 1 − p(i ≻ j)); pairs whose value is NaN
    are left out; a member without any judged pair gets NaN, except in a group of one, which gets 0.5 (no opponent;
    its group-normalised advantage is 0 anyway).
    """
    if size == 1:
        return [0.5]
    totals = [0.0] * size
    counts = [0] * size
    for (i, j), p in preferences.items():
        if not math.isfinite(p):
            continue
        totals[i] += p
        totals[j] += 1.0 - p
        counts[i] += 1
        counts[j] += 1
    return [totals[k] / counts[k] if counts[k] else math.nan for k in range(size)]


class PrefWinRate(Reward):
    """Pref-GRPO win rate: each sample's share of wins (ties ½) against the other members of its group.

    Group-wise: called once per group. R_i = (1/(G−1)) · Σ_{j≠i} [1(i≻j) + ½·1(i~j)] under the chosen pairwise
    judge (see :data:`pairwise_judges`); values lie in [0, 1] and a group's scores average ½. A group of one scores
    0.5. Samples the judge cannot compare (e.g. NaN scores) get NaN, left to ``rewards.on_nonfinite``.
    """

    groupwise: ClassVar[bool] = True

    def __init__(self, judge: str = "pointwise", judge_args: dict[str, Any] | None = None, symmetric: bool = False):
        """Options (the config's ``args``).

        Args:
            judge: Name of a pairwise judge in mmrl.rewards.preference.pairwise_judges (pointwise).
            judge_args: Options of the judge, e.g. {reward: pickscore, args: {...}, tolerance: 0.0} for pointwise.
            symmetric: Judge both orders of every pair and average (cancels position bias; twice the judge calls).
        """
        from mmrl.config.schema import bind_options

        entry = pairwise_judges.get(judge)
        options = bind_options(entry, dict(judge_args or {}), "judge_args", f"pairwise judge {judge!r}")
        self.judge = entry(**options)
        self.judge_name = judge
        self.symmetric = symmetric

    @classmethod
    def bind_nested_options(cls, options: dict[str, Any], key: str) -> dict[str, Any]:
        """Check ``judge_args`` against the chosen judge's options when the config loads (called by
        ``bind_options``), so that a judge's option out of its range stops the run before any model loads."""
        from mmrl.config.schema import ConfigError, bind_options

        judge = options.get("judge", _default(cls, "judge"))
        try:
            entry = pairwise_judges.get(judge)
        except RegistryError:
            raise ConfigError(f"{key}.judge", judge, f"one of {', '.join(pairwise_judges.names())}") from None
        judge_args = bind_options(entry, dict(options.get("judge_args") or {}), f"{key}.judge_args",
                                  f"pairwise judge {judge!r}")
        return options if options.get("judge_args") is None else {**options, "judge_args": judge_args}

    def __call__(self, batch: RewardInput) -> list[float]:
        size = len(batch)
        pairs = [(i, j) for i in range(size) for j in range(i + 1, size)]
        if not pairs:
            return win_rates({}, size) if size else []
        forward = self._judged(batch, pairs)
        if self.symmetric:
            backward = self._judged(batch, [(j, i) for i, j in pairs])
            forward = [(p + (1.0 - q)) / 2.0 for p, q in zip(forward, backward, strict=True)]
        return win_rates(dict(zip(pairs, forward, strict=True)), size)

    def _judged(self, batch: RewardInput, pairs: list[tuple[int, int]]) -> list[float]:
        values = self.judge.compare(batch, pairs)
        if isinstance(values, Tensor):
            values = values.tolist()
        values = list(values)
        if len(values) != len(pairs):
            raise RewardError(f"pairwise judge {self.judge_name!r} returned {len(values)} preferences for "
                              f"{len(pairs)} pairs")
        result = []
        for (i, j), value in zip(pairs, values, strict=True):
            p = math.nan if value is None else float(value)
            if math.isfinite(p) and not 0.0 <= p <= 1.0:
                raise RewardError(f"pairwise judge {self.judge_name!r} returned p={p!r} for pair ({i}, {j}); "
                                  "preferences must lie in [0, 1] (or NaN when a pair cannot be judged)")
            result.append(p)
        return result

