"""Advantage Weighted Matching (``plugin.likelihood: matching``) on the tiny SD3 pipeline.

Every expected value is restated here from the released code (scxue/advantage_weighted_matching@be51372,
``advantage_weighted_matching/scripts/train_sd3_awm.py``, "L" below): the surrogate log-prob (L210-252), the time
samplers (L1138-1207), the loss (L1292-1354); none of them calls :mod:`mmrl.plugins.flow.matching`'s formulas.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mmrl.config import ConfigError, from_dict
from mmrl.plugins.flow.matching import MatchingConfig, draw_times
from mmrl.plugins.flow.plugin import FlowPluginConfig
from mmrl.seeding import derive_seed
from mmrl.trainer import Trainer
from mmrl.trainer.learn import old_policy_pass
from tests.flow.conftest import plugin_options, prompt_batch

NOISE_TAG = 0xA3E2  # the documented contract: ε of (sample, epoch, column) from derive_seed(seed, tag, epoch, column)


def _matching(make_plugin, runtime=None, plugin=None, **matching):
    from mmrl.plugin import Runtime

    options = {"num_times": 3, **matching}
    return make_plugin("sd3", runtime or Runtime(needs_reference=True), likelihood="matching", matching=options,
                       num_steps=6, timestep_fraction=0.99, **(plugin or {}))


def _upstream_log_prob(velocity, noise, clean, t, weighting, power=0.25):
    """train_sd3_awm.py L237-251, written out: float64, mean over every non-batch dim, then the weighting."""
    log_prob = -(velocity.double() - (noise.double() - clean.double())) ** 2
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    t = t.double()
    if weighting == "t":
        return log_prob * t
    if weighting == "t2":
        return log_prob * t**2
    if weighting == "uniform":
        return log_prob
    if weighting == "huber":
        return -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * t
    assert weighting == "ghuber"
    return -(torch.pow(-log_prob + 1e-10, power) - torch.pow(torch.tensor(1e-10, dtype=torch.float64), power)) \
        * t / power


def _noise(seeds, epoch, column, shape):
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(
        derive_seed(int(seed), NOISE_TAG, epoch, column))) for seed in seeds.tolist()])


def _record_velocity(plugin):
    """Wrap the sampler's velocity function: every call's (latents, timesteps, output)."""
    calls = []
    original = plugin.sampler.velocity

    def velocity(module, latents, timesteps, conditioning, guidance_scale, *, phase):
        out = original(module, latents, timesteps, conditioning, guidance_scale, phase=phase)
        calls.append((latents.detach().clone(), timesteps.detach().clone(), out))
        return out

    plugin.sampler.velocity = velocity
    return calls


@pytest.mark.parametrize("weighting", ["uniform", "t", "t2", "huber", "ghuber"])
def test_log_prob_is_the_weighted_flow_matching_loss_of_the_final_sample(make_plugin, weighting):
    plugin = _matching(make_plugin, weighting=weighting, time_sampler="logit_normal")
    policy = plugin.policy()
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog"], 2))
    replay = rollout.replay
    assert rollout.old_logp is None and rollout.mask.shape == (4, 3) and bool((rollout.mask == 1).all())
    clean = replay["clean_latents"]  # [4, *latent]
    # x₀ is the latent the reward saw: decoding it gives the rollout's images
    torch.testing.assert_close(plugin.adapter.decode(plugin.adapter.finalize(clean, replay["conditioning"])),
                               rollout.payload["images"])
    calls = _record_velocity(plugin)
    output = plugin.forward(policy, rollout, need_reference=True)
    assert output.logp.shape == (4, 3) and len(calls) == 6  # policy and reference per column
    for k in range(3):
        t = replay["matching_times"][:, 0, k]
        noise = _noise(replay["matching_seeds"], 0, k, tuple(clean.shape[1:]))
        latents, timesteps, velocity = calls[2 * k]
        x_t = (1 - t.reshape(-1, 1, 1, 1)) * clean + t.reshape(-1, 1, 1, 1) * noise  # L1268
        torch.testing.assert_close(latents, x_t, rtol=0, atol=1e-6)
        torch.testing.assert_close(timesteps, t * 1000, rtol=1e-6, atol=1e-4)  # L214: timestep = t·1000
        expected = _upstream_log_prob(velocity, noise, clean, t, weighting)
        torch.testing.assert_close(output.logp[:, k].double(), expected, rtol=1e-6, atol=1e-7)
    # LoRA B = 0: the policy is the reference
    assert output.kl is not None and float(output.kl.detach().abs().max()) == 0.0


def test_velocity_kl_both_weightings(make_plugin):
    for kl_weight in ("uniform", "elbo"):
        plugin = _matching(make_plugin, kl_weight=kl_weight)
        policy = plugin.policy()
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, parameter in policy.named_parameters():
                if "lora_B" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
        rollout = plugin.rollout(policy, prompt_batch(["a cat"], 2))
        calls = _record_velocity(plugin)
        output = plugin.forward(policy, rollout, need_reference=True)
        for k in range(3):
            t = rollout.replay["matching_times"][:, 0, k].double()
            v, v_ref = calls[2 * k][2].double(), calls[2 * k + 1][2].double()
            kl = ((v - v_ref) ** 2).mean(dim=(1, 2, 3))  # L1335-1337
            if kl_weight == "elbo":
                std = torch.sqrt(t / (1 - torch.clamp(t, 0, 0.99))) * 0.7  # L236
                kl = kl / (2 * std**2)
            assert float(kl.detach().min()) > 0
            torch.testing.assert_close(output.kl[:, k].double(), kl, rtol=1e-5, atol=0)


def _unshift(t, s):
    return t / (s - (s - 1) * t)


@pytest.mark.parametrize("sampler", ["logit_normal", "uniform"])
def test_continuous_times_take_one_draw_per_stratum(sampler):
    config = MatchingConfig(num_times=4, time_sampler=sampler, time_shift=3.0)
    sigmas, timesteps = torch.linspace(1, 0, 7), torch.linspace(1, 0, 7)[:-1] * 1000
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([draw_times(config, generator, sigmas, timesteps, 5)[0] for _ in range(2000)])  # [D, K]
    raw = _unshift(draws.double(), 3.0)
    if sampler == "logit_normal":  # L1144-1159: u = (k + U)/K, t = shift(sigmoid(Φ⁻¹(u))), then t >= 0.01
        assert float(draws.min()) >= 0.01
        u = torch.distributions.Normal(0.0, 1.0).cdf(torch.logit(raw))
    else:  # L1163-1169: t = shift(0.2 + 0.8·(k + U)/K)
        u = (raw - 0.2) / 0.8
    for k in range(4):  # one draw in each stratum, uniform inside it
        assert float(u[:, k].min()) >= k / 4 - 1e-5 and float(u[:, k].max()) <= (k + 1) / 4 + 1e-5
        assert abs(float(u[:, k].mean()) - (k + 0.5) / 4) < 0.01
    times, model = draw_times(config, torch.Generator().manual_seed(1), sigmas, timesteps, 5)
    torch.testing.assert_close(model, times * 1000)


# The floored strata of the released recipes (S = 14 steps, timestep_fraction 0.9: M = 12; K = 6), by hand from
# L1173-1177 (linspace(0, 12, 7)), L1198-1202 (linspace(1, 12, 7) = 1, 2.83, 4.67, 6.5, 8.33, 10.17, 12) and
# L1182-1191 (0, then linspace(1, 12, 6) = 1, 3.2, 5.4, 7.6, 9.8, 12).
STRATA = {
    "discrete": [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)],
    "discrete_wo_init": [(1, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)],
    "discrete_with_init": [(0, 1), (1, 3), (3, 5), (5, 7), (7, 9), (9, 12)],
}


@pytest.mark.parametrize("sampler", sorted(STRATA))
def test_discrete_times_are_grid_steps_one_per_stratum(sampler):
    config = MatchingConfig(num_times=6, time_sampler=sampler)
    sigmas = torch.linspace(1, 0, 15) ** 0.5  # any decreasing grid: t is σ at the drawn step
    timesteps = sigmas[:-1] * 1000
    generator = torch.Generator().manual_seed(0)
    seen = [set() for _ in range(6)]
    for _ in range(400):
        t, model = draw_times(config, generator, sigmas, timesteps, int(14 * 0.9))
        index = [int((sigmas - value).abs().argmin()) for value in t.tolist()]
        torch.testing.assert_close(t, sigmas[index])
        torch.testing.assert_close(model, timesteps[index])
        for k, i in enumerate(index):
            seen[k].add(i)
    assert [set(range(lo, hi)) for lo, hi in STRATA[sampler]] == seen


def test_ratio_is_exactly_one_before_an_update_and_each_epoch_has_its_own_draw(make_plugin):
    from mmrl.plugin import Runtime

    # fixed transformer batches: the old pass's pieces of 3 and the training forward's 4 rows see the same shapes
    plugin = _matching(make_plugin, Runtime(inner_epochs=2), {"transformer_batch_size": 2}, time_sampler="uniform")
    policy = plugin.policy()
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog"], 2))
    times = rollout.replay["matching_times"]
    assert plugin.redraws_per_epoch and times.shape == (4, 2, 3)
    assert not torch.equal(times[:, 0], times[:, 1])  # each epoch draws its own times
    logps = []
    for epoch in range(2):
        plugin.start_inner_epoch(epoch)
        old = old_policy_pass(plugin, policy, rollout, batch_size=3).old_logp  # eval mode, no grad, pieces of 3
        policy.train()
        current = plugin.forward(policy, rollout, need_reference=False).logp
        assert torch.equal(current.detach(), old)  # the same x_t for the old and the current pass: ratio ≡ 1
        logps.append(old)
    assert not torch.allclose(logps[0], logps[1])  # the second epoch draws new times and noise
    plugin.start_inner_epoch(5)
    with pytest.raises(RuntimeError, match="inner epoch 5"):
        plugin.forward(policy, rollout, need_reference=False)


def _upstream_loss(log_probs, old_log_probs, advantages, clip_range, kl, beta, loss_type, adv_clip_max=5.0,
                   advantage_max=1.0):
    """L1293-1352 with the [K, B] layout transposed to [B, K]: advantages clipped and rescaled, the clipped
    surrogate on exp_first (per (sample, time)) or sum_first (mean over times, then exp) ratios, + β·mean KL."""
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max) / adv_clip_max * advantage_max
    if loss_type == "sum_first":
        ratio = torch.exp(log_probs.mean(dim=1) - old_log_probs.mean(dim=1))  # [B]
    else:
        ratio = torch.exp(log_probs - old_log_probs).reshape(-1)  # [B·K]
        advantages = advantages.unsqueeze(1).expand_as(log_probs).reshape(-1)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.mean(torch.maximum(unclipped, clipped)) + beta * kl.mean()


@pytest.mark.parametrize(("loss_type", "policy_loss"), [
    ("exp_first", "{name: grpo, clip_low: 0.002, clip_high: 0.002}"),
    ("sum_first", "{name: gspo, clip_low: 0.002, clip_high: 0.002}"),
])
def test_the_learner_loss_and_gradient_are_the_released_loss(train_config, tmp_path, loss_type, policy_loss):
    beta = 0.3
    config = train_config("sd3", tmp_path, f"algorithm.policy_loss={policy_loss}", f"algorithm.kl_coef={beta}",
                          "algorithm.action_chunk_size=null", likelihood="matching", num_steps=6,
                          matching={"num_times": 3, "weighting": "ghuber", "advantage_scale": 0.2,
                                    "time_sampler": "logit_normal"})
    trainer = Trainer(config)
    plugin, policy = trainer.plugin, trainer.plugin.policy()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a policy away from the reference: a KL with a gradient
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    rollout = plugin.rollout(policy, prompt_batch(["a cat"], 3))
    clean = rollout.replay["clean_latents"]
    lora = [p for name, p in policy.named_parameters() if "lora_" in name]

    # the released loss on log-probs and velocities written out here (the sampler's one velocity function)
    log_probs, kls = [], []
    for k in range(3):
        t = rollout.replay["matching_times"][:, 0, k]
        noise = _noise(rollout.replay["matching_seeds"], 0, k, tuple(clean.shape[1:]))
        x_t = (1 - t.reshape(-1, 1, 1, 1)) * clean + t.reshape(-1, 1, 1, 1) * noise
        conditioning = rollout.replay["conditioning"]
        v = plugin.sampler.velocity(policy, x_t, t * 1000, conditioning, plugin.sampler.guidance_scale,
                                    phase="forward")
        with torch.no_grad(), plugin._reference_module(policy) as reference:
            v_ref = plugin.sampler.velocity(reference, x_t, t * 1000, conditioning, plugin.sampler.guidance_scale,
                                            phase="forward")
        log_probs.append(_upstream_log_prob(v, noise, clean, t, "ghuber"))
        kls.append(((v.double() - v_ref.double()) ** 2).mean(dim=(1, 2, 3)))
    log_probs, kl = torch.stack(log_probs, dim=1), torch.stack(kls, dim=1)  # [B, K]
    shifts = torch.tensor([[-0.009, 0.001, -0.001], [0.003, -0.0015, -0.001], [0.0, 0.0, 0.0]], dtype=torch.float64)
    old = log_probs.detach() + shifts  # some ratios clipped (A > 0, r > 1.002; A < 0, r < 0.998), some not
    advantages = torch.tensor([1.5, -0.7, 4.0])
    expected = _upstream_loss(log_probs, old, advantages.double(), 0.002, kl, beta, loss_type)
    expected_grad = torch.autograd.grad(expected, lora)

    part = dataclasses.replace(rollout, old_logp=old.float())
    n, a = part.mask.shape
    loss, metrics, _, _ = trainer.learner._micro_loss(part, advantages, True, float(n * a), float(n), a, None,
                                                      part.mask.double().sum(dim=1))
    got_grad = torch.autograd.grad(loss, lora)
    assert float(metrics["policy/clip_fraction"]) > 0  # the clip is exercised
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-5, abs=1e-8)
    for got, want in zip(got_grad, expected_grad, strict=True):
        torch.testing.assert_close(got.double(), want.double(), rtol=2e-4, atol=1e-8)
    assert max(float(g.abs().max()) for g in expected_grad) > 1e-4


def test_two_grpo_steps_with_two_inner_epochs_and_the_ema_kl_move_the_lora_weights(train_config, tmp_path):
    config = train_config("sd3", tmp_path, "algorithm.inner_epochs=2", "algorithm.kl_coef=0.01",
                          "algorithm.policy_loss={name: grpo, clip_low: 0.5, clip_high: 0.5}",
                          "eval.save_samples=false", likelihood="matching", num_steps=4,
                          matching={"num_times": 2, "weighting": "ghuber", "time_sampler": "discrete",
                                    "ema_kl_coef": 1.0, "ema_decay_schedule": "constant"})
    trainer = Trainer(config)
    transformer = trainer.plugin.policy()
    before = {name: p.detach().clone() for name, p in transformer.named_parameters() if "lora_B" in name}
    history = trainer.train().history
    assert [record["step"] for record in history] == [1, 2]
    for record in history:
        assert record["loss/first_step_ratio_deviation"] == 0.0
        assert math.isfinite(record["loss/total"])
    assert history[1]["policy/kl"] > 0 and history[1]["loss/aux"] > 0  # the EMA KL once the weights moved
    moved = [name for name, p in transformer.named_parameters() if name in before
             and not torch.equal(before[name], p.detach())]
    assert len(moved) > len(before) // 2


@pytest.mark.parametrize(("options", "key"), [
    ({"credit": {"strategy": "chunk"}}, "plugin.credit.strategy"),
    ({"credit": {"ratio_norm": True}}, "plugin.credit.ratio_norm"),
    ({"credit": {"noise_weighting": True}}, "plugin.credit.noise_weighting"),
    ({"train_steps": "window"}, "plugin.train_steps"),
    ({"kl_variance": "none"}, "plugin.kl_variance"),
    ({"cps_log_prob": "gaussian"}, "plugin.cps_log_prob"),
    ({"num_steps": 6, "timestep_fraction": 0.9, "matching": {"num_times": 6}}, "plugin.timestep_fraction"),
    ({"matching": {"sde_sigma_range": [0.9, 0.3]}}, "plugin.matching.sde_sigma_range"),
    ({"matching": {"weighting": "t**2"}}, "plugin.matching.weighting"),
    ({"share_initial_noise": True}, "plugin.share_initial_noise"),
])
def test_bad_combinations_are_refused_in_one_line(pipelines, options, key):
    values = plugin_options(pipelines["sd3"], likelihood="matching", **options)
    values.pop("name")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as error:
        from_dict(FlowPluginConfig, values, "plugin")
    assert "\n" not in str(error.value)


def test_a_chunk_ratio_is_refused(train_config, tmp_path):
    with pytest.raises(ConfigError, match=r"algorithm\.policy_loss\.ratio_level") as error:
        train_config("sd3", tmp_path, "algorithm.policy_loss={name: grpo, ratio_level: chunk}",
                     "algorithm.action_chunk_size=null", likelihood="matching", matching={"num_times": 2})
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("schedule", "decay"), [("linear", 0.002), ("constant", 0.3)])
def test_ema_kl_follows_the_released_ema_and_loss(make_plugin, tmp_path, schedule, decay):
    """L649-658 (the EMA starts as a copy), L1409-1419 (ema ← d·ema + (1 − d)·θ after each epoch, d = min(0.3,
    0.001·step) for "linear"), L1276-1280 and L1341-1350 (ema_beta · mean over (time, sample) of mean((v − v_ema)²))."""
    plugin = _matching(make_plugin, ema_kl_coef=2.0, ema_decay=0.3, ema_decay_schedule=schedule)
    policy = plugin.policy()
    trained = {name: p for name, p in policy.named_parameters() if p.requires_grad}
    batch = prompt_batch(["a cat"], 2)
    plugin.rollout(policy, batch)  # step 0: the copy
    start = {name: p.detach().clone() for name, p in trained.items()}
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trained.values():
            p.add_(torch.randn(p.shape, generator=generator) * 0.2)
    rollout = plugin.rollout(policy, dataclasses.replace(batch, step=2))  # two steps done
    plugin.rollout(policy, dataclasses.replace(batch, step=2))  # a second rollout batch of the step: no update
    ema = {name: decay * start[name] + (1 - decay) * p.detach() for name, p in trained.items()}
    for name, value in ema.items():
        torch.testing.assert_close(plugin.matching.ema[name], value)

    now = {name: p.detach().clone() for name, p in trained.items()}
    output = plugin.forward(policy, rollout, need_reference=False)
    assert all(torch.equal(p, now[name]) for name, p in trained.items())  # the trained weights are back
    clean, replay = rollout.replay["clean_latents"], rollout.replay
    with torch.no_grad():  # v_ema written out: the EMA weights in place, the sampler's velocity function
        for name, p in trained.items():
            p.copy_(ema[name])
        v_ema = []
        for k in range(3):
            t = replay["matching_times"][:, 0, k]
            noise = _noise(replay["matching_seeds"], 0, k, tuple(clean.shape[1:]))
            x_t = (1 - t.reshape(-1, 1, 1, 1)) * clean + t.reshape(-1, 1, 1, 1) * noise
            v_ema.append(plugin.sampler.velocity(policy, x_t, t * 1000, replay["conditioning"],
                                                 plugin.sampler.guidance_scale, phase="forward"))
        for name, p in trained.items():
            p.copy_(now[name])
    calls = _record_velocity(plugin)
    output = plugin.forward(policy, rollout, need_reference=False)
    v = [calls[3 + k][2] for k in range(3)]  # the three EMA forwards come first
    expected = 2.0 * torch.stack([((v[k].double() - v_ema[k].double()) ** 2).mean(dim=(1, 2, 3))
                                  for k in range(3)]).mean()
    assert output.aux_loss.requires_grad and float(expected.detach()) > 0
    # rtol: the EMA here and the plugin's round differently in float32 (|v − v_ema| ~ 1e-3 of |v| at d = 0.002)
    torch.testing.assert_close(output.aux_loss.double(), expected, rtol=1e-4, atol=0)
    assert old_policy_pass(plugin, policy, rollout).old_logp.shape == (2, 3)  # no EMA term without gradients

    plugin.save_trainable(policy, tmp_path / "policy")  # the EMA travels with checkpoints
    saved = {name: value.clone() for name, value in plugin.matching.ema.items()}
    plugin.matching.ema, plugin.matching.ema_step = None, -1
    plugin.load_trainable(policy, tmp_path / "policy")
    assert plugin.matching.ema_step == 2 and all(torch.equal(plugin.matching.ema[n], v) for n, v in saved.items())


def test_draws_depend_on_each_sample_seed_only_not_on_the_batch_layout(make_plugin):
    """Multi-process and rollout-batch layouts: a sample's times and noise seed are functions of its own seed (the
    core's per-sample seed, process-independent), so the same sample drawn in another batch, at another position,
    alongside other samples, gets the same draw; and ε of (sample, epoch, column) is the documented generator's."""
    from mmrl.plugin import Runtime

    plugin = _matching(make_plugin, Runtime(inner_epochs=2), time_sampler="logit_normal")
    policy = plugin.policy()
    whole = plugin.rollout(policy, prompt_batch(["a cat", "a dog"], 2))  # seeds 100..103
    alone = plugin.rollout(policy, prompt_batch(["a dog"], 2, first_seed=102, first_group=1))  # seeds 102, 103
    for key in ("matching_times", "matching_timesteps", "matching_seeds"):
        assert torch.equal(whole.replay[key][2:], alone.replay[key]), key
    assert not torch.equal(whole.replay["matching_times"][0], whole.replay["matching_times"][1])  # per sample
    # ε regenerated from the seed, whatever rows share the forward: the recorded x_t of sample 102 is the same
    calls = _record_velocity(plugin)
    plugin.forward(policy, whole, need_reference=False)
    plugin.forward(policy, alone, need_reference=False)
    for k in range(3):  # x_t = (1 - t)·x0 + t·ε: x0 comes from rollouts of other batch sizes, whose kernels round
        # differently in the last bits (seen: 5e-7 under ATEN_CPU_CAPABILITY=default); an ε that depended on the
        # layout would differ by O(1)
        torch.testing.assert_close(calls[k][0][2:], calls[3 + k][0][:], rtol=0, atol=1e-5)
    # draw 0 does not depend on how many inner epochs are drawn
    single = _matching(make_plugin, Runtime(inner_epochs=1), time_sampler="logit_normal")
    one = single.rollout(single.policy(), prompt_batch(["a cat", "a dog"], 2))
    assert one.replay["matching_times"].shape == (4, 1, 3)
    assert torch.equal(one.replay["matching_times"][:, 0], whole.replay["matching_times"][:, 0])


