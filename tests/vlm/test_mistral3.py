"""Mistral 3 (``family: mistral3``) on a tiny build with Mistral's tokens and chat layout, a Pixtral tower on images
kept at their own aspect ratio (rows of ``[IMG]`` ended by ``[IMG_BREAK]`` / ``[IMG_END]``), and a Ministral 3 language
model whose query scaling depends on the position ids: the rollout's log-probs and the plugin's teacher-forced
log-probs equal the log-softmax of a plain per-sample transformers forward
(``Mistral3ForConditionalGeneration(**processor.apply_chat_template(..., tokenize=True))``, the completion appended),
with images of different sizes in one batch (prompts of different lengths, left padding), interleaved groups, and the
feature cache on and off; the sampling scores are the teacher-forced distribution and the tokens those of
transformers' ``generate``; a batched processor output is split per prompt and collated back; the image sizes read
from the ids are the processor's; the cache holds the tower and projector's output and freezing covers both; two GRPO
steps through the trainer (``tiny_model: mistral3``) and a LoRA export that loads with peft; the refusals.

The shared family tests run Mistral 3 too: the decode loop against ``generate`` in test_decode.py, the shared prompt
forward in test_prefix.py, the shared prefill in test_plugin.py, LoRA steps and the toy recipe in test_training.py;
its prompt ids against ``apply_chat_template`` with the tokenizer adding ``<s>`` or not in test_chat_prompts.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mmrl.plugin import PromptBatch
from mmrl.plugins.vlm.plugin import row_images
from mmrl.trainer.learn import old_policy_pass
from tests.vlm.conftest import assert_two_lora_grpo_steps_and_a_peft_export, make_plugin
from tests.vlm.test_decode import assert_decode_scores_are_teacher_forced, fill_lora_b

GROUPS = [0, 1, 2, 0, 1, 2]  # interleaved groups, as the spread layout deals them
MIN_PIXELS, MAX_PIXELS = 4 * 28 * 28, 16 * 28 * 28  # the tests' bounds: longest edge 112 = 7 tokens of 16 pixels


@pytest.fixture(scope="module")
def mistral3_model(tmp_path_factory):
    from mmrl.plugins.vlm.adapters import vlm_adapters
    from mmrl.plugins.vlm.testing import build_tiny_model

    if "mistral3" not in vlm_adapters:
        pytest.skip("transformers has no mistral3")
    return build_tiny_model("mistral3", tmp_path_factory.mktemp("mistral3") / "mistral3")


@pytest.fixture(scope="module")
def mistral_text_model(mistral3_model, tmp_path_factory):
    """The tiny build with Mistral Small 3.1/3.2's and Magistral's plain ``mistral`` language model (the same layers
    and weights without Ministral 3's YaRN and query scaling; rope_theta 10⁹ as in Mistral3Config's default), as
    those checkpoints' config.json declare it."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("mistral3_mistral") / "mistral3"
    shutil.copytree(mistral3_model, path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"].update(model_type="mistral", rope_parameters={"rope_type": "default",
                                                                         "rope_theta": 1_000_000_000.0})
    (path / "config.json").write_text(json.dumps(config))
    return path


def random_image(width, height, seed):
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8"))


def hand_written_chat(question, images=1):
    """Mistral's chat layout, each image an ``[IMG]`` (the processor expands it into the image's rows)."""
    return "<s>[INST]" + "[IMG]" * images + question + "[/INST]"


def plain_forward_logp(plugin, row, completion):
    """The tempered log-probs ``[C]`` of ``completion`` after the row's prompt under a plain transformers forward: the
    prompt built by transformers itself, ``processor.apply_chat_template(..., tokenize=True)`` on the row's raw image
    and question, the completion appended, ``model(**inputs).logits``, the plugin's suppressed ids removed."""
    images = row_images(row)
    assert len(images) == 1 and images[0].size == tuple(row["image_size"])  # the raw image
    messages = [{"role": "user", "content": [{"type": "image", "image": images[0]},
                                             {"type": "text", "text": plugin.question(row)}]}]
    inputs = plugin.adapter.processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                          add_generation_prompt=True, return_tensors="pt")
    prompt_ids = inputs["input_ids"][0]
    bos = plugin.adapter.tokenizer.bos_token_id
    assert int(prompt_ids[0]) == bos and int(prompt_ids[1]) != bos  # one <s>: the template's
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


