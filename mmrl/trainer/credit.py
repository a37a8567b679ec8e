"""From gathered rewards to advantages: the credit step of the loop, as pure functions.

The trainer gathers every process's scores, validity flags and group ids, calls these functions on the global
batch (so that groups spanning processes get the same statistics everywhere), and keeps its own slice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mmrl.algos import multi_reward_advantages


@dataclass
class Credit:
    """Result of the credit step on the global batch.

    Attributes:
        advantages: ``[N]`` per-sample advantages (0 for invalid samples).
        combined: ``[N]`` the weighted reward Σ_k w_k·r_k (0 for invalid samples).
    """

    advantages: Tensor
    combined: Tensor


def sample_advantages(
    scores: Tensor,
    valid: Tensor,
    group_ids: Tensor,
    weights: Tensor,
    estimator: Callable[..., Tensor],
    estimator_options: dict[str, Any],
    *,
    order: str,
    clip: float | None,
) -> Credit:
    """Group-relative advantages of the valid samples; invalid samples (non-finite rewards, skipped) get 0 and
    do not enter any group's statistics.

    Args:
        scores: ``[N, K]`` reward columns.
        valid: ``[N]`` bool.
        group_ids: ``[N]``.
        weights: ``[K]``.
        estimator: An advantage estimator from the registry.
        estimator_options: Its bound options.
        order: ``"sum_then_normalize"`` or ``"normalize_then_sum"``.
        clip: Clip the advantages to ±clip (None: no clipping).
    """
    advantages = torch.zeros(scores.shape[0], dtype=torch.float32)
    combined = torch.zeros(scores.shape[0], dtype=torch.float32)
    index = valid.nonzero().flatten()
    if index.numel():
        adv, comb = multi_reward_advantages(
            scores[index].to(torch.float32), weights, group_ids[index], estimator, order=order, **estimator_options
        )
        advantages[index] = adv.to(torch.float32)
        combined[index] = comb.to(torch.float32)
    if clip is not None:
        advantages = advantages.clamp(-clip, clip)
    return Credit(advantages=advantages, combined=combined)


def action_advantages(
    action_rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    estimator: Callable[..., Tensor],
    estimator_options: dict[str, Any],
    *,
    clip: float | None,
) -> Tensor:
    """Group-relative advantages per action position: the estimator runs on each action column on its own, over the
    column's active entries (``mask > 0``), with the samples' groups; inactive entries get 0.

    For plugins whose rewards are credited to individual actions (branching credit: the reward spread of a branch
    point is credited to that step; BranchGRPO normalises per tree depth). Running the estimator per column keeps
    every statistic inside its column: the group mean as always, and the std too, also for estimators whose std
    spans the batch (``batch_std``: the std of the column over the batch, not of every column pooled, which would
    shrink the advantages of a low-spread column towards 0). That is Flow-GRPO's per-prompt stat tracker on a
    reward matrix (yifan123/flow_grpo ac4c86e, ``flow_grpo/stat_tracking.py:25-29``: mean and std over axis 0, per
    column), which TempFlow-GRPO feeds one reward per branch step (Shredded-Pork/TempFlow-GRPO e66824e,
    ``scripts/train_sd3_pr.py``: ``stat_tracker.update(prompts, gathered_rewards['avg'])`` with rewards
    ``[rows, S-1]``); ``global_std=True`` there is ``batch_std`` here, ``global_std=False`` is ``grpo`` (with
    Bessel's correction, see :func:`mmrl.algos.advantages.grpo_advantages`).

    Args:
        action_rewards: ``[N, A]``.
        mask: ``[N, A]``.
        group_ids: ``[N]``.

    Returns:
        ``[N, A]`` advantages.
    """
    active = mask > 0  # [N, A]
    _, dense_groups = torch.unique(group_ids, return_inverse=True)  # [N]
    advantages = torch.zeros_like(action_rewards, dtype=torch.float32)
    for column in range(action_rewards.shape[1]):
        rows = active[:, column]  # [N]
        if rows.any():
            values = estimator(action_rewards[rows, column].to(torch.float32), dense_groups[rows],
                               **estimator_options)
            advantages[rows, column] = values.to(torch.float32)
    if clip is not None:
        advantages = advantages.clamp(-clip, clip)
    return advantages
