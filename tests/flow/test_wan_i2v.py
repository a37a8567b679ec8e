"""The Wan image-to-video adapter on tiny ``WanImageToVideoPipeline`` s built from config classes, saved and loaded
back through ``from_pretrained``: Wan 2.1 I2V (one transformer with CLIP image features) and Wan 2.2 I2V-A14B (two
experts, no image encoder), with prompt rows that name the first frame. The plugin's ODE is the pipeline's own
sampler (with the flow-shifted Euler scheduler the adapter samples with) on the same image, the image matters, the
training forward gives ratio 1 on-policy, and GRPO steps train the LoRA."""

from __future__ import annotations

import pytest
import torch

from mmrl.trainer import Trainer
from tests.flow.checks import (
    assert_ratio_one_for_any_split,
    image_batch,
    image_rows,
    perturb_lora,
    run_recipe_step,
    train_two_steps,
    write_image_rows,
)

FRAMES = 5  # the tiny VAE compresses time by 2: 3 latent frames
KINDS = ("wan_i2v", "wan22_i2v", "wan22_ti2v_i2v")


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus tiny Wan 2.1 I2V and Wan 2.2 I2V-A14B pipelines, built once per session."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    root = tmp_path_factory.mktemp("flow_wan_i2v")
    return {**pipelines, **{kind: save_tiny_pipeline(kind, root / f"tiny-{kind}") for kind in KINDS}}


@pytest.fixture(scope="session")
def first_frames(tmp_path_factory):
    """A JSONL of rows naming random RGB first frames (of other sizes than the run's) by relative paths."""
    rows = [("a cat walks", (24, 20)), ("a dog runs", (16, 16)), ("a red car", (40, 24))]
    return write_image_rows(tmp_path_factory.mktemp("flow_first_frames"), rows).parent


def _options(frames, **overrides):
    return {"dataset": str(frames / "train.jsonl"), "prompts": None, "eval_prompts": None, "num_frames": FRAMES,
            **overrides}


def _rows(frames, *indices):
    return image_rows(frames / "train.jsonl", "wan_i2v", *indices)


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
@pytest.mark.parametrize(("height", "width"), [(16, 16), (16, 32)], ids=["16x16", "16x32"])
@pytest.mark.parametrize("kind", KINDS)
def test_evaluation_is_the_i2v_pipeline_ode_on_the_same_image(make_plugin, first_frames, kind, cfg, height, width):
    # Same noise, σ grid (the pipeline's UniPC swapped for the adapter's Euler scheduler), condition video and image
    # features; [uncond; cond] in one call against the pipeline's two, and a batched against per-image VAE encode:
    # float32 rounding, 1e-5 on pixels after 4 steps.
    from PIL import Image

    from mmrl.plugins.flow.adapters.wan import euler_scheduler_for

    plugin = make_plugin(kind, **_options(first_frames, cfg=cfg, eval_num_steps=4, height=height, width=width,
                                          eval_guidance_scale=3.0 if cfg else None))
    assert plugin.adapter.name == "wan_i2v"  # detected from model_index.json
    rows = _rows(first_frames, 0, 2)
    rollout = plugin.rollout(plugin.policy(), image_batch(rows, 1, first_seed=5, training=False)).validate()
    videos = rollout.payload["videos"]
    assert videos.shape == (2, 3, FRAMES, height, width)
    pipeline = plugin.adapter.pipeline
    original, pipeline.scheduler = pipeline.scheduler, euler_scheduler_for(pipeline.scheduler)
    try:
        for k, (row, seed) in enumerate(zip(rows, (5, 6), strict=True)):
            with Image.open(row["image"]) as image:
                image = image.convert("RGB")
            with torch.no_grad():
                frames = pipeline(image=image, prompt=row["prompt"], negative_prompt="", height=height, width=width,
                                  num_frames=FRAMES, num_inference_steps=4, guidance_scale=3.0 if cfg else 1.0,
                                  generator=torch.Generator().manual_seed(seed), output_type="pt",
                                  max_sequence_length=8).frames  # [1, F, 3, H, W]
            torch.testing.assert_close(videos[k:k + 1], frames.permute(0, 2, 1, 3, 4), rtol=0, atol=1e-5)
    finally:
        pipeline.scheduler = original
    condition = rollout.payload["condition_images"]  # [2, 3, H, W]: the first frames as the model saw them
    assert condition.shape == (2, 3, height, width)


