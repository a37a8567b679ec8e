"""``PolicyOutput.aux_loss``: a plugin's model regulariser (the VLM plugin's MoE router load-balancing loss) enters
each optimizer step's gradient as its mean over the step's backward passes on every process (TRL's
``router_aux_loss_coef · aux_loss / gradient_accumulation_steps`` per micro-batch, huggingface/trl@f2cd577
``grpo_trainer.py:3218-3221``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mmrl.trainer import Trainer
from tests.helpers import record_gradients, toy_config

COEF = 0.05


def _run(tmp_path, with_aux):
    """One optimizer step of the toy recipe, 32 samples in micro-batches of 8 (four backward passes); with_aux: the
    plugin's training forwards return aux_loss = COEF · Σ p² over the trainable weights."""
    trainer = Trainer(toy_config(tmp_path, "run.max_steps=1", "algorithm.micro_batch_size=8",
                                 "optim.max_grad_norm=null"))
    plugin = trainer.plugin
    passes = []
    if with_aux:
        forward = plugin.forward

        def with_regulariser(policy, rollout, **kwargs):
            output = forward(policy, rollout, **kwargs)
            if not torch.is_grad_enabled():  # the old-policy pass, if any: no regulariser
                return output
            squares = sum((p ** 2).sum() for p in plugin.model.parameters() if p.requires_grad)
            passes.append({n: p.detach().clone() for n, p in plugin.model.named_parameters() if p.requires_grad})
            return replace(output, aux_loss=COEF * squares)

        plugin.forward = with_regulariser
    steps = record_gradients(trainer, plugin.model)
    history = trainer.train().history
    return steps[0], passes, history[0]


def test_aux_loss_adds_its_mean_over_the_backward_passes_to_the_gradient(tmp_path):
    """Four passes each adding COEF · Σ p²: the step's gradient is the plain one plus 2 · COEF · p (the mean over the
    passes; a sum would give four times that), and loss/aux logs COEF · Σ p²."""
    plain, _, plain_record = _run(tmp_path / "plain", with_aux=False)
    regularised, passes, record = _run(tmp_path / "aux", with_aux=True)
    assert len(passes) == 4
    weights = passes[0]  # one optimizer step: every pass sees the initial weights
    for name, gradient in plain.items():
        torch.testing.assert_close(regularised[name], gradient + 2 * COEF * weights[name], rtol=1e-4, atol=1e-7)
    squares = sum(float((p ** 2).sum()) for p in weights.values())
    assert record["loss/aux"] == pytest.approx(COEF * squares, rel=1e-5)
    assert "loss/aux" not in plain_record
