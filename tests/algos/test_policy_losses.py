"""Policy losses against hand-computed values: PPO clip with clip-higher and dual clip, GSPO, chunk ratios."""

import math

import pytest
import torch

from mmrl.algos import aggregate, log_ratio, policy_losses

RATIOS = torch.tensor([[1.0, 1.5, 0.5], [1.0, 1.5, 0.5]])
ADV = torch.tensor([1.0, -1.0])
MASK = torch.ones(2, 3)


def _loss(name, ratios=RATIOS, adv=ADV, mask=MASK, **options):
    old = torch.zeros_like(ratios)
    return policy_losses[name](ratios.log(), old, adv, mask, **options)


def test_grpo_clip_higher_hand_values():
    loss, metrics = _loss("grpo", clip_low=0.2, clip_high=0.28)
    # A = +1: L = -min(r, clip(r, 0.8, 1.28)) -> [-1, -1.28, -0.5]
    # A = -1: L = max(r, clip(r, 0.8, 1.28))  -> [ 1,  1.5,   0.8]
    expected = torch.tensor([[-1.0, -1.28, -0.5], [1.0, 1.5, 0.8]])
    torch.testing.assert_close(loss, expected)
    assert metrics["clip_fraction"].item() == pytest.approx(2 / 6)  # (A>0, r=1.5) and (A<0, r=0.5)
    assert metrics["clip_fraction_high"].item() == pytest.approx(1 / 6)
    assert metrics["clip_fraction_low"].item() == pytest.approx(1 / 6)


def test_dual_clip_caps_negative_advantage_losses():
    ratios = torch.tensor([[5.0, 1.0]])
    loss, metrics = _loss("grpo", ratios=ratios, adv=torch.tensor([-1.0]), mask=torch.ones(1, 2), dual_clip=3.0)
    # r = 5, A = -1: max(5, 1.2) = 5, capped at -c*A = 3. r = 1 is untouched.
    torch.testing.assert_close(loss, torch.tensor([[3.0, 1.0]]))
    assert metrics["dual_clip_fraction"].item() == pytest.approx(0.5)
    positive, _ = _loss("grpo", ratios=ratios, adv=torch.tensor([1.0]), mask=torch.ones(1, 2), dual_clip=3.0)
    torch.testing.assert_close(positive, torch.tensor([[-1.2, -1.0]]))  # A > 0 is never dual-clipped


