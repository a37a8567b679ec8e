"""Clip-Cov and KL-Cov (``mmrl.algos.covariance_losses``) against verl's code, restated here one action at a time.

The restatements are plain loops over the active actions written from ``compute_policy_loss_clip_cov`` and
``compute_policy_loss_kl_cov`` (``verl/trainer/ppo/core_algos.py`` L1450-1634 at volcengine/verl@b178a3c; the authors'
PRIME-RL/Entropy-Mechanism-of-RL@8850579 computes the same, with KL-Cov's share in percent), independent of mmrl's
vectorised code: verl's masked means (with its +1e-8), its candidate list in ``nonzero`` order, one
``torch.randperm`` over it, ``max(int(ratio·n), 1)``, and the top-k by covariance. Inputs are random floats (no exact
ties), with garbage in the padding; the value, the gradient and the selected sets must agree.
"""

import itertools
import math

import pytest
import torch

from mmrl.algos import aggregate, policy_losses
from mmrl.config import ConfigError, load_config
from mmrl.trainer import Trainer
from tests.algos.inputs import off_policy_inputs
from tests.helpers import BASE, toy_config

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0, 0.0],
                     [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                     [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                     [1.0, 1.0, 0.0, 0.0, 0.0, 0.0],
                     [1.0, 1.0, 1.0, 1.0, 1.0, 0.0],
                     [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                     [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # 23 active actions; the last row has none


def _inputs(seed: int, per_action: bool = False, spread: float = 0.4, scale: float = 1.0):
    """Log-probs in (−3, 0); advantages scaled by ``scale`` (the covariances grow with it), none set to 0."""
    return off_policy_inputs(MASK, seed, per_action=per_action, spread=spread, log_prob_span=3.0,
                             advantage_scale=scale, zero_advantage=False)


def _adv(adv, i, t):
    return float(adv[i]) if adv.dim() == 1 else float(adv[i, t])


def _active():
    """The active (row, column) pairs in row-major order, as ``torch.nonzero`` lists them."""
    return [(i, t) for i in range(MASK.shape[0]) for t in range(MASK.shape[1]) if MASK[i, t] > 0]


def _covariances(new, adv, eps):
    """(A − mean A)·(logp − mean logp) of every active action; ``eps`` is added to the count (verl's masked_mean has
    1e-8 in clip_cov; kl_cov takes plain means)."""
    active = _active()
    n = len(active)
    mean_adv = sum(_adv(adv, i, t) for i, t in active) / (n + eps)
    mean_logp = sum(float(new.detach()[i, t]) for i, t in active) / (n + eps)
    return {(i, t): (_adv(adv, i, t) - mean_adv) * (float(new.detach()[i, t]) - mean_logp) for i, t in active}


def _token_mean(terms):
    return sum(terms) / len(terms)


# ------------------------------------------------------------------------------------------ upstream restatements
def _verl_clip_cov(new, old, adv, seed, clip_low, clip_high, ratio, lb, ub, dual_clip=None):
    """verl clip_cov, token-mean: max(−A·r, −A·clip(r)), ×0 on min(max(int(ratio·n), 1), |C|) candidates drawn by
    ``randperm`` from the actions PPO did not clip whose covariance is in (lb, ub). ``dual_clip`` (mmrl's extension,
    none upstream) caps A < 0 at −c·A and keeps the capped actions out of the candidates too."""
    covariances = _covariances(new, adv, 1e-8)
    losses, candidates = {}, []
    for i, t in _active():
        a = _adv(adv, i, t)
        r = torch.exp(new[i, t] - old[i, t])
        unclipped, clipped = -a * r, -a * r.clamp(1 - clip_low, 1 + clip_high)
        loss = torch.maximum(unclipped, clipped)
        frozen = bool(clipped > unclipped)
        if dual_clip is not None and a < 0:
            frozen = frozen or bool(loss > -dual_clip * a)
            loss = torch.minimum(loss, torch.tensor(-dual_clip * a, dtype=loss.dtype))
        losses[i, t] = loss
        if not frozen and lb < covariances[i, t] < ub:
            candidates.append((i, t))
    clip_num = max(int(ratio * len(losses)), 1)
    detached = set()
    if candidates:
        perm = torch.randperm(len(candidates), generator=torch.Generator().manual_seed(seed))
        detached = {candidates[j] for j in perm[:min(clip_num, len(candidates))].tolist()}
    value = _token_mean([loss * (0.0 if key in detached else 1.0) for key, loss in losses.items()])
    return value, detached, set(candidates)


def _verl_kl_cov(new, old, adv, ratio, coef, percent=False):
    """verl kl_cov (``percent``: the authors' ``k_percent``, k = int(n·k_percent/100)), token-mean: −A·r, plus
    coef·|log r| on the k largest covariances."""
    covariances = _covariances(new, adv, 0.0)
    n = len(covariances)
    k = max(1, int(n * ratio / 100)) if percent else max(1, int(n * ratio))
    ranked = sorted(covariances, key=lambda key: covariances[key], reverse=True)
    chosen = set(ranked[:k])
    terms = []
    for i, t in _active():
        x = new[i, t] - old[i, t]
        loss = -_adv(adv, i, t) * torch.exp(x)
        terms.append(loss + coef * x.abs() if (i, t) in chosen else loss)
    return _token_mean(terms), chosen


def _mmrl(name, new, old, adv, **options):
    loss, metrics = policy_losses[name](new, old, adv, MASK.to(new.dtype), **options)
    return loss, aggregate(loss, MASK.to(new.dtype), "token_mean"), metrics


def _positions(flags):
    return {tuple(index) for index in torch.nonzero(flags).tolist()}


def _check_close(value, expected, new):
    (grad,) = torch.autograd.grad(value, new, retain_graph=True)
    (expected_grad,) = torch.autograd.grad(expected, new)
    torch.testing.assert_close(value, expected.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
    assert torch.all(grad[MASK == 0] == 0), "padding must not receive a gradient"
    return grad


# ------------------------------------------------------------------------------------ clip_cov: values and gradients
CLIP_COV_CASES = {
    # the defaults (verl's): advantages scaled so that some covariances fall in (1, 5)
    "verl_defaults": ({}, 3.0, 0.4),
    # a wider band and a larger share: more candidates than the budget and fewer, both occur over the seeds
    "band": ({"clip_cov_ratio": 0.25, "clip_cov_lb": 0.1, "clip_cov_ub": 1.5}, 1.0, 0.4),
    # the authors' recipe widens PPO's clip to [0, 2]
    "authors_recipe": ({"clip_low": 1.0, "clip_high": 1.0, "clip_cov_ratio": 0.2, "clip_cov_lb": 0.05}, 1.0, 1.0),
    "asymmetric_dual": ({"clip_low": 0.1, "clip_high": 0.28, "dual_clip": 1.2, "clip_cov_ratio": 0.3,
                         "clip_cov_lb": -0.5, "clip_cov_ub": 2.0}, 1.0, 0.4),
}


@pytest.mark.parametrize("per_action", [False, True], ids=["adv[N]", "adv[N,A]"])
@pytest.mark.parametrize("case", list(CLIP_COV_CASES))
def test_clip_cov_equals_verl_in_value_gradient_and_detached_set(case, per_action):
    options, scale, spread = CLIP_COV_CASES[case]
    settings = {"clip_low": 0.2, "clip_high": 0.2, "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0,
                "dual_clip": None} | options
    seen = {"more": False, "fewer": False, "detached": 0, "frozen": 0}
    for seed in range(4):
        new, old, adv = _inputs(seed, per_action, spread=spread, scale=scale)
        expected, detached, candidates = _verl_clip_cov(
            new, old, adv, 100 + seed, settings["clip_low"], settings["clip_high"], settings["clip_cov_ratio"],
            settings["clip_cov_lb"], settings["clip_cov_ub"], settings["dual_clip"])
        loss, value, metrics = _mmrl("clip_cov", new, old, adv, generator=torch.Generator().manual_seed(100 + seed),
                                     **options)
        grad = _check_close(value, expected, new)
        zero = _positions((loss == 0) & (MASK > 0))
        assert detached <= zero  # the detached actions lose their value ...
        assert all(float(grad[i, t]) == 0.0 for i, t in detached)  # ... and their gradient
        budget = max(int(settings["clip_cov_ratio"] * 23), 1)
        assert len(detached) == min(budget, len(candidates))
        assert metrics["cov_detached_fraction"].item() == pytest.approx(len(detached) / 23)
        assert metrics["cov_candidate_fraction"].item() == pytest.approx(len(candidates) / 23)
        seen["more"] |= len(candidates) > budget
        seen["fewer"] |= 0 < len(candidates) <= budget
        seen["detached"] += len(detached)
        seen["frozen"] += int(metrics["clip_fraction"].item() * 23)
    assert seen["detached"] > 0 and seen["frozen"] > 0, seen  # the comparison reaches both kinds of zero gradient
    assert seen["more"], seen  # the draw decides which candidates go
    if case == "band":  # and the budget may exceed the candidates: then all of them go
        assert seen["fewer"], seen


def test_clip_cov_never_draws_an_action_the_clip_froze():
    """One row per sign case, r = 1.5 or 0.5, every covariance inside a wide band, a share of 1 (all candidates go):
    PPO freezes A > 0 with r > 1 + ε and A < 0 with r < 1 − ε; the other two keep their gradient (the unclipped side),
    so they are the ones Clip-Cov detaches. The dual clip (c = 1.2) freezes A < 0 with r = 1.5 > c as well."""
    ratios = torch.tensor([[1.5, 0.5], [1.5, 0.5], [1.5, 0.5], [1.5, 0.5]], dtype=torch.float64)
    old = torch.tensor([[-1.0, -2.0], [-0.5, -2.5], [-1.5, -1.0], [-2.0, -0.5]], dtype=torch.float64)
    new = (old + ratios.log()).requires_grad_(True)
    adv = torch.tensor([2.0, 1.0, -1.0, -2.0], dtype=torch.float64)
    mask = torch.ones(4, 2, dtype=torch.float64)
    wide = {"clip_cov_ratio": 1.0, "clip_cov_lb": -100.0, "clip_cov_ub": 100.0}
    loss, metrics = policy_losses["clip_cov"](new, old, adv, mask, generator=torch.Generator().manual_seed(0), **wide)
    free = torch.tensor([[False, True], [False, True], [True, False], [True, False]])
    assert torch.equal(loss == 0, free)
    (grad,) = torch.autograd.grad(loss.sum(), new)
    assert torch.all(grad == 0)  # frozen by the clip or detached by Clip-Cov: no action moves
    assert metrics["cov_candidate_fraction"].item() == 0.5 and metrics["clip_fraction"].item() == 0.5
    loss, metrics = policy_losses["clip_cov"](new, old, adv, mask, generator=torch.Generator().manual_seed(0),
                                              dual_clip=1.2, **wide)
    assert torch.equal(loss == 0, free & (adv[:, None] > 0))  # A < 0 at r = 1.5: capped at −1.2·A, not drawn
    torch.testing.assert_close(loss[2:, 0], -1.2 * adv[2:])
    assert metrics["dual_clip_fraction"].item() == 0.25


def test_clip_cov_selects_by_the_covariance_band_and_excludes_padding_from_the_means():
    """On-policy (nothing clipped), a share of 1: exactly the active actions whose centred covariance, with means over
    the active actions only, lies in (lb, ub) lose value and gradient; the others keep −A·∇log π."""
    new, _, adv = _inputs(7, per_action=True)
    old = new.detach().clone()
    loss, _, metrics = _mmrl("clip_cov", new, old, adv, generator=torch.Generator().manual_seed(0),
                             clip_cov_ratio=1.0, clip_cov_lb=0.0, clip_cov_ub=0.6)
    covariances = _covariances(new, adv, 0.0)
    band = {key for key, value in covariances.items() if 0.0 < value < 0.6}
    assert 0 < len(band) < len(covariances)
    assert _positions((loss == 0) & (MASK > 0)) == band
    (grad,) = torch.autograd.grad((loss * MASK).sum(), new)
    keep = torch.zeros(MASK.shape, dtype=torch.bool)
    for i, t in covariances:
        keep[i, t] = (i, t) not in band
    torch.testing.assert_close(grad, torch.where(keep, -adv, 0.0))
    assert metrics["clip_fraction"].item() == 0.0


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_padding_never_matters(name):
    new, old, adv = _inputs(1, per_action=True)
    options = {"generator": torch.Generator().manual_seed(3), "clip_cov_ratio": 0.3, "clip_cov_lb": 0.0} if (
        name == "clip_cov") else {"kl_cov_ratio": 0.3}
    loss, _, metrics = _mmrl(name, new, old, adv, **options)
    other_new = torch.where(MASK > 0, new.detach(), -new.detach() * 3 - 1e6).requires_grad_(True)
    other_old = torch.where(MASK > 0, old, old + 7.0)
    other_adv = torch.where(MASK > 0, adv, 1e6)
    if name == "clip_cov":
        options["generator"] = torch.Generator().manual_seed(3)
    other_loss, _, other_metrics = _mmrl(name, other_new, other_old, other_adv, **options)
    torch.testing.assert_close(loss[MASK > 0], other_loss[MASK > 0])
    for key in metrics:
        torch.testing.assert_close(metrics[key], other_metrics[key])


# ---------------------------------------------------------------------------------------- clip_cov: the randomness
def test_clip_cov_draws_from_its_generator_only():
    """The same seed gives the same detached set, whatever the global RNG; different seeds give different sets; each
    call consumes one randperm(|C|) and nothing when there is no candidate."""
    new, old, adv = _inputs(2, per_action=True)
    options = {"clip_cov_ratio": 0.15, "clip_cov_lb": -1.0, "clip_cov_ub": 1.0}
    sets = []
    for seed in range(6):
        torch.manual_seed(1000 + seed)  # the global RNG must not matter
        loss, _, metrics = _mmrl("clip_cov", new, old, adv, generator=torch.Generator().manual_seed(seed), **options)
        again, _, _ = _mmrl("clip_cov", new, old, adv, generator=torch.Generator().manual_seed(seed), **options)
        assert torch.equal(loss, again)
        sets.append(frozenset(_positions((loss == 0) & (MASK > 0))))
    count = round(metrics["cov_candidate_fraction"].item() * 23)
    assert count > max(int(0.15 * 23), 1)  # more candidates than the budget: the draw decides
    assert len(set(sets)) > 1
    generator, twin = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    _mmrl("clip_cov", new, old, adv, generator=generator, **options)
    torch.randperm(count, generator=twin)
    assert torch.equal(generator.get_state(), twin.get_state())
    untouched = torch.Generator().manual_seed(5)
    _mmrl("clip_cov", new, old, adv, generator=untouched, clip_cov_lb=1e6, clip_cov_ub=2e6)
    assert torch.equal(untouched.get_state(), torch.Generator().manual_seed(5).get_state())


# ------------------------------------------------------------------------------------- kl_cov: values and gradients
@pytest.mark.parametrize("per_action", [False, True], ids=["adv[N]", "adv[N,A]"])
@pytest.mark.parametrize(("ratio", "coef"), [(2e-4, 1.0), (0.2, 1.0), (0.5, 0.1), (1.0, 2.0)])
def test_kl_cov_equals_verl_in_value_gradient_and_selected_set(ratio, coef, per_action):
    for seed in range(3):
        new, old, adv = _inputs(seed, per_action)
        expected, chosen = _verl_kl_cov(new, old, adv, ratio, coef)
        loss, value, metrics = _mmrl("kl_cov", new, old, adv, kl_cov_ratio=ratio, ppo_kl_coef=coef)
        _check_close(value, expected, new)
        penalised = loss.detach() - (-adv[:, None] if adv.dim() == 1 else -adv) * (new - old).detach().exp()
        assert _positions((penalised.abs() > 1e-12) & (MASK > 0)) == chosen
        assert len(chosen) == max(int(23 * ratio), 1)
        assert metrics["kl_cov_fraction"].item() == pytest.approx(len(chosen) / 23)
        x = (new - old).detach()[MASK > 0]
        assert metrics["abs_log_ratio_mean"].item() == pytest.approx(x.abs().mean().item())


@pytest.mark.parametrize("k_percent", [0.2, 20.0, 50.0])
def test_kl_cov_ratio_is_the_authors_k_percent_over_100(k_percent):
    """The authors' code (PRIME-RL/Entropy-Mechanism-of-RL@8850579, L426-467) counts k_percent in percent."""
    new, old, adv = _inputs(4)
    expected, _ = _verl_kl_cov(new, old, adv, k_percent, 1.0, percent=True)
    _, value, _ = _mmrl("kl_cov", new, old, adv, kl_cov_ratio=k_percent / 100)
    _check_close(value, expected, new)


def test_kl_cov_breaks_ties_by_position():
    """Equal covariances at the k-th place (one row's equal log-probs): the earliest actions get the penalty."""
    logp = torch.tensor([[-0.5, -0.5, -0.5, -0.5], [-0.6, -0.4, -0.55, -0.45]], dtype=torch.float64)
    old = logp - 0.1
    # mean A = 0, mean log π ≈ −0.5: row 0's covariances are all ≈ 0 (equal), row 1's −(log π + 0.5) = 0.1, −0.1,
    # 0.05, −0.05; k = ⌊8 · 0.375⌋ = 3 takes 0.1, 0.05 and the first of row 0's four equal ones.
    loss, metrics = policy_losses["kl_cov"](logp, old, torch.tensor([1.0, -1.0], dtype=torch.float64),
                                            torch.ones(2, 4), kl_cov_ratio=0.375)
    plain = -torch.tensor([[1.0], [-1.0]], dtype=torch.float64) * math.exp(0.1)
    torch.testing.assert_close(loss - plain, torch.tensor([[0.1, 0, 0, 0], [0.1, 0, 0.1, 0]], dtype=torch.float64))
    assert metrics["kl_cov_fraction"].item() == 0.375


def test_kl_cov_penalty_pulls_the_ratio_back_to_one():
    """A selected action's gradient is −A·r + β·sgn(log r): the penalty pushes log π toward log π_old from either side;
    an unselected one keeps −A·r."""
    ratios = torch.tensor([[1.3, 0.7]], dtype=torch.float64)
    old = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    new = (old + ratios.log()).requires_grad_(True)
    for adv in (2.0, -2.0):
        loss, _ = policy_losses["kl_cov"](new, old, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 2),
                                          kl_cov_ratio=1.0, ppo_kl_coef=0.5)
        (grad,) = torch.autograd.grad(loss.sum(), new)
        torch.testing.assert_close(grad, -adv * ratios + 0.5 * torch.tensor([[1.0, -1.0]], dtype=torch.float64))
        torch.testing.assert_close(loss, -adv * ratios + 0.5 * ratios.log().abs())


# ------------------------------------------------------------------------------------------------------ on-policy
def test_on_policy_gradients():
    """r = 1: kl_cov's value is −A and its gradient REINFORCE's (|log r|' = 0 at 0); clip_cov's is REINFORCE's on the
    actions it did not detach, 0 on the others."""
    torch.manual_seed(0)
    features = torch.randn(*MASK.shape, 3, dtype=torch.float64)
    weights = torch.randn(3, dtype=torch.float64, requires_grad=True)
    _, _, adv = _inputs(3, per_action=True, scale=3.0)

    def logp():
        return torch.nn.functional.logsigmoid(features @ weights)  # [N, A]

    plain, _ = policy_losses["reinforce"](logp(), logp().detach(), adv, MASK.double())
    (expected,) = torch.autograd.grad(aggregate(plain, MASK.double(), "token_mean"), weights)
    loss, metrics = policy_losses["kl_cov"](logp(), logp().detach(), adv, MASK.double(), kl_cov_ratio=0.3)
    torch.testing.assert_close(loss[MASK > 0], -adv[MASK > 0])
    (grad,) = torch.autograd.grad(aggregate(loss, MASK.double(), "token_mean"), weights)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    assert metrics["kl_cov_fraction"].item() > 0 and metrics["abs_log_ratio_mean"].item() == 0.0
    loss, metrics = policy_losses["clip_cov"](logp(), logp().detach(), adv, MASK.double(),
                                              generator=torch.Generator().manual_seed(0), clip_cov_ratio=0.2)
    detached = (loss == 0) & (MASK > 0)
    assert detached.any() and metrics["clip_fraction"].item() == 0.0
    kept = torch.where(detached, 0.0, MASK.double())
    (grad,) = torch.autograd.grad(aggregate(loss, MASK.double(), "token_mean"), weights)
    plain, _ = policy_losses["reinforce"](logp(), logp().detach(), adv, kept)
    (expected,) = torch.autograd.grad((plain * kept).sum() / MASK.sum(), weights)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------ options, config, metrics
@pytest.mark.parametrize(("name", "options", "match"), [
    ("clip_cov", {"clip_low": 1.01}, "clip_low"),
    ("clip_cov", {"clip_high": -0.1}, "clip_high"),
    ("clip_cov", {"dual_clip": 1.0}, "dual_clip"),
    ("clip_cov", {"clip_cov_ratio": 0.0}, "clip_cov_ratio"),
    ("clip_cov", {"clip_cov_ratio": 1.5}, "clip_cov_ratio"),
    ("clip_cov", {"clip_cov_lb": 2.0, "clip_cov_ub": 2.0}, "clip_cov_lb < clip_cov_ub"),
    ("clip_cov", {"clip_cov_ub": math.inf}, "clip_cov_lb < clip_cov_ub"),
    ("clip_cov", {"generator": None}, "generator"),
    ("kl_cov", {"kl_cov_ratio": 0.0}, "kl_cov_ratio"),
    ("kl_cov", {"kl_cov_ratio": 1.01}, "kl_cov_ratio"),
    ("kl_cov", {"ppo_kl_coef": -0.1}, "ppo_kl_coef"),
])
def test_bad_options_are_refused_on_direct_calls(name, options, match):
    call = ({"generator": torch.Generator()} if name == "clip_cov" else {}) | options
    with pytest.raises(ValueError, match=match) as info:
        policy_losses[name](torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), **call)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("name", "options", "key", "allowed"), [
    ("clip_cov", {"clip_low": 1.5}, "clip_low", "a number in [0, 1]"),
    ("clip_cov", {"clip_cov_ratio": 0.0}, "clip_cov_ratio", "a number in (0, 1]"),
    ("clip_cov", {"clip_cov_ub": 0.5}, "clip_cov_ub", "a number > clip_cov_lb (1.0)"),
    ("clip_cov", {"clip_cov_lb": 3.0, "clip_cov_ub": 2.0}, "clip_cov_ub", "a number > clip_cov_lb (3.0)"),
    ("kl_cov", {"kl_cov_ratio": 2.0}, "kl_cov_ratio", "a number in (0, 1]"),
    ("kl_cov", {"ppo_kl_coef": -1.0}, "ppo_kl_coef", "a number >= 0"),
])
def test_config_refuses_bad_options_in_one_line(name, options, key, allowed):
    data = {**BASE, "algorithm": {**BASE["algorithm"], "policy_loss": {"name": name, **options}}}
    with pytest.raises(ConfigError) as info:
        load_config(data)
    given = options[key]
    assert str(info.value) == f"config key 'algorithm.policy_loss.{key}': got {given!r}; allowed: {allowed}"


def test_config_keeps_the_authors_recipe_and_hides_the_generator():
    data = {**BASE, "algorithm": {**BASE["algorithm"], "policy_loss": {
        "name": "clip_cov", "clip_low": 1.0, "clip_high": 1.0, "clip_cov_lb": -2.0, "clip_cov_ub": -1.0}}}
    assert load_config(data).algorithm.policy_loss.options["clip_low"] == 1.0
    assert "generator" not in {option.name for option in policy_losses.options("clip_cov")}
    data["algorithm"]["policy_loss"] = {"name": "clip_cov", "generator": 3}
    with pytest.raises(ConfigError, match="generator"):
        load_config(data)


def test_mmrl_list_shows_them_with_one_line_descriptions(capsys):
    from mmrl.cli import main

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name, start in (("clip_cov", "Clip-Cov: "), ("kl_cov", "KL-Cov: ")):
        lines = [line for line in out.splitlines() if line.startswith(f"  {name}  — ")]
        assert lines == [f"  {name}  — {policy_losses.describe(name)}"] and policy_losses.describe(name).startswith(
            start), lines


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_metrics_are_present_finite_detached_scalars(name):
    new, old, adv = _inputs(5, per_action=True)
    extra = {"generator": torch.Generator()} if name == "clip_cov" else {}
    expected = {"clip_fraction", "clip_fraction_low", "clip_fraction_high", "cov_detached_fraction",
                "cov_candidate_fraction"} if name == "clip_cov" else {"kl_cov_fraction", "abs_log_ratio_mean"}
    _, metrics = policy_losses[name](new.float(), old.float(), adv.float(), MASK, **extra)
    assert set(metrics) == {"ratio_mean", "ratio_min", "ratio_max", "approx_kl"} | expected
    for key, value in metrics.items():
        assert value.dim() == 0 and value.dtype == torch.float32 and not value.requires_grad, key
        assert torch.isfinite(value), key
    _, empty = policy_losses[name](torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0), torch.zeros(0, 3), **extra)
    assert all(torch.isfinite(value) for value in empty.values())
    _, padded = policy_losses[name](torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3), **extra)
    assert all(torch.isfinite(value) for value in padded.values())


