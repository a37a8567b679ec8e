"""Off-policy sequence masking (``algorithm.off_policy_mask_threshold``; DeepSeek-V3.2 arXiv:2512.02556 eq. (9),
TRL ``off_policy_mask_threshold``)."""

from __future__ import annotations

import pytest
import torch

import mmrl.trainer.learn as learn
from mmrl.algos.token_selection import off_policy_sequence_mask
from mmrl.config import ConfigError
from mmrl.trainer import Trainer
from tests.helpers import record_gradients, toy_config


def trl_keep(advantages, per_token_logps, sampling_logps, mask, threshold):
    """huggingface/trl@f2cd577 grpo_trainer.py:2920-2940 (``get_off_policy_mask``), restated: [B, 1] keep."""
    kl = sampling_logps - per_token_logps
    average = (kl * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages.unsqueeze(1) >= 0) | (average <= threshold)).float()


def test_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0], [-0.5, -0.5, -0.5]])
    old = torch.tensor([[-0.5, -1.5, -9.0], [-0.4, -1.0, 5.0], [-1.0, -0.5, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # row means of old − logp over the active actions: 0.5, 0.3 (padding's 5.0 and −6.0 never count), −1/6
    keep, divergence = off_policy_sequence_mask(logp, old, torch.tensor([-1.0, -1.0, -1.0]), mask, 0.4)
    torch.testing.assert_close(divergence, torch.tensor([0.5, 0.3, -1 / 6]))
    assert keep.tolist() == [[False, False, False], [True, True, False], [True, True, True]]
    # a positive advantage keeps its row whatever the divergence; δ equal to the mean keeps it (TRL: KL <= δ)
    keep, _ = off_policy_sequence_mask(logp, old, torch.tensor([1.0, -1.0, -1.0]), mask, 0.5)
    assert keep.tolist() == [[True, True, False], [True, True, False], [True, True, True]]
    # per-action advantages: the row's one mean, each action's own sign
    keep, _ = off_policy_sequence_mask(logp, old, torch.tensor([[1.0, -1.0, -1.0]] * 3), mask, 0.0)
    assert keep.tolist() == [[True, False, False], [True, False, False], [True, True, True]]


def test_trls_mask_written_out_agrees():
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        logp = -torch.rand(7, 11, generator=generator) * 3
        old = logp + torch.randn(7, 11, generator=generator) * 0.4
        mask = (torch.rand(7, 11, generator=generator) > 0.3).float()
        mask[0] = 0.0  # a row with no active action: divergence 0, kept (and masked out anyway)
        advantages = torch.randn(7, generator=generator)
        for threshold in (0.0, 0.05, 0.2):
            keep, _ = off_policy_sequence_mask(logp, old, advantages, mask, threshold)
            expected = trl_keep(advantages, logp, old, mask, threshold).expand_as(mask).bool() & (mask > 0)
            assert torch.equal(keep, expected)


def test_on_policy_nothing_is_dropped():
    logp = -torch.rand(5, 6) * 2
    keep, divergence = off_policy_sequence_mask(logp, logp.clone(), -torch.ones(5), torch.ones(5, 6), 0.0)
    assert keep.all() and torch.equal(divergence, torch.zeros(5))


def _run(tmp_path, monkeypatch, keep_rule=None, *overrides):
    """A short off-policy run (two mini-batches per rollout), with the learner's mask replaced by ``keep_rule``
    (None: the real one); returns the gradients of each optimizer step and the history."""
    config = toy_config(tmp_path, "run.max_steps=2", "algorithm.minibatches=2", "algorithm.micro_batch_size=16",
                        "optim.max_grad_norm=null", *overrides)
    trainer = Trainer(config)
    if keep_rule is not None:
        real = learn.off_policy_sequence_mask

        def replaced(logp, old_logp, advantages, mask, threshold):
            keep, divergence = real(logp, old_logp, advantages, mask, threshold)
            return keep_rule(keep, mask), divergence

        monkeypatch.setattr(learn, "off_policy_sequence_mask", replaced)
    steps = record_gradients(trainer, trainer.plugin.model)
    history = trainer.train().history
    monkeypatch.undo()
    return steps, history


def test_the_mask_scales_the_policy_term_only(tmp_path, monkeypatch):
    baseline, _ = _run(tmp_path / "plain", monkeypatch)
    everything, history = _run(tmp_path / "all", monkeypatch, lambda keep, mask: mask > 0,
                               "algorithm.off_policy_mask_threshold=0")
    for step, expected in zip(everything, baseline, strict=True):
        for name, grad in expected.items():
            torch.testing.assert_close(step[name], grad, rtol=1e-5, atol=1e-7)
    assert history[0]["policy/off_policy_masked_fraction"] == 0.0
    # nothing kept: the policy term has no gradient, the KL term keeps its own
    nothing, history = _run(tmp_path / "none", monkeypatch, lambda keep, mask: torch.zeros_like(keep),
                            "algorithm.off_policy_mask_threshold=0")
    assert all(float(g.abs().max()) == 0.0 for step in nothing for g in step.values())
    assert history[0]["policy/off_policy_masked_fraction"] == 1.0
    # the first mini-batch trains, the later ones keep nothing: their gradient is the KL term's alone (the policy
    # has moved from the reference), and zero without it
    calls = []

    def first_only(keep, mask):
        calls.append(None)
        return mask > 0 if len(calls) == 1 else torch.zeros_like(keep)

    kl_only, _ = _run(tmp_path / "kl", monkeypatch, first_only, "algorithm.off_policy_mask_threshold=0",
                      "algorithm.kl_coef=0.5")
    assert len(calls) == 4 and max(float(g.abs().max()) for g in kl_only[1].values()) > 1e-4
    calls.clear()
    policy_only, _ = _run(tmp_path / "no_kl", monkeypatch, first_only, "algorithm.off_policy_mask_threshold=0")
    assert all(float(g.abs().max()) == 0.0 for step in policy_only[1:] for g in step.values())


def test_the_entropy_bonus_keeps_the_masked_actions(tmp_path, monkeypatch):
    # TRL f2cd577 L3156-3158: the entropy bonus's mask is the completion mask times the entropy mask only, not the
    # off-policy mask. Nothing kept and no KL: the bonus alone moves the weights.
    everything_masked, _ = _run(tmp_path, monkeypatch, lambda keep, mask: torch.zeros_like(keep),
                                "algorithm.off_policy_mask_threshold=0", "algorithm.entropy_coef=0.01")
    assert all(max(float(g.abs().max()) for g in step.values()) > 1e-6 for step in everything_masked)


def test_the_learner_masks_what_trl_would(tmp_path):
    # δ = 0 on the off-policy second mini-batch: the learner's masked share equals TRL's rule on the same inputs.
    config = toy_config(tmp_path, "run.max_steps=3", "algorithm.minibatches=2", "algorithm.micro_batch_size=16",
                        "algorithm.off_policy_mask_threshold=0")
    trainer = Trainer(config)
    seen = []
    loss = trainer.learner.policy_loss

    def recorded(logp, old_logp, advantages, mask, **options):
        seen.append((logp.detach().clone(), old_logp.clone(), advantages.clone(), mask.clone()))
        return loss(logp, old_logp, advantages, mask, **options)

    trainer.learner.policy_loss = recorded
    fractions = []
    metrics_of = trainer.learner._micro_loss

    def micro(*args, **kwargs):
        result = metrics_of(*args, **kwargs)
        fractions.append(float(result[1]["policy/off_policy_masked_fraction"]))
        return result

    trainer.learner._micro_loss = micro
    trainer.train()
    assert len(seen) == len(fractions) == 6
    for (logp, old, advantages, mask), fraction in zip(seen, fractions, strict=True):
        keep = trl_keep(advantages, logp, old, mask, 0.0).expand_as(mask) * mask
        assert fraction == pytest.approx(1 - float(keep.sum() / mask.sum()), abs=1e-6)
    assert max(fractions) > 0  # the off-policy mini-batches drop some of their negative samples


def test_refused_with_action_chunks_and_below_zero():
    with pytest.raises(ConfigError, match=r"off_policy_mask_threshold.*action_chunk_size"):
        toy_config("/tmp/unused", "algorithm.off_policy_mask_threshold=0.5", "algorithm.action_chunk_size=1")
    with pytest.raises(ConfigError, match=r"off_policy_mask_threshold"):
        toy_config("/tmp/unused", "algorithm.off_policy_mask_threshold=-0.1")
