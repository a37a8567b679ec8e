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
    Pass@k — Tang et al. 2025, "Optimizing Language Models for Inference Time Objectives using Reinforcement
    Learning", arXiv:2503.19595 (leave-one-out gradient of the best-of-k reward).
    REINFORCE++-baseline — Hu et al. 2025, "REINFORCE++", arXiv:2501.03262 (group mean, then global whitening).
    GPG — Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning",
    arXiv:2504.02546.

Reference code read for ``grpo`` and ``dr_grpo``: TRL ``trl/trainer/grpo_trainer.py`` L2680-2707 and ``nanstd`` in
``trl/trainer/utils.py`` (huggingface/trl@f2cd577), verl ``compute_grpo_outcome_advantage`` in
``verl/trainer/ppo/core_algos.py`` L267-331 (volcengine/verl@b178a3c).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

import torch
from torch import Tensor

from mmrl.algos.groups import dense_group_index, group_stats, has_spread
from mmrl.registry import Range, Registry

# Filled by this module and by the entry-point group (the dLLM plugin's wd1 arrives there, as a third party's would).
advantage_estimators: Registry[Callable[..., Tensor]] = Registry("advantage estimator",
                                                                entry_point_group="mmrl.advantage_estimators")

# eps >= 0: a negative eps can cancel a group's std (a division by zero) or flip the sign of its advantages, and
# added to a variance (reinforce_pp_baseline) it can take the square root of a negative number.
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
    ``scale_rewards="batch"`` uses the same idea. The batch is the one the estimator sees: under dynamic sampling
    the trainer calls it once on the kept batch, after the filter (:mod:`mmrl.trainer.collect`), so groups without
    spread do not shrink the std.

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


@advantage_estimators.register("grpo_passk")
def grpo_passk_advantages(rewards: Tensor, group_ids: Tensor, *, norm_by_std: bool = True,
                          eps: Annotated[float, EPS] = 1e-6) -> Tensor:
    """Pass@k: only a group's best sample gets an advantage, r_max − r_second, optionally ÷ (group std + eps).

    The leave-one-out policy gradient of the best-of-G reward (Tang et al. 2025, arXiv:2503.19595, with k the group
    size): A_i = max_j r_j − max_{j≠i} r_j. Removing any sample but the best leaves the maximum unchanged, so every
    other sample gets 0 and the best gets the gap to the runner-up.

    verl ``compute_grpo_passk_outcome_advantage`` (``verl/trainer/ppo/core_algos.py`` L361-419 at
    volcengine/verl@b178a3c) takes ``torch.topk(rewards, 2)`` per group (L409-411) and writes r_max − r_second to the
    index topk reports first, divided by ``torch.std`` (Bessel) + epsilon when ``algorithm.norm_adv_by_std_in_grpo``
    (L389, L413-415; the trainer passes no epsilon, ``verl/trainer/ppo/ray_trainer.py`` L194-216, so it is 1e-6).
    mmrl computes the same numbers, with these differences:

    - Ties: mmrl applies the leave-one-out formula itself, so a maximum shared by two or more samples gives every
      member of the group 0 (removing one of them leaves the maximum in place). verl also gets 0 there (r_max =
      r_second), at whichever tied index topk happens to report, so the values agree and neither depends on the
      order of the samples.
    - A group of one sample: verl raises (L405-408); mmrl gives 0, as the other estimators.
    - A group with no spread gives exactly 0 also with eps = 0 (verl: 0/0 = NaN).

    Args:
        norm_by_std: Divide the gap by the group's unbiased std + eps (verl's ``norm_adv_by_std_in_grpo``, default
            true in both).
        eps: Added to the std, >= 0 (verl: 1e-6).

    Shapes:
        rewards ``[N]``, group_ids ``[N]`` → advantages ``[N]``.
    """
    _check(rewards, group_ids)
    index, num_groups = dense_group_index(group_ids)  # [N], K
    count, _, std = group_stats(rewards, group_ids)  # [N] each, float64
    rewards64 = rewards.to(torch.float64)
    lowest = torch.full((num_groups,), -torch.inf, dtype=torch.float64, device=rewards.device)
    best = lowest.scatter_reduce(0, index, rewards64, reduce="amax")  # [K]
    at_best = rewards64 == best[index]  # [N]
    num_best = torch.zeros(num_groups, dtype=torch.float64, device=rewards.device).index_add_(
        0, index, at_best.to(torch.float64))  # [K]
    # The runner-up among the samples strictly below the best; only read where the best is unique and the group has
    # another member, where it is finite.
    runner_up = lowest.scatter_reduce(0, index, rewards64.masked_fill(at_best, -torch.inf), reduce="amax")  # [K]
    sole_best = at_best & (num_best[index] == 1) & (count > 1)  # [N]
    gap = torch.where(sole_best, rewards64 - runner_up[index], torch.zeros_like(rewards64))  # [N]
    if norm_by_std:
        gap = _scaled(gap, std, eps)  # a nonzero gap implies std > 0
    return gap.to(rewards.dtype)


