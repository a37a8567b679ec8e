"""The Sana adapter on a tiny ``SanaPipeline`` (a two-layer Gemma-2 on a local BPE tokenizer trained on the pipeline's
complex human instruction, a two-block Sana DiT with a non-unit timestep scale, a two-stage DC-AE, Sana 1.0's flow
DPM-Solver++ scheduler) built from config classes, saved and loaded back through ``from_pretrained``: the plugin's ODE
is the pipeline's sampler with the Euler flow scheduler swapped in, prompts and the negative prompt are the
pipeline's encodings (the negative prompt's through the adapter's negative-prompt hook, which the sampler uses), the
training forward gives ratio 1, GRPO steps train the LoRA, the exported LoRA loads with
``SanaPipeline.load_lora_weights``, the recipe runs, ``adapter_options.clean_caption`` is the pipeline's caption
cleaning, and Sana-Sprint is refused in one line."""

from __future__ import annotations

import json

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

TOKENS = 16  # max_sequence_length: the selection keeps BOS and the last 15 positions of instruction + prompt
SHORT, LONG = "A Cat", "a big red dog on the house with a small green tree and a blue car"


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus a tiny Sana, built once per session."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    folder = save_tiny_pipeline("sana", tmp_path_factory.mktemp("flow_sana") / "tiny-sana")
    return {**pipelines, "sana": folder}


@pytest.fixture
def sana(make_plugin):
    """``sana(**options)``: a FlowPlugin on the tiny Sana at 32 px with 16 text tokens."""
    def build(**overrides):
        return make_plugin("sana", **{"resolution": 32, "max_sequence_length": TOKENS, **overrides})

    return build


def _euler_pipeline(plugin):
    """The plugin's Sana folder as a fresh ``SanaPipeline`` with the Euler flow scheduler of the checkpoint's shift
    (the tiny folder ships Sana 1.0's DPM-Solver++ with flow_shift 3)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaPipeline

    pipeline = SanaPipeline.from_pretrained(plugin.config.model)
    assert type(pipeline.scheduler).__name__ == "DPMSolverMultistepScheduler"
    pipeline.scheduler = FlowMatchEulerDiscreteScheduler(shift=float(pipeline.scheduler.config.flow_shift))
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def _pipeline_images(pipeline, prompts, seeds, steps, scale, height, width):
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    with torch.no_grad():
        return pipeline(prompts, height=height, width=width, num_inference_steps=steps, guidance_scale=scale,
                        generator=generators, output_type="pt", use_resolution_binning=False,
                        max_sequence_length=TOKENS).images


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
@pytest.mark.parametrize(("height", "width"), [(32, 32), (64, 32)], ids=["32x32", "64x32"])
def test_evaluation_is_the_sana_pipeline_ode(sana, cfg, height, width):
    # Prompts of different lengths in one batch (the pipeline pads all to the instruction + 14 tokens and selects
    # 16), the empty negative prompt encoded the pipeline's other way (no instruction), CFG in one [uncond; cond]
    # call, the timestep scaled by the transformer's timestep_scale (0.5 here), the DC-AE decode. A non-square size
    # checks the latent shape and the DiT's patch grid.
    plugin = sana(cfg=cfg, eval_num_steps=4, eval_guidance_scale=3.0 if cfg else None, height=height, width=width)
    assert plugin.adapter.name == "sana"  # adapter: auto, from model_index.json's SanaPipeline
    prompts = [SHORT, LONG]
    rollout = plugin.rollout(plugin.policy(), prompt_batch(prompts, 1, first_seed=5, training=False)).validate()
    assert rollout.payload["images"].shape == (2, 3, height, width)
    pipeline = _euler_pipeline(plugin)
    expected = _pipeline_images(pipeline, prompts, (5, 6), 4, 3.0 if cfg else 1.0, height, width)
    torch.testing.assert_close(rollout.payload["images"], expected, rtol=0, atol=1e-5)
    other = _pipeline_images(pipeline, prompts, (5, 6), 4, 1.0 if cfg else 3.0, height, width)
    assert (rollout.payload["images"] - other).abs().max() > 1e-3  # guidance changes the images: the check can fail


def test_prompt_rows_are_the_pipelines_encodings_whatever_their_batch(sana):
    """Each row against the tokenizer and text encoder run here: the instruction in front, padded to the
    instruction's tokens + L − 2, BOS and the last L − 1 positions kept with their mask, and nothing else stored; the
    negative-prompt hook's form padded to L without the instruction. A row does not depend on the prompts encoded
    with it, and the prompt is lowercased as the pipeline's preprocessing does."""
    from mmrl.plugins.flow.adapters.sana import default_complex_human_instruction

    adapter = sana().adapter
    pipeline = adapter.pipeline
    tokenizer, encoder = pipeline.tokenizer, pipeline.text_encoder
    instruction = "\n".join(default_complex_human_instruction(pipeline))
    together = adapter.encode_prompts([SHORT, LONG], TOKENS)
    alone = adapter.encode_prompts([SHORT.lower()], TOKENS)
    with torch.no_grad():
        length = len(tokenizer.encode(instruction)) + TOKENS - 2
        ids = tokenizer([instruction + SHORT.lower()], padding="max_length", max_length=length, truncation=True,
                        return_tensors="pt")
        hidden = encoder(ids.input_ids, attention_mask=ids.attention_mask)[0]  # [1, length, D]
        keep = [0, *range(length - TOKENS + 1, length)]
        plain = tokenizer([SHORT.lower()], padding="max_length", max_length=TOKENS, truncation=True,
                          return_tensors="pt")
        plain_hidden = encoder(plain.input_ids, attention_mask=plain.attention_mask)[0]  # [1, L, D]
    assert together["prompt_embeds"].shape == (2, TOKENS, 16)
    torch.testing.assert_close(together["prompt_embeds"][:1], hidden[:, keep], rtol=0, atol=1e-6)
    assert torch.equal(together["prompt_attention_mask"][:1], ids.attention_mask[:, keep])
    real = int(ids.attention_mask.sum())
    assert 0 < int(together["prompt_attention_mask"][0].sum()) < TOKENS  # the short prompt's window has padding
    assert real > TOKENS  # the instruction fills the front: the selection cuts into it
    assert set(together) == {"prompt_embeds", "prompt_attention_mask"}  # the prompt form only
    as_negative = adapter.encode_negative_prompt(SHORT.lower(), TOKENS)
    assert set(as_negative) == set(together) and as_negative["prompt_embeds"].shape == (1, TOKENS, 16)
    torch.testing.assert_close(as_negative["prompt_embeds"], plain_hidden, rtol=0, atol=1e-6)
    assert torch.equal(as_negative["prompt_attention_mask"], plain.attention_mask)
    for key, value in alone.items():
        torch.testing.assert_close(together[key][:1], value, rtol=0, atol=1e-6)
    assert int(together["prompt_attention_mask"][1].sum()) == TOKENS  # the long prompt fills its window


