"""VESPO and LUSPO against TRL's computation, restated here as tensor code from TRL's formulas.

The restatements follow huggingface/trl@f2cd577 ``trl/trainer/grpo_trainer.py`` step by step: ``get_gamma_weights``
(L2941-2989) and the vespo loss (L3096-3107) reduced by ``num_items_in_batch`` (L3139-3142); the grpo/luspo clipped
term on the sequence ratio (L3056-3091) reduced by ``(per_token_loss * mask.sum(1, keepdim=True)).mean()`` over
gradient-accumulation steps (L3143-3148). They are written independently of mmrl's losses and take TRL's shapes
(``[B, 1]`` advantages, per-micro-batch normalisers). The mmrl loss, aggregated as docs/algorithms.md says reproduces
TRL, must give the same step value and gradient, on random inputs whose padding holds garbage.
"""

import math

import pytest
import torch

from mmrl.algos import aggregate, policy_losses
from mmrl.cli import main
from mmrl.config import ConfigError, load_config
from tests.algos.inputs import check_off_policy_run, off_policy_inputs
from tests.helpers import BASE, toy_config

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0],
                     [1.0, 0.0, 0.0, 0.0, 0.0],
                     [1.0, 1.0, 1.0, 1.0, 1.0],
                     [1.0, 1.0, 0.0, 0.0, 0.0],
                     [1.0, 1.0, 1.0, 1.0, 0.0],
                     [0.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)  # the last row has no active action
MICRO_BATCHES = (slice(0, 3), slice(3, 6))  # TRL's per-device micro-batches: equal sizes, as TRL's always are


def _inputs(seed: int, per_action: bool = False, spread: float = 0.3):
    return off_policy_inputs(MASK, seed, per_action=per_action, spread=spread)


# ------------------------------------------------------------------------------------------- TRL, restated
def _trl_gamma_weights(advantages, log_ratio_per_token, mask, k_pos, lambda_pos, k_neg, lambda_neg):
    """``get_gamma_weights`` with no vLLM IS ratio: per-token clamp ±20, masked *sum*, clamp [log 1e-8, 20],
    (k, λ) by A >= 0 with λ floored at 1e-4, φ = exp(λ + k·log w − λ·w) with non-finite values set to 0."""
    with torch.no_grad():
        lower = math.log(1e-8)
        seq_log_ratio = torch.sum(torch.clamp(log_ratio_per_token, -20.0, 20.0) * mask, dim=-1, keepdim=True)
        log_w = torch.clamp(seq_log_ratio, lower, 20.0)  # [B, 1]
        w = torch.exp(log_w)
        nonneg = advantages >= 0
        dtype = log_ratio_per_token.dtype
        k = torch.where(nonneg, torch.tensor(k_pos, dtype=dtype), torch.tensor(k_neg, dtype=dtype))
        lam = torch.where(nonneg, torch.tensor(lambda_pos, dtype=dtype), torch.tensor(lambda_neg, dtype=dtype))
        lam = lam.clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * w)
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _trl_vespo_step(new, old, adv, mask, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0):
    """TRL's vespo over the step's micro-batches on one process: each divides its summed loss by
    ``num_items_in_batch`` (the generation batch's active tokens: the step's, with TRL's default
    ``steps_per_generation = gradient_accumulation_steps``), the accumulated gradients add up."""
    num_items = mask.sum().clamp(min=1.0)
    total = 0.0
    for rows in MICRO_BATCHES:
        per_token_logps, advantages, m = new[rows], adv[rows], mask[rows]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        log_ratio = per_token_logps - old[rows]
        phi = _trl_gamma_weights(advantages, log_ratio, m, k_pos, lambda_pos, k_neg, lambda_neg)
        per_token_loss = -phi * advantages * per_token_logps
        total = total + (per_token_loss * m).sum() / num_items
    return total


def _trl_luspo_step(new, old, adv, mask, epsilon_low, epsilon_high):
    """TRL's luspo with ``importance_sampling_level="sequence"`` over the step's micro-batches: GSPO's ratio, the
    clipped term, ``(per_token_loss * mask.sum(1, keepdim=True)).mean()`` divided by the accumulation steps."""
    steps = len(MICRO_BATCHES)
    total = 0.0
    for rows in MICRO_BATCHES:
        per_token_logps, advantages, m = new[rows], adv[rows], mask[rows]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        log_ratio = per_token_logps - old[rows]
        log_importance_weights = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # [B, 1]
        coef_1 = torch.exp(log_importance_weights)
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
        loss = (per_token_loss * m.sum(1, keepdim=True)).mean()
        total = total + loss / steps
    return total


