"""The FLUX.1 Kontext adapter (image editing) on a tiny ``FluxKontextPipeline`` built from config classes, saved and
loaded back through ``from_pretrained``, with prompt rows that name the image to edit: the plugin's ODE is the
pipeline's own sampler on the same condition image, the condition image matters, rows without one are refused in
one line, the training forward gives ratio 1 on-policy, and GRPO steps train the LoRA."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mmrl.reward import RewardInput, reward_functions
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

SEEN_CONDITION_SHAPES: list[tuple[int, ...]] = []


def edit_distance(batch: RewardInput) -> torch.Tensor:
    """How far each edit moved from its input image (mean absolute pixel difference): a reward that reads both."""
    SEEN_CONDITION_SHAPES.append(tuple(batch.output("condition_images").shape))
    return (batch.output("images") - batch.output("condition_images")).abs().mean(dim=(1, 2, 3))


reward_functions.register("test_edit_distance", edit_distance)


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus a tiny FLUX.1 Kontext (the tiny FLUX's weights), built once per session."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    folder = save_tiny_pipeline("flux_kontext", tmp_path_factory.mktemp("flow_kontext") / "tiny-flux_kontext")
    return {**pipelines, "flux_kontext": folder}


@pytest.fixture(scope="session")
def edits(tmp_path_factory):
    """A JSONL of edit rows whose images (random RGB, of other sizes than the run's) sit in a sub-folder, named by
    paths relative to the file, as a user's dataset would."""
    rows = [("make it red", (24, 20)), ("add a dog", (16, 16)), ("a blue sky", (40, 32))]
    return write_image_rows(tmp_path_factory.mktemp("flow_edits"), rows).parent


def _rows(edits, *indices):
    return image_rows(edits / "train.jsonl", "flux_kontext", *indices)


@pytest.mark.parametrize(("height", "width"), [(16, 16), (16, 32)], ids=["16x16", "16x32"])
def test_evaluation_is_the_kontext_pipeline_ode_on_the_same_image(make_plugin, edits, height, width):
    # Each row's image is resized to the run's size by the pipeline's own image processor; the pipeline, given that
    # image with _auto_resize=False and max_area = height·width, keeps it and generates at height × width. Float32
    # rounding of batched against per-image VAE encodes and transformer calls only: 1e-5 on pixels after 4 steps.
    plugin = make_plugin("flux_kontext", dataset=str(edits / "train.jsonl"), prompts=None, eval_prompts=None,
                         eval_num_steps=4, eval_guidance_scale=2.5, height=height, width=width)
    assert plugin.adapter.name == "flux_kontext"  # detected from model_index.json
    rows = _rows(edits, 0, 2)
    rollout = plugin.rollout(plugin.policy(), image_batch(rows, 1, first_seed=5, training=False)).validate()
    assert rollout.payload["images"].shape == (2, 3, height, width)
    assert rollout.payload["condition_images"].shape == (2, 3, height, width)
    processor = plugin.adapter.pipeline.image_processor
    from PIL import Image

    for k, (row, seed) in enumerate(zip(rows, (5, 6), strict=True)):
        with Image.open(row["image"]) as image:
            resized = processor.resize(image.convert("RGB"), height, width)
        with torch.no_grad():
            expected = plugin.adapter.pipeline(
                image=resized, prompt=row["prompt"], height=height, width=width, max_area=height * width,
                _auto_resize=False, num_inference_steps=4, guidance_scale=2.5, max_sequence_length=8,
                generator=torch.Generator().manual_seed(seed), output_type="pt").images
        torch.testing.assert_close(rollout.payload["images"][k:k + 1], expected, rtol=0, atol=1e-5)
        pixels = processor.postprocess(processor.preprocess(resized, height, width), output_type="pt")
        torch.testing.assert_close(rollout.payload["condition_images"][k:k + 1], pixels, rtol=0, atol=1e-6)


def test_the_condition_image_changes_the_edit(make_plugin, edits):
    """Same prompt, same noise, two images: the velocities differ (the image tokens are attended to)."""
    plugin = make_plugin("flux_kontext", dataset=str(edits / "train.jsonl"), prompts=None, eval_prompts=None)
    first, second = _rows(edits, 0, 1)
    second = {**second, "prompt": first["prompt"]}
    _, conditioning, _ = plugin.sampler.row_conditioning([first, second])
    latents = torch.randn(1, 16, 16, generator=torch.Generator().manual_seed(0)).expand(2, -1, -1)
    with torch.no_grad():
        velocity = plugin.adapter.velocity(plugin.policy(), latents, torch.tensor([700.0, 700.0]), conditioning,
                                           guidance_scale=3.5)
    assert velocity.shape == (2, 16, 16)  # only the generated tokens come back
    assert (velocity[0] - velocity[1]).abs().max() > 1e-3


def test_condition_images_are_encoded_once_and_carried_in_the_replay(make_plugin, edits):
    plugin = make_plugin("flux_kontext", dataset=str(edits / "train.jsonl"), prompts=None, eval_prompts=None)
    calls = []
    original = plugin.adapter.encode_condition_images
    plugin.adapter.encode_condition_images = lambda images: calls.append(len(images)) or original(images)
    rows = _rows(edits, 0, 1)
    rollout = plugin.rollout(plugin.policy(), image_batch(rows, 3)).validate()
    plugin.rollout(plugin.policy(), image_batch(rows, 2, first_group=5))
    assert calls == [2]  # two distinct images, six samples, two rollouts
    assert rollout.replay["conditioning"]["image_latents"].shape == (6, 16, 16)  # [n, (16/4)², 4·4]
    assert torch.equal(rollout.replay["conditioning"]["image_latents"][0], rollout.replay["conditioning"]
                       ["image_latents"][2])  # one group, one image


def test_rows_without_an_image_are_refused_in_one_line(make_plugin, edits, tmp_path):
    from mmrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"^config key 'plugin.prompts': got \['a cat'\]; allowed: null: the "
                                          r"flux_kontext adapter conditions every sample on an input image[^\n]*$"):
        make_plugin("flux_kontext", prompts=["a cat"])
    lacking = tmp_path / "lacking.jsonl"
    lacking.write_text(json.dumps({"prompt": "make it red", "image": str(edits / "images" / "0.png")}) + "\n"
                       + json.dumps({"prompt": "no image"}) + "\n")
    with pytest.raises(ValueError, match=r"lacking.jsonl row 2 has no 'image' \(the path of its input image, or a "
                                         r"non-empty list of paths\), which the flux_kontext adapter needs in every "
                                         r"row; got None$"):
        make_plugin("flux_kontext", prompts=None, eval_prompts=None, dataset=str(lacking))
    several = tmp_path / "several.jsonl"
    several.write_text(json.dumps({"prompt": "make it red", "image": ["images/0.png", "images/1.png"]}) + "\n")
    (tmp_path / "images").mkdir(exist_ok=True)
    for name in ("0.png", "1.png"):
        (tmp_path / "images" / name).write_bytes((edits / "images" / "0.png").read_bytes())
    with pytest.raises(ValueError, match=r"several.jsonl row 1 names 2 input images; the flux_kontext adapter takes "
                                         r"one per row \(several: qwen_image_edit with a QwenImageEditPlusPipeline, "
                                         r"qwen_image21_edit, flux2_edit, flux2_klein_edit\)$"):
        make_plugin("flux_kontext", prompts=None, eval_prompts=None, dataset=str(several))
    several.write_text(json.dumps({"prompt": "make it red", "image": []}) + "\n")
    with pytest.raises(ValueError, match=r"several.jsonl row 1 has no 'image' .* got \[\]$"):
        make_plugin("flux_kontext", prompts=None, eval_prompts=None, dataset=str(several))
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"prompt": "make it red", "image": "nowhere.png"}) + "\n")
    with pytest.raises(FileNotFoundError, match=r"missing.jsonl row 1: image 'nowhere.png' is not a file"):
        make_plugin("flux_kontext", prompts=None, eval_prompts=None, dataset=str(missing))
    rows = _rows(edits, 0)
    assert rows[0]["image"] == str(edits / "images" / "0.png")  # resolved against the file's folder


