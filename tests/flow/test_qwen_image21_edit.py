"""The Qwen-Image 2.1 editing adapter (``qwen_image21_edit``) on the tiny ``QwenImage21Pipeline`` (Qwen3-VL text
encoder that reads the input images, block-causal single-stream transformer, RGBA 3-D VAE) built from config classes,
saved and loaded back through ``from_pretrained``, with prompt rows that name the images to edit: the plugin's ODE is
the pipeline's own sampler called with ``image=`` (``use_kv_cache=False``) on inputs that its
``calculate_dimensions`` sizes as the plugin does, every (prompt, images) encoding and its negative is the pipeline's,
each image and pair is encoded once, the training forward gives ratio 1 on-policy, GRPO steps train the LoRA, several
images per row follow the pipeline's ``image=[a, b]``, and buckets follow the last image."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mmrl.config import ConfigError
from mmrl.trainer import Trainer
from tests.flow.checks import (
    assert_ratio_one_for_any_split,
    image_batch,
    image_rows,
    perturb_lora,
    row_images,
    run_recipe_step,
    train_two_steps,
    write_image_rows,
)

ADAPTER = "qwen_image21_edit"
TEXT_TOKENS = 64  # the template after the system turn, "<image1>" and its 1 to 8 vision tokens, the instruction


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus a tiny Qwen-Image 2.1, built once per session."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    folder = save_tiny_pipeline("qwen_image21", tmp_path_factory.mktemp("flow_qwen_image21_edit") / "tiny")
    return {**pipelines, "qwen_image21": folder}


@pytest.fixture(scope="session")
def edits(tmp_path_factory):
    """A JSONL of edit rows naming random RGB images by relative paths: two square ones (the 32 × 32 run with the
    pipeline's ``output_resolution`` 32) and two of aspect ratio 2:1 (inputs of 64 × 128 with ``output_resolution``
    90), at other sizes than the inputs', so that both the pipeline and the plugin resize them."""
    rows = [("make it red", (40, 40)), ("add a big dog", (48, 48)), ("a blue sky", (80, 40)),
            ("a big red car", (60, 30))]
    return write_image_rows(tmp_path_factory.mktemp("flow_qwen21_edits"), rows)


