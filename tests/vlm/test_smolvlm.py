"""SmolVLM2 (``family: smolvlm``) and SmolVLM-Instruct v1 (``family: idefics3``) on tiny builds with SmolVLM's tokens
and chat layout, images scaled to a longest edge and cut into 28-pixel tiles plus a global view (``<row_r_col_c>`` and
``<global-img>`` blocks of ``<image>`` tokens), a SigLIP tower with pixel shuffle and a Llama language model: the
rollout's log-probs and the plugin's teacher-forced log-probs equal the log-softmax of a plain per-sample transformers
forward (``SmolVLMForConditionalGeneration(**processor.apply_chat_template(..., tokenize=True))``, the processor's
``pixel_values [1, frames, 3, M, M]`` and ``pixel_attention_mask``, the completion appended), with images of different
tile grids in one batch (prompts of different lengths, left padding), interleaved groups, the feature cache on and off,
and with splitting off at a one-tile longest edge; the sampling scores are the teacher-forced distribution and the
tokens those of transformers' ``generate``; a batched processor output (prompts with 1, 2 and 0 images) is split per
prompt, collated back and scored as each prompt alone; the canvas sizes are the processor's; the cache holds the
tower and connector's output and freezing covers both; two GRPO steps through the trainer (``tiny_model: smolvlm``)
and a LoRA export that loads with peft; the refusals.

The prompt ids against ``apply_chat_template`` with the tokenizer adding BOS or not are checked in
test_chat_prompts.py. Every test needs ``num2words``, which transformers' ``SmolVLMProcessor`` imports."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmrl.plugin import PromptBatch
from mmrl.plugins.vlm.plugin import row_images
from mmrl.trainer.learn import old_policy_pass
from tests.vlm.conftest import assert_two_lora_grpo_steps_and_a_peft_export, make_plugin
from tests.vlm.test_decode import assert_decode_scores_are_teacher_forced, fill_lora_b

pytest.importorskip("num2words", reason="transformers' SmolVLMProcessor needs num2words")

GROUPS = [0, 1, 2, 0, 1, 2]  # interleaved groups, as the spread layout deals them
MIN_PIXELS, MAX_PIXELS = 4 * 28 * 28, 16 * 28 * 28  # the tests' bounds: longest edge 112 = 4 tiles of 28 pixels
DATA = {"synthetic": {"train_size": 20, "eval_size": 2, "tasks": ["grounding"], "seed": 2}}
"""Enough synthetic rows for images of 4 × 4, 3 × 4 and 4 × 2 tiles (17, 13 and 9 frames) among them."""


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """The tiny ``smolvlm`` and ``idefics3`` builds, each built on first use."""
    from mmrl.plugins.vlm.adapters import vlm_adapters
    from mmrl.plugins.vlm.testing import build_tiny_model

    root = tmp_path_factory.mktemp("smolvlm")
    paths = {}

    def build(family):
        if family not in vlm_adapters:
            pytest.skip(f"transformers has no {family}")
        if family not in paths:
            paths[family] = build_tiny_model(family, root / family)
        return paths[family]

    return build


def random_image(width, height, seed):
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8"))


def hand_written_chat(question, images=1):
    """SmolVLM's chat layout, each image an ``<image>`` (the processor expands it into the image's tiles)."""
    return "<|im_start|>User:" + "<image>" * images + question + "<end_of_utterance>\nAssistant:"


def plain_forward_logp(plugin, row, completion):
    """The tempered log-probs ``[C]`` of ``completion`` after the row's prompt under a plain transformers forward: the
    prompt built by transformers itself, ``processor.apply_chat_template(..., tokenize=True)`` on the row's raw image
    and question (with the processor's ``pixel_values [1, frames, 3, M, M]`` and ``pixel_attention_mask``), the
    completion appended, ``model(**inputs).logits``, the plugin's suppressed ids removed."""
    images = row_images(row)
    assert len(images) == 1 and images[0].size == tuple(row["image_size"])  # the raw image
    messages = [{"role": "user", "content": [{"type": "image", "image": images[0]},
                                             {"type": "text", "text": plugin.question(row)}]}]
    inputs = plugin.adapter.processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                          add_generation_prompt=True, return_tensors="pt")
    assert set(inputs) == {"input_ids", "attention_mask", "pixel_values", "pixel_attention_mask"}
    prompt_ids = inputs["input_ids"][0]
    bos = plugin.adapter.tokenizer.bos_token_id
    assert int(prompt_ids[0]) == bos and int((prompt_ids == bos).sum()) == 1  # one <|im_start|>: the template's
    inputs["input_ids"] = torch.cat([prompt_ids, completion]).unsqueeze(0)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    with torch.no_grad():
        logits = plugin.policy()(**inputs).logits[0, len(prompt_ids) - 1:-1].float()  # [C, V]
    logits[:, plugin.adapter.suppressed_token_ids()] = -torch.inf
    expected = (logits / plugin.config.temperature).log_softmax(-1)
    return prompt_ids, inputs, expected.gather(-1, completion.unsqueeze(-1))[:, 0]


