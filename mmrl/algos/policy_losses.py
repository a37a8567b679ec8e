"""Policy losses: ``fn(logp[N,A], old_logp[N,A], advantages[N] or [N,A], mask[N,A], **options)``.

Each returns ``(loss[N, A], metrics)``: the per-action loss *before* aggregation (see :mod:`mmrl.algos.aggregation`)
and a dict of detached scalar diagnostics, each a masked mean over the actions of this call. Losses are written to
be minimised: a positive advantage lowers the loss when the action's log-prob rises.

References:
    PPO clip — Schulman et al. 2017, arXiv:1707.06347, eq. (7).
    Clip-higher (asymmetric ε) — Yu et al. 2025, "DAPO", arXiv:2503.14476, §3.1: ε_low 0.2, ε_high 0.28.
    Dual clip — Ye et al. 2020, "Mastering Complex Control in MOBA Games", arXiv:1912.09729, eq. (5): c = 3, c > 1.
    GSPO — Zheng et al. 2025, arXiv:2507.18071: sequence ratio, ε 3e-4 / 4e-4.
    REINFORCE — Williams 1992; with a group baseline, Ahmadian et al. 2024, arXiv:2402.14740.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Annotated, Literal

import torch
from torch import Tensor

from mmrl.algos.ratios import log_ratio
from mmrl.registry import Range, Registry

# Filled by this module and by the entry-point group (the dLLM plugin's wd1 and spg arrive there, as a third party's
# would).
policy_losses: Registry[Callable[..., tuple[Tensor, dict[str, Tensor]]]] = Registry(
    "policy loss", entry_point_group="mmrl.policy_losses"
)


# The options' ranges, checked when a config loads and again by the loss for direct calls. The clip interval
# [1 − ε_low, 1 + ε_high] must hold r = 1 with a positive lower end (ratios are positive); the dual clip's cap −c·A
# of a negative advantage must lie above the on-policy loss −A (r = 1), else it cuts the plain policy gradient:
# c > 1, as Ye et al. 2020 (arXiv:1912.09729, eq. (5)) require.
CLIP_LOW = Range(0, 1, high_open=True)
CLIP_HIGH = Range(0)
DUAL_CLIP = Range(1, low_open=True)
# INTELLECT-2's two-sided clip δ caps the unclipped ratio: r = 1 (on-policy) must stay below it.
TWO_SIDED_CLIP = Range(1, low_open=True)


def reads_old_logp(loss: Callable[..., tuple[Tensor, dict[str, Tensor]]], options: dict | None = None) -> bool:
    """Whether a policy loss, called with ``options``, reads its ``old_logp`` argument.

    True unless the function's ``reads_old_logp`` attribute says otherwise: False, or a function of the options that
    returns False (the core's ``dgpo`` reads them only for its clip or the ``old`` baseline). A loss that does not
    read them (the flow plugin's ``nft``, whose old policy enters through its own columns) spares the run the
    learner's old-policy pass with ``inner_epochs`` or ``minibatches`` above 1
    (:func:`mmrl.trainer.learn.needs_old_logp`); it then gets the detached training log-probs as ``old_logp``, and
    its ratio diagnostics read 1."""
    declared = getattr(loss, "reads_old_logp", True)
    return bool(declared(dict(options or {})) if callable(declared) else declared)


def broadcast_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    """Advantages ``[N]`` (one per sample) or ``[N, A]`` (per action) → ``[N, A]``."""
    if advantages.dim() == 1 and advantages.shape[0] == like.shape[0]:
        return advantages.unsqueeze(1).expand_as(like)
    if advantages.shape == like.shape:
        return advantages
    raise ValueError(f"advantages must be [N] or [N, A] = {tuple(like.shape)}, got {tuple(advantages.shape)}")


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over ``mask`` (0 when the mask is empty), detached, as a 0-dim float32 tensor."""
    weights = mask.to(torch.float32)
    total = weights.sum()
    return ((values.detach().to(torch.float32) * weights).sum() / total.clamp(min=1.0)).detach()


@torch.no_grad()
def masked_means(values: Sequence[Tensor], mask: Tensor) -> Tensor:
    """:func:`masked_mean` of each of ``values`` (float or bool tensors shaped like ``mask``) in one stacked
    reduction: a micro-batch's diagnostics cost a handful of tensor operations instead of five each.

    Shapes:
        values: K tensors ``[N, A]``; mask ``[N, A]`` → ``[K]`` float32, detached.
    """
    weights = _as_float32(mask)  # [N, A]
    stacked = torch.stack([_as_float32(value) for value in values])  # [K, N, A]; no_grad: nothing to detach
    dims = tuple(range(1, stacked.dim()))
    return (stacked * weights).sum(dim=dims) / weights.sum().clamp(min=1.0)  # [K]


def _as_float32(value: Tensor) -> Tensor:
    """``value`` in float32, without a conversion call when it is float32 already (most diagnostics are)."""
    return value if value.dtype == torch.float32 else value.to(torch.float32)


@torch.no_grad()
def _ratio_metrics(log_r: Tensor, mask: Tensor, fractions: dict[str, Tensor] | None = None,
                   ratio: Tensor | None = None) -> dict[str, Tensor]:
    """Ratio statistics over the active actions (``mask > 0``; min and max 1 when there are none), Schulman's
    k2-style estimate of KL(π_old‖π_θ) on the sampled actions, and the masked mean of each boolean ``fractions``
    entry, from one stacked reduction (:func:`masked_means`); each value a detached 0-dim float32 tensor.
    ``ratio``: ``log_r.exp()`` when the caller has it already."""
    log_r = log_r.detach()  # [N, A]
    ratio = log_r.exp() if ratio is None else ratio.detach()  # [N, A]
    fractions = fractions or {}
    means = masked_means([ratio, 0.5 * log_r**2, *fractions.values()], mask)  # [2 + F]
    if ratio.numel():
        active = mask > 0  # [N, A]
        # min r and min(−r) = −max r over the active actions in one reduction; with none active both are +inf and
        # the extremes are 1 (min 1, −max −1).
        extremes = torch.stack([ratio.masked_fill(~active, math.inf), ratio.neg().masked_fill(~active, math.inf)])
        empty = torch.tensor([1.0, -1.0], dtype=ratio.dtype, device=ratio.device)
        low, neg_high = torch.where(active.any(), extremes.amin(dim=(1, 2)), empty).to(torch.float32).unbind()
        high = -neg_high
    else:
        low = high = torch.ones((), dtype=torch.float32, device=ratio.device)
    ratio_mean, approx_kl, *shares = means.unbind()
    return {"ratio_mean": ratio_mean, "ratio_min": low, "ratio_max": high, "approx_kl": approx_kl,
            **dict(zip(fractions, shares, strict=True))}


@policy_losses.register("grpo")
def clipped_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: Annotated[float, CLIP_LOW] = 0.2,
    clip_high: Annotated[float, CLIP_HIGH] = 0.2,
    dual_clip: Annotated[float, DUAL_CLIP] | None = None,
    delta: Annotated[float, TWO_SIDED_CLIP] | None = None,
    ratio_level: Literal["token", "chunk", "sequence"] = "token",
    chunk_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip with asymmetric bounds (DAPO clip-higher), optional dual clip and optional two-sided clip, as in GRPO.

    L = max(−A·r, −A·clip(r, 1 − clip_low, 1 + clip_high)); with ``dual_clip = c`` and A < 0 the loss is further
    capped at −c·A. On-policy (r = 1) the gradient equals the plain policy gradient −A·∇log π.

    The default (no dual clip) is TRL's ``grpo``/``dapo`` loss (``trl/trainer/grpo_trainer.py`` L3083-3090 at
    huggingface/trl@f2cd577); verl's ``compute_policy_loss_vanilla`` (``verl/trainer/ppo/core_algos.py``
    L1160-1251 at volcengine/verl@b178a3c) always applies the dual clip, at ``clip_ratio_c`` = 3 unless configured:
    ``dual_clip=3.0`` reproduces it. Its ``pg_clipfrac`` counts what ``clip_fraction`` counts here.

    Args:
        clip_low: ε_low in [0, 1), the ratio's lower bound is 1 − ε_low (PPO/GRPO: 0.2).
        clip_high: ε_high >= 0, the ratio's upper bound is 1 + ε_high (DAPO clip-higher: 0.28).
        dual_clip: c > 1 caps the loss of negative-advantage actions at −c·A (Ye et al. 2020: 3.0); None disables.
        delta: δ > 1, INTELLECT-2's two-sided clip (Prime Intellect 2025, arXiv:2505.07291; TRL's ``delta``,
            ``trl/trainer/grpo_trainer.py`` L3085-3087 at huggingface/trl@f2cd577): the unclipped branch's ratio is
            capped, min(r, δ), so L = max(−A·min(r, δ), −A·clip(r)). For A < 0 the loss of a ratio past δ stops at
            −A·δ with no gradient (without it, the unclipped branch grows with r without bound); for A > 0 nothing
            changes when δ >= 1 + ε_high (TRL recommends δ > 1 + ε). None disables (TRL's default).
        ratio_level: "token", "chunk" (needs chunk ids from the rollout) or "sequence" (GSPO).

    Shapes:
        logp, old_logp, mask ``[N, A]``; advantages ``[N]`` or ``[N, A]`` → loss ``[N, A]``.
    """
    if clip_low < 0 or clip_low >= 1 or clip_high < 0:
        raise ValueError(f"clip_low must be in [0, 1) and clip_high >= 0; got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (it caps the loss at -c*A), got {dual_clip}")
    if delta is not None and not 1 < delta < math.inf:
        raise ValueError(f"delta must be > 1 (it caps the unclipped ratio; r = 1 must stay below it), got {delta}")
    log_r = log_ratio(logp, old_logp, mask, level=ratio_level, chunk_ids=chunk_ids)  # [N, A]
    ratio = log_r.exp()  # [N, A]
    adv = broadcast_advantages(advantages, logp).to(ratio.dtype)  # [N, A]
    neg_adv = -adv  # [N, A]
    # the clipped branch from the uncapped ratio, as TRL computes coef_2 before capping coef_1
    capped = ratio if delta is None else ratio.clamp(max=delta)  # [N, A]
    loss = torch.maximum(neg_adv * capped, neg_adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))  # [N, A]
    with torch.no_grad():
        low = (adv < 0) & (ratio < 1.0 - clip_low)  # [N, A]
        high = (adv > 0) & (ratio > 1.0 + clip_high)  # [N, A]
        fractions = {"clip_fraction": low | high, "clip_fraction_low": low, "clip_fraction_high": high}
        if delta is not None:
            fractions["two_sided_clip_fraction"] = (adv < 0) & (ratio > delta)  # [N, A]
    if dual_clip is not None:
        cap = -dual_clip * adv  # [N, A]
        negative = adv < 0
        with torch.no_grad():
            fractions["dual_clip_fraction"] = negative & (loss > cap)
        loss = torch.where(negative, torch.minimum(loss, cap), loss)
    return loss, _ratio_metrics(log_r, mask, fractions, ratio=ratio)


@policy_losses.register("gspo")
def gspo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: Annotated[float, CLIP_LOW] = 3e-4,
    clip_high: Annotated[float, CLIP_HIGH] = 4e-4,
    dual_clip: Annotated[float, DUAL_CLIP] | None = None,
    delta: Annotated[float, TWO_SIDED_CLIP] | None = None,
    ratio_level: Literal["token", "chunk", "sequence"] = "sequence",
    chunk_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: PPO-clip on the sequence ratio s_i = exp(masked mean of log(π_θ/π_old)).

    Zheng et al. 2025, arXiv:2507.18071. Aggregate with ``seq_mean_token_mean`` to reproduce the paper's
    sequence-level objective exactly (every action carries its sequence's loss). ``ratio_level="chunk"`` gives
    Chunk-GRPO's per-chunk geometric-mean ratio (arXiv:2510.21583).

    Args:
        clip_low: ε_low in [0, 1) on the sequence ratio (paper: 3e-4).
        clip_high: ε_high >= 0 on the sequence ratio (paper: 4e-4).
        dual_clip: Optional dual clip c > 1; None disables.
        delta: Optional two-sided clip δ > 1 on the sequence ratio (TRL applies its ``delta`` to every clipped
            loss type, GSPO's included); None disables.
        ratio_level: "sequence" (GSPO), "chunk" or "token".

    Shapes:
        logp, old_logp, mask ``[N, A]``; advantages ``[N]`` or ``[N, A]`` → loss ``[N, A]``.
    """
    return clipped_policy_loss(
        logp,
        old_logp,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        delta=delta,
        ratio_level=ratio_level,
        chunk_ids=chunk_ids,
    )


@policy_losses.register("reinforce")
def reinforce_policy_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE with the group baseline: L = −A·log π, no importance ratio and no clipping.

    Williams 1992; group-baseline form as in Ahmadian et al. 2024, arXiv:2402.14740. ``old_logp`` only feeds
    the diagnostics (approx-KL, ratio statistics); it does not enter the loss.

    Shapes:
        logp, old_logp, mask ``[N, A]``; advantages ``[N]`` or ``[N, A]`` → loss ``[N, A]``.
    """
    adv = broadcast_advantages(advantages, logp).to(logp.dtype)
    loss = -adv * logp  # [N, A]
    metrics = _ratio_metrics(log_ratio(logp.detach(), old_logp, mask), mask)
    return loss, metrics


# CISPO truncates its importance weight to [1 − ε_low, 1 + ε_high] with CLIP_LOW and CLIP_HIGH: both keep r = 1
# inside, so the on-policy weight is 1 (a cap below 1, as TRL's with `epsilon_high` unset, would scale even the
# on-policy gradient down). SAPO's gate is scaled by 4/τ: τ > 0. GMPO's bounds are on the log-ratio, [−ε_low, ε_high]
# holds 0 (r = 1) for any ε >= 0 and the ratio bounds e^(±ε) stay positive.
SAPO_TEMPERATURE = Range(0, low_open=True)
GMPO_CLIP = Range(0)


@policy_losses.register("cispo")
def cispo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: Annotated[float, CLIP_LOW] | None = None,
    clip_high: Annotated[float, CLIP_HIGH] = 4.0,
    ratio_level: Literal["token", "chunk", "sequence"] = "token",
    chunk_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE weighted by the truncated importance ratio, L = −sg(clip(r, 1 − ε_low, 1 + ε_high))·A·log π.

    MiniMax 2025, "MiniMax-M1", arXiv:2506.13585 (the CISPO objective); the loss of ScaleRL, Khatri et al. 2025,
    arXiv:2510.13786. Unlike PPO-clip, no action loses its gradient: the ratio is truncated and detached (sg), so it
    only scales the REINFORCE gradient −A·∇log π of every action, by a weight in [1 − ε_low, 1 + ε_high]. On-policy
    (r = 1) the weight is 1: the value and the gradient are REINFORCE's, −A·log π and −A·∇log π.

    The libraries clip differently:

    - TRL ``loss_type="cispo"`` (``trl/trainer/grpo_trainer.py`` L3080-3082 at huggingface/trl@f2cd577) caps the
      ratio from above at ``epsilon_high`` itself, min(r, ε_max), with no lower bound; TRL recommends ScaleRL's
      ε_max = 5.0 (``trl/trainer/grpo_config.py`` L191-195): ``clip_low: null, clip_high: 4.0``, the defaults here.
      TRL with ``epsilon_high`` unset caps at ``epsilon`` (0.2), a weight of 0.2 even on-policy; mmrl has no cap
      below 1 (``clip_high >= 0``).
    - verl ``compute_policy_loss_cispo`` (``verl/trainer/ppo/core_algos.py`` L1721-1779 at volcengine/verl@b178a3c)
      clamps to [1 − ``clip_ratio_low``, 1 + ``clip_ratio_high``], 0.2 each unless configured: ``clip_low: 0.2,
      clip_high: 0.2``. Its example (``examples/cispo_trainer/run_cispo_qwen2_5_0_5b_gsm8k.sh``) sets
      ``clip_ratio_low=10``, a lower bound below 0 that never binds: ``clip_low: null, clip_high: 0.2``.

    MiniMax-M1 likewise leaves the lower bound off (a large ε_low) and tunes ε_high only. Aggregate with
    ``token_mean``, as MiniMax-M1 (normalised by the batch's tokens), TRL's cispo (the step's token count,
    L3139-3142) and verl's default ``token-mean``. ``ratio_level`` as TRL's ``importance_sampling_level`` (verl:
    token only); log r is clamped to ±20 (:mod:`mmrl.algos.ratios`), as verl does.

    Metrics besides the ratio statistics: ``clip_fraction_low`` / ``clip_fraction_high``, the actions whose weight
    was truncated at the lower / upper bound whatever the advantage's sign (the weight of both signs is truncated:
    verl's ``pg_clipfrac`` counts both, TRL's ``cispo_clip_ratio`` only r > ε_max with A > 0, L3254-3256);
    ``clip_fraction`` their union; ``is_weight_mean``, the mean truncated weight.

    Args:
        clip_low: ε_low in [0, 1), the weight's lower bound 1 − ε_low; null: no lower bound (MiniMax-M1, TRL).
        clip_high: ε_high >= 0, the weight's cap 1 + ε_high (TRL's ``epsilon_high`` minus 1; ScaleRL: 4.0).
        ratio_level: "token" (MiniMax-M1), "chunk" (needs chunk ids from the rollout) or "sequence".

    Shapes:
        logp, old_logp, mask ``[N, A]``; advantages ``[N]`` or ``[N, A]`` → loss ``[N, A]``.
    """
    if clip_low is not None and not 0 <= clip_low < 1:
        raise ValueError(f"cispo clip_low must be in [0, 1) or null (no lower bound), got {clip_low}")
    if not 0 <= clip_high < math.inf:
        raise ValueError(f"cispo clip_high must be >= 0 (the weight's cap is 1 + clip_high), got {clip_high}")
    # The ratio of the detached log-probs: the weight is a constant of the loss, the stop-gradient sg of CISPO.
    log_r = log_ratio(logp.detach(), old_logp, mask, level=ratio_level, chunk_ids=chunk_ids)  # [N, A]
    ratio = log_r.exp()  # [N, A]
    weight = ratio.clamp(min=None if clip_low is None else 1.0 - clip_low, max=1.0 + clip_high)  # [N, A]
    adv = broadcast_advantages(advantages, logp).to(logp.dtype)  # [N, A]
    loss = -weight * adv * logp  # [N, A]
    with torch.no_grad():
        high = ratio > 1.0 + clip_high  # [N, A]
        low = ratio < 1.0 - clip_low if clip_low is not None else torch.zeros_like(high)  # [N, A]
        fractions = {"clip_fraction": low | high, "clip_fraction_low": low, "clip_fraction_high": high}
    metrics = _ratio_metrics(log_r, mask, fractions, ratio=ratio)
    metrics["is_weight_mean"] = masked_mean(weight, mask)
    return loss, metrics


@policy_losses.register("sapo")
def sapo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    tau_pos: Annotated[float, SAPO_TEMPERATURE] = 1.0,
    tau_neg: Annotated[float, SAPO_TEMPERATURE] = 1.05,
    ratio_level: Literal["token", "chunk", "sequence"] = "token",
    chunk_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO: a soft gate in place of the hard clip, L = −(4/τ)·σ(τ·(r − 1))·A, τ by the sign of the advantage.

    Gao et al. (Qwen team) 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347. τ = ``tau_pos`` where
    A > 0 and ``tau_neg`` where A ≤ 0. The gate is the loss *value* (times −A), not a weight on log π: the gradient
    is −A·w·∇log π with w = 4·s·(1 − s)·r, s = σ(τ·(r − 1)), so an action's update fades smoothly as r leaves 1
    (faster for larger τ; the paper takes τ_neg > τ_pos, negative updates being the less stable) instead of stopping
    at a clip bound. The factor 4/τ makes w = 1 at r = 1 for every τ: on-policy the gradient is the plain policy
    gradient −A·∇log π (the value is −(2/τ)·A).

    TRL ``loss_type="sapo"`` (``trl/trainer/grpo_trainer.py`` L3092-3095 at huggingface/trl@f2cd577;
    ``sapo_temperature_pos`` 1.0, ``sapo_temperature_neg`` 1.05, ``grpo_config.py`` L196-201) and verl
    ``compute_policy_loss_sapo`` (``verl/trainer/ppo/core_algos.py`` L1329-1411 at volcengine/verl@b178a3c;
    ``tau_pos`` 1.0, ``tau_neg`` 1.05) compute exactly this on the token ratio, verl with log r clamped to ±20 as
    mmrl. Both average per sequence, then over sequences: TRL's sapo shares grpo's reduction (L3124-3128), verl
    forces ``seq-mean-token-mean`` whatever ``loss_agg_mode`` (L1394-1397). ``aggregation: seq_mean_token_mean``
    reproduces them and the paper's objective (a per-sequence token mean, averaged over the group; TRL's
    ``.mean()`` also counts rows without active actions, e.g. completions emptied by
    ``mask_truncated_completions``, scaling the step by the share of non-empty rows; verl and mmrl leave them out).
    ``ratio_level: sequence`` gates GSPO's sequence ratio, as TRL's ``importance_sampling_level="sequence"``.

    Metrics besides the ratio statistics: ``soft_weight_mean``, the mean of w (1 on-policy; no hard clip, so no
    clip fractions).

    Args:
        tau_pos: τ > 0 of the actions with A > 0 (paper, TRL, verl: 1.0).
        tau_neg: τ > 0 of the actions with A ≤ 0 (paper, TRL, verl: 1.05).
        ratio_level: "token" (SAPO), "chunk" (needs chunk ids from the rollout) or "sequence".

    Shapes:
        logp, old_logp, mask ``[N, A]``; advantages ``[N]`` or ``[N, A]`` → loss ``[N, A]``.
    """
    for name, tau in (("tau_pos", tau_pos), ("tau_neg", tau_neg)):
        if not 0 < tau < math.inf:
            raise ValueError(f"sapo {name} must be > 0 (the gate is scaled by 4/tau), got {tau}")
    log_r = log_ratio(logp, old_logp, mask, level=ratio_level, chunk_ids=chunk_ids)  # [N, A]
    ratio = log_r.exp()  # [N, A]
    adv = broadcast_advantages(advantages, logp).to(ratio.dtype)  # [N, A]
    temperature = torch.full_like(ratio, tau_neg).masked_fill(adv > 0, tau_pos)  # [N, A] (A = 0 takes tau_neg)
    gate = torch.sigmoid(temperature * (ratio - 1.0))  # [N, A]
    loss = -(4.0 / temperature) * gate * adv  # [N, A]
    with torch.no_grad():
        weight = 4.0 * gate * (1.0 - gate) * ratio  # [N, A] d(loss)/d(log π) = −A·weight
    metrics = _ratio_metrics(log_r, mask, ratio=ratio)
    metrics["soft_weight_mean"] = masked_mean(weight, mask)
    return loss, metrics


@policy_losses.register("gmpo")
def gmpo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: Annotated[float, GMPO_CLIP] = 0.4,
    clip_high: Annotated[float, GMPO_CLIP] = 0.4,
    ratio_level: Literal["sequence"] = "sequence",
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO: −A times the geometric mean of a sequence's token ratios, each clipped in log space before the mean.

    Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673 (code: callsys/GMPO). With
    x = log r per action, s = sgn(A_{i,t}) and m the mask, for row i::

        c_{i,t} = s·min(s·x, s·clip(x, −ε_low, ε_high))      (A > 0: x capped at ε_high; A < 0: raised to −ε_low)
        ρ_i = exp(Σ_t m·c / Σ_t m),   Ā_i = Σ_t m·A / Σ_t m,   L_{i,t} = −Ā_i·ρ_i  (every action of the row)

    Each token is clipped before the mean, PPO's pessimistic min in log space; GSPO (``ratio_level: sequence`` of
    ``grpo``) clips the mean instead. A clipped token gets no gradient, the others −Ā·ρ_i·∇log π / |o_i|. On-policy
    (r = 1) ρ_i = 1 and row i's gradient is −Ā_i·mean_t ∇log π: under ``seq_mean_token_mean`` REINFORCE's.

    verl ``loss_mode: geo_mean`` (``verl/trainer/ppo/core_algos.py`` L1635-1718 at volcengine/verl@b178a3c)
    computes exactly c, ρ and Ā (per-action advantages enter through their masked mean and their signs) and takes
    the plain mean of −Ā·ρ over the rows; TRL's experimental ``GMPOTrainer`` (``trl/experimental/gmpo/
    gmpo_trainer.py`` L80-120 at huggingface/trl@f2cd577) the same with one advantage per sequence. Aggregate with
    ``seq_mean_token_mean`` to reproduce both and the paper's mean over the group (both upstream means also count
    rows without active actions, verl's with loss 0, TRL's with the constant −A, e.g. completions emptied by
    ``mask_truncated_completions``: the step is scaled by the share of non-empty rows; mmrl's mean leaves them out).
    Where A = 0, c = 0 as verl's sgn (TRL takes the A < 0 branch): with per-sequence advantages that row's loss is
    0·ρ either way. x is clamped to ±20 first (:mod:`mmrl.algos.ratios`, shared by every loss: a ratio past e^20
    is a numerical failure, not signal; verl leaves that clamp commented out, TRL has none). It matters only where
    the *unclipped* side passes it (A > 0 with x < −20, A < 0 with x > 20), and there more than in PPO, whose
    gradient the ratio itself scales: that token enters ρ_i as ∓20 and gets no gradient, where upstream it keeps
    −Ā·ρ_i/|o_i| like the others (50 tokens at x = 0.01 and one at −25, A = 1: ρ 0.677 here, 0.613 upstream).
    The bounds are log-ratios, a ratio range (e^−ε_low, e^ε_high): 0.4 each is the paper's, TRL ``GMPOConfig``'s
    default ``epsilon`` and verl's example ``clip_ratio`` (``examples/gmpo_trainer``).

    Metrics besides the token ratio statistics: ``clip_fraction_high`` (A > 0, x > ε_high), ``clip_fraction_low``
    (A < 0, x < −ε_low), ``clip_fraction`` their union, as TRL's GMPO counts them (L143-149); ``geo_ratio_mean``,
    the masked mean of ρ_i over the actions.

    Args:
        clip_low: ε_low >= 0, log-space: token ratios of A < 0 are raised to e^−ε_low (paper: 0.4).
        clip_high: ε_high >= 0, log-space: token ratios of A > 0 are capped at e^ε_high (paper: 0.4).
        ratio_level: "sequence", the only one: ρ spans every action of a row (the trainer then refuses
            ``action_chunk_size``, which would show it a few actions at a time).

    Shapes:
        logp, old_logp, mask ``[N, A]``; advantages ``[N]`` or ``[N, A]`` → loss ``[N, A]``.
    """
    if not (0 <= clip_low < math.inf and 0 <= clip_high < math.inf):
        raise ValueError(f"gmpo clip_low and clip_high are log-ratio bounds >= 0; got {clip_low}, {clip_high}")
    if ratio_level != "sequence":
        raise ValueError(f"gmpo ratio_level must be 'sequence' (its geometric mean spans the row), got {ratio_level!r}")
    log_r = log_ratio(logp, old_logp, mask)  # [N, A] token level, with gradients
    adv = broadcast_advantages(advantages, logp).to(log_r.dtype)  # [N, A]
    sign = torch.sign(adv)  # [N, A]
    clipped = sign * torch.minimum(sign * log_r, sign * log_r.clamp(-clip_low, clip_high))  # [N, A]
    weights = mask.to(log_r.dtype)  # [N, A]
    count = weights.sum(dim=1).clamp(min=1.0)  # [N]; a row without active actions gets ρ = 1 and Ā = 0
    geo_ratio = ((clipped * weights).sum(dim=1) / count).exp()  # [N] ρ_i
    row_adv = (adv * weights).sum(dim=1) / count  # [N] Ā_i
    loss = (-row_adv * geo_ratio).unsqueeze(1).repeat(1, logp.shape[1])  # [N, A]
    with torch.no_grad():
        high = (adv > 0) & (log_r > clip_high)  # [N, A]
        low = (adv < 0) & (log_r < -clip_low)  # [N, A]
        fractions = {"clip_fraction": low | high, "clip_fraction_low": low, "clip_fraction_high": high}
    metrics = _ratio_metrics(log_r, mask, fractions)
    metrics["geo_ratio_mean"] = masked_mean(geo_ratio.unsqueeze(1).expand_as(logp), mask)
    return loss, metrics


