"""The Qwen-Image-Edit adapter on tiny ``QwenImageEditPipeline`` and ``QwenImageEditPlusPipeline`` s (Qwen2.5-VL text
encoder that reads the input image, Qwen-Image MMDiT, causal 3-D VAE) built from config classes, saved and loaded
back through ``from_pretrained``, with prompt rows that name the image to edit: the plugin's ODE is the pipeline's
own sampler on the same image (with the pipelines' size rules set to the run's size), every row's negative prompt
reads its image, the training forward gives ratio 1 on-policy, and GRPO steps train the LoRA."""

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

KINDS = ("qwen_image_edit", "qwen_image_edit_plus")
TEXT_TOKENS = 48  # the template after its 64 dropped tokens, 4-16 vision tokens and the instruction


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus tiny Qwen-Image-Edit and Qwen-Image-Edit-Plus, built once per session."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    root = tmp_path_factory.mktemp("flow_qwen_image_edit")
    return {**pipelines, **{kind: save_tiny_pipeline(kind, root / f"tiny-{kind}") for kind in KINDS}}


@pytest.fixture(scope="session")
def edits(tmp_path_factory):
    """A JSONL of edit rows naming random RGB images by relative paths. The images have the aspect ratios of the
    runs below (square, and 1:2 for the 32 × 64 run) at other sizes, so the pipelines' aspect-ratio rules and the
    plugin's resizing to the run's size agree."""
    rows = [("make it red", (40, 40)), ("add a dog", (24, 24)), ("a blue sky", (40, 80)), ("a big red car", (20, 40))]
    return write_image_rows(tmp_path_factory.mktemp("flow_qwen_edits"), rows).parent


def _options(edits, **overrides):
    return {"dataset": str(edits / "train.jsonl"), "prompts": None, "eval_prompts": None, "resolution": 32,
            "max_sequence_length": TEXT_TOKENS, **overrides}


def _rows(edits, *indices):
    return image_rows(edits / "train.jsonl", "qwen_image_edit", *indices)


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
@pytest.mark.parametrize(("height", "width", "indices"), [(32, 32, (0, 1)), (64, 32, (2, 3))],
                         ids=["32x32", "64x32"])
@pytest.mark.parametrize("kind", KINDS)
def test_evaluation_is_the_edit_pipeline_ode_on_the_same_image(make_plugin, edits, monkeypatch, kind, cfg, height,
                                                               width, indices):
    # The pipelines size the input image at about 1024² pixels with its aspect ratio (the Plus pipeline: its
    # VAE_IMAGE_SIZE); with that rule set to the run's size and images of the run's aspect ratio, the pipeline and the
    # plugin resize the same image to the same sizes. The pipeline pads the text to its batch's longest prompt, the
    # plugin to TEXT_TOKENS with a mask, and runs [uncond; cond] in one call: float32 rounding, 2e-5 after 3 steps.
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit_module
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus_module

    monkeypatch.setattr(edit_module, "calculate_dimensions", lambda area, ratio: (width, height, None))
    monkeypatch.setattr(plus_module, "VAE_IMAGE_SIZE", height * width)
    plugin = make_plugin(kind, **_options(edits, cfg=cfg, negative_prompt=" ", eval_num_steps=3,
                                          eval_guidance_scale=3.0 if cfg else None, height=height, width=width))
    assert plugin.adapter.name == "qwen_image_edit" and plugin.adapter.plus == kind.endswith("plus")
    rows = _rows(edits, *indices)
    rollout = plugin.rollout(plugin.policy(), image_batch(rows, 1, first_seed=5, training=False)).validate()
    assert rollout.payload["images"].shape == (2, 3, height, width)
    from PIL import Image

    for k, (row, seed) in enumerate(zip(rows, (5, 6), strict=True)):
        with Image.open(row["image"]) as image:
            image = image.convert("RGB")
        guidance = {"true_cfg_scale": 3.0, "negative_prompt": " "} if cfg else {"true_cfg_scale": 1.0}
        with torch.no_grad():
            expected = plugin.adapter.pipeline(
                image=image, prompt=row["prompt"], height=height, width=width, num_inference_steps=3,
                generator=torch.Generator().manual_seed(seed), output_type="pt", **guidance).images
        torch.testing.assert_close(rollout.payload["images"][k:k + 1], expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_and_negative_encodings_read_each_rows_image(make_plugin, edits, kind):
    plugin = make_plugin(kind, **_options(edits, cfg=True, negative_prompt=" "))
    first, second = _rows(edits, 0, 1)
    _, conditioning, payload = plugin.sampler.row_conditioning([first, {**second, "prompt": first["prompt"]}])
    assert set(conditioning) == {"prompt_embeds", "prompt_embeds_mask", "negative_prompt_embeds",
                                 "negative_prompt_embeds_mask", "image_latents"}
    assert conditioning["prompt_embeds"].shape == (2, TEXT_TOKENS, 32)
    # same instruction, other image: other text encodings, the negative's too
    assert (conditioning["prompt_embeds"][0] - conditioning["prompt_embeds"][1]).abs().max() > 1e-3
    assert (conditioning["negative_prompt_embeds"][0] - conditioning["negative_prompt_embeds"][1]).abs().max() > 1e-3
    # each encoding is the pipeline's own for its (prompt, image), zero-padded
    adapter = plugin.adapter
    from PIL import Image

    with Image.open(second["image"]) as image:
        text_image = adapter._text_image(image.convert("RGB"))
    with torch.no_grad():
        embeds, _ = adapter.pipeline.encode_prompt(prompt=[" "], image=[text_image] if adapter.plus else text_image)
    length = embeds.shape[1]
    torch.testing.assert_close(conditioning["negative_prompt_embeds"][1, :length], embeds[0], rtol=1e-5, atol=1e-6)
    assert conditioning["negative_prompt_embeds_mask"][1].tolist() == [1] * length + [0] * (TEXT_TOKENS - length)
    assert payload["condition_images"].shape == (2, 3, 32, 32)


def test_guided_velocity_uses_each_rows_own_negative(make_plugin, edits):
    """The unconditional half of the CFG call is each row's negative prompt read with its image: compared with two
    separate transformer calls, then Qwen-Image's rescale."""
    plugin = make_plugin("qwen_image_edit", **_options(edits, cfg=True, negative_prompt=" ", guidance_scale=4.0))
    perturb_lora(plugin)
    adapter, policy = plugin.adapter, plugin.policy()
    _, conditioning, _ = plugin.sampler.row_conditioning(_rows(edits, 0, 1))
    latents = torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(0))  # [n, (32/4)², 4·4]
    timesteps = torch.tensor([743.0, 424.0])
    with torch.no_grad():
        guided = adapter.velocity(policy, latents, timesteps, conditioning, guidance_scale=4.0, negative={})
        rows = {key: value for key, value in conditioning.items() if not key.startswith("negative_")}
        cond = adapter.call_transformer(policy, latents, timesteps, rows, 4.0).float()
        uncond = adapter.call_transformer(policy, latents, timesteps, {
            **rows, "prompt_embeds": conditioning["negative_prompt_embeds"],
            "prompt_embeds_mask": conditioning["negative_prompt_embeds_mask"]}, 4.0).float()
    combined = uncond + 4.0 * (cond - uncond)
    expected = combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
    torch.testing.assert_close(guided, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))


