"""Tests for the flow sampler math (:mod:`mmrl.plugins.flow.sde`).

Expected values are computed independently with plain ``math`` on Python floats; the marginal-preservation tests use
a Gaussian data distribution whose velocity field is known in closed form.
"""

from __future__ import annotations

import math

import pytest
import torch

from mmrl.plugins.flow.sde import (
    SDE_KINDS,
    SDEStepOutput,
    diffusion_coefficient,
    gaussian_kl_between_means,
    sde_kinds,
    sde_step,
)

STOCHASTIC_KINDS = ("flow_grpo", "dance_grpo", "cps")
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@pytest.fixture(autouse=True)
def _one_thread():
    """These tensors are small: intra-op threads only add contention on a shared CPU (5× slower under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------------------------------
# Independent reference: one step on Python floats
# --------------------------------------------------------------------------------------------------------------------


def reference_step(kind, x, v, prev, sigma, sigma_next, a, cps_log_prob="flow_grpo"):
    """(mean list, std, log_prob) for one sample given as flat lists of floats, from the formulas in the notes."""
    delta = sigma - sigma_next
    if kind == "flow_grpo":
        denominator = sigma_next if sigma == 1.0 else sigma
        s = a * math.sqrt(sigma / (1.0 - denominator))
        mean = [
            xi - delta * vi - delta * s**2 / (2 * sigma) * (xi + (1 - sigma) * vi) for xi, vi in zip(x, v, strict=True)
        ]
        std = s * math.sqrt(delta)
    elif kind == "dance_grpo":
        mean = [
            xi - delta * vi - 0.5 * a**2 * delta * (xi + (1 - sigma) * vi) / sigma for xi, vi in zip(x, v, strict=True)
        ]
        std = a * math.sqrt(delta)
    elif kind == "cps":
        std = sigma_next * math.sin(a * math.pi / 2)
        coef = math.sqrt(max(sigma_next**2 - std**2, 0.0))
        mean = [
            (1 - sigma_next) * (xi - sigma * vi) + coef * (xi + (1 - sigma) * vi) for xi, vi in zip(x, v, strict=True)
        ]
    else:
        mean = [xi + (sigma_next - sigma) * vi for xi, vi in zip(x, v, strict=True)]
        std = 0.0
    if std == 0.0:
        log_prob = 0.0
    elif kind == "cps" and cps_log_prob == "flow_grpo":  # Flow-GRPO's CPS objective: constants and 1/(2std²) dropped
        log_prob = -sum((p - mu) ** 2 for p, mu in zip(prev, mean, strict=True)) / len(prev)
    else:
        terms = [
            -((p - mu) ** 2) / (2 * std**2) - math.log(std) - LOG_SQRT_2PI for p, mu in zip(prev, mean, strict=True)
        ]
        log_prob = sum(terms) / len(terms)
    return mean, std, log_prob


def tiny_inputs(dtype=torch.float64):
    """B = 2 samples of shape [1, 2, 2] with fixed, hand-written values."""
    x = torch.tensor([[[[0.5, -1.0], [2.0, 0.25]]], [[[-0.3, 0.8], [1.1, -2.0]]]], dtype=dtype)  # [2, 1, 2, 2]
    v = torch.tensor([[[[1.0, 0.5], [-0.75, 0.2]]], [[[0.4, -1.2], [0.9, 0.3]]]], dtype=dtype)
    prev = torch.tensor([[[[0.1, -0.9], [2.2, 0.0]]], [[[-0.5, 1.0], [0.7, -1.6]]]], dtype=dtype)
    return x, v, prev


# --------------------------------------------------------------------------------------------------------------------
# 1. Hand-computed values
# --------------------------------------------------------------------------------------------------------------------


def test_kinds_listing():
    assert SDE_KINDS == ("flow_grpo", "dance_grpo", "cps", "ode")
    assert sde_kinds() == SDE_KINDS


def test_every_kind_is_a_registered_class_that_mmrl_list_shows(capsys):
    """The kinds are classes in the registry sde_kind_registry, announced to `mmrl list` through the entry-point
    group mmrl.registries (pyproject.toml: flow.sde_kinds)."""
    from mmrl.cli import main
    from mmrl.plugins.flow.sde import SDEKind, sde_kind_registry

    assert set(sde_kind_registry.names()) == set(SDE_KINDS)
    for kind in SDE_KINDS:
        assert issubclass(sde_kind_registry.get(kind), SDEKind) and sde_kind_registry.get(kind).name == kind
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = lines.index("sde_kinds (plugin flow):") + 1
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("  "))
    assert {line.split()[0] for line in lines[start:end]} == set(SDE_KINDS)


def test_a_registered_kind_is_a_step_kind_like_the_built_in_ones():
    """A kind registered by another package goes through sde_step, diffusion_coefficient and transition_std: here
    x_next ~ N(x - Δ·v, (c·Δ)²) with c = noise_level, checked against the formulas written out."""
    from mmrl.plugins.flow.sde import SDEKind, diffusion_coefficient, sde_kind_registry, transition_std

    class LinearStd(SDEKind):
        """x_next ~ N(x - Δ·v, (a·Δ)²) (a test kind)."""

        name = "test_linear_std"

        def diffusion_coefficient(self, sigma, sigma_next, noise_level):
            return torch.full_like(sigma, noise_level)

        def transition(self, x, v, sigma, sigma_next, noise_level):
            return x - (sigma - sigma_next) * v, noise_level * (sigma - sigma_next)

        def transition_std(self, sigma, sigma_next, noise_level):
            return noise_level * (sigma - sigma_next)

    sde_kind_registry.register("test_linear_std", LinearStd)
    try:
        assert sde_kinds() == (*SDE_KINDS, "test_linear_std")
        x = torch.tensor([[0.5, -1.0]], dtype=torch.float64)
        v = torch.tensor([[2.0, 1.0]], dtype=torch.float64)
        prev = torch.tensor([[0.3, -1.2]], dtype=torch.float64)
        out = sde_step("test_linear_std", v, x, 0.8, 0.6, noise_level=0.5, prev_sample=prev)
        std = 0.5 * 0.2
        mean = [0.5 - 0.2 * 2.0, -1.0 - 0.2 * 1.0]  # [0.1, -1.2]
        expected = sum(-((p - m) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
                       for p, m in zip([0.3, -1.2], mean, strict=True)) / 2
        assert out.mean.flatten().tolist() == pytest.approx(mean, abs=1e-12)
        assert float(out.std) == pytest.approx(std, abs=1e-12)
        assert float(out.log_prob) == pytest.approx(expected, abs=1e-9)
        assert float(diffusion_coefficient("test_linear_std", 0.8, 0.6, noise_level=0.5)) == pytest.approx(0.5)
        assert float(transition_std("test_linear_std", 0.8, 0.6, noise_level=0.5)) == pytest.approx(0.1)
    finally:
        sde_kind_registry._entries.pop("test_linear_std")
    with pytest.raises(ValueError, match="flow_grpo, dance_grpo, cps, ode"):
        sde_step("test_linear_std", v, x, 0.8, 0.6, noise_level=0.5)


@pytest.mark.parametrize("kind", SDE_KINDS)
@pytest.mark.parametrize(
    "sigmas", [((0.8, 0.5), (0.6, 0.2)), ((1.0, 0.3), (0.9, 0.0))], ids=["interior", "sigma1-and-sigma_next0"]
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cps_log_prob", ["flow_grpo", "gaussian"])
def test_hand_computed_values(kind, sigmas, dtype, cps_log_prob):
    x, v, prev = tiny_inputs(dtype)
    sigma, sigma_next = sigmas
    a = 0.7
    sigma_t, sigma_next_t = torch.tensor(sigma, dtype=dtype), torch.tensor(sigma_next, dtype=dtype)
    out = sde_step(kind, v, x, sigma_t, sigma_next_t, noise_level=a, prev_sample=prev, cps_log_prob=cps_log_prob)
    assert isinstance(out, SDEStepOutput)
    assert out.mean.shape == x.shape and out.prev_sample.shape == x.shape
    assert out.std.shape == (2, 1, 1, 1) and out.log_prob.shape == (2,)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    for b in range(2):
        x_b, v_b, prev_b = (t[b].flatten().double().tolist() for t in (x, v, prev))
        mean, std, log_prob = reference_step(kind, x_b, v_b, prev_b, sigma[b], sigma_next[b], a, cps_log_prob)
        torch.testing.assert_close(out.mean[b].flatten().double(), torch.tensor(mean, dtype=torch.float64), **tol)
        assert out.std[b].item() == pytest.approx(std, rel=1e-6, abs=1e-12)
        assert out.log_prob[b].item() == pytest.approx(log_prob, rel=1e-5 if dtype == torch.float32 else 1e-12)
    torch.testing.assert_close(out.prev_sample, prev.to(out.prev_sample.dtype))


def test_hand_computed_single_numbers():
    """A fully written-out flow_grpo step, x = 1, v = 0.5, σ = 0.5 → 0.25, a = 0.7, one element."""
    out = sde_step(
        "flow_grpo",
        torch.tensor([[0.5]], dtype=torch.float64),
        torch.tensor([[1.0]], dtype=torch.float64),
        0.5,
        0.25,
        noise_level=0.7,
        prev_sample=torch.tensor([[0.6]], dtype=torch.float64),
    )
    # s = 0.7·√(0.5/0.5) = 0.7; ε̂ = 1 + 0.5·0.5 = 1.25; mean = 1 − 0.25·0.5 − 0.25·(0.49/1)·1.25 = 0.7218750
    # std = 0.7·0.5 = 0.35; log p = −(0.6 − 0.721875)²/(2·0.1225) − log 0.35 − log√(2π)
    assert out.mean.item() == pytest.approx(0.721875, abs=1e-15)
    assert out.std.item() == pytest.approx(0.35, abs=1e-15)
    expected = -(0.121875**2) / 0.245 - math.log(0.35) - 0.5 * math.log(2 * math.pi)
    assert out.log_prob.item() == pytest.approx(expected, abs=1e-14)


def test_float_and_per_sample_sigmas_agree():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 5, generator=gen)  # [B, L, D] packed tokens
    v = torch.randn(3, 4, 5, generator=gen)
    prev = torch.randn(3, 4, 5, generator=gen)
    sigma = torch.tensor([1.0, 0.7, 0.3])
    sigma_next = torch.tensor([0.9, 0.5, 0.0])
    for kind in SDE_KINDS:
        batched = sde_step(kind, v, x, sigma, sigma_next, noise_level=0.6, prev_sample=prev)
        assert batched.std.shape == (3, 1, 1)
        for b in range(3):
            single = sde_step(
                kind,
                v[b : b + 1],
                x[b : b + 1],
                sigma[b].item(),
                sigma_next[b].item(),
                noise_level=0.6,
                prev_sample=prev[b : b + 1],
            )
            torch.testing.assert_close(batched.mean[b : b + 1], single.mean)
            torch.testing.assert_close(batched.log_prob[b : b + 1], single.log_prob)
            torch.testing.assert_close(batched.std[b : b + 1], single.std)


# --------------------------------------------------------------------------------------------------------------------
# 2. Sampling, rescoring, generators
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "cps_log_prob"), [("flow_grpo", "flow_grpo"), ("dance_grpo", "flow_grpo"),
                                                   ("cps", "flow_grpo"), ("cps", "gaussian")])
def test_sampled_action_rescored_gives_ratio_one(kind, cps_log_prob):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 8, 8, generator=gen)
    v = torch.randn(4, 3, 8, 8, generator=gen)
    sigma, sigma_next = torch.full((4,), 0.7), torch.full((4,), 0.55)
    options = dict(noise_level=0.8, cps_log_prob=cps_log_prob)

    rollout = sde_step(kind, v, x, sigma, sigma_next, generator=torch.Generator().manual_seed(7), **options)
    # prev_sample = mean + std·z with z the generator's standard normal draw.
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(rollout.prev_sample, rollout.mean + rollout.std * z)
    # log_prob is the manual Gaussian log-density averaged over all non-batch dims (Flow-GRPO's CPS objective
    # −mean((x' − μ)²) for cps by default).
    squared = (rollout.prev_sample - rollout.mean) ** 2
    if kind == "cps" and cps_log_prob == "flow_grpo":
        manual = -squared.mean(dim=(1, 2, 3))
    else:
        manual = (-squared / (2 * rollout.std**2) - torch.log(rollout.std) - LOG_SQRT_2PI).mean(dim=(1, 2, 3))
    torch.testing.assert_close(rollout.log_prob, manual)

    rescored = sde_step(kind, v, x, sigma, sigma_next, prev_sample=rollout.prev_sample, **options)
    assert torch.equal(rescored.log_prob, rollout.log_prob)  # ratio == 1 exactly
    assert torch.equal(rescored.mean, rollout.mean)
    assert torch.equal(torch.exp(rescored.log_prob - rollout.log_prob), torch.ones(4))


def test_generators_single_and_per_sample():
    x = torch.zeros(3, 2, 4)
    v = torch.ones(3, 2, 4)
    kwargs = dict(noise_level=0.7)
    a = sde_step("flow_grpo", v, x, 0.8, 0.6, generator=torch.Generator().manual_seed(3), **kwargs)
    b = sde_step("flow_grpo", v, x, 0.8, 0.6, generator=torch.Generator().manual_seed(3), **kwargs)
    assert torch.equal(a.prev_sample, b.prev_sample)

    seeds = [11, 12, 13]
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    listed = sde_step("flow_grpo", v, x, 0.8, 0.6, generator=generators, **kwargs)
    for i, seed in enumerate(seeds):
        alone = sde_step(
            "flow_grpo", v[i : i + 1], x[i : i + 1], 0.8, 0.6, generator=torch.Generator().manual_seed(seed), **kwargs
        )
        assert torch.equal(listed.prev_sample[i : i + 1], alone.prev_sample)
    with pytest.raises(ValueError, match="generators"):
        sde_step("flow_grpo", v, x, 0.8, 0.6, generator=[torch.Generator()], **kwargs)


def test_gradients_flow_through_mean_not_the_action():
    x, v, prev = tiny_inputs(torch.float32)
    v = v.clone().requires_grad_(True)
    prev = prev.clone().requires_grad_(True)
    out = sde_step("flow_grpo", v, x, 0.8, 0.6, noise_level=0.7, prev_sample=prev)
    out.log_prob.sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0
    assert prev.grad is None  # the action is data


# --------------------------------------------------------------------------------------------------------------------
# 3. Deterministic limits and diffusers
# --------------------------------------------------------------------------------------------------------------------


def test_zero_noise_is_the_euler_step():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 6, 6, generator=gen)
    v = torch.randn(2, 4, 6, 6, generator=gen)
    ode = sde_step("ode", v, x, 0.9, 0.6, noise_level=0.0)
    torch.testing.assert_close(ode.mean, x + (0.6 - 0.9) * v)
    assert torch.equal(ode.prev_sample, ode.mean)
    assert torch.equal(ode.std, torch.zeros(2, 1, 1, 1)) and torch.equal(ode.log_prob, torch.zeros(2))
    for kind in STOCHASTIC_KINDS:
        out = sde_step(kind, v, x, 0.9, 0.6, noise_level=0.0, generator=torch.Generator().manual_seed(0))
        if kind == "cps":  # (1−σ')·x̂0 + σ'·ε̂ = x + (σ'−σ)·v up to rounding
            torch.testing.assert_close(out.mean, ode.mean, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(out.mean, ode.mean)
        assert torch.equal(out.prev_sample, out.mean)
        assert torch.equal(out.std, torch.zeros(2, 1, 1, 1))
        assert torch.equal(out.log_prob, torch.zeros(2))


def test_ode_scores_a_given_action_as_zero():
    x, v, prev = tiny_inputs(torch.float32)
    out = sde_step("ode", v, x, 0.5, 0.2, noise_level=0.0, prev_sample=prev)
    assert torch.equal(out.prev_sample, prev)
    assert torch.equal(out.log_prob, torch.zeros(2))


def test_matches_diffusers_flow_match_euler():
    diffusers = pytest.importorskip("diffusers")
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    scheduler.set_timesteps(10)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 4, 8, 8, generator=gen)
    v = torch.randn(2, 4, 8, 8, generator=gen)
    for i in range(10):
        scheduler.set_timesteps(10)  # reset the scheduler's step index
        expected = scheduler.step(v, scheduler.timesteps[i], x).prev_sample  # x + (σ_next − σ)·v
        sigma, sigma_next = scheduler.sigmas[i], scheduler.sigmas[i + 1]
        flow = sde_step("flow_grpo", v, x, sigma, sigma_next, noise_level=0.0, generator=torch.Generator())
        torch.testing.assert_close(flow.prev_sample, expected, rtol=0, atol=0)
        ode = sde_step("ode", v, x, sigma, sigma_next, noise_level=0.0)
        torch.testing.assert_close(ode.prev_sample, expected, rtol=0, atol=0)


def test_cps_full_noise_matches_diffusers_stochastic_sampling():
    """CPS with a = 1 is (1 − σ')·x̂0 + σ'·z: diffusers' ``stochastic_sampling`` step."""
    diffusers = pytest.importorskip("diffusers")
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, stochastic_sampling=True)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, 8, 8, generator=gen)
    v = torch.randn(2, 4, 8, 8, generator=gen)
    for i in (0, 4, 8):
        scheduler.set_timesteps(10)
        expected = scheduler.step(v, scheduler.timesteps[i], x, generator=torch.Generator().manual_seed(9)).prev_sample
        out = sde_step(
            "cps",
            v,
            x,
            scheduler.sigmas[i],
            scheduler.sigmas[i + 1],
            noise_level=1.0,
            generator=torch.Generator().manual_seed(9),
        )
        torch.testing.assert_close(out.prev_sample, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cps_log_prob", ["flow_grpo", "gaussian"])
def test_cps_last_step_is_deterministic_with_zero_log_prob(cps_log_prob):
    x, v, prev = tiny_inputs(torch.float32)
    v = v.clone().requires_grad_(True)
    out = sde_step("cps", v, x, 0.3, 0.0, noise_level=0.8, generator=torch.Generator().manual_seed(0),
                   cps_log_prob=cps_log_prob)
    assert torch.equal(out.std, torch.zeros(2, 1, 1, 1))
    torch.testing.assert_close(out.prev_sample, x - 0.3 * v.detach())  # = x̂0
    assert torch.equal(out.log_prob, torch.zeros(2))
    out.log_prob.sum().backward()  # no NaN gradients through the zero-std branch
    assert torch.equal(v.grad, torch.zeros_like(v))
    # another action at that step is not scored either (no regression of the mean onto it)
    rescored = sde_step("cps", v, x, 0.3, 0.0, noise_level=0.8, prev_sample=prev, cps_log_prob=cps_log_prob)
    assert torch.equal(rescored.log_prob, torch.zeros(2))


def test_cps_defaults_to_flow_grpos_objective_whose_scale_stays_flat_over_the_steps():
    """Flow-GRPO scores a CPS step with −mean((x' − μ)²), dropping 1/(2·std²) and the constants (yifan123/flow_grpo
    54809b5, flow_grpo/diffusers_patch/sd3_sde_with_logprob.py:85-86). The exact density's gradient is that one's
    times 1/(2·std²), which on SD3.5's 10-step grid (shift 3, a = 0.8) runs from 0.600 at step 0 to 6934 at step 8."""
    diffusers = pytest.importorskip("diffusers")
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    scheduler.set_timesteps(10)
    sigmas = scheduler.sigmas.double()
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(1, 4, 8, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 4, 8, 8, generator=gen, dtype=torch.float64)
    scales = []
    for step in range(9):
        velocity = v.clone().requires_grad_(True)
        default = sde_step("cps", velocity, x, sigmas[step], sigmas[step + 1], noise_level=0.8,
                           generator=torch.Generator().manual_seed(step))
        assert default.log_prob.item() == pytest.approx(-((default.prev_sample - default.mean) ** 2).mean().item(),
                                                        rel=1e-12)
        exact = sde_step("cps", velocity, x, sigmas[step], sigmas[step + 1], noise_level=0.8,
                         prev_sample=default.prev_sample, cps_log_prob="gaussian")
        (grad_default,) = torch.autograd.grad(default.log_prob.sum(), velocity)
        (grad_exact,) = torch.autograd.grad(exact.log_prob.sum(), velocity)
        std = float(sigmas[step + 1]) * math.sin(0.8 * math.pi / 2)
        torch.testing.assert_close(grad_exact, grad_default / (2 * std**2), rtol=1e-9, atol=1e-12)
        scales.append(1 / (2 * std**2))
    assert scales[0] == pytest.approx(0.600, abs=1e-3) and scales[8] == pytest.approx(6934, rel=1e-3)
    with pytest.raises(ValueError, match="cps_log_prob"):
        sde_step("cps", v, x, 0.8, 0.6, noise_level=0.8, cps_log_prob="surrogate")


def test_flow_grpo_at_sigma_one_uses_next_grid_point():
    s = diffusion_coefficient("flow_grpo", torch.tensor([1.0, 0.5]), torch.tensor([0.96, 0.25]), noise_level=0.7)
    torch.testing.assert_close(s, torch.tensor([0.7 * math.sqrt(1 / 0.04), 0.7]))
    out = sde_step("flow_grpo", torch.zeros(1, 3), torch.ones(1, 3), 1.0, 0.96, noise_level=0.7, generator=None)
    assert torch.isfinite(out.mean).all() and torch.isfinite(out.std).all()
    assert out.std.item() == pytest.approx(0.7 * math.sqrt(1 / 0.04) * math.sqrt(0.04), rel=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# 4. Marginal preservation on Gaussian data
# --------------------------------------------------------------------------------------------------------------------
# Data x0 ~ N(m, diag(c²)), ε ~ N(0, I), x_σ = (1−σ)·x0 + σ·ε. Per dim x_σ ~ N((1−σ)·m, S), S = (1−σ)²c² + σ²,
# Cov(x0, x_σ) = (1−σ)·c², Cov(ε, x_σ) = σ, so
#   E[x0 | x] = m + (1−σ)·c²/S·(x − (1−σ)·m),   E[ε | x] = σ/S·(x − (1−σ)·m),
#   v(x, σ) = E[ε − x0 | x] = (σ − (1−σ)·c²)/S·(x − (1−σ)·m) − m.

DATA_MEAN = torch.tensor([1.0, -0.5, 0.3], dtype=torch.float64)
DATA_STD = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)


def exact_velocity(x, sigma, m=DATA_MEAN, c=DATA_STD):
    var = (1 - sigma) ** 2 * c**2 + sigma**2
    return (sigma - (1 - sigma) * c**2) / var * (x - (1 - sigma) * m) - m


def marginal(sigma, m=DATA_MEAN, c=DATA_STD):
    return (1 - sigma) * m, (1 - sigma) ** 2 * c**2 + sigma**2


def propagate_moments(kind, noise_level, sigmas, m=DATA_MEAN, c=DATA_STD, start=None):
    """Exact mean/variance of the discrete chain: with this velocity every step is x' = A·x + b + std·z (per dim), and
    A, b, std are read off ``sde_step`` itself by scoring the inputs x = 0 and x = 1."""
    mean, var = marginal(sigmas[0], m, c) if start is None else start
    probe = torch.stack([torch.zeros_like(m), torch.ones_like(m)])  # [2, D]
    history = []
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:], strict=True):
        out = sde_step(
            kind,
            exact_velocity(probe, sigma, m, c),
            probe,
            sigma,
            sigma_next,
            noise_level=noise_level,
            prev_sample=probe,
        )
        b = out.mean[0]
        slope = out.mean[1] - out.mean[0]
        mean, var = slope * mean + b, slope**2 * var + out.std[0] ** 2
        history.append((sigma_next, mean, var))
    return history


