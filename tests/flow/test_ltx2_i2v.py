"""The LTX-2 image-to-audio-video adapter on a tiny ``LTX2ImageToVideoPipeline`` (the text-to-audio-video test's tiny
components, :func:`tests.flow.test_ltx2.build_tiny_ltx2_pipeline`), saved and loaded back through ``from_pretrained``,
with prompt rows that name the first frame: the plugin's ODE is the pipeline's own sampler on the same image (H.264
re-compression, resize, VAE latent on the first latent frame, its tokens at timestep 0 and never stepped, every
default guidance term), the latent holds the generated tokens only, the training forward gives ratio 1, the recipe
trains a step, and unsupported settings are refused in one line."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from mmrl.config import ConfigError
from tests.flow.checks import (
    assert_ratio_one_for_any_split,
    image_batch,
    image_rows,
    perturb_lora,
    row_images,
    run_recipe_step,
    write_image_rows,
)
from tests.flow.test_ltx2 import FRAMES, NO_EXTRA_GUIDANCE, PER_FRAME, STG_BLOCKS, TOKENS, build_tiny_ltx2_pipeline

KIND = "ltx2_i2v"
GIVEN = 16  # the first latent frame's tokens at 32 px: 4 x 4 (the tiny VAE compresses space by 8)
VIDEO, AUDIO = 48, 5  # 3 latent frames of 4 x 4 video tokens; 5 audio latent frames at 24 fps


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus a tiny LTX-2 image-to-video (the text-to-video test's components) and the
    same components saved as an ``LTX2Pipeline`` (as Lightricks/LTX-2 is)."""
    from diffusers import LTX2ImageToVideoPipeline

    root = tmp_path_factory.mktemp("flow_ltx2_i2v")
    text_to_video = build_tiny_ltx2_pipeline()
    LTX2ImageToVideoPipeline(**text_to_video.components).save_pretrained(root / "tiny-ltx2-i2v")
    text_to_video.save_pretrained(root / "tiny-ltx2")
    return {**pipelines, KIND: root / "tiny-ltx2-i2v", "ltx2_folder": root / "tiny-ltx2"}


@pytest.fixture(scope="session")
def first_frames(tmp_path_factory):
    """A JSONL of rows naming random RGB first frames of other sizes and aspect ratios than the videos'."""
    rows = [("a cat", (40, 36)), ("a dog", (30, 34)), ("a red car", (70, 30)), ("a blue house", (50, 44))]
    return write_image_rows(tmp_path_factory.mktemp("flow_ltx2_first_frames"), rows)


@pytest.fixture
def ltx2(make_plugin, first_frames):
    """``ltx2(options, **plugin options)``: a FlowPlugin on the tiny LTX-2 I2V (5 frames of 32 px, 16 text tokens,
    STG at block 1) with the image rows."""
    def build(options=None, **overrides):
        return make_plugin(KIND, **{"dataset": str(first_frames), "eval_dataset": str(first_frames), "prompts": None,
                                    "eval_prompts": None, "num_frames": FRAMES, "max_sequence_length": TOKENS,
                                    "resolution": 32, "adapter_options": {"stg_blocks": STG_BLOCKS, **(options or {})},
                                    **overrides})

    return build


def _pipeline(pipeline, rows, seeds, steps, height, width, output_type, crf, guidance):
    """``LTX2ImageToVideoPipeline(image=..., prompt=...)``: ``(video, audio)`` of ``rows``, one generator per row. With
    the default H.264 re-compression (``crf`` None) the pipeline takes one PIL image per call: one call per row."""
    calls = [[row] for row in rows] if crf is None else [rows]
    videos, audios = [], []
    for part in calls:
        images = [row_images(row)[0] for row in part]
        index = [rows.index(row) for row in part]
        with torch.no_grad():
            video, audio = pipeline(
                image=images[0] if len(images) == 1 else images, prompt=[row["prompt"] for row in part],
                height=height, width=width, num_frames=FRAMES, num_inference_steps=steps,
                max_sequence_length=TOKENS, spatio_temporal_guidance_blocks=STG_BLOCKS, image_crf=crf,
                generator=[torch.Generator().manual_seed(seeds[i]) for i in index], output_type=output_type,
                return_dict=False, **guidance)
        videos.append(video)
        audios.append(audio)
    return torch.cat(videos), torch.cat(audios)


