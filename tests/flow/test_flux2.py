"""The FLUX.2 adapter on a tiny ``Flux2Pipeline`` (Mistral-3 text encoder with a Pixtral processor, FLUX.2
transformer, batch-normalised VAE) built from config classes, saved and loaded back through ``from_pretrained``: the
plugin's ODE is the pipeline's own sampler, the training forward gives ratio 1 on-policy, and GRPO steps train the
LoRA."""

from __future__ import annotations

import math

import pytest
import torch

from mmrl.trainer import Trainer
from tests.flow.checks import assert_ratio_one_for_any_split, perturb_lora, train_two_steps
from tests.flow.conftest import prompt_batch

# FLUX.2 pads every prompt to max_sequence_length after its system turn (33 tokens in the tiny tokenizer), so the
# prompts need room: 40 tokens leaves 7 for "[INST] a big red dog [/INST]".
TEXT_TOKENS = 40


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus a tiny FLUX.2, built once per session."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    folder = save_tiny_pipeline("flux2", tmp_path_factory.mktemp("flow_flux2") / "tiny-flux2")
    return {**pipelines, "flux2": folder}


@pytest.mark.parametrize(("height", "width"), [(16, 16), (16, 32)], ids=["16x16", "16x32"])
def test_evaluation_is_the_flux2_pipeline_ode(make_plugin, height, width):
    # Same batch, same padded text length, same single transformer call per step on both sides: only the float32
    # rounding of the two code paths can differ, 1e-5 on pixels in [0, 1] after 5 steps. The non-square size checks
    # the image ids (rows, columns), their unpacking and the shift μ of h/2·w/2 tokens.
    plugin = make_plugin("flux2", eval_num_steps=5, eval_guidance_scale=3.0, max_sequence_length=TEXT_TOKENS,
                         height=height, width=width)
    assert plugin.adapter.name == "flux2" and not plugin.cfg  # detected from model_index.json; guidance-distilled
    prompts = ["a cat", "a big red dog"]
    rollout = plugin.rollout(plugin.policy(), prompt_batch(prompts, 1, first_seed=5, training=False)).validate()
    assert rollout.payload["images"].shape == (2, 3, height, width)
    generators = [torch.Generator().manual_seed(seed) for seed in (5, 6)]
    with torch.no_grad():
        expected = plugin.adapter.pipeline(prompt=prompts, height=height, width=width, num_inference_steps=5,
                                           guidance_scale=3.0, generator=generators, output_type="pt",
                                           max_sequence_length=TEXT_TOKENS).images
    torch.testing.assert_close(rollout.payload["images"], expected, rtol=0, atol=1e-5)


def test_schedule_shift_depends_on_the_number_of_steps(make_plugin):
    """σ = e^μ / (e^μ + 1/t − 1) on t = linspace(1, 1/S, S) with μ = compute_empirical_mu(tokens, S), computed here
    from the formula rather than by the scheduler."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    adapter = make_plugin("flux2", max_sequence_length=TEXT_TOKENS).adapter
    for steps in (4, 10):
        sigmas, timesteps = adapter.schedule(steps)
        mu = compute_empirical_mu(image_seq_len=16, num_steps=steps)  # 16 px → (16 / 4)² tokens
        base = torch.linspace(1.0, 1 / steps, steps, dtype=torch.float64)
        shifted = math.exp(mu) / (math.exp(mu) + (1 / base - 1))  # the scheduler's exponential time shift
        torch.testing.assert_close(sigmas[:-1].double(), shifted, rtol=1e-5, atol=1e-6)
        assert sigmas[-1] == 0 and torch.allclose(timesteps, sigmas[:-1] * 1000)


def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(make_plugin):
    plugin = make_plugin("flux2", max_sequence_length=TEXT_TOKENS)
    perturb_lora(plugin)
    policy = plugin.policy()
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog", "a red car"], 2)).validate()
    assert rollout.old_logp.shape == (6, 3)
    assert_ratio_one_for_any_split(plugin, rollout)  # other LoRA weights move the ratio: it can fail


def test_two_grpo_steps_train_the_lora_with_ratio_one(train_config, tmp_path):
    changed = train_two_steps(Trainer(train_config("flux2", tmp_path, max_sequence_length=TEXT_TOKENS)))
    assert any("single_transformer_blocks.0.attn.to_qkv_mlp_proj.lora_B" in key for key in changed)