def test_rows_of_different_lengths_share_a_batch_as_they_would_alone(sana):
    plugin = sana(guidance_scale=4.0)
    perturb_lora(plugin, scale=0.1)
    adapter, policy = plugin.adapter, plugin.policy()
    conditioning = plugin.sampler.conditioning([SHORT, LONG])
    negative = plugin.sampler.negative_conditioning()
    latents = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(1))  # [n, C, h, w]
    timesteps = torch.tensor([900.0, 300.0])
    with torch.no_grad():
        both = adapter.velocity(policy, latents, timesteps, conditioning, guidance_scale=4.0, negative=negative)
        first = adapter.velocity(policy, latents[:1], timesteps[:1], {k: v[:1] for k, v in conditioning.items()},
                                 guidance_scale=4.0, negative=negative)
    torch.testing.assert_close(both[:1], first, rtol=1e-5, atol=1e-5)


def test_the_sampler_encodes_the_negative_prompt_with_the_hook_and_stores_one_form(sana):
    """With CFG every phase (training rollout, training forward, evaluation) takes the negative prompt from the
    adapter's ``encode_negative_prompt``, once, as the pipeline encodes a negative prompt (Gemma-2 run here by hand on
    the prompt padded to L, no instruction): a sampler that encoded it with ``encode_prompts`` (the instruction
    form, 0.3 away on this model) fails. A rollout stores one form per sample: the prompt's ``[n, L, D]`` embeddings
    and ``[n, L]`` mask, the rows ``encode_prompts`` gives."""
    plugin = sana(negative_prompt="A Blurry Dog")
    adapter, sampler = plugin.adapter, plugin.sampler
    calls = {"hook": [], "prompts": []}
    hook, encode = adapter.encode_negative_prompt, adapter.encode_prompts

    def spy_hook(prompt, max_sequence_length):
        calls["hook"].append((prompt, max_sequence_length))
        return hook(prompt, max_sequence_length)

    def spy_encode(prompts, max_sequence_length):
        calls["prompts"].extend(prompts)
        return encode(prompts, max_sequence_length)

    adapter.encode_negative_prompt, adapter.encode_prompts = spy_hook, spy_encode
    sampler._negative = None  # encode it afresh through the spies
    policy = plugin.policy()
    rollout = plugin.rollout(policy, prompt_batch([SHORT, LONG], 2)).validate()
    plugin.forward(policy, rollout, need_reference=False)
    plugin.rollout(policy, prompt_batch([SHORT], 1, training=False)).validate()
    assert calls["hook"] == [("A Blurry Dog", TOKENS)]  # once, then kept for every phase
    assert "A Blurry Dog" not in calls["prompts"]

    stored = rollout.replay["conditioning"]
    assert set(stored) == {"prompt_embeds", "prompt_attention_mask"}
    assert stored["prompt_embeds"].shape == (4, TOKENS, 16) and stored["prompt_attention_mask"].shape == (4, TOKENS)
    rows = encode([SHORT, LONG], TOKENS)
    for key, value in rows.items():
        torch.testing.assert_close(stored[key], value.repeat_interleave(2, dim=0).to(stored[key].dtype),
                                   rtol=0, atol=0)

    pipeline = adapter.pipeline
    with torch.no_grad():
        plain = pipeline.tokenizer(["a blurry dog"], padding="max_length", max_length=TOKENS, truncation=True,
                                   return_tensors="pt")  # the pipeline's preprocessing lowercases it
        hidden = pipeline.text_encoder(plain.input_ids, attention_mask=plain.attention_mask)[0]  # [1, L, D]
    negative = sampler.negative_conditioning()
    assert set(negative) == set(stored)
    torch.testing.assert_close(negative["prompt_embeds"], hidden, rtol=0, atol=1e-6)
    assert torch.equal(negative["prompt_attention_mask"], plain.attention_mask)
    as_prompt = encode(["A Blurry Dog"], TOKENS)["prompt_embeds"]
    assert (negative["prompt_embeds"] - as_prompt).abs().max() > 1e-2  # the two forms differ: the check can fail


