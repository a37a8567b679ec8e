"""The old policy of the flow plugin's ratio through the trainer: ``algorithm.recompute_old_logp`` (which replaces the
sampler's old log-probs by a pass of the training forward) with and without GRPO-Guard's RatioNorm."""

from __future__ import annotations

import math

import pytest
import torch

from mmrl.plugins.flow.credit.guard import ratio_norm_log_ratio, ratio_norm_logp
from mmrl.plugins.flow.sde import sde_step
from mmrl.trainer import Trainer
from tests.helpers import record_gradients


@pytest.mark.parametrize("credit", [{}, {"ratio_norm": True}], ids=["plain", "ratio_norm"])
def test_recompute_old_logp_with_one_optimizer_step_per_rollout_trains_like_the_sampler_old_logp(
        train_config, tmp_path, credit):
    """μ = 1 and one mini-batch: the learner hands the forward old_logp=None (its training forward is the old
    policy), which the flow forward used to index (TypeError: 'NoneType' object is not subscriptable). It now trains
    exactly as a run that keeps the sampler's old log-probs, which are the same policy: the same gradient. Gradients
    are compared, not the weights after the AdamW step (tests.helpers.record_gradients): the two runs compute the
    gradient along different code paths, and AdamW's first step turns a last-bit difference δ of a small gradient
    into a weight difference of up to lr·δ/eps (2.9e-6 under ATEN_CPU_CAPABILITY=default)."""
    common = ("run.max_steps=1", "eval.save_samples=false")
    plain = Trainer(train_config("sd3", tmp_path / "plain", *common, credit=credit))
    expected = record_gradients(plain, plain.plugin.policy())
    plain.train()
    recomputed = Trainer(train_config("sd3", tmp_path / "recomputed", *common, "algorithm.recompute_old_logp=true",
                                      credit=credit))
    got = record_gradients(recomputed, recomputed.plugin.policy())
    history = recomputed.train().history
    assert history[0]["loss/first_step_ratio_deviation"] == 0.0  # the old policy is the training forward itself
    assert len(expected) == len(got) == 1 and expected[0].keys() == got[0].keys()
    assert any(g.abs().max() > 1e-4 for g in expected[0].values())  # a real gradient, not only rounding noise
    for name in expected[0]:
        torch.testing.assert_close(got[0][name], expected[0][name], rtol=1e-4, atol=1e-6, msg=name)


def _gaussian_logp(x, mean, std):
    """Per-element-mean log N(x; mean, std²), written out: ``[n]``."""
    n = x.shape[0]
    return (-((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)).reshape(n, -1).mean(1)


def _sampler_mismatch(trainer, scale):
    """Training rollouts whose stored means (and old log-probs, consistently) are those of a sampler whose means
    differ from the trainer's by ``scale``·std: a numerical mismatch between the sampling and the training forward."""
    original = trainer.plugin.rollout

    def rollout(policy, batch):
        result = original(policy, batch)
        if batch.training:
            generator = torch.Generator().manual_seed(1)
            replay = result.replay
            for column in range(result.num_actions):
                x, x_next = replay["latents"][:, column], replay["next_latents"][:, column]
                std = sde_step("flow_grpo", torch.zeros_like(x), x, replay["sigmas"][:, column],
                               replay["sigmas_next"][:, column], noise_level=0.7, prev_sample=x_next).std
                mean = replay["means"][:, column] + scale * std * torch.randn(x.shape, generator=generator)
                replay["means"][:, column] = mean
                result.old_logp[:, column] = _gaussian_logp(x_next, mean, std)
        return result

    trainer.plugin.rollout = rollout
    return trainer


def test_ratio_norm_is_one_on_policy_after_recomputing_the_old_policy(train_config, tmp_path):
    """GRPO-Guard's ratio depends on the old means; the recompute pass used to store the normalised log-prob as
    old_logp and keep the sampler's means, so a sampler mismatch of 1e-2·std left max |r − 1| = 2.5e-4 with unchanged
    weights (above a 1e-4 clip range). The recompute now refreshes the means: ratio 1 on policy."""
    common = ("run.max_steps=1", "eval.save_samples=false", "algorithm.minibatches=2", "algorithm.micro_batch_size=4")
    credit = {"ratio_norm": True}
    kept = _sampler_mismatch(Trainer(train_config("sd3", tmp_path / "kept", *common, credit=credit)), 1e-2)
    assert kept.train().history[0]["loss/first_step_ratio_deviation"] > 1e-4  # the mismatch shows without recompute
    recomputed = _sampler_mismatch(Trainer(train_config("sd3", tmp_path / "recomputed", *common,
                                                        "algorithm.recompute_old_logp=true", credit=credit)), 1e-2)
    assert recomputed.train().history[0]["loss/first_step_ratio_deviation"] < 1e-6


def test_ratio_norm_log_ratio_is_the_paper_form_and_reads_only_the_old_means():
    generator = torch.Generator().manual_seed(3)
    n, d = 5, 12
    std = torch.tensor([0.3, 0.05, 0.8, 0.01, 0.0], dtype=torch.float64).reshape(n, 1)
    old_mean = torch.randn(n, d, generator=generator, dtype=torch.float64)
    action = old_mean + std * torch.randn(n, d, generator=generator, dtype=torch.float64)
    mean = (old_mean + 0.02 * torch.randn(n, d, generator=generator, dtype=torch.float64)).requires_grad_(True)
    direct = ratio_norm_log_ratio(action, mean, old_mean, std)
    # s·(ℓ_θ − ℓ_old) + mean(d²)/(2s) with both log-densities exact (GRPO-Guard; Flow-Factory; verl-omni)
    stochastic = std.reshape(n) > 0
    safe = torch.where(std > 0, std, torch.ones_like(std))
    old_logp = _gaussian_logp(action, old_mean, safe)
    paper = ratio_norm_logp(_gaussian_logp(action, mean, safe), old_logp, mean, old_mean, std) - old_logp
    torch.testing.assert_close(direct[stochastic], paper[stochastic], rtol=1e-9, atol=1e-12)
    assert direct[~stochastic].tolist() == [0.0]  # a deterministic step has no ratio
    (grad_direct,) = torch.autograd.grad(direct[stochastic].sum(), mean, retain_graph=True)
    (grad_paper,) = torch.autograd.grad(paper[stochastic].sum(), mean)
    torch.testing.assert_close(grad_direct, grad_paper, rtol=1e-9, atol=1e-12)
    # hand value: mean((x' − μ_old)·(μ − μ_old))/s for the first sample
    expected = ((action[0] - old_mean[0]) * (mean[0] - old_mean[0])).mean() / 0.3
    assert direct[0].item() == pytest.approx(expected.item(), rel=1e-12)
