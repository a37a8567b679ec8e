"""The Wan adapter on a tiny ``WanPipeline`` (UMT5 text encoder, Wan 3-D transformer, causal video VAE) built from
config classes, saved and loaded back through ``from_pretrained``: the plugin's ODE is the pipeline's own sampler
with the Euler scheduler swapped in, the training forward gives ratio 1 on-policy, every credit strategy runs on
5-D video latents, ``plugin.num_frames`` is validated, and GRPO steps train the LoRA."""

from __future__ import annotations

import pytest
import torch

from mmrl.config import ConfigError
from mmrl.plugins.flow.credit import credit_strategies
from mmrl.trainer import Trainer
from tests.flow.conftest import prompt_batch
from tests.flow.test_credit_plugin import STRATEGIES, _deviation
from tests.flow.test_plugin import _perturb_lora, _ratio_deviation

FRAMES = 5  # the tiny VAE compresses time by 2: 3 latent frames


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus a tiny Wan, built once per session (about 7 s)."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    folder = save_tiny_pipeline("wan", tmp_path_factory.mktemp("flow_wan") / "tiny-wan")
    return {**pipelines, "wan": folder}


def _pipeline_videos(plugin, prompts, seeds, steps, scales, cfg, height=16, width=16):
    """``WanPipeline(...)``'s own videos ``[N, 3, F, H, W]`` (one generator per sample, as the plugin seeds them) with
    its UniPC scheduler replaced by the flow-shifted Euler one the adapter samples with. ``scales``: the guidance
    scale, or (guidance_scale, guidance_scale_2) for Wan 2.2's two experts."""
    from mmrl.plugins.flow.adapters.wan import euler_scheduler_for

    pipeline = plugin.adapter.pipeline
    original = pipeline.scheduler
    pipeline.scheduler = euler_scheduler_for(original)
    high, low = scales if isinstance(scales, tuple) else (scales, None)
    extra = {} if low is None else {"guidance_scale_2": low if cfg else None}
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    try:
        with torch.no_grad():
            frames = pipeline(prompts, negative_prompt="", height=height, width=width, num_frames=FRAMES,
                              num_inference_steps=steps, guidance_scale=high if cfg else 1.0, generator=generators,
                              output_type="pt", max_sequence_length=8, **extra).frames  # [N, F, 3, H, W]
    finally:
        pipeline.scheduler = original
    return frames.permute(0, 2, 1, 3, 4)


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
@pytest.mark.parametrize(("height", "width"), [(16, 16), (16, 32)], ids=["16x16", "16x32"])
def test_evaluation_is_the_wan_pipeline_ode(make_plugin, cfg, height, width):
    # Same noise, σ grid, raw timesteps and padded text; the plugin runs [uncond; cond] in one transformer call where
    # the pipeline makes two, and Wan's attention has no text mask and no cross-sample terms, so only float32
    # rounding of differently shaped matmuls separates the two: 1e-5 on pixels in [0, 1] after 4 steps.
    # 16x32: Wan's native frames are wider than tall (480x832); WanPipeline takes multiples of 16 only.
    plugin = make_plugin("wan", cfg=cfg, num_frames=FRAMES, eval_num_steps=4, eval_guidance_scale=3.0 if cfg else None,
                         height=height, width=width)
    _perturb_lora(plugin, scale=0.1)  # the pipeline shares the transformer, LoRA included
    prompts = ["a cat", "a big red dog"]
    rollout = plugin.rollout(plugin.policy(), prompt_batch(prompts, 1, first_seed=5, training=False)).validate()
    videos = rollout.payload["videos"]
    assert videos.shape == (2, 3, FRAMES, height, width) and "images" not in rollout.payload
    expected = _pipeline_videos(plugin, prompts, (5, 6), 4, 3.0, cfg, height, width)
    torch.testing.assert_close(videos, expected, rtol=0, atol=1e-5)
    assert float((videos[:, :, 1:] - videos[:, :, :1]).abs().max()) > 1e-2  # the frames are not one image repeated


