"""The HunyuanVideo 1.5 adapter on a tiny ``HunyuanVideo15Pipeline`` (Qwen2.5-VL text model behind the pipeline's
chat template, ByT5 glyph encoder, dual-stream 3-D transformer, causal video VAE with the released 4× temporal
compression) built from config classes, saved and loaded back through ``from_pretrained``: the plugin's ODE is the
pipeline's own sampler, prompts are the pipeline's encodings of both encoders, the σ grid is its scheduler's, the
guidance follows its guider, the training forward gives ratio 1 on-policy, and GRPO steps train the LoRA."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from mmrl.config import ConfigError
from mmrl.trainer import Trainer
from tests.flow.checks import (
    assert_loaded_lora_gives_the_policy_velocities,
    assert_ratio_one_for_any_split,
    perturb_lora,
    run_recipe_step,
    train_two_steps,
)
from tests.flow.conftest import prompt_batch

FRAMES = 5  # the tiny VAE compresses time by 4, as the released one: 2 latent frames
PLAIN, QUOTED = "a cat", 'a red sign "hi"'
"""A prompt without quoted text (no glyph tokens) and one whose quoted span goes through the ByT5 glyph encoder."""
PER_FRAME = "rewards.functions=[{name: per_frame, args: {reward: test_brightness, stride: 2}}]"


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus a tiny HunyuanVideo 1.5, built once per session (about a second)."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    folder = save_tiny_pipeline("hunyuan_video15", tmp_path_factory.mktemp("flow_hunyuan_video15") / "tiny-hv15")
    return {**pipelines, "hunyuan_video15": folder}


@pytest.fixture
def hunyuan(make_plugin):
    """``hunyuan(**options)``: a FlowPlugin on the tiny HunyuanVideo 1.5 (5 frames of 16 px, 32 text tokens: the
    test prompts' template part and glyph text fit)."""
    def build(**options):
        return make_plugin("hunyuan_video15", **{"num_frames": FRAMES, "max_sequence_length": 32, **options})

    return build


def _pipeline_videos(pipeline, prompts, seeds, steps, height, width, scale):
    """``HunyuanVideo15Pipeline(...)``'s own videos ``[N, 3, F, H, W]``, each prompt alone with its generator (the
    VAE of diffusers 0.42.1 decodes one video per call), at the pipeline's own text lengths (1000 and 256 tokens);
    ``scale``: the guider's CFG scale, None for a disabled guider (one conditional pass)."""
    original = pipeline.guider
    pipeline.guider = original.new(enabled=False) if scale is None else original.new(guidance_scale=scale)
    try:
        with torch.no_grad():
            frames = [pipeline(prompt, height=height, width=width, num_frames=FRAMES, num_inference_steps=steps,
                               generator=torch.Generator().manual_seed(seed), output_type="pt").frames
                      for prompt, seed in zip(prompts, seeds, strict=True)]  # [1, F, 3, H, W] each
    finally:
        pipeline.guider = original
    return torch.cat(frames).permute(0, 2, 1, 3, 4)


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
@pytest.mark.parametrize(("height", "width"), [(16, 16), (16, 32)], ids=["16x16", "16x32"])
def test_evaluation_is_the_hunyuan_video15_pipeline_ode(hunyuan, cfg, height, width):
    # Same noise, σ grid, raw timesteps, condition channels and image slots. The plugin caches 32 Qwen2.5-VL tokens
    # and 32 glyph tokens per prompt where the pipeline passes 1000 and 256, and runs [uncond; cond] in one call
    # where the pipeline makes two: the transformer drops padding from every real token's computation, so only float32
    # rounding separates the two after 4 steps. 16x32: a transposed grid would not survive a non-square size.
    plugin = hunyuan(cfg=cfg, eval_num_steps=4, eval_guidance_scale=3.0 if cfg else None, height=height, width=width)
    assert plugin.adapter.name == "hunyuan_video15"  # detected from model_index.json
    perturb_lora(plugin, scale=0.1)  # the pipeline shares the transformer, LoRA included
    prompts = [PLAIN, QUOTED]
    rollout = plugin.rollout(plugin.policy(), prompt_batch(prompts, 1, first_seed=5, training=False)).validate()
    videos = rollout.payload["videos"]
    assert videos.shape == (2, 3, FRAMES, height, width) and "images" not in rollout.payload
    pipeline = plugin.adapter.pipeline
    expected = _pipeline_videos(pipeline, prompts, (5, 6), 4, height, width, 3.0 if cfg else None)
    torch.testing.assert_close(videos, expected, rtol=0, atol=1e-5)
    assert float((videos[:, :, 1:] - videos[:, :, :1]).abs().max()) > 1e-2  # the frames are not one image repeated
    if height == width:  # the guidance matters, so the check can fail
        other = _pipeline_videos(pipeline, prompts, (5, 6), 4, height, width, None if cfg else 3.0)
        assert float((other - expected).abs().max()) > 1e-3


def test_prompt_encodings_are_the_pipelines_of_both_encoders(hunyuan):
    """Each cached row is ``encode_prompt``'s (1000 + 256 tokens at the default length, cut to padding-free lengths
    below it), and that is the Qwen2.5-VL text model's third-to-last hidden state of the chat-templated prompt with
    the 108-token system turn cropped, and the ByT5 encoding of the quoted text, computed here from the encoders."""
    adapter = hunyuan().adapter
    pipeline = adapter.pipeline
    full = adapter.encode_prompts([PLAIN, QUOTED], 1000)
    embeds, mask, embeds_2, mask_2 = pipeline.encode_prompt([PLAIN, QUOTED], device="cpu", batch_size=2)
    for key, value in zip(("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2"),
                          (embeds, mask, embeds_2, mask_2), strict=True):
        assert torch.equal(full[key], value), key
    assert full["prompt_embeds"].shape == (2, 1000, 32) and full["prompt_embeds_2"].shape == (2, 256, 16)
    cut = adapter.encode_prompts([PLAIN, QUOTED], 32)
    assert cut["prompt_embeds"].shape == (2, 32, 32) and cut["prompt_embeds_2"].shape == (2, 32, 16)
    assert torch.equal(cut["prompt_embeds"], embeds[:, :32]) and torch.equal(cut["prompt_embeds_mask_2"],
                                                                              mask_2[:, :32])

    tokenizer, text_encoder = pipeline.tokenizer, pipeline.text_encoder
    system = pipeline.system_message
    for row, prompt in enumerate([PLAIN, QUOTED]):
        turns = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=True,
                                            return_tensors="pt").input_ids  # [1, 108 + T]
        length = ids.shape[1] - 108
        assert cut["prompt_embeds_mask"][row].tolist() == [1] * length + [0] * (32 - length)
        assert tokenizer.decode(ids[0, 108:]).startswith(prompt)  # the crop keeps the user's words, not the template
        with torch.no_grad():
            hidden = text_encoder(input_ids=ids, output_hidden_states=True).hidden_states[-3][0]  # [108 + T, D]
        torch.testing.assert_close(cut["prompt_embeds"][row, :length], hidden[108:], rtol=1e-5, atol=1e-6)
    assert cut["prompt_embeds_mask_2"][0].sum() == 0 and cut["prompt_embeds_2"][0].abs().max() == 0  # no quotes
    glyph = pipeline.tokenizer_2('Text "hi". ', return_tensors="pt")  # the pipeline's extract_glyph_texts format
    count = glyph.input_ids.shape[1]
    assert cut["prompt_embeds_mask_2"][1].tolist() == [1] * count + [0] * (32 - count)
    with torch.no_grad():
        encoded = pipeline.text_encoder_2(input_ids=glyph.input_ids).last_hidden_state[0]  # [count, D2]
    torch.testing.assert_close(cut["prompt_embeds_2"][1, :count], encoded, rtol=1e-5, atol=1e-6)


