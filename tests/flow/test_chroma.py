"""The Chroma adapter on a tiny ``ChromaPipeline`` (T5 only, a 1+1-block Chroma transformer with its approximator,
the tiny FLUX VAE), built from config classes, saved and loaded back through ``from_pretrained``: the plugin's ODE
is the pipeline's own sampler with and without CFG, the text and its mask are the pipeline's, the σ grid is the
scheduler's as the pipeline sets it, a checkpointed training forward keeps the mask, the training forward gives
ratio 1 on-policy, GRPO steps train the LoRA, the LoRA loads with ``ChromaPipeline.load_lora_weights``, and the
recipe runs a step."""

from __future__ import annotations

import pytest
import torch

from mmrl.trainer import Trainer
from tests.flow.checks import (
    assert_loaded_lora_gives_the_policy_velocities,
    assert_ratio_one_for_any_split,
    perturb_lora,
    run_recipe_step,
    train_two_steps,
)
from tests.flow.conftest import prompt_batch

# Every prompt is padded to this many T5 tokens (the pipeline pads to max_sequence_length); the long prompt below
# has 9 real tokens, the short one 3, so their masks differ.
TEXT_TOKENS = 16
SHORT, LONG = "a cat", "a big red dog on the small house"


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus a tiny Chroma pipeline, built once per session."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    root = tmp_path_factory.mktemp("flow_chroma")
    return {**pipelines, "chroma": save_tiny_pipeline("chroma", root / "tiny-chroma")}


def _pipeline_images(pipeline, prompts, seeds, *, height, width, scale, negative_prompt=None, steps=4):
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    with torch.no_grad():
        return pipeline(prompt=prompts, negative_prompt=negative_prompt, height=height, width=width,
                        num_inference_steps=steps, guidance_scale=scale, generator=generators, output_type="pt",
                        max_sequence_length=TEXT_TOKENS).images


@pytest.mark.parametrize(("cfg", "negative"), [(True, ""), (True, "a blurry photo"), (False, None)],
                         ids=["cfg", "cfg-negative", "nocfg"])
@pytest.mark.parametrize(("height", "width"), [(16, 16), (16, 32)], ids=["16x16", "16x32"])
def test_evaluation_is_the_chroma_pipeline_ode(make_plugin, cfg, negative, height, width):
    # One batch holds prompts of different lengths (different text masks). The pipeline makes two calls and combines
    # them in the model's dtype, the plugin one [uncond; cond] call combined in float32: rounding only.
    options = {"cfg": cfg, **({"eval_guidance_scale": 3.0, "negative_prompt": negative} if cfg else {})}
    plugin = make_plugin("chroma", eval_num_steps=4, max_sequence_length=TEXT_TOKENS, height=height, width=width,
                         **options)
    assert plugin.adapter.name == "chroma"  # adapter: auto, from model_index.json's ChromaPipeline
    prompts = [SHORT, LONG]
    rollout = plugin.rollout(plugin.policy(), prompt_batch(prompts, 1, first_seed=5, training=False)).validate()
    assert rollout.payload["images"].shape == (2, 3, height, width)
    pipeline = plugin.adapter.pipeline
    expected = _pipeline_images(pipeline, prompts, (5, 6), height=height, width=width, scale=3.0 if cfg else 1.0,
                                negative_prompt=negative or None)
    torch.testing.assert_close(rollout.payload["images"], expected, rtol=0, atol=1e-5)
    # guidance changes the images, so the check can fail
    other = _pipeline_images(pipeline, prompts, (5, 6), height=height, width=width, scale=1.0 if cfg else 3.0)
    assert (rollout.payload["images"] - other).abs().max() > 1e-3


