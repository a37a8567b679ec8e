"""How the dLLM plugin scores completions for the core's losses (issue 21): token columns and the length weighting
of algorithm.aggregation, per-token (one_step, d1) against sequence (ELBO) ratios, mask plans redrawn per inner
epoch, classifier-free guidance in scoring. Toy checkpoint, CPU."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from mmrl.algos.aggregation import aggregate
from mmrl.algos.policy_losses import policy_losses
from mmrl.config import load_config
from mmrl.plugin import PromptBatch, Runtime, plugin_registry
from mmrl.trainer.learn import old_policy_pass

torch.set_num_threads(1)


def _plugin(runtime: Runtime | None = None, **plugin):
    data = {"plugin": {"name": "dllm", "train_size": 64, "eval_size": 16, **plugin},
            "rewards": {"functions": [{"name": "gsm8k_answer"}]}}
    return plugin_registry.get("dllm")(load_config(data).plugin.config, runtime or Runtime())


def _scored(plugin, rollout, policy=None):
    """The rollout with the old log-probs a training run uses: the dLLM plugin leaves them out and the core scores
    them with the plugin's forward under no_grad (mmrl.trainer.learn.old_policy_pass)."""
    return old_policy_pass(plugin, policy if policy is not None else plugin.policy(), rollout)


def _batch(rows, seeds):
    return PromptBatch(rows=rows, group_ids=torch.arange(len(rows)) // 2, group_size=2, seeds=torch.tensor(seeds),
                       generator=torch.Generator())


def _rows(plugin, count):
    return plugin.dataset("train")[:count]


def test_length_weighting_follows_the_aggregation():
    """ELBO estimators at ratio 1: the gradient of the aggregated GRPO loss is Σ_i c_i ∇ELBO_i with c_i = −A_i/T
    (token_mean, T the step's tokens: d1), −A_i/(S·L_i) (seq_mean_token_mean: the old hard-coded 1/|o|) or
    −A_i/(S·G) (seq_mean_token_sum_norm: Dr.GRPO's constant), S the sequences and L_i the real tokens of each."""
    plugin = _plugin(estimator="coupled", num_mc_samples=2)
    policy = plugin.policy()
    rollout = _scored(plugin, plugin.rollout(policy, _batch(_rows(plugin, 8), list(range(20, 28)))), policy)
    lengths = rollout.mask.sum(1).double()
    assert len(set(lengths.tolist())) > 1  # completions of different lengths, or the modes would agree
    advantages = torch.linspace(-1.0, 1.2, len(lengths))
    params = [p for p in policy.parameters() if p.requires_grad]
    total, count, width = float(lengths.sum()), float(len(lengths)), float(plugin.max_actions())
    for mode, coefficient in (("token_mean", -advantages / total),
                              ("seq_mean_token_mean", -advantages / (count * lengths.float())),
                              ("seq_mean_token_sum_norm", -advantages / (count * width))):
        logp = plugin.forward(policy, rollout, need_reference=False).logp
        per_action, _ = policy_losses.get("grpo")(logp, rollout.old_logp, advantages, rollout.mask)
        loss = aggregate(per_action, rollout.mask, mode, max_actions=width)
        got = torch.autograd.grad(loss, params, retain_graph=True)
        expected = torch.autograd.grad((coefficient * logp.sum(1)).sum(), params)  # logp.sum(1): the ELBO estimates
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-7, msg=mode)


