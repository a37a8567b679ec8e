"""Covariance-based entropy control: the policy losses ``clip_cov`` and ``kl_cov``.

Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models", arXiv:2505.22617
(entropy falls as the covariance between an action's log-probability and its advantage stays positive, so both
methods restrain the few actions of highest covariance). Released code: the authors' PRIME-RL/Entropy-Mechanism-of-RL
@8850579 (``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_kl_cov`` L426-467, ``compute_policy_loss_clip_cov``
L469-518; recipes ``recipe/dapo/{7b,32b}_{clip_cov,kl_cov}.sh``), merged into verl as ``loss_mode: clip_cov`` /
``kl_cov`` (volcengine/verl@b178a3c ``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_clip_cov``
L1450-1554, ``compute_policy_loss_kl_cov`` L1555-1634; defaults ``verl/trainer/config/actor/actor.yaml`` L55-76).

Both score every active action (``mask > 0``) of one call by its centred covariance term::

    Cov_{i,t} = (A_{i,t} − mean A)·(log π_{i,t} − mean log π)      (means over the call's active actions)

Per-sample advantages ``[N]`` are broadcast to every action first, so ``mean A`` is token-weighted, as verl's
per-token advantages. The statistics are those of the call, as upstream computes them per micro-batch on each GPU
(no all-reduce): mmrl's learner calls a loss once per micro-batch of ``algorithm.micro_batch_size`` rows on each
process (``algorithm.action_chunk_size``, which would show it a few columns at a time, is refused: each loss sets
``needs_whole_micro_batch``), so the same rows per micro-batch give
the same statistics as verl with ``use_dynamic_bsz=False`` and ``ppo_micro_batch_size_per_gpu``. The authors' recipes
pack micro-batches by tokens instead (``use_dynamic_bsz=True``, ``ppo_max_token_len_per_gpu`` 20480, 30720 in
``7b_kl_cov.sh``; their ``dp_actor.py`` L349-351 then ignores ``ppo_micro_batch_size_per_gpu=8``), which a fixed row
count only approximates. The selections are not invariant to the micro-batch size or the number of processes,
upstream's no more than mmrl's. The means here are exact; verl's clip_cov divides by the mask's sum + 1e-8
(``verl_F.masked_mean``), a relative difference of 1e-8/n that moves an action across ``clip_cov_lb`` or
``clip_cov_ub`` only at the boundary itself.

Aggregation: ``token_mean`` (the recipes' ``loss_agg_mode``) divides the step's summed loss by the step's active
actions on every process, as verl's engine workers do (``global_batch_info``, ``verl/workers/utils/losses.py``
L103-106). verl's FSDP ``dp_actor.py`` (L575-578, L652-656) and the authors' (L449-453) take each micro-batch's own
token mean and weight it by 1/(micro-batches) or by its share of the mini-batch's rows: the same only where every
micro-batch holds as many active actions per row.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import torch
from torch import Tensor

from mmrl.algos.policy_losses import (
    CLIP_HIGH,
    DUAL_CLIP,
    _ratio_metrics,
    broadcast_advantages,
    masked_mean,
    policy_losses,
)
from mmrl.algos.ratios import log_ratio
from mmrl.registry import ANY_FINITE, Range

# clip_cov's lower clip ε_low may reach 1: the bound 1 − ε_low = 0 never binds (ratios are positive), which is how the
# authors' recipes switch the lower clip off (clip_ratio_low=1). The selected share r of the active actions must be
# positive (verl asserts it) and at most 1 (kl_cov's top-k cannot take more actions than there are). The KL-Cov
# penalty coefficient β >= 0 (0 gives the plain policy gradient).
COV_CLIP_LOW = Range(0, 1)
COV_RATIO = Range(0, 1, low_open=True)
COV_KL_COEF = Range(0)


def covariance(logp: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """The centred covariance term of every action, ``(A − mean A)·(log π − mean log π)``, the means taken over the
    active actions (``mask > 0``) only, without gradient. Padding gets 0 and never enters a mean (a NaN pad stays out).

    Shapes:
        logp, advantages, mask ``[N, A]`` → ``[N, A]``.
    """
    with torch.no_grad():
        active = mask > 0  # [N, A]
        count = active.sum().clamp(min=1)
        adv = torch.where(active, advantages.detach(), 0.0)  # [N, A]
        logp = torch.where(active, logp.detach(), 0.0)  # [N, A]
        centred_adv = adv - adv.sum() / count  # [N, A]
        centred_logp = logp - logp.sum() / count  # [N, A]
        return torch.where(active, centred_adv * centred_logp, 0.0)


@policy_losses.register("clip_cov")
def clip_cov_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    generator: torch.Generator,
    *,
    clip_low: Annotated[float, COV_CLIP_LOW] = 0.2,
    clip_high: Annotated[float, CLIP_HIGH] = 0.2,
    dual_clip: Annotated[float, DUAL_CLIP] | None = None,
    clip_cov_ratio: Annotated[float, COV_RATIO] = 2e-4,
    clip_cov_lb: Annotated[float, ANY_FINITE] = 1.0,
    clip_cov_ub: Annotated[float, ANY_FINITE] = 5.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov: PPO-clip, minus the loss of a few random actions whose covariance lies in (lb, ub).

    Cui et al. 2025, arXiv:2505.22617 (Clip-Cov); verl ``compute_policy_loss_clip_cov``
    (``verl/trainer/ppo/core_algos.py`` L1450-1554 at volcengine/verl@b178a3c), the same computation as the authors'
    (PRIME-RL/Entropy-Mechanism-of-RL@8850579, same file, L469-518). With r = exp(log π − log π_old)::

        L_ppo = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))        (then min(·, −c·A) where A < 0 with dual clip c)
        C     = {active t : PPO did not clip t, lb < Cov_t < ub}    (Cov: see the module docstring)
        D     = the first max(⌊ratio·n⌋, 1) members of C in a uniform random order (all of C if fewer)
        L_t   = 0 for t in D, L_ppo,t otherwise

    n is the number of active actions of the call. An action of D loses its loss value *and* its gradient (verl
    multiplies by 0, ``corr``); it still counts in the aggregation's denominators, as upstream. Actions PPO already
    clipped (−A·clip(r) > −A·r, which carry no gradient) are never drawn, so the budget goes to actions that would
    move. The paper writes Clip-Cov on the unclipped surrogate −A·r; both codes keep PPO's clip, and the authors'
    recipes widen it to [0, 2] (``clip_ratio_low=1``, ``clip_ratio_high=1``): ``clip_low: 1.0, clip_high: 1.0``.

    Neither verl's clip_cov nor the authors' applies a dual clip (the recipes' ``clip_ratio_c=10`` reaches no loss in
    the authors' code, whose vanilla loss has its dual clip commented out, core_algos.py L417-421, and only the
    vanilla loss in verl): ``dual_clip: null``, the default, reproduces them. With ``dual_clip`` set (an mmrl option,
    as in ``grpo``) the actions the cap −c·A binds also carry no gradient and are left out of C like PPO's clipped
    ones. mmrl clamps log r to ±20 (:mod:`mmrl.algos.ratios`, every loss); verl does not: this changes a value only
    where a ratio leaves [e^−20, e^20].

    Randomness: upstream draws ``torch.randperm`` from the process's global RNG. mmrl's trainer seeds that stream at
    start-up and its checkpoints hold it (Accelerate's ``save_state``), but it is shared: dropout in a training
    forward, a plugin that draws without a generator and any other global draw consume it, so which actions a call
    detaches would shift whenever anything else in the run changes. This loss instead declares ``generator``, a
    ``torch.Generator`` the learner passes for each call, seeded from ``(run.seed, step, inner epoch, mini-batch,
    first row of the micro-batch, first column of the chunk, process)``
    (:meth:`mmrl.trainer.learn.Learner.loss_generator`): the draw is a function of the run's seed and of where the
    call sits only, so a run repeats and a resumed run draws exactly what it would have. It is consumed by
    one ``randperm(|C|)`` per call with at least one candidate (none otherwise), on the generator's device (the
    learner's is a CPU generator, so the draws do not depend on the accelerator). The candidates are ordered
    row-major (``nonzero``), as upstream.

    Metrics besides the ratio statistics: ``clip_fraction``, ``clip_fraction_low``, ``clip_fraction_high`` (PPO's,
    as ``grpo``), ``dual_clip_fraction`` with a dual clip, ``cov_detached_fraction`` (|D|/n: what verl logs as
    ``pg_clipfrac`` for this loss) and ``cov_candidate_fraction`` (|C|/n).

    Args:
        clip_low: ε_low in [0, 1], the ratio's lower bound 1 − ε_low; 1 switches it off (verl's ``clip_ratio_low``,
            0.2; the authors' recipes 1).
        clip_high: ε_high >= 0, the ratio's upper bound 1 + ε_high (verl's ``clip_ratio_high``, 0.2; the recipes 1).
        dual_clip: c > 1 caps the loss of negative-advantage actions at −c·A; null (upstream's clip_cov) disables.
        clip_cov_ratio: The share in (0, 1] of the call's active actions whose gradient is detached, at least one
            (verl's ``clip_cov_ratio`` and the recipes: 2e-4).
        clip_cov_lb: The covariance's open lower bound (verl's ``clip_cov_lb`` and the recipes: 1.0).
        clip_cov_ub: The covariance's open upper bound, above ``clip_cov_lb`` (verl's ``clip_cov_ub``, recipes: 5.0).

    Shapes:
        logp, old_logp, mask ``[N, A]``; advantages ``[N]`` or ``[N, A]`` → loss ``[N, A]``.
    """
    _check_clip_cov(clip_low, clip_high, dual_clip, clip_cov_ratio, clip_cov_lb, clip_cov_ub)
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"policy_loss clip_cov needs generator, a torch.Generator (the learner passes one seeded from "
                         f"the run's seed), got {type(generator).__name__}")
    log_r = log_ratio(logp, old_logp, mask)  # [N, A]
    ratio = log_r.exp()  # [N, A]
    adv = broadcast_advantages(advantages, logp).to(ratio.dtype)  # [N, A]
    unclipped = -adv * ratio  # [N, A]
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [N, A]
    loss = torch.maximum(unclipped, clipped)  # [N, A]
    active = mask > 0  # [N, A]
    with torch.no_grad():
        low = (adv < 0) & (ratio < 1.0 - clip_low)  # [N, A]
        high = (adv > 0) & (ratio > 1.0 + clip_high)  # [N, A]
        fractions = {"clip_fraction": low | high, "clip_fraction_low": low, "clip_fraction_high": high}
        frozen = clipped > unclipped  # [N, A] upstream's clip_by_origin: the clip took the gradient away
    if dual_clip is not None:
        cap = -dual_clip * adv  # [N, A]
        negative = adv < 0
        with torch.no_grad():
            capped = negative & (loss > cap)  # [N, A]
            fractions["dual_clip_fraction"] = capped
            frozen = frozen | capped
        loss = torch.where(negative, torch.minimum(loss, cap), loss)
    with torch.no_grad():
        cov = covariance(logp, adv, mask)  # [N, A]
        candidates = active & ~frozen & (cov > clip_cov_lb) & (cov < clip_cov_ub)  # [N, A]
        flat = torch.nonzero(candidates.flatten()).squeeze(1)  # [|C|] row-major, as upstream's nonzero
        # Python floats in upstream's order, int(ratio · n): the same count to the last bit.
        budget = max(int(clip_cov_ratio * float(active.sum().item())), 1)
        detached = torch.zeros_like(candidates)  # [N, A]
        if flat.numel() > 0:
            order = torch.randperm(flat.numel(), generator=generator, device=generator.device)  # [|C|]
            chosen = flat[order[:budget].to(flat.device)]  # [min(budget, |C|)]
            detached.view(-1)[chosen] = True
        fractions["cov_detached_fraction"] = detached
        fractions["cov_candidate_fraction"] = candidates
    loss = loss.masked_fill(detached, 0.0)  # value and gradient 0, as upstream's `* corr`
    return loss, _ratio_metrics(log_r, mask, fractions, ratio=ratio)


