"""DiffusionNFT (``plugin.likelihood: nft``, ``algorithm.policy_loss: nft``) on the tiny SD3 pipeline.

Every expected value is restated here from the released code (NVlabs/DiffusionNFT@24af555,
``scripts/train_nft_sd3.py``, "L" below): the implicit policies and the adaptive weights (L934-957), the optimality
weight r (L910-929), the loss with its 1/K accumulation over times (L959-983), the old policy's decay (L169-189,
L1034-1039) and its sampling (L640-659); none of them calls :mod:`mmrl.plugins.flow.nft`'s formulas.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mmrl.config import ConfigError, from_dict
from mmrl.plugin import Runtime
from mmrl.plugins.flow.nft import return_decay
from mmrl.plugins.flow.plugin import FlowPluginConfig
from mmrl.seeding import derive_seed
from mmrl.trainer import Trainer
from tests.flow.conftest import plugin_options, prompt_batch

# the documented contract: ε of (sample, epoch, time k) from derive_seed(replay["nft_seeds"][i], 0xA3E2, epoch, k)
# (matching.column_noise's stream, keyed by the sample's nft seed)
NOISE_TAG = 0xA3E2


def _nft(make_plugin, runtime=None, **nft):
    from mmrl.plugin import Runtime

    return make_plugin("sd3", runtime or Runtime(needs_reference=True), likelihood="nft", nft=nft)


def _noise(seeds, epoch, k, shape):
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(
        derive_seed(int(seed), NOISE_TAG, epoch, k))) for seed in seeds.tolist()])


def _randomise(parameters, seed, scale):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in parameters:
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=generator) * scale)


def _record_velocity(plugin):
    calls = []
    original = plugin.sampler.velocity

    def velocity(module, latents, timesteps, conditioning, guidance_scale, *, phase):
        out = original(module, latents, timesteps, conditioning, guidance_scale, phase=phase)
        calls.append((latents.detach().clone(), timesteps.detach().clone(), out))
        return out

    plugin.sampler.velocity = velocity
    return calls


def _upstream_time_terms(v, v_old, x_t, x0, t, beta):
    """L934-957 written out: (positive_loss, negative_loss) ``[n]`` of one time, the weights without gradient."""
    t = t.double().view(-1, 1, 1, 1)
    x_t, x0, v_old = x_t.double(), x0.double(), v_old.detach().double()
    positive_prediction = beta * v.double() + (1 - beta) * v_old
    negative_prediction = (1.0 + beta) * v_old - beta * v.double()
    x0_prediction = x_t - t * positive_prediction
    weight = torch.abs(x0_prediction.detach() - x0).mean(dim=(1, 2, 3), keepdim=True).clip(min=0.00001)
    positive_loss = ((x0_prediction - x0) ** 2 / weight).mean(dim=(1, 2, 3))
    negative_x0_prediction = x_t - t * negative_prediction
    negative_weight = torch.abs(negative_x0_prediction.detach() - x0).mean(dim=(1, 2, 3), keepdim=True).clip(
        min=0.00001)
    negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight).mean(dim=(1, 2, 3))
    return positive_loss, negative_loss


def _upstream_r(advantages, adv_clip_max, adv_mode):
    """L910-929."""
    clipped = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    if adv_mode == "positive_only":
        clipped = torch.clamp(clipped, 0, adv_clip_max)
    elif adv_mode == "negative_only":
        clipped = torch.clamp(clipped, -adv_clip_max, 0)
    elif adv_mode == "one_only":
        clipped = torch.where(clipped > 0, torch.ones_like(clipped), torch.zeros_like(clipped))
    elif adv_mode == "binary":
        clipped = torch.sign(clipped)
    return torch.clamp((clipped / adv_clip_max) / 2.0 + 0.5, 0, 1)


def _old_velocity(plugin, policy, x_t, model_t, conditioning):
    """v_old written out: the plugin's old weights copied into the LoRA parameters, the trained ones put back."""
    parameters = dict(policy.named_parameters())
    kept = {name: parameters[name].detach().clone() for name in plugin.nft.old}
    with torch.no_grad():
        for name, value in plugin.nft.old.items():
            parameters[name].copy_(value)
        v_old = plugin.sampler.velocity(policy, x_t, model_t, conditioning, plugin.sampler.guidance_scale,
                                        phase="forward")
        for name, value in kept.items():
            parameters[name].copy_(value)
    return v_old


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_columns_are_the_implicit_policies_weighted_x0_errors(make_plugin, beta):
    plugin = _nft(make_plugin, beta=beta)
    policy = plugin.policy()
    _randomise(policy.named_parameters(), 0, 0.3)
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog"], 2))  # step 0: old = θ
    _randomise(policy.named_parameters(), 1, 0.3)  # θ moves away from the old policy
    replay = rollout.replay
    k_times = 3  # int(4 steps * 0.99)
    assert rollout.old_logp is None and rollout.mask.shape == (4, 2 * k_times)
    sigmas, timesteps = plugin.sampler.training_schedule()
    steps = replay["nft_steps"][:, 0]  # [4, K]
    assert all(len(set(row)) == k_times for row in steps.tolist())  # K distinct grid steps per sample (L810-816)
    calls = _record_velocity(plugin)
    output = plugin.forward(policy, rollout, need_reference=True)
    assert output.logp.shape == (4, 2 * k_times) and len(calls) == 3 * k_times  # old for each time, then (θ, ref)
    clean = replay["clean_latents"]
    for k in range(k_times):
        t = sigmas[steps[:, k]]  # L864: t = timestep / 1000, σ of the grid step
        noise = _noise(replay["nft_seeds"], 0, k, tuple(clean.shape[1:]))
        x_t = (1 - t.view(-1, 1, 1, 1)) * clean + t.view(-1, 1, 1, 1) * noise  # L870
        old_latents, old_timesteps, v_old = calls[k]
        latents, model_t, v = calls[k_times + 2 * k][:3]
        v_ref = calls[k_times + 2 * k + 1][2]
        torch.testing.assert_close(latents, x_t, rtol=0, atol=1e-6)
        torch.testing.assert_close(old_latents, x_t, rtol=0, atol=1e-6)
        torch.testing.assert_close(model_t, timesteps[steps[:, k]])  # L878: the grid timestep
        torch.testing.assert_close(v_old, _old_velocity(plugin, policy, x_t, model_t, replay["conditioning"]))
        assert float((v_old - v.detach()).abs().max()) > 1e-3  # old ≠ θ
        positive, negative = _upstream_time_terms(v, v_old, x_t, clean, t, beta)
        torch.testing.assert_close(output.logp[:, 2 * k].double(), positive / beta, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(output.logp[:, 2 * k + 1].double(), negative / beta, rtol=1e-5, atol=1e-7)
        kl = ((v.double() - v_ref.double()) ** 2).mean(dim=(1, 2, 3))  # L966-968
        assert float(kl.detach().min()) > 0
        torch.testing.assert_close(output.kl[:, 2 * k].double(), kl, rtol=1e-5, atol=0)
        torch.testing.assert_close(output.kl[:, 2 * k + 1].double(), kl, rtol=1e-5, atol=0)


def _upstream_loss(plugin, policy, rollout, advantages, beta, kl_beta, adv_clip_max, adv_mode):
    """One micro-batch of L853-983: per time j, A_max·mean_b(r·e⁺/β + (1 − r)·e⁻/β) + β_KL·mean_b(kl), each time's
    loss divided by effective_grad_accum_steps = 1·K before its backward (summed here)."""
    replay = rollout.replay
    clean, conditioning = replay["clean_latents"], replay["conditioning"]
    sigmas, timesteps = plugin.sampler.training_schedule()
    k_times = replay["nft_steps"].shape[2]
    r = _upstream_r(advantages.double(), adv_clip_max, adv_mode)
    inputs = []
    for j in range(k_times):  # every v_old first: their weight swaps must not touch a graph in use
        index = replay["nft_steps"][:, 0, j]
        t, model_t = sigmas[index], timesteps[index]
        noise = _noise(replay["nft_seeds"], 0, j, tuple(clean.shape[1:]))
        x_t = (1 - t.view(-1, 1, 1, 1)) * clean + t.view(-1, 1, 1, 1) * noise
        inputs.append((t, model_t, x_t, _old_velocity(plugin, policy, x_t, model_t, conditioning)))
    total = 0.0
    for t, model_t, x_t, v_old in inputs:
        v = plugin.sampler.velocity(policy, x_t, model_t, conditioning, plugin.sampler.guidance_scale,
                                    phase="forward")
        with torch.no_grad(), plugin._reference_module(policy) as reference:
            v_ref = plugin.sampler.velocity(reference, x_t, model_t, conditioning, plugin.sampler.guidance_scale,
                                            phase="forward")
        positive, negative = _upstream_time_terms(v, v_old, x_t, clean, t, beta)
        policy_loss = ((r * positive / beta + (1.0 - r) * negative / beta) * adv_clip_max).mean()
        loss = policy_loss + kl_beta * ((v.double() - v_ref.double()) ** 2).mean(dim=(1, 2, 3)).mean()
        total = total + loss / k_times
    return total


@pytest.mark.parametrize(("beta", "adv_mode", "chunk"), [
    (1.0, "all", None), (0.1, "all", 2), (0.1, "positive_only", None), (1.0, "negative_only", None),
    (0.1, "one_only", None), (1.0, "binary", None),
])
def test_the_learner_loss_and_gradient_are_the_released_loss(train_config, tmp_path, beta, adv_mode, chunk):
    kl_beta, adv_clip_max = 0.3, 2.0
    config = train_config("sd3", tmp_path, f"algorithm.policy_loss={{name: nft, adv_clip_max: {adv_clip_max}, "
                          f"adv_mode: {adv_mode}}}", f"algorithm.kl_coef={kl_beta}",
                          f"algorithm.action_chunk_size={'null' if chunk is None else chunk}",
                          "algorithm.advantage_clip=null", likelihood="nft", nft={"beta": beta})
    trainer = Trainer(config)
    plugin, policy = trainer.plugin, trainer.plugin.policy()
    _randomise(policy.named_parameters(), 0, 0.3)  # away from the reference: a KL with a gradient
    rollout = plugin.rollout(policy, prompt_batch(["a cat"], 4))
    _randomise(policy.named_parameters(), 1, 0.2)  # and away from the old policy
    lora = [p for name, p in policy.named_parameters() if "lora_" in name]
    advantages = torch.tensor([3.5, -2.7, 0.4, -0.9])  # two beyond ±A_max
    expected = _upstream_loss(plugin, policy, rollout, advantages, beta, kl_beta, adv_clip_max, adv_mode)
    expected_grad = torch.autograd.grad(expected, lora)

    n, a = rollout.mask.shape
    lengths = rollout.mask.double().sum(dim=1)
    pieces = [None] if chunk is None else list(torch.arange(a).split(chunk))  # the learner's action chunks
    loss, got_grad = 0.0, [torch.zeros_like(p) for p in lora]
    for columns in pieces:  # one backward per chunk, as the learner (the old weights swap in before each forward)
        part, _, _, _ = trainer.learner._micro_loss(rollout, advantages, True, float(n * a), float(n), a, columns,
                                                    lengths)
        loss = loss + part.detach()
        got_grad = [g + d for g, d in zip(got_grad, torch.autograd.grad(part, lora), strict=True)]
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
    for got, want in zip(got_grad, expected_grad, strict=True):
        # the columns and the core's loss are float32: entries near 0 of a tensor carry its float32 rounding
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    assert max(float(g.abs().max()) for g in expected_grad) > 1e-4


def test_decay_schedules_are_the_released_ones():
    """Hand values of return_decay (L169-189): type 0 flat 0; type 1 0.001·s up to 0.5; type 2 0 before step 75,
    then 0.0075·(s − 75) up to 0.999."""
    assert [return_decay(s, 0) for s in (0, 10, 10_000)] == [0.0, 0.0, 0.0]
    assert [return_decay(s, 1) for s in (0, 1, 250, 499, 500, 10_000)] == pytest.approx(
        [0.0, 0.001, 0.25, 0.499, 0.5, 0.5])
    assert [return_decay(s, 2) for s in (0, 74, 75, 76, 175, 208, 209, 10_000)] == pytest.approx(
        [0.0, 0.0, 0.0, 0.0075, 0.75, 0.9975, 0.999, 0.999])
    with pytest.raises(ValueError, match="decay_type"):
        return_decay(3, 3)


def test_rollouts_sample_with_the_old_policy_which_follows_the_released_ema(make_plugin, tmp_path):
    plugin = _nft(make_plugin, decay_type=1, optimizer_steps_per_step=2)
    policy = plugin.policy()
    trained = {name: p for name, p in policy.named_parameters() if p.requires_grad}
    batch = prompt_batch(["a cat"], 2)
    _randomise(policy.named_parameters(), 0, 0.3)
    first = plugin.rollout(policy, batch)  # step 0: the old policy is a copy of θ₀ (L576-579)
    start = {name: p.detach().clone() for name, p in trained.items()}
    _randomise(policy.named_parameters(), 1, 0.3)  # θ₁
    now = {name: p.detach().clone() for name, p in trained.items()}
    again = plugin.rollout(policy, batch)  # still step 0: no update, the old policy θ₀ samples (L640-659)
    assert all(torch.equal(p, now[name]) for name, p in trained.items())  # θ is back after the rollout
    torch.testing.assert_close(again.replay["clean_latents"], first.replay["clean_latents"], rtol=0, atol=0)
    plugin.nft.old = {name: value.clone() for name, value in now.items()}  # were θ₁ the old policy ...
    by_theta = plugin.rollout(policy, batch)
    assert float((by_theta.replay["clean_latents"] - first.replay["clean_latents"]).abs().max()) > 1e-3  # ... not so
    plugin.nft.old = {name: value.clone() for name, value in start.items()}

    step = 150  # 300 optimizer steps done: d = return_decay(300, 1) = 0.3, written out (L1035-1039)
    plugin.rollout(policy, dataclasses.replace(batch, step=step))
    plugin.rollout(policy, dataclasses.replace(batch, step=step))  # a second rollout batch of the step: no update
    decay = 0.3
    for name, value in plugin.nft.old.items():
        torch.testing.assert_close(value, decay * start[name] + (1 - decay) * now[name], rtol=1e-6, atol=1e-7)
    assert plugin.nft.old_step == step

    plugin.save_trainable(policy, tmp_path / "policy")  # the old policy travels with checkpoints
    saved = {name: value.clone() for name, value in plugin.nft.old.items()}
    plugin.nft.old, plugin.nft.old_step = None, -1
    plugin.load_trainable(policy, tmp_path / "policy")
    assert plugin.nft.old_step == step and all(torch.equal(plugin.nft.old[n], v) for n, v in saved.items())


def test_the_dpm2m_rollout_is_the_released_dpm2_solver(make_plugin):
    """solver.py L207-350 with deterministic=True, restated: DDIM (η = 0) at the first and the last step,
    DPM-Solver++(2M) in the data prediction x̂₀ = x − σ·v between (its first multistep update has h₀ = ∞ at σ = 1)."""
    plugin = _nft(make_plugin, decay_type=0)
    policy = plugin.policy()
    batch = prompt_batch(["a cat"], 1)
    calls = _record_velocity(plugin)
    rollout = plugin.rollout(policy, batch)
    sigmas = plugin.sampler.training_schedule()[0].double()
    x = calls[0][0].double()
    lam = torch.log((1 - sigmas) / sigmas)  # -inf... at σ = 1, +inf at σ = 0 (unused there)
    previous = None
    for i in range(len(sigmas) - 1):
        s, t = sigmas[i], sigmas[i + 1]
        x0 = x - s * calls[i][2].double()
        if i == 0 or i == len(sigmas) - 2:  # ddim_update with eta 0
            noise_pred = (x - (1 - s) * x0) / s
            x = (1 - t) * x0 + t * noise_pred
        else:
            h, h0 = lam[i + 1] - lam[i], lam[i] - lam[i - 1]
            d1 = (1.0 / (h0 / h)) * (x0 - previous)
            x = (t / s) * x - (1 - t) * torch.expm1(-h) * x0 - 0.5 * (1 - t) * torch.expm1(-h) * d1
        previous = x0
        if i + 1 < len(sigmas) - 1:
            torch.testing.assert_close(calls[i + 1][0].double(), x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rollout.replay["clean_latents"].double(), x, rtol=1e-5, atol=1e-5)


def test_two_training_steps_move_the_lora_weights(train_config, tmp_path):
    config = train_config("sd3", tmp_path, "algorithm.policy_loss={name: nft, adv_clip_max: 5.0}",
                          "algorithm.kl_coef=0.01", "algorithm.action_chunk_size=2", "eval.save_samples=false",
                          likelihood="nft", nft={"beta": 0.1, "decay_type": 1})
    trainer = Trainer(config)
    transformer = trainer.plugin.policy()
    before = {name: p.detach().clone() for name, p in transformer.named_parameters() if "lora_B" in name}
    history = trainer.train().history
    assert [record["step"] for record in history] == [1, 2]
    for record in history:
        assert record["loss/first_step_ratio_deviation"] == 0.0
        assert math.isfinite(record["loss/total"])
    assert history[1]["policy/kl"] > 0
    moved = [name for name, p in transformer.named_parameters() if name in before
             and not torch.equal(before[name], p.detach())]
    assert len(moved) > len(before) // 2
    assert trainer.plugin.nft.old_step == 1  # updated before the second step's rollout


def test_two_optimizer_steps_per_rollout_run_no_old_policy_pass(train_config, tmp_path, monkeypatch):
    # The nft loss reads no old_logp (reads_old_logp False): with two mini-batches the learner skips the old-policy
    # pass it would run for a ratio; the core's own readers of old_logp bring it back.
    import mmrl.trainer.learn as learn

    config = train_config("sd3", tmp_path, "algorithm.policy_loss={name: nft}", "algorithm.minibatches=2",
                          "algorithm.action_chunk_size=null", "algorithm.micro_batch_size=2",
                          "eval.save_samples=false", "run.max_steps=1", likelihood="nft",
                          nft={"optimizer_steps_per_step": 2})
    assert not learn.needs_old_logp(config)
    masked = dataclasses.replace(config, algorithm=dataclasses.replace(config.algorithm,
                                                                       off_policy_mask_threshold=0.5))
    assert learn.needs_old_logp(masked)
    passes = []
    real = learn.old_policy_pass
    monkeypatch.setattr(learn, "old_policy_pass", lambda *args, **kwargs: passes.append(1) or real(*args, **kwargs))
    trainer = Trainer(config)
    history = trainer.train().history
    assert passes == [] and trainer.learner.optimizer_steps == 2
    assert math.isfinite(history[0]["loss/total"])


def test_skipping_the_old_policy_pass_trains_exactly_as_running_it(train_config, tmp_path, monkeypatch):
    """Two inner epochs, each on its own draw (start_inner_epoch): the run that skips the pass (reads_old_logp False)
    and the run forced through one pass per epoch (reads_old_logp patched to True) take bit-identical gradients at
    every optimizer step: nothing the nft loss or the plugin reads comes from the pass."""
    from mmrl.trainer import learn
    from tests.helpers import record_gradients

    runs = []
    for forced in (False, True):
        config = train_config("sd3", tmp_path / str(forced), "algorithm.policy_loss={name: nft}",
                              "algorithm.inner_epochs=2", "algorithm.action_chunk_size=null",
                              "algorithm.micro_batch_size=2", "eval.save_samples=false", likelihood="nft",
                              nft={"optimizer_steps_per_step": 2})
        passes: list[int] = []

        def counted(*args, passes=passes, real=learn.old_policy_pass, **kwargs):
            passes.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(learn, "old_policy_pass", counted)
        if forced:
            monkeypatch.setattr(learn, "reads_old_logp", lambda loss, options=None: True)
        trainer = Trainer(config)
        steps = record_gradients(trainer, trainer.policy)
        trainer.train()
        monkeypatch.undo()
        runs.append((steps, len(passes)))
    (skipped, no_passes), (forced, passes) = runs
    assert no_passes == 0 and passes == 4  # 2 steps × one pass per inner epoch
    assert len(skipped) == len(forced) == 4
    for ours, theirs in zip(skipped, forced, strict=True):
        assert ours.keys() == theirs.keys() and ours
        assert all(torch.equal(ours[name], theirs[name]) for name in ours)


@pytest.mark.parametrize(("overrides", "key"), [
    (("algorithm.policy_loss={name: grpo}",), "algorithm.policy_loss.name"),
    (("algorithm.aggregation=seq_mean_token_sum",), "algorithm.aggregation"),
    (("algorithm.action_chunk_size=1",), "algorithm.action_chunk_size"),
    (("algorithm.advantage_clip=2.0",), "algorithm.advantage_clip"),
    (("algorithm.minibatches=2",), "plugin.nft.optimizer_steps_per_step"),
    (("algorithm.policy_loss={name: nft, adv_clip_max: 0.0}",), "algorithm.policy_loss.adv_clip_max"),
    (("algorithm.off_policy_mask_threshold=0.5",), "algorithm.off_policy_mask_threshold"),  # no log-ratio to mask by
])
def test_settings_that_change_the_released_loss_are_refused_in_one_line(train_config, tmp_path, overrides, key):
    base = ["algorithm.policy_loss={name: nft}", "algorithm.action_chunk_size=null", *overrides]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as error:
        train_config("sd3", tmp_path, *base, likelihood="nft")
    assert "\n" not in str(error.value)


def test_the_nft_loss_without_nft_columns_is_refused(train_config, tmp_path):
    with pytest.raises(ConfigError, match=r"algorithm\.policy_loss\.name") as error:
        train_config("sd3", tmp_path, "algorithm.policy_loss={name: nft}", "algorithm.action_chunk_size=null")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("options", "key"), [
    ({"credit": {"strategy": "chunk"}}, "plugin.credit.strategy"),
    ({"credit": {"ratio_norm": True}}, "plugin.credit.ratio_norm"),
    ({"train_steps": "window"}, "plugin.train_steps"),
    ({"decode_latent": "predicted_x0"}, "plugin.decode_latent"),
    ({"share_initial_noise": True}, "plugin.share_initial_noise"),
    ({"num_steps": 4, "timestep_fraction": 0.2}, "plugin.timestep_fraction"),
    ({"nft": {"beta": 0.0}}, "plugin.nft.beta"),
    ({"nft": {"decay_type": 3}}, "plugin.nft.decay_type"),
    ({"nft": {"solver": "unipc"}}, "plugin.nft.solver"),
])
def test_bad_plugin_options_are_refused_in_one_line(pipelines, options, key):
    values = plugin_options(pipelines["sd3"], likelihood="nft", **options)
    values.pop("name")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as error:
        from_dict(FlowPluginConfig, values, "plugin")
    assert "\n" not in str(error.value)