def interleaved_batch(rows, seed):
    return PromptBatch(rows=[rows[g] for g in GROUPS], group_ids=torch.tensor(GROUPS), group_size=2,
                       seeds=torch.arange(len(GROUPS)) + 1000 * seed, generator=torch.Generator().manual_seed(seed))


def distinct_canvas_rows(plugin, count=3):
    """The first ``count`` training rows whose images make different numbers of frames (tile grids)."""
    chosen, seen = [], set()
    for row in plugin.dataset("train"):
        frames = plugin.adapter.frames_per_image(row["image_size"])
        if frames not in seen:
            seen.add(frames)
            chosen.append(row)
    assert len(chosen) >= count, seen
    return chosen[:count]


@pytest.mark.parametrize(("family", "cache", "attention", "bounds"),
                         [("smolvlm", True, "eager", (MIN_PIXELS, MAX_PIXELS)),
                          ("smolvlm", False, "sdpa", (MIN_PIXELS, MAX_PIXELS)),
                          ("smolvlm", True, "sdpa", (28 * 28, 28 * 28)),
                          ("idefics3", True, "eager", (MIN_PIXELS, MAX_PIXELS))],
                         ids=["cached", "pixels-sdpa", "one-tile-unsplit", "idefics3-cached"])
def test_log_probs_are_a_plain_per_sample_forward(builds, family, cache, attention, bounds):
    """Interleaved groups of prompts whose images have different tile grids (so different numbers of frames and
    tokens, prompts of different lengths, left padding): each sample's old log-probs (the core's teacher-forced pass;
    the shared prompt forward with the cache, the plain pass without) equal a plain per-sample forward of the prompt
    transformers' own ``apply_chat_template`` builds (one ``<|im_start|>``), whose ids the replay holds; the plugin's
    forward on a reordered subset gives ratio 1. Eager attention with the cache, SDPA (the recipes' kernel) without;
    a longest edge of one tile (``max_pixels`` 28²), where no image is split; and SmolVLM v1's Idefics3 classes."""
    min_pixels, max_pixels = bounds
    plugin = make_plugin(builds(family), max_new_tokens=8, cache_image_features=cache, temperature=0.9,
                         share_prompt_forward=cache, attn_implementation=attention, min_pixels=min_pixels,
                         max_pixels=max_pixels, data=DATA)
    assert plugin.model.config.text_config._attn_implementation == attention
    assert plugin.adapter.name == family and plugin.adapter.box_convention == "qwen2_5_vl"
    assert plugin.cache_features == cache
    split = max_pixels > 28 * 28
    rows = distinct_canvas_rows(plugin) if split else plugin.dataset("train")[:3]
    rollout = old_policy_pass(plugin, plugin.policy(), plugin.rollout(plugin.policy(), interleaved_batch(rows, 4)))
    rollout.validate()
    vision = {"image_embeds"} if cache else {"pixel_values"}
    assert set(rollout.replay) == {"input_ids", "completion_ids"} | vision
    assert max(len(c) for c in rollout.replay["completion_ids"]) > 1
    frame_counts = set()
    for i, group in enumerate(GROUPS):
        completion = rollout.replay["completion_ids"][i]
        prompt_ids, inputs, expected = plain_forward_logp(plugin, rows[group], completion)
        assert torch.equal(rollout.replay["input_ids"][i], prompt_ids)
        frames = inputs["pixel_values"].shape[1]
        frame_counts.add(frames)
        assert frames == plugin.adapter.frames_per_image(rows[group]["image_size"])
        assert plugin.adapter.image_sizes(prompt_ids).tolist() == [rows[group]["resized_size"][::-1]]
        torch.testing.assert_close(rollout.old_logp[i, :len(completion)], expected, rtol=0, atol=1e-5)
    assert len(frame_counts) == (3 if split else 1) and (min(frame_counts) > 1) is split
    part = rollout.select([5, 0, 3])
    with torch.no_grad():
        output = plugin.forward(plugin.policy(), part, need_reference=True)
    assert float((output.logp - part.old_logp).abs().max()) < 1e-5