@pytest.mark.parametrize("kind,noise_level", [("flow_grpo", 0.7), ("dance_grpo", 0.3), ("ode", 0.0)])
def test_moments_converge_to_the_data_distribution(kind, noise_level):
    # From σ = 1 (x ~ N(0, I)) to σ = 0 on a uniform 200-step grid. The mean is exact for every kind (the velocity
    # is affine and E[ε̂] = 0). The variance error is pure discretisation error, 1.2–1.5% here; for "flow_grpo" it
    # does not vanish as the grid is refined, because s² = a²σ/(1−σ) is singular at σ = 1 (the first steps, with
    # σ_next in the denominator, overshoot the variance by ~10% and the contraction only partly forgets it).
    sigmas = torch.linspace(1, 0, 201, dtype=torch.float64).tolist()
    history = propagate_moments(kind, noise_level, sigmas)
    _, mean, var = history[-1]
    torch.testing.assert_close(mean, DATA_MEAN, rtol=0, atol=1e-12)
    assert ((var / DATA_STD**2 - 1).abs() < 0.02).all(), var / DATA_STD**2
    # Every intermediate marginal is tracked too (worst case: the σ ≈ 1 transient of flow_grpo).
    for sigma_next, mean, var in history[:-1]:
        target_mean, target_var = marginal(sigma_next)
        torch.testing.assert_close(mean, target_mean, rtol=0, atol=1e-12)
        assert ((var / target_var - 1).abs() < 0.12).all(), (sigma_next, var / target_var)


