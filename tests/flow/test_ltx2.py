"""The LTX-2 text-to-audio-video adapter on a tiny ``LTX2Pipeline`` (a two-layer Gemma 3 on a local BPE tokenizer, the
pipeline's text connectors with learnable registers, a two-block audio-video transformer with perturbed attention (so
that STG perturbs), a one-stage causal video VAE, a mel-spectrogram audio VAE and a vocoder, every part built from its
config class with random weights), saved and loaded back through ``from_pretrained``: the plugin's ODE is the
pipeline's own sampler on both streams with all of its default guidance terms, the training forward gives ratio 1,
GRPO steps train the LoRA, the recipe runs, and unsupported settings are refused in one line."""

from __future__ import annotations

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

FRAMES = 5  # the tiny VAE compresses time by 2: 3 latent frames; 5 audio latent frames at 24 fps
TOKENS = 16  # Gemma tokens per prompt (a multiple of the connectors' 4 learnable registers)
PER_FRAME = "rewards.functions=[{name: per_frame, args: {reward: test_brightness, stride: 2}}]"
STG_BLOCKS = [1]  # the pipeline's default block 28 does not exist in the two-block tiny transformer
NO_EXTRA_GUIDANCE = {"stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0, "audio_modality_scale": 1.0,
                     "guidance_rescale": 0.0, "audio_guidance_rescale": 0.0}
"""Flow-Factory's LTX-2 training settings: no STG, no modality isolation, no rescale (one pass, or two with CFG)."""


