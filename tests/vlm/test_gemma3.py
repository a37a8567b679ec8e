"""Gemma 3 (``family: gemma3``) on a tiny build with Gemma 3's tokens and chat layout, a SigLIP tower pooled into a
fixed number of soft tokens, and sliding-window layers whose window the prompts exceed: the rollout's log-probs and
the plugin's teacher-forced log-probs equal the log-softmax of a plain per-sample transformers forward
(``Gemma3ForConditionalGeneration(**processor.apply_chat_template(..., tokenize=True))``, the completion appended), with
pan-and-scan crops giving prompts of different lengths in one batch, interleaved groups, and the feature cache on and
off; without ``token_type_ids`` (causal attention over the image tokens) they would not be; the sampling scores are
the teacher-forced distribution and the tokens those of transformers' ``generate``; the shared prompt forward gives
the plain pass's values and gradients; a batched processor output is split per prompt and collated back; the cache
holds the tower and projector's output and freezing covers both; two GRPO steps through the trainer (``tiny_model:
gemma3``) and a LoRA export that loads with peft; the refusals.

The shared family tests run Gemma 3 too (without pan-and-scan): the decode loop against ``generate`` in
test_decode.py, the shared prompt forward in test_prefix.py, the shared prefill in test_plugin.py, LoRA steps and the
toy recipe in test_training.py; its prompt ids against ``apply_chat_template`` with the tokenizer adding ``<bos>`` or
not in test_chat_prompts.py."""

from __future__ import annotations

import json
import shutil
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
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}  # crops of the tests' 56-160 px images


@pytest.fixture(scope="module")
def gemma3_model(tmp_path_factory):
    from mmrl.plugins.vlm.adapters import vlm_adapters
    from mmrl.plugins.vlm.testing import build_tiny_model

    if "gemma3" not in vlm_adapters:
        pytest.skip("transformers has no gemma3")
    return build_tiny_model("gemma3", tmp_path_factory.mktemp("gemma3") / "gemma3")


@pytest.fixture(scope="module")
def pan_and_scan_model(gemma3_model, tmp_path_factory):
    """The tiny build with pan-and-scan switched on in its saved image-processor config, as a user would."""
    path = tmp_path_factory.mktemp("gemma3_pas") / "gemma3"
    shutil.copytree(gemma3_model, path)
    config_path = path / "processor_config.json"
    config = json.loads(config_path.read_text())
    config["image_processor"].update(PAN_AND_SCAN)
    config_path.write_text(json.dumps(config))
    return path


def random_image(width, height, seed):
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8"))


def hand_written_chat(question, images=1):
    """Gemma 3's chat layout, each image a ``<start_of_image>`` (the processor expands it)."""
    return "<bos><start_of_turn>user\n" + "<start_of_image>" * images + question.strip() + \
        "<end_of_turn>\n<start_of_turn>model\n"


def plain_forward_logp(plugin, row, completion, *, pan_and_scan, token_types=True):
    """The tempered log-probs ``[C]`` of ``completion`` after the row's prompt under a plain transformers forward: the
    prompt built by transformers itself, ``processor.apply_chat_template(..., tokenize=True)`` on the row's raw image
    and question (pan-and-scan as the checkpoint sets it), the completion appended (its token types 0, text),
    ``model(**inputs).logits``, the plugin's suppressed ids removed. ``token_types=False`` drops ``token_type_ids``:
    the model is then causal over the image tokens too."""
    images = row_images(row)
    assert len(images) == 1 and images[0].size == tuple(row["image_size"])  # the raw image
    messages = [{"role": "user", "content": [{"type": "image", "image": images[0]},
                                             {"type": "text", "text": plugin.question(row)}]}]
    inputs = plugin.adapter.processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                          add_generation_prompt=True, return_tensors="pt",
                                                          processor_kwargs=dict(PAN_AND_SCAN) if pan_and_scan else None)
    prompt_ids = inputs["input_ids"][0]
    bos = plugin.adapter.tokenizer.bos_token_id
    assert int(prompt_ids[0]) == bos and int(prompt_ids[1]) != bos  # one <bos>: the template's
    inputs["input_ids"] = torch.cat([prompt_ids, completion]).unsqueeze(0)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["token_type_ids"] = torch.cat([inputs["token_type_ids"][0], torch.zeros_like(completion)])[None]
    if not token_types:
        inputs.pop("token_type_ids")
    with torch.no_grad():
        logits = plugin.policy()(**inputs).logits[0, len(prompt_ids) - 1:-1].float()  # [C, V]
    logits[:, plugin.adapter.suppressed_token_ids()] = -torch.inf
    expected = (logits / plugin.config.temperature).log_softmax(-1)
    return prompt_ids, expected.gather(-1, completion.unsqueeze(-1))[:, 0]


