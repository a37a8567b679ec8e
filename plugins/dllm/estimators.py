"""Sequence log-likelihood estimators for masked diffusion language models.

Every registered estimator has the signature

    fn(model, prompt_ids[B, P], completion_ids[B, L], completion_mask[B, L], *, mask_id, num_samples, generator,
       **options) -> Tensor[B]  (float32)

where ``model(input_ids[R, P+L]) -> logits[R, P+L, V]`` scores token ``i`` at position ``i`` (no shift: the model
adapter hides Dream-style shifts) and ``completion_mask`` marks the real completion tokens (1: up to and including
the first EOS) and the tail after them (0). The tail is replaced by the mask token in every forward and never scored
(d1 and SPG do the same; see :mod:`mmrl.plugins.dllm.masking`), so the result estimates the log-likelihood
``log π_θ(x | c)`` of the real tokens ``x`` given the prompt ``c``, the tail marginalised, through its ELBO (or, for
``spg_upper``, an upper-bound surrogate). Gradients flow to the model; wrap calls for the
old/reference policies in ``torch.no_grad()``.

Notation: ``L_b`` real tokens ``x = (x^1..x^L)``, ``x_S`` = ``x`` with positions ``S`` masked,
``g(S) = Σ_{i∈S} log p_θ(x^i | c, x_S)`` and ``h_l = E_{S uniform, |S|=l} g(S)``. The masked-diffusion ELBO
(MDLM/LLaDA training objective; Nie et al. 2025, "Large Language Diffusion Models", arXiv:2502.09992) is

    ELBO = E_{t~U(0,1)} E_{S~Bern(t)^L} [ (1/t) g(S) ] = Σ_{l=1..L} h_l / l      (see :func:`exact_elbo`).

All randomness comes from the explicit ``generator``. To score the current, old and reference policies with the
same masks and timesteps (VRPO antithetic sampling, Zhu et al. 2025, "LLaDA 1.5", arXiv:2505.19223), draw a
plan once and score it with each model::

    plan = draw_plan("elbo_l", prompt_ids, completion_ids, completion_mask, num_samples=8, generator=g)
    logp = score_plan(policy, prompt_ids, completion_ids, plan, mask_id=mask_id)
    with torch.no_grad():
        old_logp = score_plan(old_policy, prompt_ids, completion_ids, plan, mask_id=mask_id)
    ratio = torch.exp(logp - old_logp)  # exactly 1 when the weights are equal

Calling a registered estimator twice with generators in the same state gives the same plan and the same result.
All plans use one mask per sampled timestep (VRPO's optimal allocation); the ``num_samples`` masked copies of the
batch are stacked along the batch dimension into one forward (``micro_batch`` splits it), rows with nothing to
score are skipped, and log-softmax runs in float32 on the scored positions only.

References:
    LLaDA — Nie et al. 2025, arXiv:2502.09992 (ELBO; t- and l-sampling likelihood evaluation).
    d1 / diffu-GRPO — Zhao et al. 2025, arXiv:2504.12216 (one-step mean-field estimator, prompt masking).
    LLaDA 1.5 / VRPO — Zhu et al. 2025, arXiv:2505.19223 (budget allocation, antithetic sampling).
    DiffuCoder / coupled-GRPO — Gong et al. 2025, arXiv:2506.20639 (complementary masks).
    SPG — Wang et al. 2025, arXiv:2510.09541 (sandwiched ELBO/EUBO, block-wise masking).
    wd1 — Tang et al. 2025, arXiv:2507.08838 (uses the d1 one-step estimator in a ratio-free loss).
    TraceRL — Wang et al. 2025, arXiv:2509.06949 (the decoding trajectory's own context for every token: ``trace``).
    ESPO — Ou et al. 2025, arXiv:2512.03759 (count-sampled complementary pairs over ``0..L``: ``espo``).
    UniGRPO (MMaDA) — Yang et al. 2025, arXiv:2505.15809 (random masking rate per draw: ``random_masking``).
    GDPO — Rojas et al. 2025, arXiv:2510.08554 (quadrature over t, masks drawn per node: ``sdmc``).

``uniform_one_step`` is the one estimator for **canvas** models (DiffusionGemma: uniform-token noise, no mask
token); its ``model`` is the ``DiffusionGemmaForBlockDiffusion`` itself (:mod:`mmrl.plugins.dllm.canvas`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

import torch
from torch import Tensor

from mmrl.plugins.dllm.masking import (
    MaskPlan,
    coupled_cv_plan,
    coupled_plan,
    elbo_l_plan,
    elbo_t_plan,
    espo_plan,
    one_step_plan,
    random_masking_plan,
    sdmc_plan,
    spg_plan,
    trace_plan,
)
from mmrl.registry import ANY_FINITE, Range, Registry

# The plugin passes the model inputs, the mask id, the number of draws (plugin.num_mc_samples), the generator, the
# micro-batch (plugin.score_micro_batch) and, to ``trace``, the rollout's step map; the other keyword parameters are
# the config's estimator_options.
likelihood_estimators: Registry[Callable[..., Tensor]] = Registry(
    "likelihood estimator", supplied=("mask_id", "num_samples", "generator", "micro_batch", "step_map")
)

# Option ranges, checked when a config loads and again by the mask plans (masking.py) for direct calls.
PROBABILITY = Range(0, 1)  # p_mask_prompt: a masking probability
ELBO_EPS = Range(0, 1, high_open=True)  # t ~ U(ε, 1) needs ε < 1; ε = 0 is unbiased with infinite variance
BLOCK_LENGTH = Range(1)
RENYI_BETA = Range(1)  # the Rényi order of SPG's EUBO (arXiv:2510.09541), β >= 1 as MaskPlan requires
SHRINK = Range(1)  # TraceRL's distinct decoding steps per step group
MASK_RATE = Range(0, 1, low_open=True)  # UniGRPO's masking-rate bounds: t ~ U(t_low, t_high) in (0, 1]

__all__ = [
    "MaskPlan",
    "likelihood_estimators",
    "draw_plan",
    "score_plan",
    "plan_token_logprobs",
    "exact_elbo",
    "elbo_size_weights",
    "one_step",
    "elbo_t",
    "elbo_l",
    "coupled",
    "coupled_cv",
    "espo",
    "spg_lower",
    "spg_upper",
    "trace",
    "random_masking",
    "sdmc",
    "uniform_one_step",
]


# ---------------------------------------------------------------------- model evaluation
def _model_logits(model: Callable[[Tensor], Any], input_ids: Tensor) -> Tensor:
    out = model(input_ids)
    logits = out if isinstance(out, Tensor) else getattr(out, "logits", None)
    if not isinstance(logits, Tensor) or logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        shape = None if not isinstance(logits, Tensor) else tuple(logits.shape)
        raise ValueError(f"model(input_ids {tuple(input_ids.shape)}) must return logits [R, T, V], got {shape}")
    return logits


def _scored_logprobs(
    model: Callable[[Tensor], Any],
    inputs: Tensor,
    targets: Tensor,
    scored: Tensor,
    prompt_length: int,
    micro_batch: int | None,
) -> Tensor:
    """``log p(targets | inputs)`` at the scored completion positions, zero elsewhere.

    Rows with no scored position are not forwarded. Log-softmax runs in float32 on the scored positions only.

    Shapes:
        inputs ``[R, P+L]``, targets ``[R, L]``, scored ``bool [R, L]`` → ``float32 [R, L]``.
    """
    rows, length = targets.shape
    out = torch.zeros(rows, length, dtype=torch.float32, device=targets.device)
    active = scored.any(dim=-1).nonzero().squeeze(-1)  # rows worth a forward
    if active.numel() == 0:
        return out
    step = active.numel() if micro_batch is None else int(micro_batch)
    if step < 1:
        raise ValueError(f"micro_batch must be a positive int, got {micro_batch!r}")
    row_index, col_index, values = [], [], []
    for chunk in active.split(step):
        logits = _model_logits(model, inputs[chunk])[:, prompt_length:, :]  # [r, L, V]
        where = scored[chunk]  # [r, L]
        picked = logits[where].float()  # [k, V], row-major order of `where`
        target = targets[chunk][where].unsqueeze(-1)  # [k, 1]
        values.append(picked.log_softmax(dim=-1).gather(-1, target).squeeze(-1))
        position = where.nonzero()
        row_index.append(chunk[position[:, 0]])
        col_index.append(position[:, 1])
    return out.index_put((torch.cat(row_index), torch.cat(col_index)), torch.cat(values).to(out.device))


def plan_token_logprobs(
    model: Callable[[Tensor], Any],
    prompt_ids: Tensor,
    completion_ids: Tensor,
    plan: MaskPlan,
    *,
    mask_id: int,
    micro_batch: int | None = None,
) -> Tensor:
    """Per-draw, per-token log-probabilities ``log p_θ(x^i | c̃_n, x̃_n)`` at the positions the plan scores.

    Useful when one forward must feed several reductions (SPG's ``mix`` = ω·EUBO + (1−ω)·ELBO uses
    ``plan.reduce`` twice on the same log-probabilities).

    Args:
        model: ``model(input_ids[R, T]) -> logits[R, T, V]`` (or an output with ``.logits``), no shift.
        prompt_ids: ``[B, P]`` prompt ids (left padding is the caller's business).
        completion_ids: ``[B, L]`` completion ids.
        plan: A :class:`MaskPlan` drawn for these shapes.
        mask_id: The mask token id.
        micro_batch: Optional number of rows per forward (memory bound); ``None`` forwards all ``N·B`` rows at once.

    Shapes:
        → ``float32 [N, B, L]``, zero where the plan scores nothing.
    """
    plan.check_compatible(prompt_ids, completion_ids)
    plan = plan.to(completion_ids.device)
    n, b, length = plan.completion_masked.shape
    inputs = plan.model_inputs(prompt_ids, completion_ids, mask_id)  # [N·B, T]
    targets = completion_ids.repeat(n, 1)  # row n·B + b ↔ completion b
    scored = plan.scored.reshape(n * b, length)
    logp = _scored_logprobs(model, inputs, targets, scored, prompt_ids.shape[1], micro_batch)
    return logp.reshape(n, b, length)


def score_plan(
    model: Callable[[Tensor], Any],
    prompt_ids: Tensor,
    completion_ids: Tensor,
    plan: MaskPlan,
    *,
    mask_id: int,
    micro_batch: int | None = None,
) -> Tensor:
    """Evaluate a drawn :class:`MaskPlan` with ``model``: ``plan.reduce(plan_token_logprobs(...))``.

    Scoring two models with one plan shares every mask and timestep (VRPO antithetic sampling); with equal weights,
    a deterministic forward and the same ``micro_batch``, the two results are bitwise equal, so the ratio is exactly
    1 (different row chunking can change the last bits on accelerators).

    Shapes:
        prompt_ids ``[B, P]``, completion_ids ``[B, L]`` → ``float32 [B]``.
    """
    logp = plan_token_logprobs(model, prompt_ids, completion_ids, plan, mask_id=mask_id, micro_batch=micro_batch)
    return plan.reduce(logp)


_PLANS: dict[str, Callable[..., MaskPlan]] = {
    "one_step": one_step_plan,
    "elbo_t": elbo_t_plan,
    "elbo_l": elbo_l_plan,
    "coupled": coupled_plan,
    "coupled_cv": coupled_cv_plan,
    "espo": espo_plan,
    "spg_lower": lambda *args, **kwargs: spg_plan(*args, bound="lower", **kwargs),
    "spg_upper": lambda *args, **kwargs: spg_plan(*args, bound="upper", **kwargs),
    "random_masking": random_masking_plan,
    "sdmc": sdmc_plan,
}


def draw_plan(
    name: str,
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    num_samples: int,
    generator: torch.Generator | None,
    **options: Any,
) -> MaskPlan:
    """Draw the masks and timesteps of the registered estimator ``name`` without running a model.

    ``likelihood_estimators[name](model, ..., generator=g, **options)`` equals
    ``score_plan(model, ..., draw_plan(name, ..., generator=g', **options))`` when ``g`` and ``g'`` are in the same
    state. ``options`` are the estimator's options except ``micro_batch``.

    Shapes:
        prompt_ids ``[B, P]``, completion_ids and completion_mask ``[B, L]`` → a plan with ``N`` draws
        (``one_step`` without prompt masking draws one).
    """
    if name not in _PLANS:
        raise KeyError(f"no mask plan for likelihood estimator {name!r}; known: {', '.join(sorted(_PLANS))}")
    return _PLANS[name](
        prompt_ids, completion_ids, completion_mask, num_samples=num_samples, generator=generator, **options
    )


# ---------------------------------------------------------------------- registered estimators
@likelihood_estimators.register("one_step")
def one_step(
    model: Callable[[Tensor], Any],
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    mask_id: int,
    num_samples: int = 1,
    generator: torch.Generator | None = None,
    p_mask_prompt: Annotated[float, PROBABILITY] = 0.0,
    micro_batch: int | None = None,
) -> Tensor:
    """d1 one-step ("mean-field") score: all completion tokens masked, one forward, Σ_i log p(x^i | c̃, m…m).

    est = Σ_{i real} log p_θ(x^i | c̃, x_{all}), where every completion position is masked (the tail too) and each
    prompt token is masked independently w.p. ``p_mask_prompt`` (c̃). Zhao et al. 2025 (d1), arXiv:2504.12216; wd1
    (arXiv:2507.08838) uses the same score.

    **Biased, not a bound.** It equals ``h_L = g(all)`` (with a clean prompt), which is ``L`` times the ``l = L``
    term ``h_L / L`` of the ELBO ``Σ_l h_l / l``: every token is predicted with no completion context, so it is
    typically far below the ELBO for a trained model (on a random model it can be close by accident). Prompt
    masking changes the target further (it scores a corrupted prompt) and acts as a regularizer across d1's inner
    iterations, each of which draws new prompt masks; d1 runs use 0.15.

    Args:
        p_mask_prompt: Probability in [0, 1] of masking each prompt position (d1 runs: 0.15; 0 scores the clean
            prompt).
        micro_batch: Rows per forward; ``None`` runs all draws at once.

    Returns ``num_samples`` draws averaged when ``p_mask_prompt > 0``; one forward otherwise.

    Shapes:
        prompt_ids ``[B, P]``, completion_ids and completion_mask ``[B, L]`` → ``float32 [B]``.
    """
    plan = one_step_plan(
        prompt_ids, completion_ids, completion_mask, num_samples=num_samples, generator=generator,
        p_mask_prompt=p_mask_prompt,
    )
    return score_plan(model, prompt_ids, completion_ids, plan, mask_id=mask_id, micro_batch=micro_batch)


@likelihood_estimators.register("elbo_t")
def elbo_t(
    model: Callable[[Tensor], Any],
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    mask_id: int,
    num_samples: int,
    generator: torch.Generator | None,
    eps: Annotated[float, ELBO_EPS] = 1e-3,
    micro_batch: int | None = None,
) -> Tensor:
    """t-sampling ELBO: t = (1−ε)u + ε, each real token masked w.p. t, estimate (1/t)·Σ_{masked} log p; mean of N.

    est = (1/N) Σ_n (1/t_n) Σ_{i∈S_n} log p_θ(x^i | c, x_{S_n}),  S_n ~ Bern(t_n)^{L_b} over real tokens.
    The MDLM/LLaDA training loss (Nie et al. 2025, arXiv:2502.09992).

    Unbiasedness: conditioned on ``t``, ``|S| ~ Bin(L, t)`` and ``S`` given ``|S| = l`` is a uniform ``l``-subset,
    so ``E[(1/t) g(S)] = Σ_l [∫ (1/t)·C(L,l) t^l (1−t)^{L−l} dt]·h_l`` over the law of ``t``. With ``ε = 0`` the
    bracket is ``1/l`` (:func:`exact_elbo`), so the estimate is unbiased for the ELBO — but its variance is infinite
    (``Var ∝ ∫ 1/t dt``). With ``ε > 0`` it is unbiased for ``Σ_l w_l(ε)·h_l`` where
    ``w_l(ε) = (1/(1−ε))·C(L,l)·∫_ε^1 t^{l−1}(1−t)^{L−l} dt`` (:func:`elbo_size_weights`, and
    ``exact_elbo(..., eps=ε)`` is its exact value); the bias is at most ``(2ε/(1−ε))·L·max|log p|``, i.e.
    negligible at ε = 1e-3, while the variance stays large (3.5× the sd of ``elbo_l`` at equal forwards on the tiny
    model of ``tests/dllm``; the variance grows like log(1/ε)).

    Args:
        eps: Smallest timestep ε in [0, 1) (LLaDA/MDLM: 1e-3); bounds the weight 1/t by 1/ε.
        micro_batch: Rows per forward; ``None`` runs all draws at once.

    Shapes:
        prompt_ids ``[B, P]``, completion_ids and completion_mask ``[B, L]`` → ``float32 [B]``.
    """
    plan = elbo_t_plan(
        prompt_ids, completion_ids, completion_mask, num_samples=num_samples, generator=generator, eps=eps
    )
    return score_plan(model, prompt_ids, completion_ids, plan, mask_id=mask_id, micro_batch=micro_batch)


@likelihood_estimators.register("elbo_l")
def elbo_l(
    model: Callable[[Tensor], Any],
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    mask_id: int,
    num_samples: int,
    generator: torch.Generator | None,
    stratified: bool = True,
    micro_batch: int | None = None,
) -> Tensor:
    """LLaDA l-sampling ELBO: l ~ U{1..L_b}, exactly l random real tokens masked, estimate (L_b/l)·Σ_masked log p.

    est = (1/N) Σ_n (L_b/l_n) Σ_{i∈S_n} log p_θ(x^i | c, x_{S_n}),  S_n a uniform l_n-subset of the real tokens.
    LLaDA's likelihood evaluation (Nie et al. 2025, arXiv:2502.09992, and ``get_log_likelihood.py`` of its code); the
    prompt is never masked.

    Unbiasedness: ``E[(L/l)·g(S)] = Σ_{l=1..L} (1/L)·(L/l)·h_l = Σ_l h_l/l = ELBO`` exactly (no ε, bounded weights
    ≤ L_b). With ``stratified=True`` the N counts of a sample are ``l_n = ((k − 1 + ⌊n·L_b/N⌉) mod L_b) + 1`` with
    one random ``k ~ U{1..L_b}`` (LLaDA's scheme): each ``l_n`` is still marginally uniform, so the mean stays
    unbiased, and the counts cover the range evenly (with ``N = L_b`` they are a permutation of 1..L_b).

    Args:
        stratified: Spread the N mask counts of each sample evenly over 1..L_b (unbiased, lower variance).
        micro_batch: Rows per forward; ``None`` runs all draws at once.

    Shapes:
        prompt_ids ``[B, P]``, completion_ids and completion_mask ``[B, L]`` → ``float32 [B]``.
    """
    plan = elbo_l_plan(
        prompt_ids, completion_ids, completion_mask, num_samples=num_samples, generator=generator,
        stratified=stratified,
    )
    return score_plan(model, prompt_ids, completion_ids, plan, mask_id=mask_id, micro_batch=micro_batch)


@likelihood_estimators.register("coupled")
def coupled(
    model: Callable[[Tensor], Any],
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    mask_id: int,
    num_samples: int,
    generator: torch.Generator | None,
    stratified: bool = True,
    micro_batch: int | None = None,
) -> Tensor:
    """Complementary-mask ELBO: a random m-subset S and its complement S^c, weighted so the pair is unbiased.

    ``num_samples`` counts forwards and must be even: ``N/2`` pairs. Per pair, ``m ~ U{1..L_b}`` (stratified across
    pairs like ``elbo_l``), ``S`` a uniform ``m``-subset of the real tokens, ``S^c`` the other real tokens, and

        est_pair = (L/(2m))·g(S) + (L/(2(L−m)))·g(S^c)   for m < L,      est_pair = g(S) = g(all)   for m = L,

    averaged over pairs; every real token is masked in exactly one row of each pair (DiffuCoder's coupling,
    Gong et al. 2025, arXiv:2506.20639).

    Derivation (why these weights): ``S`` is a uniform ``m``-subset and ``S^c`` a uniform ``(L−m)``-subset, so
    ``E[est] = (1/L)·[Σ_{m<L} (L/(2m))·h_m + h_L + Σ_{m<L} (L/(2(L−m)))·h_{L−m}]
    = Σ_{m<L} h_m/(2m) + Σ_{k<L} h_k/(2k) + h_L/L = Σ_l h_l/l = ELBO``. The complement size ``L−m`` is uniform on
    ``{0..L−1}``: the fully masked configuration only arises on the ``S`` side (its partner is empty and needs no
    forward), hence its full weight. Each row weight is the l-sampling weight ``L/|row|`` (doubled for the fully
    masked row), since rows are averaged over ``N = 2·pairs``. Why a count rather than a timestep: for the t-space
    pair with ``t ~ U(0,1)``, ``|S|`` is uniform on ``{0..L}`` and ``E[1/t | |S| = m] = (L+1)/m``, so averaging out
    ``t`` (Rao-Blackwellization) already gives count sampling with bounded weights; drawing ``m`` from ``{1..L}``
    is the same construction without the wasted ``m = 0`` pair. No ε, no ``1/t`` tail, weights ≤ L_b. A truncated
    ``t ~ U(0.2, 0.8)`` would bound the weights too, but changes the target (see below).

    Deviations (documented, not reproduced): DiffuCoder's ``coupled_grpo.py`` draws one ``t ~ U(0.2, 0.8)`` per batch,
    masks ``r < t`` / ``r > t`` with weights ``1/t`` and ``1/(1−t)`` and averages with a third, fully masked forward: a
    token-level value for a clipped ratio that is unbiased neither for the ELBO (``t`` is truncated to [0.2, 0.8]) nor
    for a normalized log-likelihood. Summed over the tokens its expectation is ``½·h_L + Σ_l w_l·h_l`` with ``w_l =
    (1/0.6)∫_{0.2}^{0.8} C(L,l)·t^{l−1}(1−t)^{L−l} dt``: half of d1's one-step score plus a t-truncated ELBO
    (``coupled_grpo.py`` L106-122, L254-279 at apple/ml-diffucoder@f735e01; exact enumeration at L = 5 gives a target
    about 1.5× the ELBO in magnitude). Its completion tail after the first EOS is masked in the fully masked row only
    and follows ``r < t`` / ``r > t`` in the pair (visible context in one of the two rows); mmrl masks the tail in every
    row, as d1 and SPG do (:mod:`~mmrl.plugins.dllm.masking`). dLLM-RL's ``coupled`` method
    (Gen-Verse/dLLM-RL@10b4fd1 ``train/rl_llada.py`` L347-399) draws ``t ~ U(lower_p, upper_p)`` (0.1, 0.9) per pair,
    masks each completion token w.p. ``t`` in one row and the complement in the other (an empty row is dropped), and
    feeds each masked token's own log-prob to a per-token ratio, each row's surrogate averaged over its masked tokens
    (L573-607): no importance weights and no ELBO; mmrl has it as ``random_masking`` with ``coupled: true``.

    Args:
        stratified: Spread the pair counts ``m`` of each sample evenly over 1..L_b (unbiased, lower variance).
        micro_batch: Rows per forward; ``None`` runs all draws at once.

    Shapes:
        prompt_ids ``[B, P]``, completion_ids and completion_mask ``[B, L]`` → ``float32 [B]``.
    """
    plan = coupled_plan(
        prompt_ids, completion_ids, completion_mask, num_samples=num_samples, generator=generator,
        stratified=stratified,
    )
    return score_plan(model, prompt_ids, completion_ids, plan, mask_id=mask_id, micro_batch=micro_batch)


@likelihood_estimators.register("coupled_cv")
def coupled_cv(
    model: Callable[[Tensor], Any],
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    mask_id: int,
    num_samples: int,
    generator: torch.Generator | None,
    stratified: bool = True,
    control: Annotated[float, ANY_FINITE] = 1.0,
    micro_batch: int | None = None,
) -> Tensor:
    """Complementary pairs with the fully masked forward as the exact ``l = L`` term and a control variate.

    ``num_samples = N ≥ 2`` forwards: one with every real token masked (d1's one-step forward), giving
    ``ℓ_i^0 = log p_θ(x^i | c, all masked)`` for every token, and ``R = N − 1`` "D rows": complementary pairs
    ``(S, S^c)`` with ``|S| = m`` stratified over ``1..L−1`` (plus one row of uniform size when ``R`` is odd). With
    ``w_S = (L−1)/(|S|·R)`` and ``W_i = Σ_{D rows S ∋ i} w_S``,

        est = (1/L)·g(all) + Σ_{D rows} w_S·g(S) + β·( ((L−1)/L)·g(all) − Σ_i W_i·ℓ_i^0 ),   g(all) = Σ_i ℓ_i^0.

    Derivation. ``ELBO = Σ_{l=1..L} h_l/l`` (:func:`exact_elbo`); the ``l = L`` term is ``g(all)/L``, computed exactly
    by row 0. Every D row's set is uniform given its size ``l ∈ 1..L−1`` and the expected number of D rows of size
    ``l`` is ``Q(l) = R/(L−1)`` (each pair contributes ``2/(L−1)``, the odd row ``1/(L−1)``), so with the weight
    ``1/(l·Q(l))`` (the balance heuristic of multiple importance sampling), ``E[Σ w_S·g(S)] = Σ_{l<L} h_l/l``: the
    first two terms are unbiased for the ELBO. The same weights applied to the row-0 log-probs of the D rows' tokens
    have the known mean ``Σ_{l<L} (1/l)·(l/L)·g(all) = ((L−1)/L)·g(all)``, so the β term has mean zero for every β: the
    estimate is unbiased whatever ``control`` is. With β = 1 it is
    ``g(all) + Σ_S w_S Σ_{i∈S} (ℓ_i(S) − ℓ_i^0)``: the D rows only estimate how much each token gains from the
    context it sees, and which tokens fall in which row no longer matters when that gain is similar across tokens.
    That is the regime of the toy benchmark (docs/performance.md: 15× lower sd than ``elbo_t`` at 8 forwards);
    when the all-masked log-probs are far below the in-context ones and vary a lot across tokens (long LLaDA
    completions), a smaller β may do better: β = 0 keeps the exact ``l = L`` row and drops the control.

    Relation to the others: the complementary pairs are DiffuCoder's coupling (Gong et al. 2025,
    arXiv:2506.20639), the stratified counts LLaDA's (``get_log_likelihood.py``), the shared plan for π_θ, π_old and
    π_ref VRPO's antithetic sampling (arXiv:2505.19223). Unlike :func:`coupled`, the fully masked configuration is
    always evaluated (one row) instead of being drawn with probability ``1/L`` per pair, where its ``L/2``-fold weight
    was the largest source of between-count variance. The weights of row 0 can be negative (``MaskPlan.reduce`` is
    linear; the EUBO reduction is not defined for this plan).

    Args:
        stratified: Spread the pair sizes ``m`` of each sample evenly over ``1..L−1``.
        control: β, the weight of the control variate (any finite number keeps the estimate unbiased; 1 removes
            the token-selection noise of the D rows, 0 disables the control).
        micro_batch: Rows per forward; ``None`` runs all draws at once.

    Shapes:
        prompt_ids ``[B, P]``, completion_ids and completion_mask ``[B, L]`` → ``float32 [B]``.
    """
    plan = coupled_cv_plan(
        prompt_ids, completion_ids, completion_mask, num_samples=num_samples, generator=generator,
        stratified=stratified, control=control,
    )
    return score_plan(model, prompt_ids, completion_ids, plan, mask_id=mask_id, micro_batch=micro_batch)


@likelihood_estimators.register("espo")
def espo(
    model: Callable[[Tensor], Any],
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    mask_id: int,
    num_samples: int,
    generator: torch.Generator | None,
    coupled: bool = True,
    stratified: bool = False,
    micro_batch: int | None = None,
) -> Tensor:
    """ESPO's ELBO estimate: ``x ~ U{0..L}``, a uniform ``x``-subset ``S`` weighted ``(L+1)/x`` and its complement
    weighted ``(L+1)/(L−x)``, the two rows averaged.

    Per draw (``coupled=True``, two forwards),

        est = ½·[ ((L+1)/x)·g(S) + ((L+1)/(L−x))·g(S^c) ],     x ~ U{0, 1, .., L},

    averaged over the ``num_samples / 2`` draws; with ``coupled=False`` one forward per draw, ``((L+1)/x)·g(S)``.
    The prompt is never masked. Ou et al. 2025, "Principled RL for Diffusion LLMs Emerges from a Sequence-Level
    Perspective" (ESPO), arXiv:2512.03759; ML-GSAI/ESPO@b5f2dac ``espo/espo_trainer.py``: ``forward_process``
    L55-75 (``k = randint(0, L+1)``, counts ``round(linspace(k, k + (b−1)(L+1)/b, b)) mod (L+1)`` over the ``b``
    rows of a micro-batch, a random ``x``-subset per row, the returned mask ratio ``x/(L+1)``), ``_get_elbo``
    L376-438 (``CE / p_mask`` on the masked positions; with ``reduce_var`` a second forward with the complement
    masked, ``CE / (L/(L+1) − p_mask)``, the two halved; the negative sum over the completion), ``_get_elbo_mc``
    L440-474 (the mean over ``num_mc`` seeds). ESPO's recipes use ``reduce_var: true`` and ``num_mc: 2`` (four
    forwards: ``num_samples: 4`` here) for LLaDA, ``reduce_var: false``, ``num_mc: 1`` in the Dream/LLaDA demos.

    Unbiasedness: each row alone is unbiased for the ELBO ``Σ_{l=1..L} h_l/l`` (:func:`exact_elbo`). ``S`` given
    ``x`` is a uniform ``x``-subset, so ``E[((L+1)/x)·g(S)] = Σ_{x=1..L} (1/(L+1))·((L+1)/x)·h_x = Σ_x h_x/x``
    (``x = 0`` scores nothing); ``S^c`` is a uniform ``(L−x)``-subset with ``L−x`` uniform on ``0..L`` as well, so
    the same sum holds for the second row, and for their mean. Weights are bounded by ``L+1``. Compared with
    :func:`coupled` (``m ~ U{1..L}``, weights ``L/m`` and ``L/(L−m)``, the fully masked row doubled): the same
    complementary coupling, with ``L+1`` equally likely counts instead of ``L`` and weights ``(L+1)/|row|``.

    Deliberate differences from ESPO's code: the counts are drawn per sample (one offset per sample and draw, from
    the sample's own stream) instead of one offset per micro-batch spread over its ``b`` rows (each row's count is
    still marginally uniform in ESPO, except when ``(L+1)·j/b`` ends in ``.5``, e.g. ``b = 2`` with an odd ``L+1``,
    where ``torch.round``'s half-to-even makes it non-uniform); ``stratified`` spreads a sample's own draws
    instead. ``L`` is the number of scored tokens: ESPO scores the whole generated length (no completion mask in the
    loss), which the plugin reproduces with ``plugin.score_tail: true``; with the plugin's default the tail after
    the first stop token is masked and never scored (:mod:`~mmrl.plugins.dllm.masking`).

    Args:
        coupled: Add the complement row of every draw (ESPO's ``reduce_var``, its default); needs an even number
            of forwards (``plugin.num_mc_samples``).
        stratified: Spread the counts ``x`` of each sample's draws evenly over ``0..L`` (ESPO: iid, one seed per
            MC sample).
        micro_batch: Rows per forward; ``None`` runs all draws at once.

    Shapes:
        prompt_ids ``[B, P]``, completion_ids and completion_mask ``[B, L]`` → ``float32 [B]``.
    """
    plan = espo_plan(
        prompt_ids, completion_ids, completion_mask, num_samples=num_samples, generator=generator,
        coupled=coupled, stratified=stratified,
    )
    return score_plan(model, prompt_ids, completion_ids, plan, mask_id=mask_id, micro_batch=micro_batch)


@likelihood_estimators.register("spg_lower")
def spg_lower(
    model: Callable[[Tensor], Any],
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    mask_id: int,
    num_samples: int,
    generator: torch.Generator | None,
    masking: Literal["random", "block"] = "random",
    block_length: Annotated[int, BLOCK_LENGTH] = 32,
    p_mask_prompt: Annotated[float, PROBABILITY] = 0.0,
    stratified: bool = False,
    micro_batch: int | None = None,
) -> Tensor:
    """SPG's ELBO-type lower bound (used for samples with positive advantage), random or block-wise masking.

    Wang et al. 2025, "SPG: Sandwiched Policy Gradient", arXiv:2510.09541 (ELBO for A > 0, block-wise masking).

    ``masking="random"`` (SPG ``forward_type=random`` with min_t = 0, max_t = 1): l-sampling, identical to
    ``elbo_l`` with ``stratified=False`` — an unbiased estimate of the ELBO, a lower bound on the any-order
    likelihood. SPG's code reports the mean over masked tokens ``g(S)/l``; times ``L_b`` that is ``(L_b/l)·g(S)``,
    and SPG's loss re-weights each sequence by its length, so this sequence-scale value is the same quantity.

    ``masking="block"`` (``block_random``): per draw a block ``k`` (of ``block_length`` completion positions) among
    the ``K_b`` blocks that hold real tokens, blocks before ``k`` clean, real tokens of later blocks masked, and
    ``l ~ U{1..n_k}`` random real tokens of block ``k`` masked and scored with weight ``K_b·n_k/l``. This is unbiased
    for the *block* ELBO ``Σ_k Σ_l (1/l)·E_{S⊂block k,|S|=l} g_k(S)`` (``exact_elbo(..., block_length=...)``), the
    ELBO of the semi-autoregressive factorization ``Π_k π(x_k | c, x_{<k})`` that block decoding samples from.
    Deviation: SPG's code also averages the log-probs of the fully masked later blocks into its per-sequence mean
    (its ``block_mask`` is computed but unused) and divides by a completion-wide mask count; we score only the
    chosen block, which is what makes the estimate a bound. Blocks are visited uniformly without replacement across
    the N draws (SPG's code takes ``randperm(num_blocks) % K_b``, which favours the first blocks and can repeat one
    when the completion fills fewer blocks than the generation budget), prompt tokens masked w.p. ``p_mask_prompt``
    (SPG runs: 0.15, which changes the target to an average over corrupted prompts). SPG's code masks w.p.
    ``p_mask_prompt`` every position before the chosen block, the clean earlier completion blocks included
    (``~is_mask`` covers them, ``spg_trainer.py`` L373-376 at facebookresearch/SPG@a1c7120), and scores those that it
    masks; mmrl keeps earlier blocks clean as the block factorization conditions on them (the paper's description).

    Args:
        masking: ``"random"`` (l-sampling over the whole completion) or ``"block"`` (SPG block-wise masking).
        block_length: Completion positions per block for ``masking="block"``, >= 1 (SPG: 32, the decoding block).
        p_mask_prompt: Probability in [0, 1] of masking each prompt position (SPG runs: 0.15).
        stratified: Stratify the mask counts across draws (``masking="random"`` only; SPG draws them iid).
        micro_batch: Rows per forward; ``None`` runs all draws at once.

    Shapes:
        prompt_ids ``[B, P]``, completion_ids and completion_mask ``[B, L]`` → ``float32 [B]``.
    """
    plan = spg_plan(
        prompt_ids, completion_ids, completion_mask, num_samples=num_samples, generator=generator, bound="lower",
        masking=masking, block_length=block_length, p_mask_prompt=p_mask_prompt, stratified=stratified,
    )
    return score_plan(model, prompt_ids, completion_ids, plan, mask_id=mask_id, micro_batch=micro_batch)


@likelihood_estimators.register("spg_upper")
def spg_upper(
    model: Callable[[Tensor], Any],
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    mask_id: int,
    num_samples: int,
    generator: torch.Generator | None,
    beta: Annotated[float, RENYI_BETA] = 1.5,
    masking: Literal["random", "block"] = "random",
    block_length: Annotated[int, BLOCK_LENGTH] = 32,
    p_mask_prompt: Annotated[float, PROBABILITY] = 0.0,
    stratified: bool = False,
    micro_batch: int | None = None,
) -> Tensor:
    """SPG's Rényi-type evidence upper bound (EUBO, used for samples with negative advantage).

    est = L_b · mean_{observed i} (1/β)·log( (1/N) Σ_n w_{n,i} · p_θ(x^i | c̃_n, x̃_n)^β ),

    with the masks and weights ``w`` of ``spg_lower`` (same options, same draws for the same generator state):
    ``w_{n,i} = 1[i ∈ S_n]·L_b/l_n`` for random masking — exactly SPG's ``1[masked]/t̂`` with the empirical mask
    ratio ``t̂ = l/L_b`` — and ``K_b·n_k/l`` for block masking. Tokens masked in no draw are left out of the mean
    (as in SPG). Wang et al. 2025, arXiv:2510.09541 (EUBO for A < 0; runs use β = 1.5 on GSM8K/MATH, 2.0 on
    Countdown, 1.0 on Sudoku; the ``mix`` objective ω·EUBO + (1−ω)·ELBO belongs to the loss — use
    :func:`plan_token_logprobs` and ``plan.reduce`` to get both from one forward).

    What is provable here: for every real token, ``w_i`` is a probability density over the draws
    (``E[w_i] = 1``), the ELBO is ``Σ_i E[w_i log p_i]``, and by Jensen
    ``(1/β) log E[w_i p_i^β] ≥ E[w_i log p_i]``; so the ``N → ∞`` limit of this estimate is ≥ the ELBO (for random
    masking; ≥ the block ELBO for block masking), and as ``β → ∞`` it tends to ``Σ_i log max_S p(x^i | c, x_S)``,
    which bounds the likelihood of every decoding order. That it upper-bounds ``log π_θ`` for finite β is SPG's
    theorem, which this code does not re-derive; for a model whose conditionals are not consistent with one joint it
    can fail (L = 2 tokens a, b, β = 1: exp(limit) − any-order likelihood
    ``= ¼·(p(a|both masked) − p(a|b visible))·(p(b|both masked) − p(b|a visible))``, negative when the two
    differences have opposite signs). For finite N the log of a sample mean is biased low (Jensen again), by
    ``O(1/N)``, and tokens masked in no draw drop out: on the tiny test model with N = 8 forwards the estimate
    averaged *below* the exact ELBO for L = 5, so at small N it is not an upper bound in practice.

    Args:
        beta: Rényi order β ≥ 1 (SPG: 1.5 for GSM8K/MATH, 2.0 Countdown, 1.0 Sudoku).
        masking: ``"random"`` or ``"block"`` (see ``spg_lower``).
        block_length: Completion positions per block for ``masking="block"``, >= 1.
        p_mask_prompt: Probability in [0, 1] of masking each prompt position.
        stratified: Stratify the mask counts across draws (``masking="random"`` only).
        micro_batch: Rows per forward; ``None`` runs all draws at once.

    Shapes:
        prompt_ids ``[B, P]``, completion_ids and completion_mask ``[B, L]`` → ``float32 [B]``.
    """
    plan = spg_plan(
        prompt_ids, completion_ids, completion_mask, num_samples=num_samples, generator=generator, bound="upper",
        masking=masking, block_length=block_length, p_mask_prompt=p_mask_prompt, stratified=stratified, beta=beta,
    )
    return score_plan(model, prompt_ids, completion_ids, plan, mask_id=mask_id, micro_batch=micro_batch)


@likelihood_estimators.register("trace")
def trace(
    model: Callable[[Tensor], Any],
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    mask_id: int,
    num_samples: int = 1,
    generator: torch.Generator | None = None,
    step_map: Tensor | None = None,
    shrink: Annotated[int, SHRINK] = 8,
    tail: Literal["masked", "trajectory"] = "masked",
    micro_batch: int | None = None,
) -> Tensor:
    """TraceRL's trajectory-aware score: each real token's log-prob in the context in which the sampler decoded it,
    one masked forward per step group, ``Σ_i log p_θ(x^i | c, x^{decoded before group(i)})``.

    Wang et al. 2025 (TraceRL), arXiv:2509.06949; Gen-Verse/dLLM-RL@10b4fd1 ``train/rl_llada.py``: the step map's
    distinct steps merged ``shrink`` at a time (``collapse_k_unique`` L203-215), one training row per group with every
    position of that group or a later one masked and the group's tokens scored (L248-292). The plan is
    :func:`~mmrl.plugins.dllm.masking.trace_plan`, fixed by the trajectory: no randomness, so ``num_samples`` and
    ``generator`` are unused, and the policy, old policy and reference see the same rows. With ``shrink = 1`` (and
    ``tail="trajectory"``) every token is scored given exactly the state the sampler was in when it committed it
    (everything committed at earlier steps; the tokens of one step were drawn independently given that state), so
    the sum is the log-probability of the sampled tokens along the sampler's own path (not of its choice of which
    positions to commit); with ``shrink > 1`` the tokens of a group are scored with the whole group masked, a
    context a little poorer than the one they were decoded in. Not an ELBO: the sum conditions on one decoding
    order, the sampled one. The plugin returns each token's own log-prob as its action column (a per-token ratio, as
    ``one_step``).

    Args:
        step_map: ``[B, L]`` the step at which each completion position was committed (``GenerationOutput.step_map``
            of the sampler that produced the completion); required.
        shrink: Distinct decoding steps per group (TraceRL's ``training.shrink``, 8 in its configs), >= 1.
        tail: ``"masked"`` (the plugin's convention: the tail after the first stop token is masked in every row) or
            ``"trajectory"`` (TraceRL: the tail is kept as decoded, visible to the groups decoded after it). It is
            never scored either way.
        micro_batch: Rows per forward; ``None`` forwards every row of every completion at once (rows of different
            completions are packed into one batch).

    Shapes:
        prompt_ids ``[B, P]``, completion_ids, completion_mask and step_map ``[B, L]`` → ``float32 [B]``.
    """
    del num_samples, generator  # the plan is the trajectory's: nothing to draw
    if step_map is None:
        raise ValueError("the trace estimator needs step_map [B, L], the decoding step of every completion position")
    plan = trace_plan(prompt_ids, completion_ids, completion_mask, step_map=step_map, shrink=shrink, tail=tail)
    return score_plan(model, prompt_ids, completion_ids, plan, mask_id=mask_id, micro_batch=micro_batch)


@likelihood_estimators.register("random_masking")
def random_masking(
    model: Callable[[Tensor], Any],
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    mask_id: int,
    num_samples: int,
    generator: torch.Generator | None,
    t_low: Annotated[float, MASK_RATE] = 0.1,
    t_high: Annotated[float, MASK_RATE] = 0.9,
    coupled: bool = False,
    micro_batch: int | None = None,
) -> Tensor:
    """UniGRPO's random masking (MMaDA, Yang et al. 2025, arXiv:2505.15809) as released in dLLM-RL: per draw a
    masking rate ``t ~ U(t_low, t_high)``, each real token masked w.p. ``t``, each masked token scored by its own
    log-prob; a token's action value is the mean of its log-probs over the draws that mask it.

    est = Σ_i (1/c_i) Σ_{n: i∈S_n} log p_θ(x^i | c, x_{S_n}),   S_n ~ Bern(t_n)^{L_b},  t_n ~ U(t_low, t_high),

    with ``c_i`` the number of draws (of ``N = num_samples``, dLLM-RL's ``mask_times_per_sample``) that mask token
    ``i``; tokens masked in no draw contribute nothing. Gen-Verse/dLLM-RL@10b4fd1 ``train/rl_llada.py`` L301-345 and
    ``train/rl_dream.py`` L307-351 (the same with Dream's shift): one training row per draw, the prompt never masked,
    pads after the first ``post_num`` masked and never scored, empty draws dropped. The configs that select it,
    ``configs/rl_mmada_v.yaml`` and ``configs/rl_lladav.yaml`` (L66-71: ``lower_p 0.1``, ``upper_p 0.9``,
    ``mask_times_per_sample 2``, ``post_num 1``, ``data_type: mmu``), run ``train/rl_mmada_v.py`` (``rl_v.py``
    L168-175; the ``rl_lladav.py`` it names for LLaDA-V is not in the repository at that commit), whose text path
    (L305-404) is ``rl_llada.py``'s but whose ``mmu`` path (``prepare_inputs_and_labels_for_mmu``, L535-577) masks
    the first completion token of a draw that masks nothing (L557-564) instead of dropping it; mmrl drops it, as the
    text path (it happens w.p. ``E[(1 − t)^L]``, negligible beyond a few tokens). ``post_num 1`` scores the first
    pad id (``<|endoftext|>``) after the response as well: for a response that ends ``<|eot_id|><|endoftext|>…``
    dLLM-RL scores both, mmrl's real tokens stop at the first stop token (either id), so mmrl scores one token
    fewer there; they agree when the response ends at its first ``<|endoftext|>``. Gen-Verse/MMaDA@3cdb870 has no RL
    code of its own: its README (L192-194) points to dLLM-RL for UniGRPO.
    The plan is :func:`~mmrl.plugins.dllm.masking.random_masking_plan`.

    How it maps onto mmrl's token columns (``objective: grpo``; the plugin lists it with ``one_step`` and ``trace``
    as a per-token estimator): dLLM-RL's loss (``rl_llada.py`` L573-607) takes, per row, the clipped per-token
    surrogate with the ratio ``exp(logp_new − logp_old)`` of each masked token, averages it over the row's masked
    tokens and then over the rows. mmrl holds one value per token: the token's log-prob averaged over the draws that
    mask it, so its ratio is the geometric mean of its per-draw ratios (equal to dLLM-RL's per-row ratio when the
    token is masked in one draw, as with ``N = 1``; with several draws dLLM-RL clips each draw's ratio apart and
    mmrl clips their geometric mean). The plugin's action mask keeps the real tokens masked in at least one draw of
    the sample's plans (one per inner epoch with ``redraw_masks``): with one plan and ``N = 1``, ``aggregation:
    seq_mean_token_mean`` is then dLLM-RL's mean over the row's masked tokens, then over sequences. With ``N > 1``
    dLLM-RL weights each row by ``1/|S_n|`` and mmrl each covered token alike; with several plans a token masked only
    in another epoch's plan has the column 0 under every policy in this epoch (ratio 1, no gradient) and still counts
    in the epoch's token denominators. dLLM-RL's KL (``β·k1`` or ``k3`` of new against *old* log-probs, summed over a
    row's masked tokens, then averaged over the rows, L595-602) becomes the core's KL to the reference on the same
    columns, added to each token's loss before the aggregation, so averaged over the tokens where dLLM-RL sums a
    row's (at equal ``β`` its KL term is ``|S_n|`` times mmrl's).

    ``coupled=True`` is dLLM-RL's ``method == "coupled"`` (``rl_llada.py`` L347-399): every draw is a pair, the
    Bernoulli(t) set and its complement among the real tokens (two rows; ``num_samples`` even, ``N/2`` is its
    ``mask_times_per_sample``), so every real token is masked in exactly one row of each pair and none is left out.
    It is not mmrl's :func:`coupled` (unbiased ELBO weights ``L/m``, one sequence ratio).

    **Not an ELBO, not a bound.** In per-token form the ELBO is ``Σ_i E_{t~U(0,1)} E[log p(x^i | c, x_S) | i ∈ S]``
    with the other tokens masked w.p. ``t`` (the ``1/t`` weight cancels ``P(i ∈ S) = t``). Here there is no weight:
    as ``N → ∞`` column ``i`` tends to the same conditional mean with ``t`` drawn from the density ``∝ t`` on
    ``[t_low, t_high]`` (the rate given that ``i`` is masked; coupled, the same law when ``t_low + t_high = 1``, since
    the complement row masks at rate ``1 − t``), so the columns sum to an ELBO-like quantity with a
    tilted, truncated masking-rate law. At finite ``N`` the mean of column ``i`` is exactly ``1 − (1 − p̄)^N`` times
    that limit, ``p̄ = (t_low + t_high)/2`` the chance that one draw masks a given token: given which draws mask
    ``i``, those draws are iid from the law conditional on ``i ∈ S``, so their average has no ratio-of-sums bias;
    what is lost is the tokens no draw masks (column 0; a quarter of them at ``N = 2`` with the defaults; none with
    ``coupled``). On the toy benchmark the columns sum to +0.16 nats above the ELBO at 2 forwards without
    ``coupled``, +0.005 with it. What RL uses is the per-token ratio, exactly 1 at ``θ = θ_old`` since π_θ, π_old
    and π_ref share the plan.

    Args:
        t_low: Lowest masking rate, in (0, 1] (dLLM-RL ``lower_p``: 0.1).
        t_high: Highest masking rate, in [t_low, 1] (dLLM-RL ``upper_p``: 0.9).
        coupled: Pair every draw with its complement (dLLM-RL's ``coupled`` method); needs an even number of
            forwards (``plugin.num_mc_samples``).
        micro_batch: Rows per forward; ``None`` runs all draws at once.

    Shapes:
        prompt_ids ``[B, P]``, completion_ids and completion_mask ``[B, L]`` → ``float32 [B]``.
    """
    plan = random_masking_plan(
        prompt_ids, completion_ids, completion_mask, num_samples=num_samples, generator=generator, t_low=t_low,
        t_high=t_high, coupled=coupled,
    )
    return score_plan(model, prompt_ids, completion_ids, plan, mask_id=mask_id, micro_batch=micro_batch)


@likelihood_estimators.register("sdmc")
def sdmc(
    model: Callable[[Tensor], Any],
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    mask_id: int,
    num_samples: int,
    generator: torch.Generator | None,
    quadrature: Literal["gauss-1", "gauss-2", "gauss-3", "gauss-4", "gauss-5", "simpson"] = "gauss-2",
    masking: Literal["count", "bernoulli"] = "count",
    micro_batch: int | None = None,
) -> Tensor:
    """GDPO's semi-deterministic Monte Carlo (SDMC) ELBO: the integral over ``t`` by a fixed quadrature rule, only the
    masks at each node drawn at random.

    est = Σ_j w_j · (1/t_j) · (1/d) Σ_{r=1..d} Σ_{i∈S_{j,r}} log p_θ(x^i | c, x_{S_{j,r}}),

    with the rule's ``J`` nodes ``t_j`` and weights ``w_j`` on [0, 1] (:func:`~mmrl.plugins.dllm.masking.
    sdmc_quadrature`: ``gauss-n`` Gauss-Legendre mapped from [−1, 1] by ``t = (x+1)/2``, ``w = w_x/2``; ``simpson``
    GDPO's ``(0.1, 0.5, 1.0)`` with ``(1, 4, 1)/6``) and ``d = N/J`` mask draws per node (``num_samples`` must be a
    multiple of ``J``). Rojas et al. 2025, "Improving Reasoning for Diffusion Language Models via Group Diffusion
    Policy Optimization" (GDPO), arXiv:2510.08554. Released code: GDPO's ``gdpo/likelihood_estimators.py``
    ``NumericalIntegrationEstimator`` (the Gauss rules as closed-form nodes on [−1, 1] and ``xi = point*.5 + .5``,
    ``.5 * loss``; ``forward_process`` masks exactly ``int(p_mask * target_len)`` positions by ``randperm``;
    ``get_loss`` divides the masked tokens' cross-entropy by ``p_mask``; ``mc_batch_size`` copies per node averaged)
    and its port NVIDIA-NeMo/RL@d6d94dd ``nemo_rl/models/policy/dllm/elbo.py`` ``SdmcElboEstimator`` and
    ``get_quadrature`` (the same nodes and counts, the count clamped to at least 1, the default ``gauss-2`` with
    ``mc_samples: 1`` in ``dllm/config.py``; its earlier commits, 9e6c837 to 0ee69a7, round ``t·L`` instead of
    flooring it). Each node and draw gets a fresh mask (GDPO's ``forward_process`` runs at every node and draws a
    ``randperm`` per copy). The prompt is never masked.

    Masks (``masking``): ``"count"`` (GDPO's code, the default): exactly ``k_j = min(L, max(1, ⌊t_j·L⌋))`` real
    tokens, a uniform ``k_j``-subset (NeMo's clamp to 1; GDPO's reference code masks ``⌊t_j·L⌋`` with no clamp, so
    a node with ``t_j·L < 1`` scores nothing there; they agree once ``L ≥ 1/t_1``, e.g. ``L ≥ 5`` for ``gauss-2``).
    ``"bernoulli"``: each real token masked w.p. ``t_j``, the ELBO's own forward process.

    **Biased, and how much.** The ELBO is ``∫_0^1 f(t) dt`` with ``f(t) = (1/t)·E_{S~Bern(t)^L} g(S) =
    Σ_{l=1..L} C(L,l) t^{l−1}(1−t)^{L−l} h_l`` (:func:`exact_elbo`), a polynomial of degree at most ``L − 1`` in
    ``t`` and finite at ``t = 0`` (``f(0) = L·h_1``: ``g(∅) = 0`` cancels the ``1/t``; only a drawn mask's weight is
    singular there).
    With ``masking="bernoulli"`` the estimate's expectation is ``Σ_j w_j f(t_j)``, the quadrature of ``f``: for
    ``gauss-n`` it is *exactly* the ELBO when ``L ≤ 2n`` (Gauss-Legendre integrates degree ``≤ 2n − 1`` exactly),
    and otherwise off by the rule's error ``f^{(2n)}(ξ)·(n!)^4 / ((2n+1)·((2n)!)^3)`` for some ``ξ ∈ (0, 1)`` —
    small when ``f`` is smooth (tokens whose log-probs change little with the masking rate), not small in general
    for ``L ≫ n``. ``simpson`` is exact only for ``L = 1``. With ``masking="count"`` the expectation is
    ``Σ_j (w_j/t_j)·h_{k_j}``, ``h_k`` the mean of ``g`` over the ``k``-subsets: the count is ``⌊t_j·L⌋`` instead
    of the binomial spread around ``t_j·L``, and the weight ``1/t_j`` is not ``L/k_j``, so even a model whose
    tokens ignore their context (``h_l = l·a``) gets ``a·Σ_j w_j k_j/t_j ≠ L·a`` (e.g. ``+6.7%`` at ``L = 4``,
    ``gauss-2``: ``k = (1, 3)``). ``tests/dllm/test_sdmc.py`` enumerates both expectations against
    :func:`exact_elbo`: on its tiny random model (ELBO −12.63 at L = 3, −35.34 at L = 5) ``gauss-2`` is off by
    −2.95 and +6.03 nats with ``count`` masks, by 0 and 2e-5 with ``bernoulli``; the toy benchmark reports the bias
    next to the sd. Short completions are the worst case for counts: with ``L = 1`` the
    token is masked at every node and the estimate's mean is ``(Σ_j w_j/t_j)·h_1`` (3× the ELBO for ``gauss-2``;
    GDPO's unclamped count gives 0 instead); ``bernoulli`` masks it w.p. ``t_j``, which cancels the ``1/t_j``.
    What SDMC buys is variance against sampling ``t``: the ``1/t`` weight is bounded by ``1/t_1``. On the toy
    benchmark (2-4 real tokens; docs/performance.md) its sd is 1.5× (``count``) to 1.8× (``bernoulli``) below
    ``elbo_t``'s exact sd at 2 and 8 forwards, GDPO's claim against double Monte Carlo, but 2-4× above ``elbo_l``'s
    and ``coupled``'s, whose count laws already remove the ``1/t`` tail.

    Args:
        quadrature: ``gauss-1`` .. ``gauss-5`` (Gauss-Legendre on [0, 1]) or ``simpson`` (GDPO's nodes 0.1, 0.5, 1).
        masking: ``"count"`` (GDPO: ``⌊t_j·L⌋`` tokens, at least 1) or ``"bernoulli"`` (each token w.p. ``t_j``).
        micro_batch: Rows per forward; ``None`` runs all draws at once.

    Shapes:
        prompt_ids ``[B, P]``, completion_ids and completion_mask ``[B, L]`` → ``float32 [B]``.
    """
    plan = sdmc_plan(
        prompt_ids, completion_ids, completion_mask, num_samples=num_samples, generator=generator,
        quadrature=quadrature, masking=masking,
    )
    return score_plan(model, prompt_ids, completion_ids, plan, mask_id=mask_id, micro_batch=micro_batch)


# ---------------------------------------------------------------------- exact oracle
@likelihood_estimators.register("uniform_one_step")
def uniform_one_step(
    model: torch.nn.Module,
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    mask_id: int | None = None,
    num_samples: int = 1,
    generator: torch.Generator | None = None,
    eps: Annotated[float, ELBO_EPS] = 1e-3,
    self_conditioning_p: Annotated[float, PROBABILITY] = 0.5,
    micro_batch: int | None = None,
) -> Tensor:
    """DiffusionGemma's training objective as a likelihood surrogate (canvas models only;
    :mod:`mmrl.plugins.dllm.canvas`): ``(1/D) Σ_d Σ_{i real} log p_θ(x^i | c, x^{<canvas(i)}, z_{t_d})`` with
    ``t_d ~ U(eps, 1)`` and the canvas corrupted by uniform random tokens at rate ``t_d``, self-conditioned with
    probability ``self_conditioning_p``
    (NeMo AutoModel's DiffusionGemma SFT: eps 1e-3, self_conditioning_p 0.5).

    ``model`` is a ``DiffusionGemmaForBlockDiffusion``; ``prompt_ids`` are unpadded prompts (every token real);
    ``mask_id`` is unused (there is no mask token). The plugin draws the plans per sample
    (:func:`~mmrl.plugins.dllm.canvas.draw_uniform_plan`) and calls
    :func:`~mmrl.plugins.dllm.canvas.canvas_token_logprobs` itself.

    Shapes:
        prompt_ids ``[B, P]``, completion_ids and completion_mask ``[B, G]`` → ``float32 [B]``.
    """
    from mmrl.plugins.dllm.canvas import (
        canvas_token_logprobs,
        draw_uniform_plan,
        text_config,
        uniform_one_step_scores,
    )

    del mask_id
    rows = completion_ids.shape[0]
    if generator is None:  # the global RNG decides, as for the other estimators
        generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,))))
    plan = draw_uniform_plan(completion_mask, canvas_length=int(model.config.canvas_length),
                             vocab_size=int(text_config(model).vocab_size), num_samples=num_samples,
                             generators=[generator] * rows, eps=eps, self_conditioning_p=self_conditioning_p)
    token_logp = canvas_token_logprobs(model, prompt_ids, torch.ones_like(prompt_ids), completion_ids,
                                       completion_mask, plan, canvas_length=int(model.config.canvas_length),
                                       eos_id=_first_id(text_config(model).eos_token_id), micro_batch=micro_batch)
    return uniform_one_step_scores(token_logp, plan).sum(dim=-1)


def _first_id(token: int | list[int]) -> int:
    return int(token[0]) if isinstance(token, (list, tuple)) else int(token)


def elbo_size_weights(num_tokens: int, eps: float = 0.0) -> list[float]:
    """The weight of ``h_l`` (l = 1..n) in the t-sampling ELBO with ``t ~ U(ε, 1)``.

    ``w_l(ε) = (1/(1−ε))·C(n,l)·∫_ε^1 t^{l−1}(1−t)^{n−l} dt``; ``w_l(0) = C(n,l)·B(l, n−l+1) = 1/l``. For ε > 0 the
    integral is expanded as ``Σ_k C(n−l,k)(−1)^k (1 − ε^{l+k})/(l+k)`` (exact; fine in float64 for n ≤ 20).
    """
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    if eps == 0.0:
        return [1.0 / l for l in range(1, num_tokens + 1)]
    weights = []
    for l in range(1, num_tokens + 1):
        integral = sum(
            math.comb(num_tokens - l, k) * (-1) ** k * (1.0 - eps ** (l + k)) / (l + k)
            for k in range(num_tokens - l + 1)
        )
        weights.append(math.comb(num_tokens, l) * integral / (1.0 - eps))
    return weights


def exact_elbo(
    model: Callable[[Tensor], Any],
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    mask_id: int,
    eps: float = 0.0,
    block_length: int | None = None,
    max_tokens: int = 12,
    micro_batch: int | None = 1024,
) -> Tensor:
    """Exact masked-diffusion ELBO by enumerating every mask set (a test oracle for small L).

    ELBO = Σ_{l=1..L} (1/l) · (1/C(L,l)) · Σ_{|S|=l} Σ_{i∈S} log p_θ(x^i | c, x_S)   (real tokens only; the tail
    after the first EOS is masked in every row, as in every estimator).

    Derivation. ``ELBO = ∫_0^1 E_{S~Bern(t)^L}[(1/t)·g(S)] dt``. Given ``t``, ``|S| ~ Bin(L, t)`` and, given
    ``|S| = l``, ``S`` is a uniform ``l``-subset, so ``E[g(S) | t] = Σ_l C(L,l) t^l (1−t)^{L−l} h_l`` (the ``l = 0``
    term is ``g(∅) = 0``). Exchanging sum and integral,
    ``ELBO = Σ_{l≥1} h_l ∫_0^1 C(L,l) t^{l−1}(1−t)^{L−l} dt = Σ_l h_l·C(L,l)·B(l, L−l+1)`` and
    ``C(L,l)·B(l, L−l+1) = [L!/(l!(L−l)!)]·[(l−1)!(L−l)!/L!] = 1/l``. Writing ``h_l`` as the average over the
    ``C(L,l)`` subsets gives the formula above. The same sum is the any-order autoregressive ELBO
    ``E_σ Σ_k log p(x^{σ_k} | c, x^{σ_{<k}})`` (at step ``k`` the ``l = L−k+1`` still-masked positions form a
    uniform ``l``-subset and the predicted one is uniform in it, contributing ``h_l/l``), hence ≤ the any-order
    log-likelihood ``log E_σ Π_k p(...)`` by Jensen.

    With ``eps > 0`` the weights ``1/l`` become :func:`elbo_size_weights` ``(L, eps)``: the exact expectation of
    ``elbo_t(eps=eps)``. With ``block_length`` the completion is cut into blocks of that many positions and the
    result is the block (semi-autoregressive) ELBO ``Σ_k ELBO_k``, where block ``k`` is enumerated with earlier
    blocks clean and the real tokens of later blocks masked: the exact expectation of ``spg_lower(masking="block")``.

    Args:
        eps: Smallest timestep ε of the t-sampling estimator whose exact mean is wanted (0: the ELBO).
        block_length: Block size for the block ELBO; ``None`` treats the completion as one block.
        max_tokens: Largest number of real tokens per block to enumerate (2^n − 1 forwards per block).
        micro_batch: Rows per forward.

    Shapes:
        prompt_ids ``[B, P]``, completion_ids and completion_mask ``[B, L]`` → ``float32 [B]``.
    """
    real = completion_mask.to(device=completion_ids.device).bool()
    batch, length = completion_ids.shape
    results = []
    for b in range(batch):
        positions = real[b].nonzero().squeeze(-1).tolist()
        size = length if block_length is None else int(block_length)
        groups: dict[int, list[int]] = {}
        for position in positions:
            groups.setdefault(position // size, []).append(position)
        masks, coefficients = [], []
        for block, members in groups.items():
            if len(members) > max_tokens:
                raise ValueError(f"exact_elbo enumerates 2^n subsets; block has n = {len(members)} > {max_tokens}")
            later = [p for p in positions if p // size > block]
            weights = elbo_size_weights(len(members), eps)
            for l in range(1, len(members) + 1):
                coefficient = weights[l - 1] / math.comb(len(members), l)
                for subset in itertools.combinations(members, l):
                    row = torch.zeros(length, dtype=torch.bool, device=completion_ids.device)
                    row[list(subset)] = True
                    masks.append((row, later))
                    coefficients.append(coefficient)
        if not masks:
            results.append(torch.zeros((), dtype=torch.float32, device=completion_ids.device))
            continue
        scored = torch.stack([row for row, _ in masks])  # [R, L]
        masked = scored | ~real[b]  # the tail after the first EOS is masked in every row
        for r, (_, later) in enumerate(masks):
            masked[r, later] = True
        rows = scored.shape[0]
        completion = torch.where(masked, mask_id, completion_ids[b].unsqueeze(0))
        inputs = torch.cat([prompt_ids[b].unsqueeze(0).expand(rows, -1), completion], dim=-1)
        logp = _scored_logprobs(
            model, inputs, completion_ids[b].unsqueeze(0).expand(rows, -1), scored, prompt_ids.shape[1], micro_batch
        )
        coefficient = torch.tensor(coefficients, dtype=torch.float64, device=logp.device)
        results.append((coefficient * logp.to(torch.float64).sum(dim=-1)).sum().to(torch.float32))
    return torch.stack(results)