@pytest.mark.parametrize("kind,noise_level", [("flow_grpo", 0.7), ("flow_grpo", 1.0), ("dance_grpo", 0.3)])
def test_sde_kinds_are_first_order_consistent(kind, noise_level):
    # Away from the σ = 1 singularity (start at σ = 0.9 from the exact marginal), Euler–Maruyama of a marginal-
    # preserving SDE has O(Δ) weak error: refining the grid 4× divides the variance error by ~4. A wrong drift term
    # (sign, missing ½s²·score, std without √Δ) gives O(1) errors instead (checked by hand: 80%–6000%).
    errors = []
    for n in (50, 200):
        sigmas = torch.linspace(0.9, 0.0, n + 1, dtype=torch.float64).tolist()
        _, _, var = propagate_moments(kind, noise_level, sigmas)[-1]
        errors.append((var / DATA_STD**2 - 1).abs().max().item())
    assert errors[1] < 0.015
    assert 3.0 < errors[0] / errors[1] < 5.0, errors


def sample_chain(kind, noise_level, sigmas, n, seed, m=DATA_MEAN, c=DATA_STD):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, m.numel(), generator=gen, dtype=torch.float64)  # x_1 ~ N(0, I)
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:], strict=True):
        x = sde_step(
            kind, exact_velocity(x, sigma, m, c), x, sigma, sigma_next, noise_level=noise_level, generator=gen
        ).prev_sample
    return x


