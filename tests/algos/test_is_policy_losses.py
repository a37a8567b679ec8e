"""CISPO, SAPO and GMPO against their upstream definitions, restated here one element at a time.

Each restatement is a plain loop over the active actions written from the upstream code, independent of mmrl's
vectorised losses: TRL ``trl/trainer/grpo_trainer.py`` (``cispo``, ``sapo``) and
``trl/experimental/gmpo/gmpo_trainer.py`` at huggingface/trl@f2cd577; verl ``verl/trainer/ppo/core_algos.py``
(``compute_policy_loss_cispo``, ``_sapo``, ``_geo_mean``) at volcengine/verl@b178a3c. The mmrl loss, aggregated as
docs/algorithms.md says reproduces each library, must give the same value and the same gradient on random inputs
whose padding holds garbage.
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
                     [0.0, 0.0, 0.0, 0.0, 0.0]])  # the last row has no active action


def _inputs(seed: int, per_action: bool = False, spread: float = 0.6):
    return off_policy_inputs(MASK, seed, per_action=per_action, spread=spread)


def _adv(adv, i, t):
    return float(adv[i]) if adv.dim() == 1 else float(adv[i, t])


def _active(i):
    return [t for t in range(MASK.shape[1]) if MASK[i, t] > 0]


def _token_mean(terms_per_row):
    """TRL cispo (Σ m·L over the step's token count) and verl token-mean."""
    terms = [term for row in terms_per_row for term in row]
    return sum(terms) / len(terms)


def _seq_mean_token_mean(terms_per_row):
    """verl seq-mean-token-mean and TRL grpo/sapo, rows without active tokens left out as verl and mmrl do (TRL's
    ``.mean()`` counts them with loss 0: a scale of non-empty/all rows, see the sapo docstring)."""
    rows = [sum(row) / len(row) for row in terms_per_row if row]
    return sum(rows) / len(rows)


# ------------------------------------------------------------------------------------------ upstream restatements
def _trl_cispo(new, old, adv, epsilon_high):
    """TRL: −clamp(r, max=ε_high).detach()·A·logp per token; token-count normaliser."""
    rows = []
    for i in range(MASK.shape[0]):
        rows.append([-torch.exp(new[i, t] - old[i, t]).clamp(max=epsilon_high).detach() * _adv(adv, i, t) * new[i, t]
                     for t in _active(i)])
    return _token_mean(rows)


def _verl_cispo(new, old, adv, clip_ratio_low, clip_ratio_high):
    """verl: −clamp(r, 1 − lo, 1 + hi).detach()·A·logp per token, token-mean."""
    rows = []
    for i in range(MASK.shape[0]):
        row = []
        for t in _active(i):
            ratio = torch.exp((new[i, t] - old[i, t]).clamp(-20.0, 20.0))
            weight = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high).detach()
            row.append(-weight * _adv(adv, i, t) * new[i, t])
        rows.append(row)
    return _token_mean(rows)


def _sapo(new, old, adv, tau_pos, tau_neg):
    """TRL and verl alike: −σ(τ(r − 1))·4/τ·A, τ = τ_pos if A > 0 else τ_neg; per-sequence token mean, then mean."""
    rows = []
    for i in range(MASK.shape[0]):
        row = []
        for t in _active(i):
            a = _adv(adv, i, t)
            tau = tau_pos if a > 0 else tau_neg
            ratio = torch.exp(new[i, t] - old[i, t])
            row.append(-torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a)
        rows.append(row)
    return _seq_mean_token_mean(rows)


def _verl_geo_mean(new, old, adv, clip_low, clip_high):
    """verl geo_mean: c = sgn(A)·min(sgn(A)·x, sgn(A)·clamp(x)) per token, ρ = exp(masked mean c), Ā the masked mean
    advantage, −Ā·ρ per row, mean over the rows (rows without tokens left out: see the docstring of gmpo)."""
    losses = []
    for i in range(MASK.shape[0]):
        active = _active(i)
        if not active:
            continue
        clipped, advantages = [], []
        for t in active:
            x = new[i, t] - old[i, t]
            a = _adv(adv, i, t)
            sign = (a > 0) - (a < 0)
            clipped.append(sign * torch.minimum(sign * x, sign * x.clamp(-clip_low, clip_high)))
            advantages.append(a)
        rho = torch.exp(sum(clipped) / len(active))
        losses.append(-(sum(advantages) / len(active)) * rho)
    return sum(losses) / len(losses)