@advantage_estimators.register("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(rewards: Tensor, group_ids: Tensor, *,
                                     eps: Annotated[float, EPS] = 1e-8) -> Tensor:
    """REINFORCE++-baseline: c = r − group mean, then whitened over the batch, c / sqrt(var_batch c + eps).

    Hu et al. 2025, arXiv:2501.03262: subtract the group mean to reshape the reward, then normalise with the global
    batch's statistics. Here c_i = r_i − mean_g r (0 for a group of one sample) and

        A_i = c_i / sqrt(v + eps),   v = (1/N) Σ_j c_j²    (population variance over the N samples).

    The batch mean of c is zero by construction (each group's centred rewards sum to zero), so it is not subtracted
    again: subtracting a rounding residue would make all-equal groups nonzero.

    verl ``compute_reinforce_plus_plus_baseline_outcome_advantage`` (``verl/trainer/ppo/core_algos.py`` L425-473 at
    volcengine/verl@b178a3c) centres per group (L456-468), copies c_i onto every response token and applies
    ``masked_whiten`` with the response mask (L470-471): mean and variance over **tokens**, the variance
    Bessel-corrected over the T tokens of the batch, rsqrt(var + 1e-8) (``verl/utils/torch_functional.py``
    L287-340); its ``epsilon`` argument is unused. mmrl's estimator sees one reward per sample, so its statistics are
    **sample-weighted** where verl's are **token-weighted** (a sample of L_i tokens counts L_i times):

    - Equal lengths L (T = N·L): verl's mean is 0 too, its variance is v·T/(T − 1), so
      A_verl = sqrt((T−1)/T) · (mmrl's A with eps·(T−1)/T): they agree up to a factor 1 − 1/(2T) (tested exactly).
    - Unequal lengths: verl weights long responses more in both statistics; its mean Σ L_i c_i / T is no longer 0,
      so it shifts every advantage. mmrl does not reproduce that.
    - A group of one sample: verl keeps its raw reward as c (mean 0, L461-462); mmrl sets c = 0, as the other
      estimators, and the sample still counts in N like any all-equal group.

    The authors' code (OpenRLHF, ``openrlhf/trainer/ppo_utils/experience_maker.py`` L267-268 and L314-325 at
    OpenRLHF/OpenRLHF@3c3be62, ``reinforce_baseline``) also whitens over tokens, with the population variance (no
    Bessel correction, as mmrl) and ``var.clamp(min=1e-8)`` where verl and mmrl add eps.

    v is the variance of the batch the estimator sees. Under dynamic sampling the trainer calls it once on the kept
    batch, after the filter dropped the groups without spread (whose c is 0), as verl's DAPO recipe whitens the
    kept batch (:mod:`mmrl.trainer.collect`).

    Args:
        eps: Added to the batch variance under the square root, >= 0 (verl's ``masked_whiten``: 1e-8).

    Shapes:
        rewards ``[N]``, group_ids ``[N]`` → advantages ``[N]``.
    """
    _check(rewards, group_ids)
    _, mean, _ = group_stats(rewards, group_ids)
    rewards64 = rewards.to(torch.float64)
    # Exactly 0 in groups without spread (and groups of one), whatever the rounding of their mean.
    centered = torch.where(has_spread(rewards, group_ids), rewards64 - mean, torch.zeros_like(rewards64))  # [N]
    variance = (centered**2).mean()  # population variance about the batch mean, which is 0
    scale = (variance + eps).sqrt().expand_as(centered)  # [N]
    return torch.where(variance > 0, centered / scale, torch.zeros_like(centered)).to(rewards.dtype)


GPG_ALPHA_COUNTS = ("samples_with_spread", "nonzero_rewards")