def test_sampled_chains_reach_the_data_distribution():
    # n = 20 000 samples drawn through sde_step, 100 steps from σ = 1 to 0, float64. The sample moments must match
    # (a) the exact moments of the same discrete chain (propagate_moments) within 5 standard errors, and (b) the data
    # distribution within 5 standard errors plus the discretisation bias of a 100-step grid (< 3% relative variance,
    # measured with propagate_moments; 0 for the mean and for the cross-covariances, since the dims never mix).
    #   mean:       |m̂ − m|      < 5·c/√n                 (≈ 0.018·c)
    #   variance:   |ĉ²/c² − 1|  < 5·√(2/n) [+ 0.03]      (≈ 0.05 [0.08])
    #   covariance: |Ĉ_ij|       < 5·c_i·c_j/√n           (the data's dims are independent)
    n = 20_000
    sigmas = torch.linspace(1, 0, 101, dtype=torch.float64).tolist()
    statistical = 5 * math.sqrt(2 / n)
    off_diagonal = ~torch.eye(3, dtype=torch.bool)
    finals = {}
    for seed, (kind, noise_level) in enumerate([("flow_grpo", 0.7), ("dance_grpo", 0.3), ("ode", 0.0)]):
        x = sample_chain(kind, noise_level, sigmas, n, seed)
        mean, cov = x.mean(0), torch.cov(x.T)
        var = cov.diagonal()
        _, _, chain_var = propagate_moments(kind, noise_level, sigmas)[-1]
        assert ((chain_var / DATA_STD**2 - 1).abs() < 0.03).all(), (kind, chain_var / DATA_STD**2)
        assert ((mean - DATA_MEAN).abs() < 5 * DATA_STD / math.sqrt(n)).all(), (kind, mean)
        assert ((var / chain_var - 1).abs() < statistical).all(), (kind, var / chain_var)
        assert ((var / DATA_STD**2 - 1).abs() < statistical + 0.03).all(), (kind, var / DATA_STD**2)
        scale = torch.outer(DATA_STD, DATA_STD)
        assert (cov.abs()[off_diagonal] < 5 / math.sqrt(n) * scale[off_diagonal]).all(), (kind, cov)
        finals[kind] = (mean, var)
    # ... and therefore each other (twice the single-chain tolerances).
    for kind in ("dance_grpo", "ode"):
        assert ((finals[kind][0] - finals["flow_grpo"][0]).abs() < 10 * DATA_STD / math.sqrt(n)).all()
        ratio = finals[kind][1] / finals["flow_grpo"][1]
        assert ((ratio - 1).abs() < 2 * (statistical + 0.03)).all(), (kind, ratio)