def _trl_gmpo(new, old, adv, epsilon_low, epsilon_high):
    """TRL GMPOTrainer ([B] advantages): where(A > 0, min(x, clamp(x)), max(x, clamp(x))), exp of the masked mean,
    −ρ·A per sequence, mean over the sequences (rows without active tokens left out; TRL counts them with the
    constant −A, see the gmpo docstring)."""
    losses = []
    for i in range(MASK.shape[0]):
        active = _active(i)
        if not active:
            continue
        a = float(adv[i])
        logs = []
        for t in active:
            x = new[i, t] - old[i, t]
            bounded = x.clamp(-epsilon_low, epsilon_high)
            logs.append(torch.minimum(x, bounded) if a > 0 else torch.maximum(x, bounded))
        losses.append(-torch.exp(sum(logs) / len(active)) * a)
    return sum(losses) / len(losses)


def _mmrl(name, new, old, adv, aggregation, **options):
    loss, metrics = policy_losses[name](new, old, adv, MASK.to(new.dtype), **options)
    return aggregate(loss, MASK.to(new.dtype), aggregation), metrics


def _compare(upstream, mmrl, seed, per_action=False):
    new, old, adv = _inputs(seed, per_action)
    expected = upstream(new, old, adv)
    (expected_grad,) = torch.autograd.grad(expected, new)
    value, _ = mmrl(new, old, adv)
    (grad,) = torch.autograd.grad(value, new)
    torch.testing.assert_close(value, expected.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
    assert torch.all(grad[MASK == 0] == 0), "padding must not receive a gradient"
    return new, old, adv


# ------------------------------------------------------------------------------ values and gradients vs upstream
CASES = {
    # TRL epsilon_high = ε_max (ScaleRL 5.0, TRL's recommendation) ↔ clip_low null, clip_high ε_max − 1; 1.3 binds.
    "cispo_trl_default": (lambda n, o, a: _trl_cispo(n, o, a, 5.0),
                          lambda n, o, a: _mmrl("cispo", n, o, a, "token_mean")),
    "cispo_trl_1.3": (lambda n, o, a: _trl_cispo(n, o, a, 1.3),
                      lambda n, o, a: _mmrl("cispo", n, o, a, "token_mean", clip_high=0.3)),
    "cispo_verl_default": (lambda n, o, a: _verl_cispo(n, o, a, 0.2, 0.2),
                           lambda n, o, a: _mmrl("cispo", n, o, a, "token_mean", clip_low=0.2, clip_high=0.2)),
    "cispo_verl_example": (lambda n, o, a: _verl_cispo(n, o, a, 10.0, 0.2),  # its lower bound −9 never binds
                           lambda n, o, a: _mmrl("cispo", n, o, a, "token_mean", clip_low=None, clip_high=0.2)),
    "sapo_default": (lambda n, o, a: _sapo(n, o, a, 1.0, 1.05),
                     lambda n, o, a: _mmrl("sapo", n, o, a, "seq_mean_token_mean")),
    "sapo_asymmetric": (lambda n, o, a: _sapo(n, o, a, 0.5, 3.0),
                        lambda n, o, a: _mmrl("sapo", n, o, a, "seq_mean_token_mean", tau_pos=0.5, tau_neg=3.0)),
    "gmpo_verl_default": (lambda n, o, a: _verl_geo_mean(n, o, a, 0.4, 0.4),
                          lambda n, o, a: _mmrl("gmpo", n, o, a, "seq_mean_token_mean")),
    "gmpo_verl_asymmetric": (lambda n, o, a: _verl_geo_mean(n, o, a, 0.1, 0.25),
                             lambda n, o, a: _mmrl("gmpo", n, o, a, "seq_mean_token_mean", clip_low=0.1,
                                                   clip_high=0.25)),
}


@pytest.mark.parametrize("per_action", [False, True], ids=["adv[N]", "adv[N,A]"])
@pytest.mark.parametrize("case", list(CASES))
def test_value_and_gradient_equal_the_upstream_formula(case, per_action):
    upstream, mmrl = CASES[case]
    for seed in range(3):
        _compare(upstream, mmrl, seed, per_action)


@pytest.mark.parametrize(("epsilon_low", "epsilon_high"), [(0.4, 0.4), (0.1, 0.25)])
def test_gmpo_equals_trls_gmpo_trainer(epsilon_low, epsilon_high):
    for seed in range(3):
        _compare(lambda n, o, a: _trl_gmpo(n, o, a, epsilon_low, epsilon_high),
                 lambda n, o, a: _mmrl("gmpo", n, o, a, "seq_mean_token_mean", clip_low=epsilon_low,
                                       clip_high=epsilon_high), seed)


def test_the_comparisons_are_off_policy_and_reach_the_clip_bounds():
    """The random inputs above exercise every branch: ratios past e^±0.4, 1.2 and 0.8, advantages of both signs."""
    new, old, _ = _inputs(0)
    log_r = (new - old).detach()[MASK > 0]
    assert (log_r > 0.4).any() and (log_r < -0.4).any()
    assert (log_r.exp() > 1.3).any() and (log_r.exp() < 0.8).any()


# ------------------------------------------------------------------- chunk and sequence ratios, off-policy
CHUNKS = torch.tensor([[0, 0, 1, 1, 2]] * MASK.shape[0])


def _unit_log_ratio(new, old, i, t, level):
    """The masked mean of x over the unit of action t: TRL ``importance_sampling_level="sequence"``
    (grpo_trainer.py L3057-3059) for the row, Chunk-GRPO (arXiv:2510.21583) for the actions sharing t's chunk id."""
    if level == "sequence":
        members = _active(i)
    else:
        members = [u for u in _active(i) if CHUNKS[i, u] == CHUNKS[i, t]]
    return sum(new[i, u] - old[i, u] for u in members) / len(members)


def _cispo_at_level(new, old, adv, level, clip_low, clip_high):
    """TRL cispo on the unit ratio: −sg(clip(r_unit))·A·logp per action, token-count normaliser."""
    rows = []
    for i in range(MASK.shape[0]):
        row = []
        for t in _active(i):
            weight = torch.exp(_unit_log_ratio(new, old, i, t, level)).clamp(1 - clip_low, 1 + clip_high).detach()
            row.append(-weight * _adv(adv, i, t) * new[i, t])
        rows.append(row)
    return _token_mean(rows)


def _sapo_at_level(new, old, adv, level, tau_pos, tau_neg):
    """TRL sapo on the unit ratio (gradients through every action of the unit): −σ(τ(r_unit − 1))·4/τ·A."""
    rows = []
    for i in range(MASK.shape[0]):
        row = []
        for t in _active(i):
            a = _adv(adv, i, t)
            tau = tau_pos if a > 0 else tau_neg
            ratio = torch.exp(_unit_log_ratio(new, old, i, t, level))
            row.append(-torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a)
        rows.append(row)
    return _seq_mean_token_mean(rows)


@pytest.mark.parametrize("per_action", [False, True], ids=["adv[N]", "adv[N,A]"])
@pytest.mark.parametrize("level", ["chunk", "sequence"])
@pytest.mark.parametrize("name", ["cispo", "sapo"])
def test_chunk_and_sequence_ratios_off_policy(name, level, per_action):
    """Off-policy the unit's geometric-mean ratio replaces the token ratio (on-policy every level gives r = 1, so
    only this comparison sees the level). CISPO's bounds 0.8 / 1.3 bind for some units and not for others."""
    options = {"ratio_level": level, "chunk_ids": CHUNKS}
    if name == "cispo":
        def upstream(n, o, a):
            return _cispo_at_level(n, o, a, level, 0.2, 0.3)

        def mmrl(n, o, a):
            return _mmrl("cispo", n, o, a, "token_mean", clip_low=0.2, clip_high=0.3, **options)
    else:
        def upstream(n, o, a):
            return _sapo_at_level(n, o, a, level, 0.5, 3.0)

        def mmrl(n, o, a):
            return _mmrl("sapo", n, o, a, "seq_mean_token_mean", tau_pos=0.5, tau_neg=3.0, **options)
    unit_ratios = []
    for seed in range(3):
        new, old, adv = _compare(upstream, mmrl, seed, per_action)
        unit_ratios += [_unit_log_ratio(new, old, i, t, level).exp().item() for i in range(MASK.shape[0])
                        for t in _active(i)]
    assert any(r > 1.3 for r in unit_ratios) and any(r < 0.8 for r in unit_ratios)
    assert any(0.8 < r < 1.3 for r in unit_ratios) and len(set(unit_ratios)) < len(unit_ratios)


def test_gmpo_log_ratio_clamp_touches_only_the_unclipped_side_past_20():
    """The ±20 clamp of :mod:`mmrl.algos.ratios` (verl and TRL have none): a token at x = −25 is clipped to −ε_low
    anyway where A < 0 (upstream's value and gradient), but where A > 0 it enters ρ as −20 and loses its gradient,
    where upstream keeps x and −Ā·ρ/|o| (the gmpo docstring's numbers)."""
    x = torch.full((2, 50), 0.01, dtype=torch.float64)
    x[:, 7] = -25.0
    new = x.clone().requires_grad_(True)
    adv = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    loss, _ = policy_losses["gmpo"](new, torch.zeros_like(x), adv, torch.ones_like(x))
    (grad,) = torch.autograd.grad(loss[:, 0].sum(), new)
    bounded = x.clamp(-0.4, 0.4)
    upstream_c = torch.where(adv[:, None] > 0, torch.minimum(x, bounded), torch.maximum(x, bounded))  # [2, 50]
    upstream_rho = upstream_c.mean(dim=1).exp()  # [2]
    torch.testing.assert_close(loss[0, 0], upstream_rho[0])  # A < 0: the clipped side, as upstream
    torch.testing.assert_close(grad[0, 7], torch.zeros((), dtype=torch.float64))  # clipped: frozen upstream too
    torch.testing.assert_close(grad[0, 0], upstream_rho[0] / 50)
    assert upstream_rho[1].item() == pytest.approx(0.613, abs=1e-3)
    clamped_rho = (x[1].clamp(min=-20.0).clamp(max=0.4)).mean().exp()
    assert clamped_rho.item() == pytest.approx(0.677, abs=1e-3)
    torch.testing.assert_close(loss[1, 0], -clamped_rho)
    assert grad[1, 7].item() == 0.0 and grad[1, 0].item() == pytest.approx(-clamped_rho.item() / 50)


@pytest.mark.parametrize("name", ["cispo", "sapo", "gmpo"])
def test_padding_never_matters(name):
    new, old, adv = _inputs(1)
    loss, metrics = policy_losses[name](new, old, adv, MASK.double())
    other_new = torch.where(MASK > 0, new.detach(), -new.detach() * 3).requires_grad_(True)
    other_old = torch.where(MASK > 0, old, old + 7.0)
    other_loss, other_metrics = policy_losses[name](other_new, other_old, adv, MASK.double())
    torch.testing.assert_close(loss[MASK > 0], other_loss[MASK > 0])
    for key in metrics:
        torch.testing.assert_close(metrics[key], other_metrics[key])


# ------------------------------------------------------------------------------------------------------ on-policy
LEVELS = {"cispo": ["token", "chunk", "sequence"], "sapo": ["token", "chunk", "sequence"], "gmpo": ["sequence"]}
PAPER_AGGREGATION = {"cispo": "token_mean", "sapo": "seq_mean_token_mean", "gmpo": "seq_mean_token_mean"}


# A chunk or sequence ratio spreads each action's gradient over its unit: with per-action advantages SAPO's on-policy
# gradient takes the unit's mean advantage (as grpo's does), so those are left out; CISPO's weight is detached.
ON_POLICY = [(name, level, per_action) for name, levels in LEVELS.items() for level in levels
             for per_action in (False, True) if not (name == "sapo" and level != "token" and per_action)]


@pytest.mark.parametrize(("name", "level", "per_action"), ON_POLICY,
                         ids=[f"{n}-{lv}-{'adv[N,A]' if p else 'adv[N]'}" for n, lv, p in ON_POLICY])
def test_on_policy_gradient_is_the_plain_policy_gradient(name, level, per_action):
    """At r = 1: CISPO's weight is 1, SAPO's gate slope 4/τ·σ'(0)·τ = 1, GMPO's ρ = 1 — each has REINFORCE's
    gradient −A·∇log π under its paper's aggregation (GMPO: per-action advantages enter as the row's mean)."""
    torch.manual_seed(0)
    features = torch.randn(*MASK.shape, 3, dtype=torch.float64)
    weights = torch.randn(3, dtype=torch.float64, requires_grad=True)
    chunks = torch.tensor([[0, 0, 1, 1, 2]] * MASK.shape[0])
    _, _, adv = _inputs(2, per_action)
    if name == "gmpo" and per_action:
        # GMPO trains the row's mean advantage: compare with REINFORCE on that. An action with A = 0 drops out of ρ
        # (verl's sgn(A) = 0), so this comparison holds for nonzero per-action advantages.
        adv = torch.where(adv == 0, torch.full_like(adv, 0.5), adv)
        reference_adv = (adv * MASK).sum(1) / MASK.sum(1).clamp(min=1)
    else:
        reference_adv = adv
    mode = PAPER_AGGREGATION[name]

    def logp():
        return torch.nn.functional.logsigmoid(features @ weights)  # [N, A]

    options = {"ratio_level": level} | ({"chunk_ids": chunks} if name != "gmpo" else {})
    loss, metrics = policy_losses[name](logp(), logp().detach(), adv, MASK.double(), **options)
    (grad,) = torch.autograd.grad(aggregate(loss, MASK.double(), mode), weights)
    plain, _ = policy_losses["reinforce"](logp(), logp().detach(), reference_adv, MASK.double())
    (expected,) = torch.autograd.grad(aggregate(plain, MASK.double(), mode), weights)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    assert metrics["ratio_max"].item() == pytest.approx(1.0) and metrics["ratio_min"].item() == pytest.approx(1.0)
    assert metrics.get("clip_fraction", torch.tensor(0.0)).item() == 0.0


def test_on_policy_values():
    """CISPO's on-policy value is REINFORCE's −A·log π; SAPO's −(2/τ)·A; GMPO's −Ā on every action of the row."""
    logp = torch.tensor([[-0.5, -1.5], [-2.0, -0.25]])
    adv = torch.tensor([2.0, -1.0])
    mask = torch.ones(2, 2)
    cispo, cispo_metrics = policy_losses["cispo"](logp, logp, adv, mask)
    torch.testing.assert_close(cispo, -adv[:, None] * logp)
    assert cispo_metrics["is_weight_mean"].item() == 1.0
    sapo, sapo_metrics = policy_losses["sapo"](logp, logp, adv, mask, tau_pos=0.5, tau_neg=2.0)
    torch.testing.assert_close(sapo, torch.tensor([[-8.0, -8.0], [1.0, 1.0]]))  # −(2/0.5)·2, −(2/2)·(−1)
    assert sapo_metrics["soft_weight_mean"].item() == pytest.approx(1.0)
    gmpo, gmpo_metrics = policy_losses["gmpo"](logp, logp, adv, mask)
    torch.testing.assert_close(gmpo, -adv[:, None].expand(2, 2))
    assert gmpo_metrics["geo_ratio_mean"].item() == 1.0


# ------------------------------------------------------------------------------------------------- clip boundaries
def test_cispo_truncates_the_weight_on_both_sides_for_both_signs():
    ratios = torch.tensor([[0.5, 0.79, 1.0, 1.49, 3.0]])
    logp = ratios.log().requires_grad_(True)
    for advantage in (2.0, -2.0):
        loss, metrics = policy_losses["cispo"](logp, torch.zeros(1, 5), torch.tensor([advantage]), torch.ones(1, 5),
                                               clip_low=0.2, clip_high=0.5)
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        weights = torch.tensor([[0.8, 0.8, 1.0, 1.49, 1.5]])  # clamp(r, 0.8, 1.5): no action loses its gradient
        torch.testing.assert_close(grad, -advantage * weights)
        torch.testing.assert_close(loss, -advantage * weights * logp.detach())
        assert metrics["clip_fraction_low"].item() == pytest.approx(2 / 5)  # r = 0.5 and 0.79, below 0.8
        assert metrics["clip_fraction_high"].item() == pytest.approx(1 / 5)  # r = 3.0
    # Without a lower bound (the default) a small ratio keeps its own weight; the cap is 1 + 4 = 5.
    loss, metrics = policy_losses["cispo"](logp, torch.zeros(1, 5), torch.tensor([1.0]), torch.ones(1, 5))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad, -ratios)
    assert metrics["clip_fraction"].item() == 0.0
    big = torch.tensor([[7.0]]).log()
    loss, metrics = policy_losses["cispo"](big, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1))
    torch.testing.assert_close(loss, -5.0 * big)
    assert metrics["clip_fraction_high"].item() == 1.0 and metrics["is_weight_mean"].item() == pytest.approx(5.0)