def _trl_two_sided(logp, old, adv, mask, eps_low, eps_high, delta, level):
    """TRL's grpo branch with ``delta`` (huggingface/trl@f2cd577 grpo_trainer.py L3055-3091), restated: coef_2 from the
    uncapped coef_1, then coef_1 capped at δ, per-token loss −min(coef_1·A, coef_2·A)."""
    log_r = logp - old
    if level == "sequence":
        log_r = ((log_r * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1).expand_as(logp)
    coef_1 = log_r.exp()
    coef_2 = coef_1.clamp(1 - eps_low, 1 + eps_high)
    coef_1 = coef_1.clamp(max=delta)
    a = adv.unsqueeze(1)
    return -torch.min(coef_1 * a, coef_2 * a)


@pytest.mark.parametrize("name", ["grpo", "gspo", "luspo"])
def test_two_sided_clip_is_trls_delta(name):
    generator = torch.Generator().manual_seed(0)
    mask = (torch.rand(6, 5, generator=generator) > 0.2).double()
    mask[:, 0] = 1.0
    old = -torch.rand(6, 5, generator=generator, dtype=torch.float64) * 2
    logp = (old + 0.8 * torch.randn(6, 5, generator=generator, dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([-1.5, -0.7, 2.0, 0.3, -1.1, 0.9], dtype=torch.float64)
    level = "token" if name == "grpo" else "sequence"
    delta = 1.4 if level == "token" else 1.1  # a sequence's mean log-ratio spreads less
    options = {"clip_low": 0.2, "clip_high": 0.28}
    loss, metrics = policy_losses[name](logp, old, adv, mask, delta=delta, **options)
    expected = _trl_two_sided(logp, old, adv, mask, 0.2, 0.28, delta, level)
    if name == "luspo":  # |o_i| times the sequence-level term
        expected = expected * mask.sum(1, keepdim=True)
    torch.testing.assert_close(loss * mask, expected * mask)
    got = torch.autograd.grad((loss * mask).sum(), logp)[0]
    want = torch.autograd.grad((expected * mask).sum(), logp)[0]
    torch.testing.assert_close(got, want)
    ratio = log_ratio(logp.detach(), old, mask, level=level).exp()
    capped = (adv.unsqueeze(1) < 0) & (ratio > delta) & (mask > 0)
    assert capped.any() and not torch.equal(loss, policy_losses[name](logp, old, adv, mask, **options)[0])
    assert metrics["two_sided_clip_fraction"].item() == pytest.approx(float(capped.sum() / mask.sum()))


def test_two_sided_clip_by_hand():
    # A = −1: r = 5 costs max(min(5, 2), 1.2) = 2 with δ = 2 (5 without), with no gradient; r = 1 and A = +1 unchanged
    ratios = torch.tensor([[5.0, 1.0], [5.0, 1.0]])
    loss, _ = _loss("grpo", ratios=ratios, adv=torch.tensor([-1.0, 1.0]), mask=torch.ones(2, 2), delta=2.0)
    torch.testing.assert_close(loss, torch.tensor([[2.0, 1.0], [-1.2, -1.0]]))
    with pytest.raises(ValueError, match="delta"):
        _loss("grpo", delta=1.0)


def test_invalid_clip_options_are_refused():
    with pytest.raises(ValueError, match="dual_clip"):
        _loss("grpo", dual_clip=0.5)
    with pytest.raises(ValueError, match="clip_low"):
        _loss("grpo", clip_low=1.5)


def test_gspo_sequence_ratio_hand_values():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, metrics = _loss("gspo", mask=mask)
    # Row 0: s = exp((ln 1 + ln 1.5 + ln 0.5) / 3) = 0.75 ** (1/3); A = +1, clip to [1 - 3e-4, 1 + 4e-4].
    s0 = 0.75 ** (1 / 3)
    # Row 1: s = exp((ln 1 + ln 1.5) / 2) = sqrt(1.5) (the masked action is ignored); A = -1.
    s1 = math.sqrt(1.5)
    expected_row0 = -min(s0, min(max(s0, 1 - 3e-4), 1 + 4e-4))
    expected_row1 = max(s1, min(max(s1, 1 - 3e-4), 1 + 4e-4))
    torch.testing.assert_close(loss[0], torch.full((3,), expected_row0))
    torch.testing.assert_close(loss[1, :2], torch.full((2,), expected_row1))


def test_chunk_ratio_is_the_geometric_mean_over_each_chunk():
    chunks = torch.tensor([[0, 0, 1], [5, 2, 2]])  # ids are per row; any integers
    logr = log_ratio(RATIOS.log(), torch.zeros(2, 3), MASK, level="chunk", chunk_ids=chunks)
    expected = torch.tensor([
        [math.sqrt(1.5), math.sqrt(1.5), 0.5],
        [1.0, math.sqrt(0.75), math.sqrt(0.75)],
    ])
    torch.testing.assert_close(logr.exp(), expected)


def test_chunk_level_needs_chunk_ids():
    with pytest.raises(ValueError, match="chunk_ids"):
        _loss("grpo", ratio_level="chunk")


def test_reinforce_ignores_the_ratio():
    logp = torch.tensor([[-1.0, -2.0]])
    loss, _ = policy_losses["reinforce"](logp, torch.zeros(1, 2), torch.tensor([2.0]), torch.ones(1, 2))
    torch.testing.assert_close(loss, torch.tensor([[2.0, 4.0]]))  # -A * logp


def test_per_action_advantages_are_accepted():
    adv = torch.tensor([[1.0, -1.0, 0.0], [0.0, 0.0, 2.0]])
    loss, _ = _loss("grpo", adv=adv)
    assert loss[0, 2].item() == 0.0 and loss[1, 0].item() == 0.0
    with pytest.raises(ValueError, match="advantages"):
        _loss("grpo", adv=torch.ones(3))


@pytest.mark.parametrize("level", ["token", "chunk", "sequence"])
@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_on_policy_clipped_gradient_equals_plain_policy_gradient(name, level):
    """At θ = θ_old the ratio is 1 and the clipped loss has the REINFORCE gradient −A·∇log π (per level)."""
    torch.manual_seed(0)
    features = torch.randn(4, 5, 3)
    weights = torch.randn(3, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.float32)
    chunks = torch.tensor([[0, 0, 1, 1, 2]] * 4)
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.5])
    mode = "seq_mean_token_mean" if level == "sequence" else "token_mean"

    def logp():
        return torch.nn.functional.logsigmoid(features @ weights)  # [4, 5]

    clipped, metrics = policy_losses[name](logp(), logp().detach(), advantages, mask, ratio_level=level,
                                           chunk_ids=chunks)
    assert metrics["ratio_max"].item() == pytest.approx(1.0) and metrics["clip_fraction"].item() == 0.0
    (grad_clipped,) = torch.autograd.grad(aggregate(clipped, mask, mode), weights)
    plain, _ = policy_losses["reinforce"](logp(), logp().detach(), advantages, mask)
    (grad_plain,) = torch.autograd.grad(aggregate(plain, mask, mode), weights)
    torch.testing.assert_close(grad_clipped, grad_plain, rtol=1e-5, atol=1e-6)


def test_clipped_actions_get_no_gradient():
    logp = torch.log(torch.tensor([[1.5, 1.0]])).requires_grad_()
    loss, _ = policy_losses["grpo"](logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), clip_high=0.2)
    loss.sum().backward()
    assert logp.grad[0, 0].item() == 0.0  # r = 1.5 > 1.2 with A > 0: clipped
    assert logp.grad[0, 1].item() == pytest.approx(-1.0)