def test_each_inner_epoch_has_its_own_permutation_and_noise(make_plugin):
    """Upstream permutes the times and draws ε anew for every inner epoch (L806-816, L868): with μ = 2 the rollout
    carries two draws, and start_inner_epoch selects the one the forward regenerates."""
    from mmrl.plugin import Runtime

    plugin = _nft(make_plugin, Runtime(inner_epochs=2))
    policy = plugin.policy()
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog"], 2))
    steps = rollout.replay["nft_steps"]  # [4, 2, K]
    assert plugin.redraws_per_epoch and steps.shape == (4, 2, 3)
    assert not torch.equal(steps[:, 0], steps[:, 1])
    clean = rollout.replay["clean_latents"]
    for epoch in range(2):
        plugin.start_inner_epoch(epoch)
        calls = _record_velocity(plugin)
        plugin.forward(policy, rollout, need_reference=False)
        t = plugin.sampler.training_schedule()[0][steps[:, epoch, 0]].view(-1, 1, 1, 1)
        noise = _noise(rollout.replay["nft_seeds"], epoch, 0, tuple(clean.shape[1:]))
        torch.testing.assert_close(calls[0][0], (1 - t) * clean + t * noise, rtol=0, atol=1e-6)
        plugin.sampler.velocity = type(plugin.sampler).velocity.__get__(plugin.sampler)
    plugin.start_inner_epoch(5)
    with pytest.raises(RuntimeError, match="inner epoch 5"):
        plugin.forward(policy, rollout, need_reference=False)


