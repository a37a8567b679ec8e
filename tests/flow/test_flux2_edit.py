"""FLUX.2 editing with a reference image (``flux2_edit``, ``flux2_klein_edit``) on the tiny FLUX.2 [dev] and [klein]
pipelines, with prompt rows that name the image: the plugin's ODE is the pipeline's own sampler given the same
reference image, the image matters, an adapter refuses the other pipeline, the training forward gives ratio 1
on-policy, and GRPO steps train the LoRA."""

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

KINDS = {"flux2": ("flux2_edit", 48), "flux2_klein": ("flux2_klein_edit", 32)}  # pipeline → adapter, text length


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus tiny FLUX.2 [dev] and [klein] (base), built once per session."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    root = tmp_path_factory.mktemp("flow_flux2_edit")
    return {**pipelines, **{kind: save_tiny_pipeline(kind, root / f"tiny-{kind}") for kind in KINDS}}


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    """Edit rows whose reference images are 64 × 64 (the run's size below; the pipelines refuse references under 64
    px) and 80 × 72."""
    rows = [("make it red", (64, 64)), ("add a dog", (64, 64)), ("a blue sky", (80, 72))]
    return write_image_rows(tmp_path_factory.mktemp("flow_flux2_refs"), rows)


def _plugin(make_plugin, references, kind, **overrides):
    adapter, text = KINDS[kind]
    return make_plugin(kind, adapter=adapter, dataset=str(references), prompts=None, eval_prompts=None,
                       max_sequence_length=text, resolution=64, **overrides)


@pytest.mark.parametrize("kind", list(KINDS))
def test_evaluation_is_the_pipeline_ode_with_the_same_reference_image(make_plugin, references, kind):
    # A reference image of the run's size: the pipeline keeps it as it is (64 is a multiple of 16), the plugin crops
    # and resizes it to the run's size, which leaves it unchanged. Float32 rounding of batched against per-image VAE
    # encodes and of the klein pipeline's two CFG calls against one: 1e-5 on pixels after 4 steps.
    from PIL import Image

    plugin = _plugin(make_plugin, references, kind, eval_num_steps=4, eval_guidance_scale=3.0)
    rows = image_rows(references, plugin.adapter.name, 0, 1)
    rollout = plugin.rollout(plugin.policy(), image_batch(rows, 1, first_seed=5, training=False)).validate()
    assert rollout.payload["images"].shape == rollout.payload["condition_images"].shape == (2, 3, 64, 64)
    for k, (row, seed) in enumerate(zip(rows, (5, 6), strict=True)):
        with Image.open(row["image"]) as image:
            image = image.convert("RGB")
        with torch.no_grad():
            expected = plugin.adapter.pipeline(image=image, prompt=row["prompt"], height=64, width=64,
                                               num_inference_steps=4, guidance_scale=3.0, output_type="pt",
                                               max_sequence_length=KINDS[kind][1],
                                               generator=torch.Generator().manual_seed(seed)).images
            plain = plugin.adapter.pipeline(prompt=row["prompt"], height=64, width=64, num_inference_steps=4,
                                            guidance_scale=3.0, output_type="pt", max_sequence_length=KINDS[kind][1],
                                            generator=torch.Generator().manual_seed(seed)).images
        torch.testing.assert_close(rollout.payload["images"][k:k + 1], expected, rtol=0, atol=1e-5)
        assert (expected - plain).abs().max() > 1e-3  # the reference image changes the result: the check can fail


def test_an_edit_adapter_refuses_the_other_flux2_pipeline(pipelines):
    from diffusers import DiffusionPipeline

    from mmrl.plugins.flow.adapters.flux2_edit import Flux2EditAdapter

    klein = DiffusionPipeline.from_pretrained(str(pipelines["flux2_klein"]))
    with pytest.raises(ValueError, match=r"^flux2_edit adapter: Flux2KleinPipeline is not a Flux2Pipeline; use "
                                         r"adapter flux2_klein_edit for the other FLUX.2 pipeline$"):
        Flux2EditAdapter(klein, torch.device("cpu"))


@pytest.mark.parametrize("kind", list(KINDS))
def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(make_plugin, references, kind):
    plugin = _plugin(make_plugin, references, kind)
    perturb_lora(plugin)
    rows = image_rows(references, plugin.adapter.name, 0, 1, 2)  # 80 × 72 cropped and resized to 64 × 64 too
    rollout = plugin.rollout(plugin.policy(), image_batch(rows, 2)).validate()
    assert rollout.replay["conditioning"]["image_latents"].shape == (6, 256, 16)  # [n, (64/4)², 4·4]
    assert_ratio_one_for_any_split(plugin, rollout)  # other LoRA weights move the ratio: it can fail


def test_two_grpo_steps_train_the_lora_with_ratio_one(train_config, references, tmp_path):
    adapter, text = KINDS["flux2_klein"]
    train_two_steps(Trainer(train_config("flux2_klein", tmp_path, adapter=adapter, dataset=str(references),
                                         prompts=None, eval_prompts=None, eval_dataset=str(references),
                                         max_sequence_length=text, resolution=64)))


def test_the_klein_edit_recipe_runs_a_step_on_the_tiny_pipeline(pipelines, references, tmp_path):
    """configs/flow/flux2_klein_edit_pickscore.yaml as written (no CFG pass, 4 steps with one trained step drawn from
    1-2, condition and evaluation sizes, EMA, gradient checkpointing, two optimizer steps per rollout), on the tiny
    klein pipeline at 64 px (evaluation at 128 px with 128 px references) with the edit rows and the test reward."""
    trainer = run_recipe_step("flux2_klein_edit_pickscore.yaml", pipelines["flux2_klein"], tmp_path,
                              f"plugin.dataset={references}", f"plugin.eval_dataset={references}",
                              "plugin.resolution=64", "plugin.condition_size=[64, 64]", "plugin.eval_height=128",
                              "plugin.eval_width=128", "plugin.eval_condition_size=[128, 128]",
                              f"plugin.max_sequence_length={KINDS['flux2_klein'][1]}",
                              "rewards.functions=[{name: test_brightness}]")
    assert trainer.plugin.adapter.name == "flux2_klein_edit" and not trainer.plugin.cfg