def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(make_plugin, edits):
    plugin = make_plugin("flux_kontext", dataset=str(edits / "train.jsonl"), prompts=None, eval_prompts=None)
    perturb_lora(plugin)
    policy = plugin.policy()
    rollout = plugin.rollout(policy, image_batch(_rows(edits, 0, 1, 2), 2)).validate()
    assert rollout.old_logp.shape == (6, 3)
    assert_ratio_one_for_any_split(plugin, rollout)  # other LoRA weights move the ratio: it can fail


def test_two_grpo_steps_train_the_lora_with_ratio_one_and_rewards_see_both_images(train_config, edits, tmp_path):
    SEEN_CONDITION_SHAPES.clear()
    train_two_steps(Trainer(train_config("flux_kontext", tmp_path, "rewards.functions=[{name: test_edit_distance}]",
                                         dataset=str(edits / "train.jsonl"), prompts=None, eval_prompts=None,
                                         eval_dataset=str(edits / "train.jsonl"))))
    assert SEEN_CONDITION_SHAPES and all(shape[1:] == (3, 16, 16) for shape in SEEN_CONDITION_SHAPES)


def test_evaluation_grids_show_each_input_image_left_of_its_edit(make_plugin, edits, tmp_path):
    from PIL import Image

    from mmrl.plugins.flow.images import caption_grid

    plugin = make_plugin("flux_kontext", dataset=str(edits / "train.jsonl"), prompts=None, eval_prompts=None)
    rollout = plugin.rollout(plugin.policy(), image_batch(_rows(edits, 0, 1), 1, training=False))
    rewards = torch.tensor([0.25, 0.5])
    grid_path, records = plugin.save_samples(rollout, rewards, tmp_path, tag="eval")
    pairs = torch.cat([rollout.payload["condition_images"], rollout.payload["images"]], dim=-1)  # [2, 3, 16, 32]
    captions = [f"{row['prompt']} [{reward:.3f}]" for row, reward in zip(_rows(edits, 0, 1), (0.25, 0.5),
                                                                         strict=True)]
    expected = caption_grid(pairs, captions)
    with Image.open(grid_path) as grid:
        assert grid.size == expected.size
        assert np.array_equal(np.asarray(grid.convert("RGB")), np.asarray(expected.convert("RGB")))
    assert expected.size != caption_grid(rollout.payload["images"], captions).size  # the inputs are in the grid
    assert [json.loads(line)["prompt"] for line in records.read_text().splitlines()] == ["make it red", "add a dog"]