def test_one_step_ratio_is_per_token_and_elbo_ratios_are_per_sequence():
    for estimator, options in (("one_step", {}), ("coupled", {"num_mc_samples": 2})):
        plugin = _plugin(estimator=estimator, **options)
        rollout = _scored(plugin, plugin.rollout(plugin.policy(), _batch(_rows(plugin, 6), [1, 2, 3, 4, 5, 6])))
        moved = copy.deepcopy(plugin.policy())
        with torch.no_grad():
            for p in moved.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        logp = plugin.forward(moved, rollout, need_reference=False).logp
        real = rollout.mask.bool()
        log_ratio = (logp - rollout.old_logp).masked_fill(~real, float("nan"))  # [N, G]
        spread = (log_ratio.nan_to_num(0.0).amax(1) - log_ratio.nan_to_num(0.0).amin(1))[real.sum(1) > 1]
        if estimator == "one_step":  # d1: each token has its own ratio
            assert (spread > 1e-4).any()
        else:  # every token carries exp((ELBO_θ − ELBO_old) / L)
            sequence = (logp.sum(1) - rollout.old_logp.sum(1)) / real.sum(1)
            torch.testing.assert_close(torch.where(real, log_ratio, 0.0),
                                       torch.where(real, sequence.unsqueeze(1).expand_as(logp), 0.0),
                                       rtol=0, atol=1e-6)


def test_llada_recipe_uses_d1_per_token_numbers():
    """configs/dllm/llada8b_gsm8k_lora.yaml: d1's per-token clip 0.5 and β 0.04 (k3) apply to one_step's per-token
    ratio, averaged over the step's tokens (diffu_grpo_trainer.py L114-121), with d1's training settings
    (slurm_scripts/train.yaml)."""
    config = load_config(Path(__file__).resolve().parents[2] / "configs" / "dllm" / "llada8b_gsm8k_lora.yaml")
    plugin, algorithm = config.plugin.config, config.algorithm
    assert plugin.resolved_estimator == "one_step" and plugin.per_token
    assert plugin.estimator_options["p_mask_prompt"] == pytest.approx(0.15) and plugin.num_mc_samples == 1
    assert plugin.redraw_masks  # a new prompt mask per inner iteration (d1's random_masking: True)
    options = algorithm.policy_loss.options
    assert algorithm.policy_loss.name == "grpo" and options.get("ratio_level", "token") == "token"
    assert options["clip_low"] == options["clip_high"] == pytest.approx(0.5)
    assert algorithm.kl_coef == pytest.approx(0.04) and algorithm.kl_estimator == "k3"
    assert algorithm.aggregation == "token_mean" and algorithm.advantage.name == "dr_grpo"
    assert algorithm.inner_epochs == 12
    assert (plugin.gen_length, plugin.block_length, plugin.steps, plugin.max_prompt_length) == (256, 32, 128, 200)
    assert plugin.temperature == pytest.approx(0.9)
    assert (config.rollout.group_size, config.optim.lr, config.optim.max_grad_norm) == (6, 3e-6, 0.2)