def interleaved_batch(rows, seed):
    return PromptBatch(rows=[rows[g] for g in GROUPS], group_ids=torch.tensor(GROUPS), group_size=2,
                       seeds=torch.arange(len(GROUPS)) + 1000 * seed, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("cache", "attention"), [(True, "eager"), (False, "sdpa")], ids=["cached", "pixels-sdpa"])
def test_log_probs_are_a_plain_per_sample_forward_with_bidirectional_images(pan_and_scan_model, cache, attention):
    """Interleaved groups of prompts whose images make different numbers of pan-and-scan crops (so different prompt
    lengths, left padding): each sample's old log-probs (the core's teacher-forced pass; the shared prompt forward
    with the cache, the plain pass without) equal a plain per-sample forward of the prompt transformers' own
    ``apply_chat_template`` builds (one ``<bos>``), whose ids the replay holds; the plugin's forward on a reordered
    subset gives ratio 1; and the same plain forward without ``token_type_ids`` (images attended causally) scores the
    samples otherwise, far beyond rounding. Eager attention with the cache, SDPA (the recipes' kernel, its image
    blocks' mask built by transformers for it) without."""
    plugin = make_plugin(pan_and_scan_model, max_new_tokens=8, cache_image_features=cache, temperature=0.9,
                         share_prompt_forward=cache, attn_implementation=attention)
    assert plugin.model.config.text_config._attn_implementation == attention
    assert plugin.adapter.name == "gemma3" and plugin.adapter.box_convention == "qwen2_5_vl"
    assert plugin.cache_features == cache and plugin.adapter.pan_and_scan == PAN_AND_SCAN
    assert plugin.model.config.text_config.sliding_window == 16  # the prompts exceed the window
    rows = plugin.dataset("train")[:3]
    rollout = old_policy_pass(plugin, plugin.policy(), plugin.rollout(plugin.policy(), interleaved_batch(rows, 4)))
    rollout.validate()
    vision = {"image_embeds"} if cache else {"pixel_values"}
    assert set(rollout.replay) == {"input_ids", "mm_token_type_ids", "completion_ids"} | vision
    lengths = {len(ids) for ids in rollout.replay["input_ids"]}
    assert len(lengths) > 1 and min(lengths) > 16  # crops: different lengths, all beyond the sliding window
    causal_gap = 0.0
    for i, group in enumerate(GROUPS):
        completion = rollout.replay["completion_ids"][i]
        prompt_ids, expected = plain_forward_logp(plugin, rows[group], completion, pan_and_scan=True)
        assert torch.equal(rollout.replay["input_ids"][i], prompt_ids)
        torch.testing.assert_close(rollout.old_logp[i, :len(completion)], expected, rtol=0, atol=1e-5)
        _, causal = plain_forward_logp(plugin, rows[group], completion, pan_and_scan=True, token_types=False)
        causal_gap = max(causal_gap, float((causal - expected).abs().max()))
    assert causal_gap > 1e-3  # the key equality above fails without token_type_ids
    part = rollout.select([5, 0, 3])
    with torch.no_grad():
        output = plugin.forward(plugin.policy(), part, need_reference=True)
    assert float((output.logp - part.old_logp).abs().max()) < 1e-5


