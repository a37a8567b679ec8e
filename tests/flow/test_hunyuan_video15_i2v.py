"""The HunyuanVideo 1.5 image-to-video adapter on a tiny ``HunyuanVideo15ImageToVideoPipeline`` (the text-to-video
test's tiny components, a one-layer SigLIP vision tower and its processor) built from config classes, saved and
loaded back through ``from_pretrained``, with prompt rows that name the first frame: the plugin's ODE is the
pipeline's own sampler on the same image, the condition channels, mask and image features are the pipeline's, each
image is encoded once, the training forward gives ratio 1 on-policy, and GRPO steps train the LoRA."""

from __future__ import annotations

import copy
import json

import numpy as np
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

FRAMES = 5  # the tiny VAE compresses time by 4, as the released one: 2 latent frames
KIND = "hunyuan_video15_i2v"
PER_FRAME = "rewards.functions=[{name: per_frame, args: {reward: test_brightness, stride: 2}}]"
SQUARE, WIDE = (0, 1), (2, 3)
"""Rows whose images the pipeline sizes to 16 x 16 (at its tiny target_size 16) and to 16 x 32 (at target_size 23):
HunyuanVideo15ImageProcessor.calculate_default_height_width picks the bucket nearest the image's aspect ratio."""
TARGET_SIZES = {(16, 16): 16, (16, 32): 23}


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus a tiny HunyuanVideo 1.5 image-to-video, built once per session."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    folder = save_tiny_pipeline(KIND, tmp_path_factory.mktemp("flow_hunyuan_video15_i2v") / "tiny-hv15-i2v")
    return {**pipelines, KIND: folder}


@pytest.fixture(scope="session")
def first_frames(tmp_path_factory):
    """A JSONL of rows naming random RGB first frames (width, height) by relative paths: two near-square ones that
    the pipeline crops to 16 x 16 and two wide ones it crops to 16 x 32 (none of them already at that size)."""
    rows = [("a cat", (20, 20)), ("a dog", (22, 24)), ("a red car", (34, 16)), ("a blue house", (44, 20))]
    return write_image_rows(tmp_path_factory.mktemp("flow_hv15_first_frames"), rows).parent


@pytest.fixture
def hunyuan(make_plugin, first_frames):
    """``hunyuan(**options)``: a FlowPlugin on the tiny HunyuanVideo 1.5 I2V (5 frames of 16 px, 32 text tokens)."""
    def build(**options):
        return make_plugin(KIND, **{"dataset": str(first_frames / "train.jsonl"), "prompts": None,
                                    "eval_prompts": None, "num_frames": FRAMES, "max_sequence_length": 32, **options})

    return build


def _rows(first_frames, *indices):
    return image_rows(first_frames / "train.jsonl", KIND, *indices)


def _pipeline_videos(pipeline, rows, seeds, steps, size, scale):
    """``HunyuanVideo15ImageToVideoPipeline(image=..., prompt=...)``'s own videos ``[N, 3, F, H, W]``, one row per
    call (the pipeline takes one image), at the pipeline's own text lengths. It takes no height and width: its
    ``target_size`` is set so that its bucket for each row's image is ``size``. ``scale``: the guider's CFG scale,
    None for a disabled guider (one conditional pass)."""
    original, target = pipeline.guider, pipeline.target_size
    pipeline.guider = original.new(enabled=False) if scale is None else original.new(guidance_scale=scale)
    pipeline.target_size = TARGET_SIZES[size]
    try:
        frames = []
        for row, seed in zip(rows, seeds, strict=True):
            (image,) = row_images(row)
            assert pipeline.video_processor.calculate_default_height_width(
                image.height, image.width, pipeline.target_size) == size  # the pipeline's own size is the run's
            with torch.no_grad():
                frames.append(pipeline(image=image, prompt=row["prompt"], num_frames=FRAMES,
                                       num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
                                       output_type="pt").frames)  # [1, F, 3, H, W]
    finally:
        pipeline.guider, pipeline.target_size = original, target
    return torch.cat(frames).permute(0, 2, 1, 3, 4)


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
@pytest.mark.parametrize("size", [(16, 16), (16, 32)], ids=["16x16", "16x32"])
def test_evaluation_is_the_i2v_pipeline_ode_on_the_same_image(hunyuan, first_frames, cfg, size):
    # Same noise, σ grid, cropped image, condition latents and mask, SigLIP features, raw timesteps; 32 cached text
    # tokens against the pipeline's 1000 + 256 (padding only) and one [uncond; cond] call against the guider's two:
    # float32 rounding, 1e-5 on pixels after 3 steps. Both images of each size need a crop (other aspect ratios).
    height, width = size
    plugin = hunyuan(cfg=cfg, eval_num_steps=3, eval_guidance_scale=3.0 if cfg else None, height=height, width=width)
    assert plugin.adapter.name == KIND  # detected from model_index.json
    perturb_lora(plugin, scale=0.1)  # the pipeline shares the transformer, LoRA included
    rows = _rows(first_frames, *(SQUARE if size == (16, 16) else WIDE))
    rollout = plugin.rollout(plugin.policy(), image_batch(rows, 1, first_seed=5, training=False)).validate()
    videos = rollout.payload["videos"]
    assert videos.shape == (2, 3, FRAMES, height, width)
    pipeline = plugin.adapter.pipeline
    expected = _pipeline_videos(pipeline, rows, (5, 6), 3, size, 3.0 if cfg else None)
    torch.testing.assert_close(videos, expected, rtol=0, atol=1e-5)
    # the rewards' condition_images: each first frame cropped as the pipeline crops it, in [0, 1]
    condition = rollout.payload["condition_images"]  # [2, 3, H, W]
    cropped = [pipeline.video_processor.resize(row_images(row)[0], height=height, width=width, resize_mode="crop")
               for row in rows]
    seen = torch.from_numpy(np.stack([np.asarray(image) for image in cropped])).permute(0, 3, 1, 2).float() / 255
    torch.testing.assert_close(condition, seen, rtol=0, atol=1e-6)
    if size == (16, 16):  # the guidance matters, so the check can fail
        other = _pipeline_videos(pipeline, rows, (5, 6), 3, size, None if cfg else 3.0)
        assert float((other - expected).abs().max()) > 1e-3


