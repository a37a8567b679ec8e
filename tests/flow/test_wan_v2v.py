"""The Wan video-to-video adapter (``wan_v2v``, SDEdit) on the tiny ``WanPipeline`` built from config classes, saved
and loaded back through ``from_pretrained``, with prompt rows that name input videos (frame lists and a video file).
The plugin's ODE is ``WanVideoToVideoPipeline.__call__`` on the same video and generators (the flow-shifted Euler
scheduler swapped in, as for ``wan``) at two strengths, the SDE and the trained steps cover the steps run, the
training forward gives ratio 1 on-policy, a trainer step trains the LoRA, and bad rows and strengths are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmrl.config import ConfigError
from tests.flow.checks import assert_ratio_one_for_any_split, image_batch, perturb_lora
from tests.flow.conftest import plugin_options

FRAMES = 5  # the tiny VAE compresses time by 2: 3 latent frames


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    return save_tiny_pipeline("wan", tmp_path_factory.mktemp("flow_wan_v2v") / "tiny-wan")


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """``train.jsonl`` of three rows: two videos as frame lists (5 and 7 PNG frames, other sizes than the run's) and
    one as an MPEG-4 file (PyAV), by paths relative to the file."""
    import av
    from PIL import Image

    root = tmp_path_factory.mktemp("flow_v2v_videos")
    rng = np.random.RandomState(0)
    rows = []
    for index, (prompt, count, (width, height)) in enumerate([("a cat walks", 5, (24, 20)),
                                                              ("a dog runs", 7, (16, 16))]):
        folder = root / f"clip{index}"
        folder.mkdir()
        names = []
        for frame in range(count):
            Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8")).save(folder / f"{frame:02d}.png")
            names.append(f"clip{index}/{frame:02d}.png")
        rows.append({"prompt": prompt, "video": names})
    with av.open(str(root / "clip2.mp4"), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 32, 24, "yuv420p"
        for _ in range(6):
            frame = av.VideoFrame.from_ndarray((rng.rand(24, 32, 3) * 255).astype("uint8"), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    rows.append({"prompt": "a red car", "video": "clip2.mp4"})
    (root / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def _build(folder, videos, **overrides):
    from mmrl.config import from_dict
    from mmrl.plugin import Runtime
    from mmrl.plugins.flow.plugin import FlowPlugin, FlowPluginConfig

    options = plugin_options(folder, **{"adapter": "wan_v2v", "dataset": str(videos / "train.jsonl"), "prompts": None,
                                        "eval_prompts": None, "num_frames": FRAMES, **overrides})
    options.pop("name")
    return FlowPlugin(from_dict(FlowPluginConfig, options, "plugin"), Runtime())


@pytest.fixture(scope="module")
def plugin(wan_folder, videos):
    """One plugin at strength 0.5 (4 steps run of the pipeline's 8), true CFG, a perturbed LoRA."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the conftest's one-thread fixture is per test; this one is built before it runs
    try:
        built = _build(wan_folder, videos, adapter_options={"strength": 0.5}, cfg=True, eval_guidance_scale=3.0,
                       num_steps=4, eval_num_steps=3, timestep_fraction=0.75)
    finally:
        torch.set_num_threads(threads)
    perturb_lora(built, scale=0.1)  # the pipeline shares the transformer, LoRA included
    return built


def _pipeline_videos(plugin, rows, seeds, steps, strength, guidance):
    """``WanVideoToVideoPipeline(...)``'s own videos ``[N, 3, F, H, W]``, one call per row with the sample's
    generator, on the plugin's components with the flow-shifted Euler scheduler."""
    from diffusers import WanVideoToVideoPipeline

    from mmrl.plugins.flow.adapters.wan import euler_scheduler_for
    from mmrl.plugins.flow.adapters.wan_v2v import read_video

    adapter = plugin.adapter
    source = adapter.pipeline
    pipeline = WanVideoToVideoPipeline(tokenizer=source.tokenizer, text_encoder=source.text_encoder,
                                       transformer=source.transformer, vae=source.vae,
                                       scheduler=euler_scheduler_for(source.scheduler))
    pipeline.set_progress_bar_config(disable=True)
    height, width = adapter.size
    out = []
    for row, seed in zip(rows, seeds, strict=True):
        video = row["video"]
        frames = read_video(tuple(video) if isinstance(video, list) else video, FRAMES)
        with torch.no_grad():
            result = pipeline(video=frames, prompt=row["prompt"], negative_prompt="", height=height, width=width,
                              num_inference_steps=adapter.full_steps(steps), strength=strength,
                              guidance_scale=guidance, generator=torch.Generator().manual_seed(seed),
                              output_type="pt", max_sequence_length=8).frames  # [1, F, 3, H, W]
        out.append(result.permute(0, 2, 1, 3, 4))
    return torch.cat(out)


@pytest.mark.parametrize(("strength", "steps", "full"), [(0.6, 3, 5), (1.0, 3, 3)], ids=["0.6", "1.0"])
def test_evaluation_is_the_v2v_pipeline_on_the_same_video(plugin, strength, steps, full):
    # Same encoded video, noise, tail of the σ grid and raw timesteps; [uncond; cond] in one call against the
    # pipeline's two: float32 rounding, 1e-5 on pixels.
    adapter = plugin.adapter
    previous, adapter.strength = adapter.strength, strength
    try:
        assert adapter.full_steps(steps) == full
        sigmas, timesteps = adapter.schedule(steps)
        assert sigmas.shape == (steps + 1,) and timesteps.shape == (steps,)
        assert (float(sigmas[0]) == 1.0) == (strength == 1.0)  # the tail of the pipeline's grid
        rows = plugin.dataset("train")
        rollout = plugin.rollout(plugin.policy(), image_batch(rows, 1, first_seed=5, training=False)).validate()
        videos = rollout.payload["videos"]  # [3, 3, F, H, W]
        assert videos.shape == (3, 3, FRAMES, 16, 16)
        assert rollout.payload["condition_videos"].shape == (3, 3, FRAMES, 16, 16)
        expected = _pipeline_videos(plugin, rows, (5, 6, 7), steps, strength, 3.0)
        torch.testing.assert_close(videos, expected, rtol=0, atol=1e-5)
    finally:
        adapter.strength = previous


def test_the_start_is_the_noised_input_video_and_the_steps_are_the_ones_run(plugin):
    """x₀ noised to the tail's first σ with the sample's noise; the training rollout trains steps of the 4 run
    (σ from the tail), and the window mode indexes the same 4 steps."""
    from mmrl.plugins.flow.schedule import plan_steps

    adapter, sampler = plugin.adapter, plugin.sampler
    sigmas, timesteps = sampler.training_schedule()  # the last 4 of 8 steps
    full_sigmas, full_timesteps = adapter.scheduler.sigmas, adapter.scheduler.timesteps
    assert sigmas.shape == (5,) and 0 < float(sigmas[0]) < 1
    torch.testing.assert_close(timesteps, full_timesteps[4:].float(), rtol=0, atol=0)
    torch.testing.assert_close(sigmas, full_sigmas[4:].float(), rtol=0, atol=0)
    rows = plugin.dataset("train")[:2]
    batch = image_batch(rows, 2)
    _, conditioning, _ = sampler.row_conditioning(batch.rows)
    clean = conditioning["input_video_latents"]  # [4, 4, 3, 8, 8]
    noise = sampler.initial_noise(batch, batch.sample_generators())
    start = adapter.initial_latents(noise, conditioning, sigmas[0])
    torch.testing.assert_close(start, sigmas[0] * noise + (1 - sigmas[0]) * clean, rtol=0, atol=0)
    rollout = plugin.rollout(plugin.policy(), batch).validate()
    assert rollout.replay["step_index"].tolist() == [[0, 1, 2]] * 4  # timestep_fraction 0.75 of the 4 run
    torch.testing.assert_close(rollout.replay["latents"][:, 0], start, rtol=0, atol=0)
    torch.testing.assert_close(rollout.replay["sigmas"][0], sigmas[:3], rtol=0, atol=0)
    plan = plan_steps("window", 4, seeds=batch.seeds, group_ids=batch.group_ids, run_seed=0, timestep_fraction=1.0,
                      window_size=2, window_range=(1, 4))
    assert plan.stochastic.shape == (4, 4) and int(plan.step_index.max()) <= 3


def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(plugin):
    rollout = plugin.rollout(plugin.policy(), image_batch(plugin.dataset("train"), 2)).validate()
    try:
        assert_ratio_one_for_any_split(plugin, rollout)  # other LoRA weights move the ratio: it can fail
    finally:
        perturb_lora(plugin, scale=0.1)


def test_a_grpo_step_with_video_rows_trains_the_lora(wan_folder, videos, tmp_path):
    from mmrl.config import load_config
    from mmrl.trainer import Trainer

    options = plugin_options(wan_folder, adapter="wan_v2v", dataset=str(videos / "train.jsonl"), prompts=None,
                             eval_prompts=None, eval_dataset=str(videos / "train.jsonl"), num_frames=FRAMES,
                             num_steps=3, eval_num_steps=2, adapter_options={"strength": 0.8},
                             train_steps="window", window_size=1, window_range=[0, 2])
    config = load_config({
        "plugin": options,
        "run": {"output_dir": str(tmp_path), "max_steps": 1, "seed": 0, "progress": False, "cpu": True},
        "rollout": {"prompts_per_step": 1, "group_size": 3},
        "algorithm": {"micro_batch_size": 3, "action_chunk_size": 1, "advantage": "batch_std"},
        "optim": {"lr": 1e-2}, "rewards": {"functions": [{"name": "test_brightness"}]}, "eval": {"at_start": False},
    }, ["rewards.functions=[{name: per_frame, args: {reward: test_brightness, stride: 2}}]"])
    trainer = Trainer(config)
    transformer = trainer.plugin.policy()
    before = {key: p.detach().clone() for key, p in transformer.named_parameters()}
    history = trainer.train().history
    assert [record["step"] for record in history] == [1]
    assert history[0]["loss/first_step_ratio_deviation"] < 1e-5
    changed = {key for key, p in transformer.named_parameters() if not torch.equal(before[key], p)}
    assert changed and all("lora_" in key for key in changed)


def test_bad_rows_and_strengths_are_refused(wan_folder, videos, tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "no video here"}) + "\n")
    with pytest.raises(ValueError, match=r"row 1 has no 'video' \(the path of a video file"):
        _build(wan_folder, videos, dataset=str(tmp_path / "rows.jsonl"))
    (tmp_path / "short.jsonl").write_text(json.dumps({"prompt": "p", "video": ["a.png", "b.png"]}) + "\n")
    with pytest.raises(ValueError, match="'video' lists 2 frames; plugin.num_frames is 5"):
        _build(wan_folder, videos, dataset=str(tmp_path / "short.jsonl"))
    with pytest.raises(ValueError, match="plugin.prompts: null: the wan_v2v adapter starts every sample"):
        _build(wan_folder, videos, prompts=["a cat"], dataset=None)
    for strength in (0, 1.5, "high", True):
        with pytest.raises(ConfigError, match=r"strength: a number in \(0, 1\]"):
            _build(wan_folder, videos, adapter_options={"strength": strength})
    with pytest.raises(ConfigError, match="keys of strength"):
        _build(wan_folder, videos, adapter_options={"shift": 3.0})


