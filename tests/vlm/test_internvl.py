"""InternVL (``family: internvl``: InternVL3 / InternVL3.5 "-hf" checkpoints) on a tiny build with InternVL3-hf's
tokens and chat layout: the tile counts the adapter predicts are the processor's and follow the pixel bounds, a
batched processor output is split into each prompt's own tiles (mixed tile counts, a prompt with two images), the
rollout's log-probs equal a plain transformers forward of the chat written by hand with the processor called on the
raw image (with and without the feature cache), the cache holds the projector's output and freezing covers the
projector, the boxes are read on the 0–1000 grid, videos are refused, and ``family: auto`` finds the adapter.

The decode loop against ``generate``, the shared prompt forward and LoRA training steps run for InternVL in
test_decode.py, test_prefix.py and test_training.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmrl.plugins.vlm.plugin import row_images
from mmrl.reward import RewardError, RewardInput
from mmrl.trainer import Trainer
from mmrl.trainer.learn import old_policy_pass
from tests.vlm.conftest import assert_old_logp_is_a_plain_forward, make_plugin, prompt_batch

MIN_PIXELS, MAX_PIXELS = 4 * 28 * 28, 16 * 28 * 28  # the tests' bounds: 1 to 4 tiles of 56² pixels


@pytest.fixture(scope="module")
def internvl_model(tmp_path_factory):
    from mmrl.plugins.vlm.adapters import vlm_adapters
    from mmrl.plugins.vlm.testing import build_tiny_model

    if "internvl" not in vlm_adapters:
        pytest.skip("transformers has no internvl")
    return build_tiny_model("internvl", tmp_path_factory.mktemp("internvl") / "internvl")


@pytest.fixture(scope="module")
def adapter(internvl_model):
    from mmrl.plugins.vlm.adapters.internvl import InternVLAdapter

    return InternVLAdapter(str(internvl_model), min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def random_image(width, height, seed):
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8"))


def hand_written_chat(question, images=1):
    """InternVL3-hf's chat layout, each image a ``<IMG_CONTEXT>`` line (the processor expands it to its tiles)."""
    return "<|im_start|>user\n" + "<IMG_CONTEXT>\n" * images + question + "<|im_end|>\n<|im_start|>assistant\n"


def test_tile_counts_are_the_processors_and_follow_the_pixel_bounds(internvl_model, adapter):
    """:meth:`tiles_per_image` (the thumbnail included) against the number of tiles the image processor makes of
    the raw image, over square, wide, tall and random sizes; the tiled canvas is a whole number of tiles; the pixel
    bounds set the tile bounds (at least one tile)."""
    from mmrl.plugins.vlm.adapters.internvl import InternVLAdapter

    image_processor = adapter.processor.image_processor
    assert (image_processor.min_patches, image_processor.max_patches) == (1, 4)
    sizes = [(56, 56), (63, 67), (160, 56), (56, 160), (100, 80), (300, 40), (20, 20), (111, 57)]
    sizes += [tuple(int(v) for v in np.random.default_rng(i).integers(10, 400, 2)) for i in range(20)]
    counts = set()
    for number, size in enumerate(sizes):
        made = int(adapter.processor(text=[hand_written_chat("q")], images=[random_image(*size, number)],
                                     return_tensors="pt")["pixel_values"].shape[0])
        assert adapter.tiles_per_image(size) == made, size
        columns, rows = adapter.tile_grid(size)
        assert adapter.resized_size(size) == (columns * 56, rows * 56)
        counts.add(made)
    assert counts == {1, 3, 4, 5}  # one tile alone, or 2-4 tiles and the thumbnail
    one = InternVLAdapter(str(internvl_model), min_pixels=10, max_pixels=1000)  # under one tile: still one
    assert (one.processor.image_processor.min_patches, one.processor.image_processor.max_patches) == (1, 1)
    assert one.tiles_per_image((300, 40)) == 1 and one.resized_size((300, 40)) == (56, 56)
    wide = InternVLAdapter(str(internvl_model), min_pixels=2 * 56 * 56, max_pixels=6 * 56 * 56 + 55)
    assert (wide.processor.image_processor.min_patches, wide.processor.image_processor.max_patches) == (2, 6)
    with pytest.raises(ValueError, match="tiled by InternVL.s processor, not by qwen-vl-utils"):
        adapter.load_images([random_image(60, 60, 0)], use_qwen_vl_utils=True)
    assert adapter.load_images([random_image(63, 67, 0)])[0].size == (63, 67)  # unresized: the processor tiles