# ------------------------------------------------------------------------------------------------- the held old policy
def _nft_config(train_config, tmp_path, folder, *overrides):
    return train_config("sd3", tmp_path / folder, "algorithm.policy_loss={name: nft, adv_clip_max: 5.0}",
                        "algorithm.kl_coef=0.01", "algorithm.action_chunk_size=2", "eval.save_samples=false",
                        *overrides, likelihood="nft", nft={"beta": 0.1, "decay_type": 1})


def test_a_step_zero_checkpoint_resumes_exactly_and_exports(train_config, tmp_path):
    """A checkpoint written before the first rollout (a stop signal during the evaluation before step 1) holds an
    empty old-policy file (step -1): the resumed run's first rollout copies the trained weights as a run that was
    never stopped does (L576-579), to the same losses, weights and old policy; `mmrl export` of it works."""
    from mmrl.policy import export_run

    straight = Trainer(_nft_config(train_config, tmp_path, "straight"))
    history = straight.train().history
    Trainer(_nft_config(train_config, tmp_path, "stopped")).save_checkpoint()
    export_run(tmp_path / "stopped", tmp_path / "export")
    resumed = Trainer(_nft_config(train_config, tmp_path, "stopped", "run.resume=latest"))
    assert resumed.plugin.nft.old is None and resumed.plugin.nft.old_step == -1
    rest = resumed.train().history
    assert [record["step"] for record in rest] == [record["step"] for record in history] == [1, 2]
    assert [record["loss/total"] for record in rest] == [record["loss/total"] for record in history]
    old, again = straight.plugin.nft, resumed.plugin.nft
    assert old.old_step == again.old_step == 1
    for name, value in old.old.items():
        assert torch.equal(value, again.old[name]), name
    mine = dict(resumed.plugin.policy().named_parameters())
    for name, parameter in straight.plugin.policy().named_parameters():
        if parameter.requires_grad:
            assert torch.equal(parameter.detach(), mine[name].detach()), name