@pytest.mark.parametrize(("cache", "attention", "text_model"),
                         [(True, "eager", "ministral3"), (False, "sdpa", "ministral3"), (True, "sdpa", "mistral")],
                         ids=["cached", "pixels-sdpa", "mistral-text-cached"])
def test_log_probs_are_a_plain_per_sample_forward(request, cache, attention, text_model):
    """Interleaved groups of prompts whose images have different sizes (so different numbers of image rows and
    tokens, prompts of different lengths, left padding): each sample's old log-probs (the core's teacher-forced pass;
    the shared prompt forward with the cache, the plain pass without) equal a plain per-sample forward of the prompt
    transformers' own ``apply_chat_template`` builds (one ``<s>``), whose ids the replay holds; the plugin's forward
    on a reordered subset gives ratio 1. Eager attention with the cache, SDPA (the recipes' kernel) without; and the
    plain ``mistral`` language model of Mistral Small and Magistral."""
    model = request.getfixturevalue("mistral3_model" if text_model == "ministral3" else "mistral_text_model")
    plugin = make_plugin(model, max_new_tokens=8, cache_image_features=cache, temperature=0.9,
                         share_prompt_forward=cache, attn_implementation=attention)
    assert plugin.model.config.text_config._attn_implementation == attention
    assert plugin.adapter.name == "mistral3" and plugin.adapter.box_convention == "qwen2_5_vl"
    assert plugin.cache_features == cache and plugin.model.config.text_config.model_type == text_model
    rows = plugin.dataset("train")[:3]
    assert len({tuple(row["image_size"]) for row in rows}) == 3
    rollout = old_policy_pass(plugin, plugin.policy(), plugin.rollout(plugin.policy(), interleaved_batch(rows, 4)))
    rollout.validate()
    vision = {"image_embeds"} if cache else {"pixel_values"}
    assert set(rollout.replay) == {"input_ids", "completion_ids"} | vision
    assert len({len(ids) for ids in rollout.replay["input_ids"]}) == 3  # three image sizes, three prompt lengths
    assert max(len(c) for c in rollout.replay["completion_ids"]) > 1
    for i, group in enumerate(GROUPS):
        completion = rollout.replay["completion_ids"][i]
        prompt_ids, inputs, expected = plain_forward_logp(plugin, rows[group], completion)
        assert torch.equal(rollout.replay["input_ids"][i], prompt_ids)
        assert torch.equal(plugin.adapter.image_sizes(prompt_ids), inputs["image_sizes"])  # sizes read from the ids
        torch.testing.assert_close(rollout.old_logp[i, :len(completion)], expected, rtol=0, atol=1e-5)
    shapes = {tuple(inputs["pixel_values"].shape[2:]) for inputs in
              (plain_forward_logp(plugin, row, completion)[1] for row in rows)}
    assert len(shapes) == 3
    part = rollout.select([5, 0, 3])
    with torch.no_grad():
        output = plugin.forward(plugin.policy(), part, need_reference=True)
    assert float((output.logp - part.old_logp).abs().max()) < 1e-5


def test_sampling_is_the_teacher_forced_distribution_and_matches_generate(mistral3_model):
    """With non-zero LoRA B: the decode loop's scores give each sampled token the teacher-forced log-prob (positions
    continued past each row's own prompt, which Ministral 3's query scaling reads), and its tokens are transformers'
    ``generate``'s, greedy and sampled, with the shared prefill and without."""
    torch.manual_seed(0)
    plugin = make_plugin(mistral3_model, max_new_tokens=6)
    fill_lora_b(plugin.model, seed=3)
    rows = plugin.dataset("train")[:3]
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