CASES = {
    # LTX2ImageToVideoPipeline.__call__'s defaults: H.264 at CRF 33, CFG 3 / 7 in x0 space, rescale 0.7, STG 1,
    # modality 3; 32 x 64 (a transposed grid would not survive a non-square size)
    "defaults": (32, 64, True, {}, {}, None),
    # Flow-Factory's training settings: no guidance term, no re-compression
    "unguided": (32, 32, False, {**NO_EXTRA_GUIDANCE, "image_crf": 0},
                 {"guidance_scale": 1.0, "audio_guidance_scale": 1.0, "stg_scale": 0.0, "audio_stg_scale": 0.0,
                  "modality_scale": 1.0, "audio_modality_scale": 1.0, "guidance_rescale": 0.0,
                  "audio_guidance_rescale": 0.0}, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_evaluation_is_the_i2v_pipeline_ode_on_the_same_image(ltx2, first_frames, case):
    """Same noise, image latent, per-token timesteps, guidance and step (latent frame 0 held): the plugin's videos,
    both final latent streams and the waveform equal the pipeline's to float32 rounding after 3 steps; the
    transformer sees the image's tokens first, at timestep 0, in every pass."""
    height, width, cfg, options, guidance, crf = CASES[case]
    plugin = ltx2(options, cfg=cfg, eval_num_steps=3, height=height, width=width)
    adapter = plugin.adapter
    assert adapter.name == KIND and adapter.image_crf == (33 if crf is None else 0)  # detected from model_index.json
    perturb_lora(plugin, scale=0.1)  # the pipeline shares the transformer, LoRA included
    finals, seen = [], []
    count = adapter.given_tokens()  # T_g = h·w: 4 x 8 at 32 x 64
    assert count == height * width // 64
    decode = adapter.decode
    adapter.decode = lambda latents: finals.append(latents) or decode(latents)

    def record(module, args, kwargs):
        seen.append((kwargs["hidden_states"][:, :count].detach().clone(), kwargs["timestep"].detach().clone(),
                     kwargs["audio_timestep"].detach().clone()))

    rows = image_rows(first_frames, KIND, 0, 2)
    handle = adapter.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        rollout = plugin.rollout(plugin.policy(), image_batch(rows, 1, first_seed=5, training=False)).validate()
    finally:
        handle.remove()
    videos = rollout.payload["videos"]  # [2, 3, F, H, W]
    assert videos.shape == (2, 3, FRAMES, height, width)
    pipeline = adapter.pipeline
    frames, audio = _pipeline(pipeline, rows, (5, 6), 3, height, width, "pt", crf, guidance)
    torch.testing.assert_close(videos, frames.permute(0, 2, 1, 3, 4), rtol=0, atol=1e-5)
    torch.testing.assert_close(adapter.decode_audio(finals[0]), audio.float(), rtol=0, atol=1e-5)

    video_latents, audio_latents = _pipeline(pipeline, rows, (5, 6), 3, height, width, "latent", crf, guidance)
    tokens = adapter.video_tokens()  # [2, T_v, 8] of the final latents, the image's first
    video, sound = adapter.split(finals[0])
    grid = adapter.video_grid()
    vae = pipeline.vae
    unpacked = pipeline._denormalize_latents(pipeline._unpack_latents(video, *grid), vae.latents_mean,
                                             vae.latents_std, vae.config.scaling_factor)
    torch.testing.assert_close(unpacked, video_latents, rtol=0, atol=1e-5)
    sound = pipeline._denormalize_audio_latents(sound, pipeline.audio_vae.latents_mean, pipeline.audio_vae.latents_std)
    torch.testing.assert_close(pipeline._unpack_audio_latents(sound, AUDIO, num_mel_bins=4), audio_latents, rtol=0,
                               atol=1e-5)

    image = rollout.payload["condition_images"]  # [2, 3, H, W]: the re-compressed, resized image in [0, 1]
    assert image.shape == (2, 3, height, width)
    # the image's tokens: the final latents' first frame, and what every pass of every step saw, at timestep 0
    given = adapter.encode_condition_images([row_images(row)[0] for row in rows])[0]["image_latents"]
    assert torch.equal(video[:, :count], given)
    passes = {"defaults": 3, "unguided": 1}[case]  # [uncond; cond], STG, isolation / cond
    assert len(seen) == 3 * passes
    for hidden, timestep, audio_timestep in seen:
        assert timestep.shape == (hidden.shape[0], tokens)  # [n, T_v] per token
        assert bool((timestep[:, :count] == 0).all()) and bool((timestep[:, count:] > 0).all())
        assert torch.equal(timestep[:, -1], audio_timestep)
        torch.testing.assert_close(hidden, given.repeat(hidden.shape[0] // 2, 1, 1), rtol=0, atol=0)
    if case == "defaults":  # the image and the guidance matter, so the check can fail
        assert float((image - _pipeline_pixels(pipeline, rows, height, width, 0)).abs().max()) > 1e-2  # H.264
        torch.testing.assert_close(image, _pipeline_pixels(pipeline, rows, height, width, 33), rtol=0, atol=1e-6)
        other, _ = _pipeline(pipeline, rows, (5, 6), 3, height, width, "latent", None, {"stg_scale": 0.0})
        assert float((other - video_latents).abs().max()) > 1e-4


def _pipeline_pixels(pipeline, rows, height, width, crf):
    """The rows' first frames as the pipeline preprocesses them (H.264 at ``crf``, resized), in [0, 1]."""
    import numpy as np
    from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf
    from PIL import Image

    images = [Image.fromarray(apply_image_conditioning_crf(np.array(row_images(row)[0]), crf)) for row in rows]
    return (pipeline.video_processor.preprocess(images, height=height, width=width) / 2 + 0.5).clamp(0, 1)


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
def test_the_latent_is_the_generated_tokens_and_the_ratio_is_one(ltx2, first_frames, cfg):
    """The SDE, its log-prob and the stored actions cover the video tokens after the first latent frame and the
    audio tokens; the image's tokens are in the conditioning and come back for decoding; ratio 1 on-policy."""
    plugin = ltx2(cfg=cfg, num_steps=3)
    adapter = plugin.adapter
    perturb_lora(plugin)
    rollout = plugin.rollout(plugin.policy(), image_batch(image_rows(first_frames, KIND, 0, 1, 3), 2)).validate()
    assert rollout.old_logp.shape == (6, 2)
    assert rollout.replay["latents"].shape == (6, 2, VIDEO - GIVEN + AUDIO, 8)  # [n, A, T_v − T_g + T_a, C]
    image = rollout.replay["conditioning"]["image_latents"]  # [n, T_g, C]
    assert image.shape == (6, GIVEN, 8) and torch.equal(image[0], image[1])  # one group, one image
    full = adapter.fill(rollout.replay["latents"][:, 0], rollout.replay["conditioning"])
    assert full.shape == (6, VIDEO + AUDIO, 8) and torch.equal(adapter.strip(full), rollout.replay["latents"][:, 0])
    assert torch.equal(full[:, :GIVEN], image)
    assert_ratio_one_for_any_split(plugin, rollout)  # other LoRA weights move the ratio: it can fail


def test_the_recipe_runs_a_step_on_the_tiny_pipeline(pipelines, first_frames, tmp_path):
    """configs/flow/ltx2_i2av.yaml as written (Flow-Factory's LTX-2 I2AV settings: Flow-SDE at noise level 0.7 on one
    of steps 1-3, no guidance terms in training), on the tiny pipeline at 32 px and 5 frames with the image rows and
    the test reward per frame: the combination loads, trains the LoRA at ratio 1 and evaluates."""
    trainer = run_recipe_step("ltx2_i2av.yaml", pipelines[KIND], tmp_path, f"plugin.dataset={first_frames}",
                              f"plugin.eval_dataset={first_frames}", "plugin.resolution=32", "plugin.height=null",
                              "plugin.width=null", f"plugin.num_frames={FRAMES}", "plugin.num_steps=4",
                              "plugin.eval_num_steps=2", "plugin.window_range=[1, 3]",
                              f"plugin.max_sequence_length={TOKENS}", "plugin.adapter_options.image_crf=0",
                              PER_FRAME)
    plugin = trainer.plugin
    assert plugin.adapter.name == KIND and plugin.cfg is False and plugin.adapter.stg_on is False
    changed = [name for name, parameter in plugin.policy().named_parameters()
               if "lora_B" in name and bool(parameter.detach().abs().sum() > 0)]
    assert any(".audio_attn1.to_q.lora_B" in name for name in changed)


def test_unsupported_rows_and_settings_are_refused_in_one_line(ltx2, pipelines, first_frames, tmp_path):
    from mmrl.plugins.flow.adapters.ltx2_i2v import LTX2ImageToVideoAdapter

    with pytest.raises(ConfigError, match=r"^config key 'plugin.prompts': got \['a cat'\]; allowed: null: the "
                                          r"ltx2_i2v adapter conditions every sample on an input image[^\n]*$"):
        ltx2(prompts=["a cat"], dataset=None)
    lacking = tmp_path / "lacking.jsonl"
    lacking.write_text(json.dumps({"prompt": "a cat", "image": str(first_frames.parent / "images" / "0.png")}) + "\n"
                       + json.dumps({"prompt": "no image"}) + "\n")
    with pytest.raises(ValueError, match=r"lacking.jsonl row 2 has no 'image' \(the path of its input image, or a "
                                         r"non-empty list of paths\), which the ltx2_i2v adapter needs in every row; "
                                         r"got None$"):
        ltx2(dataset=str(lacking))
    two = tmp_path / "two.jsonl"
    two.write_text(json.dumps({"prompt": "a cat", "image": ["images/0.png", "images/1.png"]}) + "\n")
    (tmp_path / "images").symlink_to(first_frames.parent / "images")
    with pytest.raises(ValueError, match=r"two.jsonl row 1 names 2 input images; the ltx2_i2v adapter takes one per "
                                         r"row "):
        ltx2(dataset=str(two))
    prefix = "^config key 'plugin.adapter_options': got "
    with pytest.raises(ConfigError, match=prefix + r".*allowed: image_crf: the H.264 CRF the input image is "
                                                   r"re-compressed at .*; got 60$"):
        ltx2({"image_crf": 60})
    with pytest.raises(ConfigError, match=prefix + r".*allowed: keys of audio_guidance_scale, .*, frame_rate, "
                                                   r"image_crf \(the ltx2_i2v adapter's\); 'motion_speed' is not one$"):
        ltx2({"motion_speed": 0.5})
    plugin = ltx2()
    adapter = plugin.adapter
    pipeline = copy.copy(adapter.pipeline)  # a shallow copy: its own attributes, the same models
    pipeline.transformer = copy.copy(pipeline.transformer)
    pipeline.transformer.register_to_config(patch_size=2)
    with pytest.raises(ValueError, match=r"^ltx2_i2v adapter: the transformer's patch sizes are 2 and 1; "
                                         r"LTX2ImageToVideoPipeline's conditioning mask and first-frame step take one "
                                         r"token per latent pixel \(both 1\)$"):
        LTX2ImageToVideoAdapter(pipeline, torch.device("cpu"))
    generated = torch.zeros(1, VIDEO - GIVEN + AUDIO, 8)
    with pytest.raises(ValueError, match=r"^ltx2_i2v adapter: call_transformer takes all 424 latent elements of a "
                                         r"sample \(the image's tokens included: fill\(\) puts them in\); got 296$"):
        adapter.call_transformer(plugin.policy(), generated, torch.ones(1), {}, 1.0)
    with pytest.raises(ValueError, match=r"^the ltx2_i2v adapter drives LTX2ImageToVideoPipeline or LTX2Pipeline, "
                                         r"not StableDiffusion3Pipeline: set plugin.adapter: sd3 \(or auto\)$"):
        LTX2ImageToVideoAdapter.from_pretrained(str(pipelines["sd3"]), dtype=torch.float32, device=torch.device("cpu"))


def test_an_ltx2_pipeline_folder_loads_as_image_to_video(ltx2, pipelines):
    """Lightricks/LTX-2's model_index.json names LTX2Pipeline: ``adapter: ltx2_i2v`` on such a folder builds an
    LTX2ImageToVideoPipeline of its components (the image processor's bilinear resize included)."""
    adapter = ltx2(model=str(pipelines["ltx2_folder"]), adapter=KIND).adapter
    assert type(adapter.pipeline).__name__ == "LTX2ImageToVideoPipeline"
    assert adapter.pipeline.video_processor.config.resample == "bilinear"