def test_sampling_is_the_teacher_forced_distribution_and_matches_generate(builds):
    """With non-zero LoRA B: the decode loop's scores give each sampled token the teacher-forced log-prob, and its
    tokens are transformers' ``generate``'s, greedy and sampled, with the shared prefill and without."""
    torch.manual_seed(0)
    plugin = make_plugin(builds("smolvlm"), max_new_tokens=6, data=DATA)
    fill_lora_b(plugin.model, seed=3)
    rows = distinct_canvas_rows(plugin)
    prompts = plugin.encode_rows([rows[g] for g in GROUPS], torch.tensor(GROUPS), model=plugin.model)
    config = plugin.generation_config(True)
    config.top_k, config.top_p = 0, 1.0
    assert_decode_scores_are_teacher_forced(plugin, prompts, config)
    pixels = plugin.encode_rows([rows[g] for g in GROUPS], torch.tensor(GROUPS))
    for sampled in (False, True):
        config = plugin.generation_config(sampled)
        runs = []
        for decoder, share, inputs in (("mmrl", True, prompts), ("hf", True, prompts), ("hf", False, pixels)):
            torch.manual_seed(11)
            with torch.no_grad():
                sequences, width = plugin.adapter.generate(plugin.model, inputs, config, share_prefill=share,
                                                           decoder=decoder)
            runs.append(sequences[:, width:])
        assert runs[0].shape[1] > 1
        assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2]), sampled