def test_gmpo_clips_each_token_in_log_space_by_the_advantage_sign():
    """One-token rows: the bound that binds is the one a PPO min would take; a clipped token gets no gradient."""
    x = torch.tensor([[0.6], [-0.6], [-0.6], [0.6], [0.3]], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0])
    loss, metrics = policy_losses["gmpo"](x, torch.zeros(5, 1), adv, torch.ones(5, 1), clip_low=0.4, clip_high=0.4)
    expected_log_rho = torch.tensor([0.4, -0.6, -0.4, 0.6, 0.3])
    torch.testing.assert_close(loss[:, 0], -adv * expected_log_rho.exp())
    (grad,) = torch.autograd.grad(loss.sum(), x)
    free = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0])  # clipped: A > 0 above e^0.4, A < 0 below e^−0.4
    torch.testing.assert_close(grad[:, 0], -adv * expected_log_rho.exp() * free)
    assert metrics["clip_fraction_high"].item() == pytest.approx(1 / 5)
    assert metrics["clip_fraction_low"].item() == pytest.approx(1 / 5)
    assert metrics["clip_fraction"].item() == pytest.approx(2 / 5)


def test_gmpo_clips_before_the_mean_unlike_gspo():
    """log r = (0.8, −0.3), A > 0, ε = 0.4: clipping the tokens first gives mean(0.4, −0.3) = 0.05; clipping the
    mean instead would keep mean(0.8, −0.3) = 0.25 (inside), as GSPO does with its sequence ratio e^0.25."""
    logp = torch.tensor([[0.8, -0.3]], requires_grad=True)
    loss, metrics = policy_losses["gmpo"](logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2))
    torch.testing.assert_close(loss, torch.full((1, 2), -math.exp(0.05)))
    assert metrics["geo_ratio_mean"].item() == pytest.approx(math.exp(0.05))
    (grad,) = torch.autograd.grad(loss[0, 0], logp)
    # the clipped token is frozen, the other gets −A·ρ/|o|
    torch.testing.assert_close(grad, torch.tensor([[0.0, -math.exp(0.05) / 2]]))
    gspo, _ = policy_losses["gspo"](logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), clip_low=0.4,
                                    clip_high=math.exp(0.4) - 1)
    torch.testing.assert_close(gspo, torch.full((1, 2), -math.exp(0.25)))


