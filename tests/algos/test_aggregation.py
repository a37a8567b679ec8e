"""Aggregation modes: hand values, and gradient-accumulation invariance with step-wide denominators."""

import pytest
import torch

from mmrl.algos import aggregate, aggregation_counts, aggregation_modes, policy_losses

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", (1 + 2 + 4) / 3),
        ("seq_mean_token_mean", ((1 + 2) / 2 + 4 / 1) / 2),
        ("seq_mean_token_sum", ((1 + 2) + 4) / 2),
        ("seq_mean_token_sum_norm", ((1 + 2) + 4) / (2 * 3)),
    ],
)
def test_hand_values(mode, expected):
    assert aggregate(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_dr_grpo_constant_is_configurable():
    assert aggregate(LOSS, MASK, "seq_mean_token_sum_norm", max_actions=10).item() == pytest.approx(7 / 20)


def test_empty_rows_do_not_count_as_sequences():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert aggregation_counts(mask) == (2.0, 1.0)
    assert aggregate(LOSS, mask, "seq_mean_token_mean").item() == pytest.approx(1.5)


def test_unknown_mode_names_the_choices():
    with pytest.raises(KeyError, match="token_mean"):
        aggregate(LOSS, MASK, "mean")


def _setup():
    torch.manual_seed(0)
    features = torch.randn(8, 6, 4)
    weights = torch.randn(4, requires_grad=True)
    lengths = torch.tensor([6, 1, 3, 5, 2, 6, 4, 1])
    mask = (torch.arange(6).unsqueeze(0) < lengths.unsqueeze(1)).float()
    advantages = torch.randn(8)
    old = torch.nn.functional.logsigmoid(features @ weights).detach() + 0.05 * torch.randn(8, 6)
    return features, weights, mask, advantages, old


def _grad(features, weights, mask, advantages, old, index, mode, counts):
    logp = torch.nn.functional.logsigmoid(features[index] @ weights)
    loss, _ = policy_losses["grpo"](logp, old[index], advantages[index], mask[index])
    value = aggregate(loss, mask[index], mode, **counts)
    (grad,) = torch.autograd.grad(value, weights)
    return grad, value.detach()


@pytest.mark.parametrize("mode", aggregation_modes.names())
def test_two_micro_batches_of_four_equal_one_batch_of_eight(mode):
    features, weights, mask, advantages, old = _setup()
    full = torch.arange(8)
    actions, sequences = aggregation_counts(mask)
    counts = {"num_actions": actions, "num_sequences": sequences, "max_actions": 6}
    grad_full, value_full = _grad(features, weights, mask, advantages, old, full, mode, counts)
    grad_a, value_a = _grad(features, weights, mask, advantages, old, full[:4], mode, counts)
    grad_b, value_b = _grad(features, weights, mask, advantages, old, full[4:], mode, counts)
    torch.testing.assert_close(grad_a + grad_b, grad_full, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(value_a + value_b, value_full)


def test_per_micro_batch_denominators_would_break_invariance():
    """The check above can fail: averaging per-micro-batch token means weights short micro-batches wrongly."""
    features, weights, mask, advantages, old = _setup()
    full = torch.arange(8)
    grad_full, _ = _grad(features, weights, mask, advantages, old, full, "token_mean", {})
    grad_a, _ = _grad(features, weights, mask, advantages, old, full[:4], "token_mean", {})
    grad_b, _ = _grad(features, weights, mask, advantages, old, full[4:], "token_mean", {})
    assert not torch.allclose((grad_a + grad_b) / 2, grad_full, rtol=1e-3)
