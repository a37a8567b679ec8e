"""Benchmarks of the dLLM likelihood estimators on the bundled toy masked diffusion LM (CPU).

Part 1 (``--part variance``): every estimator's spread at an equal budget of masked forwards per completion.
Completions are sampled (temperature 1) from the toy model for held-out prompts; each estimator is run ``--repeats``
times per completion with independent mask draws. Reported per estimator and budget: the mean bias against the exact
ELBO (enumerated over all mask subsets; the completions are at most 4 tokens), the standard deviation of one
estimate (root mean over completions of the per-completion variance), and the standard deviation of the difference
``est(θ') − est(θ)`` between the model and a slightly perturbed copy — with the two scored on one shared mask plan
(as the plugin does for π_θ / π_old / π_ref) and on independent plans. ``espo`` (ESPO's count-sampled ELBO, coupled
and not) is in the table with the tail masked, as every estimator here: it then estimates the same ELBO as the others
(of the real tokens), and :func:`espo_enumeration` checks its weights against the exact ELBO by enumeration.
``trace`` (TraceRL) is not: it draws nothing and is no ELBO estimate; :func:`trace_report` says where it sits against
the exact ELBO on the same completions, with the sampler's own step maps. ``random_masking`` (UniGRPO / dLLM-RL) is in
the table although it is no ELBO estimate either (its bias column says how far its sum of per-token log-probs is);
``sdmc`` (GDPO's quadrature ELBO) runs at the budgets that are a multiple of its nodes, and
:func:`sdmc_enumeration` gives its exact expectation per rule and masking (the ``gauss-4`` rows run at the budgets
that are a multiple of 4 only).

Part 2 (``--part training``): held-out greedy accuracy against RL steps on the toy world (configs/dllm/toy.yaml) for
the one_step (per-token ratio), elbo_l, coupled and coupled_cv (sequence ratio) estimators at the same number of masked
forwards per completion, trace (per-token ratio; shrink 1 and 8, forwards fixed by the step map) and ESPO's objective
(``VARIANTS``), over several seeds. Writes a table and, when matplotlib is installed, a PNG into
``--output-dir``; the training runs themselves go to a temporary folder (so the benchmark can be run again: a run
folder holding another run's checkpoints is refused by the trainer).

``--json`` also writes the raw results: for ``variance`` ``{"rows": [...], "espo_enumeration": {...}, "trace":
{...}}`` (``sdmc_enumeration`` is printed, as a JSON line and in the markdown), rows holding ``estimator``, ``name``,
``forwards`` (the plan's rows), ``forwarded_rows`` (the mean number of them that score something and are forwarded,
per completion), ``bias_vs_exact_elbo``, ``sd``, ``sd_difference_shared_plan``, ``sd_difference_independent_plans``,
``seconds`` and ``elbo_t_exact_sd`` (elbo_t's exact sd at that number of forwards, the reference of the variance
goal); for ``training`` ``{estimator: {seed: {"curve": {step: held-out accuracy}, "seconds": ...}}}``. ``--part
variance training`` runs both parts in one process, in that order (each with its own options above), and its JSON is
``{"variance": ..., "training": ...}``, each part's object as above.

    python benchmarks/dllm_estimators.py --part variance --threads 1
    python benchmarks/dllm_estimators.py --part training --threads 1 --seeds 0 1 2 --steps 60 --eval-every 15
    # the smallest runs, one part each
    python benchmarks/dllm_estimators.py --part variance --completions 2 --repeats 2 --budgets 2 --json v.json
    python benchmarks/dllm_estimators.py --part training --seeds 0 --steps 1 --eval-every 1 --output-dir out \
        --json t.json
    # both at once (what tests/benchmarks/test_smoke.py does)
    python benchmarks/dllm_estimators.py --part variance training --completions 2 --repeats 2 --budgets 2 \
        --seeds 0 --steps 1 --eval-every 1 --output-dir out --json both.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import tempfile
import time
from pathlib import Path

import torch
from torch import Tensor

from mmrl.plugins.dllm import toy
from mmrl.plugins.dllm.adapters import MaskedLMAdapter
from mmrl.plugins.dllm.estimators import draw_plan, exact_elbo, likelihood_estimators, score_plan
from mmrl.plugins.dllm.generation import completion_mask, generate
from mmrl.plugins.dllm.masking import sdmc_quadrature

# (label, estimator, options): every row gets the budget's number of masked forwards (one_step without prompt
# masking is deterministic and always takes one).
ESTIMATORS = [
    ("one_step (d1, clean prompt: 1 forward)", "one_step", {}),
    ("one_step (d1, prompt masked 0.15)", "one_step", {"p_mask_prompt": 0.15}),
    ("elbo_t (t-sampling, eps 1e-3)", "elbo_t", {}),
    ("elbo_l iid", "elbo_l", {"stratified": False}),
    ("elbo_l stratified", "elbo_l", {"stratified": True}),
    ("coupled (complementary pairs)", "coupled", {}),
    ("coupled_cv (full row + pairs, control 1)", "coupled_cv", {}),
    ("coupled_cv (full row + pairs, control 0)", "coupled_cv", {"control": 0.0}),
    ("spg_lower (block masking, 2 blocks)", "spg_lower", {"masking": "block", "block_length": 2}),
    ("spg_upper (EUBO, beta 1.5)", "spg_upper", {"beta": 1.5}),
    ("espo coupled (ESPO's reduce_var: x ~ U{0..L}, complement row)", "espo", {"coupled": True}),
    ("espo uncoupled (one x-subset per forward)", "espo", {"coupled": False}),
    ("random_masking (UniGRPO / dLLM-RL, t ~ U(0.1, 0.9); no ELBO)", "random_masking", {}),
    ("random_masking coupled (dLLM-RL's coupled: S and S^c per t)", "random_masking", {"coupled": True}),
    ("sdmc gauss-1, count (GDPO)", "sdmc", {"quadrature": "gauss-1"}),
    ("sdmc gauss-2, count (GDPO's code, NeMo's default)", "sdmc", {"quadrature": "gauss-2"}),
    ("sdmc gauss-2, bernoulli", "sdmc", {"quadrature": "gauss-2", "masking": "bernoulli"}),
]
# sdmc spreads its forwards evenly over its quadrature nodes: an sdmc row runs only at the budgets that are a
# multiple of them. These rows run after the others at the budgets that are a multiple of 4 (8 by default).
WIDE_SDMC = [
    ("sdmc gauss-4, count (8 forwards only)", "sdmc", {"quadrature": "gauss-4"}),
    ("sdmc gauss-4, bernoulli (8 forwards only)", "sdmc", {"quadrature": "gauss-4", "masking": "bernoulli"}),
]
SDMC_VARIANTS = [("gauss-1", "count"), ("gauss-2", "count"), ("gauss-2", "bernoulli"), ("gauss-3", "count"),
                 ("gauss-4", "count"), ("gauss-4", "bernoulli"), ("simpson", "count"), ("simpson", "bernoulli")]
# trace is not in the table: it is no ELBO estimate and draws nothing (trace_report compares it with the ELBO).
TRACE_SHRINKS = (1, 8)

# Part 2's runs: config overrides on configs/dllm/toy.yaml per variant (plugin.num_mc_samples is the --forwards).
# ESPO's objective (ML-GSAI/ESPO@b5f2dac recipes/train.yaml, docs/dllm.md section 2.1): the whole generated length
# scored, leave-one-out advantages, ε = 0.2 both sides, the per-sequence mean of the columns, k2 of the sequence
# log-ratio; μ, lr and the optimizer stay the toy's. Its KL weight: the toy's 0.1 ("espo"), and ESPO's β relative to
# the d1 recipe's per-token k3 β (1e-3 / 0.04 = 1/40 of the toy's 0.1: "espo_beta_ratio").
ESPO_OBJECTIVE = ["plugin.estimator=espo", "plugin.estimator_options={coupled: true}", "plugin.score_tail=true",
                  "algorithm.advantage=rloo", "algorithm.policy_loss={name: grpo, clip_low: 0.2, clip_high: 0.2}",
                  "algorithm.aggregation=seq_mean_token_mean", "algorithm.kl_estimator=k2_seq"]
VARIANTS = {
    "one_step": ["plugin.estimator=one_step", "plugin.estimator_options={p_mask_prompt: 0.15}"],
    "elbo_l": ["plugin.estimator=elbo_l"],
    "coupled": ["plugin.estimator=coupled"],
    "coupled_cv": ["plugin.estimator=coupled_cv"],
    # one row per decoding step holding a real token (up to 4 forwards; num_mc_samples is ignored)
    "trace_shrink1": ["plugin.estimator=trace", "plugin.estimator_options={shrink: 1}"],
    # 4 steps merged into one group: the all-masked row, one forward (one_step's context on the toy)
    "trace_shrink8": ["plugin.estimator=trace", "plugin.estimator_options={shrink: 8}"],
    "espo": [*ESPO_OBJECTIVE, "algorithm.kl_coef=0.1"],
    "espo_beta_ratio": [*ESPO_OBJECTIVE, "algorithm.kl_coef=0.0025"],
    # an ablation: ESPO's objective with the toy's group-normalised advantage in place of leave-one-out
    "espo_grpo_advantage": [*ESPO_OBJECTIVE, "algorithm.kl_coef=0.1", "algorithm.advantage=grpo"],
}


def _sampled_completions(adapter, model, count: int, seed: int):
    rows = toy.addition_splits()["eval"][:count]
    prompt_ids, _ = toy.encode_examples(adapter.tokenizer, [r["prompt"] for r in rows], ["0"] * count)
    generators = [torch.Generator().manual_seed(seed + i) for i in range(count)]
    out = generate(adapter.scorer(model), prompt_ids, mask_id=adapter.mask_id, gen_length=toy.GEN_LENGTH,
                   block_length=toy.GEN_LENGTH, steps=toy.GEN_LENGTH, temperature=1.0, generators=generators)
    real = completion_mask(out.completion_ids, adapter.stop_ids)
    # the tail after EOS is masked in every forward; step_map [C, G]: the step that committed each position
    return prompt_ids, out.completion_ids, real, out.step_map


@torch.no_grad()
def subset_logprobs(scorer, prompt: Tensor, completion: Tensor, real: Tensor, mask_id: int) -> dict:
    """Every token's log-prob under every mask set of one completion's real tokens (the tail masked throughout).

    Returns ``{frozenset(S): float64 [G]}`` for every non-empty subset ``S`` of the real positions, holding
    ``log p_θ(x^i | c, x_S)`` at the positions ``i ∈ S`` (the others are not meaningful).

    Shapes:
        prompt ``[P]``, completion and real ``[G]``.
    """
    positions = real.nonzero().squeeze(-1).tolist()
    subsets = [s for size in range(1, len(positions) + 1) for s in itertools.combinations(positions, size)]
    rows = []
    for subset in subsets:
        row = torch.where(real.bool(), completion, mask_id)  # [G], the tail masked
        row[list(subset)] = mask_id
        rows.append(torch.cat([prompt, row]))
    logits = scorer(torch.stack(rows))[:, prompt.shape[0]:].double().log_softmax(-1)  # [R, G, V]
    logp = logits.gather(-1, completion.expand(len(rows), -1).unsqueeze(-1)).squeeze(-1)  # [R, G]
    return {frozenset(subset): logp[r] for r, subset in enumerate(subsets)}


def _subset_sum(table: dict, subset) -> float:
    return float(sum(table[frozenset(subset)][i] for i in subset)) if subset else 0.0


def _size_means(table: dict, positions: list[int]) -> list[float]:
    """``h_l`` (l = 0..L): the mean over the l-subsets ``S`` of ``g(S) = Σ_{i∈S} log p(x^i | c, x_S)``."""
    return [sum(_subset_sum(table, s) for s in itertools.combinations(positions, size))
            / math.comb(len(positions), size) for size in range(len(positions) + 1)]


def _espo_rows(plan, real: Tensor, positions: list[int], halves: int) -> tuple[list[frozenset], list[dict]]:
    """Each row's mask set and, per row kind (``halves`` = 2: the sets ``S``, then their complements; 1: one kind),
    the weight the plan puts on a row of ``x`` masked tokens, checked to be one value per kind and ``x``.

    Shapes:
        plan: one completion (``B = 1``); real ``[G]``.
    """
    masked = (plan.completion_masked[:, 0] & real.bool()).tolist()  # [N, G] real positions masked
    weights = plan.weights[:, 0].tolist()  # [N, G]
    rows, per_kind = plan.num_samples, [{} for _ in range(halves)]  # kind -> {x: weight}
    subsets = []
    for n in range(rows):
        subset = frozenset(i for i in positions if masked[n][i])
        scored = {i: w for i, w in enumerate(weights[n]) if w != 0}
        if set(scored) != subset or len(set(scored.values())) > 1:
            raise AssertionError(f"espo row {n} weights {weights[n]} are not one weight on its mask set {set(subset)}")
        if scored and per_kind[n * halves // rows].setdefault(len(subset), scored[min(subset)]) != scored[min(subset)]:
            raise AssertionError(f"espo's weight for rows of {len(subset)} masked tokens is not one value")
        subsets.append(subset)
    return subsets, per_kind


@torch.no_grad()
def espo_enumeration(scorer, prompt: Tensor, completion: Tensor, real: Tensor, mask_id: int, exact: Tensor,
                     draws: int = 4000, seed: int = 99) -> dict:
    """Check that ``espo``'s weights make it unbiased for the exact ELBO, by enumeration.

    For each completion, a coupled plan of ``draws`` pairs and an uncoupled plan of ``draws`` rows are drawn by
    ``espo_plan`` itself; the weight each puts on a row of ``x`` masked tokens is read from it, per row kind (the
    ``x``-subset ``S``, its complement, the uncoupled row), and checked to depend on ``x`` only; each complement row
    is checked to be its pair's complement. With the law the plan documents (``x ~ U{0..L}``, ``S`` a uniform
    ``x``-subset, so the complement a uniform ``(L−x)``-subset), the estimate's mean is then the finite sum
    ``½ Σ_x (1/(L+1)) [w_S(x)·h_x + w_c(L−x)·h_{L−x}]`` (uncoupled: ``Σ_x (1/(L+1)) w(x)·h_x``) with ``h_x``
    enumerated over every mask set, compared with :func:`exact_elbo`. The law itself is checked against the coupled
    plan's draws: the largest deviation of a count's frequency from ``1/(L+1)`` and of a subset's frequency given its
    count from ``1/C(L, x)``, in units of its standard error.
    """
    worst_mean = worst_uncoupled = worst_z = 0.0
    checks = 0  # frequencies compared with the documented law
    for b in range(completion.shape[0]):
        positions = real[b].nonzero().squeeze(-1).tolist()
        size = len(positions)
        one = (prompt[b:b + 1], completion[b:b + 1], real[b:b + 1])
        paired = draw_plan("espo", *one, num_samples=2 * draws, generator=torch.Generator().manual_seed(seed + b),
                           coupled=True)
        single = draw_plan("espo", *one, num_samples=draws, generator=torch.Generator().manual_seed(seed + b + 10**6),
                           coupled=False)
        subsets, (w_first, w_second) = _espo_rows(paired, real[b], positions, halves=2)
        _, (w_single,) = _espo_rows(single, real[b], positions, halves=1)
        if any(subsets[draws + n] != frozenset(positions) - subsets[n] for n in range(draws)):
            raise AssertionError("an espo complement row is not the complement of its pair's first row")
        h = _size_means(subset_logprobs(scorer, prompt[b], completion[b], real[b], mask_id), positions)  # [L+1]
        coupled = 0.5 * sum(w_first.get(x, 0.0) * h[x] + w_second.get(size - x, 0.0) * h[size - x]
                            for x in range(size + 1)) / (size + 1)
        uncoupled = sum(w_single.get(x, 0.0) * h[x] for x in range(size + 1)) / (size + 1)
        worst_mean = max(worst_mean, abs(coupled - float(exact[b])))
        worst_uncoupled = max(worst_uncoupled, abs(uncoupled - float(exact[b])))
        seen: dict[int, dict[frozenset, int]] = {}  # x -> {S: draws}
        for subset in subsets[:draws]:
            counts = seen.setdefault(len(subset), {})
            counts[subset] = counts.get(subset, 0) + 1
        for x in range(size + 1):
            hits, p = sum(seen.get(x, {}).values()), 1 / (size + 1)
            worst_z = max(worst_z, abs(hits / draws - p) / math.sqrt(p * (1 - p) / draws))
            checks += 1
            if 0 < x < size:  # a single subset otherwise
                if len(seen.get(x, {})) != math.comb(size, x):
                    raise AssertionError(f"espo drew {len(seen.get(x, {}))} of the {math.comb(size, x)} {x}-subsets")
                q = 1 / math.comb(size, x)
                for count in seen[x].values():
                    worst_z = max(worst_z, abs(count / hits - q) / math.sqrt(q * (1 - q) / hits))
                    checks += 1
    return {"max_abs_enumerated_mean_minus_exact_elbo_coupled": worst_mean,
            "max_abs_enumerated_mean_minus_exact_elbo_uncoupled": worst_uncoupled,
            "max_abs_z_of_the_law": worst_z, "law_checks": checks, "draws": draws}


@torch.no_grad()
def sdmc_enumeration(scorer, prompt: Tensor, completion: Tensor, real: Tensor, mask_id: int, exact: Tensor) -> dict:
    """The exact expectation of ``sdmc`` (GDPO's quadrature ELBO) minus the exact ELBO, per rule and masking.

    With the rule's nodes ``t_j`` and weights ``w_j`` (:func:`~mmrl.plugins.dllm.masking.sdmc_quadrature`) and
    ``h_l`` the mean of ``g(S)`` over the ``l``-subsets (enumerated), the mean of the estimate is
    ``Σ_j (w_j/t_j)·h_{k_j}`` with ``k_j = min(L, max(1, ⌊t_j·L⌋))`` for ``masking: count`` and
    ``Σ_j (w_j/t_j)·Σ_l C(L,l) t_j^l (1−t_j)^{L−l} h_l`` for ``bernoulli``, whatever the number of draws per node.
    Returns, per variant, the mean and the largest absolute difference from the exact ELBO over the completions.
    """
    sizes = []
    for b in range(completion.shape[0]):
        positions = real[b].nonzero().squeeze(-1).tolist()
        sizes.append(_size_means(subset_logprobs(scorer, prompt[b], completion[b], real[b], mask_id), positions))
    out = {}
    for quadrature, masking in SDMC_VARIANTS:
        nodes, weights = (values.tolist() for values in sdmc_quadrature(quadrature))
        gaps = []
        for b, h in enumerate(sizes):
            length = len(h) - 1
            value = 0.0
            for t, w in zip(nodes, weights, strict=True):
                if masking == "count":
                    inner = h[min(length, max(1, math.floor(t * length)))]
                else:
                    inner = sum(math.comb(length, l) * t ** l * (1 - t) ** (length - l) * h[l]
                                for l in range(1, length + 1))
                value += w / t * inner
            gaps.append(value - float(exact[b]))
        out[f"{quadrature}, {masking}"] = {"mean_minus_exact_elbo": sum(gaps) / len(gaps),
                                           "max_abs_minus_exact_elbo": max(abs(gap) for gap in gaps)}
    return out


@torch.no_grad()
def trace_report(scorer, prompt: Tensor, completion: Tensor, real: Tensor, step_map: Tensor, mask_id: int,
                 exact: Tensor) -> dict:
    """Where ``trace`` sits against the exact ELBO on the sampled completions, with the sampler's own step maps.

    ``trace`` with ``shrink: 1`` is the log-probability of the tokens along the one decoding order the sampler took,
    ``log p(x | σ_sampled) = Σ_k log p(x^{σ_k} | c, x^{σ_<k})`` (one token per step on the toy). The ELBO is the
    mean of the same sum over all ``L!`` orders (:func:`exact_elbo`'s any-order form), so ``trace − ELBO`` measures
    how much better the sampler's order (low-confidence remasking commits the most confident position first)
    explains its own tokens than a uniformly random order does. Every order's sum is enumerated from the mask-set
    table; the sampled order's equals ``trace`` (checked) and the mean over orders equals ``exact_elbo`` (checked).
    ``shrink: 8`` merges the toy's 4 steps into one group: every token scored with the whole completion masked,
    which is ``one_step`` with a clean prompt (checked).
    """
    estimator = likelihood_estimators["trace"]
    scores = {shrink: estimator(scorer, prompt, completion, real, mask_id=mask_id, step_map=step_map,
                                shrink=shrink).double() for shrink in TRACE_SHRINKS}  # {shrink: [C]}
    one_step = likelihood_estimators["one_step"](scorer, prompt, completion, real, mask_id=mask_id).double()  # [C]
    gaps, ranks, best, worst = [], [], [], []
    for b in range(completion.shape[0]):
        positions = real[b].nonzero().squeeze(-1).tolist()
        table = subset_logprobs(scorer, prompt[b], completion[b], real[b], mask_id)
        paths = []
        for order in itertools.permutations(positions):
            paths.append(sum(float(table[frozenset(order[k:])][order[k]]) for k in range(len(order))))
        sampled_order = sorted(positions, key=lambda i: int(step_map[b, i]))
        sampled = sum(float(table[frozenset(sampled_order[k:])][sampled_order[k]]) for k in range(len(positions)))
        if abs(sampled - float(scores[1][b])) > 1e-4 or abs(sum(paths) / len(paths) - float(exact[b])) > 1e-4:
            raise AssertionError(f"completion {b}: trace {float(scores[1][b])} vs its order's sum {sampled}, "
                                 f"mean over orders {sum(paths) / len(paths)} vs the exact ELBO {float(exact[b])}")
        gaps.append(sampled - float(exact[b]))
        below = sum(path < sampled - 1e-9 for path in paths)
        tied = sum(abs(path - sampled) <= 1e-9 for path in paths)
        ranks.append((below + 0.5 * tied) / len(paths))  # mid-rank of the sampled order among all orders
        best.append(max(paths) - float(exact[b]))
        worst.append(min(paths) - float(exact[b]))
    mismatch = float((scores[8] - one_step).abs().max())
    if mismatch > 1e-4:
        raise AssertionError(f"trace with shrink 8 differs from one_step by {mismatch} on 4-step completions")
    gap = torch.tensor(gaps, dtype=torch.float64)
    several = [rank for b, rank in enumerate(ranks) if int(real[b].sum()) > 1]  # one token: one order
    return {
        "completions": len(gaps),
        "trace_shrink1_minus_exact_elbo_mean": float(gap.mean()),
        "trace_shrink1_minus_exact_elbo_sd_over_completions": float(gap.std()),
        "trace_shrink1_above_elbo_fraction": float((gap > 1e-9).double().mean()),
        "sampled_order_mid_rank_mean": sum(several) / max(len(several), 1),
        "completions_with_several_tokens": len(several),
        "best_order_minus_exact_elbo_mean": sum(best) / len(best),
        "worst_order_minus_exact_elbo_mean": sum(worst) / len(worst),
        "trace_shrink8_minus_exact_elbo_mean": float((scores[8] - exact.double()).mean()),
        "trace_shrink8_minus_one_step_max_abs": mismatch,
    }


@torch.no_grad()
def exact_elbo_t_sd(scorer, prompt, completion, real, mask_id: int, budgets: list[int], eps: float = 1e-3) -> dict:
    """The exact sd of ``elbo_t`` (the benchmark's root mean over completions of the per-completion variance).

    One draw is ``Y = g(S)/t`` with ``t ~ U(ε, 1)`` and ``S ~ Bern(t)`` over the real tokens, so with
    ``m_k(l) = mean_{|S|=l} g(S)^k`` (enumerated: the completions have at most 4 real tokens),
    ``E[Y^k] = ∫_ε^1 Σ_l C(L,l) t^l (1−t)^{L−l} m_k(l) / t^k dt / (1−ε)``, integrated on a log-spaced grid; N draws
    divide the variance by N. The 1/t weights make the sampled sd heavy-tailed, so 100 repetitions estimate it
    poorly; this is the value they estimate.
    """
    grid = torch.logspace(math.log10(eps), 0.0, 200_001, dtype=torch.float64)
    variances = []
    for b in range(completion.shape[0]):
        positions = real[b].nonzero().squeeze(-1).tolist()
        size = len(positions)
        rows, sizes = [], []
        for l in range(1, size + 1):
            for subset in itertools.combinations(positions, l):
                row = torch.where(real[b].bool(), completion[b], mask_id)  # the tail masked
                row[list(subset)] = mask_id
                rows.append(torch.cat([prompt[b], row]))
                sizes.append(l)
        logits = scorer(torch.stack(rows))[:, prompt.shape[1]:].double().log_softmax(-1)
        logp = logits.gather(-1, completion[b].expand(len(rows), -1).unsqueeze(-1)).squeeze(-1)  # [R, G]
        masked = torch.stack(rows)[:, prompt.shape[1]:] == mask_id
        g = (logp * (masked & real[b].bool())).sum(-1)  # [R]
        sizes_t = torch.tensor(sizes)
        first = second = 0.0
        for l in range(1, size + 1):
            values = g[sizes_t == l]
            density = math.comb(size, l) * grid ** l * (1 - grid) ** (size - l) / (1 - eps)
            first += float(torch.trapezoid(density * values.mean() / grid, grid))
            second += float(torch.trapezoid(density * (values ** 2).mean() / grid ** 2, grid))
        variances.append(second - first ** 2)
    single = sum(variances) / len(variances)
    return {budget: math.sqrt(single / budget) for budget in budgets}


@torch.no_grad()
def variance_table(args: argparse.Namespace) -> tuple[dict, dict]:
    adapter = MaskedLMAdapter(str(toy.ASSETS))
    model = adapter.load_model(attn_implementation="eager").eval()
    perturbed = adapter.load_model(attn_implementation="eager").eval()
    generator = torch.Generator().manual_seed(123)
    for p in perturbed.parameters():
        p.add_(args.perturbation * torch.randn(p.shape, generator=generator) * p.abs().mean())
    scorer, scorer2 = adapter.scorer(model), adapter.scorer(perturbed)
    prompt, completion, real, step_map = _sampled_completions(adapter, model, args.completions, seed=7)
    exact = exact_elbo(scorer, prompt, completion, real, mask_id=adapter.mask_id)  # [C]
    exact_t = exact_elbo_t_sd(scorer, prompt, completion, real, adapter.mask_id, args.budgets)
    print(json.dumps({"elbo_t exact sd by forwards": exact_t}), flush=True)
    espo_check = espo_enumeration(scorer, prompt, completion, real, adapter.mask_id, exact)
    print(json.dumps({"espo enumeration": espo_check}), flush=True)
    trace = trace_report(scorer, prompt, completion, real, step_map, adapter.mask_id, exact)
    print(json.dumps({"trace against the exact ELBO": trace}), flush=True)
    sdmc_check = sdmc_enumeration(scorer, prompt, completion, real, adapter.mask_id, exact)
    print(json.dumps({"sdmc expectation against the exact ELBO": sdmc_check}), flush=True)
    c, r = prompt.shape[0], args.repeats
    rep = lambda t: t.repeat(r, 1)  # noqa: E731 — row k·C + i is repeat k of completion i
    rows = []
    for budget in args.budgets:
        for label, name, options in ESTIMATORS + WIDE_SDMC:
            if name == "sdmc" and budget % sdmc_quadrature(options.get("quadrature", "gauss-2"))[0].numel():
                continue  # the same number of draws at every node
            started = time.perf_counter()
            plan = draw_plan(name, rep(prompt), rep(completion), rep(real), num_samples=budget,
                             generator=torch.Generator().manual_seed(budget), **options)
            other = draw_plan(name, rep(prompt), rep(completion), rep(real), num_samples=budget,
                              generator=torch.Generator().manual_seed(10_000 + budget), **options)
            forwards = plan.num_samples
            base = score_plan(scorer, rep(prompt), rep(completion), plan, mask_id=adapter.mask_id,
                              micro_batch=4096).double().view(r, c)
            shared = score_plan(scorer2, rep(prompt), rep(completion), plan, mask_id=adapter.mask_id,
                                micro_batch=4096).double().view(r, c)
            independent = score_plan(scorer2, rep(prompt), rep(completion), other, mask_id=adapter.mask_id,
                                     micro_batch=4096).double().view(r, c)
            rows.append({
                "estimator": label, "name": name, "forwards": forwards,
                # rows that score nothing (espo's x = 0 and its complement at x = L) are not forwarded
                "forwarded_rows": float(plan.scored.any(dim=-1).sum()) / (r * c),
                "bias_vs_exact_elbo": float((base.mean(0) - exact.double()).mean()),
                "sd": float(base.var(0).mean().sqrt()),
                "sd_difference_shared_plan": float((shared - base).var(0).mean().sqrt()),
                "sd_difference_independent_plans": float((independent - base).var(0).mean().sqrt()),
                "seconds": round(time.perf_counter() - started, 2),
            })
            print(json.dumps(rows[-1]), flush=True)
    for row in rows:
        row["elbo_t_exact_sd"] = exact_t.get(row["forwards"])
    # sdmc's enumeration is printed and in the markdown; the JSON keeps the keys its readers check
    return {"rows": rows, "espo_enumeration": espo_check, "trace": trace}, sdmc_check


def variance_markdown(result: dict, args: argparse.Namespace, sdmc_check: dict | None = None) -> str:
    rows, espo_check, trace = result["rows"], result["espo_enumeration"], result["trace"]
    lines = [
        f"{args.completions} sampled completions (1-4 tokens incl. EOS), {args.repeats} repetitions each; θ' = θ "
        f"with every weight perturbed by {args.perturbation}·mean|w|·N(0,1).",
        "",
        "| estimator | forwards | rows forwarded | bias vs exact ELBO | sd of the estimate | sd of est(θ')−est(θ), "
        "shared plan | same, independent plans |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['estimator']} | {row['forwards']} | {row['forwarded_rows']:.2f} "
                     f"| {row['bias_vs_exact_elbo']:+.3f} | {row['sd']:.3f} "
                     f"| {row['sd_difference_shared_plan']:.4f} | {row['sd_difference_independent_plans']:.3f} |")
    exact = {row["forwards"]: row["elbo_t_exact_sd"] for row in rows if row.get("elbo_t_exact_sd")}
    lines += ["", "elbo_t's exact sd (enumerated, eps 1e-3): "
              + ", ".join(f"{value:.3f} at {budget} forwards" for budget, value in sorted(exact.items()))]
    lines += ["", f"espo by enumeration (weights read from {espo_check['draws']} drawn pairs and as many uncoupled "
              "rows per completion): "
              f"|mean − exact ELBO| <= {espo_check['max_abs_enumerated_mean_minus_exact_elbo_coupled']:.1e} coupled, "
              f"{espo_check['max_abs_enumerated_mean_minus_exact_elbo_uncoupled']:.1e} uncoupled; the drawn law's "
              f"largest deviation from x ~ U{{0..L}}, uniform subsets: {espo_check['max_abs_z_of_the_law']:.2f} "
              f"standard errors (the largest of {espo_check['law_checks']} frequencies)",
              "", "trace (no ELBO estimate; the sampler's step maps), against the exact ELBO over "
              f"{trace['completions']} completions:",
              "", "| quantity | value |", "|---|---|"]
    lines += [f"| {key} | {value:+.4f} |" if isinstance(value, float) else f"| {key} | {value} |"
              for key, value in trace.items() if key != "completions"]
    if sdmc_check:
        lines += ["", "sdmc's exact expectation (enumerated) against the exact ELBO:", "",
                  "| quadrature, masking | mean − exact ELBO | max abs |", "|---|---|---|"]
        lines += [f"| {key} | {value['mean_minus_exact_elbo']:+.4f} | {value['max_abs_minus_exact_elbo']:.4f} |"
                  for key, value in sdmc_check.items()]
    return "\n".join(lines)


def training_curves(args: argparse.Namespace) -> dict:
    from mmrl.config import load_config
    from mmrl.trainer import Trainer

    config_path = Path(__file__).resolve().parents[1] / "configs" / "dllm" / "toy.yaml"
    variants = VARIANTS if not args.estimators else {name: VARIANTS[name] for name in args.estimators}
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-dllm-") as runs:
        for name, overrides in variants.items():
            for seed in args.seeds:
                started = time.perf_counter()
                output = Path(runs) / f"{name}_seed{seed}"
                config = load_config(config_path, [
                    *overrides, f"plugin.num_mc_samples={args.forwards}", f"run.seed={seed}",
                    f"run.max_steps={args.steps}", f"eval.every={args.eval_every}", f"run.output_dir={output}",
                    "run.progress=false", "eval.save_samples=false",
                ])
                result = Trainer(config).train()
                _reset_accelerate()  # each run builds its own Accelerator
                curve = {step: metrics["eval/reward_mean"] for step, metrics in sorted(result.evaluations.items())}
                results.setdefault(name, {})[seed] = {"curve": curve, "seconds": time.perf_counter() - started}
                print(json.dumps({"estimator": name, "seed": seed, **results[name][seed]}), flush=True)
    return results


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()


def training_markdown(results: dict) -> str:
    steps = sorted({step for runs in results.values() for run in runs.values() for step in run["curve"]})
    lines = ["| estimator | " + " | ".join(f"step {s}" for s in steps) + " | minutes per run |",
             "|---|" + "---|" * (len(steps) + 1)]
    for name, runs in results.items():
        cells = []
        for step in steps:
            values = [run["curve"][step] for run in runs.values() if step in run["curve"]]
            mean = sum(values) / len(values)
            spread = (max(values) - min(values)) / 2
            cells.append(f"{mean:.3f} ± {spread:.3f}")
        minutes = sum(run["seconds"] for run in runs.values()) / len(runs) / 60
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {minutes:.1f} |")
    return "\n".join(lines)


def training_plot(results: dict, path: Path, title: str = "Toy world: GRPO with each likelihood estimator",
                  dashed_prefix: str | None = None) -> bool:
    """Held-out accuracy against RL steps per variant, the mean line and the seeds' range; False without matplotlib.
    ``dashed_prefix``: variants whose name starts with it are dashed (benchmarks/policy_losses.py dashes its grpo +
    option variants, so that they read as grpo's relatives)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    colours = plt.get_cmap("tab20").colors  # up to 20 variants: tab10 would repeat its colours past 10
    for index, (name, runs) in enumerate(results.items()):
        steps = sorted(next(iter(runs.values()))["curve"])
        values = torch.tensor([[run["curve"][s] for s in steps] for run in runs.values()])  # [seeds, evaluations]
        style = "--" if dashed_prefix is not None and name.startswith(dashed_prefix) else "-"
        colour = colours[(2 * index) % 20 + (index >= 10)]
        ax.plot(steps, values.mean(0).tolist(), marker="o", markersize=3, linestyle=style, color=colour, label=name)
        ax.fill_between(steps, values.min(0).values.tolist(), values.max(0).values.tolist(), color=colour,
                        alpha=0.08)
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=3, loc="lower right")  # below the curves, which all start at the same point
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", nargs="+", choices=["variance", "training"], required=True,
                        help="variance, training, or both (run in the order given, in this process)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--completions", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--budgets", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--perturbation", type=float, default=0.02)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=15)
    parser.add_argument("--forwards", type=int, default=2, help="masked forwards per completion in part 2")
    parser.add_argument("--output-dir", default="runs/bench_dllm", help="where the training part's plot goes")
    parser.add_argument("--estimators", nargs="+", default=None, choices=sorted(VARIANTS),
                        help="part 2: only these variants")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    args = parser.parse_args(argv)
    if len(set(args.part)) < len(args.part):
        parser.error(f"--part names a part more than once ({' '.join(args.part)}); give each once")
    torch.set_num_threads(args.threads)
    raw = {}
    for part in args.part:
        if part == "variance":
            raw[part], sdmc_check = variance_table(args)
            print(variance_markdown(raw[part], args, sdmc_check))
        else:
            raw[part] = training_curves(args)
            print(training_markdown(raw[part]))
            plot = Path(args.output_dir) / "dllm_estimators_training.png"
            plot.parent.mkdir(parents=True, exist_ok=True)
            if training_plot(raw[part], plot):
                print(f"plot: {plot}")
    if args.json:  # one part: its object, as before both could be run at once; both: keyed by part
        Path(args.json).write_text(json.dumps(raw[args.part[0]] if len(raw) == 1 else raw, indent=2, default=str))


if __name__ == "__main__":
    main()