def test_the_transformer_sees_the_images_latents_mask_and_features(hunyuan, first_frames):
    """Each call's input is ``[latents; image latents on the first latent frame, zeros after; mask 1 on the first
    latent frame only]`` and ``image_embeds`` the SigLIP tower's last hidden state of the cropped image, computed
    here from the VAE and the image encoder; another image gives another velocity."""
    plugin = hunyuan()
    adapter, pipeline = plugin.adapter, plugin.adapter.pipeline
    first, second = _rows(first_frames, 0, 1)
    _, conditioning, _ = plugin.sampler.row_conditioning([first, {**second, "prompt": first["prompt"]}])
    cropped = [pipeline.video_processor.resize(row_images(row)[0], height=16, width=16, resize_mode="crop")
               for row in (first, second)]
    pixels = pipeline.video_processor.preprocess(cropped, height=16, width=16)  # [2, 3, 16, 16] in [-1, 1]
    with torch.no_grad():
        latents = torch.cat([pipeline.vae.encode(pixel[None, :, None]).latent_dist.mode() for pixel in pixels])
        features = pipeline.image_encoder(**pipeline.feature_extractor(images=cropped, return_tensors="pt"))
    scaled = latents * pipeline.vae.config.scaling_factor  # [2, 4, 1, 4, 4]
    noisy = torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(0)).expand(2, -1, -1, -1, -1)
    seen = {}

    def record(module, args, kwargs):
        seen.update(hidden=kwargs["hidden_states"].detach().clone(), image=kwargs["image_embeds"].detach().clone())

    handle = adapter.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            velocity = adapter.velocity(plugin.policy(), noisy, torch.tensor([900.0, 900.0]), conditioning,
                                        guidance_scale=1.0)
    finally:
        handle.remove()
    hidden = seen["hidden"]  # [2, 2·4 + 1, 2, 4, 4]
    assert hidden.shape == (2, 9, 2, 4, 4)
    torch.testing.assert_close(hidden[:, :4], noisy, rtol=0, atol=0)
    torch.testing.assert_close(hidden[:, 4:8, :1], scaled, rtol=0, atol=1e-6)
    assert bool((hidden[:, 4:8, 1:] == 0).all())
    assert bool((hidden[:, 8, 0] == 1).all()) and bool((hidden[:, 8, 1:] == 0).all())
    assert seen["image"].shape == (2, 16, 8)  # 16 SigLIP tokens of the transformer's image_embed_dim
    torch.testing.assert_close(seen["image"], features.last_hidden_state, rtol=0, atol=1e-6)
    assert (velocity[0] - velocity[1]).abs().max() > 1e-3


