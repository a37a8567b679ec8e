"""GDPO's semi-deterministic Monte Carlo ELBO (``estimator: sdmc``, arXiv:2510.08554): the quadrature against numpy's
Gauss-Legendre rule, the plan against the formula restated from GDPO's ``NumericalIntegrationEstimator`` (counts
``int(t·L)``, weights ``w/t``), its exact expectation by enumeration against the exact ELBO (exact for Bernoulli
masks when L ≤ 2n, biased otherwise), the estimator's mean against that expectation, and the plugin (a shared plan:
ratio 1; per-sample plans; refusals)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from torch import Tensor

from mmrl.config import ConfigError, load_config
from mmrl.plugin import PromptBatch, Runtime, plugin_registry
from mmrl.plugins.dllm.estimators import draw_plan, exact_elbo, likelihood_estimators, score_plan
from mmrl.plugins.dllm.masking import SampleStreams, sdmc_plan, sdmc_quadrature
from mmrl.trainer.learn import old_policy_pass
from tests.dllm.test_estimators import MASK, PAD, TinyMaskedLM, _logp_table

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model() -> TinyMaskedLM:
    torch.manual_seed(0)
    return TinyMaskedLM().eval()


def _batch() -> tuple[Tensor, Tensor, Tensor]:
    """Two samples with L = 3 and L = 5 real tokens, right-padded to width 6."""
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    completion = torch.tensor([[1, 5, 7, PAD, PAD, PAD], [2, 2, 9, 0, 3, PAD]])
    return prompt, completion, (completion != PAD).long()


def rule(name: str) -> tuple[list[float], list[float]]:
    """The nodes and weights on [0, 1], restated: numpy's Gauss-Legendre on [−1, 1] mapped by ``t = (x+1)/2``,
    ``w = w_x/2`` (GDPO's ``xi = point * .5 + .5`` and ``.5 * loss``); GDPO's Simpson ``(0.1, 0.5, 1.0)``,
    ``(1, 4, 1)/6``."""
    if name == "simpson":
        return [0.1, 0.5, 1.0], [1 / 6, 4 / 6, 1 / 6]
    x, w = np.polynomial.legendre.leggauss(int(name.split("-")[1]))
    return [float(v + 1) / 2 for v in x], [float(v) / 2 for v in w]


def gdpo_count(t: float, length: int) -> int:
    """GDPO's ``num_mask = int(p_mask * target_len)``, with NeMo's clamp to at least one (and at most L)."""
    return min(length, max(1, int(t * length)))


def test_quadrature_is_gauss_legendre_on_the_unit_interval():
    for name in ("gauss-1", "gauss-2", "gauss-3", "gauss-4", "gauss-5", "simpson"):
        nodes, weights = sdmc_quadrature(name)
        expected_nodes, expected_weights = rule(name)
        np.testing.assert_allclose(nodes.numpy(), expected_nodes, rtol=0, atol=1e-14)
        np.testing.assert_allclose(weights.numpy(), expected_weights, rtol=0, atol=1e-14)
        assert float(weights.sum()) == pytest.approx(1.0, abs=1e-14)
    # gauss-n integrates t^k on [0, 1] exactly up to k = 2n − 1, not 2n
    for n in range(1, 6):
        nodes, weights = sdmc_quadrature(f"gauss-{n}")
        assert float((weights * nodes ** (2 * n - 1)).sum()) == pytest.approx(1 / (2 * n), abs=1e-13)
        assert abs(float((weights * nodes ** (2 * n)).sum()) - 1 / (2 * n + 1)) > 1e-6
    with pytest.raises(ValueError, match="quadrature must be one of"):
        sdmc_quadrature("gauss-6")


def test_counts_match_gdpos_closed_form_nodes():
    """The count ``⌊t_j·L⌋`` from the Golub-Welsch nodes equals ``int(t_j·L)`` from GDPO's closed-form nodes
    (±1/√3; 0, ±√(3/5); ±√(3/7 ∓ (2/7)√(6/5)); 0, ±(1/3)√(5 ∓ 2√(10/7)), mapped by ``x·.5 + .5``) for every
    ``L ≤ 4096``: the nodes agree to an ulp, and a node an ulp below ``k/L`` (a middle node just under 0.5) would
    mask one token fewer than GDPO at every even L."""
    a, b = math.sqrt(3 / 7 - 2 / 7 * math.sqrt(6 / 5)), math.sqrt(3 / 7 + 2 / 7 * math.sqrt(6 / 5))
    c, d = math.sqrt(5 - 2 * math.sqrt(10 / 7)) / 3, math.sqrt(5 + 2 * math.sqrt(10 / 7)) / 3
    closed = {"gauss-1": [0.0], "gauss-2": [-1 / math.sqrt(3), 1 / math.sqrt(3)],
              "gauss-3": [-math.sqrt(3 / 5), 0.0, math.sqrt(3 / 5)], "gauss-4": [-b, -a, a, b],
              "gauss-5": [-d, -c, 0.0, c, d]}
    lengths = torch.arange(1, 4097, dtype=torch.float64)  # [4096]
    for name, points in closed.items():
        nodes = sdmc_quadrature(name)[0]  # [J]
        gdpo = torch.tensor([[int((x * .5 + .5) * length) for x in points] for length in range(1, 4097)])  # [4096, J]
        ours = torch.floor(nodes.unsqueeze(0) * lengths.unsqueeze(1)).long()
        assert torch.equal(ours, gdpo), name


@pytest.mark.parametrize(("quadrature", "masking", "per_node"), [
    ("gauss-2", "count", 1), ("gauss-3", "count", 2), ("simpson", "count", 1), ("gauss-2", "bernoulli", 2)])
def test_plan_is_gdpos_nodes_counts_and_weights(quadrature, masking, per_node):
    """Rows j·d..(j+1)·d−1 belong to node j; count masking masks exactly min(L, max(1, int(t_j·L))) real tokens;
    every masked real token weighs N·w_j/(d·t_j) (the reduce averages the N rows), nothing else is scored; the tail
    is masked in every row, the prompt in none."""
    prompt, completion, real = _batch()
    nodes, weights = rule(quadrature)
    num_samples = per_node * len(nodes)
    plan = draw_plan("sdmc", prompt, completion, real, num_samples=num_samples,
                     generator=torch.Generator().manual_seed(3), quadrature=quadrature, masking=masking)
    assert plan.prompt_masked is None and plan.num_samples == num_samples
    assert torch.equal(plan.model_inputs(prompt, completion, MASK).view(num_samples, 2, -1)[:, :, :3],
                       prompt.expand(num_samples, -1, -1))
    for n in range(num_samples):
        j = n // per_node
        for b, length in ((0, 3), (1, 5)):
            masked = plan.completion_masked[n, b] & real[b].bool()
            if masking == "count":
                assert int(masked.sum()) == gdpo_count(nodes[j], length)
            expected = torch.where(masked, num_samples * weights[j] / (per_node * nodes[j]), 0.0).double()
            torch.testing.assert_close(plan.weights[n, b].double(), expected, rtol=1e-6, atol=0)
            assert plan.completion_masked[n, b, ~real[b].bool()].all()


def _enumerated(table: dict, length: int, quadrature: str, masking: str) -> float:
    """GDPO's estimator's expectation over the masks, restated: ``Σ_j (w_j/t_j)·E_j[g(S)]`` with ``E_j`` the mean of
    ``g(S) = Σ_{i∈S} log p(x^i | c, x_S)`` over the ``k_j``-subsets (count) or over ``S ~ Bern(t_j)^L``."""
    nodes, weights = rule(quadrature)
    positions = list(range(length))
    g = {frozenset(s): float(table[frozenset(s)][list(s)].sum())
         for l in range(1, length + 1) for s in itertools.combinations(positions, l)}
    total = 0.0
    for t, w in zip(nodes, weights, strict=True):
        if masking == "count":
            k = gdpo_count(t, length)
            inner = sum(g[frozenset(s)] for s in itertools.combinations(positions, k)) / math.comb(length, k)
        else:
            inner = sum(value * t ** len(s) * (1 - t) ** (length - len(s)) for s, value in g.items())
        total += w / t * inner
    return total


def test_enumerated_expectation_against_the_exact_elbo(model):
    """Bernoulli masks: the expectation is the quadrature of a polynomial of degree L − 1, so gauss-n is the exact
    ELBO for L ≤ 2n and not beyond; count masks (GDPO's code) are biased even then."""
    prompt, completion, real = _batch()
    with torch.no_grad():
        exact = exact_elbo(model, prompt, completion, real, mask_id=MASK).double()  # float32 inside
    for b, length in ((0, 3), (1, 5)):
        table = _logp_table(model, prompt[b], completion[b], list(range(length)))
        # the ELBO Σ_l (1/l)·mean_{|S|=l} g(S) in float64 from the same table
        elbo = sum(sum(float(table[frozenset(s)][list(s)].sum()) for s in itertools.combinations(range(length), l))
                   / (l * math.comb(length, l)) for l in range(1, length + 1))
        assert elbo == pytest.approx(float(exact[b]), abs=1e-5)
        for n in range(1, 6):
            value = _enumerated(table, length, f"gauss-{n}", "bernoulli")
            if length <= 2 * n:
                assert value == pytest.approx(elbo, abs=1e-10), (length, n)
            else:
                assert abs(value - elbo) > 1e-8, (length, n)  # the quadrature error (small: f is smooth here)
        count = _enumerated(table, length, "gauss-2", "count")
        assert abs(count - elbo) > 1e-2  # exact counts and 1/t weights: biased
        assert abs(_enumerated(table, length, "simpson", "bernoulli") - elbo) > 1e-2


@pytest.mark.parametrize(("quadrature", "masking", "per_node"), [
    ("gauss-2", "count", 1), ("gauss-3", "count", 1), ("gauss-2", "bernoulli", 2), ("simpson", "bernoulli", 1)])
def test_estimator_mean_is_the_enumerated_expectation(model, quadrature, masking, per_node):
    """The mean of many estimates (every sample with its own masks) equals the enumerated expectation within 4.5
    standard errors; for Bernoulli gauss-2 on L = 3 that is the exact ELBO."""
    prompt, completion, real = _batch()
    copies = 600
    num_samples = per_node * len(rule(quadrature)[0])
    with torch.no_grad():
        estimates = likelihood_estimators["sdmc"](
            model, prompt.repeat(copies, 1), completion.repeat(copies, 1), real.repeat(copies, 1), mask_id=MASK,
            num_samples=num_samples, generator=torch.Generator().manual_seed(1), quadrature=quadrature,
            masking=masking).double().view(copies, 2)
    mean, se = estimates.mean(0), estimates.std(0) / math.sqrt(copies)
    for b, length in ((0, 3), (1, 5)):
        table = _logp_table(model, prompt[b], completion[b], list(range(length)))
        expected = _enumerated(table, length, quadrature, masking)
        assert abs(float(mean[b]) - expected) <= 4.5 * float(se[b]) + 1e-5, (b, float(mean[b]), expected)


@pytest.mark.parametrize("masking", ["count", "bernoulli"])
def test_masks_are_drawn_afresh_at_every_node_and_draw(masking):
    """GDPO's ``get_loss`` calls ``forward_process`` at every node, which draws a fresh ``randperm`` for every copy:
    the masks of any two rows are independent, so a token is masked in both w.p. ``P_a·P_b`` (``k/L`` per count row,
    ``t_j`` per Bernoulli row). Masks shared across nodes (nested: the same keys ranked at every node) or across the
    draws of a node keep every mean right and fail here (the rows that share keys give ``min(P_a, P_b)``)."""
    copies, length = 4000, 5
    prompt = torch.tensor([[4, 5, 6]]).repeat(copies, 1)
    completion = torch.tensor([[2, 2, 9, 0, 3, PAD]]).repeat(copies, 1)
    real = (completion != PAD).long()
    nodes, _ = rule("gauss-2")
    plan = sdmc_plan(prompt, completion, real, num_samples=4, generator=torch.Generator().manual_seed(8),
                     quadrature="gauss-2", masking=masking)  # rows 0, 1 at node 0; rows 2, 3 at node 1
    masked = plan.completion_masked[:, :, :length].double()  # [N, copies, L]
    marginal = [gdpo_count(t, length) / length if masking == "count" else t for t in nodes]
    for row_a, row_b in ((0, 1), (2, 3), (0, 2), (1, 3)):
        both = (masked[row_a] * masked[row_b]).mean(dim=1)  # [copies]: the share of tokens masked in both rows
        expected = marginal[row_a // 2] * marginal[row_b // 2]
        se = float(both.std()) / math.sqrt(copies)
        assert abs(float(both.mean()) - expected) < 4.5 * se, (row_a, row_b, float(both.mean()), expected)


def test_a_batched_plan_is_every_sample_drawn_alone():
    prompt, completion, real = _batch()
    seeds = [4, 5]
    streams = SampleStreams([torch.Generator().manual_seed(s) for s in seeds])
    batched = [sdmc_plan(prompt, completion, real, num_samples=6, generator=streams, quadrature="gauss-3")
               for _ in range(2)]
    for b, seed in enumerate(seeds):
        generator = torch.Generator().manual_seed(seed)
        for plan in batched:
            own = sdmc_plan(prompt[b:b + 1], completion[b:b + 1], real[b:b + 1], num_samples=6, generator=generator,
                            quadrature="gauss-3")
            assert torch.equal(plan.completion_masked[:, b], own.completion_masked[:, 0])
            assert torch.equal(plan.weights[:, b], own.weights[:, 0])
    again = sdmc_plan(prompt, completion, real, num_samples=6, generator=SampleStreams(
        [torch.Generator().manual_seed(s) for s in seeds]), quadrature="gauss-3")
    assert torch.equal(again.completion_masked, batched[0].completion_masked)


# ---------------------------------------------------------------------- through the plugin (toy checkpoint)
def _plugin(runtime: Runtime | None = None, **plugin):
    data = {"plugin": {"name": "dllm", "train_size": 64, "eval_size": 16, "estimator": "sdmc", "num_mc_samples": 2,
                       **plugin},
            "rewards": {"functions": [{"name": "gsm8k_answer"}]}}
    return plugin_registry.get("dllm")(load_config(data).plugin.config, runtime or Runtime())


def test_plugin_spreads_the_estimate_with_ratio_one():
    """Each real token column holds est/L (a sequence ratio, as elbo_t); π_old, π_ref and π_θ share each epoch's
    plan, so they agree exactly; the plans are the samples' own (the same seeds in another batch give the same)."""
    plugin = _plugin(Runtime(needs_reference=True, inner_epochs=2))
    policy = plugin.policy()
    rows = plugin.dataset("train")[:4]
    batch = PromptBatch(rows=rows, group_ids=torch.arange(4) // 2, group_size=2, seeds=torch.arange(30, 34),
                        generator=torch.Generator())
    rollout = old_policy_pass(plugin, policy, plugin.rollout(policy, batch))
    replay = rollout.replay
    real = replay["completion_mask"].bool()
    assert torch.equal(rollout.mask.bool(), real)
    for epoch in range(2):
        plugin.start_inner_epoch(epoch)
        out = plugin.forward(policy, rollout, need_reference=True)
        assert torch.equal(out.logp.detach(), out.ref_logp)
        masks = replay["plan_masked"][:, epoch].transpose(0, 1).bool()
        plan = draw_plan("sdmc", replay["prompt_ids"], replay["completion_ids"], real, num_samples=2, generator=None)
        plan = type(plan)(masks, replay["plan_weights"][:, epoch].transpose(0, 1).float(), plan.num_tokens)
        with torch.no_grad():
            estimate = score_plan(plugin.adapter.scorer(policy), replay["prompt_ids"], replay["completion_ids"],
                                  plan, mask_id=plugin.adapter.mask_id)
        expected = real * (estimate / real.sum(1)).unsqueeze(1)
        torch.testing.assert_close(out.logp.detach(), expected, rtol=0, atol=1e-6)
    plugin.start_inner_epoch(0)
    assert torch.equal(plugin.forward(policy, rollout, need_reference=False).logp.detach(), rollout.old_logp)
    part = PromptBatch(rows=rows[2:], group_ids=torch.arange(2) // 2, group_size=2, seeds=torch.arange(32, 34),
                       generator=torch.Generator())
    alone = plugin.rollout(policy, part).replay
    assert torch.equal(alone["plan_masked"], replay["plan_masked"][2:])


@pytest.mark.parametrize(("overrides", "key", "match"), [
    ({"estimator_options": {"quadrature": "gauss-7"}}, "plugin.estimator_options.quadrature", "gauss-5"),
    ({"estimator_options": {"masking": "random"}}, "plugin.estimator_options.masking", "bernoulli"),
    ({"estimator_options": {"quadrature": "gauss-3"}, "num_mc_samples": 4}, "plugin.num_mc_samples",
     "a multiple of 3, the nodes of the sdmc quadrature gauss-3"),
    ({"num_mc_samples": 3}, "plugin.num_mc_samples", "a multiple of 2"),
])
def test_config_refuses_bad_options(overrides, key, match):
    data = {"plugin": {"name": "dllm", "estimator": "sdmc", **overrides},
            "rewards": {"functions": [{"name": "gsm8k_answer"}]}}
    with pytest.raises(ConfigError, match=match) as info:
        load_config(data)
    assert info.value.key == key
    assert "\n" not in str(info.value)


def test_direct_calls_refuse_bad_options():
    prompt, completion, real = _batch()
    for options, match in (({"quadrature": "trapezoid"}, "quadrature must be one of"),
                           ({"masking": "random"}, "masking must be one of"),
                           ({"num_samples": 3}, "a multiple of its 2 nodes")):
        with pytest.raises(ValueError, match=match):
            sdmc_plan(prompt, completion, real, generator=torch.Generator(), **{"num_samples": 2, **options})
