"""The flow plugin against tiny SD3 and FLUX pipelines, without the trainer: sampling, recomputation, KL, LoRA
checkpoints, loading errors."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys

import pytest
import torch

from mmrl.config import ConfigError
from mmrl.plugin import Runtime
from tests.flow.checks import perturb_lora as _perturb_lora
from tests.flow.checks import ratio_deviation as _ratio_deviation
from tests.flow.conftest import prompt_batch

MODELS = [("sd3", True), ("sd3", False), ("flux", False)]
MODEL_IDS = ["sd3-cfg", "sd3-nocfg", "flux"]


@pytest.mark.parametrize(("kind", "cfg"), MODELS, ids=MODEL_IDS)
def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(make_plugin, kind, cfg):
    plugin = make_plugin(kind, cfg=cfg)
    _perturb_lora(plugin)  # a non-trivial policy
    policy = plugin.policy()
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog", "a red car"], 2)).validate()
    assert rollout.old_logp.shape == rollout.mask.shape == (6, 3)
    assert rollout.replay["latents"].dtype == rollout.replay["next_latents"].dtype == torch.float32
    with torch.no_grad():
        for split in ([0, 1, 2, 3, 4, 5], [5], [4, 0, 2], [1, 3]):  # other sizes, orders and companions
            part = rollout.select(torch.tensor(split))
            assert _ratio_deviation(plugin.forward(policy, part, need_reference=False), part) < 1e-5
        for column in range(3):  # one denoising step at a time, as with algorithm.action_chunk_size: 1
            part = rollout.select(torch.tensor([2, 5])).select_actions(torch.tensor([column]))
            output = plugin.forward(policy, part, need_reference=False, actions=torch.tensor([column]))
            assert output.logp.shape == (2, 1)
            assert _ratio_deviation(output, part) < 1e-5
        _perturb_lora(plugin, seed=1)  # the check can fail: other weights move the ratio
        assert _ratio_deviation(plugin.forward(policy, rollout, need_reference=False), rollout) > 1e-3


def test_transformer_rows_are_counted_under_the_phase_each_call_names(make_plugin):
    """The sampler counts transformer rows by the phase each velocity call passes (there is no phase state): an
    evaluation between a rollout and its forward takes none of their rows, and the reference pass counts as forward."""
    plugin = make_plugin("sd3")
    policy = plugin.policy()
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog"], 2))  # 4 samples x 4 steps (CFG counts once)
    assert plugin.model_evaluations == {"rollout": 16, "forward": 0, "evaluation": 0}
    plugin.rollout(policy, prompt_batch(["a cat"], 1, training=False))  # 1 sample x 3 evaluation steps
    assert plugin.model_evaluations == {"rollout": 16, "forward": 0, "evaluation": 3}
    with torch.no_grad():
        plugin.forward(policy, rollout, need_reference=True)  # 4 samples x 3 trained steps, policy and reference
    assert plugin.model_evaluations == {"rollout": 16, "forward": 24, "evaluation": 3}
    assert plugin.model_evaluations is plugin.sampler.model_evaluations


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_fixed_transformer_batches_make_velocities_independent_of_the_batch(make_plugin, kind):
    plugin = make_plugin(kind, transformer_batch_size=4)
    _perturb_lora(plugin)
    rollout = plugin.rollout(plugin.policy(), prompt_batch(["a cat", "a dog", "a red car"], 2))
    replay = rollout.replay
    with torch.no_grad():
        whole = plugin.sampler.velocity(plugin.policy(), replay["latents"][:, 1], replay["timesteps"][:, 1],
                                        replay["conditioning"], plugin.guidance_scale, phase="forward")
        index = torch.tensor([4, 1])
        part = plugin.sampler.velocity(plugin.policy(), replay["latents"][index, 1], replay["timesteps"][index, 1],
                                       {k: v[index] for k, v in replay["conditioning"].items()}, plugin.guidance_scale,
                                       phase="forward")
    assert torch.equal(part, whole[index])  # bit-exact, not merely close


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_kl_to_the_reference_is_zero_at_start_and_grows_with_the_adapter(make_plugin, kind):
    plugin = make_plugin(kind)
    policy = plugin.policy()
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog"], 2))
    output = plugin.forward(policy, rollout, need_reference=True)
    assert output.kl.shape == (4, 3)
    assert output.kl.abs().max() == 0  # B = 0: the adapter is the identity
    _perturb_lora(plugin)
    output = plugin.forward(policy, rollout, need_reference=True)
    assert (output.kl > 0).all()
    output.kl.sum().backward()  # the KL carries gradients to the adapter
    grads = [p.grad for n, p in policy.named_parameters() if "lora_" in n]
    assert grads and all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    with torch.no_grad():  # the reference pass leaves the adapter enabled
        assert torch.equal(plugin.forward(policy, rollout, need_reference=False).logp, output.logp.detach())
    assert not any(module.disable_adapters for module in policy.modules() if hasattr(module, "lora_A"))


def test_flow_grpo_kl_is_the_exact_kl_times_the_step_size(make_plugin):
    """Flow-GRPO's KL divides by 2s² where the exact one divides by 2s²Δ (flow_grpo#22)."""
    flow_grpo, exact = make_plugin("sd3"), make_plugin("sd3", kl_variance="transition")
    for plugin in (flow_grpo, exact):
        _perturb_lora(plugin)
    rollout = flow_grpo.rollout(flow_grpo.policy(), prompt_batch(["a cat"], 2))
    with torch.no_grad():
        a = flow_grpo.forward(flow_grpo.policy(), rollout, need_reference=True).kl
        b = exact.forward(exact.policy(), rollout, need_reference=True).kl
    delta = rollout.replay["sigmas"] - rollout.replay["sigmas_next"]
    torch.testing.assert_close(a, b * delta, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("kind", ["sd3", "flux"])
@pytest.mark.parametrize(("height", "width"), [(16, 16), (16, 32), (32, 16)], ids=["16x16", "16x32", "32x16"])
def test_evaluation_is_the_diffusers_pipeline_ode(make_plugin, kind, height, width):
    # Non-square sizes too: FLUX's image position ids and its unpacking read height and width separately, so a
    # transposed grid gives other pixels than the pipeline's.
    plugin = make_plugin(kind, eval_num_steps=5, eval_guidance_scale=3.0, height=height, width=width)
    prompts = ["a cat", "a red dog"]
    batch = prompt_batch(prompts, 1, first_seed=5, training=False)
    rollout = plugin.rollout(plugin.policy(), batch).validate()
    assert rollout.num_actions == 0 and rollout.payload["prompts"] == prompts
    assert rollout.payload["images"].shape == (2, 3, height, width)
    generators = [torch.Generator().manual_seed(seed) for seed in (5, 6)]
    with torch.no_grad():
        expected = plugin.adapter.pipeline(prompts, height=height, width=width, num_inference_steps=5,
                                           guidance_scale=3.0, generator=generators, output_type="pt",
                                           max_sequence_length=8).images
    torch.testing.assert_close(rollout.payload["images"], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_shared_initial_noise_is_per_group(make_plugin, kind):
    batch = prompt_batch(["a cat", "a dog", "a cat"], 3)  # the third group repeats a prompt: noise still differs
    plugin = make_plugin(kind, share_initial_noise=True)
    shared = plugin.rollout(plugin.policy(), batch)
    start = shared.replay["latents"][:, 0].reshape(3, 3, -1)  # x at σ = 1, [group, member, ...]
    for group in range(3):
        assert all(torch.equal(start[group, 0], start[group, k]) for k in (1, 2))
    assert not torch.equal(start[0, 0], start[1, 0]) and not torch.equal(start[0, 0], start[2, 0])
    assert not torch.equal(shared.replay["next_latents"][0, 0], shared.replay["next_latents"][1, 0])  # SDE noise
    plugin.config.share_initial_noise = False
    independent = plugin.rollout(plugin.policy(), batch).replay["latents"][:, 0]
    assert not torch.equal(independent[0], independent[1])


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_decode_latent_predicted_x0_decodes_the_last_steps_prediction(make_plugin, kind):
    # DanceGRPO's trainers decode x − σ·v of the last step (its pred_original_sample) for the reward, not the noisy
    # sample after it. Record the sampler's last model call and what the adapter decodes.
    batch = prompt_batch(["a cat", "a dog"], 2)
    results = {}
    for mode in ("sample", "predicted_x0"):
        plugin = make_plugin(kind, sde="dance_grpo", noise_level=0.3, decode_latent=mode)
        sampler, calls, decoded = plugin.sampler, [], []
        velocity, decode = sampler.velocity, plugin.adapter.decode

        def recorded_velocity(module, latents, *args, _velocity=velocity, _calls=calls, **kwargs):
            out = _velocity(module, latents, *args, **kwargs)
            _calls.append((latents.clone(), out.clone()))
            return out

        def recorded_decode(latents, _decode=decode, _decoded=decoded):
            _decoded.append(latents.clone())
            return _decode(latents)

        sampler.velocity, plugin.adapter.decode = recorded_velocity, recorded_decode
        rollout = plugin.rollout(plugin.policy(), batch)
        assert len(calls) == plugin.config.num_steps and len(decoded) == 1
        results[mode] = rollout, calls, decoded[0]
    last_sigma = plugin.adapter.schedule(plugin.config.num_steps)[0][-2]
    x_last, v_last = results["predicted_x0"][1][-1]
    torch.testing.assert_close(results["predicted_x0"][2], x_last.float() - last_sigma * v_last.float())
    assert not torch.allclose(results["sample"][2], results["predicted_x0"][2], atol=1e-3)  # the last step's noise
    for key in ("latents", "next_latents", "step_index"):  # the trajectories are the same
        assert torch.equal(results["sample"][0].replay[key], results["predicted_x0"][0].replay[key])
    torch.testing.assert_close(results["sample"][0].old_logp, results["predicted_x0"][0].old_logp)


def _dance_grpo_grid(shift: float, num_steps: int) -> torch.Tensor:
    """DanceGRPO's σ grid as its trainers build it (XueZeyue/DanceGRPO@15cc71d fastvideo/train_grpo_flux.py:127-128,
    311-313), written out: sd3_time_shift(shift, linspace(1, 0, S + 1))."""
    t = [1 - i / num_steps for i in range(num_steps + 1)]
    return torch.tensor([shift * x / (1 + (shift - 1) * x) for x in t], dtype=torch.float64)


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_static_shift_steps_training_rollouts_on_dance_grpos_grid(make_plugin, kind):
    # DanceGRPO's lineage builds SD3's static shift 3 on linspace(1, 0, S + 1) for every model, where the pipelines
    # (FLUX: resolution-dependent dynamic shift) build their own. Training rollouts follow plugin.static_shift;
    # evaluation keeps the pipeline's grid.
    plugin = make_plugin(kind, static_shift=3.0, num_steps=6, eval_num_steps=3, train_steps="random",
                         timestep_fraction=0.6)
    expected = _dance_grpo_grid(3.0, 6)
    sigmas, timesteps = plugin.sampler.training_schedule()
    torch.testing.assert_close(sigmas.double(), expected, rtol=1e-6, atol=1e-7)
    assert sigmas[0] == 1 and sigmas[-1] == 0
    torch.testing.assert_close(timesteps.double(), expected[:-1] * 1000, rtol=1e-6, atol=1e-4)
    assert not torch.allclose(sigmas, plugin.adapter.schedule(6)[0])  # not the pipeline's grid
    plugin.adapter.set_size(64, 32)  # whatever the resolution
    torch.testing.assert_close(plugin.sampler.training_schedule()[0], sigmas)
    plugin.adapter.set_size(plugin.config.resolution, plugin.config.resolution)
    rollout = plugin.rollout(plugin.policy(), prompt_batch(["a cat", "a dog"], 2))
    steps = rollout.replay["step_index"]
    torch.testing.assert_close(rollout.replay["sigmas"], sigmas[steps])
    torch.testing.assert_close(rollout.replay["timesteps"], timesteps[steps])
    seen = []
    velocity = plugin.sampler.velocity

    def recorded(module, latents, step_timesteps, *args, **kwargs):
        seen.append(step_timesteps[0].item())
        return velocity(module, latents, step_timesteps, *args, **kwargs)

    plugin.sampler.velocity = recorded
    plugin.sampler.evaluation_rollout(plugin.policy(), prompt_batch(["a cat"], 1, training=False))
    assert seen == plugin.adapter.schedule(3)[1].tolist()  # the pipeline's grid at evaluation


def test_rollout_does_not_depend_on_how_samples_are_batched(make_plugin):
    plugin = make_plugin("sd3", transformer_batch_size=2, train_steps="random", timestep_fraction=0.5)
    batch = prompt_batch(["a cat", "a dog"], 2)
    whole = plugin.rollout(plugin.policy(), batch)
    halves = [plugin.rollout(plugin.policy(), prompt_batch([prompt], 2, first_seed=100 + 2 * i, first_group=i))
              for i, prompt in enumerate(["a cat", "a dog"])]
    for key in ("latents", "next_latents", "step_index"):
        assert torch.equal(whole.replay[key], torch.cat([h.replay[key] for h in halves]))
    assert torch.equal(whole.payload["images"], torch.cat([h.payload["images"] for h in halves]))


@pytest.mark.parametrize("selection", ["fraction", "random", "window"])
def test_stored_steps_follow_the_step_selection(make_plugin, selection):
    plugin = make_plugin("flux", num_steps=6, train_steps=selection, timestep_fraction=0.5, window_size=2,
                         window_range=[1, 5])
    rollout = plugin.rollout(plugin.policy(), prompt_batch(["a cat", "a dog"], 2))
    steps = rollout.replay["step_index"]
    expected_width = {"fraction": 3, "random": 2, "window": 2}[selection]
    assert steps.shape == rollout.mask.shape == (4, expected_width) and rollout.mask.all()
    assert plugin.max_actions() == expected_width
    sigmas, _ = plugin.adapter.schedule(6)
    assert torch.equal(rollout.replay["sigmas"], sigmas[steps])
    assert torch.equal(rollout.replay["sigmas_next"], sigmas[steps + 1])
    if selection == "fraction":
        assert torch.equal(steps, torch.arange(3).expand(4, 3))
    if selection == "random":
        assert steps.max() <= 4  # the last step (5) is never trained
    if selection == "window":
        assert (steps[:, 1] == steps[:, 0] + 1).all() and steps.min() >= 1 and steps.max() <= 4
        assert torch.equal(steps[0], steps[1]) and torch.equal(steps[2], steps[3])
    # Consecutive trained steps chain: x after step k is x before step k + 1.
    for n in range(4):
        for j in range(expected_width - 1):
            if steps[n, j + 1] == steps[n, j] + 1:
                assert torch.equal(rollout.replay["next_latents"][n, j], rollout.replay["latents"][n, j + 1])


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_saved_adapter_reproduces_the_policy_and_loads_into_diffusers(make_plugin, kind, tmp_path):
    trained = make_plugin(kind)
    _perturb_lora(trained)
    trained.save_trainable(trained.policy(), tmp_path / "policy")
    assert (tmp_path / "policy" / "pytorch_lora_weights.safetensors").is_file()
    rollout = trained.rollout(trained.policy(), prompt_batch(["a cat"], 2))
    fresh = make_plugin(kind)
    fresh.load_trainable(fresh.policy(), tmp_path / "policy")
    with torch.no_grad():
        expected = trained.forward(trained.policy(), rollout, need_reference=False).logp
        assert torch.equal(fresh.forward(fresh.policy(), rollout, need_reference=False).logp, expected)
        # A plain diffusers pipeline loads the same adapter with load_lora_weights.
        pipeline = type(fresh.adapter.pipeline).from_pretrained(fresh.config.model)
        pipeline.load_lora_weights(str(tmp_path / "policy"))
        latents = rollout.replay["latents"][:, 1]
        conditioning = rollout.replay["conditioning"]
        timesteps = rollout.replay["timesteps"][:, 1]
        ours = trained.adapter.call_transformer(trained.policy(), latents, timesteps, conditioning, 3.5)
        theirs = trained.adapter.call_transformer(pipeline.transformer, latents, timesteps, conditioning, 3.5)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)


def test_loading_an_adapter_of_another_rank_fails_clearly(make_plugin, tmp_path):
    saved = make_plugin("sd3")
    saved.save_trainable(saved.policy(), tmp_path)
    other = make_plugin("sd3", lora={"rank": 2, "alpha": 8})
    with pytest.raises(ValueError, match="rank 4"):
        other.load_trainable(other.policy(), tmp_path)
    with pytest.raises(FileNotFoundError, match="pytorch_lora_weights"):
        other.load_trainable(other.policy(), tmp_path / "absent")


def test_adapter_is_saved_from_the_gathered_state_by_the_main_process_only(make_plugin, tmp_path):
    from safetensors.torch import load_file

    # Under FSDP/ZeRO-3 local parameters are shards: the adapter must come from Runtime.full_state_dict.
    def gathered(module):
        return {name: torch.full_like(value, 0.25) if "lora_" in name else value
                for name, value in module.state_dict().items()}

    plugin = make_plugin("flux", runtime=Runtime(full_state_dict=gathered))
    plugin.save_trainable(plugin.policy(), tmp_path / "main")
    saved = load_file(str(tmp_path / "main" / "pytorch_lora_weights.safetensors"))
    assert len(saved) == sum(1 for name, _ in plugin.policy().named_parameters() if "lora_" in name)
    assert all(bool((tensor == 0.25).all()) for tensor in saved.values())

    calls = []
    other = make_plugin("flux", runtime=Runtime(process_index=1, num_processes=2,
                                                full_state_dict=lambda module: calls.append(1) or {}))
    other.save_trainable(other.policy(), tmp_path / "other")
    assert calls == [1] and not (tmp_path / "other").exists()

    incomplete = make_plugin("flux", runtime=Runtime(full_state_dict=lambda module: {}))
    with pytest.raises(RuntimeError, match="refusing to save trainable weights"):
        incomplete.save_trainable(incomplete.policy(), tmp_path / "incomplete")
    assert not (tmp_path / "incomplete").exists()


def test_full_fine_tuning_trains_every_transformer_weight_against_a_frozen_copy(make_plugin):
    plugin = make_plugin("sd3", runtime=Runtime(needs_reference=True), lora=None, cfg=False)
    policy = plugin.policy()
    assert all(p.requires_grad and p.dtype == torch.float32 for p in policy.parameters())
    assert not any(p.requires_grad for p in plugin.adapter.vae.parameters())
    rollout = plugin.rollout(policy, prompt_batch(["a cat"], 2))
    assert plugin.forward(policy, rollout, need_reference=True).kl.abs().max() == 0
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    assert (plugin.forward(policy, rollout, need_reference=True).kl > 0).all()
    # reference_module() (algorithm.ref_sync_every) is the copy forward scores with: moved onto the policy, KL 0
    reference = plugin.reference_module()
    with torch.no_grad():
        for target, p in zip(reference.parameters(), policy.parameters(), strict=True):
            target.copy_(p)
    assert plugin.forward(policy, rollout, need_reference=True).kl.abs().max() == 0
    assert make_plugin("sd3", runtime=Runtime(needs_reference=True)).reference_module() is None  # LoRA
    no_copy = make_plugin("sd3", lora=None, cfg=False)  # kl_coef = 0: no copy is kept
    assert no_copy.reference is None
    with pytest.raises(RuntimeError, match="needs_reference"):
        no_copy.forward(no_copy.policy(), rollout, need_reference=True)


def test_mixed_precision_keeps_log_prob_math_and_adapter_in_float32(make_plugin):
    runtime = Runtime(mixed_precision="bf16", autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    plugin = make_plugin("flux", runtime=runtime, transformer_batch_size=2)
    policy = plugin.policy()
    assert {p.dtype for p in policy.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in policy.parameters() if not p.requires_grad} == {torch.bfloat16}
    _perturb_lora(plugin)
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog"], 2))
    assert rollout.old_logp.dtype == rollout.replay["next_latents"].dtype == torch.float32
    with torch.no_grad():
        part = rollout.select(torch.tensor([3, 0, 1]))
        assert _ratio_deviation(plugin.forward(policy, part, need_reference=False), part) < 1e-5


def test_cfg_is_refused_for_a_guidance_distilled_model(make_plugin):
    with pytest.raises(ConfigError, match="plugin.cfg"):
        make_plugin("flux", cfg=True)


def test_a_guidance_scale_without_the_cfg_pass_is_refused(make_plugin):
    """SD3 is guided only by the unconditional pass: cfg false with a scale other than 1 would be silently unguided."""
    for key in ("guidance_scale", "eval_guidance_scale"):
        with pytest.raises(ConfigError, match=f"plugin.{key}"):
            make_plugin("sd3", cfg=False, **{key: 4.5})
    plugin = make_plugin("sd3", cfg=False)  # null resolves to 1.0 (the adapter's 4.5 is the CFG pass's scale)
    assert (plugin.guidance_scale, plugin.eval_guidance_scale) == (1.0, 1.0)
    assert make_plugin("sd3", cfg=False, guidance_scale=1.0).guidance_scale == 1.0
    assert make_plugin("flux", guidance_scale=2.0).guidance_scale == 2.0  # FLUX: the guidance embedding's value
    # the config's own resolution, which tools that sample without the plugin use (the shapes requirements tool)
    from mmrl.plugins.flow.plugin import FlowPluginConfig

    assert FlowPluginConfig(model="m", cfg=False).resolved_guidance_scales(4.5, guided_by_cfg=True) == (1.0, 1.0)
    assert FlowPluginConfig(model="m").resolved_guidance_scales(4.5, guided_by_cfg=True) == (4.5, 4.5)
    assert FlowPluginConfig(model="m", cfg=False).resolved_guidance_scales(3.5) == (3.5, 3.5)


def test_resolution_must_fit_the_vae_and_patches(make_plugin):
    with pytest.raises(ConfigError, match="plugin.resolution"):
        make_plugin("flux", resolution=18)


def test_a_folder_without_weights_fails_with_one_line_naming_it(make_plugin, pipelines, tmp_path):
    broken = tmp_path / "no-weights"
    shutil.copytree(pipelines["sd3"], broken)
    (broken / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as error:
        make_plugin("sd3", model=str(broken))
    message = str(error.value)
    assert str(broken) in message and "transformer/" in message and "\n" not in message
    with pytest.raises(FileNotFoundError, match="no such pipeline folder"):
        make_plugin("sd3", model=str(tmp_path / "missing" / "folder"))
    (broken / "model_index.json").unlink()
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        make_plugin("sd3", model=str(broken))


def test_adapter_is_detected_from_model_index_and_new_adapters_register(make_plugin):
    from mmrl.plugins.flow.adapters import flow_adapters
    from mmrl.plugins.flow.adapters.sd3 import SD3Adapter

    assert make_plugin("sd3").adapter.name == "sd3"
    assert make_plugin("flux").adapter.name == "flux"

    class ImageStreamOnly(SD3Adapter):  # a "new model" in one class: LoRA on the image stream only
        name = "sd3-image-stream"
        lora_target_modules = ("attn.to_q", "attn.to_v")

    flow_adapters.register("sd3-image-stream", ImageStreamOnly)
    plugin = make_plugin("sd3", adapter="sd3-image-stream")
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in plugin.policy().named_parameters() if "lora_" in n}
    assert adapted == {"to_q", "to_v"}


def test_prompt_embeddings_are_encoded_once_per_prompt(make_plugin):
    plugin = make_plugin("sd3", embedding_cache_size=2)
    calls = []
    encode = plugin.adapter.encode_prompts
    plugin.adapter.encode_prompts = lambda prompts, length: calls.append(list(prompts)) or encode(prompts, length)
    first = plugin.sampler.conditioning(["a cat", "a dog", "a cat"])
    again = plugin.sampler.conditioning(["a dog", "a cat"])
    assert calls == [["a cat", "a dog"]]
    assert torch.equal(again["prompt_embeds"], first["prompt_embeds"][[1, 0]])
    plugin.sampler.conditioning(["a red car"])  # evicts the least recently used ("a dog")
    plugin.sampler.conditioning(["a cat"])
    plugin.sampler.conditioning(["a dog"])
    assert calls == [["a cat", "a dog"], ["a red car"], ["a dog"]]


def test_prompt_files(make_plugin, tmp_path):
    from mmrl.config import from_dict
    from mmrl.plugins.flow.config import FlowPluginConfig, load_rows

    folder = tmp_path / "prompts"
    folder.mkdir()
    (folder / "train.txt").write_text("a cat\n\na dog\n")
    (folder / "test_metadata.jsonl").write_text('{"prompt": "two cats", "count": 2}\n')
    config = from_dict(FlowPluginConfig, {"model": "unused", "dataset": str(folder)}, "plugin")
    assert load_rows(config, "train") == [{"prompt": "a cat"}, {"prompt": "a dog"}]
    assert load_rows(config, "eval") == [{"prompt": "two cats", "count": 2}]
    (folder / "bad.jsonl").write_text('{"text": "no prompt"}\n')
    bad = from_dict(FlowPluginConfig, {"model": "unused", "dataset": str(folder / "bad.jsonl")}, "plugin")
    with pytest.raises(ValueError, match="line 1"):
        load_rows(bad, "train")


def test_importing_the_plugin_package_does_not_import_diffusers():
    code = ("import sys, mmrl.plugins.flow, mmrl.plugins.flow.plugin, mmrl.plugins.flow.adapters\n"
            "from mmrl.plugin import plugin_registry\n"
            "assert plugin_registry.get('flow').name == 'flow'\n"
            "assert 'diffusers' not in sys.modules, 'diffusers imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_an_action_of_weight_zero_adds_no_kl_when_recomputed_only_for_the_graph(make_plugin):
    """The trainer weights the policy term only; a forward in which no action is trained still recomputes one (the
    backward needs a graph), and its KL to the reference must not enter the loss either."""
    plugin = make_plugin("sd3")
    _perturb_lora(plugin)  # the KL is not 0
    policy = plugin.policy()
    rollout = plugin.rollout(policy, prompt_batch(["a cat"], 2))
    rollout.action_weights = torch.zeros_like(rollout.mask)
    output = plugin.forward(policy, rollout, need_reference=True)
    assert output.logp.requires_grad and output.kl.requires_grad
    assert torch.equal(output.kl.detach(), torch.zeros_like(output.kl))


def test_cps_steps_are_scored_with_flow_grpos_objective_unless_the_exact_density_is_asked_for(make_plugin):
    """``sde: cps`` scores a step with Flow-GRPO's −mean((x' − μ)²) by default; ``cps_log_prob: gaussian`` with the
    exact log-density −mean((x' − μ)²)/(2·std²) − log std − log √(2π), std = σ_next·sin(a·π/2)."""
    default = make_plugin("sd3", sde="cps", noise_level=0.8)
    exact = make_plugin("sd3", sde="cps", noise_level=0.8, cps_log_prob="gaussian")
    assert default.config.cps_log_prob == "flow_grpo"
    rollout = default.rollout(default.policy(), prompt_batch(["a cat"], 2))
    with torch.no_grad():
        objective = default.forward(default.policy(), rollout, need_reference=False).logp  # [2, 3]
        density = exact.forward(exact.policy(), rollout, need_reference=False).logp
    assert (objective < 0).all()
    torch.testing.assert_close(objective, rollout.old_logp)  # ratio 1 on policy
    std = rollout.replay["sigmas_next"] * math.sin(0.8 * math.pi / 2)  # [2, 3]
    expected = objective / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(density, expected, rtol=1e-5, atol=1e-5)


CPS = {"sde": "cps", "noise_level": 0.8, "num_steps": 4}


@pytest.mark.parametrize(("options", "key"), [
    ({"timestep_fraction": 1.0}, "plugin.timestep_fraction"),
    ({"train_steps": "window", "window_size": 2, "window_range": [2, 4]}, "plugin.window_range"),
    ({"train_steps": "window", "window_size": 4}, "plugin.window_range"),  # the default range is then [0, 4)
    ({"timestep_fraction": 1.0, "credit": {"strategy": "chunk", "chunk": {"sizes": [2, 2]}}},
     "plugin.timestep_fraction"),
    ({"credit": {"strategy": "branch", "branch": {"points": [0, 3]}}}, "plugin.credit.branch.points"),
    ({"credit": {"strategy": "tree", "tree": {"split_points": [0, 3], "sde_steps": "splits"}}},
     "plugin.credit.tree.split_points"),
], ids=["fraction", "window", "default-window", "chunk", "branch", "tree"])
def test_no_strategy_trains_the_deterministic_last_cps_step(options, key):
    """CPS's std σ_next·sin(a·π/2) is 0 at the last step: its KL to the reference is inf (means differ) or NaN (equal
    means) and it has no log-prob to train. 'step' (and 'chunk') with timestep_fraction 1.0 or a window reaching the
    last step used to train it; the other strategies already refused it."""
    from mmrl.config import from_dict
    from mmrl.plugins.flow.plugin import FlowPluginConfig

    with pytest.raises(ConfigError) as error:
        from_dict(FlowPluginConfig, {"model": "unused", "prompts": ["a"], **CPS, **options}, "plugin")
    assert error.value.key == key and "\n" not in str(error.value)
    # The same selection is fine for an SDE that is stochastic at the last step, and so is cps without that step.
    from_dict(FlowPluginConfig, {"model": "unused", "prompts": ["a"], **CPS, **options, "sde": "flow_grpo"}, "plugin")
    # sliding_window never reaches the last step, whatever the SDE (MixGRPO's range, tests/flow/test_credit_*.py).
    for allowed in ({"timestep_fraction": 0.99}, {"train_steps": "window", "window_size": 2, "window_range": [1, 3]},
                    {"credit": {"strategy": "sliding_window", "sliding_window": {"size": 2}}}):
        from_dict(FlowPluginConfig, {"model": "unused", "prompts": ["a"], **CPS, **allowed}, "plugin")


def test_a_registered_strategy_that_trains_the_last_cps_step_stops_the_rollout(make_plugin):
    from mmrl.rollout import RolloutError

    plugin = make_plugin("sd3", **CPS)
    plugin.config.timestep_fraction = 1.0  # past the config check, as a strategy choosing its own steps could be
    with pytest.raises(RolloutError, match="last step with sde 'cps'"):
        plugin.rollout(plugin.policy(), prompt_batch(["a cat"], 2))


@pytest.mark.parametrize("sde", ["flow_grpo", "dance_grpo", "cps"])
def test_zero_noise_is_refused_for_training(sde):
    from mmrl.config import from_dict
    from mmrl.plugins.flow.plugin import FlowPluginConfig

    with pytest.raises(ConfigError) as error:
        from_dict(FlowPluginConfig, {"model": "unused", "prompts": ["a"], "sde": sde, "noise_level": 0.0}, "plugin")
    assert error.value.key == "plugin.noise_level"


def test_a_registered_sde_kind_drives_rollouts_and_forwards(make_plugin):
    """A kind registered in sde_kind_registry (here DanceGRPO's SDE under another name) is selected by plugin.sde and
    samples exactly as the kind it copies; the forward reproduces the rollout's log-probs (ratio 1)."""
    from mmrl.plugins.flow.sde import DanceGRPOSDE, sde_kind_registry

    class Renamed(DanceGRPOSDE):
        name = "test_renamed"

    sde_kind_registry.register("test_renamed", Renamed)
    try:
        renamed = make_plugin("sd3", sde="test_renamed", noise_level=0.3)
        rollout = renamed.rollout(renamed.policy(), prompt_batch(["a cat"], 2))
        with torch.no_grad():
            logp = renamed.forward(renamed.policy(), rollout, need_reference=False).logp
    finally:
        sde_kind_registry._entries.pop("test_renamed")
    original = make_plugin("sd3", sde="dance_grpo", noise_level=0.3)
    expected = original.rollout(original.policy(), prompt_batch(["a cat"], 2))
    assert torch.equal(rollout.replay["next_latents"], expected.replay["next_latents"])
    torch.testing.assert_close(rollout.old_logp, expected.old_logp, rtol=0, atol=0)
    torch.testing.assert_close(logp, rollout.old_logp, rtol=0, atol=1e-5)
