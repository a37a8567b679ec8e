"""DeepSeek-V3.2's unbiased KL estimate (``algorithm.kl_importance_weighted``; arXiv:2512.02556, "Unbiased KL
Estimate"; TRL ``use_bias_correction_kl``): the KL term of each action is multiplied by the policy loss's importance
ratio, with its gradient."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmrl.algos import kl_estimators, log_ratio
from mmrl.config import ConfigError, load_config
from mmrl.trainer import Trainer
from tests.helpers import record_gradients, toy_config, trainable_gradients

BETA = 0.5


def _expected_gradients(tmp_path, loss_name: str, weighted: bool):
    """Run two steps (one micro-batch each, on the sampling weights: ratio 1 in value) and return the second's
    gradient and the gradient of −Σ A·r + β·w·k3 over the active actions / their count, written out here (w = the
    ratio at the loss's level when weighted, else 1). The first step trains on the reference's own weights, where
    k3 and its gradient are 0 and weighting changes nothing; the second starts off the reference."""
    overrides = ["run.max_steps=2", f"algorithm.kl_coef={BETA}", "optim.max_grad_norm=null",
                 f"algorithm.policy_loss.name={loss_name}", f"algorithm.kl_importance_weighted={str(weighted).lower()}"]
    if loss_name == "gspo":  # on-policy the clip is inactive whatever ε: the paper's small ε are fine
        overrides.append("algorithm.aggregation=token_mean")
    trainer = Trainer(toy_config(tmp_path, *overrides))
    policy, plugin = trainer.policy, trainer.plugin
    expected = {}
    collect = trainer.collector.collect
    level = "sequence" if loss_name == "gspo" else "token"  # the policy term's ratio

    calls = []

    def recorded(*args, **kwargs):
        batch = collect(*args, **kwargs)
        calls.append(None)
        if len(calls) == 1:
            return batch
        rollout = batch.rollout.to(trainer.accelerator.device)
        output = plugin.forward(policy, rollout, need_reference=True)
        mask = rollout.mask
        ratio = log_ratio(output.logp, output.logp.detach(), mask, level=level).exp()  # [N, A], 1 in value
        kl = kl_estimators.get("k3")(output.logp, output.ref_logp.float())
        # the KL's weight is the token ratio whatever the loss's level (DeepSeek-V3.2's; TRL's coef_1 is gspo's)
        token_ratio = log_ratio(output.logp, output.logp.detach(), mask).exp()  # [N, A]
        weight = token_ratio if weighted else torch.ones_like(ratio)
        per_action = -batch.advantages.unsqueeze(1) * ratio + BETA * weight * kl
        loss = (per_action * mask).sum() / mask.sum()
        expected.update(trainable_gradients(loss, plugin.model))
        return batch

    trainer.collector.collect = recorded
    steps = record_gradients(trainer, plugin.model)
    trainer.train()
    return steps[1], expected


@pytest.mark.parametrize("loss_name", ["grpo", "gspo", "vespo"])
def test_the_kl_term_carries_the_ratio_and_its_gradient(tmp_path, loss_name):
    for weighted in (True, False):
        got, expected = _expected_gradients(tmp_path / str(weighted), loss_name, weighted)
        assert expected
        for name, grad in expected.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6)


def test_weighting_changes_the_gradient_once_the_policy_left_the_reference(tmp_path):
    # Two steps: after the first the policy differs from the reference, so k3 > 0 and its ratio term k3·∇log π adds
    # a gradient the unweighted KL lacks.
    def second_step(weighted):
        trainer = Trainer(toy_config(tmp_path / str(weighted), "run.max_steps=2", f"algorithm.kl_coef={BETA}",
                                     "optim.max_grad_norm=null",
                                     f"algorithm.kl_importance_weighted={str(weighted).lower()}"))
        steps = record_gradients(trainer, trainer.plugin.model)
        trainer.train()
        return steps[1]

    plain, weighted = second_step(False), second_step(True)
    gap = max(float((weighted[n] - plain[n]).abs().max()) for n in plain)
    scale = max(float(plain[n].abs().max()) for n in plain)
    assert gap > 1e-3 * scale


def test_refusals():
    with pytest.raises(ConfigError, match=r"kl_importance_weighted.*kl_coef"):
        toy_config("/tmp/unused", "algorithm.kl_importance_weighted=true")
    with pytest.raises(ConfigError, match=r"kl_importance_weighted.*k2_seq"):
        toy_config("/tmp/unused", "algorithm.kl_importance_weighted=true", "algorithm.kl_coef=0.1",
                   "algorithm.kl_estimator=k2_seq")
    shapes = str(Path(__file__).resolve().parents[2] / "configs/flow/shapes.yaml")
    with pytest.raises(ConfigError, match=r"kl_importance_weighted.*plugin flow"):
        load_config(shapes, ["algorithm.kl_importance_weighted=true", "algorithm.kl_coef=0.1"])


def test_a_plugins_own_kl_is_refused_at_the_first_step(tmp_path):
    from dataclasses import replace

    from mmrl.rollout import RolloutError

    trainer = Trainer(toy_config(tmp_path, "run.max_steps=1", f"algorithm.kl_coef={BETA}",
                                 "algorithm.kl_importance_weighted=true"))
    forward = trainer.plugin.forward

    def own_kl(*args, **kwargs):
        output = forward(*args, **kwargs)
        return replace(output, kl=torch.zeros_like(output.logp))

    trainer.plugin.forward = own_kl
    with pytest.raises(RolloutError, match=r"kl_importance_weighted.*PolicyOutput.kl"):
        trainer.train()


def test_off_policy_the_kl_term_is_the_unclipped_token_ratio_times_k3(tmp_path):
    """Two mini-batches per rollout: the second trains off-policy (|log r| up to ~0.5 here), where the gradient tests
    above, on the sampling weights (r = 1 in value), cannot see the ratio's value. The logged KL of every backward
    pass must be the masked mean of r·k3 with r = π_θ/π_old unclipped (TRL's coef_1, not the clipped coef_2),
    written out from the learner's own inputs."""
    config = toy_config(tmp_path, "run.max_steps=2", "algorithm.minibatches=2", "algorithm.micro_batch_size=16",
                        f"algorithm.kl_coef={BETA}", "algorithm.kl_importance_weighted=true")
    trainer = Trainer(config)
    learner = trainer.learner
    seen, refs, logged = [], [], []
    loss, estimator, micro = learner.policy_loss, learner.kl_estimator, learner._micro_loss

    def recorded_loss(logp, old_logp, advantages, mask, **options):
        seen.append((logp.detach().clone(), old_logp.clone(), mask.clone()))
        return loss(logp, old_logp, advantages, mask, **options)

    def recorded_kl(logp, ref_logp):
        refs.append(ref_logp.detach().clone())
        return estimator(logp, ref_logp)

    def recorded_micro(*args, **kwargs):
        result = micro(*args, **kwargs)
        logged.append(float(result[1]["policy/kl"]))
        return result

    learner.policy_loss, learner.kl_estimator, learner._micro_loss = recorded_loss, recorded_kl, recorded_micro
    trainer.train()
    assert len(seen) == len(refs) == len(logged) == 4  # 2 steps × 2 mini-batches × 1 micro-batch
    largest = 0.0
    for (logp, old_logp, mask), ref_logp, kl in zip(seen, refs, logged, strict=True):
        ratio = (logp - old_logp).exp()  # [n, A]
        expected = (ratio * kl_estimators.get("k3")(logp, ref_logp) * mask).sum() / mask.sum()
        assert kl == pytest.approx(float(expected), rel=1e-5, abs=1e-8)
        largest = max(largest, float(((logp - old_logp).abs() * mask).max()))
    assert largest > 0.25  # off-policy beyond a clipped ratio's range (1 ± 0.2), which would differ


def _enumerated(level: str | None, theta: torch.Tensor, old: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """E over π_old's two-token sequences of Σ_t w_t·k3_t, w = exp(log_ratio at ``level``) (None: w = 1), on a toy
    whose logits are [1 + V, V]: row 0 the first token's, row 1 + a the second's after a."""
    vocab = theta.shape[1]
    lt, lo, lr = (torch.log_softmax(x, -1) for x in (theta, old, ref))
    first, second = torch.arange(vocab).repeat_interleave(vocab), torch.arange(vocab).repeat(vocab)  # [V²] each

    def columns(logps):  # [V², 2] the log-probs of each sequence's two tokens
        return torch.stack([logps[0, first], logps[1 + first, second]], dim=1)

    logp, old_logp, ref_logp = columns(lt), columns(lo).detach(), columns(lr)
    mask = torch.ones_like(logp)
    weight = 1.0 if level is None else log_ratio(logp, old_logp, mask, level=level).exp()
    per_sequence = (weight * kl_estimators.get("k3")(logp, ref_logp)).sum(dim=1)  # [V²]
    return (old_logp.sum(dim=1).exp() * per_sequence).sum()


def test_the_token_ratio_is_the_unbiased_weight_and_a_sequence_ratio_is_not():
    """The docs' claims, enumerated exactly (no sampling): with actions from π_old, E_old[Σ_t r_t·k3_t] is the KL of
    π_θ to π_ref at each state summed over the tokens (states drawn by π_old), and on policy its gradient is that
    sum's gradient with the states held fixed; the sequence level's geometric-mean ratio (TRL's coef_1 for GSPO)
    gives neither, and neither does no weight."""
    generator = torch.Generator().manual_seed(0)
    theta = torch.randn(4, 3, dtype=torch.float64, generator=generator).requires_grad_()
    old = theta.detach() + 0.4 * torch.randn(4, 3, dtype=torch.float64, generator=generator)
    ref = torch.randn(4, 3, dtype=torch.float64, generator=generator)

    def state_kl(states):  # Σ_t KL(π_θ(·|s_t) ‖ π_ref(·|s_t)), the second state drawn from `states`
        lt, lr = torch.log_softmax(theta, -1), torch.log_softmax(ref, -1)
        rows = (lt.exp() * (lt - lr)).sum(-1)  # [1 + V]
        return rows[0] + (torch.softmax(states, -1)[0] * rows[1:]).sum()

    target = state_kl(old)
    assert float(_enumerated("token", theta, old, ref).detach()) == pytest.approx(float(target.detach()), rel=1e-12)
    for level in ("sequence", None):
        assert abs(float((_enumerated(level, theta, old, ref) - target).detach())) > 1e-2
    exact = torch.autograd.grad(state_kl(theta.detach()), theta)[0]
    token = torch.autograd.grad(_enumerated("token", theta, theta.detach(), ref), theta)[0]
    torch.testing.assert_close(token, exact, rtol=1e-10, atol=1e-12)
    for level in ("sequence", None):
        gradient = torch.autograd.grad(_enumerated(level, theta, theta.detach(), ref), theta)[0]
        assert float((gradient - exact).abs().max()) > 1e-2
