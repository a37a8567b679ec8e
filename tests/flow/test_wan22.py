"""Wan 2.2 text-to-video through the wan adapter, on tiny pipelines built from config classes
(:mod:`mmrl.plugins.flow.testing`) and loaded back through ``from_pretrained``:

- the two-expert pipeline (``transformer`` + ``transformer_2``, ``boundary_ratio`` 0.875, flow shift 12: at 4 steps
  the timesteps are about 1000, 960, 857 and 12, so a rollout crosses the boundary after step 1);
- the TI2V pipeline (``expand_timesteps``: one timestep per token, a residual Wan 2.2 VAE with a 2×2 patchify).

The evaluation ODE is ``WanPipeline.__call__`` with the Euler scheduler swapped in; a training rollout across the
boundary has ratio 1 on the first inner step, each step scored by the expert that sampled it; GRPO steps move the
trained experts' weights and leave a frozen expert as it was; checkpoints and exports hold one folder per trained
expert and load back (into the plugin, and into a diffusers pipeline with ``load_lora_weights``).
"""

from __future__ import annotations

import pytest
import torch

from mmrl.config import ConfigError
from mmrl.trainer import Trainer
from tests.flow.conftest import prompt_batch
from tests.flow.test_plugin import _ratio_deviation
from tests.flow.test_wan import FRAMES, _pipeline_videos  # FRAMES: both tiny VAEs compress time by 2

BOUNDARY = 875.0  # boundary_ratio 0.875 x 1000 training timesteps
REWARD = "rewards.functions=[{name: per_frame, args: {reward: test_brightness, stride: 2}}]"  # on frames 0, 2, 4


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus the tiny Wan 2.1, Wan 2.2 two-expert and Wan 2.2 TI2V ones."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    root = tmp_path_factory.mktemp("flow_wan22")
    return {**pipelines, **{kind: save_tiny_pipeline(kind, root / f"tiny-{kind}")
                            for kind in ("wan", "wan22", "wan22_ti2v")}}