def _mmrl_step(name, new, old, adv, mode, num_sequences=None, **options):
    """mmrl over the same micro-batches with the step-wide counts the trainer passes."""
    num_actions = float(MASK.sum())
    num_sequences = float((MASK.sum(1) > 0).sum()) if num_sequences is None else num_sequences
    total = 0.0
    for rows in MICRO_BATCHES:
        loss, _ = policy_losses[name](new[rows], old[rows], adv[rows], MASK[rows], **options)
        total = total + aggregate(loss, MASK[rows], mode, num_actions=num_actions, num_sequences=num_sequences)
    return total


def _assert_same_value_and_gradient(expected, value, new):
    (expected_grad,) = torch.autograd.grad(expected, new)
    (grad,) = torch.autograd.grad(value, new)
    torch.testing.assert_close(value, expected.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
    assert torch.all(grad[MASK == 0] == 0), "padding must not receive a gradient"
    assert grad.abs().sum() > 0


# ------------------------------------------------------------------------------------ values and gradients vs TRL
VESPO_OPTIONS = [{}, {"k_pos": 1.5, "lambda_pos": 0.5, "k_neg": 0.0, "lambda_neg": 1e-4}]


@pytest.mark.parametrize("per_action", [False, True], ids=["adv[N]", "adv[N,A]"])
@pytest.mark.parametrize("options", VESPO_OPTIONS, ids=["defaults", "custom"])
@pytest.mark.parametrize("spread", [0.3, 6.0])
def test_vespo_with_token_mean_is_trl_vespo(per_action, options, spread):
    """Per-action advantages pick (k, λ) per action, as TRL's ``[B, T]`` ones. The wide spread takes one row's log w
    past the upper clamp (φ = 0 there) and the others far from 0."""
    new, old, adv = _inputs(1, per_action, spread)
    expected = _trl_vespo_step(new, old, adv, MASK, **options)
    value = _mmrl_step("vespo", new, old, adv, "token_mean", **options)
    _assert_same_value_and_gradient(expected, value, new)


LUSPO_CLIPS = [(2e-3, 2.5e-3), (0.2, 0.28)]


@pytest.mark.parametrize("advantages", ["adv[N]", "row-constant adv[N,A]"])
@pytest.mark.parametrize(("clip_low", "clip_high"), LUSPO_CLIPS, ids=["paper", "wide"])
def test_luspo_with_seq_mean_token_mean_is_trl_luspo(advantages, clip_low, clip_high):
    """TRL's whole step (micro-batch means over B rows, divided by the accumulation steps) equals
    ``seq_mean_token_mean`` over the step's rows. TRL's B counts the row without active actions: passing every row
    as ``num_sequences`` gives TRL's value; mmrl's default count leaves it out (a scale of 6/5 here)."""
    new, old, adv = _inputs(2)
    if advantages != "adv[N]":
        adv = adv[:, None].expand(MASK.shape)  # TRL's [B, T] path: the mean runs over every column, padding too
    expected = _trl_luspo_step(new, old, adv, MASK, clip_low, clip_high)
    options = {"clip_low": clip_low, "clip_high": clip_high}
    value = _mmrl_step("luspo", new, old, adv, "seq_mean_token_mean", num_sequences=float(MASK.shape[0]), **options)
    _assert_same_value_and_gradient(expected, value, new)
    default_count = _mmrl_step("luspo", new, old, adv, "seq_mean_token_mean", **options)
    torch.testing.assert_close(default_count, expected.detach() * 6 / 5, rtol=1e-10, atol=1e-12)


def test_luspo_clips_some_rows_and_not_others_at_the_paper_bounds():
    """The comparison above exercises both branches of the min: s_i inside and outside [1 − ε_low, 1 + ε_high]."""
    new, old, adv = _inputs(2)
    _, metrics = policy_losses["luspo"](new, old, adv, MASK)
    assert 0 < metrics["clip_fraction"].item() < 1
    _, wide = policy_losses["luspo"](new, old, adv, MASK, clip_low=0.2, clip_high=0.28)
    assert wide["clip_fraction"].item() < metrics["clip_fraction"].item()


def test_luspo_per_action_advantages_take_each_rows_mean_over_its_active_actions():
    """With advantages that vary along a row, row i contributes Σ_t m·ℓ_{i,t} = |o_i|·mean_t ℓ_{i,t} (TRL's
    ``[B, T]`` mean would run over the padding columns too): restated one action at a time."""
    new, old, adv = _inputs(3, per_action=True)
    eps_low, eps_high = 0.2, 0.28
    rows = []
    for i in range(MASK.shape[0]):
        active = [t for t in range(MASK.shape[1]) if MASK[i, t] > 0]
        if not active:
            continue
        s = torch.exp(sum(new[i, t] - old[i, t] for t in active) / len(active))
        terms = [torch.maximum(-adv[i, t] * s, -adv[i, t] * s.clamp(1 - eps_low, 1 + eps_high)) for t in active]
        rows.append(sum(terms))
    expected = sum(rows) / len(rows)
    loss, _ = policy_losses["luspo"](new, old, adv, MASK, clip_low=eps_low, clip_high=eps_high)
    _assert_same_value_and_gradient(expected, aggregate(loss, MASK, "seq_mean_token_mean"), new)


def test_luspo_is_gspo_scaled_by_each_rows_length():
    new, old, adv = _inputs(4, per_action=True)
    loss, metrics = policy_losses["luspo"](new, old, adv, MASK, clip_low=0.1, clip_high=0.1)
    gspo, gspo_metrics = policy_losses["gspo"](new, old, adv, MASK, clip_low=0.1, clip_high=0.1)
    torch.testing.assert_close(loss, MASK.sum(1, keepdim=True) * gspo)
    assert metrics.keys() == gspo_metrics.keys()
    for key in metrics:
        torch.testing.assert_close(metrics[key], gspo_metrics[key])


# ------------------------------------------------------------------------------------------------------ on-policy
@pytest.mark.parametrize("per_action", [False, True], ids=["adv[N]", "adv[N,A]"])
def test_on_policy_vespo_is_reinforce_in_value_and_gradient(per_action):
    """φ(1) = e^λ·1^k·e^−λ = 1 for either pair: the loss is −A·log π itself."""
    torch.manual_seed(0)
    features = torch.randn(*MASK.shape, 3, dtype=torch.float64)
    weights = torch.randn(3, dtype=torch.float64, requires_grad=True)
    _, _, adv = _inputs(5, per_action)

    def logp():
        return torch.nn.functional.logsigmoid(features @ weights)  # [N, A]

    loss, metrics = policy_losses["vespo"](logp(), logp().detach(), adv, MASK)
    plain, _ = policy_losses["reinforce"](logp(), logp().detach(), adv, MASK)
    torch.testing.assert_close(loss, plain, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(aggregate(loss, MASK, "token_mean"), weights)
    (expected,) = torch.autograd.grad(aggregate(plain, MASK, "token_mean"), weights)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    assert metrics["phi_mean"].item() == 1.0 and metrics["seq_log_ratio_mean"].item() == 0.0


@pytest.mark.parametrize("per_action", [False, True], ids=["adv[N]", "adv[N,A]"])
def test_on_policy_luspo_is_reinforce_summed_over_each_sequence(per_action):
    """s = 1: row i's gradient is −Ā_i·Σ_t ∇log π, REINFORCE under ``seq_mean_token_sum`` with the row's mean
    advantage (no 1/|o_i|: the length bias GSPO's mean introduces is gone); the value is −|o_i|·Ā_i per row."""
    torch.manual_seed(0)
    features = torch.randn(*MASK.shape, 3, dtype=torch.float64)
    weights = torch.randn(3, dtype=torch.float64, requires_grad=True)
    _, _, adv = _inputs(6, per_action)
    row_adv = adv if adv.dim() == 1 else (adv * MASK).sum(1) / MASK.sum(1).clamp(min=1)

    def logp():
        return torch.nn.functional.logsigmoid(features @ weights)  # [N, A]

    loss, metrics = policy_losses["luspo"](logp(), logp().detach(), adv, MASK)
    value = aggregate(loss, MASK, "seq_mean_token_mean")
    (grad,) = torch.autograd.grad(value, weights)
    plain, _ = policy_losses["reinforce"](logp(), logp().detach(), row_adv, MASK)
    (expected,) = torch.autograd.grad(aggregate(plain, MASK, "seq_mean_token_sum"), weights)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    lengths = MASK.sum(1)
    torch.testing.assert_close(value, -(lengths * row_adv).sum() / 5)  # five rows with active actions
    assert metrics["clip_fraction"].item() == 0.0 and metrics["ratio_max"].item() == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------- VESPO's kernel by hand
def test_vespo_weight_by_hand_for_each_advantage_sign():
    """One-action rows with w = 2, 1/2, 3/2: φ = w^k·e^(λ(1 − w)), (k, λ) = (2, 3) for A >= 0 (A = 0 included),
    (3, 2) for A < 0; the gradient on log π is −φ·A and the value −φ·A·log π."""
    ws = [2.0, 0.5, 1.5, 2.0, 0.5, 2.0]
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, 0.0], dtype=torch.float64)
    logp = torch.tensor([[-0.7], [-1.2], [-0.3], [-2.0], [-0.1], [-0.5]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - torch.tensor(ws, dtype=torch.float64).log()[:, None]
    loss, metrics = policy_losses["vespo"](logp, old, adv, torch.ones(6, 1, dtype=torch.float64))
    pairs = [(2.0, 3.0) if a >= 0 else (3.0, 2.0) for a in adv.tolist()]
    phi = torch.tensor([w**k * math.exp(lam * (1 - w)) for w, (k, lam) in zip(ws, pairs, strict=True)],
                       dtype=torch.float64)
    torch.testing.assert_close(loss[:, 0], -phi * adv * logp.detach()[:, 0])
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad[:, 0], -phi * adv)
    assert metrics["phi_mean"].item() == pytest.approx(phi.mean().item())
    assert phi[0].item() == pytest.approx(4 * math.exp(-3))  # A > 0, w = 2: 2²·e^(3·(−1))
    assert phi[3].item() == pytest.approx(8 * math.exp(-2))  # A < 0, w = 2: 2³·e^(2·(−1))


def test_vespo_metrics_are_masked_means_over_the_actions():
    """``phi_mean`` and ``seq_log_ratio_mean`` weigh each row's φ and log w by its active actions (3, 1, 5, 2, 4, 0):
    padding and the empty row stay out. TRL's restated φ gives the expected values; the plain means over the rows
    and over every column differ from them here, so a metric that drops the mask fails."""
    new, old, adv = _inputs(9)
    _, metrics = policy_losses["vespo"](new, old, adv, MASK)
    x = new.detach() - old  # [N, A]
    phi = _trl_gamma_weights(adv[:, None], x, MASK, 2.0, 3.0, 3.0, 2.0)[:, 0]  # [N]
    log_w = (x.clamp(-20.0, 20.0) * MASK).sum(1).clamp(math.log(1e-8), 20.0)  # [N]
    lengths = MASK.sum(1)  # [N]
    for key, per_row in (("phi_mean", phi), ("seq_log_ratio_mean", log_w)):
        expected = (per_row * lengths).sum().item() / lengths.sum().item()
        assert metrics[key].item() == pytest.approx(expected, rel=1e-6), key
        assert abs(per_row.mean().item() - expected) > 1e-3 * max(abs(expected), 1.0), key  # the inputs discriminate


@pytest.mark.parametrize(("sign", "k", "lam"), [(1.0, 2.0, 3.0), (-1.0, 3.0, 2.0)])
def test_vespo_weight_peaks_at_k_over_lambda(sign, k, lam):
    """dφ/dw = φ·(k/w − λ) vanishes at w = k/λ (2/3 for A >= 0, 3/2 for A < 0 by default) with φ > 1 there."""
    ws = torch.tensor([k / lam - 0.01, k / lam, k / lam + 0.01, 1.0], dtype=torch.float64)
    logp = torch.zeros(4, 1, dtype=torch.float64)
    _, metrics = policy_losses["vespo"](logp, -ws.log()[:, None], torch.full((4,), sign, dtype=torch.float64),
                                        torch.ones(4, 1, dtype=torch.float64))
    phi = [policy_losses["vespo"](logp[i:i + 1], -ws[i:i + 1].log()[:, None], torch.tensor([sign]),
                                  torch.ones(1, 1, dtype=torch.float64))[1]["phi_mean"].item() for i in range(4)]
    assert phi[1] > phi[0] and phi[1] > phi[2] and phi[1] > 1.0
    assert phi[3] == pytest.approx(1.0)
    assert phi[1] == pytest.approx(math.exp(lam - k) * (k / lam) ** k)


def test_vespo_sequence_weight_is_the_product_of_the_ratios_not_their_geometric_mean():
    """log r = (0.3, 0.3) and padding: log w = 0.6 (GSPO's sequence ratio would be e^0.3), padding left out."""
    logp = torch.tensor([[0.3, 0.3, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    _, metrics = policy_losses["vespo"](logp, torch.zeros(1, 3, dtype=torch.float64), torch.tensor([1.0]), mask)
    w = math.exp(0.6)
    assert metrics["seq_log_ratio_mean"].item() == pytest.approx(0.6)
    assert metrics["phi_mean"].item() == pytest.approx(w**2 * math.exp(3 * (1 - w)))


def test_vespo_clamps_each_token_then_the_sequence_in_log_space():
    """As TRL: each token's log r to ±20 before the sum, the sum to [log 1e-8, 20]."""
    one = torch.ones(1, 2, dtype=torch.float64)
    zeros = torch.zeros(1, 2, dtype=torch.float64)
    # log r = (25, −24): clamped per token, 20 − 20 = 0 and φ = 1; the raw sum 1 would give φ = e^(2 + 3 − 3e)
    logp = torch.tensor([[25.0, -24.0]], dtype=torch.float64)
    _, metrics = policy_losses["vespo"](logp, zeros, torch.tensor([1.0]), one)
    assert metrics["phi_mean"].item() == 1.0 and metrics["seq_log_ratio_mean"].item() == 0.0
    # log w = −30 floors at log 1e-8: visible through φ with a small k (λ·w ≈ 0 either way)
    logp = torch.tensor([[-15.0, -15.0]], dtype=torch.float64)
    _, metrics = policy_losses["vespo"](logp, zeros, torch.tensor([1.0]), one, k_pos=0.01, lambda_pos=1.0)
    floor = math.log(1e-8)
    assert metrics["seq_log_ratio_mean"].item() == pytest.approx(floor)
    assert metrics["phi_mean"].item() == pytest.approx(math.exp(1.0 + 0.01 * floor - 1e-8))
    # log w = 25 caps at 20 (φ = 0 there for every allowed λ: λ·e^20 >= 4.8e4)
    logp = torch.tensor([[15.0, 10.0]], dtype=torch.float64)
    _, metrics = policy_losses["vespo"](logp, zeros, torch.tensor([-1.0]), one)
    assert metrics["seq_log_ratio_mean"].item() == 20.0 and metrics["phi_mean"].item() == 0.0


def test_vespo_sets_an_overflowing_weight_to_zero_as_trl():
    """float32: k = 10, log w = 10, λ = 1e-4 gives log φ ≈ 97.8 > 88.7, exp overflows; TRL's nan_to_num makes that
    sequence's weight 0, and so does mmrl (the other row keeps its finite φ)."""
    logp = torch.tensor([[5.0, 5.0], [0.1, 0.0]], requires_grad=True)
    old, mask, adv = torch.zeros(2, 2), torch.ones(2, 2), torch.tensor([1.0, 1.0])
    loss, _ = policy_losses["vespo"](logp, old, adv, mask, k_pos=10.0, lambda_pos=1e-4)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert torch.all(grad[0] == 0) and torch.all(torch.isfinite(loss))
    expected = _trl_gamma_weights(adv[:, None], logp.detach() - old, mask, 10.0, 1e-4, 3.0, 2.0)
    assert expected[0, 0].item() == 0.0
    torch.testing.assert_close(grad[1], -expected[1].expand(2))


# -------------------------------------------------------------------------------- advantages [N] and [N, A], metrics
@pytest.mark.parametrize("name", ["vespo", "luspo"])
def test_row_constant_per_action_advantages_equal_per_sample_ones(name):
    new, old, adv = _inputs(7)
    loss, metrics = policy_losses[name](new, old, adv, MASK)
    wide, wide_metrics = policy_losses[name](new, old, adv[:, None].expand(MASK.shape), MASK)
    torch.testing.assert_close(loss, wide)
    for key in metrics:
        torch.testing.assert_close(metrics[key], wide_metrics[key])
    with pytest.raises(ValueError, match="advantages"):
        policy_losses[name](new, old, torch.ones(4, dtype=torch.float64), MASK)


EXPECTED_METRICS = {"vespo": {"phi_mean", "seq_log_ratio_mean"},
                    "luspo": {"clip_fraction", "clip_fraction_low", "clip_fraction_high"}}
AGGREGATION = {"vespo": "token_mean", "luspo": "seq_mean_token_mean"}


@pytest.mark.parametrize("name", ["vespo", "luspo"])
def test_metrics_are_present_finite_detached_scalars(name):
    new, old, adv = _inputs(8, per_action=True)
    _, metrics = policy_losses[name](new.float(), old.float(), adv.float(), MASK.float())
    assert set(metrics) == {"ratio_mean", "ratio_min", "ratio_max", "approx_kl"} | EXPECTED_METRICS[name]
    for key, value in metrics.items():
        assert value.dim() == 0 and value.dtype == torch.float32 and not value.requires_grad, key
        assert torch.isfinite(value), key
    _, empty = policy_losses[name](torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0), torch.zeros(0, 3))
    assert all(torch.isfinite(value) for value in empty.values())


# ------------------------------------------------------------------------------------ options, config, mmrl list
@pytest.mark.parametrize(("name", "options", "match"), [
    ("vespo", {"k_pos": -0.1}, "k_pos"),
    ("vespo", {"k_neg": -1.0}, "k_neg"),
    ("vespo", {"lambda_pos": 0.0}, "lambda_pos"),
    ("vespo", {"lambda_neg": 5e-5}, "lambda_neg"),  # TRL would silently raise it to 1e-4
    ("vespo", {"ratio_level": "token"}, "ratio_level"),
    ("luspo", {"clip_low": 1.0}, "clip_low"),
    ("luspo", {"clip_high": -0.1}, "clip_high"),
    ("luspo", {"ratio_level": "token"}, "ratio_level"),
])
def test_bad_options_are_refused_on_direct_calls(name, options, match):
    with pytest.raises(ValueError, match=match):
        policy_losses[name](torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), **options)


@pytest.mark.parametrize(("name", "option", "value", "allowed"), [
    ("vespo", "k_pos", -0.5, "a number >= 0"),
    ("vespo", "lambda_neg", 0.0, "a number >= 0.0001"),
    ("luspo", "clip_low", 1.0, "a number in [0, 1)"),
    ("luspo", "clip_high", -0.5, "a number >= 0"),
])
def test_config_refuses_bad_options_in_one_line(name, option, value, allowed):
    data = {**BASE, "algorithm": {**BASE["algorithm"], "policy_loss": {"name": name, option: value}}}
    with pytest.raises(ConfigError) as info:
        load_config(data)
    assert str(info.value) == f"config key 'algorithm.policy_loss.{option}': got {value!r}; allowed: {allowed}"


@pytest.mark.parametrize("name", ["vespo", "luspo"])
def test_each_declares_the_sequence_level_so_action_chunks_are_refused(tmp_path, name):
    from mmrl.trainer import Trainer
    from mmrl.trainer.learn import ratio_level

    assert ratio_level(toy_config(tmp_path, f"algorithm.policy_loss={name}")) == "sequence"
    with pytest.raises(ConfigError) as info:
        toy_config(tmp_path, f"algorithm.policy_loss={name}", "algorithm.policy_loss.ratio_level=token")
    assert "\n" not in str(info.value) and "sequence" in str(info.value)
    with pytest.raises(ConfigError, match="action_chunk_size"):  # w and |o_i| need every action of the row at once
        Trainer(toy_config(tmp_path, "algorithm.action_chunk_size=2", f"algorithm.policy_loss={name}"))


@pytest.mark.parametrize("name", ["vespo", "luspo"])
def test_the_trainer_runs_each_loss_off_policy(tmp_path, name):
    """Two inner epochs of two mini-batches: the later updates are off-policy, the first is on-policy."""
    options = ["algorithm.policy_loss.clip_low=0.2", "algorithm.policy_loss.clip_high=0.28"] if name == "luspo" else []
    config = toy_config(tmp_path, "run.max_steps=2", f"algorithm.policy_loss={name}", *options,
                        "algorithm.inner_epochs=2", "algorithm.minibatches=2",
                        f"algorithm.aggregation={AGGREGATION[name]}", "optim.lr=3e-2")
    check_off_policy_run(config, EXPECTED_METRICS[name])


def test_mmrl_list_shows_them_with_one_line_descriptions(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name, start in (("vespo", "VESPO: "), ("luspo", "LUSPO: ")):
        lines = [line for line in out.splitlines() if line.startswith(f"  {name}  — ")]
        assert len(lines) == 1 and lines[0].startswith(f"  {name}  — {start}"), lines
        assert lines[0] == f"  {name}  — {policy_losses.describe(name)}"