def test_each_pair_is_encoded_once(make_plugin, edits):
    plugin = make_plugin("qwen_image_edit", **_options(edits, cfg=True, negative_prompt=" "))
    calls = []
    original = plugin.adapter.encode_prompts_with_images
    plugin.adapter.encode_prompts_with_images = lambda prompts, images, length: (
        calls.append(list(prompts)) or original(prompts, images, length))
    rows = _rows(edits, 0, 1)
    plugin.rollout(plugin.policy(), image_batch(rows, 2))
    plugin.rollout(plugin.policy(), image_batch(rows, 3, first_group=4))
    assert calls == [["make it red", "add a dog"], [" ", " "]]  # the pairs, then each image's negative; once


def test_a_prompt_longer_than_max_sequence_length_is_refused_in_one_line(make_plugin, edits):
    plugin = make_plugin("qwen_image_edit", **_options(edits, max_sequence_length=4))
    with pytest.raises(ValueError, match=r"^plugin.max_sequence_length is 4, but 'make it red' with its image is "
                                         r"\d+ text tokens \(the image's vision tokens count\): raise it$"):
        plugin.rollout(plugin.policy(), image_batch(_rows(edits, 0), 2))


@pytest.mark.parametrize("kind", KINDS)
def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(make_plugin, edits, kind):
    plugin = make_plugin(kind, **_options(edits, cfg=True, negative_prompt=" "))
    perturb_lora(plugin)
    policy = plugin.policy()
    rollout = plugin.rollout(policy, image_batch(_rows(edits, 0, 1, 0), 2)).validate()
    assert rollout.old_logp.shape == (6, 3)
    assert_ratio_one_for_any_split(plugin, rollout)  # other LoRA weights move the ratio: it can fail


def test_two_grpo_steps_train_the_lora_with_ratio_one(train_config, edits, tmp_path):
    options = _options(edits, cfg=True, negative_prompt=" ", eval_dataset=str(edits / "train.jsonl"))
    train_two_steps(Trainer(train_config("qwen_image_edit_plus", tmp_path, **options)))


def test_the_recipe_runs_a_step_on_the_tiny_pipeline(pipelines, edits, tmp_path):
    """configs/flow/qwen_image_edit_pickscore.yaml as written (true CFG with each image's negative, 10 steps with one
    trained step drawn from 1-3, EMA, gradient checkpointing, two optimizer steps per rollout), on the tiny Plus
    pipeline at 32 px with the edit rows and the test reward: the combination loads, trains at ratio 1 and
    evaluates."""
    trainer = run_recipe_step("qwen_image_edit_pickscore.yaml", pipelines["qwen_image_edit_plus"], tmp_path,
                              f"plugin.dataset={edits / 'train.jsonl'}", f"plugin.eval_dataset={edits / 'train.jsonl'}",
                              "plugin.resolution=32", "plugin.buckets=[[32, 32], [32, 48], [48, 32]]",
                              "plugin.eval_buckets=[[64, 64], [48, 80]]", "rewards.functions=[{name: test_brightness}]")
    assert trainer.plugin.cfg and trainer.plugin.adapter.plus