@pytest.mark.parametrize(("height", "width"), [(16, 16), (16, 32)], ids=["16x16", "16x32"])
def test_a_boolean_text_mask_is_the_pipeline_given_boolean_masks(make_plugin, height, width):
    """adapter_options text_mask: boolean equals ChromaPipeline handed the same prompts' embeddings with boolean
    masks (padding after the first pad token removed from attention, as the Chroma authors' trainer masks it), with
    CFG; and differs from the plain pipeline's images (its float mask is a bias), so the check can fail."""
    plugin = make_plugin("chroma", eval_num_steps=4, max_sequence_length=TEXT_TOKENS, height=height, width=width,
                         eval_guidance_scale=3.0, adapter_options={"text_mask": "boolean"})
    prompts = [SHORT, LONG]
    rollout = plugin.rollout(plugin.policy(), prompt_batch(prompts, 1, first_seed=5, training=False))
    pipeline = plugin.adapter.pipeline

    def boolean_pipeline(text_tokens: int):
        embeds, _, mask, negative, _, negative_mask = pipeline.encode_prompt(
            prompt=prompts, max_sequence_length=text_tokens, do_classifier_free_guidance=True)
        generators = [torch.Generator().manual_seed(seed) for seed in (5, 6)]
        with torch.no_grad():
            return pipeline(prompt_embeds=embeds, prompt_attention_mask=mask.bool(), negative_prompt_embeds=negative,
                            negative_prompt_attention_mask=negative_mask.bool(), height=height, width=width,
                            num_inference_steps=4, guidance_scale=3.0, generator=generators,
                            output_type="pt").images

    torch.testing.assert_close(rollout.payload["images"], boolean_pipeline(TEXT_TOKENS), rtol=0, atol=1e-5)
    # with padding removed from attention the padded length no longer matters (docs/flow.md, Chroma)
    torch.testing.assert_close(rollout.payload["images"], boolean_pipeline(2 * TEXT_TOKENS), rtol=0, atol=1e-5)
    plain = _pipeline_images(pipeline, prompts, (5, 6), height=height, width=width, scale=3.0)
    assert (rollout.payload["images"] - plain).abs().max() > 1e-3


