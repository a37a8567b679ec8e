"""DGPO (``plugin.likelihood: dgpo``, ``algorithm.policy_loss: dgpo``) on the tiny SD3 pipeline.

Every expected value is restated here from the released code (Luo-Yihong/DGPO@01ceb4b, ``scripts/train_sd3_dgpo.py``,
"L" below): x_t, the target and dsm (L1098-1132), the conditional trained velocity and the reference with its LoRA off
(L1109-1120, L290-330), the group loss (L162-193), the PPO-style clip against the fast EMA (L1116-1144), the EMA
reference (L1122-1124), the KL (L1150-1156), the fast EMA's decay (L1175-1177, ``flow_grpo/ema.py`` L32-43) and its
sampling (L799-800); the velocities come from direct transformer calls, not from the plugin's scoring.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mmrl.config import ConfigError, from_dict
from mmrl.plugin import Runtime
from mmrl.plugins.flow.plugin import FlowPluginConfig
from mmrl.seeding import derive_seed
from mmrl.trainer import Trainer
from tests.flow.conftest import plugin_options, prompt_batch

# the documented contract: a group's noise seed is derive_seed(run seed, 0xD691, group id), and ε of (epoch, time k)
# is randn from derive_seed(that seed, 0xA3E2, epoch, k) (matching.column_noise's stream)
GROUP_TAG, NOISE_TAG = 0xD691, 0xA3E2
SMALL = {"num_times": 2, "trunc_steps": 2}  # 4-step grid of the tiny runs


def _dgpo(make_plugin, runtime=None, **dgpo):
    return make_plugin("sd3", runtime or Runtime(needs_reference=True), likelihood="dgpo", dgpo={**SMALL, **dgpo})


def _randomise(parameters, seed, scale):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in parameters:
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=generator) * scale)


def _group_noise(run_seed, group_ids, epoch, k, shape):
    rows = []
    for group in group_ids.tolist():
        seed = derive_seed(derive_seed(run_seed, GROUP_TAG, int(group)), NOISE_TAG, epoch, k)
        rows.append(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))
    return torch.stack(rows)


def _transformer_velocity(policy, x_t, model_t, conditioning, negative=None, scale=1.0):
    """v(x_t, t) of the transformer called directly: the conditional one (``predict_v(..., cfg=False)``, L312-321),
    or with ``negative`` classifier-free guidance at ``scale`` (L297-311)."""
    def call(prompt, pooled):
        return policy(hidden_states=x_t, timestep=model_t, encoder_hidden_states=prompt, pooled_projections=pooled,
                      return_dict=False)[0].float()

    cond = call(conditioning["prompt_embeds"], conditioning["pooled_prompt_embeds"])
    if negative is None:
        return cond
    n = x_t.shape[0]
    uncond = call(negative["prompt_embeds"].expand(n, -1, -1), negative["pooled_prompt_embeds"].expand(n, -1))
    return uncond + scale * (cond - uncond)


def _with_weights(policy, values):
    """A context: ``values`` (name → tensor) copied into the policy's parameters, the originals put back."""
    class Swap:
        def __enter__(self):
            parameters = dict(policy.named_parameters())
            self.kept = {name: parameters[name].detach().clone() for name in values}
            with torch.no_grad():
                for name, value in values.items():
                    parameters[name].copy_(value)

        def __exit__(self, *exc):
            parameters = dict(policy.named_parameters())
            with torch.no_grad():
                for name, value in self.kept.items():
                    parameters[name].copy_(value)

    return Swap()


def _base_weights(policy):
    """The reference: every LoRA B zero, so the adapter adds nothing (the LoRA-off base model, L1111)."""
    return {name: torch.zeros_like(p) for name, p in policy.named_parameters() if "lora_B" in name}