@advantage_estimators.register("gpg")
def gpg_advantages(rewards: Tensor, group_ids: Tensor, *,
                   f_norm: Annotated[float, Range(0, low_open=True)] = 1.0,
                   alpha_count: Literal["samples_with_spread", "nonzero_rewards"] = "samples_with_spread",
                   scale_rewards: bool = False, eps: Annotated[float, EPS] = 1e-4) -> Tensor:
    """GPG: A_i = α · (r_i − group mean) / F_norm, with α = N / n correcting for samples that carry no gradient.

    Chu et al. 2025, arXiv:2504.02546 (Group Policy Gradient, "accurate gradient estimation"): a group whose samples
    all got the same reward has zero advantage and contributes nothing to the batch-mean gradient, which is then
    too small by the fraction of such samples; α = B/(B − M), M the number of those samples, rescales it. The
    authors' code computes the same fraction per group (``open-r1/src/open_r1/gpg_trainer.py`` L541-551 and
    L625-626 at AMAP-ML/GPG@e096da8: ``inverse_alpha`` = groups with std > 0 / groups) and divides the loss by it
    (L315-316); multiplying the advantages is the same for GPG's plain policy-gradient loss (mmrl's ``reinforce``).

    ``alpha_count`` chooses n:

    - ``"samples_with_spread"`` (default, the paper): the samples whose group has max > min. For equal group sizes
      this is the authors' group fraction.
    - ``"nonzero_rewards"``: the samples whose raw reward is nonzero, which is what verl computes
      (``compute_gpg_outcome_advantage``, ``verl/trainer/ppo/core_algos.py`` L697-698 at volcengine/verl@b178a3c:
      ``m = torch.count_nonzero(scores)`` on the rewards before centring, α = bsz / max(m, 1)). It depends on how
      rewards are coded: with 0/1 rewards n is the number of correct samples, with ±1 rewards α is always 1.

    n is clamped to ≥ 1 (as verl); when no group has spread every advantage is 0 anyway. verl's ``alpha`` argument
    is overwritten (L698) and ``f_norm`` is a constant divisor (L714), 1.0 since the trainer passes neither
    (``verl/trainer/ppo/ray_trainer.py`` L194-216); verl computes each group's std (L710) but never uses it, so it
    offers no std normaliser. A group of one sample gets 0 and counts as a sample without spread (verl: mean 0,
    advantage α·r).

    F_norm. The paper allows F_norm = 1 or the group std; the authors' code switches with TRL's ``scale_rewards``
    flag (``gpg_trainer.py`` L615-623 at AMAP-ML/GPG@e096da8: ``advantages / (std_grouped_rewards + 1e-4)``, the
    Bessel-corrected ``torch.std`` of the group). ``scale_rewards`` here is that flag: F_norm = (group std + eps) ·
    ``f_norm``, else ``f_norm`` alone (verl's constant; leave it at 1 to match the authors' code). The authors pin
    TRL 0.16.0 (``open-r1/setup.py`` L70), whose ``scale_rewards`` defaults to true, and most of their GPG recipes
    leave it unset (``recipes/Qwen2.5-Math-7B/grpo/config_simple_rl_gpg.yaml``) while several set it false (most
    ``*_wostd`` / ``*_nostd`` ones, ``open-rs/recipes/gpg_std.yaml``; ``config_demo_woSTD.yaml`` leaves it unset);
    mmrl keeps false as default (verl's behaviour and this estimator's earlier one). A group without spread gets
    exactly 0 either way. Their ``GPGConfig.scale_batch`` ("divide std use group or batch std",
    ``open-r1/src/open_r1/configs.py`` L60) is stored (``gpg_trainer.py`` L193) but never read, so it is not
    offered.

    α is that of the batch the estimator sees. Under dynamic sampling the trainer calls it once on the kept batch,
    after the filter (:mod:`mmrl.trainer.collect`), as verl's DAPO recipe and the authors' own resampling do (their
    ``inverse_alpha`` is min(1, groups with spread accumulated over the generation rounds / groups of a batch),
    L541-553 and L625-626): every kept group has spread, so α = 1 there with ``"samples_with_spread"`` (theirs grows
    above 1 when the rounds run out before the batch fills; mmrl's padding instead leaves the loss denominators).

    Args:
        f_norm: Constant divisor of the centred reward, > 0 (verl: 1.0).
        alpha_count: Which samples n counts in α = N / n: ``"samples_with_spread"`` (the paper) or
            ``"nonzero_rewards"`` (verl).
        scale_rewards: Divide by the group's unbiased std + eps as well (the authors' ``scale_rewards``; default
            false: verl, and the authors' ``*_wostd`` recipes).
        eps: Added to the group std with ``scale_rewards``, >= 0 (the authors' code: 1e-4).

    Shapes:
        rewards ``[N]``, group_ids ``[N]`` → advantages ``[N]``.
    """
    _check(rewards, group_ids)
    if not f_norm > 0:
        raise ValueError(f"gpg f_norm must be > 0 (it divides the advantages), got {f_norm}")
    if alpha_count not in GPG_ALPHA_COUNTS:
        raise ValueError(f"gpg alpha_count must be one of {GPG_ALPHA_COUNTS}, got {alpha_count!r}")
    _, mean, std = group_stats(rewards, group_ids)  # [N] each, float64; std Bessel-corrected as torch.std
    rewards64 = rewards.to(torch.float64)
    spread = has_spread(rewards, group_ids)  # [N] bool; False for a group of one sample
    counted = spread if alpha_count == "samples_with_spread" else rewards64 != 0  # [N]
    alpha = rewards64.numel() / counted.sum().clamp(min=1).to(torch.float64)
    centered = torch.where(spread, rewards64 - mean, torch.zeros_like(rewards64))  # [N], exactly 0 without spread
    if scale_rewards:
        centered = _scaled(centered, std, eps)  # 0 stays 0, also with eps = 0
    return (alpha * centered / f_norm).to(rewards.dtype)


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
