"""Gemma 4 (``family: gemma4``) on a tiny build with Gemma 4's tokens and chat layout and every text feature of the
released variants (sliding windows shorter than the prompts, key/value sharing, per-layer embeddings, bidirectional
attention inside images, soft-capped logits): the rollout's log-probs equal the log-softmax of a plain transformers
forward's ``logits`` of the chat written by hand with the processor on the raw image (with and without the feature
cache), and would not without the soft-capping; a batched processor output is split into each prompt's own padded
patch sets and re-padded at collation; left-padded rows get the positions they have alone; the cache holds the
embedder's output and freezing covers it; the pixel bounds pick the soft-token budget, and ``min_pixels`` is taken
up to the smallest area that budget gives an image (swept through transformers' resize) and refused above it; videos
are refused and ``family: auto`` finds the adapter. On the MoE build (the 26B-A4B's routed experts): the adapter is
MoE per checkpoint, and the batched rollout's log-probs equal a plain per-sample forward.

The decode loop against ``generate``, the shared prompt forward, the shared prefill and LoRA training steps run for
Gemma 4 in test_decode.py, test_prefix.py, test_plugin.py and test_training.py; the MoE build's router loss, LoRA on
its experts and full fine-tuning in test_training.py; its prompt ids against ``apply_chat_template``, with the tokenizer
adding ``<bos>`` or not (the released one does not), in test_chat_prompts.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmrl.plugins.vlm.plugin import row_images
from mmrl.trainer.learn import old_policy_pass
from tests.vlm.conftest import assert_old_logp_is_a_plain_forward, make_plugin, prompt_batch

MIN_PIXELS, MAX_PIXELS = 4 * 28 * 28, 16 * 28 * 28  # the tests' bounds: 70 soft tokens of 12² pixels per image


@pytest.fixture(scope="module")
def gemma4_model(tmp_path_factory):
    from mmrl.plugins.vlm.adapters import vlm_adapters
    from mmrl.plugins.vlm.testing import build_tiny_model

    if "gemma4" not in vlm_adapters:
        pytest.skip("transformers has no gemma4")
    return build_tiny_model("gemma4", tmp_path_factory.mktemp("gemma4") / "gemma4")


@pytest.fixture(scope="module")
def gemma4_moe_model(tmp_path_factory):
    from mmrl.plugins.vlm.adapters import vlm_adapters
    from mmrl.plugins.vlm.testing import build_tiny_model

    if "gemma4" not in vlm_adapters:
        pytest.skip("transformers has no gemma4")
    return build_tiny_model("gemma4_moe", tmp_path_factory.mktemp("gemma4_moe") / "gemma4_moe")


@pytest.fixture(scope="module")
def adapter(gemma4_model):
    from mmrl.plugins.vlm.adapters.gemma4 import Gemma4Adapter

    return Gemma4Adapter(str(gemma4_model), min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def random_image(width, height, seed):
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8"))


def hand_written_chat(question, images=1):
    """Gemma 4's chat layout, each image a ``<|image|>`` (the processor expands it to its soft tokens)."""
    return "<bos><|turn>user\n" + "<|image|>" * images + question + "<turn|>\n<|turn>model\n"


def _processor_inputs(plugin):
    def processor_inputs(row):
        images = row_images(row)
        assert len(images) == 1 and images[0].size == tuple(row["image_size"])  # the raw image
        return plugin.adapter.processor(text=[hand_written_chat(plugin.question(row))], images=[images],
                                        return_tensors="pt")
    return processor_inputs