def test_sapo_gate_takes_tau_by_the_advantage_sign():
    """r = 2 and r = 0.5 with A = ±1: the value is −4/τ·σ(τ(r − 1))·A and the gradient −A·4σ(1 − σ)·r, τ = τ_pos for
    A > 0, τ_neg for A ≤ 0 (A = 0 included, where both vanish)."""
    ratios = torch.tensor([[2.0, 0.5], [2.0, 0.5], [2.0, 0.5]])
    logp = ratios.log().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.0])
    loss, metrics = policy_losses["sapo"](logp, torch.zeros(3, 2), adv, torch.ones(3, 2), tau_pos=0.5, tau_neg=4.0)
    tau = torch.tensor([[0.5], [4.0], [4.0]])
    gate = torch.sigmoid(tau * (ratios - 1))
    torch.testing.assert_close(loss, -(4 / tau) * gate * adv[:, None])
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    weight = 4 * gate * (1 - gate) * ratios
    torch.testing.assert_close(grad, -adv[:, None] * weight)
    assert metrics["soft_weight_mean"].item() == pytest.approx(weight.mean().item())
    # The steeper negative gate fades faster: far from r = 1 its gradient weight is the smaller one.
    assert weight[1, 0] < weight[0, 0] and weight[1, 1] < weight[0, 1]


