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


def test_k2_seq_is_refused_with_action_chunks(tmp_path):
    """The learner calls the KL estimator on each chunk of columns with ``action_chunk_size``; k2_seq squares the
    sum of a whole row, so chunks would give Σ_c ½·x_c²/A_c instead of ½·x²/A."""
    from mmrl.config import ConfigError
    from tests.helpers import toy_config

    with pytest.raises(ConfigError, match="action_chunk_size"):
        toy_config(tmp_path, "algorithm.kl_coef=0.1", "algorithm.kl_estimator=k2_seq", "algorithm.action_chunk_size=2")
    toy_config(tmp_path, "algorithm.kl_coef=0.1", "algorithm.kl_estimator=k3", "algorithm.action_chunk_size=2")


def test_the_learner_hands_the_kl_estimator_the_real_columns_only(tmp_path):
    """The toy plugin's columns after EOS carry log-probs that differ between the policy and the reference; k2_seq
    sums a row's columns, so the learner zeroes the padding columns of both before the estimator (per-action
    estimators give those columns 0 either way, and the mask drops them)."""
    from mmrl.algos import aggregation_counts
    from mmrl.trainer import Trainer
    from tests.helpers import toy_config

    trainer = Trainer(toy_config(tmp_path, "algorithm.kl_coef=0.1", "algorithm.kl_estimator=k2_seq",
                                 "algorithm.entropy_coef=0.0"))
    batch = trainer.collector.collect(trainer.policy, 0, {})
    rollout, advantages = batch.rollout, batch.advantages
    with torch.no_grad():  # move the policy away from the reference so that the KL is not 0
        generator = torch.Generator().manual_seed(0)
        for parameter in trainer.plugin.model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
        output = trainer.plugin.forward(trainer.policy, rollout, need_reference=True)
        ref = output.ref_logp if output.ref_logp is not None else rollout.ref_logp
        mask = rollout.mask.float()  # [N, A]
        outside = ((output.logp - ref).abs() * (1 - mask)).max()
        assert float(outside) > 1e-3  # the padding columns differ: the test can tell the two sums apart
        x = ((output.logp - ref) * mask).sum(dim=1)  # [N] the sequence log-ratio over the real columns
        per_row = 0.5 * x**2 / mask.shape[1]
        expected = float((per_row * mask.sum(dim=1)).sum() / mask.sum())  # policy/kl: the masked mean
        num_actions, num_sequences = aggregation_counts(rollout.mask)
        lengths = rollout.mask.to(torch.float64).sum(dim=1)
        _, metrics, _, _ = trainer.learner._micro_loss(rollout, advantages, True, num_actions, num_sequences,
                                                       trainer.plugin.max_actions(), None, lengths)
    assert expected > 1e-6
    assert float(metrics["policy/kl"]) == pytest.approx(expected, rel=1e-4)
