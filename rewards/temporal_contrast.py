"""T-GRPO's temporal reward (Video-R1, arXiv:2503.21776): a bonus for answers that need the frames in order.

Video-R1's T-GRPO samples, beside the G completions of a video question, G/2 completions of the same question with
the video's frames shuffled, and compares the accuracy of the two groups: when the ordered frames do at least
μ times as well as the shuffled ones (p ≥ μ·p̃), the correct answers of the ordered group get a bonus α, so the
policy is rewarded for reasoning that uses the frames' order. The shuffled completions are only compared, never
trained on. Released code: tulerfeng/Video-R1@59d65c3 ``src/r1-v/src/open_r1/trainer/vllm_grpo_trainer_modified.py``
(shuffling ``video_inputs[0][torch.randperm(T)]``, ``shuffled_num_generations = num_generations // 2``, lines
500-520 and 572-590; the comparison and bonus, lines 771-786: ``acc_mean >= 0.8 * shuffled_acc_mean`` adds ``0.3``
to the accuracy reward of the samples whose accuracy is above 0.1; a batch without a video gets no bonus).

In mmrl the VLM plugin samples the shuffled completions (``plugin.temporal_contrast``: how many per video prompt)
and hands them over as ``payload["shuffled_completions"]`` (each sample: its group's list of texts; empty for a
prompt without a video), and this reward wraps the accuracy reward: it scores both groups with it and returns the
accuracy plus the bonus, the column Video-R1 adds it to. Video-R1 compares one prompt's groups (one prompt per
device); here each group is compared on its own too (a group-wise reward).
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

NonNegative = Annotated[float, Range(0.0)]


class TemporalContrastReward(Reward):
    """An accuracy reward plus T-GRPO's temporal bonus (module docstring)."""

    groupwise = True

    def __init__(self, *, reward: str, options: dict[str, Any] | None = None, bonus: NonNegative = 0.3,
                 ratio: NonNegative = 0.8,
                 threshold: Annotated[float, ANY_FINITE] = 0.1, shuffled: str = "shuffled_completions",
                 output: str = "completions"):
        """Options (the config's ``args``).

        Args:
            reward: The registered accuracy reward scored on both groups (e.g. ``choice``, ``math``, ``count``).
            options: That reward's options (its ``args``).
            bonus: α, added to the accuracy of the ordered group's samples above ``threshold`` (Video-R1: 0.3).
            ratio: μ, the bonus is given when the ordered group's mean accuracy p ≥ μ · the shuffled group's p̃
                (Video-R1: 0.8).
            threshold: The accuracy above which a sample counts as correct and gets the bonus (Video-R1: 0.1).
            shuffled: Payload entry holding each sample's group's shuffled-frame completions.
            output: Payload entry holding the completions, which the accuracy reward reads.
        """
        for name, value in (("bonus", bonus), ("ratio", ratio), ("threshold", threshold)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RewardError(f"reward 'temporal_contrast': {name} must be a finite number, got {value!r}")
        for name, value in (("bonus", bonus), ("ratio", ratio)):
            if value < 0:
                raise RewardError(f"reward 'temporal_contrast': {name} must be >= 0, got {value!r}")
        self.name = reward
        # The options already went through the accuracy reward's own resolve_args with the run's context
        # (resolve_args below), e.g. the VLM plugin's box convention for iou.
        self.inner = build_accuracy_reward("temporal_contrast", reward, options)
        self.bonus, self.ratio, self.threshold = float(bonus), float(ratio), float(threshold)
        self.shuffled, self.output = shuffled, output

    @staticmethod
    def resolve_args(args: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
        """The accuracy reward's options resolved with the run's reward context, as if configured on its own."""
        return resolve_wrapped_args(args, context, excluded={"temporal_contrast"})

    @classmethod
    def bind_nested_options(cls, options: dict[str, Any], key: str) -> dict[str, Any]:
        """Check the accuracy reward's name and options when the config loads (called by ``bind_options``)."""
        return bind_wrapped_options(options, key, excluded={"temporal_contrast"}, kind="a per-sample accuracy reward")

    def _accuracy(self, batch: RewardInput, what: str) -> Tensor:
        return inner_scores("temporal_contrast", self.name, self.inner, batch, what)

    def __call__(self, batch: RewardInput) -> Tensor:
        """One group: its accuracy, plus the bonus on its correct samples when p ≥ μ · p̃."""
        n = len(batch)
        scores = self._accuracy(batch, "samples") if n else torch.zeros(0, dtype=torch.float64)
        if n == 0:
            return scores
        lists = batch.output(self.shuffled)
        if not isinstance(lists, (list, tuple)) or len(lists) != n:
            raise RewardError(f"reward 'temporal_contrast': payload[{self.shuffled!r}] must hold one list of texts per "
                              f"sample, got {type(lists).__name__}")
        texts = lists[0]
        if any(list(other) != list(texts) for other in lists[1:]):
            raise RewardError(f"reward 'temporal_contrast': the samples of one group carry different "
                              f"payload[{self.shuffled!r}] lists; each sample must carry its group's")
        if not texts:  # no video in this prompt (or an evaluation rollout): no comparison, no bonus
            return scores
        row = batch.rows[0]
        shuffled = RewardInput(rows=[row] * len(texts), payload={self.output: list(texts)},
                               group_ids=torch.zeros(len(texts), dtype=torch.long))
        ordered_mean = float(scores.mean())
        shuffled_mean = float(self._accuracy(shuffled, "shuffled-frame completions").mean())
        if ordered_mean >= self.ratio * shuffled_mean:  # False when either mean is NaN: no bonus
            scores = torch.where(scores > self.threshold, scores + self.bonus, scores)
        return scores


__all__ = ["TemporalContrastReward"]
