"""Length rewards for text completions.

``overlong_penalty`` is DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, §3.4, eq. 13): with a
generation budget of L_max tokens and a buffer of L_cache tokens before it, a completion of |y| tokens gets

    0                                    if |y| ≤ L_max − L_cache
    ((L_max − L_cache) − |y|) / L_cache  if L_max − L_cache < |y| ≤ L_max
    −1                                   if |y| > L_max

times ``factor``, added to the task reward (list both rewards, weight 1 each). verl's DAPO reward manager computes
the same (volcengine/verl@b178a3c ``verl/workers/reward_manager/dapo.py:77, 116-122``: ``overlong_buffer.len``
L_cache, ``penalty_factor``, the budget ``max_resp_len``; exceeding length ``|y| − (L_max − L_cache)``, penalty
``min(−exceed / L_cache · factor, 0)``, with |y| the response's attention-mask length, end-of-sequence token
included), and its DAPO recipe sets L_max 20480, L_cache 4096, factor 1.0 (verl@246cac4
``recipe/dapo/run_dapo_early_qwen2.5_32b.sh:18-21``). With the budget enforced by generation |y| never exceeds
L_max, where both give −factor; beyond it DAPO's formula stays at −1 (verl's would keep falling).

``correct_length_bonus`` is Video-R1's length control (arXiv:2503.21776; tulerfeng/Video-R1@59d65c3
``src/r1-v/src/open_r1/trainer/vllm_grpo_trainer_modified.py:795-813``, ``--len_control true`` in its GRPO scripts):
within a group that has more than one correct answer (accuracy above 0.1), each correct answer whose length is
within [320, 512] tokens gets + 0.2, rewarding reasoning of moderate length without rewarding length in wrong
answers. It returns the bonus alone (a column summed with the accuracy, as Video-R1 adds it to the summed reward);
the accuracy is the wrapped reward's, before any other bonus (Video-R1 reads its first reward column, not the
temporal bonus).

Both read the completion length in tokens from ``payload["completion_tokens"]`` (the vlm, dllm and toy plugins write
it: tokens up to and including the end-of-sequence token, all of them without one; Video-R1's ``completion_mask``
counts the same).
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import torch
from torch import Tensor

from mmrl.registry import ANY_FINITE, Range
from mmrl.reward import Reward, RewardError, RewardInput
from mmrl.rewards.wrapped import (
    bind_wrapped_options,
    build_accuracy_reward,
    inner_scores,
    resolve_wrapped_args,
)


def overlong_penalty(batch: RewardInput, *, max_length: Annotated[int, Range(1)],
                     buffer: Annotated[int, Range(1)],
                     factor: Annotated[float, Range(0.0)] = 1.0,
                     output: str = "completion_tokens") -> list[float]:
    """DAPO's soft overlong punishment (module docstring): 0 up to ``max_length − buffer`` tokens, then falling
    linearly to ``−factor`` at ``max_length``, ``−factor`` beyond.

    Args:
        max_length: L_max, the generation budget in tokens (the plugin's ``max_new_tokens`` or generation length).
        buffer: L_cache, the tokens before the budget over which the penalty grows; at most ``max_length``.
        factor: Scale of the penalty (verl's ``overlong_buffer.penalty_factor``).
        output: Payload entry holding each completion's length in tokens.
    """
    if max_length < 1:
        raise RewardError(f"overlong_penalty: max_length must be at least 1 token, got {max_length}")
    if not 1 <= buffer <= max_length:
        raise RewardError(f"overlong_penalty: buffer must be in [1, max_length={max_length}], got {buffer}")
    if not math.isfinite(factor) or factor < 0:
        raise RewardError(f"overlong_penalty: factor must be a finite number >= 0, got {factor}")
    lengths = batch.output(output)
    lengths = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
    start = max_length - buffer
    scores = []
    for length in lengths:
        if length > max_length:
            scores.append(-factor)
        else:
            scores.append(factor * min(start - float(length), 0.0) / buffer)
    return scores


class CorrectLengthBonus(Reward):
    """Video-R1's length control (module docstring): ``bonus`` for each correct answer of ``min_tokens`` to
    ``max_tokens`` tokens, in a group with at least ``min_correct`` correct answers; 0 otherwise."""

    groupwise = True

    def __init__(self, *, reward: str, options: dict[str, Any] | None = None,
                 bonus: Annotated[float, Range(0.0)] = 0.2, min_tokens: Annotated[int, Range(0)] = 320,
                 max_tokens: Annotated[int, Range(1)] = 512,
                 threshold: Annotated[float, ANY_FINITE] = 0.1,
                 min_correct: Annotated[int, Range(1)] = 2, output: str = "completion_tokens"):
        """Options (the config's ``args``).

        Args:
            reward: The registered per-sample accuracy reward that decides which answers are correct.
            options: That reward's options (its ``args``).
            bonus: Added to a correct answer of the right length (Video-R1: 0.2).
            min_tokens: Shortest rewarded length, inclusive (Video-R1: 320).
            max_tokens: Longest rewarded length, inclusive (Video-R1: 512).
            threshold: Accuracy above which an answer is correct (Video-R1: 0.1).
            min_correct: Correct answers a group needs for any bonus (Video-R1: more than one, 2).
            output: Payload entry holding the completion lengths in tokens.
        """
        for name, value, low in (("bonus", bonus, 0.0), ("min_tokens", min_tokens, 0), ("max_tokens", max_tokens, 1),
                                 ("min_correct", min_correct, 1)):
            integer = name != "bonus"
            if (isinstance(value, bool) or not isinstance(value, int if integer else (int, float))
                    or not math.isfinite(value) or value < low):
                kind = "an integer" if integer else "a number"
                raise RewardError(f"reward 'correct_length_bonus': {name} must be {kind} >= {low}, got {value!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
            raise RewardError(f"reward 'correct_length_bonus': threshold must be a finite number, got {threshold!r}")
        if min_tokens > max_tokens:
            raise RewardError(f"reward 'correct_length_bonus': min_tokens ({min_tokens}) exceeds max_tokens "
                              f"({max_tokens})")
        self.name = reward
        self.inner = build_accuracy_reward("correct_length_bonus", reward, options)
        self.bonus, self.min_tokens, self.max_tokens = float(bonus), int(min_tokens), int(max_tokens)
        self.threshold, self.min_correct, self.output = float(threshold), int(min_correct), output

    @staticmethod
    def resolve_args(args: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
        """The accuracy reward's options resolved with the run's reward context, as if configured on its own."""
        return resolve_wrapped_args(args, context, excluded={"correct_length_bonus"})

    @classmethod
    def bind_nested_options(cls, options: dict[str, Any], key: str) -> dict[str, Any]:
        """Check the accuracy reward's name and options when the config loads (called by ``bind_options``)."""
        return bind_wrapped_options(options, key, excluded={"correct_length_bonus"},
                                    kind="a per-sample accuracy reward")

    def __call__(self, batch: RewardInput) -> Tensor:
        """One group: the bonus of each sample."""
        n = len(batch)
        if n == 0:
            return torch.zeros(0, dtype=torch.float64)
        accuracy = inner_scores("correct_length_bonus", self.name, self.inner, batch, "samples")
        lengths = batch.output(self.output)
        lengths = torch.as_tensor(lengths.tolist() if isinstance(lengths, Tensor) else list(lengths),
                                  dtype=torch.float64).reshape(-1)
        if lengths.shape[0] != n:
            raise RewardError(f"reward 'correct_length_bonus': payload[{self.output!r}] holds {lengths.shape[0]} "
                              f"lengths for {n} samples")
        correct = accuracy > self.threshold  # NaN: not correct
        if int(correct.sum()) < self.min_correct:
            return torch.zeros(n, dtype=torch.float64)
        window = (lengths >= self.min_tokens) & (lengths <= self.max_tokens)
        return torch.where(correct & window, torch.full((n,), self.bonus, dtype=torch.float64),
                           torch.zeros(n, dtype=torch.float64))