# ------------------------------------------------------------------------------------------------- in the trainer
def _recorded_seeds(trainer):
    """Wrap the learner's policy loss: the initial seed of every generator it is handed, in call order."""
    seeds: list[int] = []
    loss = trainer.learner.policy_loss

    def recorded(logp, old_logp, advantages, mask, **options):
        seeds.append(options["generator"].initial_seed())
        return loss(logp, old_logp, advantages, mask, **options)

    trainer.learner.policy_loss = recorded
    return seeds


def test_the_learner_seeds_each_call_from_where_it_sits_and_a_resumed_run_draws_the_same(tmp_path):
    """Two steps × two inner epochs × two mini-batches of 8 samples × two micro-batches of 4: every call gets the
    generator derive_seed(run seed, step, epoch, mini-batch, first row, first column, process, tag), whatever else
    drew from the global RNG, and a run resumed after step 1 lands on the parameters of the uninterrupted run."""
    from mmrl.seeding import derive_seed
    from mmrl.trainer import Trainer
    from mmrl.trainer.learn import LOSS_DRAW_TAG

    common = ("algorithm.policy_loss={name: clip_cov, clip_cov_ratio: 0.3, clip_cov_lb: -10.0, clip_cov_ub: 10.0}",
              "algorithm.inner_epochs=2", "algorithm.minibatches=2", "algorithm.micro_batch_size=4",
              "rollout.prompts_per_step=4", "optim.lr=3e-2")
    straight = Trainer(toy_config(tmp_path / "straight", "run.max_steps=2", *common))
    seeds = _recorded_seeds(straight)
    history = straight.train().history
    expected = [derive_seed(0, step, epoch, minibatch, row, 0, 0, LOSS_DRAW_TAG)
                for step in range(2) for epoch in range(2) for minibatch in range(2) for row in (0, 4)]
    assert seeds == expected
    assert all(record["policy/cov_detached_fraction"] > 0 for record in history)
    Trainer(toy_config(tmp_path / "split", "run.max_steps=1", "run.save_every=1", *common)).train()
    resumed = Trainer(toy_config(tmp_path / "split", "run.max_steps=2", "run.resume=latest", *common))
    resumed_seeds = _recorded_seeds(resumed)
    resumed.train()
    assert resumed_seeds == expected[8:]
    for name, parameter in straight.plugin.model.named_parameters():
        assert torch.equal(dict(resumed.plugin.model.named_parameters())[name], parameter), name
    assert straight.learner.loss_generator(0, 0, 0, 0, None) is not None
    grpo = Trainer(toy_config(tmp_path / "grpo", "run.max_steps=1"))
    assert grpo.learner.loss_generator(0, 0, 0, 0, None) is None  # losses that draw nothing get none


