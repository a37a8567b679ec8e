"""The sequence-level k2 KL estimator (``k2_seq``, ESPO's KL on the sequence ELBO): hand values and gradients."""

import pytest
import torch

from mmrl.algos import aggregate, kl_estimators


def test_hand_values():
    # Row 0: log-ratios 0.5, −0.1, 0.2 → x = 0.6, ½·0.36/3 = 0.06 in every column.
    # Row 1: 1.0, 1.0, 0 (an inactive column: equal in both) → x = 2, ½·4/3 = 2/3.
    logp = torch.tensor([[0.5, -0.1, 0.2], [-1.0, 0.0, -4.0]])
    ref = torch.tensor([[0.0, 0.0, 0.0], [-2.0, -1.0, -4.0]])
    expected = torch.tensor([[0.06] * 3, [2 / 3] * 3])
    torch.testing.assert_close(kl_estimators["k2_seq"](logp, ref), expected)


def test_espo_normalisation_under_seq_mean_token_mean():
    """Aggregated with seq_mean_token_mean, each sequence contributes ½·x²/A whatever its mask (ESPO: the squared
    ELBO difference over 2 and over the generation budget, averaged over sequences)."""
    logp = torch.tensor([[0.3, 0.3, 0.3, 0.3], [0.5, 0.5, 0.0, 0.0]], requires_grad=True)
    ref = torch.zeros(2, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    kl = aggregate(kl_estimators["k2_seq"](logp, ref), mask, "seq_mean_token_mean")
    x = torch.tensor([1.2, 1.0])
    assert float(kl.detach()) == pytest.approx(float((0.5 * x**2 / 4).mean()))
    kl.backward()
    # d/dlogp[i, a] of mean_i ½·x_i²/4 = x_i / (4·2) for every column of row i (x sums all of them).
    torch.testing.assert_close(logp.grad, (x / 8).unsqueeze(1).expand(2, 4))


def test_reference_gets_no_gradient_and_the_sum_is_not_clamped():
    logp = torch.full((1, 4), 10.0, requires_grad=True)  # x = 40: each column within ±20, the sum beyond it
    ref = torch.zeros(1, 4, requires_grad=True)
    value = kl_estimators["k2_seq"](logp, ref)
    torch.testing.assert_close(value, torch.full((1, 4), 0.5 * 40.0**2 / 4))
    value.sum().backward()
    assert ref.grad is None
    torch.testing.assert_close(logp.grad, torch.full((1, 4), 40.0))  # Σ over 4 columns of x/4


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="shape"):
        kl_estimators["k2_seq"](torch.zeros(2, 3), torch.zeros(2, 2))