def test_a_batched_processor_output_is_split_into_each_prompts_tiles(adapter):
    """One processor call on prompts with 1, 4 + 1 and 5 tiles (a prompt with two images): each prompt gets exactly
    the tiles and token ids the processor gives it alone, and collating them back restores the batch's order."""
    images = [[random_image(56, 56, 1)], [random_image(160, 56, 2), random_image(60, 50, 3)],
              [random_image(100, 80, 4)]]
    texts = [hand_written_chat(f"question {i}", images=len(group)) for i, group in enumerate(images)]
    prompts = adapter.encode(texts, images)
    assert [int(p["pixel_values"].shape[0]) for p in prompts] == [1, 5, 5]
    for text, group, prompt in zip(texts, images, prompts, strict=True):
        alone = adapter.processor(text=[text], images=group, return_tensors="pt")
        assert torch.equal(prompt["input_ids"], alone["input_ids"][0])
        assert torch.equal(prompt["pixel_values"], alone["pixel_values"])  # [tiles, 3, 56, 56]
        assert adapter.image_token_count(prompt) == prompt["pixel_values"].shape[0] * adapter.image_seq_length
        assert sum(adapter.tiles_per_image(image.size) for image in group) == prompt["pixel_values"].shape[0]
    batch = adapter.processor(text=texts, images=[image for group in images for image in group], padding=True,
                              padding_side="left", return_tensors="pt")
    inputs, width = adapter.collate(prompts)
    assert torch.equal(inputs["pixel_values"], batch["pixel_values"]) and torch.equal(inputs["input_ids"],
                                                                                      batch["input_ids"])
    assert width == batch["input_ids"].shape[1] and set(inputs) == {"input_ids", "attention_mask", "pixel_values"}


@pytest.mark.parametrize("cache", [True, False], ids=["cached", "pixels"])
def test_image_log_probs_equal_a_plain_transformers_forward(internvl_model, cache):
    """Each sample's old log-probs (mixed tile counts in one batch, shared prefill and prompt forward, left padding)
    equal a plain forward of InternVL's chat written by hand with the processor called on the row's raw image; ratio
    1 on a reordered subset."""
    plugin = make_plugin(internvl_model, max_new_tokens=8, cache_image_features=cache)
    assert plugin.adapter.name == "internvl" and plugin.adapter.box_convention == "qwen2_vl"
    assert plugin.cache_features == cache
    rows = plugin.dataset("train")[:3]
    assert len({plugin.adapter.tiles_per_image(row["image_size"]) for row in rows}) == 3  # 1, 5 and 3 tiles
    group = 2
    rollout = old_policy_pass(plugin, plugin.policy(),
                              plugin.rollout(plugin.policy(), prompt_batch(rows, group, seed=4))).validate()
    assert set(rollout.replay) == {"input_ids", "image_embeds" if cache else "pixel_values", "completion_ids"}
    assert rollout.metrics["image_tokens"] == 4 * (1 + 5 + 3) / 3

    def processor_inputs(row):
        images = row_images(row)
        assert len(images) == 1 and images[0].size == tuple(row["image_size"])  # the raw image
        return plugin.adapter.processor(text=[hand_written_chat(plugin.question(row))], images=images,
                                        return_tensors="pt")

    assert_old_logp_is_a_plain_forward(plugin, rollout, rows, group, processor_inputs, atol=1e-5)
    part = rollout.select([5, 0, 3])
    with torch.no_grad():
        output = plugin.forward(plugin.policy(), part, need_reference=True)
    assert float((output.logp - part.old_logp).abs().max()) < 1e-5