def test_image_tokens_attend_to_their_own_block_both_ways(gemma3_model):
    """Changing an image's last soft-token feature changes the hidden state at its first soft token when the token
    types are passed (the block attends both ways, transformers' ``create_masks_for_vision_model``), not without
    them; the other image's block, before it, is unchanged either way (blocks do not see later blocks)."""
    plugin = make_plugin(gemma3_model)
    image = [random_image(60, 90, 2), random_image(100, 80, 3)]
    prompt = plugin.adapter.image_features(plugin.model, plugin.adapter.encode([hand_written_chat("q", 2)],
                                                                               [image]))[0]
    soft = (prompt["input_ids"] == plugin.adapter.image_token_id).nonzero()[:, 0]  # [32]: two blocks of 16
    first, second = soft[:16], soft[16:]
    changed = {**prompt, "image_embeds": prompt["image_embeds"].clone()}
    changed["image_embeds"][-1] += 1.0  # the second image's last soft token

    def hidden(p, typed):
        inputs, _ = plugin.adapter.collate([p])
        if not typed:
            inputs.pop("token_type_ids")
        with torch.no_grad():
            return plugin.model(**inputs, output_hidden_states=True).hidden_states[-1][0]  # [P, H]

    for typed in (True, False):
        before, after = hidden(prompt, typed), hidden(changed, typed)
        assert torch.equal(before[first], after[first])  # the earlier block never sees the later one
        moved = float((before[second[0]] - after[second[0]]).abs().max())
        assert (moved > 1e-3) if typed else (moved == 0.0), (typed, moved)


def test_sampling_is_the_teacher_forced_distribution_and_matches_generate(pan_and_scan_model):
    """With non-zero LoRA B: the decode loop's scores give each sampled token the teacher-forced log-prob (its
    prefill attends bidirectionally inside images like the teacher-forced pass), and its tokens are transformers'
    ``generate``'s, greedy and sampled, with the shared prefill and without (the adapter's own shared prefill for
    ``decoder: hf``)."""
    torch.manual_seed(0)
    plugin = make_plugin(pan_and_scan_model, max_new_tokens=6)
    fill_lora_b(plugin.model, seed=3)
    rows = plugin.dataset("train")[:3]
    prompts = plugin.encode_rows([rows[g] for g in GROUPS], torch.tensor(GROUPS), model=plugin.model)
    config = plugin.generation_config(True)
    config.top_k, config.top_p = 0, 1.0
    assert_decode_scores_are_teacher_forced(plugin, prompts, config)
    for sampled in (False, True):
        config = plugin.generation_config(sampled)
        runs = []
        for decoder, share in (("mmrl", True), ("hf", True), ("hf", False)):
            torch.manual_seed(11)
            with torch.no_grad():
                sequences, width = plugin.adapter.generate(plugin.model, prompts, config, share_prefill=share,
                                                           decoder=decoder)
            runs.append(sequences[:, width:])
        assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2]), sampled