def test_evaluation_runs_the_plain_sampler_and_leaves_the_ema_alone(make_plugin):
    plugin = _matching(make_plugin, ema_kl_coef=1.0)
    policy = plugin.policy()
    calls = _record_velocity(plugin)
    evaluation = plugin.rollout(policy, prompt_batch(["a cat"], 2, training=False))
    assert evaluation.mask.shape == (2, 0) and "matching_times" not in (evaluation.replay or {})
    assert len(calls) == 3  # eval_num_steps Euler steps, one velocity each
    assert plugin.matching.ema is None and plugin.matching.ema_step == -1  # only training rollouts move the EMA
    plugin.rollout(policy, prompt_batch(["a cat"], 2))
    assert plugin.matching.ema is not None and plugin.matching.ema_step == 0


def test_action_chunks_give_the_loss_and_gradient_of_all_columns_at_once(train_config, tmp_path):
    """``algorithm.action_chunk_size`` back-propagates the K time columns in chunks (here 2 + 1 of K = 3): each
    chunk's forward scores its columns only, at the same x_t, and with the step-wide denominators the chunks' losses
    and gradients sum to the unchunked ones (policy term with its clip, action weights, velocity KL)."""
    config = train_config("sd3", tmp_path, "algorithm.policy_loss={name: grpo, clip_low: 0.002, clip_high: 0.002}",
                          "algorithm.kl_coef=0.3", "algorithm.action_chunk_size=null", likelihood="matching",
                          num_steps=6, matching={"num_times": 3, "weighting": "huber", "advantage_scale": 0.2})
    trainer = Trainer(config)
    plugin, policy = trainer.plugin, trainer.plugin.policy()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    rollout = plugin.rollout(policy, prompt_batch(["a cat"], 3))
    with torch.no_grad():
        logp = plugin.forward(policy, rollout, need_reference=False).logp
    shifts = torch.tensor([[-0.009, 0.001, -0.001], [0.003, -0.0015, -0.001], [0.0, 0.0, 0.0]])
    part = dataclasses.replace(rollout, old_logp=logp + shifts)  # some ratios clipped
    advantages = torch.tensor([1.5, -0.7, 4.0])
    lora = [p for name, p in policy.named_parameters() if "lora_" in name]
    n, a = part.mask.shape
    lengths = part.mask.double().sum(dim=1)

    def loss_and_grad(columns):
        loss, _, _, _ = trainer.learner._micro_loss(part, advantages, True, float(n * a), float(n), a, columns,
                                                    lengths)
        return loss.detach(), torch.autograd.grad(loss, lora)

    whole, whole_grad = loss_and_grad(None)
    chunks = [loss_and_grad(torch.tensor(columns)) for columns in ([0, 1], [2])]
    assert float(whole.abs()) > 0
    torch.testing.assert_close(sum(loss for loss, _ in chunks), whole, rtol=1e-5, atol=1e-9)
    for k, want in enumerate(whole_grad):
        torch.testing.assert_close(sum(grads[k] for _, grads in chunks), want, rtol=1e-4, atol=1e-9)


