"""The Qwen-Image 2.1 adapter on a tiny ``QwenImage21Pipeline`` (Qwen3-VL text encoder and processor, block-causal
single-stream transformer, RGBA 3-D VAE with the pipeline's factor 16) built from config classes, saved and loaded back
through ``from_pretrained``: the plugin's ODE is the pipeline's own sampler (``use_kv_cache=False``), prompts are the
pipeline's encodings, the σ grid is its scheduler's, the training forward gives ratio 1 on-policy, and GRPO steps
train the LoRA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmrl.config import ConfigError
from mmrl.trainer import Trainer
from tests.flow.checks import assert_ratio_one_for_any_split, perturb_lora, run_recipe_step, train_two_steps
from tests.flow.conftest import prompt_batch

SHORT, LONG = "a cat", "a big dog"
"""Two prompts whose templates differ in length (17 and 22 tokens after the system turn)."""


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus a tiny Qwen-Image 2.1, built once per session (under a second)."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    folder = save_tiny_pipeline("qwen_image21", tmp_path_factory.mktemp("flow_qwen_image21") / "tiny-qwen_image21")
    return {**pipelines, "qwen_image21": folder}


@pytest.fixture
def plugin21(make_plugin):
    """``plugin21(**options)``: a FlowPlugin on the tiny Qwen-Image 2.1 at 32 px (one 2×2 image slot) with room for
    the test prompts' 17 to 24 text tokens."""
    def build(**options):
        return make_plugin("qwen_image21", **{"resolution": 32, "max_sequence_length": 32, **options})

    return build


def _composited(images: torch.Tensor) -> torch.Tensor:
    """The pipeline's RGBA ``output_type="pt"`` images over white, as the adapter hands them to the rewards."""
    return images[:, :3] * images[:, 3:] + (1 - images[:, 3:])


def _pipeline_images(pipeline, prompts, seeds, steps, height, width, scale=None, **options):
    """``QwenImage21Pipeline(...)`` for each prompt alone (a batch would pad the short prompts: see the adapter),
    with the uncached path the plugin computes; ``scale``: true CFG with the empty negative prompt."""
    guidance = {} if scale is None else {"true_cfg_scale": scale, "negative_prompt": ""}
    images = []
    with torch.no_grad():
        for prompt, seed in zip(prompts, seeds, strict=True):
            images.append(pipeline(prompt, height=height, width=width, num_inference_steps=steps,
                                   generator=torch.Generator().manual_seed(seed), output_type="pt",
                                   use_kv_cache=False, **guidance, **options).images)
    return torch.cat(images)


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
@pytest.mark.parametrize(("height", "width"), [(32, 32), (64, 32)], ids=["32x32", "64x32"])
def test_evaluation_is_the_qwen_image21_pipeline_ode(plugin21, cfg, height, width):
    # Prompts of different lengths in one rollout: rows are cut to their own tokens and grouped by length, so each
    # gets the pipeline's computation for it alone. A non-square size checks img_shapes (1, h, w), the packing and
    # the σ shift of h·w tokens; pixels agree to float32 rounding of differently batched matmuls.
    plugin = plugin21(cfg=cfg, eval_num_steps=3, eval_guidance_scale=3.0 if cfg else None, height=height, width=width)
    assert plugin.adapter.name == "qwen_image21"  # detected from model_index.json
    prompts = [SHORT, LONG]
    rollout = plugin.rollout(plugin.policy(), prompt_batch(prompts, 1, first_seed=5, training=False)).validate()
    assert rollout.payload["images"].shape == (2, 3, height, width)
    pipeline = plugin.adapter.pipeline
    expected = _pipeline_images(pipeline, prompts, (5, 6), 3, height, width, 3.0 if cfg else None)
    assert expected.shape == (2, 4, height, width)  # the VAE decodes RGBA
    torch.testing.assert_close(rollout.payload["images"], _composited(expected), rtol=0, atol=1e-5)
    other = _pipeline_images(pipeline, prompts, (5, 6), 3, height, width, None if cfg else 3.0)
    assert (_composited(other) - _composited(expected)).abs().max() > 1e-3  # the guidance matters: it can fail