def test_the_recipe_runs_a_step_on_the_tiny_pipeline(wan_folder, videos, tmp_path):
    """configs/flow/wan_v2v.yaml as written (strength 0.8, 8 steps run with one trained step drawn from 1-3, 22 at
    evaluation, true CFG, EMA, gradient checkpointing, two optimizer steps per rollout, a per-frame reward), on the
    tiny Wan pipeline at 16 px with the test image reward per frame: the combination loads, trains at ratio 1 and
    evaluates."""
    from tests.flow.checks import run_recipe_step

    run_recipe_step("wan_v2v.yaml", wan_folder, tmp_path, f"plugin.dataset={videos / 'train.jsonl'}",
                    f"plugin.eval_dataset={videos / 'train.jsonl'}", "plugin.resolution=16",
                    "plugin.max_sequence_length=8",
                    "rewards.functions=[{name: per_frame, args: {reward: test_brightness}}]")


@pytest.mark.parametrize("name", ["branch", "tree", "sliding_window"])
def test_shared_prefix_and_windowed_strategies_start_from_the_noised_video(wan_folder, videos, name):
    """The group-sharing strategies (one noise per group: the noised row video is each group's start) and MixGRPO's
    window with its ODE tail run on the 4 steps run: a valid rollout, ratio 1 on-policy for any split."""
    from tests.flow.test_credit_plugin import STRATEGIES, _deviation

    plugin = _build(wan_folder, videos, adapter_options={"strength": 0.5}, num_steps=4, credit=STRATEGIES[name])
    perturb_lora(plugin, scale=0.1)
    batch = image_batch(plugin.dataset("train")[:2], 4)  # two whole groups of G = 4
    batch.step, batch.max_steps = 1, 10
    rollout = plugin.rollout(plugin.policy(), batch).validate()
    assert rollout.payload["videos"].shape == (8, 3, FRAMES, 16, 16) and rollout.mask.sum() > 0
    sampler = plugin.sampler
    sigmas = sampler.sigma_grid()  # [5], the tail of the pipeline's 8-step grid
    assert sigmas.shape == (5,) and float(sigmas[0]) < 1
    if name != "sliding_window":  # step 0 is stored for every sample: the group's shared, noised start
        assert int(rollout.replay["step_index"][:, 0].max()) == 0
        _, conditioning, _ = sampler.row_conditioning(batch.rows)
        noise = torch.cat([sampler.group_noise(int(group)) for group in batch.group_ids])
        start = sigmas[0] * noise + (1 - sigmas[0]) * conditioning["input_video_latents"]
        torch.testing.assert_close(rollout.replay["latents"][:, 0], start, rtol=0, atol=0)
    for split in ([0, 1, 2, 3, 4, 5, 6, 7], [5, 0, 3]):
        part = rollout.select(torch.tensor(split))
        with torch.no_grad():
            assert _deviation(plugin.forward(plugin.policy(), part, need_reference=False), part) < 1e-5