def test_prompts_are_t5_with_the_mask_and_one_padding_token(make_plugin):
    """The cached rows against T5 run here with the tokenizer's mask, and the transformer's text mask against
    ChromaPipeline's rule written out: the real tokens (EOS included) and the first padding token."""
    adapter = make_plugin("chroma", max_sequence_length=TEXT_TOKENS).adapter
    rows = adapter.encode_prompts([SHORT, LONG], TEXT_TOKENS)
    tokenizer, encoder = adapter.pipeline.tokenizer, adapter.pipeline.text_encoder
    ids = tokenizer([SHORT, LONG], padding="max_length", max_length=TEXT_TOKENS, truncation=True,
                    return_tensors="pt")
    real = ids.attention_mask.sum(dim=1)  # [2]
    assert real.tolist() == [3, 9]
    with torch.no_grad():
        hidden = encoder(ids.input_ids, attention_mask=ids.attention_mask)[0]  # [2, L, 32]
    torch.testing.assert_close(rows["prompt_embeds"], hidden, rtol=0, atol=0)
    expected_mask = torch.zeros(2, TEXT_TOKENS)
    expected_mask[0, :4], expected_mask[1, :10] = 1, 1
    torch.testing.assert_close(rows["prompt_attention_mask"], expected_mask, rtol=0, atol=0)
    # a row does not depend on the prompts encoded with it (every prompt is padded to the same length)
    alone = adapter.encode_prompts([SHORT], TEXT_TOKENS)
    for key in ("prompt_embeds", "prompt_attention_mask"):
        torch.testing.assert_close(alone[key][0], rows[key][0], rtol=0, atol=0)


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic-shift", "static-shift"])
def test_the_sigma_grid_is_the_pipelines(make_plugin, dynamic):
    """σ and the timesteps at 16×32 as ChromaPipeline sets them on its scheduler (recorded from a pipeline call),
    for the dynamically shifted config (μ from the image tokens) and a static shift-3 one (μ ignored)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    plugin = make_plugin("chroma", height=16, width=32, max_sequence_length=TEXT_TOKENS)
    pipeline = plugin.adapter.pipeline
    if not dynamic:
        pipeline.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
        plugin.adapter.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipeline.scheduler.config)
        plugin.adapter._schedules.clear()
    seen = []
    pipeline(prompt=SHORT, height=16, width=32, num_inference_steps=4, guidance_scale=1.0, output_type="latent",
             max_sequence_length=TEXT_TOKENS, callback_on_step_end=lambda p, i, t, kw: seen.append(float(t)) or {})
    sigmas, timesteps = plugin.adapter.schedule(4)
    torch.testing.assert_close(sigmas, pipeline.scheduler.sigmas.float(), rtol=0, atol=0)
    torch.testing.assert_close(timesteps, torch.tensor(seen), rtol=0, atol=0)


def test_a_checkpointed_training_forward_keeps_the_text_mask(make_plugin, monkeypatch):
    """ChromaTransformer2DModel drops the mask of its single-stream blocks when it checkpoints them (diffusers
    0.42.1 transformer_chroma.py:589); the adapter puts it back, so the velocity with gradients and checkpointing on
    is the rollout's. Without the adapter's fix the two differ: the check can fail."""
    from contextlib import nullcontext

    from mmrl.plugins.flow.adapters.chroma import ChromaAdapter

    plugin = make_plugin("chroma", max_sequence_length=TEXT_TOKENS, gradient_checkpointing=True)
    perturb_lora(plugin, scale=0.1)
    rollout = plugin.rollout(plugin.policy(), prompt_batch([SHORT, LONG], 1))
    replay, adapter = rollout.replay, plugin.adapter
    latents, timesteps = replay["latents"][:, 1], replay["timesteps"][:, 1]
    negative = adapter.encode_prompts([""], TEXT_TOKENS)

    def velocity(grad: bool):
        with torch.set_grad_enabled(grad):
            return adapter.velocity(plugin.policy(), latents, timesteps, replay["conditioning"], guidance_scale=3.0,
                                    negative=negative).detach()

    assert plugin.policy().gradient_checkpointing
    torch.testing.assert_close(velocity(True), velocity(False), rtol=0, atol=1e-6)
    monkeypatch.setattr(ChromaAdapter, "_masked_checkpointing", staticmethod(lambda module, mask: nullcontext()))
    assert (velocity(True) - velocity(False)).abs().max() > 1e-4


def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(make_plugin):
    plugin = make_plugin("chroma", max_sequence_length=TEXT_TOKENS, guidance_scale=3.0)
    assert plugin.cfg
    perturb_lora(plugin)
    rollout = plugin.rollout(plugin.policy(), prompt_batch([SHORT, LONG, "a red car"], 2)).validate()
    assert rollout.old_logp.shape == (6, 3)
    assert_ratio_one_for_any_split(plugin, rollout)  # other LoRA weights move the ratio: it can fail


def test_two_grpo_steps_train_the_lora_and_it_loads_with_load_lora_weights(train_config, tmp_path):
    trainer = Trainer(train_config("chroma", tmp_path, max_sequence_length=TEXT_TOKENS, guidance_scale=2.0,
                                   gradient_checkpointing=True))
    assert trainer.plugin.cfg
    changed = train_two_steps(trainer, frozen_components=True)
    assert any("single_transformer_blocks.0.attn.to_q.lora_B" in key for key in changed)
    assert any("transformer_blocks.0.ff_context.net.2.lora_B" in key for key in changed)
    assert not any("distilled_guidance_layer" in key for key in changed)  # the approximator stays frozen
    plugin = trainer.plugin
    rollout = plugin.rollout(plugin.policy(), prompt_batch([SHORT, LONG], 1))
    pipeline = type(plugin.adapter.pipeline).from_pretrained(plugin.config.model)
    pipeline.load_lora_weights(str(tmp_path / "checkpoints" / "step-00000002" / "policy"))
    assert_loaded_lora_gives_the_policy_velocities(plugin, rollout, pipeline.transformer, 2.0)


def test_auto_detection_and_refusals(make_plugin, pipelines):
    from diffusers import ChromaPipeline

    from mmrl.config import ConfigError
    from mmrl.plugins.flow.adapters import adapter_for_pipeline
    from mmrl.plugins.flow.adapters.chroma import ChromaAdapter

    assert adapter_for_pipeline("ChromaPipeline", "m") is ChromaAdapter
    plugin = make_plugin("chroma", max_sequence_length=TEXT_TOKENS)
    assert (plugin.cfg, plugin.guidance_scale) == (True, 5.0)  # the pipeline's default, with the CFG pass
    with pytest.raises(ConfigError, match=r"^config key 'plugin.guidance_scale': got 4.0; allowed: null or 1.0 "
                                          r"with plugin.cfg false[^\n]*$"):
        make_plugin("chroma", cfg=False, guidance_scale=4.0)  # guided only by the pass: refused, not ignored
    with pytest.raises(ConfigError, match=r"^config key 'plugin.adapter_options'[^\n]*allowed: keys of text_mask "
                                          r"\(the chroma adapter's\); 'mask' is not one$"):
        make_plugin("chroma", adapter_options={"mask": "boolean"})
    with pytest.raises(ConfigError, match=r"^config key 'plugin.adapter_options'[^\n]*allowed: text_mask: 'pipeline' "
                                          r"[^\n]*got 'bool'$"):
        make_plugin("chroma", adapter_options={"text_mask": "bool"})
    with pytest.raises(ValueError, match=r"^plugin.max_sequence_length is 513; ChromaPipeline takes 1 to 512 T5 "
                                         r"tokens$"):
        plugin.adapter.encode_prompts([SHORT], 513)
    fresh = ChromaAdapter(ChromaPipeline.from_pretrained(str(pipelines["chroma"])), torch.device("cpu"))
    fresh.set_size(16, 16)
    with pytest.raises(RuntimeError, match="^chroma adapter: no prompt encoded yet"):
        fresh.call_transformer(fresh.transformer, torch.zeros(1, 16, 16), torch.zeros(1),
                               {"prompt_embeds": torch.zeros(1, 4, 32), "prompt_attention_mask": torch.ones(1, 4)}, 1.0)


def test_another_pipeline_is_refused_in_one_line(make_plugin, pipelines):
    """``adapter: chroma`` names the pipeline class it reproduces: on a FLUX.1 checkpoint (the model Chroma derives
    from, a likely mix-up) it is refused in one line when the adapter is built, as the Sana and LongCat-Image adapters
    refuse theirs, not with a TypeError from deep inside ``FluxPipeline.encode_prompt`` at the first prompt; the
    line names the adapter that drives the class found. The reverse (``adapter: flux`` on a Chroma checkpoint) is in
    tests/flow/test_pipeline_refusals.py."""
    from diffusers import FluxPipeline

    from mmrl.plugins.flow.adapters.chroma import ChromaAdapter

    refused = r"^the chroma adapter drives ChromaPipeline, not FluxPipeline: set plugin.adapter: flux \(or auto\)$"
    with pytest.raises(ValueError, match=refused):
        ChromaAdapter(FluxPipeline.from_pretrained(str(pipelines["flux"])), torch.device("cpu"))
    with pytest.raises(ValueError, match=refused):
        make_plugin("flux", adapter="chroma", max_sequence_length=TEXT_TOKENS)


def test_the_recipe_runs_a_step_on_the_tiny_pipeline(pipelines, tmp_path):
    """configs/flow/chroma_pickscore.yaml as written (true CFG at 5.0, one trained SDE step drawn from steps 1-3,
    EMA, gradient checkpointing, two optimizer steps per rollout), on the tiny pipeline at 16 px with the test
    reward: the combination loads, trains at ratio 1 (through the checkpointed blocks) and evaluates."""
    trainer = run_recipe_step("chroma_pickscore.yaml", pipelines["chroma"], tmp_path,
                              "plugin.dataset=null", "plugin.prompts=[a cat, a dog, a red car]",
                              "plugin.eval_prompts=[a blue house]", "plugin.resolution=16",
                              "plugin.eval_num_steps=3", f"plugin.max_sequence_length={TEXT_TOKENS}",
                              "rewards.functions=[{name: test_brightness}]")
    assert (trainer.plugin.cfg, trainer.plugin.guidance_scale) == (True, 5.0)
    assert trainer.plugin.policy().gradient_checkpointing