def _reference_metrics(logp, old_logp, adv, mask, clip_low, clip_high, dual_clip, level):
    """The diagnostics written out one masked mean at a time (the formulas before they were fused into one stacked
    reduction): an independent computation of every metric the clipped loss reports."""
    def mean(values):
        weights = mask.float()
        return float((values.detach().float() * weights).sum() / weights.sum().clamp(min=1.0))

    log_r = log_ratio(logp, old_logp, mask, level=level).detach()
    ratio = log_r.exp()
    adv = adv.unsqueeze(1).expand_as(ratio) if adv.dim() == 1 else adv
    active = mask > 0
    low = (adv < 0) & (ratio < 1 - clip_low)
    high = (adv > 0) & (ratio > 1 + clip_high)
    expected = {
        "ratio_mean": mean(ratio),
        "ratio_min": float(ratio[active].min()) if active.any() else 1.0,
        "ratio_max": float(ratio[active].max()) if active.any() else 1.0,
        "approx_kl": mean(0.5 * log_r**2),
        "clip_fraction": mean((low | high).float()),
        "clip_fraction_low": mean(low.float()),
        "clip_fraction_high": mean(high.float()),
    }
    if dual_clip is not None:
        unclipped = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + clip_high))
        expected["dual_clip_fraction"] = mean(((adv < 0) & (unclipped > -dual_clip * adv)).float())
    return expected


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("dual_clip", [None, 1.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_diagnostics_equal_one_masked_mean_each(level, dual_clip, dtype):
    generator = torch.Generator().manual_seed(7)
    for trial in range(5):
        n, a = 9, 7
        old = -torch.rand(n, a, generator=generator, dtype=dtype) * 3
        logp = old + 0.4 * torch.randn(n, a, generator=generator, dtype=dtype)
        adv = torch.randn(n, generator=generator, dtype=dtype) if trial % 2 else torch.randn(
            n, a, generator=generator, dtype=dtype)
        mask = (torch.rand(n, a, generator=generator) > 0.3).float()
        if trial == 3:
            mask = mask * torch.rand(n, a, generator=generator)  # fractional weights
        if trial == 4:
            mask = torch.zeros(n, a)  # no active action: ratio min and max are 1
        _, metrics = policy_losses["grpo"](logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip,
                                           ratio_level=level)
        expected = _reference_metrics(logp, old, adv, mask, 0.2, 0.28, dual_clip, level)
        assert list(metrics) == list(expected)
        for name, value in metrics.items():
            assert value.dtype == torch.float32 and value.dim() == 0 and not value.requires_grad
            assert float(value) == pytest.approx(expected[name], rel=1e-6, abs=1e-7), (trial, name)


def test_fused_diagnostics_keep_nan_and_empty_batches():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[float("nan"), 0.1, 0.2], [0.0, -0.1, 0.3]])
    _, metrics = policy_losses["grpo"](logp, old, torch.ones(2), torch.ones(2, 3))
    assert all(torch.isnan(metrics[name]) for name in ("ratio_mean", "ratio_min", "ratio_max", "approx_kl"))
    _, empty = policy_losses["grpo"](torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0), torch.zeros(0, 3))
    assert float(empty["ratio_min"]) == float(empty["ratio_max"]) == 1.0
    assert float(empty["ratio_mean"]) == float(empty["clip_fraction"]) == 0.0
    _, reinforce = policy_losses["reinforce"](logp.nan_to_num(), old, torch.ones(2), torch.ones(2, 3))
    assert float(reinforce["ratio_max"]) == pytest.approx(math.exp(0.3), rel=1e-6)