def test_cps_preserves_marginals_exactly_for_point_mass_data():
    # With c = 0 the posterior is exact (x̂0 = x0, ε̂ = ε), so CPS's coefficient-preserving step maps the marginal
    # N((1−σ)·m, σ²) exactly onto N((1−σ')·m, σ'²) at every step, for any number of steps.
    zero = torch.zeros(3, dtype=torch.float64)
    for n_steps in (10, 200):
        sigmas = torch.linspace(1, 0, n_steps + 1, dtype=torch.float64).tolist()
        for sigma_next, mean, var in propagate_moments("cps", 0.8, sigmas, c=zero):
            torch.testing.assert_close(mean, (1 - sigma_next) * DATA_MEAN, rtol=0, atol=1e-12)
            target_var = torch.full((3,), sigma_next**2, dtype=torch.float64)
            torch.testing.assert_close(var, target_var, rtol=1e-10, atol=1e-12)
    # Sampled: halfway the spread is σ = 0.5 in every dim; the last step (σ' = 0, std = 0) lands on m exactly.
    n = 20_000
    half = sample_chain("cps", 0.8, torch.linspace(1, 0.5, 6, dtype=torch.float64).tolist(), n, seed=0, c=zero)
    assert ((half.mean(0) - 0.5 * DATA_MEAN).abs() < 5 * 0.5 / math.sqrt(n)).all()
    assert ((half.var(0) / 0.25 - 1).abs() < 5 * math.sqrt(2 / n)).all()
    final = sample_chain("cps", 0.8, torch.linspace(1, 0, 11, dtype=torch.float64).tolist(), n, seed=1, c=zero)
    torch.testing.assert_close(final, DATA_MEAN.expand(n, 3), rtol=0, atol=1e-9)