def test_a_resumed_run_continues_exactly_with_its_ema(train_config, tmp_path):
    """Two steps in one go, and one step then a resume from its checkpoint for the second: the same LoRA weights,
    the same EMA (restored with the step of its last update, then moved by d = min(0.3, 0.001·step) of the resumed
    step) and the same losses: the draws come from the samples' seeds, not from state a restart loses."""
    def config(folder, *overrides):
        return train_config("sd3", tmp_path / folder, "algorithm.kl_coef=0.01", "algorithm.action_chunk_size=null",
                            "algorithm.micro_batch_size=4", "eval.save_samples=false", *overrides,
                            likelihood="matching", num_steps=4,
                            matching={"num_times": 2, "time_sampler": "uniform", "ema_kl_coef": 1.0})

    straight = Trainer(config("straight"))
    history = straight.train().history
    Trainer(config("resumed", "run.max_steps=1")).train()
    resumed = Trainer(config("resumed", "run.resume=latest"))  # the checkpoint's EMA: ema_step 0
    rest = resumed.train().history
    assert [record["step"] for record in rest] == [2]
    assert rest[0]["loss/total"] == history[1]["loss/total"] and history[1]["loss/aux"] > 0
    ema, again = straight.plugin.matching, resumed.plugin.matching
    assert ema.ema_step == again.ema_step == 1 and ema.ema.keys() == again.ema.keys()
    for name, value in ema.ema.items():
        assert torch.equal(value, again.ema[name]), name
    mine = dict(resumed.plugin.policy().named_parameters())
    for name, parameter in straight.plugin.policy().named_parameters():
        if parameter.requires_grad:
            assert torch.equal(parameter.detach(), mine[name].detach()), name


