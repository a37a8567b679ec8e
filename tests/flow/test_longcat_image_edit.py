"""The LongCat-Image-Edit adapter on a tiny ``LongCatImageEditPipeline`` (the tiny LongCat-Image's components: a
Qwen2.5-VL that reads the input image, the 1+1-block transformer, the 16-channel VAE), saved and loaded back through
``from_pretrained``, with prompt rows naming the image to edit: the plugin's ODE is the pipeline's own sampler on the
same image (its size rule set to the run's size) with and without CFG, every row's prompt and negative prompt are
the pipeline's encodings read with its image, the training forward gives ratio 1 on-policy, GRPO steps train the
LoRA, options the edit pipeline does not have are refused, the memory estimator's text length is the pipeline's, and
the recipe runs a step."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

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

TOKENS = 512  # the pipeline's fixed instruction length (the vision tokens come on top)


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus a tiny LongCat-Image-Edit, built once per session."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    folder = save_tiny_pipeline("longcat_image_edit", tmp_path_factory.mktemp("flow_longcat_edit") / "tiny")
    return {**pipelines, "longcat_image_edit": folder}


@pytest.fixture(scope="session")
def edits(tmp_path_factory):
    """Edit rows naming random RGB images of the runs' aspect ratios (square; 2:1 for the 16 × 32 run) at other
    sizes, so the pipeline's aspect-ratio rule and the plugin's resizing agree; one instruction has quoted text."""
    rows = [("make it red", (24, 24)), ('write "ok" on it', (40, 40)), ("a blue sky", (40, 20)),
            ("add a dog", (48, 24))]
    return write_image_rows(tmp_path_factory.mktemp("flow_longcat_edits"), rows).parent


def _options(edits, **overrides):
    return {"dataset": str(edits / "train.jsonl"), "prompts": None, "eval_prompts": None, "resolution": 16,
            "max_sequence_length": TOKENS, **overrides}


def _rows(edits, *indices):
    return image_rows(edits / "train.jsonl", "longcat_image_edit", *indices)


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
@pytest.mark.parametrize(("height", "width", "indices"), [(16, 16, (0, 1)), (16, 32, (2, 3))],
                         ids=["16x16", "16x32"])
def test_evaluation_is_the_edit_pipeline_ode_on_the_same_image(make_plugin, edits, monkeypatch, cfg, height, width,
                                                               indices):
    # The pipeline sizes output and input at about 1024² pixels with the input's aspect ratio; with that rule set to
    # the run's size and images of the run's aspect ratio both resize the same image to the same sizes. The pipeline
    # takes one prompt per call: each row against its own call.
    import diffusers.pipelines.longcat_image.pipeline_longcat_image_edit as edit_module
    from diffusers import LongCatImageEditPipeline

    monkeypatch.setattr(edit_module, "calculate_dimensions", lambda area, ratio: (width, height))
    plugin = make_plugin("longcat_image_edit", **_options(edits, cfg=cfg, eval_num_steps=3, height=height,
                                                          width=width, eval_guidance_scale=3.0 if cfg else None))
    assert plugin.adapter.name == "longcat_image_edit"  # adapter: auto, from model_index.json
    rows = _rows(edits, *indices)
    rollout = plugin.rollout(plugin.policy(), image_batch(rows, 1, first_seed=5, training=False)).validate()
    assert rollout.payload["images"].shape == (2, 3, height, width)
    pipeline = LongCatImageEditPipeline.from_pretrained(plugin.config.model)  # shares nothing with the adapter's
    pipeline.set_progress_bar_config(disable=True)
    for k, (row, seed) in enumerate(zip(rows, (5, 6), strict=True)):
        with torch.no_grad():
            expected = pipeline(image=row_images(row)[0], prompt=row["prompt"], num_inference_steps=3,
                                guidance_scale=3.0 if cfg else 1.0, generator=torch.Generator().manual_seed(seed),
                                output_type="pt").images
        torch.testing.assert_close(rollout.payload["images"][k:k + 1], expected, rtol=0, atol=1e-5)
        if cfg:  # the check can fail: the unguided image is far away
            with torch.no_grad():
                unguided = pipeline(image=row_images(row)[0], prompt=row["prompt"], num_inference_steps=3,
                                    guidance_scale=1.0, generator=torch.Generator().manual_seed(seed),
                                    output_type="pt").images
            assert (rollout.payload["images"][k:k + 1] - unguided).abs().max() > 1e-3


def test_prompt_and_negative_encodings_read_each_rows_image(make_plugin, edits):
    plugin = make_plugin("longcat_image_edit", **_options(edits, cfg=True, height=16, width=32))
    first, second = _rows(edits, 2, 3)
    _, conditioning, payload = plugin.sampler.row_conditioning([first, {**second, "prompt": first["prompt"]}])
    assert set(conditioning) == {"prompt_embeds", "negative_prompt_embeds", "image_latents"}
    length = conditioning["prompt_embeds"].shape[1]
    assert length > TOKENS and conditioning["negative_prompt_embeds"].shape[1] == length  # the vision tokens first
    # same instruction, other image: other text encodings, the negative's too
    assert (conditioning["prompt_embeds"][0] - conditioning["prompt_embeds"][1]).abs().max() > 1e-3
    assert (conditioning["negative_prompt_embeds"][0] - conditioning["negative_prompt_embeds"][1]).abs().max() > 1e-3
    # each encoding is the pipeline's own for its (prompt, image at half the output's sides)
    pipeline = plugin.adapter.pipeline
    image = pipeline.image_processor.resize(pipeline.image_processor.resize(row_images(second)[0], 16, 32), 8, 16)
    with torch.no_grad():
        negative, _ = pipeline.encode_prompt(prompt=[""], image=image)
        prompt, _ = pipeline.encode_prompt(prompt=[first["prompt"]], image=image)
    torch.testing.assert_close(conditioning["negative_prompt_embeds"][1:], negative, rtol=0, atol=1e-6)
    torch.testing.assert_close(conditioning["prompt_embeds"][1:], prompt, rtol=0, atol=1e-6)
    assert payload["condition_images"].shape == (2, 3, 16, 32)
    assert conditioning["image_latents"].shape == (2, 4 * 8, 64)  # the input's packed latents: (16/4)·(32/4) tokens


def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(make_plugin, edits):
    plugin = make_plugin("longcat_image_edit", **_options(edits, cfg=True, guidance_scale=4.5))
    perturb_lora(plugin, scale=0.1)
    rollout = plugin.rollout(plugin.policy(), image_batch(_rows(edits, 0, 1, 2), 2)).validate()
    assert rollout.old_logp.shape == (6, 3)
    assert_ratio_one_for_any_split(plugin, rollout)


def test_two_grpo_steps_train_the_lora_with_ratio_one(train_config, edits, tmp_path):
    options = _options(edits, eval_dataset=str(edits / "train.jsonl"))
    trainer = Trainer(train_config("longcat_image_edit", tmp_path, **options))
    assert trainer.plugin.cfg and trainer.plugin.guidance_scale == 4.5  # LongCatImageEditPipeline's defaults
    changed = train_two_steps(trainer, frozen_components=True)
    assert any(".attn.to_q.lora_B" in key for key in changed)


def test_renorm_options_and_other_lengths_are_refused(make_plugin, edits):
    """The edit pipeline has no cfg renorm: the text-to-image adapter's options are refused, and the velocity is the
    plain CFG combination."""
    with pytest.raises(ConfigError, match=r"^config key 'plugin.adapter_options': [^\n]*the longcat_image_edit "
                                          r"adapter takes no options \('enable_cfg_renorm' given\)$"):
        make_plugin("longcat_image_edit", **_options(edits, adapter_options={"enable_cfg_renorm": True}))
    adapter = make_plugin("longcat_image_edit", **_options(edits)).adapter
    uncond, cond = torch.randn(2, 4, 64), torch.randn(2, 4, 64)
    torch.testing.assert_close(adapter.combine_guidance(uncond, cond, 4.0), uncond + 4.0 * (cond - uncond),
                               rtol=0, atol=0)
    plugin = make_plugin("longcat_image_edit", **_options(edits, max_sequence_length=64))
    with pytest.raises(ValueError, match=r"^plugin.max_sequence_length is 64; LongCatImageEditPipeline pads every "
                                         r"prompt to exactly 512 tokens[^\n]*$"):
        plugin.rollout(plugin.policy(), image_batch(_rows(edits, 0), 1))


def _memory_estimate() -> Any:
    """benchmarks/memory_estimate.py as a module (its LongCat-Image-Edit row sizes the text with this formula)."""
    name = "benchmarks_memory_estimate"
    if name not in sys.modules:  # registered before it runs: its dataclasses look their module up
        path = Path(__file__).resolve().parents[2] / "benchmarks" / "memory_estimate.py"
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


@pytest.mark.parametrize(("height", "width", "indices"), [(16, 16, (0, 1)), (16, 32, (2, 3)), (32, 32, (0, 1))],
                         ids=["16x16", "16x32", "32x32"])
def test_the_memory_estimators_text_length_is_the_pipelines(make_plugin, edits, height, width, indices):
    """The text row the memory estimator counts for LongCat-Image-Edit (``longcat_edit_text_tokens``: two markers, the
    merged vision tokens of the input at half its sides, 512) is the length of the rows the adapter encodes with the
    pipeline's own ``encode_prompt``, at the tiny processor's pixel bounds (4 to 16 merged tokens: 4, 6 and 16 here);
    and its grid rule is transformers' ``smart_resize`` at Qwen2-VL's default bounds, which the full-size row uses
    (384 px: a 192 px text image, 7 x 7 tokens, 563 in all)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    estimator = _memory_estimate()
    plugin = make_plugin("longcat_image_edit", **_options(edits, cfg=False, height=height, width=width))
    _, conditioning, _ = plugin.sampler.row_conditioning(_rows(edits, *indices))
    bounds = plugin.adapter.pipeline.text_processor.image_processor.size  # shortest_edge / longest_edge: pixels
    expected = estimator.longcat_edit_text_tokens(height, width, bounds.shortest_edge, bounds.longest_edge)
    assert conditioning["prompt_embeds"].shape[1] == expected
    for side_h, side_w in ((192, 192), (256, 256), (512, 512), (384, 672), (2048, 64), (20, 30)):
        rows, columns = estimator.qwen2_vl_grid(side_h, side_w)
        assert (rows * 28, columns * 28) == smart_resize(side_h, side_w)
    assert estimator.longcat_edit_text_tokens(384, 384) == 1 + 7 * 7 + 1 + 512


def test_the_recipe_runs_a_step_on_the_tiny_pipeline(pipelines, edits, tmp_path):
    """configs/flow/longcat_image_edit_pickscore.yaml as written (true CFG 4.5 with each row's negative, 10 steps with
    one trained step drawn from 1-3, EMA, gradient checkpointing, two optimizer steps per rollout, evaluation at a
    larger output and input size), on the tiny pipeline at 16 px with the edit rows and the test reward: the
    combination loads, trains at ratio 1 and evaluates."""
    trainer = run_recipe_step("longcat_image_edit_pickscore.yaml", pipelines["longcat_image_edit"], tmp_path,
                              f"plugin.dataset={edits / 'train.jsonl'}", f"plugin.eval_dataset={edits / 'train.jsonl'}",
                              "plugin.resolution=16", "plugin.eval_height=32", "plugin.eval_width=32",
                              "plugin.eval_condition_size=[32, 32]", "rewards.functions=[{name: test_brightness}]")
    plugin = trainer.plugin
    assert (plugin.adapter.name, plugin.cfg, plugin.guidance_scale) == ("longcat_image_edit", True, 4.5)
    assert plugin.config.gradient_checkpointing and plugin.config.max_sequence_length == TOKENS