@pytest.fixture(scope="session")
def several(tmp_path_factory):
    """A JSONL whose rows name two, one and two (the first row's, swapped) 32 px images, and rows whose two images
    have different aspect ratios (a wide one, a tall one, in both orders), for the buckets."""
    from PIL import Image

    root = tmp_path_factory.mktemp("flow_qwen21_several")
    (root / "images").mkdir()
    rng = np.random.RandomState(1)
    for name, (width, height) in {"a": (32, 32), "b": (32, 32), "wide": (64, 32), "tall": (32, 64)}.items():
        Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8")).save(root / "images" / f"{name}.png")
    rows = [{"prompt": "put the cat of picture 2 on the sofa", "image": ["images/a.png", "images/b.png"]},
            {"prompt": "make it red", "image": "images/b.png"},
            {"prompt": "swap them", "image": ["images/b.png", "images/a.png"]}]
    (root / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    shaped = [{"prompt": "make it red", "image": ["images/wide.png", "images/tall.png"]},
              {"prompt": "add a dog", "image": ["images/tall.png", "images/wide.png"]}]
    (root / "shaped.jsonl").write_text("".join(json.dumps(row) + "\n" for row in shaped))
    return root


def _plugin(make_plugin, dataset: Path, **overrides):
    options = {"adapter": ADAPTER, "dataset": str(dataset), "prompts": None, "eval_prompts": None, "resolution": 32,
               "max_sequence_length": TEXT_TOKENS, **overrides}
    return make_plugin("qwen_image21", **options)


def _composited(images: torch.Tensor) -> torch.Tensor:
    """The pipeline's RGBA ``output_type="pt"`` images over white, as the adapter hands them to the rewards."""
    return images[:, :3] * images[:, 3:] + (1 - images[:, 3:])


def _pipeline_image(pipeline, images, prompt, seed, height, width, resolution, scale=None, steps=3):
    """``QwenImage21Pipeline(image=images, ...)`` for one row, uncached, composited over white; ``scale``: true CFG
    with the negative prompt " "."""
    guidance = {} if scale is None else {"true_cfg_scale": scale, "negative_prompt": " "}
    with torch.no_grad():
        output = pipeline(image=images, prompt=prompt, height=height, width=width, output_resolution=resolution,
                          num_inference_steps=steps, use_kv_cache=False, generator=torch.Generator().manual_seed(seed),
                          output_type="pt", **guidance).images
    return _composited(output)


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
@pytest.mark.parametrize(("height", "width", "condition", "resolution", "indices"),
                         [(32, 32, None, 32, (0, 1)), (64, 32, [64, 128], 90, (2, 3))],
                         ids=["32x32", "64x32-inputs-64x128"])
def test_evaluation_is_the_pipeline_ode_on_the_same_images(make_plugin, edits, cfg, height, width, condition,
                                                           resolution, indices):
    # The pipeline sizes an input at calculate_dimensions(output_resolution², its ratio): 32 × 32 for the square
    # images with output_resolution 32, and 64 × 128 (height × width) for the 2:1 ones with 90 (√(2·90²) = 127.3 → 128,
    # 63.6 → 64), the plugin's condition_size (null: the output size). The second case has inputs of another grid and
    # aspect ratio than the output, so img_shapes, the slots and the packing are checked off the square.
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions

    rows = image_rows(edits, ADAPTER, *indices)
    for image in (row_images(row)[0] for row in rows):
        assert calculate_dimensions(resolution ** 2, image.size[0] / image.size[1])[:2] == \
            tuple(reversed(condition or [height, width]))
    plugin = _plugin(make_plugin, edits, cfg=cfg, negative_prompt=" ", eval_num_steps=3, height=height, width=width,
                     condition_size=condition, eval_guidance_scale=3.0 if cfg else None)
    perturb_lora(plugin)  # the LoRA sits in the pipeline's transformer: a random model that reads its inputs strongly
    rollout = plugin.rollout(plugin.policy(), image_batch(rows, 1, first_seed=5, training=False)).validate()
    assert rollout.payload["images"].shape == (2, 3, height, width)
    assert rollout.payload["condition_images"].shape == (2, 3, *(condition or [height, width]))
    pipeline = plugin.adapter.pipeline
    for k, (row, seed) in enumerate(zip(rows, (5, 6), strict=True)):
        expected = _pipeline_image(pipeline, row_images(row), row["prompt"], seed, height, width, resolution,
                                   3.0 if cfg else None)
        torch.testing.assert_close(rollout.payload["images"][k:k + 1], expected, rtol=0, atol=1e-5)
        other = _pipeline_image(pipeline, row_images(rows[1 - k]), row["prompt"], seed, height, width, resolution,
                                3.0 if cfg else None)
        assert (other - expected).abs().max() > 1e-3  # the input image matters: the check can fail


def test_each_encoding_is_the_pipelines_with_its_images_and_the_negatives_too(make_plugin, edits):
    """Each row's prompt and negative encodings are ``encode_prompt(prompt, image=[...])`` of the pipeline's own
    resized RGBA input (calculate_dimensions' 64 × 128 at output_resolution 90) on the real tokens, zero-padded, with
    the image's 8 vision tokens as ``image_pad_mask`` slots; another image changes them."""
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions

    plugin = _plugin(make_plugin, edits, cfg=True, negative_prompt=" ", height=64, width=32, condition_size=[64, 128])
    rows = image_rows(edits, ADAPTER, 2, 3)
    rows[1] = {**rows[1], "prompt": rows[0]["prompt"]}  # one instruction, two images
    _, conditioning, _ = plugin.sampler.row_conditioning(rows)
    assert set(conditioning) == {"prompt_embeds", "prompt_embeds_mask", "image_pad_mask", "negative_prompt_embeds",
                                 "negative_prompt_embeds_mask", "negative_image_pad_mask", "image_latents"}
    assert conditioning["image_latents"].shape == (2, 4 * 8, 8)  # [n, (64/16)·(128/16), C]
    pipeline = plugin.adapter.pipeline
    for k, row in enumerate(rows):
        image = row_images(row)[0]
        width, height, _ = calculate_dimensions(90 ** 2, image.size[0] / image.size[1])
        resized = pipeline.image_processor.resize(image.convert("RGBA"), width=width, height=height)
        for prefix, prompt in (("", row["prompt"]), ("negative_", " ")):
            with torch.no_grad():
                embeds, mask, slots = pipeline.encode_prompt(prompt=[prompt], image=[resized], device="cpu")
            length = embeds.shape[1]
            assert mask is None and int(slots.sum()) == 8  # one vision token per 2×2 latent tokens of 4 × 8
            torch.testing.assert_close(conditioning[f"{prefix}prompt_embeds"][k, :length], embeds[0], rtol=0, atol=0)
            assert conditioning[f"{prefix}prompt_embeds"][k, length:].abs().max() == 0
            assert conditioning[f"{prefix}prompt_embeds_mask"][k].tolist() == [1] * length + [0] * (TEXT_TOKENS
                                                                                                   - length)
            assert conditioning[f"{prefix}image_pad_mask"][k, :length].tolist() == slots[0].long().tolist()
    for prefix in ("", "negative_"):  # same instruction, other image: other encodings
        embeds = conditioning[f"{prefix}prompt_embeds"]
        assert (embeds[0] - embeds[1]).abs().max() > 1e-3


def test_each_image_and_each_pair_is_encoded_once(make_plugin, edits):
    plugin = _plugin(make_plugin, edits, cfg=True, negative_prompt=" ")
    adapter = plugin.adapter
    encoded, read = [], []
    images, prompts = adapter.encode_condition_images, adapter.encode_prompts_with_images
    adapter.encode_condition_images = lambda batch: encoded.append(len(batch)) or images(batch)
    adapter.encode_prompts_with_images = lambda texts, pictures, length: (
        read.append(list(texts)) or prompts(texts, pictures, length))
    rows = image_rows(edits, ADAPTER, 0, 1)
    plugin.rollout(plugin.policy(), image_batch(rows, 2))
    plugin.rollout(plugin.policy(), image_batch(rows, 3, first_group=4))
    assert encoded == [2]  # two image files, once for all samples and both rollouts
    assert read == [["make it red", "add a big dog"], [" ", " "]]  # the pairs, then each image's negative; once


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(make_plugin, edits, cfg):
    plugin = _plugin(make_plugin, edits, cfg=cfg, negative_prompt=" ", guidance_scale=3.0 if cfg else None)
    perturb_lora(plugin)
    rollout = plugin.rollout(plugin.policy(), image_batch(image_rows(edits, ADAPTER, 0, 1, 0), 2)).validate()
    assert rollout.old_logp.shape == (6, 3)
    assert_ratio_one_for_any_split(plugin, rollout)  # other LoRA weights move the ratio: it can fail


def test_two_grpo_steps_train_the_lora_with_ratio_one(train_config, edits, tmp_path):
    options = {"adapter": ADAPTER, "dataset": str(edits), "eval_dataset": str(edits), "prompts": None,
               "eval_prompts": None, "resolution": 32, "max_sequence_length": TEXT_TOKENS}
    changed = train_two_steps(Trainer(train_config("qwen_image21", tmp_path, **options)), frozen_components=True)
    for target in ("attn.to_q", "attn.to_out.0", "img_mlp.proj", "img_mlp.out"):
        assert any(f".{target}.lora_B" in key for key in changed), target


def test_several_images_per_row_are_the_pipelines_image_list_in_a_mixed_batch(make_plugin, several):
    """Rows of two, one and two (swapped) images in one rollout: each is the pipeline given ``image=[a, b]`` in the
    row's order (the template's ``<image1>``, `` <image2>``, their latents in order, an img_shapes entry each); the
    order matters. 32 px images and ``output_resolution`` 32 keep every input at 32 × 32."""
    plugin = _plugin(make_plugin, several / "train.jsonl", eval_num_steps=3)
    perturb_lora(plugin)  # in the pipeline's transformer too: the random model then reads its inputs strongly
    rows = plugin.dataset("train")
    rollout = plugin.rollout(plugin.policy(), image_batch(rows, 1, first_seed=5, training=False)).validate()
    assert rollout.payload["condition_image_counts"].tolist() == [2, 1, 2]
    pipeline = plugin.adapter.pipeline
    outputs = [_pipeline_image(pipeline, row_images(row), row["prompt"], seed, 32, 32, 32)
               for row, seed in zip(rows, (5, 6, 7), strict=True)]
    torch.testing.assert_close(rollout.payload["images"], torch.cat(outputs), rtol=0, atol=1e-5)
    swapped = _pipeline_image(pipeline, row_images(rows[0])[::-1], rows[0]["prompt"], 5, 32, 32, 32)
    assert (swapped - outputs[0]).abs().max() > 1e-3  # the order matters: the check can fail
    with torch.no_grad():
        _, _, slots = pipeline.encode_prompt(prompt=[rows[0]["prompt"]], image=row_images(rows[0]), device="cpu")
    assert int(slots.sum()) == 2  # a slot per 32 px image


def test_ratio_one_with_mixed_image_counts(make_plugin, several):
    plugin = _plugin(make_plugin, several / "train.jsonl", cfg=True, negative_prompt=" ", guidance_scale=3.0)
    perturb_lora(plugin)
    rollout = plugin.rollout(plugin.policy(), image_batch(plugin.dataset("train"), 2)).validate()
    assert_ratio_one_for_any_split(plugin, rollout)


def test_buckets_follow_the_last_input_image(make_plugin, several):
    """The pipeline sizes its output by ``image[-1]``: a row of a wide then a tall image is generated tall, and the
    other order wide; both inputs are brought to the bucket, and the rollout is a run configured at its size."""
    shaped = several / "shaped.jsonl"
    plugin = _plugin(make_plugin, shaped, buckets=[[32, 64], [64, 32]])
    assert plugin.row_buckets("train") == ["64x32", "32x64"]
    rows = plugin.dataset("train")
    rollout = plugin.rollout(plugin.policy(), image_batch(rows[:1], 2)).validate()
    assert rollout.payload["images"].shape == rollout.payload["condition_images"].shape == (2, 3, 64, 32)
    assert rollout.payload["more_condition_images"].shape == (2, 1, 3, 64, 32)
    fixed = _plugin(make_plugin, shaped, height=64, width=32)
    expected = fixed.rollout(fixed.policy(), image_batch(fixed.dataset("train")[:1], 2))
    torch.testing.assert_close(rollout.payload["images"], expected.payload["images"], rtol=0, atol=1e-6)


def test_the_shared_refusals_and_the_adapters_own(make_plugin, edits):
    from mmrl.plugins.flow.adapters import adapter_for_pipeline
    from mmrl.plugins.flow.adapters.qwen_image21_edit import QwenImage21EditAdapter

    assert adapter_for_pipeline("QwenImage21Pipeline", "m").name == "qwen_image21"  # auto keeps text-to-image
    with pytest.raises(ConfigError, match=r"^config key 'plugin.prompts': got \['a cat'\]; allowed: null: the "
                                          r"qwen_image21_edit adapter conditions every sample on an input image"):
        make_plugin("qwen_image21", adapter=ADAPTER, prompts=["a cat"], resolution=32)
    with pytest.raises(ValueError, match=r"^qwen_image21_edit adapter: object is not a QwenImage21Pipeline; "):
        QwenImage21EditAdapter(object(), torch.device("cpu"))
    # 160 x 160 px is over the tiny processor's 128² pixels: it shrinks the image, and the slots no longer match
    plugin = _plugin(make_plugin, edits, condition_size=[160, 160])
    with pytest.raises(ValueError, match=r"^qwen_image21_edit adapter: the processor gave 'make it red''s 1 input "
                                         r"image\(s\) of 160x160 px \d+ vision tokens where the transformer needs 25, "
                                         r"one per 2x2 latent tokens: plugin.condition_size must lie within the "
                                         r"processor's min_pixels/max_pixels$"):
        plugin.rollout(plugin.policy(), image_batch(image_rows(edits, ADAPTER, 0), 1))
    short = _plugin(make_plugin, edits, max_sequence_length=8)
    with pytest.raises(ValueError, match=r"^plugin.max_sequence_length is 8, but 'make it red' with its image and its "
                                         r"template is \d+ text tokens: raise it$"):
        short.rollout(short.policy(), image_batch(image_rows(edits, ADAPTER, 0), 1))


def test_the_recipe_runs_a_step_on_the_tiny_pipeline(pipelines, several, edits, tmp_path):
    """configs/flow/qwen_image21_edit_pickscore.yaml as written (no CFG pass, buckets at calculate_dimensions' sizes,
    one trained SDE step drawn from 1-3 at noise level 1.0, EMA, gradient checkpointing, two optimizer steps per
    rollout), on the tiny pipeline with the edit rows, the buckets scaled down to 32² (training) and 64² (evaluation)
    areas, and the test reward: the combination loads, trains at ratio 1 and evaluates."""
    trainer = run_recipe_step("qwen_image21_edit_pickscore.yaml", pipelines["qwen_image21"], tmp_path,
                              f"plugin.dataset={edits}", f"plugin.eval_dataset={several / 'train.jsonl'}",
                              "plugin.resolution=32", "plugin.buckets=[[32, 32], [32, 64], [64, 32]]",
                              "plugin.eval_buckets=[[64, 64], [64, 96]]", "plugin.max_sequence_length=64",
                              "rewards.functions=[{name: test_brightness}]")
    assert (trainer.plugin.cfg, trainer.plugin.guidance_scale) == (False, 1.0)
    assert trainer.plugin.adapter.name == ADAPTER