def tiny_gemma_tokenizer():
    """A byte-fallback-free BPE ``GemmaTokenizer`` trained on a few words, with Gemma's pad/eos/bos/unk tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GemmaTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"],
                                  show_progress=False)
    tokenizer.train_from_iterator(["a cat a dog a red car a blue house the photo of a green tree small big"] * 4,
                                  trainer)
    return GemmaTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                              unk_token="<unk>", model_max_length=TOKENS)


def build_tiny_ltx2_pipeline(seed: int = 0):
    """An ``LTX2Pipeline`` with the layout of Lightricks/LTX-2 at toy sizes: video tokens of 8 channels (VAE: patch 4
    and one spatio-temporal stage, 8x spatial and 2x temporal compression) and audio tokens of 2 channels x 4 latent
    mel bins = 8 (one width: the packed latent is [n, T_v + T_a, 8]), non-trivial latent statistics for both VAEs, and
    the released scheduler's dynamic shift (base/max shift 0.95/2.05, shift_terminal 0.1)."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    tokenizer = tiny_gemma_tokenizer()
    torch.manual_seed(seed)
    text = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                            sliding_window=8, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id)
    vision = SiglipVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=1,
                                image_size=8, patch_size=4)
    text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision,
                                                               mm_tokens_per_image=4)).eval()
    connectors = LTX2TextConnectors(
        caption_channels=16, text_proj_in_factor=3,  # Gemma's width, its 2 layers + the embeddings
        video_connector_num_attention_heads=2, video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=4, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1, audio_connector_num_learnable_registers=4,
        connector_rope_base_seq_len=32)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        vae_scale_factors=(2, 8, 8), audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, caption_channels=16,
        base_height=64, base_width=64, perturbed_attn=True)
    vae = AutoencoderKLLTX2Video(
        latent_channels=8, block_out_channels=(8,), down_block_types=("LTX2VideoDownBlock3D",),
        decoder_block_out_channels=(8,), layers_per_block=(1, 1), decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False),
        downsample_type=("spatiotemporal",), upsample_type=("spatiotemporal",), upsample_residual=(True,),
        upsample_factor=(2,), patch_size=4, patch_size_t=1, scaling_factor=0.8)
    audio_vae = AutoencoderKLLTX2Audio(base_channels=8, output_channels=2, ch_mult=(1, 2), num_res_blocks=1,
                                       latent_channels=2, mel_bins=16)
    with torch.no_grad():  # latent statistics, so that un-normalising is tested
        for module in (vae, audio_vae):
            module.latents_mean.copy_(torch.randn(module.latents_mean.shape) * 0.1)
            module.latents_std.copy_(torch.rand(module.latents_std.shape) + 0.5)
    vocoder = LTX2Vocoder(in_channels=32, hidden_channels=16, out_channels=2, upsample_kernel_sizes=[4, 4],
                          upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1]],
                          output_sampling_rate=16000)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)
    return LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=text_encoder,
                        tokenizer=tokenizer, connectors=connectors, transformer=transformer, vocoder=vocoder)


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus a tiny LTX-2, built once per session."""
    folder = tmp_path_factory.mktemp("flow_ltx2") / "tiny-ltx2"
    build_tiny_ltx2_pipeline().save_pretrained(folder)
    return {**pipelines, "ltx2": folder}


@pytest.fixture
def ltx2(make_plugin):
    """``ltx2(**options)``: a FlowPlugin on the tiny LTX-2 (5 frames of 32 px, 16 text tokens), STG at block 1."""
    def build(options=None, **overrides):
        return make_plugin("ltx2", **{"num_frames": FRAMES, "max_sequence_length": TOKENS, "resolution": 32,
                                      "adapter_options": {"stg_blocks": STG_BLOCKS, **(options or {})}, **overrides})

    return build


def _pipeline(pipeline, prompts, seeds, steps, height, width, output_type, **guidance):
    """``LTX2Pipeline(...)`` on ``prompts`` with one generator per prompt: ``(video, audio)``."""
    with torch.no_grad():
        return pipeline(prompts, height=height, width=width, num_frames=FRAMES, num_inference_steps=steps,
                        max_sequence_length=TOKENS, spatio_temporal_guidance_blocks=STG_BLOCKS,
                        generator=[torch.Generator().manual_seed(seed) for seed in seeds], output_type=output_type,
                        return_dict=False, **guidance)


CASES = {
    # LTX2Pipeline.__call__'s defaults: CFG 3 (video) / 7 (audio) in x0 space, rescale 0.7, STG 1, modality 3
    "defaults": (32, 64, True, {}, {}),
    # Flow-Factory's training settings: no CFG pass and no other guidance term
    "unguided": (32, 32, False, NO_EXTRA_GUIDANCE,
                 {"guidance_scale": 1.0, "audio_guidance_scale": 1.0, "stg_scale": 0.0, "audio_stg_scale": 0.0,
                  "modality_scale": 1.0, "audio_modality_scale": 1.0, "guidance_rescale": 0.0,
                  "audio_guidance_rescale": 0.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_evaluation_is_the_ltx2_pipeline_ode(ltx2, case):
    """Same noise (one draw per sample generator covering both streams), σ grid, transformer inputs, guidance and
    decode: the plugin's evaluation videos, both final latent streams and the audio waveform equal the pipeline's to
    float32 rounding after 3 steps; 32x64: a transposed grid would not survive a non-square size."""
    height, width, cfg, options, guidance = CASES[case]
    plugin = ltx2(options, cfg=cfg, eval_num_steps=3, height=height, width=width)
    adapter = plugin.adapter
    assert adapter.name == "ltx2"  # detected from model_index.json
    perturb_lora(plugin, scale=0.1)  # the pipeline shares the transformer, LoRA included
    finals = []
    decode = adapter.decode
    adapter.decode = lambda latents: finals.append(latents) or decode(latents)
    prompts, seeds = ["a cat", "a red car"], (5, 6)
    rollout = plugin.rollout(plugin.policy(), prompt_batch(prompts, 1, first_seed=5, training=False)).validate()
    videos = rollout.payload["videos"]  # [2, 3, F, H, W]
    assert videos.shape == (2, 3, FRAMES, height, width)
    pipeline = adapter.pipeline
    frames, audio = _pipeline(pipeline, prompts, seeds, 3, height, width, "pt", **guidance)
    torch.testing.assert_close(videos, frames.permute(0, 2, 1, 3, 4), rtol=0, atol=1e-5)
    torch.testing.assert_close(adapter.decode_audio(finals[0]), audio.float(), rtol=0, atol=1e-5)
    sigmas, timesteps = adapter.schedule(3)  # the scheduler's grid after the pipeline's own call
    torch.testing.assert_close(sigmas, pipeline.scheduler.sigmas.float(), rtol=0, atol=0)
    torch.testing.assert_close(timesteps, pipeline.scheduler.timesteps.float(), rtol=0, atol=0)

    video_latents, audio_latents = _pipeline(pipeline, prompts, seeds, 3, height, width, "latent", **guidance)
    video, sound = adapter.split(finals[0])  # [2, T_v, 8], [2, T_a, 8]
    unpacked = pipeline._unpack_latents(video, *adapter.video_grid())
    vae = pipeline.vae
    unpacked = pipeline._denormalize_latents(unpacked, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    torch.testing.assert_close(unpacked, video_latents, rtol=0, atol=1e-5)
    sound = pipeline._denormalize_audio_latents(sound, pipeline.audio_vae.latents_mean, pipeline.audio_vae.latents_std)
    torch.testing.assert_close(pipeline._unpack_audio_latents(sound, 5, num_mel_bins=4), audio_latents, rtol=0,
                               atol=1e-5)
    assert float((videos[:, :, 1:] - videos[:, :, :1]).abs().max()) > 1e-2  # the frames are not one image repeated
    if case == "defaults":  # every guidance term matters, so the check can fail
        for changed in ({"modality_scale": 1.0, "audio_modality_scale": 1.0}, {"stg_scale": 0.0},
                        {"guidance_rescale": 0.0}, {"audio_guidance_scale": 3.0}):
            other, _ = _pipeline(pipeline, prompts, seeds, 3, height, width, "latent", **changed)
            assert float((other - video_latents).abs().max()) > 1e-4, changed


def test_packing_follows_the_token_widths(ltx2):
    """Equal widths: [n, T_v + T_a, C], video tokens first; other widths: a flat [n, T_v·C_v + T_a·C_a] that split
    cuts back; the noise is the pipeline's two draws from each generator."""
    adapter = ltx2().adapter
    pipeline = adapter.pipeline
    assert adapter.video_tokens() == 3 * 4 * 4 and adapter.audio_frames() == 5 and adapter.stream_widths() == (8, 8)
    assert adapter.noise_shape() == (8 * 48 + 2 * 5 * 4,)
    noise = adapter.pack(torch.randn(1, *adapter.noise_shape(), generator=torch.Generator().manual_seed(3)))
    assert noise.shape == (1, 48 + 5, 8)
    generator = torch.Generator().manual_seed(3)
    video = pipeline.prepare_latents(1, 8, 32, 32, FRAMES, dtype=torch.float32, device="cpu", generator=generator)
    audio = pipeline.prepare_audio_latents(1, 2, 5, 16, dtype=torch.float32, device="cpu", generator=generator)
    assert torch.equal(noise, torch.cat([video, audio], dim=1))
    video, audio = torch.randn(2, 48, 8), torch.randn(2, 5, 6)  # another audio width
    packed = adapter.join(video, audio)
    assert packed.shape == (2, 48 * 8 + 5 * 6)
    adapter.stream_widths = lambda: (8, 6)
    assert all(torch.equal(a, b) for a, b in zip(adapter.split(packed), (video, audio), strict=True))


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(ltx2, cfg):
    """Both streams in the log-prob, with every default guidance pass (four transformer passes a step with CFG)."""
    plugin = ltx2(cfg=cfg, num_steps=3)
    perturb_lora(plugin)
    rollout = plugin.rollout(plugin.policy(), prompt_batch(["a cat", "a dog", "a red car"], 2)).validate()
    assert rollout.old_logp.shape == (6, 2)
    assert rollout.replay["latents"].shape == (6, 2, 48 + 5, 8)  # [n, A, T_v + T_a, C]
    assert_ratio_one_for_any_split(plugin, rollout)  # other LoRA weights move the ratio: it can fail