def test_cps_keeps_the_mean_but_is_under_dispersed_on_spread_data():
    # Characterisation (see the module docstring): CPS's per-step noise σ'·sin(aπ/2) does not shrink with Δ, so
    # with imperfect posteriors (c > 0) it loses variance at every step and does not converge to the data
    # distribution as the grid is refined. a = 0 is the Euler step and converges.
    for n_steps in (10, 200):
        sigmas = torch.linspace(1, 0, n_steps + 1, dtype=torch.float64).tolist()
        _, mean, var = propagate_moments("cps", 0.8, sigmas)[-1]
        torch.testing.assert_close(mean, DATA_MEAN, rtol=0, atol=1e-12)
        assert (var < DATA_STD**2).all() and (var / DATA_STD**2 > 0.3).all(), var / DATA_STD**2
    sigmas = torch.linspace(1, 0, 201, dtype=torch.float64).tolist()
    _, _, var = propagate_moments("cps", 0.0, sigmas)[-1]
    assert ((var / DATA_STD**2 - 1).abs() < 0.02).all()


# --------------------------------------------------------------------------------------------------------------------
# 5. Errors
# --------------------------------------------------------------------------------------------------------------------


def test_errors():
    x, v, prev = tiny_inputs(torch.float32)
    with pytest.raises(ValueError, match="flow_grpo, dance_grpo, cps, ode"):
        sde_step("ddim", v, x, 0.8, 0.6, noise_level=0.7)
    with pytest.raises(ValueError, match="noise_level"):
        sde_step("flow_grpo", v, x, 0.8, 0.6, noise_level=-0.1)
    with pytest.raises(ValueError, match="noise_level"):
        sde_step("ode", v, x, 0.8, 0.6, noise_level=-1.0)
    with pytest.raises(ValueError, match="noise_level"):
        sde_step("cps", v, x, 0.8, 0.6, noise_level=1.5)
    with pytest.raises(ValueError, match="sigma_next"):
        sde_step("flow_grpo", v, x, 0.6, 0.8, noise_level=0.7)
    with pytest.raises(ValueError, match="sigma_next"):
        sde_step("dance_grpo", v, x, 0.6, 0.6, noise_level=0.3)
    with pytest.raises(ValueError, match="sigma_next"):  # one bad sample in a batch
        sde_step("cps", v, x, torch.tensor([0.8, 0.4]), torch.tensor([0.6, 0.5]), noise_level=0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        sde_step("flow_grpo", v, x, 1.2, 0.6, noise_level=0.7)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        sde_step("flow_grpo", v, x, 0.5, -0.1, noise_level=0.7)
    with pytest.raises(ValueError, match="batch"):
        sde_step("flow_grpo", v, x, torch.tensor([0.8, 0.7, 0.6]), 0.5, noise_level=0.7)
    with pytest.raises(ValueError, match="shape"):
        sde_step("flow_grpo", v[:, :, :1], x, 0.8, 0.6, noise_level=0.7)
    with pytest.raises(ValueError, match="shape"):
        sde_step("flow_grpo", v, x, 0.8, 0.6, noise_level=0.7, prev_sample=prev[:1])
    with pytest.raises(ValueError, match="kind"):
        diffusion_coefficient("euler", 0.8, 0.6, noise_level=0.7)
    with pytest.raises(ValueError, match="variance"):
        gaussian_kl_between_means(x, prev, 0.5, variance="sum")
    with pytest.raises(ValueError, match="diffusion_coeff"):
        gaussian_kl_between_means(x, prev, 0.5, variance="flow_grpo")


# --------------------------------------------------------------------------------------------------------------------
# 6. Precision
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", SDE_KINDS)
def test_half_precision_inputs_are_scored_in_float32(half, kind):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 4, 4, 4, generator=gen).to(half)
    v = torch.randn(2, 4, 4, 4, generator=gen).to(half)
    prev = torch.randn(2, 4, 4, 4, generator=gen).to(half)
    sigma = torch.tensor([0.8, 0.5], dtype=half)
    low = sde_step(kind, v, x, sigma, 0.3, noise_level=0.7, prev_sample=prev)
    for tensor in low:
        assert tensor.dtype == torch.float32
    # Identical to scoring the upcast inputs: the upcast happens before any arithmetic.
    full = sde_step(kind, v.float(), x.float(), sigma.float(), 0.3, noise_level=0.7, prev_sample=prev.float())
    assert torch.equal(low.log_prob, full.log_prob)
    assert torch.equal(low.mean, full.mean)
    sampled = sde_step(kind, v, x, sigma, 0.3, noise_level=0.7, generator=torch.Generator().manual_seed(0))
    assert sampled.prev_sample.dtype == torch.float32 and sampled.log_prob.dtype == torch.float32