@pytest.mark.parametrize("kind", KINDS[:2])
def test_the_condition_carries_the_image_and_its_mask(make_plugin, first_frames, kind):
    """``[mask; latents]`` with the mask one on the first latent frame only, and another image gives another
    velocity; Wan 2.1 I2V also carries the CLIP features."""
    plugin = make_plugin(kind, **_options(first_frames))
    first, second = _rows(first_frames, 0, 1)
    _, conditioning, _ = plugin.sampler.row_conditioning([first, {**second, "prompt": first["prompt"]}])
    condition = conditioning["image_condition"]  # [2, 2 + 4, 3, 8, 8]
    assert condition.shape == (2, 6, 3, 8, 8)
    assert bool((condition[:, :2, 0] == 1).all()) and bool((condition[:, :2, 1:] == 0).all())
    assert ("image_embeds" in conditioning) == (kind == "wan_i2v")
    latents = torch.randn(1, 4, 3, 8, 8, generator=torch.Generator().manual_seed(0)).expand(2, -1, -1, -1, -1)
    with torch.no_grad():
        velocity = plugin.adapter.velocity(plugin.policy(), latents, torch.tensor([950.0, 950.0]), conditioning,
                                           guidance_scale=1.0)
    assert velocity.shape == (2, 4, 3, 8, 8)
    assert (velocity[0] - velocity[1]).abs().max() > 1e-3


def test_ti2v_puts_the_image_frame_in_at_timestep_zero_and_back_before_decoding(make_plugin, first_frames):
    """Wan 2.2 TI2V-5B given an image: the condition is one latent frame; the transformer sees it as the first frame
    of its input with timestep 0 on its tokens, and the sampled latents get it back (finalize)."""
    plugin = make_plugin("wan22_ti2v_i2v", **_options(first_frames))
    adapter = plugin.adapter
    _, conditioning, _ = plugin.sampler.row_conditioning(_rows(first_frames, 0, 1))
    condition = conditioning["image_condition"]  # [2, 6, 1, 4, 4]: z_dim 6, one latent frame, 16 px / 4
    assert condition.shape == (2, 6, 1, 4, 4)
    latents = torch.randn(2, 6, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    seen = {}

    def record(module, args, kwargs):
        seen.update(hidden=kwargs["hidden_states"].detach().clone(), timestep=kwargs["timestep"].detach().clone())

    handle = adapter.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            adapter.velocity(plugin.policy(), latents, torch.tensor([700.0, 300.0]), conditioning, guidance_scale=1.0)
    finally:
        handle.remove()
    torch.testing.assert_close(seen["hidden"][:, :, :1], condition, rtol=0, atol=0)
    torch.testing.assert_close(seen["hidden"][:, :, 1:], latents[:, :, 1:], rtol=0, atol=0)
    tokens = seen["timestep"]  # [2, 3 frames · 2 · 2 tokens]
    assert tokens.shape == (2, 12) and bool((tokens[:, :4] == 0).all())
    assert tokens[:, 4:].tolist() == [[700.0] * 8, [300.0] * 8]
    final = adapter.finalize(latents, conditioning)
    assert torch.equal(final[:, :, :1], condition) and torch.equal(final[:, :, 1:], latents[:, :, 1:])


@pytest.mark.parametrize("kind", KINDS)
def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(make_plugin, first_frames, kind):
    plugin = make_plugin(kind, **_options(first_frames, num_steps=6, timestep_fraction=0.6))
    perturb_lora(plugin, scale=0.1)
    policy = plugin.policy()
    rollout = plugin.rollout(policy, image_batch(_rows(first_frames, 0, 1, 2), 2)).validate()
    assert_ratio_one_for_any_split(plugin, rollout)  # other LoRA weights move the ratio: it can fail


@pytest.mark.parametrize("kind", KINDS)
def test_two_grpo_steps_train_the_lora_with_ratio_one(train_config, first_frames, kind, tmp_path):
    options = _options(first_frames, eval_dataset=str(first_frames / "train.jsonl"))
    train_two_steps(Trainer(train_config(kind, tmp_path, "rewards.functions=[{name: per_frame, args: {reward: "
                                                         "test_brightness, stride: 2}}]", **options)))


def test_the_recipe_runs_a_step_on_the_tiny_pipeline(pipelines, first_frames, tmp_path):
    """configs/flow/wan_i2v.yaml as written (true CFG, 5 frames, 10 steps with one trained step drawn from 1-3, EMA,
    gradient checkpointing, two optimizer steps per rollout, a per-frame reward), on the tiny Wan 2.1 I2V pipeline at
    16 px with the test image reward per frame: the combination loads, trains at ratio 1 and evaluates."""
    run_recipe_step("wan_i2v.yaml", pipelines["wan_i2v"], tmp_path,
                    f"plugin.dataset={first_frames / 'train.jsonl'}",
                    f"plugin.eval_dataset={first_frames / 'train.jsonl'}",
                    "plugin.resolution=16", "plugin.max_sequence_length=8",
                    "rewards.functions=[{name: per_frame, args: {reward: test_brightness}}]")