def test_prompt_encoding_is_the_pipelines_on_the_real_tokens(plugin21):
    """Each cached row is ``encode_prompt`` of the prompt alone, zero-padded with a mask, and that is the pre-norm
    last hidden state of the templated prompt with the system turn (``_drop_idx`` tokens) dropped, computed here
    from the text encoder directly."""
    adapter = plugin21().adapter
    pipeline = adapter.pipeline
    rows = adapter.encode_prompts([SHORT, LONG], 32)
    assert rows["prompt_embeds"].shape == (2, 32, 32)
    assert torch.equal(rows["image_pad_mask"], torch.zeros(2, 32, dtype=torch.long))  # text-to-image: no slot
    tokenizer = pipeline.processor.tokenizer
    system = f"<|im_start|>system\n{pipeline.sys_prompt}<|im_end|>\n"
    drop = len(tokenizer(system).input_ids)
    assert pipeline._drop_idx == drop  # the processor's chat template gives the system turn alone
    for row, prompt in enumerate([SHORT, LONG]):
        embeds, mask, _ = pipeline.encode_prompt(prompt=[prompt], device="cpu")
        length = embeds.shape[1]
        assert mask is None  # one prompt: the pipeline drops its all-ones mask
        assert rows["prompt_embeds_mask"][row].tolist() == [1] * length + [0] * (32 - length)
        torch.testing.assert_close(rows["prompt_embeds"][row, :length], embeds[0], rtol=0, atol=0)
        assert rows["prompt_embeds"][row, length:].abs().max() == 0
        text = f"{system}<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
        ids = tokenizer(text, return_tensors="pt").input_ids
        assert ids.shape[1] == drop + length
        assert tokenizer.convert_ids_to_tokens(int(ids[0, drop])) == "<|im_start|>"  # the user turn is kept whole
        language = pipeline.text_encoder.model.language_model
        hidden = _norm_input(pipeline.text_encoder, language.norm, ids)[0]  # [drop + L, D]
        torch.testing.assert_close(rows["prompt_embeds"][row, :length], hidden[drop:], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(hidden[drop:], language.norm(hidden)[drop:], atol=1e-3)  # the norm would change it


def _norm_input(text_encoder, norm, ids):
    """The input of the text model's final norm (the last decoder layer's output) for ``ids`` ``[1, T]``."""
    captured = []
    handle = norm.register_forward_hook(lambda module, args, output: captured.append(args[0]))
    try:
        with torch.no_grad():
            text_encoder(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        handle.remove()
    return captured[0]  # [1, T, D]


def test_rows_of_different_lengths_share_a_batch_as_they_would_alone(plugin21):
    """A velocity row does not depend on its batch companions; keeping the padding instead (the pipeline's batch
    layout) moves the image after the padded text and changes the short prompt's velocity."""
    plugin = plugin21()
    perturb_lora(plugin)
    adapter, policy = plugin.adapter, plugin.policy()
    conditioning = plugin.sampler.conditioning([SHORT, LONG])
    latents = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))  # [n, (32/16)², C]
    timesteps = torch.tensor([900.0, 300.0])
    with torch.no_grad():
        both = adapter.velocity(policy, latents, timesteps, conditioning, guidance_scale=1.0)
        alone = [adapter.velocity(policy, latents[i:i + 1], timesteps[i:i + 1],
                                  {k: v[i:i + 1] for k, v in conditioning.items()}, guidance_scale=1.0)
                 for i in range(2)]
        length = int(conditioning["prompt_embeds_mask"].sum(dim=1).max())
        padded = policy(hidden_states=latents, encoder_hidden_states=conditioning["prompt_embeds"][:, :length],
                        encoder_hidden_states_mask=conditioning["prompt_embeds_mask"][:, :length].bool(),
                        timestep=timesteps / 1000, img_shapes=[[(1, 2, 2)]] * 2,
                        img_mask=torch.cat([torch.zeros(2, length, dtype=torch.bool),
                                            torch.ones(2, 1, dtype=torch.bool)], dim=1), return_dict=False)[0]
        padded = padded[:, -4:]  # [2, h·w, C]: the target image's tokens
    torch.testing.assert_close(both, torch.cat(alone), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(padded[1:], both[1:], rtol=1e-5, atol=1e-6)  # the longest row has no padding
    assert (padded[:1] - both[:1]).abs().max() > 1e-3


@pytest.mark.parametrize("configured", [None, [1.0, 0.7, 0.4, 0.2]], ids=["linspace", "sample_sigmas"])
@pytest.mark.parametrize(("height", "width"), [(32, 32), (64, 96)], ids=["32x32", "64x96"])
def test_sigma_grid_is_the_pipelines(plugin21, configured, height, width):
    """σ and the timesteps are what the pipeline's scheduler holds after sampling: its config's ``sample_sigmas``
    (whatever num_inference_steps says), else linspace(1, 1/S, S), shifted by μ of the h·w latent tokens; a number of
    steps the configured grid does not have takes the pipeline's grid for ``sigmas=linspace(1, 1/S, S)``."""
    plugin = plugin21(height=height, width=width)
    adapter, pipeline = plugin.adapter, plugin.adapter.pipeline
    pipeline.register_to_config(sample_sigmas=configured)
    try:
        with torch.no_grad():
            pipeline(SHORT, height=height, width=width, num_inference_steps=4, output_type="latent",
                     use_kv_cache=False)
        sigmas, timesteps = adapter.schedule(4)
        torch.testing.assert_close(sigmas, pipeline.scheduler.sigmas.float(), rtol=0, atol=0)
        torch.testing.assert_close(timesteps, pipeline.scheduler.timesteps.float(), rtol=0, atol=0)
        if configured:
            assert float(sigmas[1]) > 0.7  # the configured grid is shifted too (μ > 0 moves the inner σ up)
        with torch.no_grad():
            pipeline(SHORT, height=height, width=width, sigmas=np.linspace(1.0, 1 / 6, 6), output_type="latent",
                     use_kv_cache=False)
        if configured is None:
            sigmas, _ = adapter.schedule(6)
        else:
            with pytest.warns(UserWarning, match=r"sample_sigmas has 4 steps; 6 steps use linspace"):
                sigmas, _ = adapter.schedule(6)
        torch.testing.assert_close(sigmas, pipeline.scheduler.sigmas.float(), rtol=0, atol=0)
    finally:
        pipeline.register_to_config(sample_sigmas=None)


def test_without_cfg_by_default_as_the_pipeline_samples(plugin21):
    """A null ``cfg`` is off (the pipeline's true_cfg_scale 1.0) with guidance 1.0; another scale without the pass is
    refused in one line; ``cfg: true`` takes the adapter's 4.0."""
    plugin = plugin21()
    assert (plugin.cfg, plugin.guidance_scale) == (False, 1.0)
    with pytest.raises(ConfigError, match=r"^config key 'plugin.guidance_scale': got 3.0; allowed: null or 1.0 "
                                          r"with plugin.cfg false[^\n]*$"):
        plugin21(guidance_scale=3.0)
    guided = plugin21(cfg=True)
    assert (guided.cfg, guided.guidance_scale) == (True, 4.0)


def test_rgba_is_composited_over_white():
    from mmrl.plugins.flow.adapters.qwen_image21 import over_white

    images = torch.rand(2, 4, 3, 5, generator=torch.Generator().manual_seed(0))
    composited = over_white(images)
    assert composited.shape == (2, 3, 3, 5)
    torch.testing.assert_close(composited, images[:, :3] * images[:, 3:] + 1 - images[:, 3:])
    assert torch.equal(over_white(images[:, :3]), images[:, :3])
    with pytest.raises(ValueError, match=r"^Qwen-Image 2.1 adapter: the VAE decoded 2 channels; RGB \(3\) or RGBA"):
        over_white(images[:, :2])


def test_prompt_longer_than_max_sequence_length_is_refused_in_one_line(plugin21):
    plugin = plugin21(max_sequence_length=20)
    with pytest.raises(ValueError, match=r"^plugin.max_sequence_length is 20, but 'a big dog' with "
                                         r"its template is 22 text tokens: raise it$"):
        plugin.rollout(plugin.policy(), prompt_batch([LONG], 2))


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(plugin21, cfg):
    plugin = plugin21(cfg=cfg, guidance_scale=3.0 if cfg else None)
    perturb_lora(plugin)
    rollout = plugin.rollout(plugin.policy(), prompt_batch([SHORT, "a dog", LONG], 2)).validate()
    assert rollout.old_logp.shape == (6, 3)
    assert_ratio_one_for_any_split(plugin, rollout)  # other LoRA weights move the ratio: it can fail


def test_two_grpo_steps_train_the_lora_with_ratio_one(train_config, tmp_path):
    trainer = Trainer(train_config("qwen_image21", tmp_path, resolution=32, max_sequence_length=32))
    changed = train_two_steps(trainer, frozen_components=True)
    for target in ("attn.to_q", "attn.to_out.0", "img_mlp.proj", "img_mlp.gate_layer", "img_mlp.out"):
        assert any(f".{target}.lora_B" in key for key in changed), target


def test_the_recipe_runs_a_step_on_the_tiny_pipeline(pipelines, tmp_path):
    """configs/flow/qwen_image21_pickscore.yaml as written (no CFG pass, noise level 1.0, one trained SDE step drawn
    from 1-3, EMA, gradient checkpointing, two optimizer steps per rollout), on the tiny pipeline at 32 px with the
    test reward: the combination loads, trains at ratio 1 and evaluates."""
    trainer = run_recipe_step("qwen_image21_pickscore.yaml", pipelines["qwen_image21"], tmp_path,
                              "plugin.dataset=null", "plugin.prompts=[a cat, a dog, a red car]",
                              "plugin.eval_prompts=[a blue house]", "plugin.resolution=32",
                              "plugin.num_steps=4", "plugin.eval_num_steps=3",
                              "rewards.functions=[{name: test_brightness}]")
    assert (trainer.plugin.cfg, trainer.plugin.guidance_scale) == (False, 1.0)