def test_the_shared_prompt_forward_gives_the_plain_pass_values_and_gradients(pan_and_scan_model):
    """With non-zero LoRA B and gradients on: the shared prompt forward (each distinct prompt once, bidirectional
    image blocks inside it, the completions on its copied KV cache) gives the plain per-sample pass's log-probs and
    LoRA gradients; the split does run (its prompt pass sees the token types)."""
    import mmrl.plugins.vlm.prefix as prefix

    torch.manual_seed(0)
    plugin = make_plugin(pan_and_scan_model)
    fill_lora_b(plugin.model, seed=5)
    rows = plugin.dataset("train")[:3]
    prompts = plugin.encode_rows([rows[g] for g in GROUPS], torch.tensor(GROUPS), model=plugin.model)
    completions = [torch.tensor([20, 21, 22]), torch.tensor([23]), torch.tensor([24, 25]), torch.tensor([26, 27]),
                   torch.tensor([28, 29, 30]), torch.tensor([31])]
    seen = []
    original = prefix.shared_prompt_hidden

    def shared_prompt_hidden(*args, **kwargs):
        result = original(*args, **kwargs)
        seen.append(result is not None)
        return result

    def values_and_gradients(share):
        plugin.config.share_prompt_forward = share
        plugin.model.zero_grad()
        logp, _ = plugin.token_logp(plugin.policy(), prompts, completions, 3, with_entropy=False)
        logp.sum().backward()
        return logp.detach(), {name: p.grad.clone() for name, p in plugin.model.named_parameters() if p.requires_grad}

    prefix.shared_prompt_hidden = shared_prompt_hidden
    try:
        plain, plain_grads = values_and_gradients(False)
        shared, shared_grads = values_and_gradients(True)
    finally:
        prefix.shared_prompt_hidden = original
        plugin.config.share_prompt_forward = True
    assert seen == [True]  # the plain pass never asks; the shared one splits
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)
    assert any(g.abs().max() > 0 for g in plain_grads.values())
    for name, gradient in plain_grads.items():
        # float32 rounding of two differently split passes: ~2e-6 on gradients up to ~2
        torch.testing.assert_close(shared_grads[name], gradient, rtol=1e-4, atol=1e-5, msg=name)


def test_a_batched_processor_output_is_split_per_prompt_and_collated_back(pan_and_scan_model):
    """One processor call on prompts with 1, 2, 0 and 1 images, pan-and-scan on: each prompt gets exactly the ids,
    token types and pixel rows (image, then its crops) the processor gives it alone, the soft tokens count 16 per
    row, and collating the prompts restores the batch, the token types as ``token_type_ids``."""
    from mmrl.plugins.vlm.adapters.gemma3 import Gemma3Adapter

    adapter = Gemma3Adapter(str(pan_and_scan_model), min_pixels=10, max_pixels=20)  # the pixel bounds play no part
    images = [[random_image(160, 56, 1)], [random_image(60, 90, 2), random_image(100, 80, 3)], [],
              [random_image(63, 67, 4)]]
    texts = [hand_written_chat(f"question {i}", images=len(group)) for i, group in enumerate(images)]
    prompts = adapter.encode(texts, images)
    assert [p["pixel_values"].shape[0] for p in prompts] == [4, 6, 0, 1]  # 160x56: 3 crops; 60x90, 100x80: 2, 1
    for text, group, prompt in zip(texts, images, prompts, strict=True):
        alone = adapter.processor(text=[text], images=[group] if group else None, return_tensors="pt",
                                  add_special_tokens=False, **PAN_AND_SCAN)
        assert torch.equal(prompt["input_ids"], alone["input_ids"][0])
        assert torch.equal(prompt["mm_token_type_ids"], alone["token_type_ids"][0])
        if group:
            assert torch.equal(prompt["pixel_values"], alone["pixel_values"])  # [rows, 3, 32, 32]
        assert adapter.image_token_count(prompt) == 16 * prompt["pixel_values"].shape[0]
    batch = adapter.processor(text=texts, images=images, padding=True, padding_side="left", return_tensors="pt",
                              add_special_tokens=False, **PAN_AND_SCAN)
    inputs, width = adapter.collate(prompts)
    assert set(inputs) == {"input_ids", "attention_mask", "token_type_ids", "pixel_values"}
    for key in inputs:
        assert torch.equal(inputs[key], batch[key]), key
    assert width == batch["input_ids"].shape[1]
    completions = [torch.tensor([20, 21]), torch.tensor([22]), torch.tensor([23, 24, 25]), torch.tensor([26])]
    inputs, _ = adapter.collate(prompts, completions)
    assert not inputs["token_type_ids"][:, width:].any()  # completions are text
    assert adapter.resized_size((160, 56)) == (32, 32)