@pytest.mark.parametrize("cache", [True, False], ids=["cached", "pixels"])
def test_log_probs_are_the_log_softmax_of_the_models_soft_capped_logits(gemma4_model, cache):
    """Each sample's old log-probs (mixed image sizes in one batch, shared prefill and prompt forward, left padding)
    equal the tempered log-softmax of ``model(...).logits`` — soft-capped by the model — for the chat written by
    hand with the processor on the row's raw image; ratio 1 on a reordered subset; with the fused head's cap
    dropped the same samples score otherwise (the cap binds on this build)."""
    plugin = make_plugin(gemma4_model, max_new_tokens=8, cache_image_features=cache, temperature=0.9)
    assert plugin.adapter.name == "gemma4" and plugin.adapter.box_convention == "absolute"
    assert plugin.cache_features == cache and plugin.model.config.text_config.final_logit_softcapping == 2.0
    rows = plugin.dataset("train")[:3]
    assert len({tuple(plugin.adapter.resized_size(row["image_size"])) for row in rows}) == 3  # three image sizes
    group = 2
    rollout = old_policy_pass(plugin, plugin.policy(),
                              plugin.rollout(plugin.policy(), prompt_batch(rows, group, seed=4))).validate()
    vision = {"image_embeds"} if cache else {"pixel_values", "image_position_ids"}
    assert set(rollout.replay) == {"input_ids", "mm_token_type_ids", "completion_ids"} | vision
    # to float32 rounding of log-probs near -7 (other CPU kernels round the batched and the plain pass apart by 7e-6)
    assert_old_logp_is_a_plain_forward(plugin, rollout, rows, group, _processor_inputs(plugin), atol=3e-5)
    part = rollout.select([5, 0, 3])
    with torch.no_grad():
        output = plugin.forward(plugin.policy(), part, need_reference=True)
    assert float((output.logp - part.old_logp).abs().max()) < 1e-5
    # the same pass with the cap taken out of the fused head: another distribution, far beyond rounding
    import mmrl.plugins.vlm.adapters.base as base

    original = base.logit_softcap
    base.logit_softcap = lambda model: None
    try:
        with torch.no_grad():
            uncapped = plugin.forward(plugin.policy(), rollout, need_reference=False).logp
    finally:
        base.logit_softcap = original
    assert float(((uncapped - rollout.old_logp) * rollout.mask).abs().max()) > 0.1


