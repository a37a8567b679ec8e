"""Group-relative advantage estimators: ``fn(rewards[N], group_ids[N], **options) -> advantages[N]``.

All estimators compare each sample with the other samples of its group (the G completions of one prompt). The
statistics are accumulated in float64 and the result is returned in the rewards' dtype. A group of a single
sample carries no comparison and gets advantage 0.

References:
    GRPO — Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, eq. (3).
    Dr.GRPO — Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783, §3.
    RLOO — Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE", arXiv:2402.14740, eq. (9).
    Batch std — Liu et al. 2025, "Flow-GRPO", arXiv:2505.05470 (``global_std`` in the reference code).
    GDPO — "Group reward-Decoupled normalization Policy Optimization", arXiv:2601.05242 (normalise each reward, sum).

Reference code read for ``grpo`` and ``dr_grpo``: TRL ``trl/trainer/grpo_trainer.py`` L2680-2707 and ``nanstd`` in
``trl/trainer/utils.py`` (huggingface/trl@f2cd577), verl ``compute_grpo_outcome_advantage`` in
``verl/trainer/ppo/core_algos.py`` L267-331 (volcengine/verl@b178a3c).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import torch
from torch import Tensor

from mmrl.algos.groups import group_stats
from mmrl.registry import Range, Registry

# Filled by this module and by the entry-point group (the dLLM plugin's wd1 arrives there, as a third party's would).
advantage_estimators: Registry[Callable[..., Tensor]] = Registry("advantage estimator",
                                                                entry_point_group="mmrl.advantage_estimators")

# eps >= 0: a negative eps can cancel a group's std (a division by zero) or flip the sign of its advantages.
EPS = Range(0)


def _check(rewards: Tensor, group_ids: Tensor) -> None:
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"advantage estimators take rewards [N] and group_ids [N]; got {tuple(rewards.shape)} "
            f"and {tuple(group_ids.shape)}"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("advantage estimators need finite rewards; drop or reject non-finite rewards first")


def _scaled(centered: Tensor, std: Tensor, eps: float) -> Tensor:
    """centered / (std + eps), and exactly 0 where there is no spread (so eps = 0 never divides 0 by 0)."""
    return torch.where(std > 0, centered / (std + eps), torch.zeros_like(centered))


@advantage_estimators.register("grpo")
def grpo_advantages(rewards: Tensor, group_ids: Tensor, *, eps: Annotated[float, EPS] = 1e-6) -> Tensor:
    """GRPO: (r − group mean) / (group std + eps), with the unbiased (Bessel-corrected) std.

    Matches TRL (``scale_rewards="group"``; grpo_trainer.py L2690-2707 at huggingface/trl@f2cd577, Bessel-corrected
    ``nanstd``) and verl (``adv_estimator=grpo``; core_algos.py L309-325 at volcengine/verl@b178a3c, ``torch.std``)
    for groups of two or more. Where they differ from each other or from mmrl:

    - A group of one sample: verl sets its mean to 0 and std to 1, so the advantage is the raw reward (L314-316);
      TRL requires at least two generations. mmrl gives 0: one sample has nothing to be compared with, and a raw
      reward would enter the loss on another scale than its batch-mates' normalised advantages.
    - A group with no spread gets exactly 0 here (float64 statistics and an explicit zero); TRL (float32) and verl
      get 0 up to rounding of the mean.

    Shao et al. 2024, arXiv:2402.03300, eq. (3).

    Args:
        eps: Added to the std so that groups with almost no spread do not explode, >= 0 (verl: 1e-6, TRL: 1e-4).

    Shapes:
        rewards ``[N]``, group_ids ``[N]`` → advantages ``[N]``.
    """
    _check(rewards, group_ids)
    _, mean, std = group_stats(rewards, group_ids)  # [N] each, float64
    return _scaled(rewards.to(torch.float64) - mean, std, eps).to(rewards.dtype)


@advantage_estimators.register("dr_grpo")
def dr_grpo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr.GRPO: r − group mean, without dividing by the std (removes the question-difficulty bias).

    Liu et al. 2025, arXiv:2503.20783, §3.1; ``compute_monte_carlo_advantages`` in ``train_zero_math.py`` L294-300
    at sail-sg/understand-r1-zero@dfca49d. TRL ``scale_rewards="none"``.

    Shapes:
        rewards ``[N]``, group_ids ``[N]`` → advantages ``[N]``.
    """
    _check(rewards, group_ids)
    _, mean, _ = group_stats(rewards, group_ids)
    return (rewards.to(torch.float64) - mean).to(rewards.dtype)