def test_the_feature_cache_holds_the_projectors_output_and_freezing_covers_it(gemma3_model):
    """A prompt's cached features are ``get_image_features``'s output for its own images (tower and projector), the
    model reads them (zeroing them changes the log-probs) and gives the pixel path's log-probs; full fine-tuning with
    ``freeze_vision`` freezes exactly the tower and the projector, LoRA adapts the language model only."""
    plugin = make_plugin(gemma3_model)
    rows = plugin.dataset("train")[:3]
    pixels = plugin.encode_rows(rows)
    cached = plugin.encode_rows(rows, model=plugin.model)
    for prompt, features in zip(pixels, cached, strict=True):
        with torch.no_grad():
            alone = plugin.model.model.get_image_features(pixel_values=prompt["pixel_values"], return_dict=True)
        torch.testing.assert_close(features["image_embeds"], alone.pooler_output.flatten(0, 1), rtol=0, atol=1e-6)
        assert features["image_embeds"].shape == (plugin.adapter.image_token_count(prompt), 32)
    completions = [torch.tensor([20, 21, 22]), torch.tensor([23]), torch.tensor([24, 25])]
    with torch.no_grad():
        from_pixels, _ = plugin.token_logp(plugin.policy(), pixels, completions, 3, with_entropy=False)
        from_cache, _ = plugin.token_logp(plugin.policy(), cached, completions, 3, with_entropy=False)
        zeroed = [{**p, "image_embeds": torch.zeros_like(p["image_embeds"])} for p in cached]
        blind, _ = plugin.token_logp(plugin.policy(), zeroed, completions, 3, with_entropy=False)
    torch.testing.assert_close(from_cache, from_pixels, rtol=0, atol=1e-6)
    assert float((blind - from_cache).abs().max()) > 1e-3
    with pytest.raises(ValueError, match="mixes prompts with cached image features and prompts with pixels"):
        plugin.adapter.collate([cached[0], pixels[1]])
    with pytest.raises(ValueError, match=r"^gemma3: every prompt needs its token types \(mm_token_type_ids\)"):
        plugin.adapter.collate([{k: v for k, v in pixels[0].items() if k != "mm_token_type_ids"}])
    adapted = [name for name, p in plugin.model.named_parameters() if p.requires_grad]
    assert adapted and all("lora_" in name and "language_model" in name for name in adapted)
    full = make_plugin(gemma3_model, lora=None)
    frozen = {name for name, p in full.model.named_parameters() if not p.requires_grad}
    assert frozen == {name for name, _ in full.model.named_parameters()
                      if name.startswith(("model.vision_tower.", "model.multi_modal_projector."))}
    assert "model.multi_modal_projector.mm_input_projection_weight" in frozen


def test_two_grpo_steps_with_lora_and_the_export_loads_with_peft(tmp_path):
    """Two GRPO steps of ``tiny_model: gemma3`` with LoRA, ratio 1, only the language model's adapters trained, and
    the peft export (``assert_two_lora_grpo_steps_and_a_peft_export``); boxes in pixels of the resized image."""
    def check_rows(plugin):
        assert plugin.reward_context()["box_convention"] == "qwen2_5_vl"
        assert all(row["resized_size"] == [32, 32] for row in plugin.dataset("train"))  # the boxes' frame: the square

    assert_two_lora_grpo_steps_and_a_peft_export(tmp_path, "gemma3", check_rows)