# --------------------------------------------------------------------------------------------------------------------
# KL between transition means
# --------------------------------------------------------------------------------------------------------------------


def test_kl_transition_is_the_exact_gaussian_kl_per_element():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 2, 4, 4, generator=gen, dtype=torch.float64)
    v = torch.randn(3, 2, 4, 4, generator=gen, dtype=torch.float64)
    v_ref = v + 0.1 * torch.randn(3, 2, 4, 4, generator=gen, dtype=torch.float64)
    sigma, sigma_next = torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.9, 0.4, 0.1])
    for kind in STOCHASTIC_KINDS:
        policy = sde_step(kind, v, x, sigma, sigma_next, noise_level=0.7, prev_sample=x)
        ref = sde_step(kind, v_ref, x, sigma, sigma_next, noise_level=0.7, prev_sample=x)
        kl = gaussian_kl_between_means(policy.mean, ref.mean, policy.std)
        assert kl.shape == (3,)
        exact = torch.distributions.kl_divergence(
            torch.distributions.Normal(policy.mean, policy.std.expand_as(policy.mean)),
            torch.distributions.Normal(ref.mean, ref.std.expand_as(ref.mean)),
        ).mean(dim=(1, 2, 3))
        torch.testing.assert_close(kl, exact)
        # Flow-GRPO's form divides by the diffusion coefficient s² instead of s²·Δ.
        s = diffusion_coefficient(kind, sigma, sigma_next, noise_level=0.7)
        flow_form = gaussian_kl_between_means(
            policy.mean, ref.mean, policy.std, variance="flow_grpo", diffusion_coeff=s
        )
        if kind == "cps":
            torch.testing.assert_close(flow_form, kl)
        else:
            torch.testing.assert_close(flow_form, kl * (sigma - sigma_next).double())


