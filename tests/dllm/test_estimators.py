"""Likelihood estimators of the masked-diffusion plugin against exact, enumerated values on a tiny random model."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from torch import Tensor, nn

from mmrl.plugins.dllm.estimators import (
    MaskPlan,
    draw_plan,
    elbo_size_weights,
    exact_elbo,
    likelihood_estimators,
    plan_token_logprobs,
    score_plan,
)
from mmrl.plugins.dllm.masking import stratified_counts, uniform

VOCAB, PAD, MASK = 12, 10, 11


class TinyMaskedLM(nn.Module):
    """Bidirectional two-layer single-head transformer; pad positions are never attended to (so padding is inert)."""

    def __init__(self, hidden: int = 16, layers: int = 2, max_len: int = 16, scale: float = 3.0):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.pos = nn.Parameter(torch.randn(max_len, hidden) * 0.5)
        self.qkv = nn.ModuleList(nn.Linear(hidden, 3 * hidden) for _ in range(layers))
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
            for _ in range(layers)
        )
        self.head = nn.Linear(hidden, VOCAB)
        self.scale = scale  # sharper predictions, so that log-probs depend visibly on the masked context

    def forward(self, input_ids: Tensor) -> Tensor:  # [R, T] -> [R, T, V], position i scores token i
        h = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        keys = (input_ids != PAD).unsqueeze(1)  # [R, 1, T]
        for qkv, mlp in zip(self.qkv, self.mlp, strict=True):
            q, k, v = qkv(h).chunk(3, dim=-1)
            attention = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
            h = h + attention.masked_fill(~keys, float("-inf")).softmax(dim=-1) @ v
            h = h + mlp(h)
        return self.head(h) * self.scale


@pytest.fixture(scope="module")
def model() -> TinyMaskedLM:
    torch.manual_seed(0)
    return TinyMaskedLM().eval()


@pytest.fixture(scope="module")
def batch() -> tuple[Tensor, Tensor, Tensor]:
    """Two samples with L = 3 and L = 5 real tokens, right-padded to width 6."""
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    completion = torch.tensor([[1, 5, 7, PAD, PAD, PAD], [2, 2, 9, 0, 3, PAD]])
    return prompt, completion, (completion != PAD).long()


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logp_table(model, prompt: Tensor, completion: Tensor, positions: list[int]) -> dict[frozenset, Tensor]:
    """log p(x^i | c, x_S) for every non-empty subset S of the real positions `positions` (one sample), with every
    other completion position (the tail after EOS) masked too: {S: [L] log-probs}."""
    subsets = [frozenset(s) for l in range(1, len(positions) + 1) for s in itertools.combinations(positions, l)]
    tail = [i for i in range(completion.shape[0]) if i not in positions]
    rows = []
    for subset in subsets:
        row = completion.clone()
        row[list(subset) + tail] = MASK
        rows.append(torch.cat([prompt, row]))
    with torch.no_grad():
        logits = model(torch.stack(rows))[:, prompt.shape[0] :].double()
    logp = logits.log_softmax(-1).gather(-1, completion.expand(len(rows), -1).unsqueeze(-1)).squeeze(-1)
    return dict(zip(subsets, logp, strict=True))


def _replicated(batch: tuple[Tensor, Tensor, Tensor], copies: int) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(t.repeat(copies, 1) for t in batch)


def _mean_and_se(estimates: Tensor, copies: int, batch_size: int) -> tuple[Tensor, Tensor]:
    values = estimates.double().reshape(copies, batch_size)
    return values.mean(0), values.std(0) / math.sqrt(copies)


# ---------------------------------------------------------------------- exact ELBO
def test_elbo_size_weights_identity():
    # ∫_0^1 (1/t)·C(L,l)·t^l(1−t)^{L−l} dt = C(L,l)·B(l, L−l+1) = 1/l.
    for length in range(1, 8):
        for l in range(1, length + 1):
            beta = math.exp(math.lgamma(l) + math.lgamma(length - l + 1) - math.lgamma(length + 1))
            assert math.comb(length, l) * beta == pytest.approx(1.0 / l, rel=1e-12)
        assert elbo_size_weights(length) == pytest.approx([1.0 / l for l in range(1, length + 1)])
    # Truncated timesteps t ~ U(ε, 1): compare with a trapezoid quadrature of the defining integral.
    eps, length = 0.05, 5
    t = torch.linspace(eps, 1.0, 200_001, dtype=torch.float64)
    for l, weight in enumerate(elbo_size_weights(length, eps), start=1):
        integrand = math.comb(length, l) * t ** (l - 1) * (1 - t) ** (length - l) / (1 - eps)
        assert weight == pytest.approx(torch.trapezoid(integrand, t).item(), rel=1e-8)


@pytest.mark.parametrize("length", [1, 2, 3, 4])
def test_exact_elbo_matches_brute_force(model, length):
    prompt = torch.tensor([[3, 1, 4]])
    completion = torch.tensor([[1, 5, 9, 2][:length] + [PAD, PAD]])
    mask = (completion != PAD).long()
    table = _logp_table(model, prompt[0], completion[0], list(range(length)))
    # Subset form: Σ_l (1/l)·mean_{|S|=l} Σ_{i∈S} log p(x^i | c, x_S).
    subset_form = sum(
        (1.0 / l) * sum(table[frozenset(s)][list(s)].sum() for s in itertools.combinations(range(length), l))
        / math.comb(length, l)
        for l in range(1, length + 1)
    )
    # Any-order autoregressive form: mean over orders of Σ_k log p(x^{σ_k} | c, σ_k..σ_L still masked).
    orders = list(itertools.permutations(range(length)))
    order_form = sum(
        sum(table[frozenset(order[k:])][order[k]] for k in range(length)) for order in orders
    ) / len(orders)
    exact = exact_elbo(model, prompt, completion, mask, mask_id=MASK)
    assert exact.shape == (1,) and exact.dtype == torch.float32
    assert exact.item() == pytest.approx(subset_form.item(), abs=1e-4)
    assert exact.item() == pytest.approx(order_form.item(), abs=1e-4)
    # one_step (every position masked, clean prompt) is h_L = g(all): L times the l = L term h_L / L of the ELBO.
    every = frozenset(range(length))
    h_last = table[every][list(every)].sum()
    last_term = sum(table[frozenset(s)][list(s)].sum() for s in itertools.combinations(range(length), length)) / length
    with torch.no_grad():
        one_step = likelihood_estimators["one_step"](model, prompt, completion, mask, mask_id=MASK, num_samples=1,
                                                     generator=None)
    assert one_step.item() == pytest.approx(h_last.item(), abs=1e-5)
    assert one_step.item() == pytest.approx(length * last_term.item(), abs=1e-5)


def test_the_tail_is_masked_so_its_content_never_changes_an_estimate(model, batch):
    prompt, completion, mask = batch
    other = torch.where(mask.bool(), completion, torch.tensor([[3, 7, 0, 9, 1, 4]]))  # another tail, same tokens
    exact = exact_elbo(model, prompt, completion, mask, mask_id=MASK)
    assert torch.allclose(exact, exact_elbo(model, prompt, other, mask, mask_id=MASK), atol=1e-6)
    with torch.no_grad():
        for name, options in ALL:
            first = likelihood_estimators[name](model, prompt, completion, mask, mask_id=MASK, num_samples=4,
                                                generator=_generator(3), **options)
            second = likelihood_estimators[name](model, prompt, other, mask, mask_id=MASK, num_samples=4,
                                                 generator=_generator(3), **options)
            assert torch.allclose(first, second, atol=1e-6), name
            plan = draw_plan(name, prompt, completion, mask, num_samples=4, generator=_generator(3), **options)
            tail = ~mask.bool().unsqueeze(0)
            assert plan.completion_masked[tail.expand_as(plan.completion_masked)].all(), name  # masked in every row
            assert not (plan.scored & tail).any(), name  # and never scored


# ---------------------------------------------------------------------- unbiasedness
UNBIASED = [
    ("elbo_l", {"stratified": True}, 8),
    ("elbo_l", {"stratified": False}, 8),
    ("coupled", {"stratified": True}, 8),
    ("coupled", {"stratified": False}, 8),
    ("coupled_cv", {}, 8),
    ("coupled_cv", {"control": 0.0, "stratified": False}, 3),
    ("coupled_cv", {"control": -1.5}, 2),  # any β: the control term has mean zero
    ("spg_lower", {"masking": "random"}, 8),
    ("elbo_t", {"eps": 0.05}, 8),  # target: exact_elbo(eps=0.05), the exact mean of the truncated-t estimator
    ("elbo_t", {}, 8),  # default ε = 1e-3: bias ≤ 2ε/(1−ε)·L·max|log p| ≈ 0.05, far below 4 SE
]


@pytest.mark.parametrize(("name", "options", "num_samples"), UNBIASED)
def test_unbiased_estimators_match_exact_elbo(model, batch, name, options, num_samples):
    copies = 300
    prompt, completion, mask = _replicated(batch, copies)  # independent replicates share one forward
    exact = exact_elbo(model, *batch, mask_id=MASK, eps=options.get("eps", 0.0)).double()
    with torch.no_grad():
        estimates = likelihood_estimators[name](
            model, prompt, completion, mask, mask_id=MASK, num_samples=num_samples, generator=_generator(1), **options
        )
    mean, se = _mean_and_se(estimates, copies, 2)
    assert torch.all((mean - exact).abs() <= 4 * se), (name, options, mean, exact, se)


def test_block_lower_bound_matches_exact_block_elbo(model, batch):
    copies = 300
    prompt, completion, mask = _replicated(batch, copies)
    exact = exact_elbo(model, *batch, mask_id=MASK, block_length=2).double()
    with torch.no_grad():
        estimates = likelihood_estimators["spg_lower"](
            model, prompt, completion, mask, mask_id=MASK, num_samples=4, generator=_generator(2),
            masking="block", block_length=2,
        )
    mean, se = _mean_and_se(estimates, copies, 2)
    assert torch.all((mean - exact).abs() <= 4 * se), (mean, exact, se)


def test_t_sampling_has_far_more_variance_than_l_sampling(model, batch):
    copies = 300
    replicated = _replicated(batch, copies)
    stds = {}
    with torch.no_grad():
        for name, options in (("elbo_t", {}), ("elbo_l", {"stratified": False})):
            estimates = likelihood_estimators[name](
                model, *replicated, mask_id=MASK, num_samples=4, generator=_generator(3), **options
            )
            stds[name] = estimates.double().reshape(copies, 2).std(0)
    assert torch.all(stds["elbo_l"] * 2 < stds["elbo_t"])  # 3.5x on this model


def _count_only_model(input_ids: Tensor) -> Tensor:
    """log p(x^i) depends only on the number m of masked tokens in the row (class MASK gets logit m/2, others 0)."""
    logits = torch.zeros(*input_ids.shape, VOCAB)
    logits[..., MASK] = 0.5 * (input_ids == MASK).sum(-1, keepdim=True)
    return logits


@pytest.mark.parametrize("name", ["elbo_l", "coupled"])
def test_stratification_removes_count_variance(batch, name):
    # When log p depends on the mask count only, the estimate given the count is deterministic, so stratified
    # counts that cover every count equally often (N a multiple of L_b for every sample) give the exact ELBO.
    prompt, completion, mask = batch
    exact = exact_elbo(_count_only_model, prompt, completion, mask, mask_id=MASK)
    num = 15 if name == "elbo_l" else 30  # lcm(3, 5) draws (coupled: 15 pairs, 30 forwards)
    stratified = likelihood_estimators[name](_count_only_model, prompt, completion, mask, mask_id=MASK,
                                             num_samples=num, generator=_generator(4), stratified=True)
    iid = likelihood_estimators[name](_count_only_model, prompt, completion, mask, mask_id=MASK, num_samples=num,
                                      generator=_generator(4), stratified=False)
    assert torch.allclose(stratified, exact, atol=1e-5)
    assert not torch.allclose(iid, exact, atol=1e-3)


def _context_free_model(input_ids: Tensor) -> Tensor:
    """Logits that depend on the position only, never on the context: log p(x^i | c, x_S) is the same for every S."""
    table = torch.sin(torch.arange(input_ids.shape[1] * VOCAB, dtype=torch.float32)).reshape(-1, VOCAB) * 3.0
    return table.unsqueeze(0).expand(input_ids.shape[0], -1, -1)


def test_coupled_cv_control_removes_token_selection_noise(batch):
    # Without context effects every token's log-prob is the same in every row, so with β = 1 each draw returns the
    # exact ELBO (Σ_i log p_i); coupled weights its two rows unequally (L/(2m), L/(2(L−m))) and varies.
    prompt, completion, mask = _replicated(batch, 20)
    exact = exact_elbo(_context_free_model, *batch, mask_id=MASK).repeat(20)
    for num in (2, 3, 8):
        cv = likelihood_estimators["coupled_cv"](_context_free_model, prompt, completion, mask, mask_id=MASK,
                                                 num_samples=num, generator=_generator(num))
        assert torch.allclose(cv, exact, atol=1e-4), num
    coupled = likelihood_estimators["coupled"](_context_free_model, prompt, completion, mask, mask_id=MASK,
                                               num_samples=2, generator=_generator(0))
    assert coupled.std() > 0.1


def test_coupled_cv_plan_by_hand():
    # L = 4 real tokens and a tail, N = 4: row 0 masks everything; a complementary pair with sizes m and 4 − m in
    # 1..3; one odd row of size in 1..3. D weights (L−1)/(l·R) = 1/l (R = 3); row-0 weight of token i:
    # 1/4 + β·3/4 − β·W_i. Stored weights are N× these.
    prompt = torch.tensor([[1, 2]])
    completion = torch.tensor([[3, 4, 5, 6, 7]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    for control in (1.0, 0.0, 0.5):
        plan = draw_plan("coupled_cv", prompt, completion, mask, num_samples=4, generator=_generator(5),
                         control=control)
        masked, weights = plan.completion_masked[:, 0], plan.weights[:, 0].double() / 4  # [4, 5]
        assert masked.all(dim=1)[0] and masked[:, 4].all()  # row 0 everything; the tail in every row
        first, second, odd = masked[1, :4], masked[2, :4], masked[3, :4]
        assert not (first & second).any() and (first | second).all() and 1 <= int(first.sum()) <= 3
        assert 1 <= int(odd.sum()) <= 3
        covered = torch.zeros(4, dtype=torch.float64)
        for row in (1, 2, 3):
            size = int(masked[row, :4].sum())
            expected = torch.where(masked[row, :4], 1.0 / size, 0.0).double()
            torch.testing.assert_close(weights[row, :4], expected, rtol=1e-6, atol=1e-7)
            covered += expected
        torch.testing.assert_close(weights[0, :4], 0.25 + control * 0.75 - control * covered, rtol=1e-6, atol=1e-6)
        assert not (weights[:, 4] != 0).any()
    with pytest.raises(ValueError, match="num_samples >= 2"):
        draw_plan("coupled_cv", prompt, completion, mask, num_samples=1, generator=None)


# ---------------------------------------------------------------------- deterministic values
def test_one_step_equals_single_forward(model, batch):
    prompt, completion, mask = batch
    inputs = torch.cat([prompt, torch.full_like(completion, MASK)], dim=1)  # every completion position masked
    with torch.no_grad():
        logp = model(inputs)[:, 3:].double().log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        expected = (logp * mask).sum(-1)
        got = likelihood_estimators["one_step"](model, prompt, completion, mask, mask_id=MASK, num_samples=4,
                                                 generator=_generator(0))
        # p_mask_prompt = 1 masks the whole prompt in every draw: deterministic again.
        masked_inputs = inputs.clone()
        masked_inputs[:, :3] = MASK
        logp_masked = model(masked_inputs)[:, 3:].double().log_softmax(-1)
        expected_masked = (logp_masked.gather(-1, completion.unsqueeze(-1)).squeeze(-1) * mask).sum(-1)
        got_masked = likelihood_estimators["one_step"](model, prompt, completion, mask, mask_id=MASK,
                                                        num_samples=3, generator=_generator(0), p_mask_prompt=1.0)
    assert torch.allclose(got.double(), expected, atol=1e-5)
    assert torch.allclose(got_masked.double(), expected_masked, atol=1e-5)
    # One forward only: the plan has one draw without prompt masking.
    assert draw_plan("one_step", prompt, completion, mask, num_samples=4, generator=None).num_samples == 1


def test_eubo_and_elbo_reductions_by_hand(model):
    prompt = torch.tensor([[1, 2, 3]])
    completion = torch.tensor([[4, 6, 8]])
    masked = torch.tensor([[[True, True, False]], [[False, False, True]]])  # draws: S = {0, 1}, S = {2}
    weights = torch.tensor([[[1.5, 1.5, 0.0]], [[0.0, 0.0, 3.0]]])  # L/l
    beta = 2.0
    eubo_plan = MaskPlan(masked, weights, torch.tensor([3.0]), reduction="eubo", beta=beta)
    elbo_plan = MaskPlan(masked, weights, torch.tensor([3.0]))
    with torch.no_grad():
        rows = [torch.cat([prompt[0], torch.where(m[0], MASK, completion[0])]) for m in masked]
        p = model(torch.stack(rows))[:, 3:].double().softmax(-1).gather(-1, completion.expand(2, -1).unsqueeze(-1))
        p = p.squeeze(-1)  # [2 draws, 3 tokens]
        a = [0.5 * 1.5 * p[0, 0] ** beta, 0.5 * 1.5 * p[0, 1] ** beta, 0.5 * 3.0 * p[1, 2] ** beta]
        expected_eubo = 3.0 * sum(torch.log(x) / beta for x in a) / 3
        expected_elbo = 0.5 * (1.5 * (p[0, 0].log() + p[0, 1].log()) + 3.0 * p[1, 2].log())
        got_eubo = score_plan(model, prompt, completion, eubo_plan, mask_id=MASK)
        got_elbo = score_plan(model, prompt, completion, elbo_plan, mask_id=MASK)
        token_logp = plan_token_logprobs(model, prompt, completion, eubo_plan, mask_id=MASK)
    assert torch.equal(token_logp == 0, weights == 0)  # only scored positions are evaluated
    assert torch.equal(elbo_plan.reduce(token_logp), got_elbo)  # one forward can feed both reductions (SPG mix)
    assert got_eubo.item() == pytest.approx(expected_eubo.item(), abs=1e-5)
    assert got_elbo.item() == pytest.approx(expected_elbo.item(), abs=1e-5)


def _exact_eubo_limit(model, prompt: Tensor, completion: Tensor, length: int, beta: float) -> float:
    """N → ∞ limit of spg_upper(masking='random'): Σ_i (1/β)·log E[(L/l)·1[i∈S]·p(x^i | c, x_S)^β], l ~ U{1..L}."""
    table = _logp_table(model, prompt, completion, list(range(length)))
    total = 0.0
    for i in range(length):
        expectation = 0.0
        for subset, logp in table.items():
            if i in subset:
                l = len(subset)
                expectation += (1 / length) / math.comb(length, l) * (length / l) * math.exp(beta * logp[i].item())
        total += math.log(expectation) / beta
    return total


def test_spg_upper_bounds_the_elbo(model, batch):
    prompt, completion, mask = batch
    beta = 1.5
    exact = exact_elbo(model, prompt, completion, mask, mask_id=MASK)
    limits = [
        _exact_eubo_limit(model, prompt[b], completion[b], length, beta)
        for b, length in enumerate(mask.sum(-1).tolist())
    ]
    with torch.no_grad():
        upper = likelihood_estimators["spg_upper"](model, prompt, completion, mask, mask_id=MASK, num_samples=1500,
                                                   generator=_generator(4), beta=beta)
        lower = likelihood_estimators["spg_lower"](model, prompt, completion, mask, mask_id=MASK, num_samples=1500,
                                                   generator=_generator(4))
        block_upper = likelihood_estimators["spg_upper"](
            model, prompt, completion, mask, mask_id=MASK, num_samples=1500, generator=_generator(5), beta=beta,
            masking="block", block_length=2,
        )
    block_exact = exact_elbo(model, prompt, completion, mask, mask_id=MASK, block_length=2)
    for b in range(2):
        assert limits[b] >= exact[b].item()  # Jensen: per-token (1/β) log E[w p^β] ≥ E[w log p]
        assert upper[b].item() == pytest.approx(limits[b], abs=0.1)  # log of a sample mean: O(1/N) low bias
        assert upper[b].item() > lower[b].item()
        assert block_upper[b].item() > block_exact[b].item()


# ---------------------------------------------------------------------- randomness, sharing, plumbing
ALL = [
    ("one_step", {"p_mask_prompt": 0.3}),
    ("elbo_t", {}),
    ("elbo_l", {}),
    ("coupled", {}),
    ("coupled_cv", {}),
    ("spg_lower", {"masking": "block", "block_length": 2, "p_mask_prompt": 0.15}),
    ("spg_upper", {}),
]


@pytest.mark.parametrize(("name", "options"), ALL)
def test_same_seed_same_estimate_and_shared_plan_ratio_is_one(model, batch, name, options):
    prompt, completion, mask = batch
    twin = copy.deepcopy(model)
    with torch.no_grad():
        first = likelihood_estimators[name](model, prompt, completion, mask, mask_id=MASK, num_samples=6,
                                            generator=_generator(7), **options)
        second = likelihood_estimators[name](model, prompt, completion, mask, mask_id=MASK, num_samples=6,
                                             generator=_generator(7), **options)
        assert torch.equal(first, second)
        plan = draw_plan(name, prompt, completion, mask, num_samples=6, generator=_generator(7), **options)
        current = score_plan(model, prompt, completion, plan, mask_id=MASK)
        old = score_plan(twin, prompt, completion, plan, mask_id=MASK)
    assert torch.equal(current, first)  # the estimator is draw_plan + score_plan
    assert torch.equal(torch.exp(current - old), torch.ones(2))


def test_gradients_flow_and_micro_batching_agrees(model, batch):
    prompt, completion, mask = batch
    for name in ("elbo_l", "spg_upper"):
        model.zero_grad()
        plan = draw_plan(name, prompt, completion, mask, num_samples=1, generator=_generator(8))  # some tokens unseen
        full = score_plan(model, prompt, completion, plan, mask_id=MASK)
        full.sum().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        assert any(g.abs().sum() > 0 for g in grads)
        with torch.no_grad():
            chunked = score_plan(model, prompt, completion, plan, mask_id=MASK, micro_batch=1)
        assert torch.allclose(full.detach(), chunked, atol=1e-6)
    model.zero_grad()


def test_plan_structure(batch):
    prompt, completion, mask = batch
    real = mask.bool()
    coupled = draw_plan("coupled", prompt, completion, mask, num_samples=10, generator=_generator(9))
    first, second = coupled.completion_masked.chunk(2, dim=0)
    tail = ~real.expand_as(first)
    assert torch.equal((first | second) & ~tail, ~tail) and torch.equal(first & second, tail)  # a partition + tail
    assert not (coupled.scored & ~real).any()  # the tail is never scored
    # Stratified counts with N = L_b are a permutation of 1..L_b.
    counts = stratified_counts(uniform((2,), _generator(0), torch.device("cpu")), torch.tensor([3, 5]), 5)
    assert sorted(counts[:, 1].tolist()) == [1, 2, 3, 4, 5]
    plan = draw_plan("elbo_l", prompt, completion, mask, num_samples=5, generator=_generator(0))
    sizes = plan.scored.sum(-1)  # [N, B] masked real tokens (the one tail position is masked besides)
    assert sorted(sizes[:, 1].tolist()) == [1, 2, 3, 4, 5]
    assert torch.allclose(plan.weights.sum(-1), real.sum(-1).float().expand(5, -1))  # (L/l)·l = L per draw
    # Block masking: one block scored, earlier blocks clean, later real tokens masked.
    block = draw_plan("spg_lower", prompt, completion, mask, num_samples=3, generator=_generator(1), masking="block",
                      block_length=2)
    for n in range(3):
        scored = block.scored[n, 1].nonzero().squeeze(-1)
        chosen = scored[0].item() // 2
        assert all(position // 2 == chosen for position in scored.tolist())
        masked = block.completion_masked[n, 1]
        assert not masked[: 2 * chosen].any() and masked[2 * chosen + 2 : 5].all()


def test_registry_and_validation(batch):
    prompt, completion, mask = batch
    assert set(likelihood_estimators.names()) == {"one_step", "elbo_t", "elbo_l", "coupled", "coupled_cv", "espo",
                                                  "spg_lower", "spg_upper", "trace", "random_masking", "sdmc",
                                                  "uniform_one_step"}
    assert likelihood_estimators.describe("elbo_l").startswith("LLaDA l-sampling")
    options = {option.name for option in likelihood_estimators.options("spg_upper")}
    assert {"beta", "masking", "block_length", "p_mask_prompt"} <= options
    with pytest.raises(ValueError, match="even"):
        draw_plan("coupled", prompt, completion, mask, num_samples=3, generator=None)
    with pytest.raises(ValueError, match="beta"):
        draw_plan("spg_upper", prompt, completion, mask, num_samples=2, generator=None, beta=0.5)
    with pytest.raises(ValueError, match="num_samples"):
        draw_plan("elbo_l", prompt, completion, mask, num_samples=0, generator=None)
    plan = draw_plan("elbo_l", prompt, completion, mask, num_samples=2, generator=None)
    with pytest.raises(ValueError, match="drawn for"):
        score_plan(lambda ids: ids, prompt, completion[:, :4], plan, mask_id=MASK)