def test_an_old_policy_file_of_other_parameters_is_refused_at_load_in_one_line(make_plugin, tmp_path):
    from safetensors.torch import save_file

    plugin = _nft(make_plugin)
    policy = plugin.policy()
    plugin.rollout(policy, prompt_batch(["a cat"], 2))
    plugin.save_trainable(policy, tmp_path / "good")
    plugin.load_trainable(policy, tmp_path / "good")
    trained = {name: value.clone() for name, value in plugin.nft.old.items()}
    first = next(iter(trained))
    for case, tensors in {"missing": {k: v for k, v in trained.items() if k != first},
                          "shape": {**trained, first: trained[first][:1]}}.items():
        folder = tmp_path / case
        plugin.save_trainable(policy, folder)
        save_file(tensors, str(folder / "nft_old.safetensors"), metadata={"step": "3"})
        with pytest.raises(ValueError, match=r"nft_old\.safetensors") as error:
            plugin.load_trainable(policy, folder)
        assert repr(first) in str(error.value) and "\n" not in str(error.value), case


def test_a_sharded_launch_is_refused_at_start_up(make_plugin, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match=r"plugin\.likelihood") as error:
        _nft(make_plugin)
    assert "FSDP" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(("kind", "likelihood"), [("wan22_ti2v_i2v", "nft"), ("wan22_ti2v_i2v", "matching"),
                                                 ("wan22_i2v", "nft")])