def _check_clip_cov(clip_low: float, clip_high: float, dual_clip: float | None, clip_cov_ratio: float,
                    clip_cov_lb: float, clip_cov_ub: float) -> None:
    """One-line refusals of clip_cov's options for direct calls (the config checks them when it loads)."""
    if not 0 <= clip_low <= 1:
        raise ValueError(f"clip_cov clip_low must be in [0, 1] (1: no lower bound), got {clip_low}")
    if not 0 <= clip_high < math.inf:
        raise ValueError(f"clip_cov clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and not 1 < dual_clip < math.inf:
        raise ValueError(f"clip_cov dual_clip must be > 1 (it caps the loss at -c*A) or null, got {dual_clip}")
    if not 0 < clip_cov_ratio <= 1:
        raise ValueError(f"clip_cov clip_cov_ratio must be in (0, 1] (a share of the active actions), got "
                         f"{clip_cov_ratio}")
    if not (math.isfinite(clip_cov_lb) and math.isfinite(clip_cov_ub) and clip_cov_lb < clip_cov_ub):
        raise ValueError(f"clip_cov needs finite clip_cov_lb < clip_cov_ub (an open covariance interval), got "
                         f"{clip_cov_lb}, {clip_cov_ub}")


def _bind_clip_cov_bounds(options: dict[str, Any], key: str) -> dict[str, Any]:
    """Config-load check of the pair (each bound alone is any finite number): the interval must not be empty."""
    from mmrl.config import ConfigError

    low = options.get("clip_cov_lb", 1.0)
    high = options.get("clip_cov_ub", 5.0)
    if not low < high:
        raise ConfigError(f"{key}.clip_cov_ub", high, f"a number > clip_cov_lb ({low})")
    return options


clip_cov_policy_loss.bind_nested_options = _bind_clip_cov_bounds  # type: ignore[attr-defined]


@policy_losses.register("kl_cov")
def kl_cov_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    kl_cov_ratio: Annotated[float, COV_RATIO] = 2e-4,
    ppo_kl_coef: Annotated[float, COV_KL_COEF] = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov: the unclipped surrogate −A·r, plus β·|log r| on the actions of highest covariance.

    Cui et al. 2025, arXiv:2505.22617 (KL-Cov); verl ``compute_policy_loss_kl_cov``
    (``verl/trainer/ppo/core_algos.py`` L1555-1634 at volcengine/verl@b178a3c) and the authors'
    (PRIME-RL/Entropy-Mechanism-of-RL@8850579, same file, L426-467). With r = exp(log π − log π_old), n the
    call's active actions and k = max(⌊n·ratio⌋, 1)::

        K   = the k active actions of largest Cov (see the module docstring)
        L_t = −A·r + β·|log r|  for t in K,      −A·r  otherwise

    No clip: the KL term restrains K instead (verl and the authors read no clip range in this loss, though the
    recipes set one). The paper writes the penalty as a KL divergence between the old and current policy at the
    token; both codes use |log π − log π_old|, as here. On-policy (r = 1) the value is −A and the gradient the plain
    policy gradient −A·∇log π (|x| has zero derivative at 0 in torch). Covariances are computed without gradient.

    Selection as verl: k = max(int(n·ratio), 1) and the k largest by ``torch.topk`` over the active actions (none
    when there are no active actions). The authors' code takes ``k_percent`` in percent, ⌊n·k_percent/100⌋:
    ``k_percent=0.2`` (their 7B recipe) is ``kl_cov_ratio: 2e-3``, 0.02 (32B) is 2e-4, verl's default. Ties at the
    k-th covariance (tokens of one sequence with equal log-probs, e.g. exactly 0) go to the earliest actions in
    row-major order (a stable sort): ``torch.topk``'s choice among ties, upstream's, is unspecified.

    Defaults: ``kl_cov_ratio`` 2e-4 (verl's ``kl_cov_ratio``; the authors' 32B recipe) and ``ppo_kl_coef`` 1.0 (the
    authors' recipes, and verl's fallback for an explicit null; verl's ``actor.yaml`` and ``PolicyLossConfig``,
    ``verl/workers/config/actor.py`` L80, default to 0.1). mmrl clamps log r to ±20 (:mod:`mmrl.algos.ratios`);
    upstream does not. Aggregate with ``token_mean``, the recipes' ``loss_agg_mode`` (see the module docstring).

    Metrics besides the ratio statistics: ``kl_cov_fraction`` (k/n, the penalised share) and ``abs_log_ratio_mean``
    (the mean |log r| over the active actions: what verl logs as ``ppo_kl`` for this loss).

    Args:
        kl_cov_ratio: The share in (0, 1] of the call's active actions that get the penalty, at least one (verl's
            ``kl_cov_ratio``; the authors' ``k_percent`` / 100).
        ppo_kl_coef: β >= 0, the penalty's coefficient (the recipes: 1; verl's config: 0.1).

    Shapes:
        logp, old_logp, mask ``[N, A]``; advantages ``[N]`` or ``[N, A]`` → loss ``[N, A]``.
    """
    if not 0 < kl_cov_ratio <= 1:
        raise ValueError(f"kl_cov kl_cov_ratio must be in (0, 1] (a share of the active actions), got {kl_cov_ratio}")
    if not 0 <= ppo_kl_coef < math.inf:
        raise ValueError(f"kl_cov ppo_kl_coef must be >= 0, got {ppo_kl_coef}")
    log_r = log_ratio(logp, old_logp, mask)  # [N, A]
    ratio = log_r.exp()  # [N, A]
    adv = broadcast_advantages(advantages, logp).to(ratio.dtype)  # [N, A]
    active = mask > 0  # [N, A]
    with torch.no_grad():
        count = int(active.sum().item())
        selected = torch.zeros_like(active)  # [N, A]
        if count > 0:
            cov = covariance(logp, adv, mask)  # [N, A]
            flat = torch.nonzero(active.flatten()).squeeze(1)  # [n] row-major
            k = max(int(count * kl_cov_ratio), 1)
            order = torch.sort(cov.flatten()[flat], descending=True, stable=True).indices  # [n]
            selected.view(-1)[flat[order[:k]]] = True
    penalty = ppo_kl_coef * log_r.abs()  # [N, A]
    loss = -adv * ratio + torch.where(selected, penalty, 0.0)  # [N, A]
    metrics = _ratio_metrics(log_r, mask, {"kl_cov_fraction": selected}, ratio=ratio)
    metrics["abs_log_ratio_mean"] = masked_mean(log_r.abs(), mask)
    return loss, metrics


# Their statistics span the call's active actions (verl's micro-batch): the learner refuses action chunks for them
# (mmrl.trainer.learn.chunked_geometry), as for top_entropy_quantile and off_policy_mask_threshold.
clip_cov_policy_loss.needs_whole_micro_batch = True  # type: ignore[attr-defined]
kl_cov_policy_loss.needs_whole_micro_batch = True  # type: ignore[attr-defined]
