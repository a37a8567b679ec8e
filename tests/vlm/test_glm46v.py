"""GLM-4.6V (``family: glm46v``) on two tiny builds with GLM's tokenizer layout under ``Glm46VConfig``: GLM-4.6V-Flash's
dense language model (``glm46v``) and GLM-4.6V's mixture of experts (``glm46v_moe``). With the same weights the model
is transformers' GLM-4.1V / GLM-4.5V (the same logits), and the router loss the adapter computes is GLM-4.5V's
``aux_loss``, which GLM-4.6V's own forward cannot return; the image size the adapter predicts is the one GLM-4.6V's
processor produces; the rollout's log-probs (mixed image sizes, feature cache, shared prefill and prompt forward) equal
a plain per-sample transformers forward of the chat written by hand with the processor called on the raw images;
video prompts carry GLM-4.6V's frame timestamps (``"0.0 seconds"``) and their log-probs equal the plain forward too;
two GRPO steps with LoRA (each build's targets) and a peft export; ``family: auto`` finds ``glm46v``, and another
language model is refused.

GLM-4.6V's prompt ids against ``apply_chat_template`` are checked in test_chat_prompts.py."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from mmrl.plugins.vlm.plugin import row_images, row_video_fps, row_videos
from mmrl.trainer.learn import old_policy_pass
from tests.vlm.conftest import (
    assert_old_logp_is_a_plain_forward,
    assert_two_lora_grpo_steps_and_a_peft_export,
    make_plugin,
    prompt_batch,
)

BUILDS = ("glm46v", "glm46v_moe")
MIN_PIXELS, MAX_PIXELS = 4 * 28 * 28, 16 * 28 * 28


@pytest.fixture(scope="module")
def glm46v_models(tmp_path_factory):
    from mmrl.plugins.vlm.adapters import vlm_adapters
    from mmrl.plugins.vlm.testing import build_tiny_model

    if "glm46v" not in vlm_adapters:
        pytest.skip("transformers has no glm46v")
    root = tmp_path_factory.mktemp("glm46v")
    return {build: build_tiny_model(build, root / build) for build in BUILDS}


def random_image(width, height, seed):
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8"))


def hand_written_chat(question, images=0, videos=0):
    """GLM's chat layout (the tiny builds' template), each image and video a placeholder the processor expands."""
    vision = "<|begin_of_image|><|image|><|end_of_image|>" * images
    vision += "<|begin_of_video|><|video|><|end_of_video|>" * videos
    return f"[gMASK]<sop><|user|>\n{vision}{question}<|assistant|>\n"


def test_the_model_is_glm41v_and_glm45v_with_the_same_weights_and_the_router_loss_is_glm45vs(glm46v_models):
    """GLM-4.6V runs GLM-4.1V's code (modeling_glm46v.py against modeling_glm4v.py): each build's checkpoint loads
    into transformers' ``Glm4vForConditionalGeneration`` / ``Glm4vMoeForConditionalGeneration`` with the same
    parameters and gives the same logits on a batch of two left-padded image prompts of different sizes. GLM-4.6V's
    forward fails on ``output_router_logits`` (its output class has no such field) and returns no ``aux_loss``; under
    the adapter's :meth:`carry_router_logits` it returns the router logits, and the adapter's loss over them is
    GLM-4.5V's ``aux_loss`` (transformers' ``load_balancing_loss_func`` over the real tokens)."""
    import transformers

    from mmrl.plugins.vlm.adapters.glm46v import Glm46vAdapter

    images = [random_image(90, 60, 0), random_image(60, 120, 1)]
    chats = [hand_written_chat("Where is the red circle?", images=1), hand_written_chat("How many?", images=1)]
    siblings = {"glm46v": transformers.Glm4vForConditionalGeneration,
                "glm46v_moe": transformers.Glm4vMoeForConditionalGeneration}
    for build, sibling_class in siblings.items():
        path = str(glm46v_models[build])
        adapter = Glm46vAdapter(path, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
        inputs = adapter.processor(text=chats, images=images, padding=True, padding_side="left", return_tensors="pt")
        assert int((inputs["attention_mask"] == 0).sum()) > 0  # the prompts differ in length: left padding
        ours = transformers.Glm46VForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        sibling = sibling_class.from_pretrained(path, dtype=torch.float32).eval()
        theirs_state = sibling.state_dict()
        assert ours.state_dict().keys() == theirs_state.keys()
        assert all(torch.equal(value, theirs_state[key]) for key, value in ours.state_dict().items())
        with torch.no_grad():
            torch.testing.assert_close(ours(**inputs).logits, sibling(**inputs).logits, rtol=0, atol=1e-6)
        assert adapter.moe is (build == "glm46v_moe")
        if not adapter.moe:
            continue
        with torch.no_grad():
            with pytest.raises(TypeError, match="router_logits"):
                ours(**inputs, output_router_logits=True)
            reference = sibling(**inputs, output_router_logits=True)
            with adapter.carry_router_logits(ours, {"output_router_logits": True}):
                output = ours(**inputs, output_router_logits=True)
        assert getattr(output, "aux_loss", None) is None
        assert len(output.router_logits) == len(reference.router_logits) == 1  # one MoE layer after the dense one
        for got, expected in zip(output.router_logits, reference.router_logits, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        ours_loss = adapter.router_load_balancing_loss(output, inputs["attention_mask"])
        torch.testing.assert_close(ours_loss, reference.aux_loss.float(), rtol=1e-6, atol=1e-7)
        unmasked = transformers.models.glm4v_moe.modeling_glm4v_moe.load_balancing_loss_func(
            reference.router_logits, sibling.num_experts, sibling.num_experts_per_tok, None)
        assert float((ours_loss - unmasked).abs()) > 1e-6  # the padding is left out, as GLM-4.5V leaves it


def test_resized_size_is_the_processors(glm46v_models):
    """:meth:`resized_size` (GLM's smart_resize with the per-image bounds doubled: an image is two frames) against the
    grid GLM-4.6V's image processor gives the raw image: sides under 28, rounding ties, both bounds hit, long thin
    images; images reach the processor unresized."""
    from mmrl.plugins.vlm.adapters.glm46v import Glm46vAdapter

    adapter = Glm46vAdapter(str(glm46v_models["glm46v"]), min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    assert type(adapter.processor.image_processor).__name__ == "Glm46VImageProcessor"
    sizes = [(63, 67), (20, 90), (14, 300), (70, 70), (42, 42), (98, 154), (400, 300), (1000, 30), (57, 85), (3, 3)]
    sizes += [tuple(int(v) for v in np.random.default_rng(i).integers(5, 600, 2)) for i in range(20)]
    for number, size in enumerate(sizes):
        grid = adapter.processor.image_processor(images=[random_image(*size, number)],
                                                 return_tensors="pt")["image_grid_thw"][0]
        assert adapter.resized_size(size) == (int(grid[2]) * 14, int(grid[1]) * 14), size
    assert adapter.load_images([random_image(63, 67, 0)])[0].size == (63, 67)


@pytest.mark.parametrize("build", BUILDS)
def test_image_log_probs_equal_a_plain_transformers_forward(glm46v_models, build):
    """Each sample's old log-probs (feature cache, shared prefill and prompt forward, three image sizes, interleaved
    with their groups) equal a plain forward of GLM's chat written by hand, the processor called directly on the row's
    raw image; ratio 1 on a reordered subset; the rows' boxes are GLM's 0-1000 grid."""
    plugin = make_plugin(glm46v_models[build], max_new_tokens=8)
    assert plugin.adapter.name == "glm46v" and plugin.adapter.box_convention == "glm4v" and plugin.cache_features
    rows = plugin.dataset("train")[:3]
    assert len({tuple(row["resized_size"]) for row in rows}) > 1
    group = 2
    rollout = old_policy_pass(plugin, plugin.policy(),
                              plugin.rollout(plugin.policy(), prompt_batch(rows, group, seed=4))).validate()
    assert "image_embeds" in rollout.replay

    def processor_inputs(row):
        images = [image.convert("RGB") for image in row_images(row)]
        assert len(images) == 1 and images[0].size == tuple(row["image_size"])  # the raw image
        return plugin.adapter.processor(text=[hand_written_chat(plugin.question(row), images=1)], images=images,
                                        return_tensors="pt")

    assert_old_logp_is_a_plain_forward(plugin, rollout, rows, group, processor_inputs)
    part = rollout.select([5, 0, 3])
    with torch.no_grad():
        output = plugin.forward(plugin.policy(), part, need_reference=True)
    assert float((output.logp - part.old_logp).abs().max()) < 1e-5


def test_video_prompts_carry_glm46vs_timestamps_and_their_log_probs_are_a_plain_forward(glm46v_models):
    """A 6-frame clip at 2 fps and a 4-frame clip at 4 fps: the prompt writes each temporal patch's timestamp as
    GLM-4.6V's processor does (``0.0 seconds``, ``1.0 seconds``, ...; GLM-4.1V writes ``0``, ``1``), and the rollout's
    old log-probs equal a plain forward of the hand-written chat through the processor on the same frames and rates
    (the timestamps' text tokens between the frames in the M-RoPE positions)."""
    plugin = make_plugin(glm46v_models["glm46v"], max_new_tokens=6, video_min_pixels=4 * 28 * 28,
                         video_max_pixels=8 * 28 * 28)

    def clip(count, width, height, seed):
        return [random_image(width, height, seed * 100 + k) for k in range(count)]

    rows = [{"prompt": "Which way does it move?", "video": clip(6, 56, 84, 0), "video_fps": 2.0, "solution": "left",
             "task": "motion"},
            {"prompt": "What changes?", "video": clip(4, 84, 56, 1), "video_fps": 4.0, "solution": "up",
             "task": "motion"}]
    group = 2
    rollout = old_policy_pass(plugin, plugin.policy(),
                              plugin.rollout(plugin.policy(), prompt_batch(rows, group, seed=3))).validate()
    first = plugin.adapter.tokenizer.decode(rollout.replay["input_ids"][0])
    second = plugin.adapter.tokenizer.decode(rollout.replay["input_ids"][2])
    assert "<|end_of_image|>0.0 seconds<|begin_of_image|>" in first
    assert "<|end_of_image|>2.0 seconds<|end_of_video|>" in first
    assert "<|end_of_image|>0.5 seconds<|end_of_video|>" in second

    def processor_inputs(row):
        clips = row_videos(row)
        rates = row_video_fps(row, len(clips), plugin.config.video_fps)
        metadata = [{"fps": rate, "total_num_frames": len(c), "frames_indices": list(range(len(c)))}
                    for c, rate in zip(clips, rates, strict=True)]
        resized = plugin.adapter.load_videos(clips)  # the adapter's frame size, GLM's own (test_glm4v.py)
        return plugin.adapter.processor(text=[hand_written_chat(plugin.question(row), videos=len(clips))],
                                        videos=resized, video_metadata=metadata, do_sample_frames=False,
                                        do_resize=False, return_tensors="pt")

    assert_old_logp_is_a_plain_forward(plugin, rollout, rows, group, processor_inputs)


@pytest.mark.parametrize("build", BUILDS)
def test_two_grpo_steps_with_lora_and_the_export_loads_with_peft(tmp_path, build):
    """Two GRPO steps of ``tiny_model: glm46v`` / ``glm46v_moe`` with LoRA on each language model's targets
    (GLM-4.1V's fused MLP names for the dense model; the dense first layer's and the shared expert's MLP names for the
    MoE model, which peft leaves there for ``model_type: glm46v``; the MoE model's router loss on), ratio 1, only
    the language model's adapters trained, and the peft export (``assert_two_lora_grpo_steps_and_a_peft_export``)."""
    expected = {"glm46v": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"},
                "glm46v_moe": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}}

    def check_rows(plugin):
        assert plugin.reward_context()["box_convention"] == "glm4v"
        assert plugin.adapter.moe is (build == "glm46v_moe") and plugin.config.router_aux_loss_coef > 0
        adapted = {name.rsplit(".lora_", 1)[0] for name, _ in plugin.model.named_parameters() if ".lora_A." in name}
        assert {name.rsplit(".", 1)[-1] for name in adapted} == expected[build]
        assert all(".language_model." in name and ".experts." not in name for name in adapted)
        if build == "glm46v_moe":
            assert any(".shared_experts.gate_proj" in name for name in adapted)
            assert any(".layers.0.mlp.gate_proj" in name for name in adapted)

    assert_two_lora_grpo_steps_and_a_peft_export(tmp_path, build, check_rows, adapter="glm46v")