def test_wan22_ti2v_image_to_video_is_refused(tmp_path_factory, kind, likelihood):
    """Wan 2.2 TI2V-5B's image is the first latent frame of the latent the errors are taken over (at timestep 0,
    replaced before decoding): refused in one line for nft and matching. Wan 2.2 I2V-A14B gives the image through
    extra channels and generates every latent frame: accepted."""
    from mmrl.plugins.flow.plugin import FlowPlugin
    from mmrl.plugins.flow.testing import save_tiny_pipeline
    from tests.flow.checks import write_image_rows

    root = tmp_path_factory.getbasetemp() / f"nft_{kind}"
    if not root.is_dir():
        save_tiny_pipeline(kind, root)
    rows = write_image_rows(tmp_path_factory.mktemp("frames"), [("a cat walks", (16, 16))])
    options = plugin_options(root, likelihood=likelihood, dataset=str(rows), prompts=None, eval_prompts=None,
                             num_frames=5, **({"matching": {"num_times": 2}} if likelihood == "matching" else {}))
    options.pop("name")
    config = from_dict(FlowPluginConfig, options, "plugin")
    if kind != "wan22_ti2v_i2v":
        assert FlowPlugin(config, Runtime()).adapter.name == "wan_i2v"
        return
    with pytest.raises(ConfigError, match=r"plugin\.likelihood") as error:
        FlowPlugin(config, Runtime())
    assert "TI2V-5B" in str(error.value) and "\n" not in str(error.value)