@advantage_estimators.register("rloo")
def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO: r minus the mean of the *other* samples of its group (leave-one-out baseline).

    A_i = r_i − (Σ_{j≠i} r_j)/(G−1) = G/(G−1)·(r_i − mean). Ahmadian et al. 2024, arXiv:2402.14740; verl's
    ``compute_rloo_outcome_advantage`` computes the same G/(G−1) form (``verl/trainer/ppo/core_algos.py`` L511-524 at
    volcengine/verl@b178a3c). A group of one sample has no other member and gets 0 (verl: its raw reward, as for
    ``grpo``).

    Shapes:
        rewards ``[N]``, group_ids ``[N]`` → advantages ``[N]``.
    """
    _check(rewards, group_ids)
    count, mean, _ = group_stats(rewards, group_ids)
    rewards64 = rewards.to(torch.float64)
    others_mean = (mean * count - rewards64) / (count - 1).clamp(min=1)  # [N]
    advantages = torch.where(count > 1, rewards64 - others_mean, torch.zeros_like(rewards64))
    return advantages.to(rewards.dtype)


@advantage_estimators.register("batch_std")
def batch_std_advantages(rewards: Tensor, group_ids: Tensor, *, eps: Annotated[float, EPS] = 1e-4) -> Tensor:
    """Per-group mean, population std over the whole batch: (r − group mean) / (std_batch + eps).

    Flow-GRPO's per-prompt stat tracker with ``global_std=True`` (Liu et al. 2025, arXiv:2505.05470); TRL
    ``scale_rewards="batch"`` uses the same idea.

    Args:
        eps: Added to the batch std, >= 0 (Flow-GRPO: 1e-4).

    Shapes:
        rewards ``[N]``, group_ids ``[N]`` → advantages ``[N]``.
    """
    _check(rewards, group_ids)
    _, mean, _ = group_stats(rewards, group_ids)
    rewards64 = rewards.to(torch.float64)
    batch_std = rewards64.std(unbiased=False).expand_as(rewards64)  # population std, as np.std in the reference code
    return _scaled(rewards64 - mean, batch_std, eps).to(rewards.dtype)


MULTI_REWARD_ORDERS = ("sum_then_normalize", "normalize_then_sum")


def multi_reward_advantages(
    rewards: Tensor,
    weights: Tensor,
    group_ids: Tensor,
    estimator: Callable[..., Tensor],
    *,
    order: str = "sum_then_normalize",
    whiten_eps: float = 1e-4,
    **estimator_options,
) -> tuple[Tensor, Tensor]:
    """Advantages from K reward functions, in either order of weighting and normalising.

    - ``"sum_then_normalize"``: R = Σ_k w_k·r_k, then ``estimator(R)`` (TRL's default).
    - ``"normalize_then_sum"`` (GDPO, arXiv:2601.05242): A_k = ``estimator(r_k)`` per reward,
      S = Σ_k w_k·A_k, then whitened over the batch: (S − mean S)/(std S + eps), with the Bessel-corrected std and
      eps = 1e-4 as GDPO's released code (``trl-GDPO/trl-0.18.0-gdpo/trl/trainer/grpo_trainer.py`` L1222-1246 at
      NVlabs/GDPO@b080e63) and TRL's ``multi_objective_aggregation="normalize_then_sum"`` (``grpo_trainer.py``
      L2710-2720 at huggingface/trl@f2cd577) whiten it. Both normalise each reward with GRPO's group statistics
      (Bessel std + 1e-4): ``advantage: {name: grpo, eps: 1.0e-4}`` reproduces them exactly. Normalising each reward
      first keeps distinct reward combinations from collapsing onto the same advantage.

    Args:
        rewards: ``[N, K]`` one column per reward function.
        weights: ``[K]`` weight of each reward function.
        group_ids: ``[N]``.
        estimator: An entry of :data:`advantage_estimators`.
        order: One of ``MULTI_REWARD_ORDERS``.
        whiten_eps: eps of the final batch whitening in ``normalize_then_sum``.
        estimator_options: Passed to ``estimator``.

    Returns:
        ``(advantages[N], combined_reward[N])``; the combined reward is the weighted sum Σ_k w_k·r_k (logged).
    """
    if rewards.dim() != 2 or weights.shape != (rewards.shape[1],):
        raise ValueError(f"rewards must be [N, K] and weights [K]; got {tuple(rewards.shape)}, {tuple(weights.shape)}")
    weights = weights.to(rewards.dtype)
    combined = rewards @ weights  # [N]
    if order == "sum_then_normalize":
        return estimator(combined, group_ids, **estimator_options), combined
    if order == "normalize_then_sum":
        per_reward = torch.stack(
            [estimator(rewards[:, k], group_ids, **estimator_options) for k in range(rewards.shape[1])], dim=1
        )  # [N, K]
        summed = (per_reward.to(torch.float64) @ weights.to(torch.float64))  # [N]
        if summed.numel() < 2:
            return summed.to(rewards.dtype), combined
        whitened = (summed - summed.mean()) / (summed.std() + whiten_eps)  # Bessel-corrected, as GDPO and TRL
        return whitened.to(rewards.dtype), combined
    raise ValueError(f"multi-reward order must be one of {MULTI_REWARD_ORDERS}, got {order!r}")
