"""Input images of another size than the generated one (``plugin.condition_size``, ``eval_condition_size``), as the
editing pipelines size them on their own (Qwen-Image-Edit: about 1024² whatever the output) and Flow-Factory's
``condition_image_size`` sets them: for FLUX.1 Kontext, Qwen-Image-Edit (and Plus) and FLUX.2 editing, the evaluation
rollout is the pipeline given an input of that size (its tokens on their own grid: Kontext's and FLUX.2's position
ids, Qwen-Image's ``img_shapes``), with several images per row too; the training forward keeps ratio 1; the option
is refused where the input is the video's first frame or there is no input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.flow.checks import assert_ratio_one_for_any_split, image_batch, perturb_lora, row_images

KINDS = ("flux_kontext", "qwen_image_edit", "qwen_image_edit_plus", "flux2_klein", "wan_i2v")


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    root = tmp_path_factory.mktemp("flow_condition_size")
    return {**pipelines, **{kind: save_tiny_pipeline(kind, root / f"tiny-{kind}") for kind in KINDS}}


def _dataset(root, size, several=False):
    """``root/train.jsonl``: three rows whose random RGB images have ``size`` (height, width); with ``several`` the
    first and last rows name two images."""
    from PIL import Image

    rng = np.random.RandomState(0)
    (root / "images").mkdir(parents=True, exist_ok=True)
    height, width = size
    for index in range(4):
        Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8")).save(root / "images" / f"{index}.png")
    rows = [{"prompt": "make it red", "image": ["images/0.png", "images/3.png"] if several else "images/0.png"},
            {"prompt": "add a dog", "image": "images/1.png"},
            {"prompt": "a blue sky", "image": ["images/2.png", "images/0.png"] if several else "images/2.png"}]
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# kind → (adapter, text length, output size, input size, the pipeline's options)
CASES = {
    "flux_kontext": ("flux_kontext", 8, (16, 16), (32, 16)),
    "qwen_image_edit": ("qwen_image_edit", 64, (32, 32), (64, 32)),
    "qwen_image_edit_plus": ("qwen_image_edit", 64, (32, 32), (64, 32)),
    "flux2_klein": ("flux2_klein_edit", 32, (64, 64), (128, 64)),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_evaluation_is_the_pipeline_given_inputs_of_the_condition_size(make_plugin, monkeypatch, tmp_path, kind):
    # The pipelines keep an input of that size as it is (Kontext with _auto_resize=False; FLUX.2 below 1024² on its
    # grid) or size it by a rule set here to it (Qwen-Image-Edit's calculate_dimensions, the Plus VAE_IMAGE_SIZE;
    # the Plus text image is 384² at the input's aspect ratio on both sides).
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit_module
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus_module

    adapter, text, (height, width), (in_height, in_width) = CASES[kind]
    monkeypatch.setattr(edit_module, "calculate_dimensions", lambda area, ratio: (in_width, in_height, None))
    monkeypatch.setattr(plus_module, "VAE_IMAGE_SIZE", in_height * in_width)
    several = kind in ("qwen_image_edit_plus", "flux2_klein")  # pipelines that take several images per row
    dataset = _dataset(tmp_path, (in_height, in_width), several=several)
    qwen = kind.startswith("qwen")
    plugin = make_plugin(kind, adapter=adapter, dataset=str(dataset), prompts=None, eval_prompts=None,
                         max_sequence_length=text, height=height, width=width, eval_condition_size=[in_height,
                                                                                                    in_width],
                         eval_num_steps=3, eval_guidance_scale=1.0 if qwen else 2.5)
    rows = plugin.dataset("train")
    rollout = plugin.rollout(plugin.policy(), image_batch(rows, 1, first_seed=5, training=False)).validate()
    assert rollout.payload["images"].shape == (3, 3, height, width)
    assert rollout.payload["condition_images"].shape == (3, 3, in_height, in_width)
    for k, row in enumerate(rows):
        images = row_images(row)
        options = {"true_cfg_scale": 1.0} if qwen else {"guidance_scale": 2.5, "max_sequence_length": text}
        if kind == "flux_kontext":
            options.update(max_area=height * width, _auto_resize=False)
        with torch.no_grad():
            expected = plugin.adapter.pipeline(
                image=images if several else images[0], prompt=row["prompt"], height=height, width=width,
                num_inference_steps=3, generator=torch.Generator().manual_seed(5 + k), output_type="pt",
                **options).images
        torch.testing.assert_close(rollout.payload["images"][k:k + 1], expected, rtol=0, atol=2e-5)
    # the training size's inputs are another computation: the check can fail
    plugin.condition_sizes = (None, None)
    same = plugin.rollout(plugin.policy(), image_batch(rows[:1], 1, first_seed=5, training=False))
    assert (same.payload["images"] - rollout.payload["images"][:1]).abs().max() > 1e-3


def test_training_at_a_condition_size_keeps_ratio_one_and_the_grid_shows_the_inputs(make_plugin, tmp_path):
    dataset = _dataset(tmp_path, (32, 16), several=True)
    plugin = make_plugin("flux2_klein", adapter="flux2_klein_edit", dataset=str(dataset), prompts=None,
                         eval_prompts=None, max_sequence_length=32, resolution=64, condition_size=[128, 64])
    perturb_lora(plugin)
    rollout = plugin.rollout(plugin.policy(), image_batch(plugin.dataset("train")[:2], 3)).validate()
    # [n, slots·T_in, 4C]: each input's tokens on its own grid, 128 x 64 pixels over the tiny model's multiple (4)
    assert plugin.adapter.resolution_multiple() == 4
    assert rollout.replay["conditioning"]["image_latents"].shape[:2] == (6, 2 * (128 // 4) * (64 // 4))
    assert rollout.payload["condition_images"].shape == (6, 3, 128, 64)
    assert_ratio_one_for_any_split(plugin, rollout)
    plugin.save_samples(rollout, torch.zeros(6), tmp_path / "grid", tag="train")  # inputs shown at the result's height
    from PIL import Image

    with Image.open(tmp_path / "grid" / "train.png") as grid:
        assert grid.width >= 32 + 32 + 64  # two inputs 32 wide (128 x 64 shown 64 high) and the 64-wide result


def test_condition_size_is_refused_where_the_input_is_not_sized_on_its_own(make_plugin, tmp_path):
    from mmrl.config import ConfigError

    dataset = _dataset(tmp_path, (16, 16))
    with pytest.raises(ConfigError, match=r"^config key 'plugin.condition_size': got \[32, 32\]; allowed: null: the "
                                          r"sd3 adapter's input images are brought to the generated size [^\n]*$"):
        make_plugin("sd3", condition_size=[32, 32])
    with pytest.raises(ConfigError, match=r"^config key 'plugin.eval_condition_size': got \[16, 16\]; allowed: null: "
                                          r"the wan_i2v adapter's [^\n]*$"):
        make_plugin("wan_i2v", dataset=str(dataset), prompts=None, eval_prompts=None, eval_condition_size=[16, 16])
    with pytest.raises(ConfigError, match=r"^config key 'plugin.condition_size': got \[18, 16\]; allowed: two "
                                          r"multiples of 4 [^\n]*$"):
        make_plugin("flux_kontext", dataset=str(dataset), prompts=None, eval_prompts=None, condition_size=[18, 16])
    with pytest.raises(ConfigError, match=r"^config key 'plugin.condition_size': got \[16\]; allowed: null or "
                                          r"\[height, width\], two positive integers \(pixels\)$"):
        make_plugin("flux_kontext", dataset=str(dataset), prompts=None, eval_prompts=None, condition_size=[16])
