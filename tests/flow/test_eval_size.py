"""Evaluation at another size than training (``plugin.eval_height`` / ``eval_width``), as Flow-Factory's examples
train at 384 px and evaluate at 512 or 1024: the evaluation rollout is the diffusers pipeline at the evaluation size
(FLUX's resolution-dependent σ shift and position ids, Kontext's input image brought to that size), and training
rollouts before and after it stay at the training size with ratio 1."""

from __future__ import annotations

import pytest
import torch

from tests.flow.checks import assert_ratio_one_for_any_split, image_batch, image_rows, perturb_lora, write_image_rows
from tests.flow.conftest import prompt_batch


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus a tiny FLUX.1 Kontext, built once per session."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    folder = save_tiny_pipeline("flux_kontext", tmp_path_factory.mktemp("flow_eval_size") / "tiny-flux_kontext")
    return {**pipelines, "flux_kontext": folder}


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_evaluation_at_its_own_size_is_the_pipeline_there_and_training_keeps_its_size(make_plugin, kind):
    plugin = make_plugin(kind, height=16, width=16, eval_height=32, eval_width=16, eval_num_steps=4,
                         eval_guidance_scale=3.0)
    perturb_lora(plugin)
    prompts = ["a cat", "a red dog"]
    before = plugin.rollout(plugin.policy(), prompt_batch(prompts + ["a car"], 2))
    evaluation = plugin.rollout(plugin.policy(), prompt_batch(prompts, 1, first_seed=5, training=False)).validate()
    assert evaluation.payload["images"].shape == (2, 3, 32, 16)
    generators = [torch.Generator().manual_seed(seed) for seed in (5, 6)]
    with torch.no_grad():
        expected = plugin.adapter.pipeline(prompts, height=32, width=16, num_inference_steps=4, guidance_scale=3.0,
                                           generator=generators, output_type="pt", max_sequence_length=8).images
    torch.testing.assert_close(evaluation.payload["images"], expected, rtol=0, atol=1e-5)
    assert plugin.adapter.size == (16, 16)
    after = plugin.rollout(plugin.policy(), prompt_batch(prompts + ["a car"], 2)).validate()
    assert after.payload["images"].shape == (6, 3, 16, 16)
    # the same seeds give the same training rollout as before the evaluation: nothing of its size was left behind
    torch.testing.assert_close(after.payload["images"], before.payload["images"], rtol=0, atol=0)
    assert_ratio_one_for_any_split(plugin, after)


def test_an_editing_evaluation_brings_the_input_images_to_its_size(make_plugin, tmp_path):
    # Training at 16 x 32 and evaluating at 32 x 16: as many tokens on a transposed grid, so position ids cached
    # by token count alone would be the training grid's (the pipeline's images differ by ~1e-2 then).
    from PIL import Image

    edits = write_image_rows(tmp_path, [("make it red", (24, 20)), ("add a dog", (40, 32))])
    plugin = make_plugin("flux_kontext", dataset=str(edits), prompts=None, eval_prompts=None, height=16, width=32,
                         eval_height=32, eval_width=16, eval_num_steps=4, eval_guidance_scale=2.5)
    rows = image_rows(edits, "flux_kontext", 0, 1)
    plugin.rollout(plugin.policy(), image_batch(rows, 2))  # training first: its grid's ids and encodings cached
    evaluation = plugin.rollout(plugin.policy(), image_batch(rows, 1, first_seed=5, training=False)).validate()
    assert evaluation.payload["images"].shape == evaluation.payload["condition_images"].shape == (2, 3, 32, 16)
    processor = plugin.adapter.pipeline.image_processor
    for k, row in enumerate(rows):
        with Image.open(row["image"]) as image:
            resized = processor.resize(image.convert("RGB"), 32, 16)
        with torch.no_grad():
            expected = plugin.adapter.pipeline(
                image=resized, prompt=row["prompt"], height=32, width=16, max_area=32 * 16, _auto_resize=False,
                num_inference_steps=4, guidance_scale=2.5, max_sequence_length=8,
                generator=torch.Generator().manual_seed(5 + k), output_type="pt").images
        torch.testing.assert_close(evaluation.payload["images"][k:k + 1], expected, rtol=0, atol=1e-5)
    training = plugin.rollout(plugin.policy(), image_batch(rows, 2)).validate()
    assert training.payload["condition_images"].shape == (4, 3, 16, 32)


def test_evaluation_sizes_off_the_grid_are_refused_and_a_failed_evaluation_restores_the_size(make_plugin):
    from mmrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"^config key 'plugin.eval_width': got 18; allowed: a multiple of 4 for "
                                          r"[^\n]*$"):
        make_plugin("flux", eval_width=18)
    plugin = make_plugin("sd3", height=16, width=16, eval_height=32)
    with pytest.raises(RuntimeError, match="boom"), plugin.adapter.sized(32, 16):
        assert plugin.adapter.size == (32, 16)
        raise RuntimeError("boom")
    assert plugin.adapter.size == (16, 16)


def test_the_evaluation_size_is_an_evaluation_only_key():
    """``mmrl eval`` may set it on a trained run's saved config without the run being refused as another run."""
    from mmrl.config.schema import eval_only_keys
    from mmrl.plugins.flow.config import FlowPluginConfig

    keys = eval_only_keys(FlowPluginConfig(model="m", prompts=["a"]))
    assert {"eval_height", "eval_width"} <= set(keys)