def test_prompts_past_the_cut_are_refused_in_one_line(hunyuan):
    adapter = hunyuan().adapter
    with pytest.raises(ValueError, match=r"^plugin.max_sequence_length is 8, but for 'a red sign \"hi\"' its "
                                         r"template's prompt part is 14 Qwen2.5-VL tokens: raise it$"):
        adapter.encode_prompts([PLAIN, QUOTED], 8)
    glyphs = 'a "cat cat cat cat cat cat"'  # 17 Qwen2.5-VL tokens, 33 ByT5 bytes: the glyph cut is the one refused
    with pytest.raises(ValueError, match=r"^plugin.max_sequence_length is 20, but for 'a \"cat cat cat cat cat cat\"' "
                                         r"its quoted text is 33 ByT5 tokens: raise it$"):
        adapter.encode_prompts([glyphs], 20)
    with pytest.raises(ValueError, match=r"^plugin.max_sequence_length is 1001; HunyuanVideo 1.5 encodes at most 1000 "
                                         r"Qwen2.5-VL tokens per prompt \(the pipeline's tokenizer_max_length\)$"):
        adapter.encode_prompts([PLAIN], 1001)


@pytest.mark.parametrize("steps", [4, 7])
def test_sigma_grid_is_the_pipelines_and_dancegrpos_shift_5(hunyuan, steps):
    """The σ grid and timesteps equal the pipeline scheduler's after sampling, and are shift 5 on linspace(1, 0, S + 1)
    (DanceGRPO's static-shift grid); the transformer sees 1000·σ."""
    plugin = hunyuan()
    sigmas, timesteps = plugin.adapter.schedule(steps)
    pipeline = plugin.adapter.pipeline
    with torch.no_grad():
        pipeline(PLAIN, height=16, width=16, num_frames=FRAMES, num_inference_steps=steps, output_type="latent",
                 generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(sigmas, pipeline.scheduler.sigmas.float(), rtol=0, atol=0)
    torch.testing.assert_close(timesteps, pipeline.scheduler.timesteps.float(), rtol=0, atol=0)
    grid = np.linspace(1, 0, steps + 1)
    expected = torch.tensor(5 * grid / (1 + 4 * grid), dtype=torch.float32)
    torch.testing.assert_close(sigmas, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(timesteps, sigmas[:-1] * 1000, rtol=0, atol=1e-3)
    static, _ = plugin.adapter.schedule(steps, static_shift=5.0)
    torch.testing.assert_close(static, sigmas, rtol=0, atol=1e-6)


def test_num_frames_and_sizes_are_validated_against_the_adapter(hunyuan):
    prefix = "^config key 'plugin.num_frames': got "
    with pytest.raises(ConfigError, match=prefix + r"7; allowed: 1 \+ a multiple of 4 \(the hunyuan_video15 VAE's "
                                                   r"temporal compression\), e.g. 17$"):
        hunyuan(num_frames=7)
    assert hunyuan(num_frames=None).adapter.num_frames == 121  # the pipeline's default
    plugin = hunyuan(num_frames=9, height=16, width=32)
    assert plugin.adapter.noise_shape() == (4, 3, 4, 8)  # [C, (9 − 1)/4 + 1, 16/4, 32/4]
    with plugin.adapter.sized(32, 16):
        assert plugin.adapter.noise_shape() == (4, 3, 8, 4)  # height and width are not swapped anywhere
    with pytest.raises(ConfigError, match=r"^config key 'plugin.width': got 18; allowed: a multiple of 4 "):
        hunyuan(width=18)


def test_default_guidance_follows_the_pipelines_guider(hunyuan):
    """CFG on at the guider's scale 6.0 by default; a guider that leaves the conditional velocity alone (the
    step-distilled checkpoints' scale 1.0, or a disabled one) means no CFG pass; use_original_formulation moves the
    unguided scale to 0; a partial-schedule guider is refused in one line."""
    from mmrl.plugins.flow.adapters.hunyuan_video15 import HunyuanVideo15Adapter

    plugin = hunyuan()
    assert (plugin.cfg, plugin.guidance_scale) == (True, 6.0)
    pipeline = copy.copy(plugin.adapter.pipeline)  # a shallow copy: its own guider attribute, the same models
    for guider, expected in [(dict(guidance_scale=1.0), (False, 6.0, 1.0)), (dict(enabled=False), (False, 6.0, 1.0)),
                             (dict(guidance_scale=4.0, use_original_formulation=True), (True, 4.0, 0.0))]:
        pipeline.guider = plugin.adapter.pipeline.guider.new(**guider)
        adapter = HunyuanVideo15Adapter(pipeline, torch.device("cpu"))
        assert (adapter.cfg_by_default, adapter.default_guidance_scale, adapter.unguided_scale) == expected, guider
    pipeline.guider = plugin.adapter.pipeline.guider.new(start=0.2)
    with pytest.raises(ValueError, match=r"^hunyuan_video15 adapter: the pipeline's guider guides steps from 0.2 to "
                                         r"1.0 of the schedule; the plugin guides every step or none, so its start "
                                         r"must be 0 and stop 1$"):
        HunyuanVideo15Adapter(pipeline, torch.device("cpu"))


@pytest.mark.parametrize("options", [dict(guidance_scale=3.0), dict(guidance_scale=3.0, guidance_rescale=0.7),
                                     dict(guidance_scale=2.0, use_original_formulation=True)],
                         ids=["plain", "rescale", "original"])
def test_guidance_is_the_guiders_combination(hunyuan, options):
    """The adapter's combination of float32 velocities equals ClassifierFreeGuidance.forward with the same settings;
    the rescale and the original formulation move it away from the plain v_u + w·(v_c − v_u)."""
    from mmrl.plugins.flow.adapters.hunyuan_video15 import HunyuanVideo15Adapter

    plugin = hunyuan()
    pipeline = copy.copy(plugin.adapter.pipeline)
    pipeline.guider = plugin.adapter.pipeline.guider.new(**options)
    adapter = HunyuanVideo15Adapter(pipeline, torch.device("cpu"))
    uncond, cond = torch.randn(2, 3, 4, 2, 4, 4, generator=torch.Generator().manual_seed(0))  # [n, C, F, h, w] each
    pipeline.guider.set_state(step=0, num_inference_steps=4, timestep=torch.tensor(900.0))
    expected = pipeline.guider.forward(cond, uncond).pred
    scale = options["guidance_scale"]
    guided = adapter.combine_guidance(uncond, cond, scale)
    torch.testing.assert_close(guided, expected, rtol=0, atol=1e-6)
    plain = uncond + scale * (cond - uncond)
    assert float((guided - plain).abs().max()) == 0 if len(options) == 1 else float((guided - plain).abs().max()) > 1e-3


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(hunyuan, cfg):
    plugin = hunyuan(cfg=cfg, guidance_scale=3.0 if cfg else None)
    perturb_lora(plugin)
    rollout = plugin.rollout(plugin.policy(), prompt_batch([PLAIN, "a dog", QUOTED], 2)).validate()
    assert rollout.old_logp.shape == (6, 3)
    assert rollout.replay["latents"].shape == (6, 3, 4, 2, 4, 4)  # [n, A, C, F_lat, h, w]
    assert_ratio_one_for_any_split(plugin, rollout)  # other LoRA weights move the ratio: it can fail


def test_two_grpo_steps_train_the_lora_with_ratio_one(train_config, tmp_path):
    trainer = Trainer(train_config("hunyuan_video15", tmp_path, PER_FRAME, num_frames=FRAMES, max_sequence_length=32,
                                   cfg=False))  # the CFG pass trains in the ratio and recipe tests
    changed = train_two_steps(trainer, frozen_components=True)
    for target in ("attn.to_q", "attn.add_k_proj", "attn.to_add_out", "ff.net.2", "ff_context.net.0.proj"):
        assert any(key.startswith("transformer_blocks.") and f".{target}.lora_B" in key for key in changed), target
    # the refiner's blocks share the attn.to_* / ff.net.* suffixes, so the default targets reach them too (documented)
    assert any(key.startswith("context_embedder.token_refiner.") for key in changed)


def test_the_recipe_runs_a_step_on_the_tiny_pipeline(pipelines, tmp_path):
    """configs/flow/hunyuan_video15_t2v.yaml as written (DanceGRPO's SDE at eta 0.25, a random 0.6 of the steps,
    shared initial noise, the x0 prediction decoded, true CFG at 6.0, two optimizer steps per rollout), on the tiny
    pipeline at 16 px and 5 frames with the test reward per frame: the combination loads, trains at ratio 1 and
    evaluates."""
    trainer = run_recipe_step("hunyuan_video15_t2v.yaml", pipelines["hunyuan_video15"], tmp_path,
                              "plugin.dataset=null", "plugin.prompts=[a cat, a dog, a red car]",
                              "plugin.eval_prompts=[a blue house]", "plugin.resolution=16",
                              f"plugin.num_frames={FRAMES}", "plugin.num_steps=4", "plugin.eval_num_steps=3",
                              "plugin.max_sequence_length=32", PER_FRAME)
    assert (trainer.plugin.cfg, trainer.plugin.guidance_scale) == (True, 6.0)


def test_saved_adapter_loads_into_a_plain_pipelines_transformer(hunyuan, tmp_path):
    """HunyuanVideo15Pipeline has no load_lora_weights (no LoRA loader mixin); its transformer's load_lora_adapter
    reads the plugin's diffusers LoRA file, refiner targets included, and gives the policy's velocities."""
    plugin = hunyuan()
    perturb_lora(plugin, scale=0.1)
    plugin.save_trainable(plugin.policy(), tmp_path / "policy")
    rollout = plugin.rollout(plugin.policy(), prompt_batch([PLAIN, QUOTED], 1))
    pipeline = type(plugin.adapter.pipeline).from_pretrained(plugin.config.model)
    assert not hasattr(pipeline, "load_lora_weights")
    pipeline.transformer.load_lora_adapter(str(tmp_path / "policy"), prefix="transformer",
                                           weight_name="pytorch_lora_weights.safetensors")
    assert_loaded_lora_gives_the_policy_velocities(plugin, rollout, pipeline.transformer, 6.0)