def test_a_batched_processor_output_is_split_per_prompt_and_collated_back(mistral3_model):
    """One processor call on prompts with 1, 2, 0 and 1 images of different sizes: each prompt gets exactly the ids
    the processor gives it alone and its own images (cut to its largest), the sizes read from its ids are the
    processor's ``image_sizes`` and :meth:`resized_size`'s, an image is ``h`` rows of ``w`` ``[IMG]`` (``h - 1``
    ``[IMG_BREAK]``, one ``[IMG_END]``), and collating the prompts restores the batch (``pixel_values`` padded to its
    largest image, ``image_sizes``); ``max_pixels`` sets the longest edge."""
    from mmrl.plugins.vlm.adapters.mistral3 import Mistral3Adapter

    adapter = Mistral3Adapter(str(mistral3_model), min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    assert adapter.longest_edge == 112 and adapter.image_factor == 16  # ⌊√12544⌋ = 112, a multiple of 8 × 2
    images = [[random_image(160, 56, 1)], [random_image(60, 90, 2), random_image(100, 80, 3)], [],
              [random_image(63, 67, 4)]]
    texts = [hand_written_chat(f"question {i}", images=len(group)) for i, group in enumerate(images)]
    prompts = adapter.encode(texts, images)
    vocab = adapter.tokenizer.get_vocab()
    for text, group, prompt in zip(texts, images, prompts, strict=True):
        alone = adapter.processor(text=[text], images=group or None, return_tensors="pt", add_special_tokens=False)
        ids = prompt["input_ids"]
        assert torch.equal(ids, alone["input_ids"][0])
        assert prompt["pixel_values"].shape[0] == len(group)
        if not group:
            continue
        sizes = adapter.image_sizes(ids)  # [images, 2] (height, width)
        assert torch.equal(sizes, torch.as_tensor(alone["image_sizes"]))
        assert [adapter.resized_size(image.size) for image in group] == [(w, h) for h, w in sizes.tolist()]
        torch.testing.assert_close(prompt["pixel_values"], alone["pixel_values"], rtol=0, atol=0)
        tokens = (sizes // 16).tolist()
        assert adapter.image_token_count(prompt) == sum(h * w for h, w in tokens)
        assert int((ids == vocab["[IMG_BREAK]"]).sum()) == sum(h - 1 for h, _ in tokens)
        assert int((ids == vocab["[IMG_END]"]).sum()) == len(group)
    assert [tuple(p["pixel_values"].shape[2:]) for p in prompts if p["pixel_values"].numel()] == [
        (48, 112), (96, 112), (80, 64)]  # 160x56 -> 112x48; 60x90 -> 64x96 and 100x80 -> 112x80; 63x67 -> 64x80
    batch = adapter.processor(text=texts, images=[image for group in images for image in group], padding=True,
                              padding_side="left", return_tensors="pt", add_special_tokens=False)
    inputs, width = adapter.collate(prompts)
    assert set(inputs) == {"input_ids", "attention_mask", "pixel_values", "image_sizes"}
    for key in inputs:
        assert torch.equal(inputs[key], torch.as_tensor(batch[key])), key
    assert width == batch["input_ids"].shape[1]
    assert adapter.resized_size((1000, 10)) == (112, 16) and adapter.resized_size((10, 10)) == (16, 16)
    smaller = Mistral3Adapter(str(mistral3_model), min_pixels=10, max_pixels=50 * 50)
    assert smaller.longest_edge == 48  # ⌊√2500⌋ = 50, down to a multiple of 16
    for size in ((160, 56), (56, 160), (47, 47), (300, 290)):
        image = random_image(*size, 5)
        alone = smaller.processor(text=[hand_written_chat("q")], images=[image], return_tensors="pt")
        height, width = torch.as_tensor(alone["image_sizes"])[0].tolist()
        assert smaller.resized_size(size) == (width, height) and width * height <= 50 * 50


def test_the_feature_cache_holds_the_projectors_output_and_freezing_covers_it(mistral3_model):
    """A prompt's cached features are ``get_image_features``'s output for its own images (tower, merger and
    projector), one row per ``[IMG]``; the model reads them (zeroing them changes the log-probs) and gives the pixel
    path's log-probs; full fine-tuning with ``freeze_vision`` freezes exactly the tower and the projector, LoRA
    adapts the language model only."""
    plugin = make_plugin(mistral3_model)
    rows = plugin.dataset("train")[:3]
    pixels = plugin.encode_rows(rows)
    cached = plugin.encode_rows(rows, model=plugin.model)
    for prompt, features in zip(pixels, cached, strict=True):
        sizes = plugin.adapter.image_sizes(prompt["input_ids"])
        with torch.no_grad():
            alone = plugin.model.model.get_image_features(pixel_values=prompt["pixel_values"], image_sizes=sizes,
                                                          return_dict=True)
        torch.testing.assert_close(features["image_embeds"], torch.cat(alone.pooler_output), rtol=0, atol=1e-6)
        assert features["image_embeds"].shape == (plugin.adapter.image_token_count(prompt), 32)
    completions = [torch.tensor([20, 21, 22]), torch.tensor([23]), torch.tensor([24, 25])]
    with torch.no_grad():
        from_pixels, _ = plugin.token_logp(plugin.policy(), pixels, completions, 3, with_entropy=False)
        from_cache, _ = plugin.token_logp(plugin.policy(), cached, completions, 3, with_entropy=False)
        zeroed = [{**p, "image_embeds": torch.zeros_like(p["image_embeds"])} for p in cached]
        blind, _ = plugin.token_logp(plugin.policy(), zeroed, completions, 3, with_entropy=False)
    torch.testing.assert_close(from_cache, from_pixels, rtol=0, atol=1e-5)
    assert float((blind - from_cache).abs().max()) > 1e-3
    with pytest.raises(ValueError, match="^mistral3: a batch mixes prompts with cached image features"):
        plugin.adapter.collate([cached[0], pixels[1]])
    adapted = [name for name, p in plugin.model.named_parameters() if p.requires_grad]
    assert adapted and all("lora_" in name and "language_model" in name for name in adapted)
    full = make_plugin(mistral3_model, lora=None)
    frozen = {name for name, p in full.model.named_parameters() if not p.requires_grad}
    assert frozen == {name for name, _ in full.model.named_parameters()
                      if name.startswith(("model.vision_tower.", "model.multi_modal_projector."))}
    assert "model.multi_modal_projector.patch_merger.merging_layer.weight" in frozen


def test_two_grpo_steps_with_lora_and_the_export_loads_with_peft(tmp_path):
    """Two GRPO steps of ``tiny_model: mistral3`` with LoRA, ratio 1, only the language model's adapters trained, and
    the peft export (``assert_two_lora_grpo_steps_and_a_peft_export``); boxes in pixels of the resized image."""
    def check_rows(plugin):
        assert plugin.reward_context()["box_convention"] == "qwen2_5_vl"
        for row in plugin.dataset("train"):  # the boxes' frame: the processor's size of the row's image
            assert row["resized_size"] == list(plugin.adapter.resized_size(row["image_size"]))

    assert_two_lora_grpo_steps_and_a_peft_export(tmp_path, "mistral3", check_rows)


def test_refusals_tokens_and_family(mistral3_model):
    """Video rows and videos are refused, as are qwen-vl-utils, a ``max_pixels`` below one token's cell and ids that
    do not form whole images, each in one line; ``family: auto`` reads ``model_type: mistral3``; the image tokens are
    suppressed, the chat markers are not, and a completion ends at ``</s>``; a system prompt is
    ``[SYSTEM_PROMPT]...[/SYSTEM_PROMPT]``."""
    from mmrl.plugins.vlm.adapters import adapter_for
    from mmrl.plugins.vlm.adapters.mistral3 import Mistral3Adapter

    motion = {"synthetic": {"train_size": 4, "eval_size": 2, "tasks": ["motion"], "seed": 2}}
    with pytest.raises(ValueError, match=r"^vlm family 'mistral3' does not take videos, and the 'train' split holds "
                                         r"video rows: train this family on image rows only$"):
        make_plugin(mistral3_model, data=motion)
    adapter = Mistral3Adapter(str(mistral3_model), min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    frames = [random_image(56, 56, k) for k in range(4)]
    refusal = r"^mistral3: videos are not supported for this family \(Pixtral's processor takes images only\)"
    with pytest.raises(ValueError, match=refusal):
        adapter.load_videos([frames])
    with pytest.raises(ValueError, match=refusal):
        adapter.encode([hand_written_chat("q", images=0)], [[]], [[frames]], [[2.0]])
    with pytest.raises(ValueError, match="^Mistral 3 images are resized by Pixtral's processor, not by qwen-vl-utils$"):
        adapter.load_images([random_image(56, 56, 0)], use_qwen_vl_utils=True)
    with pytest.raises(ValueError, match=r"^mistral3: max_pixels 255 is below one image token's 16 x 16 pixels; set "
                                         r"plugin.max_pixels to at least 256$"):
        Mistral3Adapter(str(mistral3_model), min_pixels=10, max_pixels=255)
    vocab = adapter.tokenizer.get_vocab()
    img, brk, end = vocab["[IMG]"], vocab["[IMG_BREAK]"], vocab["[IMG_END]"]
    with pytest.raises(ValueError, match=r"^mistral3: an image row of 1 \[IMG\] tokens in an image whose rows have 2"):
        adapter.image_sizes(torch.tensor([img, img, brk, img, end]))
    with pytest.raises(ValueError, match=r"^mistral3: the prompt ends inside an image"):
        adapter.image_sizes(torch.tensor([img, img, brk]))
    assert adapter.image_sizes(torch.tensor([5, img, img, brk, img, img, end, 6])).tolist() == [[32, 32]]
    assert adapter_for("auto", str(mistral3_model)) is Mistral3Adapter
    assert adapter.suppressed_token_ids() == sorted([img, brk, end])
    plugin = make_plugin(mistral3_model, system_prompt="Be brief.")
    assert plugin.eos_ids == [vocab["</s>"]]
    assert not {vocab["[INST]"], vocab["[/INST]"], vocab["<s>"]} & set(plugin.suppressed_ids)
    text = adapter.chat_text(adapter.messages("Where?", 1, "Be brief."))
    assert text == "<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST][IMG]Where?[/INST]"


def test_min_pixels_other_than_the_default_is_refused_and_the_recipe_loads(mistral3_model):
    """Pixtral never enlarges an image, so ``min_pixels`` cannot be honoured: a value other than the config's default
    is refused when the plugin starts, in one line naming the option, the family and the fix; ``max_pixels`` is
    honoured (it sets the longest edge); the default (left out, or written as it is) and the Ministral 3 recipe
    load."""
    from mmrl.config import ConfigError, load_config
    from mmrl.plugins.vlm.plugin import check_pixel_bounds

    with pytest.raises(ConfigError, match=r"^config key 'plugin.min_pixels': got 5000; allowed: 3136 \(the default\) "
                                          r"for family 'mistral3': mistral3 never enlarges an image \(Pixtral's "
                                          r"processor only shrinks it to longest_edge 112, .*plugin.min_pixels is not "
                                          r"used by this family, remove it$"):
        make_plugin(mistral3_model, min_pixels=5000)
    plugin = make_plugin(mistral3_model, min_pixels=3136, max_pixels=64 * 64)
    assert plugin.adapter.longest_edge == 64
    recipe = load_config(Path(__file__).resolve().parents[2] / "configs" / "vlm" / "ministral3_8b_grounding.yaml")
    assert recipe.plugin.config.min_pixels == 3136  # the recipe writes max_pixels (honoured), no min_pixels
    check_pixel_bounds(plugin.adapter, recipe.plugin.config)


def test_a_row_prepared_for_other_bounds_is_caught_by_the_size_check(mistral3_model):
    """The rows' ``resized_size`` (the boxes' frame) is checked against the size the processor gives each prompt's
    first image, read from its ``[IMG]`` rows (the processor's ``image_sizes``, computed here on the raw image): rows
    prepared at this run's bounds pass, a row prepared with another ``max_pixels`` (another longest edge) is refused in
    one line."""
    from mmrl.plugins.vlm.adapters.mistral3 import Mistral3Adapter

    plugin = make_plugin(mistral3_model)
    rows = plugin.dataset("train")[:3]
    for row, prompt in zip(rows, plugin.encode_rows(rows), strict=True):
        alone = plugin.adapter.processor(text=[hand_written_chat("q")], images=row_images(row), return_tensors="pt")
        height, width = torch.as_tensor(alone["image_sizes"])[0].tolist()
        assert row["resized_size"] == [width, height]
        assert plugin.adapter.image_sizes(prompt["input_ids"])[0].tolist() == [height, width]
    other = Mistral3Adapter(str(mistral3_model), min_pixels=10, max_pixels=48 * 48)  # longest edge 48
    stale = [{**row, "resized_size": list(other.resized_size(row["image_size"]))} for row in rows]
    assert any(s["resized_size"] != row["resized_size"] for s, row in zip(stale, rows, strict=True))
    with pytest.raises(RuntimeError, match=r"^row resized_size \[\d+, \d+\] differs from the processor's \[\d+, \d+\] "
                                           r"\(width, height\); the row was prepared for other min_pixels/max_pixels$"):
        plugin.encode_rows(stale)


def test_replayed_image_sizes_are_exact_for_any_micro_batch(mistral3_model):
    """``image_sizes`` is not replayed: each pass reads it back from the replayed ids. Two rollouts of different image
    sizes (pixels, no feature cache) concatenated as rollout chunks are, then scored in micro-batches of every kind
    (one sample, samples of both chunks in another order, all reversed): each micro-batch's collated ``image_sizes``
    are the processor's sizes of its own samples' raw images, and its log-probs are the rollout's (ratio 1). Sizes
    padded to the micro-batch's largest image instead (what a lost size would leave) make the tower cut other patches
    than the ``[IMG]`` tokens count, which the model refuses: the sizes are read, and read right."""
    from mmrl.plugins.vlm.plugin import replay_prompts
    from mmrl.rollout import Rollout

    plugin = make_plugin(mistral3_model, max_new_tokens=5, cache_image_features=False)
    rows = plugin.dataset("train")[:6]
    chunks = []
    for part in (rows[:3], rows[3:]):
        rollout = plugin.rollout(plugin.policy(), interleaved_batch(part, len(chunks)))
        chunks.append(old_policy_pass(plugin, plugin.policy(), rollout))
    rollout = Rollout.concat(chunks)
    assert "image_sizes" not in rollout.replay and "pixel_values" in rollout.replay
    sample_rows = [part[g] for part in (rows[:3], rows[3:]) for g in GROUPS]
    processor_sizes = []
    for row in sample_rows:
        alone = plugin.adapter.processor(text=[hand_written_chat("q")], images=row_images(row), return_tensors="pt")
        processor_sizes.append(torch.as_tensor(alone["image_sizes"]))  # [1, 2]
    assert len({tuple(s[0].tolist()) for s in processor_sizes}) >= 4
    for indices in ([4], [7, 0, 4], [11, 2, 9, 6], list(range(11, -1, -1))):
        part = rollout.select(indices)
        inputs, _ = plugin.adapter.collate(replay_prompts(part.replay))
        assert torch.equal(inputs["image_sizes"], torch.cat([processor_sizes[i] for i in indices]))
        with torch.no_grad():
            output = plugin.forward(plugin.policy(), part, need_reference=False)
        assert float((output.logp - part.old_logp).abs().max()) < 1e-5, indices
    part = rollout.select([7, 0, 4])
    read_back = plugin.adapter.image_sizes
    largest = torch.cat([processor_sizes[i] for i in (7, 0, 4)]).amax(0)  # [2]

    def padded_sizes(ids):
        return read_back(ids) * 0 + largest

    plugin.adapter.image_sizes = padded_sizes
    try:
        with pytest.raises(ValueError, match="Image features and image tokens do not match"), torch.no_grad():
            plugin.forward(plugin.policy(), part, need_reference=False)
    finally:
        del plugin.adapter.image_sizes