def test_the_adapter_samples_with_the_flow_shifted_euler_grid(make_plugin):
    """σ_k = shift·s/(1 + (shift−1)·s) on FlowMatchEulerDiscreteScheduler's linspace of unshifted σ, computed by hand
    (shift 3 from the UniPC config); the timesteps the transformer sees are 1000·σ, not σ."""
    plugin = make_plugin("wan", num_frames=FRAMES)
    sigmas, timesteps = plugin.adapter.schedule(4)
    shift = 3.0
    low = shift * 1e-3 / (1 + (shift - 1) * 1e-3)  # the scheduler's σ_min: its shifted training σ at t = 1
    unshifted = [1.0 + (low - 1.0) * k / 3 for k in range(4)]
    expected = [shift * s / (1 + (shift - 1) * s) for s in unshifted] + [0.0]
    torch.testing.assert_close(sigmas, torch.tensor(expected), rtol=0, atol=1e-6)
    torch.testing.assert_close(timesteps, sigmas[:-1] * 1000, rtol=0, atol=1e-3)
    assert type(plugin.adapter.pipeline.scheduler).__name__ == "UniPCMultistepScheduler"  # the pipeline's, untouched
    assert plugin.adapter.noise_shape() == (4, 3, 8, 8)  # [C, (5 − 1)/2 + 1, 16/2, 16/2]


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(make_plugin, cfg):
    plugin = make_plugin("wan", cfg=cfg, num_frames=FRAMES)
    assert plugin.adapter.name == "wan"  # detected from model_index.json
    _perturb_lora(plugin)
    policy = plugin.policy()
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog", "a red car"], 2)).validate()
    assert rollout.old_logp.shape == (6, 3)
    assert rollout.replay["latents"].shape == (6, 3, 4, 3, 8, 8)  # [n, A, C, F_lat, h, w]
    with torch.no_grad():
        for split in ([0, 1, 2, 3, 4, 5], [5], [4, 0, 2]):
            part = rollout.select(torch.tensor(split))
            assert _ratio_deviation(plugin.forward(policy, part, need_reference=False), part) < 1e-5
        _perturb_lora(plugin, seed=1)  # the check can fail: other weights move the ratio
        assert _ratio_deviation(plugin.forward(policy, rollout, need_reference=False), rollout) > 1e-3


@pytest.mark.parametrize("name", [*credit_strategies.names(), "guard"])
def test_every_credit_strategy_runs_on_video(make_plugin, name):
    """Every registered strategy (and GRPO-Guard's RatioNorm on 'step'): a valid rollout of videos, ratio 1 on
    policy for any split, and gradients into the LoRA through the active actions."""
    plugin = make_plugin("wan", num_frames=FRAMES, credit=STRATEGIES.get(name, {"strategy": name}))
    _perturb_lora(plugin)
    policy = plugin.policy()
    batch = prompt_batch(["a cat", "a dog"], 4)  # two whole groups of G = 4
    batch.step, batch.max_steps = 1, 10
    rollout = plugin.rollout(policy, batch).validate()
    assert rollout.payload["videos"].shape == (8, 3, FRAMES, 16, 16)
    assert rollout.mask.sum() > 0
    for split in ([0, 1, 2, 3, 4, 5, 6, 7], [5, 0, 3]):
        part = rollout.select(torch.tensor(split))
        with torch.no_grad():
            assert _deviation(plugin.forward(policy, part, need_reference=False), part) < 1e-5
    output = plugin.forward(policy, rollout, need_reference=False)
    weights = torch.ones_like(rollout.mask) if rollout.action_weights is None else rollout.action_weights
    (output.logp * rollout.mask * weights).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in policy.named_parameters() if "lora_" in n)


def test_num_frames_is_validated_against_the_adapter(make_plugin):
    prefix = "^config key 'plugin.num_frames': got "
    with pytest.raises(ConfigError, match=prefix + r"4; allowed: 1 \+ a multiple of 2 [^\n]*$"):
        make_plugin("wan", num_frames=4)
    with pytest.raises(ConfigError, match=prefix + r"5; allowed: null: the sd3 adapter generates images$"):
        make_plugin("sd3", num_frames=5)
    assert make_plugin("wan").adapter.num_frames == 33  # the adapter's default
    assert make_plugin("sd3").adapter.num_frames == 1