@pytest.mark.parametrize("sampler", ["logit_normal", "discrete"])
def test_flux_transformer_sees_sigma_t_for_x_t_on_its_shifted_grid(make_plugin, sampler):
    """The timestep convention on a family other than SD3: FLUX's scheduler shifts its grid with the image size
    (σ ≠ linspace) and its transformer takes σ itself (FluxPipeline passes timestep/1000). The matching forward must
    hand the transformer σ = t for x_t = (1 − t)·x₀ + t·ε: t·1000 in the scheduler's convention for the continuous
    samplers, the grid's own (σ_i, timestep_i) pair for the discrete ones."""
    plugin = make_plugin("flux", likelihood="matching", num_steps=6, timestep_fraction=0.99,
                         matching={"num_times": 3, "time_sampler": sampler})
    policy = plugin.policy()
    sigmas, timesteps = plugin.sampler.training_schedule()
    assert not torch.allclose(sigmas, torch.linspace(1, 0, 7))  # a shifted grid
    rollout = plugin.rollout(policy, prompt_batch(["a cat"], 2))
    times = rollout.replay["matching_times"][:, 0]  # [2, 3]
    if sampler == "discrete":  # every t is a grid σ, with its own timestep
        index = (times.reshape(-1, 1) - sigmas.reshape(1, -1)).abs().argmin(dim=1)
        torch.testing.assert_close(times.reshape(-1), sigmas[index], rtol=0, atol=0)
        torch.testing.assert_close(rollout.replay["matching_timesteps"][:, 0].reshape(-1), timesteps[index])
    seen = []
    hook = policy.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["timestep"].detach()),
                                            with_kwargs=True)
    try:
        plugin.forward(policy, rollout, need_reference=False)
    finally:
        hook.remove()
    assert len(seen) == 3
    for k in range(3):
        torch.testing.assert_close(seen[k].float(), times[:, k], rtol=1e-6, atol=1e-6)