def test_the_loss_generator_names_the_action_chunk_and_the_process():
    """The trainer test above runs one process without action chunks; here the seed of every place a call can sit in
    one step, two action chunks of a micro-batch and two processes included, is derive_seed of that place, and no two
    places share a generator (two chunks or two processes drawing the same permutation would correlate their sets)."""
    from types import SimpleNamespace

    from mmrl.seeding import derive_seed
    from mmrl.trainer.learn import LOSS_DRAW_TAG, Learner

    seeds = {}
    for process in (0, 1):
        learner = SimpleNamespace(loss_draws=True, config=SimpleNamespace(run=SimpleNamespace(seed=7)),
                                  accelerator=SimpleNamespace(process_index=process))
        for step, epoch, minibatch, row in itertools.product((0, 3), (0, 1), (0, 1), (0, 4)):
            for columns in (torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4])):
                place = (step, epoch, minibatch, row, int(columns[0]), process)
                seeds[place] = Learner.loss_generator(learner, step, epoch, minibatch, row, columns).initial_seed()
                assert seeds[place] == derive_seed(7, *place, LOSS_DRAW_TAG)
            whole = Learner.loss_generator(learner, step, epoch, minibatch, row, None)  # no chunks: column 0
            assert whole.initial_seed() == seeds[step, epoch, minibatch, row, 0, process]
    assert len(set(seeds.values())) == len(seeds) == 2 * 16 * 3


def test_kl_cov_trains_off_policy(tmp_path):
    from mmrl.trainer import Trainer

    config = toy_config(tmp_path, "run.max_steps=2", "algorithm.policy_loss={name: kl_cov, kl_cov_ratio: 0.2}",
                        "algorithm.inner_epochs=2", "algorithm.minibatches=2", "optim.lr=3e-2")
    history = Trainer(config).train().history
    for record in history:
        assert record["loss/first_step_ratio_deviation"] < 1e-5
        assert record["policy/kl_cov_fraction"] == pytest.approx(0.2, abs=0.05)
    assert history[-1]["policy/abs_log_ratio_mean"] > 0


@pytest.mark.parametrize("loss", ["clip_cov", "kl_cov"])
def test_action_chunks_are_refused_at_start_up(tmp_path, loss):
    # Their covariance statistics span a whole micro-batch: a chunk of its columns would have its own means and budget.
    with pytest.raises(ConfigError, match=rf"action_chunk_size.*{loss}"):
        Trainer(toy_config(tmp_path, f"algorithm.policy_loss.name={loss}", "algorithm.action_chunk_size=2"))
