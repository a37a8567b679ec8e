"""Shared inputs of the policy-loss tests: off-policy log-probs with garbage in the padding."""

from __future__ import annotations

import torch


def off_policy_inputs(mask: torch.Tensor, seed: int, *, per_action: bool = False, spread: float = 0.6,
                      log_prob_span: float = 2.0, advantage_scale: float = 1.0, zero_advantage: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, old_logp, advantages)`` in float64 for a ``[N, A]`` ``mask``: old log-probs in (−span, 0), current
    ones off them by ``spread``·N(0, 1) per action (ratios well off 1, some past every clip bound used in the tests),
    large garbage in the padding of both (a loss that reads it shows), advantages ``[N]`` (or ``[N, A]`` with
    ``per_action``) of both signs scaled by ``advantage_scale``, one of them exactly 0 with ``zero_advantage``.
    ``logp`` requires grad."""
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(mask.shape, generator=generator, dtype=torch.float64) * log_prob_span
    new = old + spread * torch.randn(mask.shape, generator=generator, dtype=torch.float64)
    garbage = 50.0 * torch.randn(mask.shape, generator=generator, dtype=torch.float64)
    new = torch.where(mask > 0, new, garbage)
    old = torch.where(mask > 0, old, -garbage.abs())
    shape = mask.shape if per_action else mask.shape[:1]
    adv = advantage_scale * torch.randn(shape, generator=generator, dtype=torch.float64)
    if zero_advantage:
        adv[(0, 1) if per_action else 3] = 0.0
    return new.requires_grad_(True), old, adv


def check_off_policy_run(config, expected_metrics) -> None:
    """Train ``config`` (two inner epochs of two mini-batches: the later updates off-policy) and check each step:
    ratio 1 on the first mini-batch, every one of the loss's ``expected_metrics`` (names under ``policy/``) logged
    and finite, and the last step's ratios off 1."""
    import math

    from mmrl.trainer import Trainer

    history = Trainer(config).train().history
    for record in history:
        assert record["loss/first_step_ratio_deviation"] < 1e-5
        for key in expected_metrics:
            assert math.isfinite(record[f"policy/{key}"]), key
    assert history[-1]["policy/ratio_max"] > 1.0 + 1e-4