def test_two_grpo_steps_train_the_lora_with_ratio_one(train_config, tmp_path):
    trainer = Trainer(train_config("ltx2", tmp_path, PER_FRAME, num_frames=FRAMES, max_sequence_length=TOKENS,
                                   resolution=32, num_steps=3, cfg=False,
                                   adapter_options={"stg_blocks": STG_BLOCKS}))
    changed = train_two_steps(trainer, frozen_components=True)
    for target in ("attn1.to_q", "audio_attn2.to_v", "audio_to_video_attn.to_out.0", "video_to_audio_attn.to_k",
                   "ff.net.2", "audio_ff.net.0.proj"):
        assert any(f".{target}.lora_B" in key for key in changed), target


def test_the_recipe_runs_a_step_on_the_tiny_pipeline(pipelines, tmp_path):
    """configs/flow/ltx2_t2av.yaml as written (Flow-Factory's LTX-2 settings: CPS at noise level 0.8, one of the early
    steps trained, no guidance terms), on the tiny pipeline at 32 px and 5 frames with the test reward per frame."""
    trainer = run_recipe_step("ltx2_t2av.yaml", pipelines["ltx2"], tmp_path, "plugin.dataset=null",
                              "plugin.prompts=[a cat, a dog, a red car]", "plugin.eval_prompts=[a blue house]",
                              "plugin.resolution=32", "plugin.height=null", "plugin.width=null",
                              f"plugin.num_frames={FRAMES}", "plugin.num_steps=4", "plugin.eval_num_steps=2",
                              "plugin.window_range=[0, 2]", "plugin.window_size=1",
                              f"plugin.max_sequence_length={TOKENS}", PER_FRAME)
    assert trainer.plugin.cfg is False and trainer.plugin.adapter.stg_on is False