# -------------------------------------------------------------------------------- advantages [N] and [N, A], metrics
@pytest.mark.parametrize("name", ["cispo", "sapo", "gmpo"])
def test_row_constant_per_action_advantages_equal_per_sample_ones(name):
    new, old, adv = _inputs(4)
    loss, metrics = policy_losses[name](new, old, adv, MASK.double())
    wide, wide_metrics = policy_losses[name](new, old, adv[:, None].expand(MASK.shape), MASK.double())
    torch.testing.assert_close(loss, wide)
    for key in metrics:
        torch.testing.assert_close(metrics[key], wide_metrics[key])
    with pytest.raises(ValueError, match="advantages"):
        policy_losses[name](new, old, torch.ones(4), MASK.double())


EXPECTED_METRICS = {
    "cispo": {"clip_fraction", "clip_fraction_low", "clip_fraction_high", "is_weight_mean"},
    "sapo": {"soft_weight_mean"},
    "gmpo": {"clip_fraction", "clip_fraction_low", "clip_fraction_high", "geo_ratio_mean"},
}


@pytest.mark.parametrize("name", ["cispo", "sapo", "gmpo"])
def test_metrics_are_present_finite_detached_scalars(name):
    new, old, adv = _inputs(5, per_action=True)
    _, metrics = policy_losses[name](new.float(), old.float(), adv.float(), MASK)
    assert set(metrics) == {"ratio_mean", "ratio_min", "ratio_max", "approx_kl"} | EXPECTED_METRICS[name]
    for key, value in metrics.items():
        assert value.dim() == 0 and value.dtype == torch.float32 and not value.requires_grad, key
        assert torch.isfinite(value), key
    _, empty = policy_losses[name](torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0), torch.zeros(0, 3))
    assert all(torch.isfinite(value) for value in empty.values())


