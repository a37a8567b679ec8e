"""Sequence-level policy losses from TRL: VESPO's Gamma-weighted REINFORCE and LUSPO's length-scaled GSPO.

Both register into :data:`mmrl.algos.policy_losses.policy_losses` when this module is imported (``mmrl.algos``
imports it) and keep that registry's contract: ``fn(logp[N,A], old_logp[N,A], advantages[N] or [N,A], mask[N,A],
**options) -> (loss[N,A], metrics)``, the loss per action before :mod:`mmrl.algos.aggregation`, the metrics detached
masked means over the actions of the call.

Each weight spans a whole row (VESPO's sequence ratio is a sum over the row's actions, LUSPO's length is the row's
action count), so each declares ``ratio_level: sequence`` as its only level: the trainer then refuses
``algorithm.action_chunk_size``, which would show the loss a few of a row's actions at a time.

References:
    VESPO — Shen et al. 2026, "VESPO: Variational Sequence-Level Soft Policy Optimization", arXiv:2602.10693; code
        FloyedShen/VESPO@3fd2c7f ``recipe/vespo/code/core_algos.py`` (``compute_policy_loss_vespo``).
    LUSPO — Liu et al. 2026, "Length-Unbiased Sequence Policy Optimization", arXiv:2602.05261.
    TRL — huggingface/trl@f2cd577 ``trl/trainer/grpo_trainer.py``: ``get_gamma_weights`` L2941-2989, the loss
        branches L3083-3107, the reductions L3139-3148, the metrics L3242-3258, the checks L891-915;
        ``trl/trainer/grpo_config.py`` L202-214 (``vespo_*``), L268-274 (``luspo``, ``vespo``);
        ``docs/source/paper_index.md`` L643-686 (each paper's settings).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import torch
from torch import Tensor

from mmrl.algos.policy_losses import (
    CLIP_HIGH,
    CLIP_LOW,
    TWO_SIDED_CLIP,
    _ratio_metrics,
    broadcast_advantages,
    clipped_policy_loss,
    masked_mean,
    policy_losses,
)
from mmrl.algos.ratios import LOG_RATIO_CLAMP, log_ratio
from mmrl.registry import Range

# φ(w) = w^k·e^(λ(1 − w)) is a bounded down-weighting kernel for k >= 0 and λ > 0: bounded as w → 0 (k < 0 would
# blow it up on sequences the current policy finds unlikely) and as w → ∞ (λ <= 0 would let w^k grow), with its
# maximum e^(λ − k)·(k/λ)^k at w = k/λ. TRL and the VESPO code floor λ at 1e-4 (`clamp(min=1e-4)`) instead of
# refusing a smaller one; mmrl refuses below that floor, so every accepted λ computes what TRL computes.
VESPO_K = Range(0)
VESPO_LAMBDA = Range(1e-4)

# TRL's (and the VESPO code's) floor of the sequence log-ratio: log(1e-8) ≈ −18.42, the lower clamp of log w.
VESPO_LOG_W_MIN = math.log(1e-8)


@policy_losses.register("vespo")
def vespo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    k_pos: Annotated[float, VESPO_K] = 2.0,
    lambda_pos: Annotated[float, VESPO_LAMBDA] = 3.0,
    k_neg: Annotated[float, VESPO_K] = 3.0,
    lambda_neg: Annotated[float, VESPO_LAMBDA] = 2.0,
    ratio_level: Literal["sequence"] = "sequence",
) -> tuple[Tensor, dict[str, Tensor]]:
    """VESPO: REINFORCE scaled by a Gamma kernel of the sequence ratio, L = −sg(φ(w))·A·log π.

    Shen et al. 2026, arXiv:2602.10693. For row i, with x_{i,t} = log π_θ − log π_old of its actions and m the
    mask::

        log w_i = clamp(Σ_t m·clamp(x_{i,t}, −20, 20), log 1e-8, 20)      (the product of the ratios, no length mean)
        (k, λ) = (k_pos, λ_pos) where A ≥ 0, (k_neg, λ_neg) where A < 0
        φ = exp(λ + k·log w − λ·w) = w^k·e^(λ(1 − w)),   a non-finite φ set to 0
        L_{i,t} = −sg(φ_{i,t})·A_{i,t}·log π_{i,t}

    φ(1) = 1, so on-policy (w = 1) the value and the gradient are REINFORCE's, −A·log π and −A·∇log π. Off-policy
    φ smoothly down-weights the whole sequence's gradient where w is far from 1 in either direction (the maximum is
    at w = k/λ: 2/3 for A ≥ 0, 3/2 for A < 0 with the defaults), instead of clipping tokens. φ is detached: it
    only scales the gradient.

    This is TRL ``loss_type="vespo"`` (``get_gamma_weights``, ``trl/trainer/grpo_trainer.py`` L2941-2989 at
    huggingface/trl@f2cd577, the loss L3096-3107), clamps and defaults included (``vespo_k_pos`` 2.0,
    ``vespo_lambda_pos`` 3.0, ``vespo_k_neg`` 3.0, ``vespo_lambda_neg`` 2.0, ``grpo_config.py`` L202-214; the VESPO
    code, FloyedShen/VESPO@3fd2c7f ``recipe/vespo/code/core_algos.py`` L86-89, has the same defaults though its
    docstring lists others, clamps w to [e^−20, e^20] and floors w at 1e-8 only inside the log: where
    log w < −18.42 the two differ in λ·w alone, w <= 1e-8, a relative change of φ below λ·1e-8). Per-action
    advantages pick (k, λ) per action by their own sign, as TRL with ``[B, T]`` advantages (the VESPO code takes
    the first action's advantage for the whole row). A = 0 takes the positive pair (its loss is 0 either way).
    TRL sets a non-finite φ to 0 (``nan_to_num``), so does mmrl: a float32 overflow of exp (log φ > 88.7, only for
    k·log w ≫ λ·w, e.g. k = 10, log w = 10, λ = 1e-4) drops that sequence's gradient rather than the step.

    TRL's ``importance_sampling_level`` must stay ``"token"`` (a warning otherwise, L897-901): it selects the ratio
    ``coef_1`` of the clipped losses, which vespo does not use (it builds w from the raw token log-ratios itself);
    only TRL's KL bias correction reads ``coef_1`` there. mmrl's ``ratio_level`` is another thing: the unit that the
    loss's weight spans, which the trainer reads to decide whether a row may be shown a few actions at a time. w
    spans the row, so the only level is ``"sequence"`` (and it is the *product* of the row's ratios, exp Σ, not the
    geometric mean exp mean that ``ratio_level: sequence`` means for the clipped losses, GSPO's).

    TRL folds its vLLM importance-sampling correction (π_old/π_sampler per token, ``token_truncate`` or
    ``token_mask`` only, L911-915) into log w (L2972-2975) and so skips its per-token multiplication for vespo
    (L3117). mmrl has no separate rollout engine: ``old_logp`` are the log-probs of the policy that sampled (the
    plugin's own sampling pass or the learner's old-policy pass), π_sampler = π_old, and there is nothing to fold.

    Aggregate with ``token_mean``: TRL divides vespo's summed loss by ``num_items_in_batch`` (L3139-3142), the active
    tokens of the whole generation batch over every process (counted at L2427, copied to each of its
    ``steps_per_generation`` slices): one optimizer step's tokens with TRL's default ``steps_per_generation =
    gradient_accumulation_steps`` (mmrl ``minibatches: 1``), as the VESPO code's default ``token-mean`` per
    mini-batch. With ``steps_per_generation = k·gradient_accumulation_steps`` (k off-policy mini-batches per
    generation, mmrl ``minibatches: k``) TRL divides each step's sum by all k steps' tokens, about 1/k of
    ``token_mean``'s value and gradient: a step-dependent learning-rate scale that mmrl does not copy.

    Metrics besides the token ratio statistics: ``phi_mean``, the masked mean of φ over the actions (TRL's
    ``vespo/phi_seq_mean`` averages over sequences with ``[B]`` advantages); ``seq_log_ratio_mean``, that of log w
    (after its clamps).

    Args:
        k_pos: k >= 0 of the actions with A >= 0: φ's power of w, its down-weighting of w < 1 (the paper's c1,
            §3.4, as TRL's paper index names it; TRL and the VESPO scripts: 2.0).
        lambda_pos: λ >= 1e-4 of the actions with A >= 0: φ's decay e^(−λw), its down-weighting of w > 1 (the
            paper's c2; 3.0).
        k_neg: k >= 0 of the actions with A < 0 (3.0).
        lambda_neg: λ >= 1e-4 of the actions with A < 0 (2.0).
        ratio_level: "sequence", the only one: w spans every action of a row (the trainer then refuses
            ``action_chunk_size``).

    Shapes:
        logp, old_logp, mask ``[N, A]``; advantages ``[N]`` or ``[N, A]`` → loss ``[N, A]``.
    """
    for name, value in (("k_pos", k_pos), ("k_neg", k_neg)):
        if value not in VESPO_K:
            raise ValueError(f"vespo {name} must be >= 0 (phi's power of w; k < 0 is unbounded as w -> 0), "
                             f"got {value}")
    for name, value in (("lambda_pos", lambda_pos), ("lambda_neg", lambda_neg)):
        if value not in VESPO_LAMBDA:
            raise ValueError(f"vespo {name} must be >= 0.0001 (phi's decay; TRL floors it there), got {value}")
    if ratio_level != "sequence":
        raise ValueError(f"vespo ratio_level must be 'sequence' (its weight spans the row), got {ratio_level!r}")
    log_r = log_ratio(logp.detach(), old_logp, mask)  # [N, A] token level, each clamped to ±20 as TRL does
    adv = broadcast_advantages(advantages, logp).to(logp.dtype)  # [N, A]
    with torch.no_grad():
        weights = mask.to(log_r.dtype)  # [N, A]
        # where, not ×: a non-finite padding log-prob stays out of the sum (TRL's × gives the same on finite ones)
        summed = torch.where(mask > 0, log_r * weights, 0.0).sum(dim=1, keepdim=True)  # [N, 1] Σ_t m·x
        log_w = summed.clamp(VESPO_LOG_W_MIN, LOG_RATIO_CLAMP)  # [N, 1]
        nonnegative = adv >= 0  # [N, A]
        k = torch.full_like(log_r, k_neg).masked_fill(nonnegative, k_pos)  # [N, A] in log_r's dtype, not float32's
        lam = torch.full_like(log_r, lambda_neg).masked_fill(nonnegative, lambda_pos)  # [N, A]
        phi = torch.exp(lam + k * log_w - lam * log_w.exp())  # [N, A]
        phi = phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    loss = -phi * adv * logp  # [N, A]
    metrics = _ratio_metrics(log_r, mask)
    metrics["phi_mean"] = masked_mean(phi, mask)
    metrics["seq_log_ratio_mean"] = masked_mean(log_w.expand_as(logp), mask)
    return loss, metrics


@policy_losses.register("luspo")
def luspo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: Annotated[float, CLIP_LOW] = 2e-3,
    clip_high: Annotated[float, CLIP_HIGH] = 2.5e-3,
    delta: Annotated[float, TWO_SIDED_CLIP] | None = None,
    ratio_level: Literal["sequence"] = "sequence",
) -> tuple[Tensor, dict[str, Tensor]]:
    """LUSPO: GSPO's clipped sequence-ratio loss scaled by the sequence's length, L = |o_i|·max(−A·s, −A·clip(s)).

    Liu et al. 2026, arXiv:2602.05261: GSPO's sequence ratio spreads a sequence's gradient over its tokens as
    (1/|o_i|)·Σ_t ∇log π, so a token of a long sequence weighs less than one of a short sequence; the paper ties
    this length bias to GSPO's collapsing response length and scales each sequence's term by |o_i|, which gives
    every token the same weight. With s_i = exp(Σ_t m·x / Σ_t m) GSPO's sequence ratio (x = log π_θ − log π_old) and
    |o_i| = Σ_t m_{i,t}::

        L_{i,t} = |o_i|·max(−A_{i,t}·s_i, −A_{i,t}·clip(s_i, 1 − ε_low, 1 + ε_high))      (every action of row i)

    An unclipped row's gradient is −A·s_i·Σ_t ∇log π: on-policy (s = 1), under ``seq_mean_token_mean``,
    REINFORCE's gradient summed over each sequence's actions and averaged over the sequences (``seq_mean_token_sum``
    of ``reinforce``), per-action advantages entering through their row mean.

    TRL ``loss_type="luspo"`` with ``importance_sampling_level="sequence"`` (``trl/trainer/grpo_trainer.py``
    L3083-3091, the same term as grpo's on the sequence ratio, at huggingface/trl@f2cd577; TRL warns for any other
    level, L891-895) reduces it as ``(per_token_loss * mask.sum(1, keepdim=True)).mean()`` (L3143-3148): the mean of
    |o_i|·ℓ_i over the micro-batch's B rows, divided by the gradient-accumulation steps. ``aggregation:
    seq_mean_token_mean`` reproduces that: each row's mean of its constant L is |o_i|·ℓ_i, averaged over the step's
    sequences, the micro-batch means of TRL (all of one size) averaged over its accumulation steps and processes.
    TRL's B also counts rows without an active action (with 0), e.g. completions emptied by
    ``mask_truncated_completions``; mmrl leaves them out (passing ``num_sequences`` = every row to
    :func:`mmrl.algos.aggregate` reproduces TRL's count). With per-action ``[B, T]`` advantages TRL's ``.mean()``
    runs over every column, padding included; mmrl takes row i's mean over its active actions, |o_i| times mean_t
    ℓ_{i,t}: the same as TRL where a row's advantage is constant (padding included), as it is when one advantage
    per sequence is broadcast. TRL's optional ``delta`` (an upper cap on the unclipped ratio, default off) is
    ``delta`` here, as in ``grpo``; s is computed from log s clamped to ±20 (:mod:`mmrl.algos.ratios`, TRL has no
    clamp: a ratio past e^20 is a numerical failure).

    The defaults are the paper's (§5.1) as TRL's ``paper_index.md`` gives them (L643-657): ``epsilon=2e-3``,
    ``epsilon_high=2.5e-3`` (TRL's own defaults are 0.2 for every loss type).

    Metrics: those of ``grpo`` on the sequence ratio (``clip_fraction``, ``_low``, ``_high`` and the ratio
    statistics), masked means over the actions (TRL's ``clip_ratio/*`` average over sequences for ``[B]``
    advantages, L3242-3252).

    Args:
        clip_low: ε_low in [0, 1) on the sequence ratio (paper: 2e-3).
        clip_high: ε_high >= 0 on the sequence ratio (paper: 2.5e-3).
        delta: Optional two-sided clip δ > 1 on the sequence ratio (TRL's ``delta``, as ``grpo``'s); None disables.
        ratio_level: "sequence", the only one: s and |o_i| span every action of a row (the trainer then refuses
            ``action_chunk_size``).

    Shapes:
        logp, old_logp, mask ``[N, A]``; advantages ``[N]`` or ``[N, A]`` → loss ``[N, A]``.
    """
    if ratio_level != "sequence":
        raise ValueError(f"luspo ratio_level must be 'sequence' (GSPO's ratio and the length span the row), got "
                         f"{ratio_level!r}")
    clipped, metrics = clipped_policy_loss(logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                                           delta=delta, ratio_level="sequence")  # [N, A] GSPO's ℓ_{i,t}
    lengths = mask.to(clipped.dtype).sum(dim=1, keepdim=True)  # [N, 1] |o_i|
    return lengths * clipped, metrics