def test_condition_images_are_encoded_once_per_image(hunyuan, first_frames):
    plugin = hunyuan(cfg=False, num_steps=2)
    calls = []
    original = plugin.adapter.encode_condition_images
    plugin.adapter.encode_condition_images = lambda images: calls.append(len(images)) or original(images)
    rows = _rows(first_frames, 0, 1)
    rollout = plugin.rollout(plugin.policy(), image_batch(rows, 3)).validate()
    plugin.rollout(plugin.policy(), image_batch(rows, 2, first_group=5))
    assert calls == [2]  # two distinct images, ten samples, two rollouts
    conditioning = rollout.replay["conditioning"]
    assert conditioning["image_latents"].shape == (6, 4, 1, 4, 4)  # [n, C, 1, h, w]
    assert conditioning["image_embeds"].shape == (6, 16, 8)  # [n, T, D_image]
    assert torch.equal(conditioning["image_embeds"][0], conditioning["image_embeds"][2])  # one group, one image


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(hunyuan, first_frames, cfg):
    plugin = hunyuan(cfg=cfg, guidance_scale=3.0 if cfg else None, num_steps=4, timestep_fraction=0.6)
    perturb_lora(plugin)
    rollout = plugin.rollout(plugin.policy(), image_batch(_rows(first_frames, 0, 1, 2), 2)).validate()
    assert rollout.replay["latents"].shape[2:] == (4, 2, 4, 4)  # [n, A, C, F_lat, h, w]
    assert_ratio_one_for_any_split(plugin, rollout)  # other LoRA weights move the ratio: it can fail


def test_two_grpo_steps_train_the_lora_with_ratio_one(train_config, first_frames, tmp_path):
    dataset = str(first_frames / "train.jsonl")
    trainer = Trainer(train_config(KIND, tmp_path, PER_FRAME, dataset=dataset, eval_dataset=dataset, prompts=None,
                                   eval_prompts=None, num_frames=FRAMES, max_sequence_length=32, cfg=False))
    changed = train_two_steps(trainer, frozen_components=True)  # the image encoder and VAE stay frozen too
    assert any(key.startswith("transformer_blocks.") and ".attn.to_q.lora_B" in key for key in changed)


def test_refusals_are_one_line(make_plugin, hunyuan, first_frames, tmp_path):
    """Inline prompts, rows without an image, a meanflow transformer and a pipeline without an image encoder."""
    from mmrl.plugins.flow.adapters.hunyuan_video15_i2v import HunyuanVideo15ImageToVideoAdapter

    with pytest.raises(ConfigError, match=r"^config key 'plugin.prompts': got \['a cat'\]; allowed: null: the "
                                          r"hunyuan_video15_i2v adapter conditions every sample on an input "
                                          r"image[^\n]*$"):
        make_plugin(KIND, prompts=["a cat"], num_frames=FRAMES)
    lacking = tmp_path / "lacking.jsonl"
    lacking.write_text(json.dumps({"prompt": "a cat", "image": str(first_frames / "images" / "0.png")}) + "\n"
                       + json.dumps({"prompt": "no image"}) + "\n")
    with pytest.raises(ValueError, match=r"lacking.jsonl row 2 has no 'image' \(the path of its input image, or a "
                                         r"non-empty list of paths\), which the hunyuan_video15_i2v adapter needs in "
                                         r"every row; got None$"):
        hunyuan(dataset=str(lacking))
    pipeline = copy.copy(hunyuan().adapter.pipeline)  # a shallow copy: its own attributes, the same models
    pipeline.transformer = copy.copy(pipeline.transformer)
    pipeline.transformer.register_to_config(use_meanflow=True)
    with pytest.raises(ValueError, match=r"^hunyuan_video15_i2v adapter: the transformer has use_meanflow, for which "
                                         r"the pipeline passes the next step's timestep as timestep_r; the adapter "
                                         r"reproduces transformers without it$"):
        HunyuanVideo15ImageToVideoAdapter(pipeline, torch.device("cpu"))
    pipeline = copy.copy(hunyuan().adapter.pipeline)
    pipeline.image_encoder = None
    with pytest.raises(ValueError, match=r"^hunyuan_video15_i2v adapter: the pipeline has no image_encoder; "):
        HunyuanVideo15ImageToVideoAdapter(pipeline, torch.device("cpu"))


def test_the_recipe_runs_a_step_on_the_tiny_pipeline(pipelines, first_frames, tmp_path):
    """configs/flow/hunyuan_video15_i2v.yaml as written (DanceGRPO's SDE at eta 0.25 on a random 0.6 of the steps,
    shared initial noise, the x0 prediction decoded, true CFG at 6.0, two optimizer steps per rollout), on the tiny
    pipeline at 16 px and 5 frames with the test reward per frame: the combination loads, trains at ratio 1 and
    evaluates."""
    dataset = first_frames / "train.jsonl"
    trainer = run_recipe_step("hunyuan_video15_i2v.yaml", pipelines[KIND], tmp_path, f"plugin.dataset={dataset}",
                              f"plugin.eval_dataset={dataset}", "plugin.resolution=16", f"plugin.num_frames={FRAMES}",
                              "plugin.num_steps=4", "plugin.eval_num_steps=2", "plugin.max_sequence_length=32",
                              PER_FRAME)
    assert (trainer.plugin.cfg, trainer.plugin.guidance_scale) == (True, 6.0)