def test_refusals_tokens_and_family(gemma3_model, tmp_path):
    """Video rows and videos are refused, as are qwen-vl-utils and a checkpoint with logit soft-capping, each in one
    line; ``family: auto`` reads ``model_type: gemma3``; the soft token and the image delimiters are suppressed, the
    turn markers are not, and a completion ends at ``<end_of_turn>`` or ``<eos>``; a system prompt opens the first
    user turn."""
    from mmrl.plugins.vlm.adapters import adapter_for
    from mmrl.plugins.vlm.adapters.gemma3 import Gemma3Adapter

    motion = {"synthetic": {"train_size": 4, "eval_size": 2, "tasks": ["motion"], "seed": 2}}
    with pytest.raises(ValueError, match=r"^vlm family 'gemma3' does not take videos, and the 'train' split holds "
                                         r"video rows: train this family on image rows only$"):
        make_plugin(gemma3_model, data=motion)
    adapter = Gemma3Adapter(str(gemma3_model), min_pixels=3136, max_pixels=12544)
    frames = [random_image(56, 56, k) for k in range(4)]
    refusal = r"^gemma3: videos are not supported for this family \(Gemma 3's processor takes images only\)"
    with pytest.raises(ValueError, match=refusal):
        adapter.load_videos([frames])
    with pytest.raises(ValueError, match=refusal):
        adapter.encode([hand_written_chat("q", images=0)], [[]], [[frames]], [[2.0]])
    with pytest.raises(ValueError, match="^Gemma 3 images are resized by Gemma 3's processor, not by qwen-vl-utils$"):
        adapter.load_images([random_image(56, 56, 0)], use_qwen_vl_utils=True)
    capped = tmp_path / "capped"
    shutil.copytree(gemma3_model, capped)
    config = json.loads((capped / "config.json").read_text())
    config["text_config"]["final_logit_softcapping"] = 30.0
    (capped / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^gemma3: .*capped sets text_config.final_logit_softcapping 30.0, which "
                                         r"Gemma3ForConditionalGeneration does not apply"):
        Gemma3Adapter(str(capped), min_pixels=3136, max_pixels=12544)
    assert adapter_for("auto", str(gemma3_model)) is Gemma3Adapter
    vocab = adapter.tokenizer.get_vocab()
    assert adapter.suppressed_token_ids() == sorted(vocab[t] for t in ("<image_soft_token>", "<start_of_image>",
                                                                       "<end_of_image>"))
    plugin = make_plugin(gemma3_model, system_prompt="Be brief.")
    assert plugin.eos_ids == sorted([vocab["<end_of_turn>"], vocab["<eos>"]])
    assert not {vocab["<start_of_turn>"], vocab["<end_of_turn>"]} & set(plugin.suppressed_ids)
    text = adapter.chat_text(adapter.messages("Where?", 1, "Be brief."))
    assert text == "<bos><start_of_turn>user\nBe brief.\n\n<start_of_image>Where?<end_of_turn>\n<start_of_turn>model\n"


def test_pixel_bounds_other_than_the_defaults_are_refused(gemma3_model):
    """Every image becomes the tower's square, so no pixel bound can be honoured: a ``min_pixels`` or ``max_pixels``
    other than the config's default is refused when the plugin starts, in one line naming the option, the family, the
    square and the fix; the defaults (left out, or written as they are) and the released-model recipe load."""
    from mmrl.config import ConfigError, load_config
    from mmrl.plugins.vlm.plugin import check_pixel_bounds
    from mmrl.plugins.vlm.testing import GEMMA3_IMAGE

    square = f"{GEMMA3_IMAGE} x {GEMMA3_IMAGE}"
    for option, value in (("max_pixels", 16 * 28 * 28), ("min_pixels", 10), ("max_pixels", 10**7)):
        with pytest.raises(ConfigError, match=rf"^config key 'plugin.{option}': got {value}; allowed: .* \(the "
                                              rf"default\) for family 'gemma3': gemma3 resizes every image to the "
                                              rf"checkpoint's square \({square};.*plugin.{option} is not used by "
                                              r"this family, remove it$"):
            make_plugin(gemma3_model, **{option: value})
    plugin = make_plugin(gemma3_model, min_pixels=3136, max_pixels=401408)  # the defaults, written out
    assert plugin.adapter.resized_size((160, 56)) == (GEMMA3_IMAGE, GEMMA3_IMAGE)
    recipe = load_config(Path(__file__).resolve().parents[2] / "configs" / "vlm" / "gemma3_4b_grounding.yaml")
    check_pixel_bounds(plugin.adapter, recipe.plugin.config)