def test_two_grpo_steps_train_the_lora_with_ratio_one(train_config, tmp_path):
    # The conftest's image reward on frames 0, 2, 4 of each video (per_frame): the video payload reaches it.
    reward = "rewards.functions=[{name: per_frame, args: {reward: test_brightness, stride: 2}}]"
    trainer = Trainer(train_config("wan", tmp_path, reward, num_frames=FRAMES))
    transformer = trainer.plugin.policy()
    frozen = {name: module for name, module in trainer.plugin.adapter.pipeline.components.items()
              if isinstance(module, torch.nn.Module) and name != "transformer"}
    before = {name: {key: p.detach().clone() for key, p in module.named_parameters()}
              for name, module in [("transformer", transformer), *frozen.items()]}
    history = trainer.train().history

    assert [record["step"] for record in history] == [1, 2]
    assert all(record["loss/first_step_ratio_deviation"] < 1e-5 for record in history)
    assert all(0 < record["reward/mean"] < 1 for record in history)  # mean brightness of the chosen frames
    changed = {key for key, p in transformer.named_parameters() if not torch.equal(before["transformer"][key], p)}
    lora = {key for key, _ in transformer.named_parameters() if "lora_" in key}
    assert changed and changed <= lora  # only the adapter moves
    assert any(".attn2.to_k.lora_B" in key for key in changed)  # cross-attention is a default target
    assert any(".ffn.net.2.lora_B" in key for key in changed)
    for name, module in frozen.items():
        assert all(torch.equal(before[name][key], p) for key, p in module.named_parameters()), f"{name} changed"
    assert (tmp_path / "checkpoints" / "step-00000002" / "policy" / "pytorch_lora_weights.safetensors").is_file()


def test_filmstrips_lay_strided_frames_side_by_side():
    from mmrl.plugins.flow.images import filmstrips

    videos = torch.arange(2 * 3 * 9 * 1 * 2, dtype=torch.float32).reshape(2, 3, 9, 1, 2)  # [N, 3, F, H, W]
    strips = filmstrips(videos, max_frames=5)  # stride ceil(8 / 4) = 2: frames 0, 2, 4, 6, 8
    assert strips.shape == (2, 3, 1, 10)
    for k, frame in enumerate((0, 2, 4, 6, 8)):
        assert torch.equal(strips[..., 2 * k:2 * k + 2], videos[:, :, frame])
    assert filmstrips(videos[:, :, :1]).shape == (2, 3, 1, 2)  # one frame: itself


def test_video_samples_are_saved_as_a_grid_of_filmstrips(make_plugin, tmp_path):
    from PIL import Image

    plugin = make_plugin("wan", num_frames=FRAMES, eval_num_steps=2)
    rollout = plugin.rollout(plugin.policy(), prompt_batch(["a cat", "a dog"], 1, training=False))
    grid, records = plugin.save_samples(rollout, torch.tensor([0.5, 0.25]), tmp_path, tag="eval")
    with Image.open(grid) as picture:  # 5 frames of 16 px side by side, enlarged x3 to reach 192 px cells
        assert picture.width > 5 * 16 * 3 * 2 - 1
    assert records.read_text().count("\n") == 2


def test_decoding_in_batches_gives_the_same_videos(make_plugin):
    plugin = make_plugin("wan", num_frames=FRAMES)
    latents = torch.randn(3, 4, 3, 8, 8, generator=torch.Generator().manual_seed(0))  # [n, C, F_lat, h, w]
    one_by_one = plugin.adapter.decode(latents)
    plugin.adapter.decode_batch_size = 2
    torch.testing.assert_close(plugin.adapter.decode(latents), one_by_one, rtol=0, atol=1e-6)
    assert one_by_one.shape == (3, 3, FRAMES, 16, 16)
