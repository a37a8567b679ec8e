"""Several input images per prompt row (``"image": [path, path, ...]``) for the adapters whose pipelines take several:
Qwen-Image-Edit-Plus ("Picture 1: ... Picture 2: ...") and FLUX.2 editing (reference images at T = 10, 20, ...), on
the tiny pipelines built from config classes. The plugin's ODE is each pipeline's own sampler given the same images
in the same order, row by row, in batches that mix rows of one and two images; the training forward gives ratio 1
for any micro-batch split; the rewards get every input image; rows naming more images than an adapter takes are
refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mmrl.trainer import Trainer
from tests.flow.checks import assert_ratio_one_for_any_split, image_batch, perturb_lora, row_images, train_two_steps

# pipeline kind → (adapter, text length, run size)
KINDS = {"qwen_image_edit_plus": ("qwen_image_edit", 64, 32), "flux2": ("flux2_edit", 48, 64),
         "flux2_klein": ("flux2_klein_edit", 32, 64)}


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus the tiny editing pipelines that take several images, built once."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    root = tmp_path_factory.mktemp("flow_several_images")
    return {**pipelines, **{kind: save_tiny_pipeline(kind, root / f"tiny-{kind}") for kind in [*KINDS,
                                                                                                "qwen_image_edit"]}}


def _write_rows(root: Path, size: int) -> Path:
    """``root/train.jsonl``: two rows of two images, one of one image, one of two again, random RGB PNGs of the run's
    size (the pipelines then keep each image as it is) named by relative paths."""
    from PIL import Image

    rng = np.random.RandomState(0)
    (root / "images").mkdir(parents=True, exist_ok=True)
    for index in range(5):
        Image.fromarray((rng.rand(size, size, 3) * 255).astype("uint8")).save(root / "images" / f"{index}.png")
    rows = [{"prompt": "put the cat of picture 2 on the sofa", "image": ["images/0.png", "images/1.png"]},
            {"prompt": "make it red", "image": "images/2.png"},
            {"prompt": "both in one room", "image": ["images/3.png", "images/4.png"]},
            {"prompt": "swap them", "image": ["images/1.png", "images/0.png"]}]
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="session")
def datasets(tmp_path_factory):
    return {size: _write_rows(tmp_path_factory.mktemp(f"several_{size}"), size) for size in (32, 64)}


def _plugin(make_plugin, datasets, kind, **overrides):
    adapter, text, size = KINDS[kind]
    return make_plugin(kind, adapter=adapter, dataset=str(datasets[size]), prompts=None, eval_prompts=None,
                       max_sequence_length=text, resolution=size, **overrides)


def _pipeline_output(plugin, kind, row, seed, steps, images=None):
    _, text, size = KINDS[kind]
    images = row_images(row) if images is None else images
    options = {"true_cfg_scale": 1.0} if kind.startswith("qwen") else {"guidance_scale": 3.0,
                                                                        "max_sequence_length": text}
    with torch.no_grad():
        return plugin.adapter.pipeline(image=images, prompt=row["prompt"], height=size, width=size,
                                       num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
                                       output_type="pt", **options).images


@pytest.mark.parametrize("kind", list(KINDS))
def test_evaluation_is_the_pipeline_ode_with_each_rows_images_in_a_mixed_batch(make_plugin, datasets, monkeypatch,
                                                                               kind):
    # The Plus pipeline sizes each VAE image at about 1024² pixels (VAE_IMAGE_SIZE), set here to the run's size, and
    # each text-encoder image at 384² (CONDITION_IMAGE_SIZE) at the image's aspect ratio, the run's here; the FLUX.2
    # pipelines keep a reference image of the run's size as it is. A batch of rows with 2, 1, 2 images: the plugin
    # runs the one-image row in a transformer call of its own. Float32 rounding of batched against per-row calls.
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus_module

    size = KINDS[kind][2]
    monkeypatch.setattr(plus_module, "VAE_IMAGE_SIZE", size * size)
    plugin = _plugin(make_plugin, datasets, kind, eval_num_steps=3, eval_guidance_scale=1.0 if kind.startswith(
        "qwen") else 3.0)
    rows = plugin.dataset("train")[:3]
    rollout = plugin.rollout(plugin.policy(), image_batch(rows, 1, first_seed=5, training=False)).validate()
    assert rollout.payload["images"].shape == (3, 3, size, size)
    for k, row in enumerate(rows):
        expected = _pipeline_output(plugin, kind, row, 5 + k, 3)
        torch.testing.assert_close(rollout.payload["images"][k:k + 1], expected, rtol=0, atol=2e-5)
    # the second image matters, and for Qwen-Image-Edit-Plus the images' order ("Picture 1:", "Picture 2:"): the
    # checks above can fail. (FLUX.2's tiny transformers barely tell the order apart, 1e-4 and 3e-5 here: their
    # rotary time axis turns little between T = 10 and 20; the order of the tokens is checked in the next test.)
    first = rows[0]
    alone = _pipeline_output(plugin, kind, first, 5, 3, images=row_images(first)[:1])
    assert (alone - rollout.payload["images"][:1]).abs().max() > 1e-3
    if kind.startswith("qwen"):
        swapped = _pipeline_output(plugin, kind, first, 5, 3, images=row_images(first)[::-1])
        assert (swapped - rollout.payload["images"][:1]).abs().max() > 1e-3


def test_the_rewards_get_every_input_image_and_the_counts(make_plugin, datasets):
    plugin = _plugin(make_plugin, datasets, "flux2_klein")
    rows = plugin.dataset("train")
    _, conditioning, payload = plugin.sampler.row_conditioning(rows)
    assert payload["condition_images"].shape == (4, 3, 64, 64)
    assert payload["more_condition_images"].shape == (4, 1, 3, 64, 64)  # two places: the most a row names
    assert payload["condition_image_counts"].tolist() == [2, 1, 2, 2]
    assert conditioning["condition_image_mask"].tolist() == [[1, 1], [1, 0], [1, 1], [1, 1]]
    assert conditioning["image_latents"].shape == (4, 2 * 256, 16)  # [n, slots·(64/4)², 4·4]
    pictures = [torch.from_numpy(np.asarray(image)).permute(2, 0, 1).float() / 255 for image in row_images(rows[0])]
    torch.testing.assert_close(payload["condition_images"][0], pictures[0], rtol=0, atol=1e-6)  # cropped at its size
    torch.testing.assert_close(payload["more_condition_images"][0, 0], pictures[1], rtol=0, atol=1e-6)
    assert payload["more_condition_images"][1].abs().max() == 0  # a one-image row: nothing in the second place
    assert conditioning["image_latents"][1, 256:].abs().max() == 0
    # row 3 names row 0's images the other way round: the same encodings, in the other order
    torch.testing.assert_close(conditioning["image_latents"][3, :256], conditioning["image_latents"][0, 256:])
    torch.testing.assert_close(payload["more_condition_images"][3, 0], payload["condition_images"][0])


def test_each_image_is_encoded_once_and_the_plus_text_reads_all_of_a_rows_images(make_plugin, datasets):
    plugin = _plugin(make_plugin, datasets, "qwen_image_edit_plus", cfg=True, negative_prompt=" ")
    encoded, read = [], []
    adapter = plugin.adapter
    images, prompts = adapter.encode_condition_images, adapter.encode_prompts_with_images
    adapter.encode_condition_images = lambda batch: encoded.append(len(batch)) or images(batch)
    adapter.encode_prompts_with_images = lambda texts, pictures, length: (
        read.append([len(row) for row in pictures]) or prompts(texts, pictures, length))
    rows = plugin.dataset("train")
    _, conditioning, _ = plugin.sampler.row_conditioning(rows)
    plugin.sampler.row_conditioning(rows[::-1])
    assert encoded == [5]  # five image files, each encoded once (rows 0 and 3 share theirs), then from the cache
    assert read == [[2, 1, 2, 2], [2, 1, 2, 2]]  # each (prompt, images), then each row's images with the negative
    # row 3 has row 0's images swapped: the text encoder reads "Picture 1:" and "Picture 2:" in the row's order
    with torch.no_grad():
        embeds, _ = adapter.pipeline.encode_prompt(prompt=[rows[3]["prompt"]], image=[
            adapter._text_image(image) for image in row_images(rows[3])])
    torch.testing.assert_close(conditioning["prompt_embeds"][3, :embeds.shape[1]], embeds[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["qwen_image_edit_plus", "flux2"])
def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split_with_mixed_counts(make_plugin, datasets, kind):
    plugin = _plugin(make_plugin, datasets, kind, **({"cfg": True, "negative_prompt": " "}
                                                     if kind.startswith("qwen") else {}))
    perturb_lora(plugin)
    rollout = plugin.rollout(plugin.policy(), image_batch(plugin.dataset("train")[:2], 3)).validate()
    assert rollout.replay["conditioning"]["condition_image_mask"].sum(1).tolist() == [2, 2, 2, 1, 1, 1]
    assert_ratio_one_for_any_split(plugin, rollout)  # splits that separate or mix the counts; other LoRA weights fail


def test_two_grpo_steps_train_the_lora_with_mixed_counts(train_config, datasets, tmp_path):
    adapter, text, size = KINDS["flux2_klein"]
    train_two_steps(Trainer(train_config("flux2_klein", tmp_path, adapter=adapter, dataset=str(datasets[size]),
                                         prompts=None, eval_prompts=None, eval_dataset=str(datasets[size]),
                                         max_sequence_length=text, resolution=size)))


def test_saved_samples_show_each_rows_input_images_left_of_the_result(make_plugin, datasets, monkeypatch, tmp_path):
    import mmrl.plugins.flow.images as images_module

    plugin = _plugin(make_plugin, datasets, "flux2_klein", eval_num_steps=2)
    rollout = plugin.rollout(plugin.policy(), image_batch(plugin.dataset("train"), 1, training=False))
    shown = []
    original = images_module.save_caption_grid
    monkeypatch.setattr(images_module, "save_caption_grid", lambda images, captions, path: (
        shown.append(images) or original(images, captions, path)))
    plugin.save_samples(rollout, torch.zeros(4), tmp_path, tag="eval")
    (grid,) = shown
    assert grid.shape == (4, 3, 64, 3 * 64)  # first image, second image (black for the one-image row), result
    torch.testing.assert_close(grid[..., :64], rollout.payload["condition_images"])
    torch.testing.assert_close(grid[..., 64:128], rollout.payload["more_condition_images"][:, 0])
    torch.testing.assert_close(grid[..., 128:], rollout.payload["images"])
    assert (tmp_path / "eval.png").is_file()


def test_rows_with_several_images_are_refused_where_the_pipeline_takes_one(make_plugin, datasets):
    with pytest.raises(ValueError, match=r"^.*train.jsonl row 1 names 2 input images; the qwen_image_edit adapter "
                                         r"takes one per row \(several: qwen_image_edit with a "
                                         r"QwenImageEditPlusPipeline, qwen_image21_edit, flux2_edit, "
                                         r"flux2_klein_edit\)$"):
        make_plugin("qwen_image_edit", dataset=str(datasets[32]), prompts=None, eval_prompts=None, resolution=32,
                    max_sequence_length=64)