def test_a_batched_processor_output_is_split_into_each_prompts_patches_and_re_padded(adapter):
    """One processor call on prompts with 1, 2 and 1 images of different sizes: each prompt gets exactly the padded
    patch sets, positions, token ids and token types the processor gives it alone, and collating them restores the
    batch. Prompts whose patch sets were cut to their own real patches (another budget's width) are re-padded at
    collation to the widest with zero rows at (-1, -1), and the vision tower gives the same features."""
    from mmrl.plugins.vlm.adapters.gemma4 import pad_patches

    images = [[random_image(160, 56, 1)], [random_image(60, 90, 2), random_image(100, 80, 3)],
              [random_image(63, 67, 4)]]
    texts = [hand_written_chat(f"question {i}", images=len(group)) for i, group in enumerate(images)]
    prompts = adapter.encode(texts, images)
    assert [tuple(p["pixel_values"].shape) for p in prompts] == [(1, 630, 48), (2, 630, 48), (1, 630, 48)]
    for text, group, prompt in zip(texts, images, prompts, strict=True):
        alone = adapter.processor(text=[text], images=[group], return_tensors="pt")
        for key in ("input_ids", "mm_token_type_ids"):
            assert torch.equal(prompt[key], alone[key][0])
        assert torch.equal(prompt["pixel_values"], alone["pixel_values"])  # [images, 630, 3·4²]
        assert torch.equal(prompt["image_position_ids"], alone["image_position_ids"])  # [images, 630, 2]
        real = (prompt["image_position_ids"] != -1).all(-1).sum()
        assert adapter.image_token_count(prompt) == int(real) // 9  # pooled 3 × 3
    tokens = [int(adapter.image_token_count(p)) for p in prompts]
    assert len(set(tokens)) == 3  # different soft-token counts per prompt
    batch = adapter.processor(text=texts, images=images, padding=True, padding_side="left", return_tensors="pt")
    inputs, width = adapter.collate(prompts)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_position_ids"):
        assert torch.equal(inputs[key], batch[key]), key
    assert width == batch["input_ids"].shape[1]
    # cut each prompt's patch sets to its own real patches, rounded up to the pooling (another budget's width)
    cut = []
    for prompt in prompts:
        real = int((prompt["image_position_ids"] != -1).all(-1).sum(-1).max())
        keep = -(-real // 9) * 9
        cut.append({**prompt, "pixel_values": prompt["pixel_values"][:, :keep],
                    "image_position_ids": prompt["image_position_ids"][:, :keep]})
    assert len({p["pixel_values"].shape[1] for p in cut}) == 3
    pixels, positions = pad_patches(cut)
    widest = max(p["pixel_values"].shape[1] for p in cut)
    assert pixels.shape == (4, widest, 48) and positions.shape == (4, widest, 2)
    start = 0
    for prompt in cut:
        count, own = prompt["pixel_values"].shape[:2]
        assert torch.equal(pixels[start:start + count, :own], prompt["pixel_values"])
        assert (pixels[start:start + count, own:] == 0).all() and (positions[start:start + count, own:] == -1).all()
        start += count
    model = adapter.transformers_class().from_pretrained(adapter.model_path).eval()
    with torch.no_grad():
        full = adapter.image_features(model, prompts)
        narrow = adapter.image_features(model, cut)
    for a, b, count in zip(full, narrow, tokens, strict=True):
        assert a["image_embeds"].shape == (count, 32)
        torch.testing.assert_close(b["image_embeds"], a["image_embeds"], rtol=0, atol=1e-5)


def test_the_feature_cache_holds_the_embedders_output_and_freezing_covers_it(gemma4_model):
    """A prompt's cached features are ``get_image_features``'s output for its own images (tower, pooling,
    ``embed_vision``), the model reads them (zeroing them changes the log-probs) and gives the pixel path's log-probs;
    full fine-tuning with ``freeze_vision`` freezes the tower and the embedder, LoRA adapts neither."""
    plugin = make_plugin(gemma4_model)
    rows = plugin.dataset("train")[:3]
    pixels = plugin.encode_rows(rows)
    cached = plugin.encode_rows(rows, model=plugin.model)
    for prompt, features in zip(pixels, cached, strict=True):
        with torch.no_grad():
            alone = plugin.model.model.get_image_features(pixel_values=prompt["pixel_values"],
                                                          image_position_ids=prompt["image_position_ids"],
                                                          return_dict=True)
        torch.testing.assert_close(features["image_embeds"], torch.cat(alone.pooler_output), rtol=0, atol=1e-6)
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
    adapted = [name for name, p in plugin.model.named_parameters() if p.requires_grad]
    assert adapted and all("lora_" in name and "language_model" in name for name in adapted)
    full = make_plugin(gemma4_model, lora=None)
    frozen = {name for name, p in full.model.named_parameters() if not p.requires_grad}
    assert frozen == {name for name, _ in full.model.named_parameters()
                      if name.startswith(("model.vision_tower.", "model.embed_vision."))}
    assert any(name.startswith("model.embed_vision.") for name in frozen)


def test_left_padded_rows_get_the_positions_they_have_alone(gemma4_model):
    """Gemma 4 numbers positions from the first column when given none, padding included: a left-padded row's
    logits then differ from the row's alone. The teacher-forced pass, the decode loop's prefill and HF generate's
    shared prefill give each left-padded row the positions 0, 1, 2, ... of its real tokens (checked on the position
    ids themselves: the logits' difference without them, 2.6e-5 on AVX2, is as small as what other CPU kernels round
    a batched row apart from the row alone), and with them a batched row's logits are the row's alone to rounding."""
    plugin = make_plugin(gemma4_model, max_new_tokens=3)
    rows = plugin.dataset("train")[:3]
    prompts = plugin.encode_rows([rows[0], rows[1], rows[2], rows[0]], torch.tensor([0, 1, 2, 0]), model=plugin.model)
    lengths = [len(p["input_ids"]) for p in prompts]
    assert len(set(lengths)) == 3  # different soft-token counts: different prompt lengths, so left padding
    model = plugin.model
    inputs, width = plugin.adapter.collate(prompts)
    short = int(np.argmin(lengths))
    alone, _ = plugin.adapter.collate([prompts[short]])
    positioned_inputs = plugin.adapter._positioned(inputs)
    real = positioned_inputs["position_ids"][short, width - lengths[short]:]  # the short row's real tokens
    assert real.tolist() == list(range(lengths[short]))
    with torch.no_grad():
        reference = model(**alone).logits[0]  # [P_short, V]
        positioned = model(**positioned_inputs).logits[short, width - lengths[short]:]
    torch.testing.assert_close(positioned, reference, rtol=0, atol=2e-4)
    seen = []
    language_model = model.model.language_model  # LoRA is injected in place: the transformers model
    hook = language_model.register_forward_pre_hook(
        lambda _module, _args, kwargs: seen.append((kwargs["position_ids"], kwargs["attention_mask"])),
        with_kwargs=True)
    completions = [torch.tensor([20, 21]), torch.tensor([22]), torch.tensor([23, 24]), torch.tensor([20, 21])]
    try:
        with torch.no_grad():
            inputs, _ = plugin.adapter.collate(prompts, completions)
            plugin.adapter.completion_hidden(plugin.policy(), inputs, 2)  # the plain teacher-forced pass
            plugin.adapter.generate(plugin.policy(), prompts, plugin.generation_config(False))  # the decode loop
            plugin.adapter.generate(plugin.policy(), prompts, plugin.generation_config(False), decoder="hf")
    finally:
        hook.remove()
    prefills = [positions for positions, _ in seen if positions.shape[-1] > 3]
    assert len(prefills) == 3  # teacher-forced, decode-loop prefill, generate's shared prefill (P - 1 columns)
    real_lengths = [{n + len(c) for n, c in zip(lengths, completions, strict=True)}, set(lengths),
                    {n - 1 for n in lengths}]
    for positions, expected in zip(prefills, real_lengths, strict=True):
        assert positions.dim() == 2  # plain rotary positions [n, L]
        found = set()
        for row in positions:  # padding at 0 (left, and right of a shorter completion), the real tokens 0, 1, 2, ...
            real, end = int(row.max()) + 1, int(row.argmax()) + 1
            assert torch.equal(row[end - real:end], torch.arange(real))
            assert not row[:end - real].any() and not row[end:].any()
            found.add(real)
        assert found == expected


def test_images_attend_bidirectionally_inside_their_block(gemma4_model):
    """The build uses the 31B / 26B-A4B models' bidirectional attention inside images (the token types matter: the
    same tokens typed as text give other logits), and a prompt's image block ends inside the prompt, so the shared
    prompt pass (test_prefix.py) continues states that depend on the prompt alone."""
    plugin = make_plugin(gemma4_model)
    assert plugin.model.config.text_config.use_bidirectional_attention == "vision"
    prompt = plugin.encode_rows(plugin.dataset("train")[:1])[0]
    assert int(prompt["mm_token_type_ids"][-1]) == 0  # the prompt ends in text
    inputs, _ = plugin.adapter.collate([prompt])
    with torch.no_grad():
        typed = plugin.model(**inputs).logits
        untyped = plugin.model(**{**inputs, "mm_token_type_ids": torch.zeros_like(inputs["mm_token_type_ids"])}).logits
    assert float((typed - untyped).abs().max()) > 1e-4


def test_pixel_bounds_pick_the_soft_token_budget(gemma4_model):
    """``max_pixels`` picks the largest supported budget whose area fits (a token is 12² pixels here, 48² in the
    released checkpoints), below the smallest it is refused in one line; the resized sizes are the processor's."""
    from mmrl.plugins.vlm.adapters.gemma4 import Gemma4Adapter, soft_token_budget

    assert soft_token_budget(401_408, 16, 3) == 140 and soft_token_budget(645_120, 16, 3) == 280
    assert soft_token_budget(645_119, 16, 3) == 140 and soft_token_budget(161_280, 16, 3) == 70
    wide = Gemma4Adapter(str(gemma4_model), min_pixels=10, max_pixels=280 * 144)
    assert wide.processor.image_processor.max_soft_tokens == 280 and wide.max_patches == 280 * 9
    for size in [(160, 56), (63, 67), (300, 40), (20, 20), (111, 57)]:
        made = wide.processor(text=[hand_written_chat("q")], images=[[random_image(*size, 0)]], return_tensors="pt")
        real = (made["image_position_ids"][0] != -1).all(-1)
        columns = int(made["image_position_ids"][0][real][:, 0].max()) + 1
        rows = int(made["image_position_ids"][0][real][:, 1].max()) + 1
        assert wide.resized_size(size) == (columns * 4, rows * 4), size
    with pytest.raises(ValueError, match=r"^gemma4: max_pixels 10000 is below the smallest soft-token budget, "
                                         r"70 tokens of 144 pixels; set max_pixels to at least 10080$"):
        Gemma4Adapter(str(gemma4_model), min_pixels=10, max_pixels=10_000)


def _swept_smallest_area(tokens, patch, pooling, heights, aspect):
    """The smallest area transformers' ``get_aspect_ratio_preserving_size`` gives, under ``tokens`` soft tokens, to
    images of ``heights`` by every width up to ``aspect`` times the height, both orientations; and one such image."""
    from transformers.models.gemma4.image_processing_gemma4 import get_aspect_ratio_preserving_size

    best = None
    for height in heights:
        for width in range(1, aspect * height + 1):
            for h, w in ((height, width), (width, height)):
                new_h, new_w = get_aspect_ratio_preserving_size(h, w, patch, tokens * pooling ** 2, pooling)
                if best is None or new_h * new_w < best[0]:
                    best = (new_h * new_w, w, h)
    return best


def test_min_pixels_holds_up_to_the_smallest_area_and_is_refused_above(gemma4_model):
    """Every image is scaled to fill the soft-token budget, then its sides are rounded down to whole tokens, so the
    smallest resized area (``smallest_resized_area``) is about half the budget's, not the budget's: swept through
    transformers' own resize over images of every aspect ratio, its minimum is that area, reached (by the processor
    too, its real patches counted); a square image already falls below the budget's area. ``min_pixels`` up to it is
    taken, above it refused in one line naming the largest allowed."""
    from mmrl.plugins.vlm.adapters.gemma4 import Gemma4Adapter, smallest_resized_area

    # (tokens, patch, pooling): the tiny build's 12-pixel tokens, the released checkpoints' 48-pixel ones
    for tokens, patch, pooling, heights, aspect in [(70, 4, 3, range(1, 41), 20), (140, 4, 3, range(1, 21), 40),
                                                    (280, 16, 3, range(1, 21), 80), (70, 16, 3, range(1, 41), 20)]:
        side = patch * pooling
        area, _, _ = _swept_smallest_area(tokens, patch, pooling, heights, aspect)
        assert area == smallest_resized_area(tokens, side), (tokens, side)
        assert area < tokens * side * side // 2 + side * side  # about half the budget
    assert smallest_resized_area(280, 48) == 139 * 48 * 48  # 280 / 2 - 1 tokens (the function's docstring)

    adapter = Gemma4Adapter(str(gemma4_model), min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)  # 70 tokens of 12²
    smallest = adapter.smallest_area
    assert smallest == smallest_resized_area(70, 12) < 70 * 144
    _, width, height = _swept_smallest_area(70, 4, 3, range(1, 41), 20)
    made = adapter.processor(text=[hand_written_chat("q")], images=[[random_image(width, height, 0)]],
                             return_tensors="pt")
    assert int((made["image_position_ids"][0] != -1).all(-1).sum()) * 16 == smallest  # real 4² patches
    square = adapter.resized_size((64, 64))
    assert square[0] * square[1] < 70 * 144  # the budget's area is no lower bound
    assert Gemma4Adapter(str(gemma4_model), min_pixels=smallest, max_pixels=MAX_PIXELS).min_pixels == smallest
    with pytest.raises(ValueError, match=rf"^gemma4: min_pixels {smallest + 1} exceeds the smallest image the "
                                         rf"processor makes under its 70-token budget \({smallest} pixels: .*; set "
                                         rf"plugin.min_pixels to at most {smallest}$"):
        Gemma4Adapter(str(gemma4_model), min_pixels=smallest + 1, max_pixels=MAX_PIXELS)


def test_videos_are_refused_and_the_tokens_and_family_are_gemmas(gemma4_model, adapter):
    """A dataset with video rows is refused when the plugin starts and a video handed to the adapter is refused;
    ``family: auto`` reads ``model_type: gemma4``; the image, video and audio placeholders and delimiters are
    suppressed, the turn markers are not, and a completion ends at ``<turn|>`` or ``<eos>``."""
    from mmrl.plugins.vlm.adapters import adapter_for
    from mmrl.plugins.vlm.adapters.gemma4 import Gemma4Adapter

    motion = {"synthetic": {"train_size": 4, "eval_size": 2, "tasks": ["motion"], "seed": 2}}
    with pytest.raises(ValueError, match=r"^vlm family 'gemma4' does not take videos, and the 'train' split holds "
                                         r"video rows: train this family on image rows only$"):
        make_plugin(gemma4_model, data=motion)
    frames = [random_image(56, 56, k) for k in range(4)]
    with pytest.raises(ValueError, match="^gemma4: videos are not supported for this family"):
        adapter.load_videos([frames])
    with pytest.raises(ValueError, match="^gemma4: videos are not supported for this family"):
        adapter.encode([hand_written_chat("q", images=0) + "<|video|>"], [[]], [[frames]], [[2.0]])
    assert adapter_for("auto", str(gemma4_model)) is Gemma4Adapter
    vocab = adapter.tokenizer.get_vocab()
    assert adapter.suppressed_token_ids() == sorted(vocab[t] for t in ("<|image|>", "<|image>", "<image|>",
                                                                       "<|video|>", "<|audio|>", "<|audio>",
                                                                       "<audio|>"))
    plugin = make_plugin(gemma4_model)
    assert plugin.eos_ids == sorted([vocab["<turn|>"], vocab["<eos>"]])
    assert not {vocab["<|turn>"], vocab["<turn|>"]} & set(plugin.suppressed_ids)


def test_the_moe_build_is_moe_per_checkpoint_and_scores_as_a_plain_forward(gemma4_model, gemma4_moe_model, adapter):
    """``family: auto`` loads the MoE build with the same adapter, MoE from its config (the dense build's is not);
    its batched rollout (mixed image sizes, left padding, shared prefill and prompt forward, the feature cache) gives
    each sample the log-probs of a plain per-sample transformers forward of the hand-written chat. What
    ``output_router_logits`` records per layer are the router's probabilities (rows sum to 1), which the router loss
    (test_training.py) reads as such."""
    from mmrl.plugins.vlm.adapters import adapter_for

    assert adapter_for("auto", str(gemma4_moe_model)) is type(adapter) and not adapter.moe
    plugin = make_plugin(gemma4_moe_model, max_new_tokens=8, temperature=0.9)
    assert plugin.cache_features and plugin.config.share_prompt_forward
    assert plugin.adapter.name == "gemma4" and plugin.adapter.moe and plugin.adapter.top_k_experts == 2
    text = plugin.model.config.text_config
    assert text.enable_moe_block and text.num_experts == 4
    rows = plugin.dataset("train")[:3]
    group = 2
    rollout = old_policy_pass(plugin, plugin.policy(),
                              plugin.rollout(plugin.policy(), prompt_batch(rows, group, seed=4))).validate()
    # to float32 rounding of log-probs near -7 (as the dense test above)
    assert_old_logp_is_a_plain_forward(plugin, rollout, rows, group, _processor_inputs(plugin), atol=3e-5)
    prompt = plugin.encode_rows(rows[:1])[0]
    inputs, _ = plugin.adapter.collate([prompt])
    with torch.no_grad():
        routed = plugin.model(**inputs, output_router_logits=True).router_logits
    assert len(routed) == text.num_hidden_layers
    for probabilities in routed:  # [P, E]: the router's softmax, which output_router_logits records
        assert probabilities.shape == (len(prompt["input_ids"]), 4)
        torch.testing.assert_close(probabilities.sum(-1), torch.ones(len(prompt["input_ids"])))
