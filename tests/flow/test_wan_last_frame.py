"""First-and-last-frame video (``WanImageToVideoPipeline(image=..., last_image=...)``): rows that name a
``"last_image"`` on the tiny Wan2.1-FLF2V (its image embedder reads both images' CLIP features) and Wan 2.2
I2V-A14B (no image encoder; rows with and without a last frame in one batch) pipelines. The plugin's ODE is the
pipeline's own sampler given the same two images, the condition holds the last frame and its mask, the training
forward gives ratio 1, and the pipelines that cannot take a last frame refuse it in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.flow.checks import assert_ratio_one_for_any_split, image_batch, perturb_lora

FRAMES = 5  # 3 latent frames with the tiny VAE's temporal factor 2
KINDS = ("wan_flf2v", "wan22_i2v", "wan_i2v", "wan22_ti2v_i2v")


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    root = tmp_path_factory.mktemp("flow_wan_last_frame")
    return {**pipelines, **{kind: save_tiny_pipeline(kind, root / f"tiny-{kind}") for kind in (*KINDS, "flux_kontext")}}


def _dataset(root, rows):
    """``root/train.jsonl`` from ``rows`` [(prompt, first index, last index or None)], random RGB PNGs of 16 px."""
    from PIL import Image

    rng = np.random.RandomState(0)
    (root / "images").mkdir(parents=True, exist_ok=True)
    for index in range(4):
        Image.fromarray((rng.rand(16, 16, 3) * 255).astype("uint8")).save(root / "images" / f"{index}.png")
    lines = []
    for prompt, first, last in rows:
        row = {"prompt": prompt, "image": f"images/{first}.png"}
        if last is not None:
            row["last_image"] = f"images/{last}.png"
        lines.append(json.dumps(row) + "\n")
    path = root / "train.jsonl"
    path.write_text("".join(lines))
    return path


def _open(path):
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


def _plugin(make_plugin, kind, dataset, **overrides):
    return make_plugin(kind, dataset=str(dataset), prompts=None, eval_prompts=None, num_frames=FRAMES,
                       resolution=16, **overrides)


@pytest.mark.parametrize("kind", ["wan_flf2v", "wan22_i2v"])
def test_evaluation_is_the_pipeline_ode_with_the_first_and_last_frame(make_plugin, tmp_path, kind):
    from mmrl.plugins.flow.adapters.wan import euler_scheduler_for

    # Wan 2.2 I2V-A14B takes rows with and without a last frame in one batch; Wan2.1-FLF2V needs one in every row
    rows = [("a cat walks", 0, 1), ("a dog runs", 2, None if kind == "wan22_i2v" else 3), ("a red car", 3, 0)]
    plugin = _plugin(make_plugin, kind, _dataset(tmp_path, rows), cfg=True, eval_num_steps=4, eval_guidance_scale=3.0)
    loaded = plugin.dataset("train")
    rollout = plugin.rollout(plugin.policy(), image_batch(loaded, 1, first_seed=5, training=False)).validate()
    videos = rollout.payload["videos"]  # [3, 3, F, H, W]
    pipeline = plugin.adapter.pipeline
    original, pipeline.scheduler = pipeline.scheduler, euler_scheduler_for(pipeline.scheduler)
    try:
        for k, row in enumerate(loaded):
            last = row.get("last_image")
            with torch.no_grad():
                frames = pipeline(image=_open(row["image"]), last_image=None if last is None else _open(last),
                                  prompt=row["prompt"], negative_prompt="", height=16, width=16, num_frames=FRAMES,
                                  num_inference_steps=4, guidance_scale=3.0,
                                  generator=torch.Generator().manual_seed(5 + k), output_type="pt",
                                  max_sequence_length=8).frames  # [1, F, 3, H, W]
                without = pipeline(image=_open(row["image"]), prompt=row["prompt"], negative_prompt="", height=16,
                                   width=16, num_frames=FRAMES, num_inference_steps=4, guidance_scale=3.0,
                                   generator=torch.Generator().manual_seed(5 + k), output_type="pt",
                                   max_sequence_length=8).frames if kind == "wan22_i2v" else None
            torch.testing.assert_close(videos[k:k + 1], frames.permute(0, 2, 1, 3, 4), rtol=0, atol=1e-5)
            if without is not None and last is not None:  # the last frame changes the video: the check can fail
                assert (without - frames).abs().max() > 1e-3
    finally:
        pipeline.scheduler = original
    last_seen = rollout.payload["condition_last_images"]  # [3, 3, H, W], zero for the row without
    assert last_seen.shape == (3, 3, 16, 16)
    assert (last_seen[1].abs().max() == 0) == (kind == "wan22_i2v")
    torch.testing.assert_close(last_seen[2], rollout.payload["condition_images"][0], rtol=0, atol=0)  # image 0


def test_the_condition_holds_the_last_frame_and_its_mask(make_plugin, tmp_path):
    rows = [("a cat walks", 0, 1), ("a dog runs", 0, None)]
    plugin = _plugin(make_plugin, "wan22_i2v", _dataset(tmp_path, rows))
    _, conditioning, _ = plugin.sampler.row_conditioning(plugin.dataset("train"))
    condition = conditioning["image_condition"]  # [2, t + C, F_lat, h, w]: the mask's t = 2 channels first
    mask = condition[:, :2]
    assert bool((mask[:, :, 0] == 1).all()) and bool((mask[:, :, 1] == 0).all())
    assert mask[0, :, 2].unique().tolist() == [0.0, 1.0] and bool((mask[1, :, 2] == 0).all())
    # the same first frame: the latent frames differ where the condition video does (its end)
    assert (condition[0, 2:, -1] - condition[1, 2:, -1]).abs().max() > 1e-3


def test_recomputed_logp_has_ratio_one_with_last_frames(make_plugin, tmp_path):
    rows = [("a cat walks", 0, 1), ("a dog runs", 2, 3)]
    plugin = _plugin(make_plugin, "wan_flf2v", _dataset(tmp_path, rows))
    perturb_lora(plugin)
    rollout = plugin.rollout(plugin.policy(), image_batch(plugin.dataset("train"), 3)).validate()
    assert rollout.replay["conditioning"]["image_embeds"].shape[:2] == (6, 2)  # both images' features per sample
    assert_ratio_one_for_any_split(plugin, rollout)


def test_pipelines_that_cannot_take_a_last_frame_refuse_it(make_plugin, tmp_path):
    with_last = _dataset(tmp_path / "with", [("a cat walks", 0, 1)])
    with pytest.raises(ValueError, match=r"rows name a 'last_image', but this transformer's image embedder reads one "
                                         r"image per sample \(Wan 2.1 I2V; [^\n]*\)$"):
        _plugin(make_plugin, "wan_i2v", with_last)
    with pytest.raises(ValueError, match=r"rows name a 'last_image', which Wan 2.2 TI2V-5B's pipeline ignores"):
        _plugin(make_plugin, "wan22_ti2v_i2v", with_last)
    with pytest.raises(ValueError, match=r"rows name a 'last_image', but a video of 1 frame has no last frame apart "
                                         r"from its first: plugin.num_frames must be larger$"):
        make_plugin("wan22_i2v", dataset=str(with_last), prompts=None, eval_prompts=None, num_frames=1, resolution=16)
    mixed = _dataset(tmp_path / "mixed", [("a cat walks", 0, 1), ("a dog runs", 2, None)])
    with pytest.raises(ValueError, match=r"1 of 2 rows have no 'last_image', which this transformer \(Wan2.1-FLF2V"):
        _plugin(make_plugin, "wan_flf2v", mixed)
    with pytest.raises(ValueError, match=r"train.jsonl row 1 names a 'last_image' \(a video's last frame\), which the "
                                         r"flux_kontext adapter does not take \(wan_i2v does[^\n]*$"):
        make_plugin("flux_kontext", dataset=str(with_last), prompts=None, eval_prompts=None)


def test_the_first_and_last_frame_recipe_runs_a_step_on_the_tiny_pipeline(pipelines, tmp_path):
    """configs/flow/wan_flf2v.yaml as written (the wan_i2v recipe with the FLF2V checkpoint and last-frame rows), on
    the tiny Wan2.1-FLF2V pipeline at 16 px with the test image reward per frame: loads, trains at ratio 1,
    evaluates."""
    from tests.flow.checks import run_recipe_step

    dataset = _dataset(tmp_path / "data", [("the cat turns", 0, 1), ("the dog jumps", 2, 3)])
    trainer = run_recipe_step("wan_flf2v.yaml", pipelines["wan_flf2v"], tmp_path / "run",
                              f"plugin.dataset={dataset}", f"plugin.eval_dataset={dataset}", "plugin.resolution=16",
                              "plugin.max_sequence_length=8",
                              "rewards.functions=[{name: per_frame, args: {reward: test_brightness}}]")
    assert all(row.get("last_image") for row in trainer.plugin.dataset("train"))  # the rows' last frames