def test_bf16_autocast_scores_the_transformer_output_in_float64(make_plugin):
    """Under bf16 autocast the adapter returns the (CFG-combined) velocity in float32, and the squared error is taken
    in float64 on it (upstream: ``noise_pred.double()``, L244-245), not in the autocast dtype; the old-policy pass in
    pieces of 3 gives ratio exactly 1 (``transformer_batch_size``: fixed kernel shapes)."""
    from mmrl.plugin import Runtime

    runtime = Runtime(mixed_precision="bf16", autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    plugin = _matching(make_plugin, runtime, {"transformer_batch_size": 2}, weighting="t2")
    policy = plugin.policy()
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog"], 2))
    clean = rollout.replay["clean_latents"]
    assert clean.dtype == torch.float32
    calls = _record_velocity(plugin)
    output = plugin.forward(policy, rollout, need_reference=False)
    for k in range(3):
        velocity = calls[k][2]
        assert velocity.dtype == torch.float32
        t = rollout.replay["matching_times"][:, 0, k]
        noise = _noise(rollout.replay["matching_seeds"], 0, k, tuple(clean.shape[1:]))
        expected = _upstream_log_prob(velocity, noise, clean, t, "t2")
        torch.testing.assert_close(output.logp[:, k].double(), expected, rtol=1e-6, atol=0)
    old = old_policy_pass(plugin, policy, rollout, batch_size=3).old_logp
    assert torch.equal(output.logp.detach(), old)


def test_a_bucketed_rollout_draws_on_its_own_grid_and_the_forward_runs_at_its_size(make_plugin, tmp_path):
    """``plugin.buckets`` on FLUX, whose σ grid shifts with the image size: a wide row's discrete times are σ of the
    wide grid, its x₀ is the wide latent, and its forward (after a square rollout moved the adapter) runs at the wide
    size, the transformer seeing σ = t, with ratio exactly 1 against the old-policy pass."""
    import json

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in [{"prompt": "a cat", "aspect_ratio": "2:1"},
                                                                   {"prompt": "a dog"}]))
    plugin = make_plugin("flux", prompts=None, dataset=str(prompts), buckets=[[16, 16], [16, 32]],
                         likelihood="matching", num_steps=6, timestep_fraction=0.99, transformer_batch_size=2,
                         matching={"num_times": 3, "time_sampler": "discrete"})
    policy = plugin.policy()
    rows = plugin.dataset("train")
    batch = prompt_batch(["a cat"], 2)
    batch.rows = [rows[0]] * 2
    with plugin.adapter.sized(16, 32):
        wide_grid = plugin.sampler.training_schedule()[0]
    square_grid = plugin.sampler.training_schedule()[0]
    assert not torch.allclose(wide_grid[1:-1], square_grid[1:-1])
    wide = plugin.rollout(policy, batch)
    square_batch = prompt_batch(["a dog"], 2, first_seed=7)
    square_batch.rows = [rows[1]] * 2
    square = plugin.rollout(policy, square_batch)
    assert wide.replay["output_size"].tolist() == [[16, 32]] * 2
    assert wide.replay["clean_latents"].shape[1:] != square.replay["clean_latents"].shape[1:]
    times = wide.replay["matching_times"][:, 0]  # [2, 3]
    index = (times.reshape(-1, 1) - wide_grid.reshape(1, -1)).abs().argmin(dim=1)
    torch.testing.assert_close(times.reshape(-1), wide_grid[index], rtol=0, atol=0)
    seen = []
    hook = policy.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["timestep"].detach()),
                                            with_kwargs=True)
    try:
        current = plugin.forward(policy, wide, need_reference=False).logp
    finally:
        hook.remove()
    for k in range(3):
        torch.testing.assert_close(seen[k].float(), times[:, k], rtol=1e-6, atol=1e-6)
    old = old_policy_pass(plugin, policy, wide, batch_size=1).old_logp
    assert torch.equal(current.detach(), old)