def test_family_auto_and_the_refusals(glm46v_models, tmp_path):
    """``family: auto`` reads ``model_type: glm46v`` for both builds; a ``glm46v`` checkpoint whose language model is
    neither GLM-4.6V-Flash's nor GLM-4.6V's is refused in one line, as is a dataset split mixing image and video rows
    (GLM-4.1V's placeholder mask, which GLM-4.6V keeps)."""
    from mmrl.plugins.vlm.adapters import adapter_for
    from mmrl.plugins.vlm.adapters.glm46v import Glm46vAdapter

    for build in BUILDS:
        assert adapter_for("auto", str(glm46v_models[build])) is Glm46vAdapter
    other = tmp_path / "other"
    shutil.copytree(glm46v_models["glm46v"], other)
    config = json.loads((other / "config.json").read_text())
    config["text_config"]["model_type"] = "glm4"
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^glm46v: .*other has a 'glm4' language model; this family takes glm4v_text "
                                         r"or glm4v_moe_text \(GLM-4.6V-Flash, GLM-4.6V\)$"):
        Glm46vAdapter(str(other), min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    mixed = {"synthetic": {"train_size": 6, "eval_size": 2, "tasks": ["motion", "grounding"], "seed": 2}}
    with pytest.raises(ValueError, match="'glm46v' cannot take images and videos.*'train' split"):
        make_plugin(glm46v_models["glm46v_moe"], data=mixed)