def _perturb(module, scale=0.3, seed=0):
    """Random LoRA weights in ``module`` (B starts at zero, so a fresh adapter does nothing)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
@pytest.mark.parametrize(("height", "width"), [(16, 16), (16, 32)], ids=["16x16", "16x32"])
def test_two_expert_evaluation_is_the_wan_pipeline_ode(make_plugin, cfg, height, width):
    # The high-noise steps (t >= 875) guided with 3.0 by `transformer`, the low-noise ones with 2.0 by
    # `transformer_2`, as WanPipeline(guidance_scale=3.0, guidance_scale_2=2.0) samples.
    options = {"eval_guidance_scale": 3.0, "guidance_scale_2": 2.0} if cfg else {}
    plugin = make_plugin("wan22", cfg=cfg, num_frames=FRAMES, eval_num_steps=4, height=height, width=width,
                         **options)
    experts = plugin.adapter.experts()
    assert list(experts) == ["transformer", "transformer_2"]
    assert experts["transformer_2"] is plugin.adapter.pipeline.transformer_2  # the pipeline's own modules
    _, timesteps = plugin.adapter.schedule(4)
    assert bool((timesteps >= BOUNDARY).any()) and bool((timesteps < BOUNDARY).any())  # both experts sample
    _perturb(plugin.policy(), scale=0.1)  # LoRA in both experts; the pipeline shares them
    prompts = ["a cat", "a big red dog"]
    rollout = plugin.rollout(plugin.policy(), prompt_batch(prompts, 1, first_seed=5, training=False)).validate()
    videos = rollout.payload["videos"]
    assert videos.shape == (2, 3, FRAMES, height, width)
    expected = _pipeline_videos(plugin, prompts, (5, 6), 4, (3.0, 2.0), cfg, height, width)
    torch.testing.assert_close(videos, expected, rtol=0, atol=1e-5)
    if cfg:  # the check can fail: the low-noise steps with the high-noise scale give other videos
        other = _pipeline_videos(plugin, prompts, (5, 6), 4, (3.0, 3.0), cfg, height, width)
        assert float((other - videos).abs().max()) > 1e-3


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
@pytest.mark.parametrize(("height", "width"), [(16, 16), (16, 32)], ids=["16x16", "16x32"])
def test_ti2v_evaluation_is_the_wan_pipeline_ode(make_plugin, cfg, height, width):
    plugin = make_plugin("wan22_ti2v", cfg=cfg, num_frames=FRAMES, eval_num_steps=4, height=height, width=width,
                         eval_guidance_scale=3.0 if cfg else None)
    adapter = plugin.adapter
    assert adapter.expand_timesteps and list(adapter.experts()) == ["transformer"]
    assert adapter.noise_shape() == (6, 3, height // 4, width // 4)  # Wan 2.2 VAE: 2x2 patchify x one downsampling
    latents = torch.zeros(2, *adapter.noise_shape())
    per_token = adapter.model_timesteps(latents, torch.tensor([500.0, 20.0]))
    assert per_token.shape == (2, 3 * (height // 8) * (width // 8))  # one timestep per 1x2x2 patch
    assert torch.equal(per_token[:, 0], torch.tensor([500.0, 20.0])) and bool((per_token == per_token[:, :1]).all())
    _perturb(plugin.policy(), scale=0.1)
    prompts = ["a cat", "a big red dog"]
    rollout = plugin.rollout(plugin.policy(), prompt_batch(prompts, 1, first_seed=5, training=False)).validate()
    videos = rollout.payload["videos"]
    assert videos.shape == (2, 3, FRAMES, height, width)
    expected = _pipeline_videos(plugin, prompts, (5, 6), 4, 3.0, cfg, height, width)
    torch.testing.assert_close(videos, expected, rtol=0, atol=1e-5)
    assert float((videos[:, :, 1:] - videos[:, :, :1]).abs().max()) > 1e-2  # frames differ


@pytest.mark.parametrize("train_steps", ["fraction", "random"])
def test_a_training_rollout_across_the_boundary_has_ratio_one(make_plugin, train_steps):
    """Steps 0-1 run on the high-noise expert, step 2 on the low-noise one (random: columns mix both experts across
    samples, so a forward splits its rows by expert). Each column is recomputed by the expert that sampled it: ratio
    1 for any micro-batch; moving only the low-noise expert's LoRA moves only the low-noise columns' ratios."""
    plugin = make_plugin("wan22", num_frames=FRAMES, guidance_scale=4.0, guidance_scale_2=3.0,
                         train_steps=train_steps, timestep_fraction=0.75 if train_steps == "random" else 0.99)
    assert plugin.guidance_scale == (4.0, 3.0)
    experts = plugin.adapter.experts()
    _perturb(experts["transformer"], seed=0)
    _perturb(experts["transformer_2"], seed=1)
    policy = plugin.policy()
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog", "a red car"], 2)).validate()
    timesteps = rollout.replay["timesteps"]  # [n, A]
    high = timesteps >= BOUNDARY
    assert bool(high.any()) and bool((~high).any())  # the trained steps cross the boundary
    if train_steps == "random":
        assert bool((high.any(dim=0) & (~high).any(dim=0)).any())  # some column mixes the experts
    with torch.no_grad():
        for split in ([0, 1, 2, 3, 4, 5], [5], [4, 0, 2]):
            part = rollout.select(torch.tensor(split))
            assert _ratio_deviation(plugin.forward(policy, part, need_reference=False), part) < 1e-5
        _perturb(experts["transformer_2"], seed=2)  # the check can fail, and fails exactly where routed
        output = plugin.forward(policy, rollout, need_reference=False)
    ratio = (output.logp - rollout.old_logp).exp()
    assert float(ratio[high].sub(1).abs().max()) < 1e-5
    assert float(ratio[~high].sub(1).abs().max()) > 1e-3


def test_the_ti2v_forward_has_ratio_one_and_trains_the_lora(make_plugin):
    plugin = make_plugin("wan22_ti2v", num_frames=FRAMES)
    _perturb(plugin.policy())
    policy = plugin.policy()
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog"], 2)).validate()
    assert rollout.replay["latents"].shape == (4, 3, 6, 3, 4, 4)  # [n, A, C, F_lat, h, w]
    with torch.no_grad():
        for split in ([0, 1, 2, 3], [3, 1]):
            part = rollout.select(torch.tensor(split))
            assert _ratio_deviation(plugin.forward(policy, part, need_reference=False), part) < 1e-5
    plugin.forward(policy, rollout, need_reference=False).logp.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in policy.named_parameters() if "lora_B" in n)


def _lora_state(module):
    return {name: p.detach().clone() for name, p in module.named_parameters() if "lora_" in name}


@pytest.mark.parametrize("train_experts", [None, ["transformer_2"]], ids=["both", "low_noise_only"])
def test_grpo_steps_train_the_chosen_experts_and_checkpoints_hold_each(train_config, tmp_path, train_experts):
    from mmrl.plugin import Runtime
    from mmrl.policy import DIFFUSERS_LORA_WEIGHTS

    options = {"num_frames": FRAMES, "guidance_scale": 4.0, "guidance_scale_2": 3.0}
    if train_experts is not None:
        options["train_experts"] = train_experts
    trainer = Trainer(train_config("wan22", tmp_path / "run", REWARD, **options))
    plugin = trainer.plugin
    experts = plugin.adapter.experts()
    trained = train_experts or ["transformer", "transformer_2"]
    frozen = [name for name in experts if name not in trained]
    before = {name: {key: p.detach().clone() for key, p in expert.named_parameters()}
              for name, expert in experts.items()}
    history = trainer.train().history

    assert [record["step"] for record in history] == [1, 2]
    assert all(record["loss/first_step_ratio_deviation"] < 1e-5 for record in history)
    for name in trained:  # 4 steps, 3 trained: steps 0-1 on transformer, step 2 on transformer_2; both get gradients
        changed = {key for key, p in experts[name].named_parameters() if not torch.equal(before[name][key], p)}
        lora = {key for key, _ in experts[name].named_parameters() if "lora_" in key}
        assert changed and changed <= lora, name  # only the adapter moves
        assert any(".attn2.to_k.lora_B" in key for key in changed), name
    for name in frozen:
        expert = experts[name]
        assert not any("lora_" in key for key, _ in expert.named_parameters())  # no adapter on a frozen expert
        assert all(not p.requires_grad and p.grad is None for p in expert.parameters())
        assert all(torch.equal(before[name][key], p) for key, p in expert.named_parameters()), name

    policy_dir = tmp_path / "run" / "checkpoints" / "step-00000002" / "policy"
    assert (policy_dir / DIFFUSERS_LORA_WEIGHTS).is_file() == ("transformer" in trained)
    assert (policy_dir / "transformer_2" / DIFFUSERS_LORA_WEIGHTS).is_file()

    # Resume: a fresh plugin loads each expert's adapter back.
    trained_state = {name: _lora_state(experts[name]) for name in trained}
    fresh = type(plugin)(trainer.config.plugin.config, Runtime())
    fresh.load_trainable(fresh.policy(), policy_dir)
    for name in trained:
        loaded = _lora_state(fresh.adapter.experts()[name])
        assert loaded.keys() == trained_state[name].keys()
        assert all(torch.equal(loaded[key], value) for key, value in trained_state[name].items()), name


def test_export_loads_into_the_diffusers_pipeline_with_load_into_transformer_2(make_plugin, pipelines, tmp_path):
    """The exported LoRA files are what diffusers loads: `load_lora_weights(folder)` into transformer and
    `load_lora_weights(folder / "transformer_2", load_into_transformer_2=True)`; the loaded pipeline's experts give
    the trained policy's velocities."""
    from diffusers import WanPipeline

    from mmrl.policy import DIFFUSERS_LORA_WEIGHTS

    plugin = make_plugin("wan22", num_frames=FRAMES)
    _perturb(plugin.policy(), scale=0.2)
    assert plugin.export(plugin.policy(), tmp_path / "export") == "diffusers_lora"
    assert (tmp_path / "export" / DIFFUSERS_LORA_WEIGHTS).is_file()
    assert (tmp_path / "export" / "transformer_2" / DIFFUSERS_LORA_WEIGHTS).is_file()

    bare = WanPipeline.from_pretrained(str(pipelines["wan22"]))
    pipeline = WanPipeline.from_pretrained(str(pipelines["wan22"]))
    pipeline.load_lora_weights(str(tmp_path / "export"))
    pipeline.load_lora_weights(str(tmp_path / "export" / "transformer_2"), load_into_transformer_2=True)
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 4, 3, 8, 8, generator=generator)
    embeds = plugin.sampler.conditioning(["a cat", "a dog"])["prompt_embeds"]
    timestep = torch.tensor([960.0, 960.0])
    with torch.no_grad():
        for name in ("transformer", "transformer_2"):
            inputs = {"hidden_states": latents, "timestep": timestep, "encoder_hidden_states": embeds,
                      "return_dict": False}
            ours = plugin.adapter.experts()[name](**inputs)[0]
            torch.testing.assert_close(getattr(pipeline, name)(**inputs)[0], ours, rtol=0, atol=1e-5)
            assert float((getattr(bare, name)(**inputs)[0] - ours).abs().max()) > 1e-3  # the LoRA matters