def test_the_recipe_runs_a_step_on_the_tiny_pipeline(pipelines, edits, tmp_path):
    """configs/flow/flux_kontext_pickscore.yaml as written (embedded guidance, 10 steps with one trained step drawn
    from 1-3, EMA, gradient checkpointing, two optimizer steps per rollout), on the tiny pipeline at 16 px with the
    edit rows and the test reward: the combination loads, trains at ratio 1 and evaluates."""
    run_recipe_step("flux_kontext_pickscore.yaml", pipelines["flux_kontext"], tmp_path,
                    f"plugin.dataset={edits / 'train.jsonl'}", f"plugin.eval_dataset={edits / 'train.jsonl'}",
                    "plugin.resolution=16", "plugin.eval_height=32", "plugin.eval_width=32",
                    "plugin.eval_condition_size=[32, 32]", "plugin.max_sequence_length=8",
                    "rewards.functions=[{name: test_edit_distance}]")


def test_an_unreadable_input_image_is_a_one_line_error_naming_it(make_plugin, tmp_path):
    """A file that exists (load_rows checks that) but is not an image stops the rollout with one line naming it."""
    from mmrl.rollout import RolloutError

    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "make it red", "image": "broken.png"}) + "\n")
    plugin = make_plugin("flux_kontext", dataset=str(rows), prompts=None, eval_prompts=None)
    with pytest.raises(RolloutError, match=rf"^input image {broken} is not a readable image \([^\n]*\)$"):
        plugin.rollout(plugin.policy(), image_batch(image_rows(rows, "flux_kontext", 0), 2))