def test_shared_initial_noise_with_an_sde_range_that_holds_no_grid_sigma_is_refused(make_plugin):
    """``share_initial_noise`` passes the config check with an ``sde_sigma_range``, but a range between two grid points
    leaves every step an ODE step: the G samples of a group would be one image (zero advantages, silently)."""
    from mmrl.rollout import RolloutError

    plugin = _matching(make_plugin, None, {"share_initial_noise": True}, sde_sigma_range=[0.3, 0.9], num_times=2)
    grid = plugin.sampler.training_schedule()[0][:-1].tolist()  # [S]
    rollout = plugin.rollout(plugin.policy(), prompt_batch(["a cat"], 2))  # steps in the range: SDE, two images
    assert not torch.equal(rollout.replay["clean_latents"][0], rollout.replay["clean_latents"][1])
    lo = (grid[1] + grid[2]) / 2  # strictly between two grid points
    plugin.matching.config.sde_sigma_range = [lo, lo + 1e-4]
    with pytest.raises(RolloutError, match=r"^plugin\.matching\.sde_sigma_range .* holds no sigma") as error:
        plugin.rollout(plugin.policy(), prompt_batch(["a cat"], 2))
    assert "\n" not in str(error.value)


# ------------------------------------------------------------------------------------------------- the held EMA copy
def _awm_config(train_config, tmp_path, folder, *overrides):
    return train_config("sd3", tmp_path / folder, "algorithm.kl_coef=0.01", "algorithm.action_chunk_size=null",
                        "algorithm.micro_batch_size=4", "eval.save_samples=false", *overrides,
                        likelihood="matching", num_steps=4,
                        matching={"num_times": 2, "time_sampler": "uniform", "ema_kl_coef": 1.0})