def test_the_feature_cache_holds_the_projectors_output_and_freezing_covers_it(internvl_model):
    """The cached features of a prompt are ``get_image_features``'s output for its own tiles (vision tower, pixel
    shuffle, projector), the model reads them (zeroing them changes the log-probs) and gives the pixel path's
    log-probs; full fine-tuning with ``freeze_vision`` freezes the tower and the projector, LoRA adapts neither."""
    plugin = make_plugin(internvl_model)
    rows = plugin.dataset("train")[:3]
    pixels = plugin.encode_rows(rows)
    cached = plugin.encode_rows(rows, model=plugin.model)
    model = plugin.model.get_base_model() if hasattr(plugin.model, "get_base_model") else plugin.model
    for prompt, features in zip(pixels, cached, strict=True):
        with torch.no_grad():
            alone = model.model.get_image_features(pixel_values=prompt["pixel_values"], return_dict=True)
        torch.testing.assert_close(features["image_embeds"], alone.pooler_output.flatten(0, 1), rtol=0, atol=1e-6)
        assert features["image_embeds"].shape == (prompt["pixel_values"].shape[0] * 4, 32)
    completions = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])]
    with torch.no_grad():
        from_pixels, _ = plugin.token_logp(plugin.policy(), pixels, completions, 3, with_entropy=False)
        from_cache, _ = plugin.token_logp(plugin.policy(), cached, completions, 3, with_entropy=False)
        zeroed = [{**p, "image_embeds": torch.zeros_like(p["image_embeds"])} for p in cached]
        blind, _ = plugin.token_logp(plugin.policy(), zeroed, completions, 3, with_entropy=False)
    torch.testing.assert_close(from_cache, from_pixels, rtol=0, atol=1e-6)
    assert float((blind - from_cache).abs().max()) > 1e-3
    with pytest.raises(ValueError, match="mixes prompts with cached image features and prompts with pixels"):
        plugin.adapter.collate([cached[0], pixels[1]])
    adapted = [name for name, p in plugin.model.named_parameters() if p.requires_grad]
    assert adapted and all("lora_" in name and "language_model" in name for name in adapted)
    full = make_plugin(internvl_model, lora=None)
    frozen = {name for name, p in full.model.named_parameters() if not p.requires_grad}
    assert frozen == {name for name, _ in full.model.named_parameters()
                      if name.startswith(("model.vision_tower.", "model.multi_modal_projector."))}
    assert any(name.startswith("model.multi_modal_projector.") for name in frozen)


# A 640x480 image with the object at [64, 48, 320, 240], as InternVL writes it: 0-1000 of the image, <box>[[...]]</box>.
INTERNVL_ANSWER = "<answer><ref>the red circle</ref><box>[[100, 100, 500, 500]]</box></answer>"


def test_boxes_are_read_on_the_0_1000_grid_end_to_end(internvl_model, tmp_path):
    """The trainer hands the plugin's convention (``qwen2_vl``: 0–1000 of the image) to the iou reward: InternVL's
    ``<ref>…</ref><box>[[x1, y1, x2, y2]]</box>`` answer for the object scores 1, and the first of several boxes
    is the one scored; the same text read as Qwen2.5-VL pixels scores low, and that convention is refused unless
    allowed."""
    from mmrl.rewards.boxes import parse_boxes
    from tests.vlm.test_training import _config

    two = "<answer><ref>circles</ref><box>[[100, 100, 500, 500], [600, 600, 700, 700]]</box></answer>"
    assert parse_boxes(two, "qwen2_vl", (640, 480)) == [[64.0, 48.0, 320.0, 240.0], [384.0, 288.0, 448.0, 336.0]]
    batch = RewardInput(rows=[{"solution": [64, 48, 320, 240], "image_size": [640, 480], "resized_size": [672, 448]}
                              for _ in range(3)],
                        payload={"completions": [INTERNVL_ANSWER, two, '<answer>{"bbox_2d": [64, 48, 320, 240]}'
                                                                        "</answer>"]})
    trainer = Trainer(_config(tmp_path / "default", internvl_model, "internvl"))
    assert trainer.plugin.reward_context() == {"box_convention": "qwen2_vl"}
    column = trainer.scorer.names.index("iou")
    scores = trainer.scorer.score(batch).scores[:, column].tolist()
    assert scores[0] == pytest.approx(1.0) and scores[1] == pytest.approx(1.0) and scores[2] < 0.5
    with pytest.raises(RewardError, match="reward 'iou': option convention 'qwen2_5_vl' differs from 'qwen2_vl'"):
        Trainer(_config(tmp_path / "mismatch", internvl_model, "internvl", iou_args={"convention": "qwen2_5_vl"}))