def test_full_fine_tuning_of_one_expert_with_a_kl_reference(train_config, tmp_path):
    """plugin.lora null, train_experts [transformer], kl_coef > 0: the high-noise expert trains in float32, the
    low-noise one stays frozen and is shared (not copied) by the reference; checkpoints and exports hold the trained
    expert only (trainable.safetensors; a save_pretrained folder)."""
    from diffusers import WanTransformer3DModel

    trainer = Trainer(train_config("wan22", tmp_path / "run", REWARD, "algorithm.kl_coef=0.01", "optim.lr=1e-3",
                                   num_frames=FRAMES, lora=None, train_experts=["transformer"]))
    plugin = trainer.plugin
    experts = plugin.adapter.experts()
    reference = plugin.reference_module()
    assert reference.transformer_2 is experts["transformer_2"] and reference.transformer is not experts["transformer"]
    assert all(not p.requires_grad for p in reference.parameters())
    before = {name: {key: p.detach().clone() for key, p in expert.named_parameters()}
              for name, expert in experts.items()}
    history = trainer.train().history
    assert all(record["loss/first_step_ratio_deviation"] < 1e-5 for record in history)
    assert history[0]["policy/kl"] < 1e-12 < history[1]["policy/kl"]  # the reference is the initial expert
    high = experts["transformer"]
    assert all(p.requires_grad and p.dtype == torch.float32 for p in high.parameters())
    assert not torch.equal(before["transformer"]["proj_out.weight"], high.proj_out.weight)
    assert all(not p.requires_grad and p.grad is None for p in experts["transformer_2"].parameters())
    assert all(torch.equal(before["transformer_2"][key], p) for key, p in experts["transformer_2"].named_parameters())
    policy_dir = tmp_path / "run" / "checkpoints" / "step-00000002" / "policy"
    assert (policy_dir / "trainable.safetensors").is_file() and not (policy_dir / "transformer_2").exists()
    assert plugin.export(plugin.policy(), tmp_path / "export") == "pretrained"
    loaded = WanTransformer3DModel.from_pretrained(str(tmp_path / "export"))
    assert all(torch.equal(loaded.state_dict()[key], value) for key, value in high.state_dict().items())