def test_cispo_and_gmpo_clip_fractions_by_hand_on_random_inputs():
    new, old, adv = _inputs(6, per_action=True)
    x = (new - old).detach()
    active = MASK > 0

    def share(condition):
        return (condition & active).sum().item() / active.sum().item()

    _, cispo = policy_losses["cispo"](new, old, adv, MASK.double(), clip_low=0.2, clip_high=0.3)
    assert cispo["clip_fraction_low"].item() == pytest.approx(share(x.exp() < 0.8))
    assert cispo["clip_fraction_high"].item() == pytest.approx(share(x.exp() > 1.3))
    weights = x.exp().clamp(0.8, 1.3)
    assert cispo["is_weight_mean"].item() == pytest.approx(weights[active].mean().item())
    _, gmpo = policy_losses["gmpo"](new, old, adv, MASK.double(), clip_low=0.3, clip_high=0.2)
    assert gmpo["clip_fraction_low"].item() == pytest.approx(share((adv < 0) & (x < -0.3)))
    assert gmpo["clip_fraction_high"].item() == pytest.approx(share((adv > 0) & (x > 0.2)))
    assert 0 < gmpo["clip_fraction"].item() < 1


# ------------------------------------------------------------------------------------ options, config, mmrl list
@pytest.mark.parametrize(("name", "options", "match"), [
    ("cispo", {"clip_low": 1.0}, "clip_low"),
    ("cispo", {"clip_high": -0.1}, "clip_high"),
    ("sapo", {"tau_pos": 0.0}, "tau_pos"),
    ("sapo", {"tau_neg": -1.0}, "tau_neg"),
    ("gmpo", {"clip_low": -0.1}, "clip_low"),
    ("gmpo", {"ratio_level": "token"}, "ratio_level"),
])
def test_bad_options_are_refused_on_direct_calls(name, options, match):
    with pytest.raises(ValueError, match=match):
        policy_losses[name](torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), **options)