def test_a_step_zero_checkpoint_resumes_exactly_and_exports(train_config, tmp_path):
    """The trainer writes a checkpoint at step 0 when a stop signal arrives during the evaluation before step 1,
    before any rollout made the EMA: it holds an empty EMA file (step -1), the resumed run copies the trained weights
    at its first rollout as a run that was never stopped does, and `mmrl export` of it works."""
    from mmrl.policy import export_run

    straight = Trainer(_awm_config(train_config, tmp_path, "straight"))
    history = straight.train().history
    Trainer(_awm_config(train_config, tmp_path, "stopped")).save_checkpoint()  # what a stop before step 1 writes
    export_run(tmp_path / "stopped", tmp_path / "export")
    assert (tmp_path / "export").is_dir()
    resumed = Trainer(_awm_config(train_config, tmp_path, "stopped", "run.resume=latest"))
    assert resumed.plugin.matching.ema is None and resumed.plugin.matching.ema_step == -1
    rest = resumed.train().history
    assert [record["step"] for record in rest] == [record["step"] for record in history] == [1, 2]
    assert [record["loss/total"] for record in rest] == [record["loss/total"] for record in history]
    ema, again = straight.plugin.matching, resumed.plugin.matching
    assert ema.ema_step == again.ema_step == 1
    for name, value in ema.ema.items():
        assert torch.equal(value, again.ema[name]), name