def test_wan22_options_are_refused_where_they_do_not_apply(make_plugin, pipelines):
    from diffusers import WanPipeline

    from mmrl.plugins.flow.adapters.wan import WanAdapter

    prefix = "^config key 'plugin.{}': got "
    with pytest.raises(ConfigError, match=prefix.format("guidance_scale_2") + r"3.0; allowed: null: .* one "
                       r"transformer [^\n]*$"):
        make_plugin("wan", num_frames=FRAMES, guidance_scale_2=3.0)
    with pytest.raises(ConfigError, match=prefix.format("train_experts") + r"\['transformer_2'\]; allowed: null or a "
                       r"non-empty list of transformer \(the experts of [^\n]*\)$"):
        make_plugin("wan", num_frames=FRAMES, train_experts=["transformer_2"])
    with pytest.raises(ConfigError, match=prefix.format("train_experts") + r"\[\]; allowed: null or a non-empty"):
        make_plugin("wan22", num_frames=FRAMES, train_experts=[])
    with pytest.raises(ConfigError, match=prefix.format("guidance_scale_2") + r"2.0; allowed: null or 1.0 with "
                       "plugin.cfg false"):
        make_plugin("wan22", num_frames=FRAMES, cfg=False, guidance_scale_2=2.0)
    assert make_plugin("wan", num_frames=FRAMES, train_experts=["transformer"]).trained_experts.keys() == {
        "transformer"}
    two = WanPipeline.from_pretrained(str(pipelines["wan22"]))
    two.transformer_2 = None
    with pytest.raises(ValueError, match=r"^wan adapter: this WanPipeline has boundary_ratio 0.875 but no "
                       r"transformer_2 [^\n]*$"):
        WanAdapter(two, torch.device("cpu"))