# DGPO's clip range: the ratio's bounds 1 ± c must keep 1 − c > 0 (ratios are positive), as CLIP_LOW.
DGPO_CLIP = Range(0, 1, low_open=True, high_open=True)
DGPO_BETA = Range(0, low_open=True)


@policy_losses.register("dgpo")
def dgpo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    group_ids: Tensor | None = None,
    ref_logp: Tensor | None = None,
    beta_dpo: Annotated[float, DGPO_BETA] = 100.0,
    clip_range: Annotated[float, DGPO_CLIP] | None = None,
    reference: Literal["ref", "old"] = "ref",
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""DGPO, Direct Group Preference Optimization: a group-level Bradley-Terry weight on advantage-weighted
    log-likelihoods.

    Luo, Hu, Tang 2025, "Reinforcing Diffusion Models by Direct Group Preference Optimization", arXiv:2510.08425;
    released code Luo-Yihong/DGPO@01ceb4b, ``scripts/train_sd3_dgpo.py`` (``compute_group_dgpo_loss_allreduce``
    L162-193, its call with PPO-style clipping L1126-1149). Upstream writes it on the flow-matching errors
    dsm_i = mean (ε − x₀ − v_θ)²; here the columns are log-likelihood terms, log p = −dsm for
    ``plugin.likelihood: dgpo``. Per action column (a training time) and group g, with β = ``beta_dpo``, G_g the rows
    of group g in this call and ref the baseline (``reference``)::

        S_g = β/G_g · Σ_{i∈g} A_i·(log p_ref,i − log p_i)      (no gradient; = Σ A·β·(dsm − dsm_ref)/G upstream)
        loss_i = −σ(S_g)·A_i·log p_i                           (= σ(S_g)·A_i·dsm_i upstream, L191)

    so ``token_mean`` over a step's columns is upstream's mean over (sample, time) and its gradient
    mean_i σ(S_g)·A_i·∇dsm_i. That is the gradient of mean_g softplus(S_g)/β with S_g taken with gradients, i.e. of
    −log σ(−S_g) per group: lowering the advantage-weighted error below the reference's raises the group's
    preference likelihood, and σ(S_g) → 0 once the group already prefers its positive samples (the DPO fade-out).
    With ``clip_range`` = c (upstream ``clip_dsm``, L1133-1144) the ratio r = exp(log p − log p_old) (upstream
    exp(dsm_old − dsm)) stops the gradient of actions with A > 0 and r > 1 + c, or A ≤ 0 and r < 1 − c; the value
    is unchanged. ``reference: old`` takes the old log-probs as the baseline (upstream ``use_ema_ref``, from TDM-R1,
    L1122-1124; the flow plugin's old log-probs are then its fast EMA copy's).

    The groups must be whole in every call: upstream all-reduces S_g over processes (L184-185) so that a group may
    span GPUs; mmrl's learner keeps a group's samples in one micro-batch instead (the learner refuses a geometry
    that cannot, :func:`mmrl.trainer.geometry.check_whole_groups`), so S_g is complete without a collective. G_g is
    the number of rows of group g passed in (upstream's fixed ``num_image_per_prompt``: the same with whole
    groups). A row whose mask is 0 adds nothing to its group's sum.

    Args:
        group_ids: ``[N]`` the group of each row (any integers, equal for the members of a group); the learner
            passes ``rollout.group_ids``.
        ref_logp: ``[N, A]`` the reference policy's log-probs (no gradient); needed with ``reference: ref``.
        beta_dpo: β > 0 of S_g (upstream ``train.beta_dpo``: 100 GenEval and OCR, 10 PickScore, 2000 with the EMA
            reference).
        clip_range: c in (0, 1) of the stop-gradient clip, or None for none (upstream ``clip_range`` with
            ``clip_dsm``: 1e-2 GenEval and OCR, 5e-2 PickScore).
        reference: ``ref`` (the reference policy, upstream's default) or ``old`` (the old policy, ``use_ema_ref``).

    Shapes:
        logp, old_logp, mask, ref_logp ``[N, A]``; advantages ``[N]`` or ``[N, A]``; group_ids ``[N]`` → loss
        ``[N, A]``.
    """
    if not beta_dpo > 0:
        raise ValueError(f"dgpo beta_dpo must be > 0, got {beta_dpo}")
    if clip_range is not None and not 0 < clip_range < 1:
        raise ValueError(f"dgpo clip_range must be in (0, 1) or null, got {clip_range}")
    if reference not in ("ref", "old"):
        raise ValueError(f"dgpo reference must be 'ref' or 'old', got {reference!r}")
    if group_ids is None or group_ids.shape != logp.shape[:1]:
        raise ValueError(f"policy_loss dgpo needs group_ids [N] = [{logp.shape[0]}] (the learner passes them), got "
                         f"{None if group_ids is None else tuple(group_ids.shape)}")
    baseline = ref_logp if reference == "ref" else old_logp
    if baseline is None or baseline.shape != logp.shape:
        raise ValueError(f"policy_loss dgpo with reference {reference!r} needs {reference}_logp shaped like logp "
                         f"{tuple(logp.shape)}, got {None if baseline is None else tuple(baseline.shape)}")
    adv = broadcast_advantages(advantages, logp).to(logp.dtype)  # [N, A]
    log_r = logp.detach() - old_logp  # [N, A]
    with torch.no_grad():
        _, dense = torch.unique(group_ids.to(logp.device), return_inverse=True)  # [N] 0..groups-1
        members = torch.bincount(dense).to(logp.dtype)  # [groups] G_g
        # A·β·(dsm − dsm_ref) = A·β·(log p_ref − log p); masked entries add nothing (where, not ×: a NaN pad stays out)
        terms = torch.where(mask > 0, adv * beta_dpo * (baseline.to(logp.dtype) - logp.detach()), 0.0)  # [N, A]
        sums = logp.new_zeros(members.shape[0], logp.shape[1]).index_add_(0, dense, terms) / members[:, None]
        weights = torch.sigmoid(sums)[dense]  # [N, A] σ(S_g) of each row's group
    trained = logp
    fractions: dict[str, Tensor] = {}
    if clip_range is not None:
        with torch.no_grad():
            ratio = log_r.exp()  # [N, A]
            high = (adv > 0) & (ratio > 1.0 + clip_range)
            low = (adv <= 0) & (ratio < 1.0 - clip_range)  # upstream's `where(A > 0, ..., r < 1 − c)`: A = 0 too
            fractions = {"clip_fraction": high | low, "clip_fraction_low": low, "clip_fraction_high": high}
        trained = torch.where(high | low, logp.detach(), logp)
    loss = -weights * adv * trained  # [N, A]
    metrics = _ratio_metrics(log_r, mask, fractions)
    metrics["group_weight_mean"] = masked_mean(weights, mask)
    return loss, metrics


# Only the clip and the `old` baseline read old_logp: without them the learner runs no old-policy pass for dgpo.
dgpo_policy_loss.reads_old_logp = lambda options: (options.get("clip_range") is not None
                                                   or options.get("reference", "ref") == "old")