def test_plans_are_redrawn_per_inner_epoch_and_shared_by_policy_old_and_reference():
    """μ = 3, one_step with prompt masking (d1/wd1 redraw the prompt masks every inner iteration): three plans per
    sample; epoch e's forward scores plan e and hands back π_ref on plan e (scored at rollout time); π_old is the
    core's (the rollout leaves it out, and the plugin declares redraws_per_epoch so the core scores every plan)."""
    plugin = _plugin(Runtime(needs_reference=True, inner_epochs=3), estimator="one_step", num_mc_samples=1,
                     estimator_options={"p_mask_prompt": 0.5})
    policy = plugin.policy()
    rows = _rows(plugin, 6)
    rollout = plugin.rollout(policy, _batch(rows, [11, 12, 13, 14, 15, 16]))
    replay = rollout.replay
    prompt_masks = replay["plan_prompt_masked"]  # [N, 3, 1, w]
    assert prompt_masks.shape[:3] == (6, 3, 1) and replay["epoch_ref_logp"].shape == (6, 3, plugin.max_actions())
    assert rollout.old_logp is None and "epoch_old_logp" not in replay and plugin.redraws_per_epoch
    assert not torch.equal(prompt_masks[:, 0], prompt_masks[:, 1]) and not torch.equal(prompt_masks[:, 1],
                                                                                       prompt_masks[:, 2])
    # Plan 0 is the plan a single-plan run draws from the same seeds.
    single = _plugin(estimator="one_step", num_mc_samples=1, estimator_options={"p_mask_prompt": 0.5})
    assert torch.equal(single.rollout(single.policy(), _batch(rows, [11, 12, 13, 14, 15, 16]))
                       .replay["plan_prompt_masked"][:, 0], prompt_masks[:, 0])
    prompt, completion = replay["prompt_ids"], replay["completion_ids"]
    real = replay["completion_mask"].bool()
    for epoch in range(3):
        plugin.start_inner_epoch(epoch)
        out = plugin.forward(policy, rollout, need_reference=False)
        # Independent one-step forward with epoch e's prompt mask (d1's forward_process with that epoch's seed).
        masked_prompt = torch.where(prompt_masks[:, epoch, 0], plugin.adapter.mask_id, prompt)
        inputs = torch.cat([masked_prompt, torch.full_like(completion, plugin.adapter.mask_id)], dim=1)
        with torch.no_grad():
            logits = plugin.adapter.logits(plugin.model, inputs)[:, prompt.shape[1]:]
        expected = logits.log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(out.logp.detach(), torch.where(real, expected, 0.0), rtol=0, atol=1e-5)
        ref = rollout.ref_logp if epoch == 0 else out.ref_logp  # epoch 0: the rollout's own
        assert torch.equal(ref, replay["epoch_ref_logp"][:, epoch])
        torch.testing.assert_close(out.logp.detach(), ref, rtol=0, atol=1e-6)  # no training yet: the reference
    with pytest.raises(RuntimeError, match="inner epoch 3"):
        plugin.start_inner_epoch(3)
        plugin.forward(policy, rollout, need_reference=False)
    # redraw_masks false, or a deterministic plan: one plan for every epoch.
    for options in ({"redraw_masks": False, "estimator_options": {"p_mask_prompt": 0.5}}, {}):
        once = _plugin(Runtime(inner_epochs=3), estimator="one_step", num_mc_samples=1, **options)
        kept = once.rollout(once.policy(), _batch(rows[:2], [1, 2]))
        assert kept.replay["plan_masked"].shape[1] == 1 and not once.redraws_per_epoch


def test_classifier_free_guidance_is_applied_when_scoring():
    """cfg_scale s > 0 decodes with guided logits un + (s+1)(cond − un); the policy, π_old and the reference are
    scored with the same guidance (d1's get_logits), so the scored policy is the sampled one. Independent check on
    the one-step columns: two forwards by hand, the unconditional one with the real prompt tokens masked."""
    scale = 1.5
    plugin = _plugin(Runtime(needs_reference=True), estimator="one_step", cfg_scale=scale)
    policy = plugin.policy()
    rollout = _scored(plugin, plugin.rollout(policy, _batch(_rows(plugin, 4), [3, 4, 5, 6])), policy)
    prompt, completion = rollout.replay["prompt_ids"], rollout.replay["completion_ids"]
    real = rollout.replay["completion_mask"].bool()
    mask_id, pad_id = plugin.adapter.mask_id, plugin.adapter.pad_id
    masked_completion = torch.full_like(completion, mask_id)
    conditional = torch.cat([prompt, masked_completion], dim=1)
    unconditional = torch.cat([torch.where(prompt != pad_id, mask_id, prompt), masked_completion], dim=1)
    with torch.no_grad():
        cond = plugin.adapter.logits(plugin.model, conditional)[:, prompt.shape[1]:]
        uncond = plugin.adapter.logits(plugin.model, unconditional)[:, prompt.shape[1]:]
        unguided = cond.log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        guided = (uncond + (scale + 1) * (cond - uncond)).log_softmax(-1)
    expected = guided.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(rollout.old_logp, torch.where(real, expected, 0.0), rtol=0, atol=1e-5)
    assert not torch.allclose(rollout.old_logp, torch.where(real, unguided, 0.0), atol=1e-3)
    torch.testing.assert_close(rollout.ref_logp, rollout.old_logp, rtol=0, atol=0)  # the reference is guided too
    out = plugin.forward(policy, rollout, need_reference=True)
    torch.testing.assert_close(out.logp.detach(), rollout.old_logp, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.ref_logp, rollout.ref_logp, rtol=0, atol=1e-6)
