"""The Qwen-Image adapter on a tiny ``QwenImagePipeline`` (Qwen2.5-VL text encoder, Qwen-Image MMDiT, causal 3-D
VAE) built from config classes, saved and loaded back through ``from_pretrained``: the plugin's ODE is the
pipeline's own sampler, the training forward gives ratio 1 on-policy, and GRPO steps train the LoRA."""

from __future__ import annotations

import pytest
import torch

from mmrl.trainer import Trainer
from tests.flow.checks import assert_ratio_one_for_any_split, perturb_lora, train_two_steps
from tests.flow.conftest import prompt_batch


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus a tiny Qwen-Image, built once per session (about 3 s)."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    folder = save_tiny_pipeline("qwen_image", tmp_path_factory.mktemp("flow_qwen_image") / "tiny-qwen_image")
    return {**pipelines, "qwen_image": folder}


def _pipeline_images(plugin, prompts, seeds, steps, scale, cfg, height=16, width=16):
    """The diffusers pipeline's own output for ``prompts``, one generator per sample as the plugin seeds them."""
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    guidance = {"true_cfg_scale": scale, "negative_prompt": ""} if cfg else {"true_cfg_scale": 1.0}
    with torch.no_grad():
        return plugin.adapter.pipeline(prompts, height=height, width=width, num_inference_steps=steps,
                                       generator=generators, output_type="pt", max_sequence_length=8,
                                       **guidance).images


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
@pytest.mark.parametrize(("height", "width"), [(16, 16), (32, 16)], ids=["16x16", "32x16"])
def test_evaluation_is_the_qwen_image_pipeline_ode(make_plugin, cfg, height, width):
    # The pipeline pads text to the longest prompt of its batch ("a cat": 7 tokens, "a big red dog": 9, cut to 8)
    # and runs the negative prompt as a second call; the plugin pads every prompt to 8 with a mask and runs
    # [uncond; cond] in one call. Masked keys get exactly zero attention weight, so only float32 rounding of
    # differently shaped matmuls separates the two: 1e-5 on pixels in [0, 1] after 5 steps.
    # A non-square size checks img_shapes (1, h/2, w/2), the unpacking and the σ shift of h/2·w/2 tokens.
    plugin = make_plugin("qwen_image", cfg=cfg, eval_num_steps=5, eval_guidance_scale=3.0 if cfg else None,
                         height=height, width=width)
    prompts = ["a cat", "a big red dog"]
    rollout = plugin.rollout(plugin.policy(), prompt_batch(prompts, 1, first_seed=5, training=False)).validate()
    assert rollout.payload["images"].shape == (2, 3, height, width)
    expected = _pipeline_images(plugin, prompts, (5, 6), 5, 3.0, cfg, height, width)
    torch.testing.assert_close(rollout.payload["images"], expected, rtol=0, atol=1e-5)


def test_guided_velocity_is_rescaled_to_the_conditional_norm(make_plugin):
    """v = (v_u + w(v_c − v_u))·‖v_c‖/‖·‖ per token, from two separate transformer calls computed here."""
    plugin = make_plugin("qwen_image", cfg=True, guidance_scale=4.0)
    perturb_lora(plugin)
    adapter, policy = plugin.adapter, plugin.policy()
    conditioning = plugin.sampler.conditioning(["a cat", "a red dog"])
    negative = plugin.sampler.negative_conditioning()
    latents = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0))  # [n, (16/4)², 4·4]
    timesteps = torch.tensor([743.0, 424.0])
    with torch.no_grad():
        guided = adapter.velocity(policy, latents, timesteps, conditioning, guidance_scale=4.0, negative=negative)
        cond = adapter.call_transformer(policy, latents, timesteps, conditioning, 4.0)
        uncond = adapter.call_transformer(policy, latents, timesteps,
                                          {k: v.expand(2, *v.shape[1:]) for k, v in negative.items()}, 4.0)
    combined = uncond + 4.0 * (cond - uncond)  # [2, 16, 16]
    expected = torch.empty_like(combined)
    for row in range(2):
        for token in range(16):
            expected[row, token] = combined[row, token] * (cond[row, token].norm() / combined[row, token].norm())
    # One [uncond; cond] call against two separate calls: float32 rounding of differently shaped matmuls, amplified
    # by w = 4 in the combination; 1e-5 of the largest component bounds it.
    torch.testing.assert_close(guided, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    assert not torch.allclose(guided, combined, rtol=1e-3, atol=1e-4)  # the rescale is not the identity here


def test_prompt_rows_do_not_depend_on_their_batch_companions(make_plugin):
    """Cached prompts are encoded in batches but reused one by one: padding to max_sequence_length with a mask must
    give each prompt the same row whatever else was encoded with it."""
    plugin = make_plugin("qwen_image")
    together = plugin.adapter.encode_prompts(["a cat", "a big red dog"], 8)
    alone = plugin.adapter.encode_prompts(["a cat"], 8)
    assert together["prompt_embeds"].shape == (2, 8, 32)
    assert together["prompt_embeds_mask"].tolist()[0] == [1] * 7 + [0]  # "a cat" + 5 template tokens
    assert together["prompt_embeds_mask"].tolist()[1] == [1] * 8  # truncated at max_sequence_length
    torch.testing.assert_close(together["prompt_embeds"][:1], alone["prompt_embeds"], rtol=1e-5, atol=1e-6)
    assert torch.equal(together["prompt_embeds_mask"][:1], alone["prompt_embeds_mask"])
    assert together["prompt_embeds"][0, 7].abs().max() == 0  # padding is zeros, as the pipeline pads


def test_text_longer_than_the_pipeline_allows_is_refused_in_one_line(make_plugin):
    plugin = make_plugin("qwen_image", max_sequence_length=1025)
    with pytest.raises(ValueError, match=r"^plugin.max_sequence_length is 1025; Qwen-Image takes at most 1024 [^\n]*$"):
        plugin.rollout(plugin.policy(), prompt_batch(["a cat"], 2))


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(make_plugin, cfg):
    plugin = make_plugin("qwen_image", cfg=cfg)
    assert plugin.adapter.name == "qwen_image"  # detected from model_index.json
    perturb_lora(plugin)
    policy = plugin.policy()
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog", "a red car"], 2)).validate()
    assert rollout.old_logp.shape == (6, 3)
    assert_ratio_one_for_any_split(plugin, rollout)  # other LoRA weights move the ratio: it can fail


def test_two_grpo_steps_train_the_lora_with_ratio_one(train_config, tmp_path):
    changed = train_two_steps(Trainer(train_config("qwen_image", tmp_path)), frozen_components=True)
    assert any(".img_mlp.net.2.lora_B" in key for key in changed)  # the default targets include the FFN outputs
