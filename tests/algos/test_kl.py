"""KL estimators (Schulman 2020): hand values, and exact expectations over a categorical distribution."""

import math

import pytest
import torch

from mmrl.algos import kl_estimators


def test_hand_values():
    logp, ref = torch.tensor([[0.5, -1.0]]), torch.tensor([[0.0, 0.0]])
    torch.testing.assert_close(kl_estimators["k1"](logp, ref), torch.tensor([[0.5, -1.0]]))
    torch.testing.assert_close(kl_estimators["k2"](logp, ref), torch.tensor([[0.125, 0.5]]))
    expected_k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    torch.testing.assert_close(kl_estimators["k3"](logp, ref), torch.tensor([expected_k3]))


def test_k1_and_k3_are_unbiased_for_kl():
    """Σ_a π(a)·k(a) over the whole support equals KL(π‖π_ref) exactly for k1 and k3; k3 is never negative."""
    policy = torch.log_softmax(torch.tensor([0.3, -1.0, 2.0, 0.0]), dim=0)
    reference = torch.log_softmax(torch.tensor([1.0, 0.5, -0.5, 0.0]), dim=0)
    exact = float((policy.exp() * (policy - reference)).sum())
    for name in ("k1", "k3"):
        values = kl_estimators[name](policy.unsqueeze(0), reference.unsqueeze(0))[0]
        assert float((policy.exp() * values).sum()) == pytest.approx(exact, rel=1e-5)
    assert (kl_estimators["k3"](policy.unsqueeze(0), reference.unsqueeze(0)) >= 0).all()


def test_kl_gradient_flows_to_logp_only():
    logp = torch.tensor([[0.2]], requires_grad=True)
    ref = torch.tensor([[0.0]], requires_grad=True)
    kl_estimators["k3"](logp, ref).sum().backward()
    assert logp.grad is not None and ref.grad is None
    assert logp.grad.item() == pytest.approx(1 - math.exp(-0.2))  # d/dx (e^-x + x - 1)


def test_k3_is_not_clamped_at_10_as_verl_does_only_its_input_at_20():
    """Far from the reference k3 keeps its value and gradient (verl clamps k3 to 10, which zeroes the gradient)."""
    logp = torch.tensor([[-5.0, 15.0, -25.0]], requires_grad=True)  # x = logp - ref: -5, 15, -25 (clamped to -20)
    kl = kl_estimators["k3"](logp, torch.zeros(1, 3))
    torch.testing.assert_close(kl, torch.tensor([[math.exp(5) - 6, math.exp(-15) + 14, math.exp(20) - 21]]))
    kl.sum().backward()
    expected_grad = [1 - math.exp(5), 1 - math.exp(-15), 0.0]  # d/dx (e^-x + x - 1); 0 past the ±20 clamp
    torch.testing.assert_close(logp.grad, torch.tensor([expected_grad]))


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="shape"):
        kl_estimators["k1"](torch.zeros(2, 3), torch.zeros(2, 2))