def test_kl_hand_value_and_reference_is_detached():
    mean = torch.tensor([[1.0, 2.0], [0.0, 0.0]], requires_grad=True)
    ref_mean = torch.tensor([[0.5, 2.5], [0.0, 1.0]], requires_grad=True)
    kl = gaussian_kl_between_means(mean, ref_mean, torch.tensor([0.5, 2.0]))
    torch.testing.assert_close(kl, torch.tensor([(0.25 + 0.25) / 2 / (2 * 0.25), 0.5 / (2 * 4.0)]))
    kl.sum().backward()
    assert mean.grad is not None and ref_mean.grad is None
    flow = gaussian_kl_between_means(mean, ref_mean, 0.5, variance="flow_grpo", diffusion_coeff=1.0)
    torch.testing.assert_close(flow, torch.tensor([0.25 / 2.0, 0.5 / 2.0]))
    # The CPS authors' form: the mean squared distance of the means, no denominator (FlowCPS train_sd3.py:900).
    plain = gaussian_kl_between_means(mean, ref_mean, 0.5, variance="none")
    torch.testing.assert_close(plain, torch.tensor([0.25, 0.5]))
    with pytest.raises(ValueError, match="unknown KL variance 'exact'; expected one of transition, flow_grpo, none"):
        gaussian_kl_between_means(mean, ref_mean, 0.5, variance="exact")


def test_plugin_sde_accepts_a_registered_kind_and_names_the_kinds_otherwise():
    """plugin.sde is validated against the registry when the config is read: a kind another package registers can be
    selected; an unknown name, or the deterministic ode kind (nothing to train), is one line listing the kinds."""
    from mmrl.config import ConfigError, from_dict
    from mmrl.plugins.flow.config import FlowPluginConfig
    from mmrl.plugins.flow.sde import DanceGRPOSDE, sde_kind_registry

    class Wider(DanceGRPOSDE):
        """DanceGRPO's SDE under another name (a test kind)."""

        name = "test_wider"

    options = {"model": "unused", "prompts": ["a cat"]}
    with pytest.raises(ConfigError, match=r"^config key 'plugin.sde': got 'test_wider'; allowed: a stochastic SDE "
                                          r"kind registered in sde_kind_registry: flow_grpo, dance_grpo, cps$"):
        from_dict(FlowPluginConfig, {**options, "sde": "test_wider"}, "plugin")
    sde_kind_registry.register("test_wider", Wider)
    try:
        assert from_dict(FlowPluginConfig, {**options, "sde": "test_wider"}, "plugin").sde == "test_wider"
        with pytest.raises(ConfigError, match=r"allowed: .*: flow_grpo, dance_grpo, cps, test_wider$"):
            from_dict(FlowPluginConfig, {**options, "sde": "ode"}, "plugin")
    finally:
        sde_kind_registry._entries.pop("test_wider")


def test_a_kinds_limits_are_properties_of_its_class_not_of_its_name():
    """The config and the credit strategies ask the kind's class (max_noise_level, deterministic_last_step), so a
    registered kind with cps's limits under another name is refused the same way, and the built-in kinds keep their
    own: cps's noise level is at most 1 and its last step is untrainable; flow_grpo has neither limit."""
    from mmrl.config import ConfigError, from_dict
    from mmrl.plugins.flow.config import FlowPluginConfig
    from mmrl.plugins.flow.sde import CoefficientsPreservingStep, DanceGRPOSDE, sde_kind_registry

    assert (CoefficientsPreservingStep.max_noise_level, CoefficientsPreservingStep.deterministic_last_step) == (1, True)
    assert (DanceGRPOSDE.max_noise_level, DanceGRPOSDE.deterministic_last_step) == (None, False)

    class Bounded(DanceGRPOSDE):
        """DanceGRPO's step with a noise ceiling and an untrainable last step (a test kind)."""

        name = "test_bounded"
        max_noise_level = 0.5
        deterministic_last_step = True

    options = {"model": "unused", "prompts": ["a cat"], "num_steps": 4}

    def config(**more):
        return from_dict(FlowPluginConfig, {**options, **more}, "plugin")

    sde_kind_registry.register("test_bounded", Bounded)
    try:
        assert config(sde="test_bounded", noise_level=0.5, timestep_fraction=0.75).sde == "test_bounded"
        with pytest.raises(ConfigError, match=r"'plugin.noise_level': got 0.6; allowed: a number in \(0, 0.5\] for "
                                              r"sde 'test_bounded'$"):
            config(sde="test_bounded", noise_level=0.6, timestep_fraction=0.75)
        with pytest.raises(ConfigError, match=r"'plugin.timestep_fraction': got 1.0; .* the last of the 4 steps with "
                                              r"sde 'test_bounded'"):
            config(sde="test_bounded", noise_level=0.5, timestep_fraction=1.0)
        with pytest.raises(ConfigError, match=r"'plugin.credit.branch.points': got \[1, 3\]; allowed: no branch at "
                                              r"the last step with sde 'test_bounded'"):
            config(sde="test_bounded", noise_level=0.5, credit={"strategy": "branch", "branch": {"points": [1, 3]}})
        with pytest.raises(ConfigError, match=r"'plugin.credit.tree.split_points': got \[0, 3\]; allowed: no split "
                                              r"at the last step with sde 'test_bounded'"):
            config(sde="test_bounded", noise_level=0.5,
                   credit={"strategy": "tree", "tree": {"split_points": [0, 3]}})
    finally:
        sde_kind_registry._entries.pop("test_bounded")
    # the built-in kinds: cps keeps its limits, flow_grpo takes a noise level above 1 and trains every step
    with pytest.raises(ConfigError, match=r"a number in \(0, 1\] for sde 'cps'$"):
        config(sde="cps", noise_level=1.5, timestep_fraction=0.75)
    assert config(sde="flow_grpo", noise_level=1.5, timestep_fraction=1.0).noise_level == 1.5