def test_videos_are_refused_in_one_line(internvl_model, adapter):
    """A dataset with video rows is refused when the plugin starts, and a video handed to the adapter is refused."""
    motion = {"synthetic": {"train_size": 4, "eval_size": 2, "tasks": ["motion"], "seed": 2}}
    with pytest.raises(ValueError, match=r"^vlm family 'internvl' does not take videos, and the 'train' split holds "
                                         r"video rows: train this family on image rows only$"):
        make_plugin(internvl_model, data=motion)
    frames = [random_image(56, 56, k) for k in range(4)]
    with pytest.raises(ValueError, match="^internvl: videos are not supported for this family"):
        adapter.load_videos([frames])
    with pytest.raises(ValueError, match="^internvl: videos are not supported for this family"):
        adapter.encode([hand_written_chat("q", images=0) + "<video>\n"], [[]], [[frames]], [[2.0]])


def test_family_auto_and_the_suppressed_tokens(internvl_model, adapter):
    """``family: auto`` reads ``model_type: internvl``; sampling and scoring suppress the image delimiters, context
    and video tokens, never the grounding tags the model writes its boxes with."""
    from mmrl.plugins.vlm.adapters import adapter_for
    from mmrl.plugins.vlm.adapters.internvl import InternVLAdapter

    assert adapter_for("auto", str(internvl_model)) is InternVLAdapter
    vocab = adapter.tokenizer.get_vocab()
    assert adapter.suppressed_token_ids() == sorted(vocab[t] for t in ("<img>", "</img>", "<IMG_CONTEXT>", "<video>"))
    assert not {vocab[t] for t in ("<ref>", "</ref>", "<box>", "</box>")} & set(adapter.suppressed_token_ids())


def test_left_padded_rows_get_the_positions_they_have_alone(internvl_model):
    """InternVL's language model numbers positions from the first column when given none, padding included; the
    teacher-forced pass, the decode loop's prefill and HF generate's shared prefill give each left-padded row the
    positions 0, 1, 2, ... of its real tokens (rotary attention is relative, so float32 log-probs barely tell the
    two apart: the positions are checked directly)."""
    plugin = make_plugin(internvl_model, max_new_tokens=3)
    rows = plugin.dataset("train")[:3]
    prompts = plugin.encode_rows([rows[0], rows[1], rows[2], rows[0]], torch.tensor([0, 1, 2, 0]), model=plugin.model)
    lengths = [len(p["input_ids"]) for p in prompts]
    assert len(set(lengths)) == 3  # mixed tile counts: different prompt lengths, so left padding
    seen = []
    language_model = plugin.model.model.language_model  # LoRA is injected in place: the transformers model
    hook = language_model.register_forward_pre_hook(
        lambda _module, _args, kwargs: seen.append((kwargs["position_ids"], kwargs["attention_mask"])),
        with_kwargs=True)
    completions = [torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([8, 9]), torch.tensor([5, 6])]
    try:
        with torch.no_grad():
            inputs, width = plugin.adapter.collate(prompts, completions)
            plugin.adapter.completion_hidden(plugin.policy(), inputs, 2)  # the plain teacher-forced pass
            plugin.adapter.generate(plugin.policy(), prompts, plugin.generation_config(False))  # the decode loop
            plugin.adapter.generate(plugin.policy(), prompts, plugin.generation_config(False), decoder="hf")
    finally:
        hook.remove()
    prefills = [(positions, mask) for positions, mask in seen if positions.shape[-1] > 3]
    assert len(prefills) == 3  # teacher-forced, decode-loop prefill, generate's shared prefill
    for positions, mask in prefills:
        assert positions.dim() == 2 and positions.shape == mask.shape  # plain rotary positions [n, L]
        for row, attended in zip(positions, mask.bool(), strict=True):
            assert torch.equal(row[attended], torch.arange(int(attended.sum())))
