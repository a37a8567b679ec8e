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
    ratio_level: Literal["token", "chunk", "sequence"] = "token",
    chunk_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip with asymmetric bounds (DAPO clip-higher) and optional dual clip, as in GRPO.

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
        ratio_level: "token", "chunk" (needs chunk ids from the rollout) or "sequence" (GSPO).

    Shapes:
        logp, old_logp, mask ``[N, A]``; advantages ``[N]`` or ``[N, A]`` → loss ``[N, A]``.
    """
    if clip_low < 0 or clip_low >= 1 or clip_high < 0:
        raise ValueError(f"clip_low must be in [0, 1) and clip_high >= 0; got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (it caps the loss at -c*A), got {dual_clip}")
    log_r = log_ratio(logp, old_logp, mask, level=ratio_level, chunk_ids=chunk_ids)  # [N, A]
    ratio = log_r.exp()  # [N, A]
    adv = broadcast_advantages(advantages, logp).to(ratio.dtype)  # [N, A]
    neg_adv = -adv  # [N, A]
    loss = torch.maximum(neg_adv * ratio, neg_adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))  # [N, A]
    with torch.no_grad():
        low = (adv < 0) & (ratio < 1.0 - clip_low)  # [N, A]
        high = (adv > 0) & (ratio > 1.0 + clip_high)  # [N, A]
        fractions = {"clip_fraction": low | high, "clip_fraction_low": low, "clip_fraction_high": high}
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