@pytest.mark.parametrize(("name", "option", "value", "allowed"), [
    ("cispo", "clip_low", 1.0, "a number in [0, 1) or null"),
    ("cispo", "clip_high", -0.5, "a number >= 0"),
    ("sapo", "tau_pos", 0.0, "a number > 0"),
    ("sapo", "tau_neg", -1.05, "a number > 0"),
    ("gmpo", "clip_high", -0.4, "a number >= 0"),
])
def test_config_refuses_bad_options_in_one_line(name, option, value, allowed):
    data = {**BASE, "algorithm": {**BASE["algorithm"], "policy_loss": {"name": name, option: value}}}
    with pytest.raises(ConfigError) as info:
        load_config(data)
    assert str(info.value) == f"config key 'algorithm.policy_loss.{option}': got {value!r}; allowed: {allowed}"


def test_gmpo_declares_the_sequence_level_so_action_chunks_are_refused(tmp_path):
    from mmrl.trainer import Trainer
    from mmrl.trainer.learn import ratio_level

    assert ratio_level(toy_config(tmp_path, "algorithm.policy_loss=gmpo")) == "sequence"
    assert ratio_level(toy_config(tmp_path, "algorithm.policy_loss=cispo")) == "token"
    with pytest.raises(ConfigError) as info:
        toy_config(tmp_path, "algorithm.policy_loss=gmpo", "algorithm.policy_loss.ratio_level=token")
    assert "\n" not in str(info.value) and "sequence" in str(info.value)
    with pytest.raises(ConfigError, match="action_chunk_size"):  # ρ needs every action of the row at once
        Trainer(toy_config(tmp_path, "algorithm.action_chunk_size=2", "algorithm.policy_loss=gmpo"))


@pytest.mark.parametrize("name", ["cispo", "sapo", "gmpo"])
def test_the_trainer_runs_each_loss_off_policy(tmp_path, name):
    """Two inner epochs of two mini-batches: the later updates are off-policy, the first is on-policy."""
    config = toy_config(tmp_path, "run.max_steps=2", f"algorithm.policy_loss={name}", "algorithm.inner_epochs=2",
                        "algorithm.minibatches=2", f"algorithm.aggregation={PAPER_AGGREGATION[name]}",
                        "optim.lr=3e-2")
    check_off_policy_run(config, EXPECTED_METRICS[name])


def test_mmrl_list_shows_them_with_one_line_descriptions(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name, start in (("cispo", "CISPO: "), ("sapo", "SAPO: "), ("gmpo", "GMPO: ")):
        lines = [line for line in out.splitlines() if line.startswith(f"  {name}  — ")]
        assert len(lines) == 1 and lines[0].startswith(f"  {name}  — {start}"), lines
        assert lines[0] == f"  {name}  — {policy_losses.describe(name)}"