def test_unsupported_settings_are_refused_in_one_line(ltx2, make_plugin):
    prefix = "^config key 'plugin.adapter_options': got "
    with pytest.raises(ConfigError, match=prefix + r".*allowed: keys of audio_guidance_scale, .*, frame_rate \(the "
                                                   r"ltx2 adapter's\); 'enable_prompt_enhancement' is not one$"):
        ltx2({"enable_prompt_enhancement": True})
    with pytest.raises(ConfigError, match=prefix + r".*allowed: stg_blocks: indices of the transformer's 2 blocks "
                                                   r"\(0 to 1\) while STG is on; got \[28\]$"):
        ltx2({"stg_blocks": [28]})
    assert ltx2({"stg_blocks": [28], "stg_scale": 0.0, "audio_stg_scale": 0.0}).adapter.stg_on is False
    with pytest.raises(ConfigError, match=prefix + r".*allowed: guidance_rescale: the video stream's x0-space guidance "
                                                   r"rescale phi \(in \[0, 1\]; default 0.7\); got 1.5$"):
        ltx2({"guidance_rescale": 1.5})
    with pytest.raises(ConfigError, match=prefix + r".*allowed: audio_guidance_scale: unset or 1.0 with plugin.cfg "
                                                   r"false \(the audio CFG scale needs the unconditional pass\); "
                                                   r"got 7.0$"):
        ltx2({"audio_guidance_scale": 7.0}, cfg=False)
    with pytest.raises(ConfigError, match=r"^config key 'plugin.num_frames': got 6; allowed: 1 \+ a multiple of 2 "):
        ltx2(num_frames=6)
    with pytest.raises(ConfigError, match=r"^config key 'plugin.width': got 48; allowed: a multiple of 32 "):
        ltx2(width=48)
    with pytest.raises(ConfigError, match=prefix + r"\{'x': 1\}; allowed: an empty mapping: the sd3 adapter takes "
                                                   r"no options \('x' given\)$"):
        make_plugin("sd3", adapter_options={"x": 1})


def test_saved_adapter_loads_into_a_plain_pipeline(ltx2, tmp_path):
    """The plugin's diffusers LoRA file loads with LTX2Pipeline.load_lora_weights (LTX2LoraLoaderMixin) and gives the
    policy's velocities."""
    plugin = ltx2(num_steps=3)
    perturb_lora(plugin, scale=0.1)
    plugin.save_trainable(plugin.policy(), tmp_path / "policy")
    rollout = plugin.rollout(plugin.policy(), prompt_batch(["a cat"], 2))
    pipeline = type(plugin.adapter.pipeline).from_pretrained(plugin.config.model)
    pipeline.load_lora_weights(str(tmp_path / "policy"))
    assert_loaded_lora_gives_the_policy_velocities(plugin, rollout, pipeline.transformer, 3.0)