def test_the_euler_grid_has_the_checkpoints_shift(sana, pipelines, tmp_path):
    """σ of the shipped DPM-Solver's flow_shift s on the Euler scheduler's spacing, written out: t = linspace(1,
    shift(1/1000), S) (the Euler scheduler spaces between its shifted training σ's ends), σ = shift(t), then 0, with
    shift(t) = s·t/(1 + (s − 1)·t); timesteps σ·1000. A checkpoint shipping the Euler scheduler gives its own grid,
    and one the pipeline could not run (dynamic shifting without μ, a non-flow solver) is refused."""
    from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler, SanaPipeline

    from mmrl.plugins.flow.adapters.sana import SanaAdapter

    adapter = sana().adapter
    sigmas, timesteps = adapter.schedule(10)
    def shift(t, s):
        return s * t / (1 + (s - 1) * t)

    t = torch.linspace(1, shift(1e-3, 3.0), 10, dtype=torch.float64)
    expected = torch.cat([shift(t, 3.0), torch.zeros(1, dtype=torch.float64)]).float()
    torch.testing.assert_close(sigmas, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(timesteps, expected[:-1] * 1000, rtol=0, atol=1e-3)
    pipeline = SanaPipeline.from_pretrained(pipelines["sana"])
    pipeline.scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    euler = SanaAdapter(pipeline, torch.device("cpu"))
    euler.set_size(32, 32)
    sigmas, _ = euler.schedule(10)
    t = torch.linspace(1, shift(1e-3, 5.0), 10, dtype=torch.float64)
    torch.testing.assert_close(sigmas[:-1], shift(t, 5.0).float(), rtol=0, atol=1e-6)
    pipeline.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    with pytest.raises(ValueError, match=r"^sana adapter: the checkpoint's FlowMatchEulerDiscreteScheduler sets "
                                         r"use_dynamic_shifting[^\n]*$"):
        SanaAdapter(pipeline, torch.device("cpu"))
    pipeline.scheduler = DDIMScheduler()
    with pytest.raises(ValueError, match=r"^sana adapter: DDIMScheduler is not a flow scheduler [^\n]*$"):
        SanaAdapter(pipeline, torch.device("cpu"))


def test_complex_human_instruction_option(sana):
    """``adapter_options.complex_human_instruction: []`` encodes prompts without the instruction (then a prompt's
    encoding is its negative-prompt form); another value than a list of strings is refused in one line."""
    adapter = sana(adapter_options={"complex_human_instruction": []}).adapter
    plain = adapter.encode_prompts([SHORT], TOKENS)
    as_negative = adapter.encode_negative_prompt(SHORT, TOKENS)
    torch.testing.assert_close(plain["prompt_embeds"], as_negative["prompt_embeds"], rtol=0, atol=0)
    assert torch.equal(plain["prompt_attention_mask"], as_negative["prompt_attention_mask"])
    instructed = sana().adapter.encode_prompts([SHORT], TOKENS)
    assert (instructed["prompt_embeds"] - plain["prompt_embeds"]).abs().max() > 1e-3
    with pytest.raises(ConfigError, match=r"^config key 'plugin.adapter_options': [^\n]*complex_human_instruction"
                                          r": a list of strings \(\[\] for none\); got 'describe'$"):
        sana(adapter_options={"complex_human_instruction": "describe"})
    with pytest.raises(ConfigError, match=r"^config key 'plugin.adapter_options': [^\n]*allowed: keys of "
                                          r"complex_human_instruction, clean_caption \(the sana adapter's\); "
                                          r"'clean_captions' is not one$"):
        sana(adapter_options={"clean_captions": True})


# A prompt and a negative prompt that SanaPipeline's caption cleaning changes: an HTML tag and entity, a URL, an
# escaped space and a run of bad punctuation (its _clean_caption removes or replaces each)
DIRTY, DIRTY_NEGATIVE = "A <b>Cat</b> &amp; a dog at https://example.com/x%20y", "blurry ### [ugly] <i>photo</i>"


def test_clean_caption_is_the_pipelines_caption_cleaning(sana):
    """``adapter_options: {clean_caption: true}`` samples what ``SanaPipeline(..., clean_caption=True)`` samples (the
    pipeline's own cleaning of the prompts and of the negative prompt, run by its ``encode_prompt``); the check can
    fail: the same prompts uncleaned give other images."""
    pytest.importorskip("bs4", reason="SanaPipeline's caption cleaning needs beautifulsoup4")
    pytest.importorskip("ftfy", reason="SanaPipeline's caption cleaning needs ftfy")
    plugin = sana(adapter_options={"clean_caption": True}, negative_prompt=DIRTY_NEGATIVE, eval_num_steps=3,
                  eval_guidance_scale=3.0)
    prompts = [DIRTY, LONG]
    pipeline = _euler_pipeline(plugin)
    assert pipeline._text_preprocessing([DIRTY], clean_caption=True) != [DIRTY.lower()]  # cleaning changes it
    rollout = plugin.rollout(plugin.policy(), prompt_batch(prompts, 1, first_seed=5, training=False)).validate()
    generators = [torch.Generator().manual_seed(seed) for seed in (5, 6)]
    with torch.no_grad():
        expected = pipeline(prompts, negative_prompt=DIRTY_NEGATIVE, height=32, width=32, num_inference_steps=3,
                            guidance_scale=3.0, generator=generators, output_type="pt", use_resolution_binning=False,
                            max_sequence_length=TOKENS, clean_caption=True).images
    torch.testing.assert_close(rollout.payload["images"], expected, rtol=0, atol=1e-5)
    uncleaned = sana(negative_prompt=DIRTY_NEGATIVE, eval_num_steps=3, eval_guidance_scale=3.0)
    other = uncleaned.rollout(uncleaned.policy(), prompt_batch(prompts, 1, first_seed=5, training=False))
    assert (rollout.payload["images"] - other.payload["images"]).abs().max() > 1e-3
    # the negative prompt is cleaned too (SanaPipeline.encode_prompt passes clean_caption to its negative path)
    cleaned = plugin.adapter.encode_negative_prompt(DIRTY_NEGATIVE, TOKENS)["prompt_embeds"]
    raw = uncleaned.adapter.encode_negative_prompt(DIRTY_NEGATIVE, TOKENS)["prompt_embeds"]
    assert (cleaned - raw).abs().max() > 1e-3


def test_clean_caption_without_its_packages_or_not_a_bool_is_refused(sana, monkeypatch):
    """Where beautifulsoup4 or ftfy is missing SanaPipeline warns and encodes the prompt uncleaned; the adapter refuses
    ``clean_caption: true`` in one line naming what is missing (false stays allowed), and a non-boolean value."""
    from mmrl.plugins.flow.adapters import sana as sana_module

    with pytest.raises(ConfigError, match=r"^config key 'plugin.adapter_options': [^\n]*clean_caption: true or "
                                          r"false \(SanaPipeline's caption cleaning\); got 'yes'$"):
        sana(adapter_options={"clean_caption": "yes"})
    monkeypatch.setattr(sana_module, "caption_cleaning_packages", lambda: {"beautifulsoup4": False, "ftfy": True})
    with pytest.raises(ConfigError, match=r"^config key 'plugin.adapter_options': [^\n]*beautifulsoup4 missing: "
                                          r"pip install beautifulsoup4$"):
        sana(adapter_options={"clean_caption": True})
    assert sana(adapter_options={"clean_caption": False}).adapter.clean_caption is False


def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(sana):
    plugin = sana(guidance_scale=4.5)
    perturb_lora(plugin, scale=0.1)
    rollout = plugin.rollout(plugin.policy(), prompt_batch([SHORT, LONG, "a dog"], 2)).validate()
    assert rollout.old_logp.shape == (6, 3)
    assert_ratio_one_for_any_split(plugin, rollout)  # other LoRA weights move the ratio: it can fail


def test_two_grpo_steps_train_the_lora_with_ratio_one(train_config, tmp_path):
    trainer = Trainer(train_config("sana", tmp_path, resolution=32, max_sequence_length=TOKENS))
    assert trainer.plugin.cfg and trainer.plugin.guidance_scale == 4.5  # SanaPipeline's defaults
    changed = train_two_steps(trainer, frozen_components=True)
    assert any(".attn1.to_q.lora_B" in key for key in changed) and any(".attn2.to_v.lora_B" in key for key in changed)


def test_exported_lora_loads_with_load_lora_weights(sana, tmp_path):
    from diffusers import SanaPipeline

    plugin = sana()
    perturb_lora(plugin, scale=0.1)
    plugin.save_trainable(plugin.policy(), tmp_path / "policy")
    rollout = plugin.rollout(plugin.policy(), prompt_batch([SHORT, LONG], 1))
    pipeline = SanaPipeline.from_pretrained(plugin.config.model)
    pipeline.load_lora_weights(str(tmp_path / "policy"))
    assert_loaded_lora_gives_the_policy_velocities(plugin, rollout, pipeline.transformer, 4.5)


def test_sana_sprint_and_bad_sizes_are_refused_in_one_line(sana, pipelines, tmp_path):
    from diffusers import SanaPipeline, SanaSprintPipeline

    from mmrl.plugins.flow.adapters.sana import SanaAdapter

    components = SanaPipeline.from_pretrained(pipelines["sana"]).components
    sprint = SanaSprintPipeline(**components)
    with pytest.raises(ValueError, match=r"^the sana adapter does not train Sana-Sprint \(SanaSprintPipeline\)[^\n]*$"):
        SanaAdapter(sprint, torch.device("cpu"))
    folder = tmp_path / "sprint"
    sprint.save_pretrained(folder)
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "SanaSprintPipeline"
    with pytest.raises(ValueError, match=r"^no flow adapter handles pipeline class 'SanaSprintPipeline'[^\n]*$"):
        sana(model=str(folder))  # adapter: auto
    with pytest.raises(ValueError, match=r"^the sana adapter does not train Sana-Sprint[^\n]*$"):
        sana(model=str(folder), adapter="sana")
    with pytest.raises(ConfigError, match=r"^config key 'plugin.height': got 48; allowed: a multiple of 32[^\n]*$"):
        sana(height=48, width=32)


def test_the_recipe_runs_a_step_on_the_tiny_pipeline(pipelines, tmp_path):
    """configs/flow/sana_pickscore.yaml as written (Flow-GRPO's SD3.5 settings: CFG 4.5, 10 steps with 9 trained,
    KL, EMA, two optimizer steps per rollout) on the tiny pipeline at 32 px with the test reward."""
    trainer = run_recipe_step("sana_pickscore.yaml", pipelines["sana"], tmp_path, "plugin.dataset=null",
                              "plugin.prompts=[a cat, a dog, a red car]", "plugin.eval_prompts=[a blue house]",
                              "plugin.resolution=32", f"plugin.max_sequence_length={TOKENS}",
                              "plugin.transformer_batch_size=4", "algorithm.micro_batch_size=4",
                              "rewards.functions=[{name: test_brightness}]")
    assert (trainer.plugin.adapter.name, trainer.plugin.cfg, trainer.plugin.guidance_scale) == ("sana", True, 4.5)