def _inputs(plugin, rollout, epoch=0):
    """Per trained column: (σ, model timestep, ε, x_t) restated from the replay's grid steps and the noise contract."""
    replay = rollout.replay
    clean = replay["clean_latents"]
    sigmas, timesteps = plugin.sampler.training_schedule()
    out = []
    for k in range(replay["dgpo_steps"].shape[2]):
        step = replay["dgpo_steps"][:, epoch, k]
        t, model_t = sigmas[step], timesteps[step]  # L1099-1100: σ = t/1000 of the grid step
        noise = _group_noise(0, rollout.group_ids, epoch, k, tuple(clean.shape[1:]))
        x_t = (1 - t.view(-1, 1, 1, 1)) * clean + t.view(-1, 1, 1, 1) * noise  # L1106
        out.append((t, model_t, noise, x_t))
    return out


def _dsm(velocity, noise, clean):
    return ((noise - clean).double() - velocity.double()).pow(2).mean(dim=(1, 2, 3))  # L1132


@pytest.mark.parametrize("kl_cfg", [1.0, 3.0])
def test_columns_are_negated_dsm_of_the_conditional_velocity_with_the_reference(make_plugin, kl_cfg):
    plugin = _dgpo(make_plugin, kl_cfg=kl_cfg)
    assert plugin.cfg and plugin.sampler.guidance_scale != 1.0  # rollouts use CFG; the trained velocity must not
    policy = plugin.policy()
    _randomise(policy.named_parameters(), 0, 0.3)
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog"], 2))
    output = plugin.forward(policy, rollout, need_reference=True)
    clean, conditioning = rollout.replay["clean_latents"], rollout.replay["conditioning"]
    negative = plugin.sampler.negative_conditioning() if kl_cfg > 1 else None
    assert output.logp.shape == output.ref_logp.shape == output.kl.shape == (4, 2) and rollout.old_logp is None
    with torch.no_grad():
        for k, (_, model_t, noise, x_t) in enumerate(_inputs(plugin, rollout)):
            v = _transformer_velocity(policy, x_t, model_t, conditioning)
            with _with_weights(policy, _base_weights(policy)):
                v_ref = _transformer_velocity(policy, x_t, model_t, conditioning, negative, kl_cfg)
            torch.testing.assert_close(output.logp[:, k].double(), -_dsm(v, noise, clean), rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(output.ref_logp[:, k].double(), -_dsm(v_ref, noise, clean), rtol=1e-5,
                                       atol=1e-7)
            kl = (v.double() - v_ref.double()).pow(2).mean(dim=(1, 2, 3))  # L1151
            assert float(kl.min()) > 1e-6
            torch.testing.assert_close(output.kl[:, k].double(), kl, rtol=1e-5, atol=1e-9)
    assert output.logp.requires_grad and not output.ref_logp.requires_grad


def test_noise_is_shared_within_a_group_and_times_by_the_step(make_plugin):
    """ε recovered from the forwards' x_t: equal within a group, different across groups, times and inner epochs
    (L76-108); the M grid steps are distinct, among 0..trunc_steps, the same for every sample of a step and for every
    rollout batch of it, and drawn anew per inner epoch (L1062-1064)."""
    plugin = _dgpo(make_plugin, Runtime(inner_epochs=2, needs_reference=True), num_times=2, trunc_steps=3)
    policy = plugin.policy()
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog"], 2))
    other = plugin.rollout(policy, prompt_batch(["a red car"], 2, first_group=7, first_seed=300))  # the same step
    steps = rollout.replay["dgpo_steps"]  # [4, E, M]
    assert plugin.redraws_per_epoch and steps.shape == (4, 2, 2)
    assert bool((steps == steps[:1]).all()) and torch.equal(other.replay["dgpo_steps"][0], steps[0])
    assert all(len(set(draw)) == 2 and max(draw) <= 3 for draw in steps[0].tolist())
    assert not torch.equal(steps[0, 0], steps[0, 1])
    later = [plugin.rollout(policy, dataclasses.replace(prompt_batch(["a cat"], 2), step=s)).replay["dgpo_steps"][0]
             for s in (1, 2, 3)]
    assert any(not torch.equal(draw, steps[0]) for draw in later)
    clean = rollout.replay["clean_latents"]
    sigmas = plugin.sampler.training_schedule()[0]
    recovered = {}
    for epoch in range(2):
        plugin.start_inner_epoch(epoch)
        calls = []
        original = plugin.sampler.velocity

        def velocity(module, latents, timesteps, conditioning, guidance_scale, *, phase, calls=calls, f=original):
            calls.append(latents.detach().clone())
            return f(module, latents, timesteps, conditioning, guidance_scale, phase=phase)

        plugin.sampler.velocity = velocity
        plugin.forward(policy, rollout, need_reference=False)
        plugin.sampler.velocity = original
        for k in range(2):
            t = sigmas[steps[:, epoch, k]].view(-1, 1, 1, 1)
            recovered[epoch, k] = (calls[k] - (1 - t) * clean) / t  # [4, *latent]: ε of each row
    for (epoch, k), noise in recovered.items():
        torch.testing.assert_close(noise[0], noise[1], rtol=0, atol=1e-4)  # group 0 (x_t is float32, ÷ σ)
        torch.testing.assert_close(noise[2], noise[3], rtol=0, atol=1e-4)  # group 1
        assert float((noise[0] - noise[2]).abs().max()) > 0.1
        expected = _group_noise(0, rollout.group_ids, epoch, k, tuple(clean.shape[1:]))
        torch.testing.assert_close(noise, expected, rtol=0, atol=1e-4)
    assert float((recovered[0, 0] - recovered[0, 1]).abs().max()) > 0.1  # across times
    assert float((recovered[0, 0] - recovered[1, 0]).abs().max()) > 0.1  # across inner epochs



def _recovered_noise(plugin, policy, rollout, epoch=0):
    """ε of every column as the training forward sees it: each velocity call's x_t, minus (1 − σ)·x₀, over σ."""
    calls = []
    original = plugin.sampler.velocity

    def velocity(module, latents, timesteps, conditioning, guidance_scale, *, phase):
        calls.append(latents.detach().clone())
        return original(module, latents, timesteps, conditioning, guidance_scale, phase=phase)

    plugin.start_inner_epoch(epoch)
    plugin.sampler.velocity = velocity
    try:
        plugin.forward(policy, rollout, need_reference=False)
    finally:
        plugin.sampler.velocity = original
    clean, steps = rollout.replay["clean_latents"], rollout.replay["dgpo_steps"]
    sigmas = plugin.sampler.training_schedule()[0]
    return [(x_t - (1 - sigmas[steps[:, epoch, k]].view(-1, 1, 1, 1)) * clean) / sigmas[steps[:, epoch, k]].view(
        -1, 1, 1, 1) for k, x_t in enumerate(calls)]


def test_the_time_draw_is_upstreams_random_sample_of_steps_0_to_trunc_steps():
    """``random.sample(range(trunc_steps + 1), M)`` (L1062-1064): M distinct steps, every step 0..trunc_steps
    (both ends included) drawn with probability M / (trunc_steps + 1), in a random order."""
    from mmrl.plugins.flow.dgpo import draw_steps

    trunc, m, steps = 3, 2, 400
    draws = torch.cat([draw_steps(5, step, 2, m, trunc) for step in range(steps)])  # [2·steps, M]
    assert all(len(set(row)) == m for row in draws.tolist())
    counts = torch.bincount(draws.flatten(), minlength=trunc + 1)
    expected = draws.numel() / (trunc + 1)  # 400 per step; binomial sd ≈ 17
    assert counts.numel() == trunc + 1 and bool(((counts - expected).abs() < 80).all()), counts.tolist()
    firsts = torch.bincount(draws[:, 0], minlength=trunc + 1)  # the order is random too (the first column uniform)
    assert bool(((firsts - draws.shape[0] / (trunc + 1)).abs() < 60).all()), firsts.tolist()


def test_the_fast_ema_moves_once_per_training_step_over_its_rollout_batches(make_plugin):
    """A training step samples several rollout batches (``rollout.batch_size``; the recipe's 48 local samples in
    batches of 12); upstream moves the EMA once per optimizer step (L1175-1177), so the second batch of a step must
    score the same EMA as the first."""
    plugin = _dgpo(make_plugin, ema_ref=True)
    policy = plugin.policy()
    trained = {name: p for name, p in policy.named_parameters() if p.requires_grad}
    _randomise(policy.named_parameters(), 0, 0.3)
    plugin.rollout(policy, prompt_batch(["a cat"], 2))  # step 0: a copy of θ₀
    _randomise(policy.named_parameters(), 1, 0.3)
    theta_1 = {name: p.detach().clone() for name, p in trained.items()}
    plugin.rollout(policy, dataclasses.replace(prompt_batch(["a cat"], 2), step=1))  # d = 0: the EMA is θ₁
    _randomise(policy.named_parameters(), 2, 0.3)
    theta_2 = {name: p.detach().clone() for name, p in trained.items()}
    first = plugin.rollout(policy, dataclasses.replace(prompt_batch(["a cat"], 2), step=2))  # d = 0.001
    second = plugin.rollout(policy, dataclasses.replace(prompt_batch(["a dog"], 2, first_group=1, first_seed=200),
                                                        step=2))  # the same step's next rollout batch
    for name, value in plugin.dgpo.ema.items():
        torch.testing.assert_close(value, 0.001 * theta_1[name] + 0.999 * theta_2[name], rtol=1e-6, atol=1e-7)
    assert plugin.dgpo.ema_step == 2
    ema = {name: 0.001 * theta_1[name] + 0.999 * theta_2[name] for name in theta_1}
    with torch.no_grad(), _with_weights(policy, ema):  # both batches' old log-probs are that EMA's
        for rollout in (first, second):
            torch.testing.assert_close(rollout.old_logp, plugin.forward(policy, rollout, need_reference=False).logp,
                                       rtol=1e-5, atol=1e-7)


def test_a_groups_noise_follows_its_run_wide_id_not_its_place_in_the_batch(make_plugin):
    """The group ids of a step are unique over the run (the prompt stream's positions), so keying ε on them draws
    fresh noise at every step, as upstream's ``torch.randn`` per call (L95); keying on the group's place in the
    rollout batch would give the first group of every step the same ε."""
    plugin = _dgpo(make_plugin)
    policy = plugin.policy()
    late = plugin.rollout(policy, dataclasses.replace(prompt_batch(["a cat", "a dog"], 2, first_group=7), step=3))
    shape = tuple(late.replay["clean_latents"].shape[1:])
    for k, noise in enumerate(_recovered_noise(plugin, policy, late)):
        torch.testing.assert_close(noise, _group_noise(0, late.group_ids, 0, k, shape), rtol=0, atol=1e-4)
        first_place = _group_noise(0, torch.zeros(1, dtype=torch.long), 0, k, shape)[0]
        assert float((noise[0] - first_place).abs().max()) > 0.1

def _upstream_loss(plugin, policy, rollout, advantages, *, beta_dpo, kl_beta, clip_range, use_ema_ref):
    """One training micro-batch of L1089-1167 on one process: per time j, the DGPO loss (L162-193) with the clipped
    dsm (L1133-1144) and the EMA or LoRA-off reference (L1122-1124), + β·mean KL (L1150-1156), divided by the M
    backward passes accelerate accumulates (gradient_accumulation_steps·M, L537), summed."""
    clean, conditioning = rollout.replay["clean_latents"], rollout.replay["conditioning"]
    group_size = int(torch.bincount(torch.unique(rollout.group_ids, return_inverse=True)[1]).max())
    _, group_of = torch.unique(rollout.group_ids, return_inverse=True)
    inputs = _inputs(plugin, rollout)
    constants = []
    with torch.no_grad():  # every weight swap before the forwards that keep a graph
        for _, model_t, _, x_t in inputs:
            with _with_weights(policy, _base_weights(policy)):
                ref_old_v = _transformer_velocity(policy, x_t, model_t, conditioning)
            with _with_weights(policy, plugin.dgpo.ema):
                old_v = _transformer_velocity(policy, x_t, model_t, conditioning)
            constants.append((ref_old_v, old_v))
    total = 0.0
    for (_, model_t, noise, x_t), (ref_old_v, old_v) in zip(inputs, constants, strict=True):
        model_v = _transformer_velocity(policy, x_t, model_t, conditioning)
        target_v = noise - clean
        dsm_loss = (target_v.double() - model_v.double()).square().reshape(len(clean), -1).mean(dim=1)
        old_dsm_loss = (target_v.double() - old_v.double()).square().reshape(len(clean), -1).mean(dim=1)
        if clip_range is not None:
            ratio = torch.exp(-dsm_loss + old_dsm_loss)
            should_clip = torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
            dsm_loss = torch.where(should_clip, dsm_loss.detach(), dsm_loss)
        ref_dgpo_v = old_v if use_ema_ref else ref_old_v
        ref_dsm_loss = (target_v.double() - ref_dgpo_v.double()).square().reshape(len(clean), -1).mean(dim=1)
        per_sample_term = advantages * beta_dpo * (dsm_loss.detach() - ref_dsm_loss) / group_size
        sums = torch.zeros(int(group_of.max()) + 1, dtype=torch.float64).scatter_add_(0, group_of, per_sample_term)
        dgpo_loss = (torch.sigmoid(sums)[group_of] * advantages * dsm_loss).mean()
        kl_loss = (model_v.double() - ref_old_v.double()).square().reshape(len(clean), -1).mean(dim=1).mean()
        total = total + (dgpo_loss + kl_beta * kl_loss) / len(inputs)
    return total


def _trainer(train_config, tmp_path, *overrides, **dgpo):
    config = train_config("sd3", tmp_path, "algorithm.micro_batch_size=4", "eval.save_samples=false", *overrides,
                          likelihood="dgpo", dgpo={**SMALL, **dgpo})
    return Trainer(config)


@pytest.mark.parametrize(("clip_range", "reference", "chunk"), [
    (None, "ref", None), (0.05, "ref", 1), (0.05, "old", None),
])
def test_the_learner_loss_and_gradient_are_the_released_loss(train_config, tmp_path, clip_range, reference, chunk):
    beta_dpo, kl_beta = 30.0, 0.2
    loss_options = f"{{name: dgpo, beta_dpo: {beta_dpo}" + (f", clip_range: {clip_range}" if clip_range else "") \
        + f", reference: {reference}}}"
    trainer = _trainer(train_config, tmp_path, f"algorithm.policy_loss={loss_options}", f"algorithm.kl_coef={kl_beta}",
                       f"algorithm.action_chunk_size={'null' if chunk is None else chunk}", ema_ref=True)
    plugin, policy = trainer.plugin, trainer.plugin.policy()
    _randomise(policy.named_parameters(), 0, 0.3)  # away from the reference: a KL with a gradient
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog"], 2))  # step 0: the EMA is θ₀
    _randomise(policy.named_parameters(), 1, 0.05)  # and θ away from the EMA: ratios ≠ 1
    lora = [p for name, p in policy.named_parameters() if "lora_" in name]
    advantages = torch.tensor([1.3, -0.6, 0.8, -1.9], dtype=torch.float64)
    expected = _upstream_loss(plugin, policy, rollout, advantages, beta_dpo=beta_dpo, kl_beta=kl_beta,
                              clip_range=clip_range, use_ema_ref=reference == "old")
    expected_grad = torch.autograd.grad(expected, lora)
    n, a = rollout.mask.shape
    lengths = rollout.mask.double().sum(dim=1)
    pieces = [None] if chunk is None else list(torch.arange(a).split(chunk))
    loss, got_grad, metrics = 0.0, [torch.zeros_like(p) for p in lora], {}
    for columns in pieces:  # one backward per chunk, as the learner
        part, metrics, _, _ = trainer.learner._micro_loss(rollout, advantages.float(), True, float(n * a), float(n),
                                                          a, columns, lengths)
        loss = loss + part.detach()
        got_grad = [g + d for g, d in zip(got_grad, torch.autograd.grad(part, lora), strict=True)]
    assert float(loss) == pytest.approx(float(expected.detach()), rel=1e-5)
    for got, want in zip(got_grad, expected_grad, strict=True):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    assert max(float(g.abs().max()) for g in expected_grad) > 1e-4
    weight = float(metrics["policy/group_weight_mean"])
    assert 0.02 < weight < 0.98 and abs(weight - 0.5) > 1e-3  # σ(S_g) neither saturated nor trivially 1/2
    if clip_range is not None and chunk is None:
        assert 0 < float(metrics["policy/clip_fraction"]) < 1


def test_the_fast_ema_follows_the_released_decay_samples_after_the_switch_and_travels(make_plugin, tmp_path):
    plugin = _dgpo(make_plugin, ema_ref=True, switch_ema_ref=3)
    policy = plugin.policy()
    trained = {name: p for name, p in policy.named_parameters() if p.requires_grad}
    batch = prompt_batch(["a cat"], 2)
    _randomise(policy.named_parameters(), 0, 0.3)
    first = plugin.rollout(policy, batch)  # step 0: the EMA is a copy of θ₀ (L629)
    start = {name: p.detach().clone() for name, p in trained.items()}
    output = plugin.forward(policy, first, need_reference=False)
    torch.testing.assert_close(first.old_logp, output.logp.detach(), rtol=0, atol=1e-6)  # the EMA is θ: ratio 1
    _randomise(policy.named_parameters(), 1, 0.3)  # θ₁
    now = {name: p.detach().clone() for name, p in trained.items()}
    plugin.rollout(policy, dataclasses.replace(batch, step=1))  # after optimizer step 0: d = min(0.3, 0) = 0
    for name, value in plugin.dgpo.ema.items():
        assert torch.equal(value, now[name])
    plugin.dgpo.ema = {name: value.clone() for name, value in start.items()}
    plugin.rollout(policy, dataclasses.replace(batch, step=3))  # after optimizer step 2: d = 0.002, written out
    for name, value in plugin.dgpo.ema.items():
        torch.testing.assert_close(value, 0.002 * start[name] + 0.998 * now[name], rtol=1e-6, atol=1e-7)
    assert plugin.dgpo.ema_step == 3
    plugin.dgpo.ema = {name: value.clone() for name, value in start.items()}
    plugin.dgpo.ema_step = 400  # no update at the rollouts below
    by_theta = plugin.rollout(policy, dataclasses.replace(batch, step=3))  # 3 steps done: not > switch_ema_ref
    by_ema = plugin.rollout(policy, dataclasses.replace(batch, step=4))  # 4 > 3: the EMA samples (L799-800)
    assert all(torch.equal(p, now[name]) for name, p in trained.items())  # θ is back after the rollout
    with _with_weights(policy, start):
        expected = plugin.rollout(policy, dataclasses.replace(batch, step=3))
    torch.testing.assert_close(by_ema.replay["clean_latents"], expected.replay["clean_latents"], rtol=0, atol=0)
    assert float((by_theta.replay["clean_latents"] - by_ema.replay["clean_latents"]).abs().max()) > 1e-3
    assert by_ema.metrics["dgpo_samples_with_ema"] == 1.0 and by_theta.metrics["dgpo_samples_with_ema"] == 0.0
    assert [ema_decay_value(s) for s in (0, 1, 150, 300, 301, 10_000)] == pytest.approx(
        [0.0, 0.001, 0.15, 0.3, 0.3, 0.3])

    plugin.save_trainable(policy, tmp_path / "policy")  # the fast EMA travels with checkpoints
    saved = {name: value.clone() for name, value in plugin.dgpo.ema.items()}
    plugin.dgpo.ema, plugin.dgpo.ema_step = None, -1
    plugin.load_trainable(policy, tmp_path / "policy")
    assert plugin.dgpo.ema_step == 400 and all(torch.equal(plugin.dgpo.ema[n], v) for n, v in saved.items())


def ema_decay_value(step):
    """L1176 written out: min(0.3, 0.001·global_step)."""
    return min(0.3, 0.001 * step)


def test_training_steps_move_the_lora_weights_and_resume_exactly(train_config, tmp_path):
    overrides = ("algorithm.policy_loss={name: dgpo, beta_dpo: 30.0, clip_range: 0.01}", "algorithm.kl_coef=0.02",
                 "algorithm.action_chunk_size=1")
    straight = _trainer(train_config, tmp_path / "straight", *overrides, "run.max_steps=3", ema_ref=True)
    transformer = straight.plugin.policy()
    before = {name: p.detach().clone() for name, p in transformer.named_parameters() if "lora_B" in name}
    history = straight.train().history
    assert [record["step"] for record in history] == [1, 2, 3]
    for record in history[:2]:  # the EMA is θ at steps 0 and 1 (d = 0 after optimizer step 0): ratio 1
        # up to rounding: the rollout scores the EMA on the whole batch, the training forward one column at a time
        # (1.2e-7 apart under ATEN_CPU_CAPABILITY=default; an EMA that differs from θ moves it by far more, step 3)
        assert record["loss/first_step_ratio_deviation"] < 1e-6 and math.isfinite(record["loss/total"])
    assert history[2]["loss/first_step_ratio_deviation"] > 2e-6  # d = 0.001 after step 1: EMA ≠ θ (8e-6 here)
    assert history[1]["policy/kl"] > 0
    moved = [name for name, p in transformer.named_parameters() if name in before
             and not torch.equal(before[name], p.detach())]
    assert len(moved) > len(before) // 2
    assert straight.plugin.dgpo.ema_step == 2

    _trainer(train_config, tmp_path / "stopped", *overrides, "run.max_steps=2", ema_ref=True).train()
    resumed = _trainer(train_config, tmp_path / "stopped", *overrides, "run.max_steps=3", "run.resume=latest",
                       ema_ref=True)
    rest = resumed.train().history  # restores the checkpoint of step 2, its fast EMA included
    assert [record["step"] for record in rest] == [3]
    assert rest[0]["loss/total"] == history[2]["loss/total"]
    for name, value in straight.plugin.dgpo.ema.items():  # a fresh copy of θ₂ would differ by 0.001·(θ₁ − θ₂)
        assert torch.equal(value, resumed.plugin.dgpo.ema[name]), name
    mine = dict(resumed.plugin.policy().named_parameters())
    for name, parameter in transformer.named_parameters():
        if parameter.requires_grad:
            assert torch.equal(parameter.detach(), mine[name].detach()), name


@pytest.mark.parametrize(("overrides", "dgpo", "key"), [
    (("algorithm.policy_loss={name: grpo}",), {}, "algorithm.policy_loss.name"),
    (("algorithm.policy_loss={name: dgpo}", "algorithm.aggregation=seq_mean_token_sum"), {}, "algorithm.aggregation"),
    (("algorithm.policy_loss={name: dgpo, clip_range: 0.01}",), {}, "algorithm.policy_loss.clip_range"),
    (("algorithm.policy_loss={name: dgpo, reference: old}",), {}, "algorithm.policy_loss.reference"),
    (("algorithm.policy_loss={name: dgpo}", "algorithm.minibatches=2"), {"ema_ref": True}, "algorithm.minibatches"),
    (("algorithm.policy_loss={name: dgpo}", "algorithm.inner_epochs=2"), {"ema_ref": True}, "algorithm.inner_epochs"),
    (("algorithm.policy_loss={name: dgpo}", "algorithm.recompute_old_logp=true"), {"ema_ref": True},
     "algorithm.recompute_old_logp"),
    (("algorithm.policy_loss={name: dgpo, beta_dpo: 0.0}",), {}, "algorithm.policy_loss.beta_dpo"),
    (("algorithm.policy_loss={name: dgpo, clip_range: 1.0}",), {"ema_ref": True}, "algorithm.policy_loss.clip_range"),
])
def test_settings_that_change_the_released_loss_are_refused_in_one_line(train_config, tmp_path, overrides, dgpo,
                                                                         key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as error:
        train_config("sd3", tmp_path, "algorithm.micro_batch_size=4", *overrides, likelihood="dgpo",
                     dgpo={**SMALL, **dgpo})
    assert "\n" not in str(error.value)


def test_full_fine_tuning_keeps_a_reference_copy_without_a_kl_term(train_config, tmp_path):
    """DGPO's reference errors need the initial weights: the dgpo loss declares ref_logp, so the trainer tells the
    plugin to keep its frozen copy whatever kl_coef (``needs_reference``; tests/test_toy_reference.py trains it)."""
    from mmrl.trainer.learn import needs_reference

    config = train_config("sd3", tmp_path, "algorithm.policy_loss={name: dgpo}", "algorithm.micro_batch_size=4",
                          "algorithm.kl_coef=0", likelihood="dgpo", dgpo=SMALL, lora=None)
    assert config.algorithm.kl_coef == 0 and needs_reference(config)


def test_the_dgpo_loss_without_dgpo_columns_is_refused(train_config, tmp_path):
    with pytest.raises(ConfigError, match=r"algorithm\.policy_loss\.name") as error:
        train_config("sd3", tmp_path, "algorithm.policy_loss={name: dgpo}", "algorithm.micro_batch_size=4")
    assert "\n" not in str(error.value) and "dgpo" in str(error.value)


def test_a_micro_batch_that_splits_a_group_is_refused_at_start_up(train_config, tmp_path):
    config = train_config("sd3", tmp_path, "algorithm.policy_loss={name: dgpo}", likelihood="dgpo", dgpo=SMALL)
    with pytest.raises(ConfigError, match=r"algorithm\.micro_batch_size") as error:  # the fixture's 3, G = 4
        Trainer(config)
    assert "\n" not in str(error.value) and "group_size (4)" in str(error.value)


@pytest.mark.parametrize(("options", "key"), [
    ({"credit": {"strategy": "chunk"}}, "plugin.credit.strategy"),
    ({"train_steps": "window"}, "plugin.train_steps"),
    ({"decode_latent": "predicted_x0"}, "plugin.decode_latent"),
    ({"share_initial_noise": True}, "plugin.share_initial_noise"),
    ({"dgpo": {"num_times": 2, "trunc_steps": 4}}, "plugin.dgpo.trunc_steps"),
    ({"dgpo": {"num_times": 4, "trunc_steps": 2}}, "plugin.dgpo.num_times"),
    ({"dgpo": {**SMALL, "switch_ema_ref": 10}}, "plugin.dgpo.switch_ema_ref"),
    ({"dgpo": {**SMALL, "kl_cfg": 0.5}}, "plugin.dgpo.kl_cfg"),
    ({"dgpo": {**SMALL, "ema_decay": 1.5}}, "plugin.dgpo.ema_decay"),
])
def test_bad_plugin_options_are_refused_in_one_line(pipelines, options, key):
    values = plugin_options(pipelines["sd3"], likelihood="dgpo", **{"dgpo": SMALL, **options})
    values.pop("name")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as error:
        from_dict(FlowPluginConfig, values, "plugin")
    assert "\n" not in str(error.value)


def test_a_guided_reference_without_cfg_is_refused_at_start_up(make_plugin):
    with pytest.raises(ConfigError, match=r"plugin\.dgpo\.kl_cfg") as error:
        make_plugin("sd3", likelihood="dgpo", cfg=False, dgpo={**SMALL, "kl_cfg": 4.5})
    assert "\n" not in str(error.value)