def test_an_ema_file_of_other_parameters_is_refused_at_load_in_one_line(make_plugin, tmp_path):
    """A copy whose names or shapes are not the trained parameters' (another LoRA rank, another model) is refused
    when the checkpoint is loaded, naming the file and the first mismatch, not by a KeyError at the next update."""
    from safetensors.torch import save_file

    plugin = _matching(make_plugin, ema_kl_coef=1.0)
    policy = plugin.policy()
    plugin.rollout(policy, prompt_batch(["a cat"], 2))  # step 0: the EMA is a copy
    plugin.save_trainable(policy, tmp_path / "good")
    plugin.load_trainable(policy, tmp_path / "good")  # its own checkpoint loads
    trained = {name: value.clone() for name, value in plugin.matching.ema.items()}
    first = next(iter(trained))
    cases = {
        "missing": ({k: v for k, v in trained.items() if k != first}, f"lacks '{first}'"),
        "extra": ({**trained, "not.a.parameter": torch.zeros(1)}, "'not.a.parameter' is not a trained parameter"),
        "shape": ({**trained, first: torch.zeros(*trained[first].shape, 2)}, f"'{first}' is"),
    }
    for case, (tensors, why) in cases.items():
        folder = tmp_path / case
        plugin.save_trainable(policy, folder)
        save_file(tensors, str(folder / "matching_ema.safetensors"), metadata={"step": "0"})
        with pytest.raises(ValueError, match="matching_ema.safetensors") as error:
            plugin.load_trainable(policy, folder)
        assert why in str(error.value) and "\n" not in str(error.value), case


def test_a_chunk_size_that_does_not_divide_the_times_is_refused_with_the_ema_kl(train_config, tmp_path):
    """The EMA KL is each backward pass's mean over its (sample, time) pairs, averaged over the step's passes: with
    K = 3 times in chunks of 2 the last chunk's time would weigh twice the others'. A divisor is accepted."""
    matching = {"num_times": 3, "time_sampler": "uniform", "ema_kl_coef": 1.0}
    with pytest.raises(ConfigError, match=r"algorithm\.action_chunk_size") as error:
        train_config("sd3", tmp_path, "algorithm.action_chunk_size=2", likelihood="matching", matching=matching)
    assert "\n" not in str(error.value) and "num_times (3)" in str(error.value)
    train_config("sd3", tmp_path, "algorithm.action_chunk_size=3", likelihood="matching", matching=matching)
    train_config("sd3", tmp_path, "algorithm.action_chunk_size=2", likelihood="matching",
                 matching={**matching, "ema_kl_coef": 0.0})


@pytest.mark.parametrize(("variables", "what"), [
    ({"ACCELERATE_USE_FSDP": "true"}, "FSDP"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, "DeepSpeed ZeRO-3"),
])
def test_a_sharded_launch_with_the_ema_kl_is_refused_at_start_up(make_plugin, monkeypatch, variables, what):
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"plugin\.likelihood") as error:
        _matching(make_plugin, ema_kl_coef=1.0)
    assert what in str(error.value) and "\n" not in str(error.value)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")  # ZeRO-2 keeps whole parameters on every process
    if "ACCELERATE_USE_DEEPSPEED" in variables:
        _matching(make_plugin, ema_kl_coef=1.0)
    _matching(make_plugin)  # no EMA copy: nothing to refuse


def test_a_sharded_parameter_is_refused_when_the_ema_copies_it(make_plugin):
    """A wrapper the start-up check cannot see (ZeRO-3 marks its partitioned parameters with ``ds_id``)."""
    plugin = _matching(make_plugin, ema_kl_coef=1.0)
    policy = plugin.policy()
    next(p for p in policy.parameters() if p.requires_grad).ds_id = 0
    with pytest.raises(RuntimeError, match="shard") as error:
        plugin.rollout(policy, prompt_batch(["a cat"], 2))
    assert "\n" not in str(error.value)