def test_a_batched_processor_output_is_split_per_prompt_collated_back_and_scored_alone(builds):
    """One processor call on prompts with 1, 2, 0 and 1 images of different tile grids: each prompt gets exactly the
    ids the processor gives it alone and its own real frames (no padding frames), the canvases read from its ids are
    :meth:`resized_size`'s and its frame count the ``<row_r_col_c>`` grid plus the global view; collating the prompts
    gives the batch's real frames in order as one row; the batched forward of the collated prompts (left padding, all
    frames in one row, no mask) gives every prompt the logits the model gives it alone with the processor's padded
    ``pixel_values`` and ``pixel_attention_mask``. ``resized_size`` is the processor's canvas for sizes of every aspect
    (and its grid transformers' own ``get_number_of_image_patches``'s)."""
    from mmrl.plugins.vlm.adapters.smolvlm import SmolVLMAdapter

    path = builds("smolvlm")
    adapter = SmolVLMAdapter(str(path), min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    assert (adapter.longest_edge, adapter.tile, adapter.image_seq_len) == (112, 28, 4)
    images = [[random_image(150, 60, 1)], [random_image(64, 120, 2), random_image(100, 80, 3)], [],
              [random_image(300, 40, 4)]]
    texts = [hand_written_chat(f"question {i}", images=len(group)) for i, group in enumerate(images)]
    prompts = adapter.encode(texts, images)
    vocab = adapter.tokenizer.get_vocab()
    for text, group, prompt in zip(texts, images, prompts, strict=True):
        alone = adapter.processor(text=[text], images=[group] if group else None, return_tensors="pt",
                                  add_special_tokens=False)
        ids = prompt["input_ids"]
        assert torch.equal(ids, alone["input_ids"][0])
        frames = sum(adapter.frames_per_image(image.size) for image in group)
        assert prompt["pixel_values"].shape == (frames, 3, 28, 28)
        if not group:
            continue
        torch.testing.assert_close(prompt["pixel_values"], alone["pixel_values"][0], rtol=0, atol=0)
        assert bool(alone["pixel_attention_mask"].all())  # every real frame is a whole tile
        assert adapter.image_sizes(ids).tolist() == [list(adapter.resized_size(image.size))[::-1] for image in group]
        grids = [adapter.tile_grid(image.size) for image in group]
        assert int((ids == vocab["<global-img>"]).sum()) == len(group)
        assert int((ids == vocab["<fake_token_around_image>"]).sum()) == sum(c * r + 2 for c, r in grids)
        assert adapter.image_token_count(prompt) == 4 * frames
    assert [adapter.tile_grid(image.size) for image in (images[0][0], *images[1], images[3][0])] == [
        (4, 2), (3, 4), (4, 4), (4, 1)]  # 150x60 -> 112x56, 64x120 -> 84x112, 100x80 -> 112x112, 300x40 -> 112x28
    batch = adapter.processor(text=texts, images=[list(group) for group in images], padding=True,
                              padding_side="left", return_tensors="pt", add_special_tokens=False)
    inputs, width = adapter.collate(prompts)
    assert set(inputs) == {"input_ids", "attention_mask", "pixel_values"}
    assert torch.equal(inputs["input_ids"], batch["input_ids"]) and width == batch["input_ids"].shape[1]
    assert torch.equal(inputs["attention_mask"], batch["attention_mask"])
    real = batch["pixel_attention_mask"].flatten(2).any(-1)  # [B, max frames]: the processor's real frames
    assert torch.equal(inputs["pixel_values"][0], batch["pixel_values"][real])
    from transformers import SmolVLMForConditionalGeneration

    model = SmolVLMForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model(**adapter._positioned(inputs)).logits  # [B, P, V]
        for i, (text, group) in enumerate(zip(texts, images, strict=True)):
            alone = adapter.processor(text=[text], images=[group] if group else None, return_tensors="pt",
                                      add_special_tokens=False)
            expected = model(**alone).logits[0]  # [P_i, V]
            torch.testing.assert_close(logits[i, width - expected.shape[0]:], expected, rtol=0, atol=1e-5)
    image_processor = adapter.processor.image_processor
    for size in ((150, 60), (60, 150), (1, 300), (300, 1), (77, 77), (113, 29), (29, 113), (500, 181), (10, 9)):
        alone = adapter.processor(text=[hand_written_chat("q")], images=[[random_image(*size, 5)]],
                                  return_tensors="pt")
        assert adapter.image_sizes(alone["input_ids"][0]).tolist() == [list(adapter.resized_size(size))[::-1]]
        cols, rows = adapter.tile_grid(size)
        assert alone["pixel_values"].shape[1] == cols * rows + 1
        _, upstream_rows, upstream_cols = image_processor.get_number_of_image_patches(size[1], size[0])
        assert (upstream_cols, upstream_rows) == (cols, rows), size  # transformers' own count agrees here
    smaller = SmolVLMAdapter(str(path), min_pixels=10, max_pixels=70 * 70)  # longest edge 56: 2 tiles at most a side
    for size in ((150, 60), (60, 150), (77, 77), (300, 20)):
        alone = smaller.processor(text=[hand_written_chat("q")], images=[[random_image(*size, 6)]],
                                  return_tensors="pt")
        width, height = smaller.resized_size(size)
        assert smaller.image_sizes(alone["input_ids"][0]).tolist() == [[height, width]]
        assert alone["pixel_values"].shape[1] == smaller.frames_per_image(size) and width * height <= 70 * 70


def test_the_feature_cache_holds_the_connectors_output_and_freezing_covers_it(builds):
    """A prompt's cached features are ``get_image_features``'s output for its own frames (tower, pixel shuffle and
    projection), ``image_seq_len`` rows per frame; the model reads them (zeroing them changes the log-probs) and
    gives the pixel path's log-probs; full fine-tuning with ``freeze_vision`` freezes exactly the tower and the
    connector, LoRA adapts the language model only."""
    plugin = make_plugin(builds("smolvlm"), data=DATA)
    rows = distinct_canvas_rows(plugin)
    pixels = plugin.encode_rows(rows)
    cached = plugin.encode_rows(rows, model=plugin.model)
    for prompt, features in zip(pixels, cached, strict=True):
        with torch.no_grad():
            alone = plugin.model.model.get_image_features(pixel_values=prompt["pixel_values"][None],
                                                          return_dict=True)
        torch.testing.assert_close(features["image_embeds"], torch.cat(alone.pooler_output), rtol=0, atol=1e-6)
        assert features["image_embeds"].shape == (plugin.adapter.image_token_count(prompt), 32)
    completions = [torch.tensor([100, 101, 102]), torch.tensor([103]), torch.tensor([104, 105])]  # not suppressed
    with torch.no_grad():
        from_pixels, _ = plugin.token_logp(plugin.policy(), pixels, completions, 3, with_entropy=False)
        from_cache, _ = plugin.token_logp(plugin.policy(), cached, completions, 3, with_entropy=False)
        zeroed = [{**p, "image_embeds": torch.zeros_like(p["image_embeds"])} for p in cached]
        blind, _ = plugin.token_logp(plugin.policy(), zeroed, completions, 3, with_entropy=False)
    torch.testing.assert_close(from_cache, from_pixels, rtol=0, atol=1e-5)
    assert float((blind - from_cache).abs().max()) > 1e-3
    with pytest.raises(ValueError, match="^smolvlm: a batch mixes prompts with cached image features"):
        plugin.adapter.collate([cached[0], pixels[1]])
    adapted = [name for name, p in plugin.model.named_parameters() if p.requires_grad]
    assert adapted and all("lora_" in name and ".text_model." in name for name in adapted)
    full = make_plugin(builds("smolvlm"), lora=None)
    frozen = {name for name, p in full.model.named_parameters() if not p.requires_grad}
    assert frozen == {name for name, _ in full.model.named_parameters()
                      if name.startswith(("model.vision_model.", "model.connector."))}
    assert "model.connector.modality_projection.proj.weight" in frozen


def test_two_grpo_steps_with_lora_and_the_export_loads_with_peft(tmp_path):
    """Two GRPO steps of ``tiny_model: smolvlm`` with LoRA, ratio 1, only the language model's (``text_model``)
    adapters trained, and the peft export (``assert_two_lora_grpo_steps_and_a_peft_export``); boxes in pixels of the
    tile canvas."""
    pytest.importorskip("transformers.models.smolvlm")

    def check_rows(plugin):
        assert plugin.reward_context()["box_convention"] == "qwen2_5_vl"
        for row in plugin.dataset("train"):  # the boxes' frame: the processor's canvas of the row's image
            assert row["resized_size"] == list(plugin.adapter.resized_size(row["image_size"]))

    assert_two_lora_grpo_steps_and_a_peft_export(tmp_path, "smolvlm", check_rows, language_model=".text_model.")


def test_refusals_tokens_and_family(builds):
    """Video rows and videos are refused, as are qwen-vl-utils, a ``max_pixels`` below one tile, a ``min_pixels``
    above the smallest canvas and ids that do not form whole images, each in one line; ``family: auto`` reads
    ``model_type: smolvlm`` and ``idefics3``; the image, frame, global-view and tile position tokens are suppressed, the
    chat markers are not, and a completion ends at ``<end_of_utterance>``; a system prompt is a ``System:`` turn."""
    from mmrl.plugins.vlm.adapters import adapter_for
    from mmrl.plugins.vlm.adapters.smolvlm import Idefics3Adapter, SmolVLMAdapter

    path = builds("smolvlm")
    motion = {"synthetic": {"train_size": 4, "eval_size": 2, "tasks": ["motion"], "seed": 2}}
    with pytest.raises(ValueError, match=r"^vlm family 'smolvlm' does not take videos, and the 'train' split holds "
                                         r"video rows: train this family on image rows only$"):
        make_plugin(path, data=motion)
    adapter = SmolVLMAdapter(str(path), min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    frames = [random_image(56, 56, k) for k in range(4)]
    refusal = r"^smolvlm: videos are not supported for this family \(its processor writes a video as timestamped"
    with pytest.raises(ValueError, match=refusal):
        adapter.load_videos([frames])
    with pytest.raises(ValueError, match=refusal):
        adapter.encode([hand_written_chat("q", images=0)], [[]], [[frames]], [[2.0]])
    with pytest.raises(ValueError, match="^SmolVLM images are resized and tiled by SmolVLM's processor, not by "
                                         "qwen-vl-utils$"):
        adapter.load_images([random_image(56, 56, 0)], use_qwen_vl_utils=True)
    with pytest.raises(ValueError, match=r"^smolvlm: max_pixels 783 is below one 28 x 28 tile; set plugin.max_pixels "
                                         r"to at least 784$"):
        SmolVLMAdapter(str(path), min_pixels=10, max_pixels=783)
    with pytest.raises(ValueError, match=r"^smolvlm: min_pixels 3137 exceeds the smallest image the processor makes "
                                         r"at longest_edge 112 \(3136 pixels: every image is scaled to that longest "
                                         r"edge\); set plugin.min_pixels to at most 3136$"):
        SmolVLMAdapter(str(path), min_pixels=3137, max_pixels=MAX_PIXELS)
    smaller = SmolVLMAdapter(str(path), min_pixels=10, max_pixels=70 * 70)
    assert smaller.longest_edge == 56 and smaller.smallest_canvas == 56 * 28  # ⌊√4900⌋ = 70, down to 2 tiles
    assert SmolVLMAdapter(str(path), min_pixels=10, max_pixels=10 ** 6).longest_edge == 112  # the checkpoint's
    vocab = adapter.tokenizer.get_vocab()
    image, glob, fake = vocab["<image>"], vocab["<global-img>"], vocab["<fake_token_around_image>"]
    r11, r12, r21, r22 = (vocab[f"<row_{r}_col_{c}>"] for r, c in ((1, 1), (1, 2), (2, 1), (2, 2)))
    tile = [image] * 4
    with pytest.raises(ValueError, match=r"^smolvlm: an image's tiles \[\(1, 1\), \(2, 2\)\] are not a row-major "
                                         r"grid"):
        adapter.image_sizes(torch.tensor([fake, r11, *tile, fake, r22, *tile, fake, glob, *tile, fake]))
    with pytest.raises(ValueError, match=r"^smolvlm: a tile or global-view token not followed by 4 <image> tokens"):
        adapter.image_sizes(torch.tensor([fake, glob, image, image, fake]))
    with pytest.raises(ValueError, match=r"^smolvlm: <image> tokens outside a tile or global view"):
        adapter.image_sizes(torch.tensor([100, image, image, 101]))
    with pytest.raises(ValueError, match=r"^smolvlm: the prompt ends inside an image"):
        adapter.image_sizes(torch.tensor([fake, r11, *tile]))
    two_by_two = [r11, *tile, r12, *tile, r21, *tile, r22, *tile, glob, *tile]
    assert adapter.image_sizes(torch.tensor([100, *two_by_two, 101, glob, *tile])).tolist() == [[56, 56], [28, 28]]
    assert adapter_for("auto", str(path)) is SmolVLMAdapter
    assert adapter_for("auto", str(builds("idefics3"))) is Idefics3Adapter
    rows_cols = {vocab[f"<row_{r}_col_{c}>"] for r in range(1, 7) for c in range(1, 7)}
    assert set(adapter.suppressed_token_ids()) == {image, glob, fake, vocab["<video>"]} | rows_cols
    plugin = make_plugin(path, system_prompt="Be brief.")
    assert plugin.eos_ids == [vocab["<end_of_utterance>"]]
    assert not {vocab["<|im_start|>"], vocab["<|im_end|>"]} & set(plugin.suppressed_ids)
    text = adapter.chat_text(adapter.messages("Where?", 1, "Be brief."))
    assert text == "<|im_start|>System: Be brief.<end_of_utterance>\nUser:<image>Where?<end_of_utterance>\nAssistant:"
    assert adapter.tokenizer("Where?")["input_ids"][0] != adapter.tokenizer.bos_token_id  # adds no BOS (module doc)
    assert adapter.adds_special_tokens([text]) is False  # the template wrote <|im_start|>
