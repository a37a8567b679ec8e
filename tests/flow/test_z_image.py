"""The Z-Image adapter on a tiny ``ZImagePipeline`` (Qwen3 text encoder, Z-Image single-stream DiT with learned
padding tokens, FLUX-style VAE) built from config classes, saved and loaded back through ``from_pretrained``: the
plugin's ODE is the pipeline's own sampler, guidance is the pipeline's ``pos + w·(pos − neg)``, the training forward
gives ratio 1 on-policy, and GRPO steps train the LoRA."""

from __future__ import annotations

import pytest
import torch

from mmrl.trainer import Trainer
from tests.flow.checks import assert_ratio_one_for_any_split, perturb_lora, run_recipe_step, train_two_steps
from tests.flow.conftest import prompt_batch


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus a tiny Z-Image, built once per session."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    folder = save_tiny_pipeline("z_image", tmp_path_factory.mktemp("flow_z_image") / "tiny-z_image")
    return {**pipelines, "z_image": folder}


def _pipeline_images(plugin, prompts, seeds, steps, scale, height=16, width=16, max_sequence_length=16, **rules):
    """ZImagePipeline's own output for ``prompts``, one generator per sample as the plugin seeds them (guidance 0:
    no unconditional pass, as the pipeline decides; ``rules``: cfg_normalization, cfg_truncation)."""
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    with torch.no_grad():
        return plugin.adapter.pipeline(prompts, height=height, width=width, num_inference_steps=steps,
                                       guidance_scale=scale, generator=generators, output_type="pt",
                                       max_sequence_length=max_sequence_length, **rules).images


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
@pytest.mark.parametrize(("height", "width"), [(16, 16), (32, 16)], ids=["16x16", "32x16"])
def test_evaluation_is_the_z_image_pipeline_ode(make_plugin, cfg, height, width):
    # The pipeline passes each caption's real tokens (7 and 9 here) and the transformer pads them to 32 with its
    # learned padding token; the plugin caches them zero-padded to 16 with a mask and cuts them back, so the
    # transformer sees the same captions. The negative prompt goes through one [uncond; cond] call in both.
    # A non-square size checks the latent shape, the patch grid and the unpacking.
    plugin = make_plugin("z_image", cfg=cfg, eval_num_steps=4, eval_guidance_scale=2.5 if cfg else None,
                         height=height, width=width, max_sequence_length=16)
    prompts = ["a cat", "a big red dog"]
    rollout = plugin.rollout(plugin.policy(), prompt_batch(prompts, 1, first_seed=5, training=False)).validate()
    assert rollout.payload["images"].shape == (2, 3, height, width)
    expected = _pipeline_images(plugin, prompts, (5, 6), 4, 2.5 if cfg else 0.0, height, width)
    torch.testing.assert_close(rollout.payload["images"], expected, rtol=0, atol=1e-5)
    other = _pipeline_images(plugin, prompts, (5, 6), 4, 0.0 if cfg else 2.5, height, width)
    assert (rollout.payload["images"] - other).abs().max() > 1e-3  # guidance changes the images: the check can fail


def test_guidance_is_the_pipelines_conditional_plus_w_times_the_difference(make_plugin):
    """v = −(o_c + w(o_c − o_u)) from two separate transformer calls computed here, o the raw outputs: standard CFG
    at scale 1 + w, not SD3's v_u + w(v_c − v_u)."""
    plugin = make_plugin("z_image", cfg=True, guidance_scale=3.0, max_sequence_length=16)
    perturb_lora(plugin)
    adapter, policy = plugin.adapter, plugin.policy()
    conditioning = plugin.sampler.conditioning(["a cat", "a red dog"])
    negative = plugin.sampler.negative_conditioning()
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))  # [n, C, h, w]
    timesteps = torch.tensor([743.0, 424.0])

    def raw(rows):  # the transformer's own output for each row, called directly
        embeds, mask = rows["prompt_embeds"], rows["prompt_embeds_mask"].bool()
        out = policy(x=list(latents.unsqueeze(2).unbind(0)), t=(1000 - timesteps) / 1000,
                     cap_feats=[embeds[i][mask[i]] for i in range(2)], return_dict=False)[0]
        return torch.stack(out).squeeze(2).float()  # [2, C, h, w]

    with torch.no_grad():
        guided = adapter.velocity(policy, latents, timesteps, conditioning, guidance_scale=3.0, negative=negative)
        cond = raw(conditioning)
        uncond = raw({key: value.expand(2, *value.shape[1:]) for key, value in negative.items()})
    expected = -(cond + 3.0 * (cond - uncond))
    # One [uncond; cond] call against two separate calls: float32 rounding of differently shaped matmuls, amplified
    # by 1 + w = 4 in the combination.
    torch.testing.assert_close(guided, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    standard = -(uncond + 3.0 * (cond - uncond))
    assert (guided - standard).abs().max() > 1e-3  # the check tells the two conventions apart


@pytest.mark.parametrize("rules", [{"cfg_normalization": 1.0}, {"cfg_truncation": 0.5},
                                   {"cfg_normalization": 1.2, "cfg_truncation": 0.6}],
                         ids=["normalization", "truncation", "both"])
def test_the_pipelines_optional_guidance_rules_are_its_own(make_plugin, rules):
    # cfg_normalization caps a guided sample's norm at c times the conditional one's; cfg_truncation drops guidance
    # at the steps past 1 - sigma = tau (the pipeline makes no unconditional pass there; the plugin weights it 0).
    plugin = make_plugin("z_image", cfg=True, eval_num_steps=4, eval_guidance_scale=4.0, max_sequence_length=16,
                         **rules)
    prompts = ["a cat", "a big red dog"]
    rollout = plugin.rollout(plugin.policy(), prompt_batch(prompts, 1, first_seed=5, training=False)).validate()
    expected = _pipeline_images(plugin, prompts, (5, 6), 4, 4.0, **rules)
    torch.testing.assert_close(rollout.payload["images"], expected, rtol=0, atol=1e-5)
    plain = _pipeline_images(plugin, prompts, (5, 6), 4, 4.0)
    assert (expected - plain).abs().max() > 1e-3  # the rules change the pipeline's images: the check can fail


def test_guidance_rules_by_hand(make_plugin):
    """The combination on hand-made velocities: c caps only guided rows over c·‖cond‖; a truncated row is cond."""
    plugin = make_plugin("z_image", cfg=True, cfg_normalization=1.5, cfg_truncation=0.5, max_sequence_length=16)
    adapter = plugin.adapter
    cond = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]]).view(3, 2, 1, 1)  # norms 5, 1, 2
    uncond = torch.tensor([[3.0, 3.0], [1.0, 0.5], [0.0, 0.0]]).view(3, 2, 1, 1)
    # timesteps 900 and 400: 1 - sigma = 0.1 (guided) and 0.6 (> 0.5: truncated); the third row guided
    scale = adapter.guidance_for(torch.tensor([900.0, 400.0, 700.0]), 2.0)
    assert scale.flatten().tolist() == [2.0, 0.0, 2.0]
    out = adapter.combine_guidance(uncond, cond, scale).flatten(1)
    # row 0: (3, 6), norm 6.708 > 7.5? no: kept. row 1: truncated, cond itself. row 2: (0, 6), norm 6 > 3: to (0, 3)
    torch.testing.assert_close(out, torch.tensor([[3.0, 6.0], [1.0, 0.0], [0.0, 3.0]]), rtol=0, atol=1e-6)
    tight = make_plugin("z_image", cfg=True, cfg_normalization=0.5, cfg_truncation=0.5,
                        max_sequence_length=16).adapter
    out = tight.combine_guidance(uncond, cond, tight.guidance_for(torch.tensor([900.0, 400.0, 900.0]), 2.0))
    # the guided rows capped at 0.5 × their conditional norms; the truncated row is cond, uncapped (no CFG branch)
    torch.testing.assert_close(out.flatten(1).norm(dim=1)[[0, 2]], torch.tensor([2.5, 1.0]), rtol=1e-6, atol=0)
    torch.testing.assert_close(out[1], cond[1], rtol=0, atol=0)


def test_guidance_rules_are_refused_without_cfg_and_for_other_models(make_plugin):
    from mmrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"^config key 'plugin.cfg_truncation': got 0.5; allowed: null: the z_image "
                                          r"adapter guides without cfg \(cfg is false\); [^\n]*$"):
        make_plugin("z_image", cfg=False, cfg_truncation=0.5)
    with pytest.raises(ConfigError, match=r"^config key 'plugin.cfg_normalization': got 1.0; allowed: null: the sd3 "
                                          r"adapter takes no such rule; [^\n]*$"):
        make_plugin("sd3", cfg_normalization=1.0)
    with pytest.raises(ConfigError, match=r"^config key 'plugin.cfg_truncation': got 1.5; [^\n]*$"):
        make_plugin("z_image", cfg_truncation=1.5)


def test_recomputed_logp_has_ratio_one_with_the_guidance_rules(make_plugin):
    plugin = make_plugin("z_image", cfg=True, guidance_scale=4.0, cfg_normalization=1.0, cfg_truncation=0.5,
                         max_sequence_length=16)
    perturb_lora(plugin)
    rollout = plugin.rollout(plugin.policy(), prompt_batch(["a cat", "a dog", "a red car"], 2)).validate()
    assert_ratio_one_for_any_split(plugin, rollout)


def test_prompt_rows_are_the_pipelines_captions_whatever_their_batch(make_plugin):
    """Each cached row is the pipeline's ragged caption (chat template with enable_thinking, hidden_states[-2]),
    zero-padded with a mask, and does not depend on the prompts encoded with it."""
    plugin = make_plugin("z_image", max_sequence_length=16)
    adapter = plugin.adapter
    together = adapter.encode_prompts(["a cat", "a big red dog"], 16)
    alone = adapter.encode_prompts(["a cat"], 16)
    tokenizer = adapter.pipeline.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": "a cat"}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=True)
    assert text.endswith("<|im_start|>assistant\n")  # thinking left open: no empty <think></think> block
    real = len(tokenizer(text).input_ids)
    assert together["prompt_embeds"].shape == (2, 16, 24)
    assert together["prompt_embeds_mask"][0].tolist() == [1] * real + [0] * (16 - real)
    with torch.no_grad():
        ids = tokenizer([text], padding="max_length", max_length=16, return_tensors="pt")
        hidden = adapter.pipeline.text_encoder(input_ids=ids.input_ids, attention_mask=ids.attention_mask.bool(),
                                               output_hidden_states=True).hidden_states[-2]  # [1, 16, D]
    torch.testing.assert_close(together["prompt_embeds"][0, :real], hidden[0, :real], rtol=0, atol=0)
    assert together["prompt_embeds"][0, real:].abs().max() == 0  # zeros where the pipeline has no token
    torch.testing.assert_close(together["prompt_embeds"][:1], alone["prompt_embeds"], rtol=1e-5, atol=1e-6)
    assert torch.equal(together["prompt_embeds_mask"][:1], alone["prompt_embeds_mask"])


def test_captions_of_different_lengths_share_a_batch_as_they_would_alone(make_plugin):
    """Rows are cut back to their own captions, so a velocity row does not depend on its batch companions."""
    plugin = make_plugin("z_image", max_sequence_length=16)
    perturb_lora(plugin)
    adapter, policy = plugin.adapter, plugin.policy()
    conditioning = plugin.sampler.conditioning(["a cat", "a big red dog with a small house"])
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    timesteps = torch.tensor([900.0, 300.0])
    with torch.no_grad():
        both = adapter.velocity(policy, latents, timesteps, conditioning, guidance_scale=0.0)
        first = adapter.velocity(policy, latents[:1], timesteps[:1], {k: v[:1] for k, v in conditioning.items()},
                                 guidance_scale=0.0)
    torch.testing.assert_close(both[:1], first, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(make_plugin, cfg):
    plugin = make_plugin("z_image", cfg=cfg, guidance_scale=2.0 if cfg else 0.0)
    assert plugin.adapter.name == "z_image"  # detected from model_index.json
    perturb_lora(plugin)
    policy = plugin.policy()
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog", "a red car"], 2)).validate()
    assert rollout.old_logp.shape == (6, 3)
    assert_ratio_one_for_any_split(plugin, rollout)  # other LoRA weights move the ratio: it can fail


def test_without_cfg_the_unguided_scale_is_zero_as_z_image_turbo_is_run(make_plugin):
    """Z-Image-Turbo is run with guidance_scale 0 (no unconditional pass): with cfg false a null scale resolves to 0,
    0 is accepted and any other scale is refused in one line (it would be ignored)."""
    from mmrl.config import ConfigError

    plugin = make_plugin("z_image", cfg=False)
    assert (plugin.guidance_scale, plugin.eval_guidance_scale) == (0.0, 0.0)
    assert make_plugin("z_image", cfg=False, guidance_scale=0.0).guidance_scale == 0.0
    with pytest.raises(ConfigError, match=r"^config key 'plugin.guidance_scale': got 1.0; allowed: null or 0.0 with "
                                          r"plugin.cfg false[^\n]*$"):
        make_plugin("z_image", cfg=False, guidance_scale=1.0)
    assert make_plugin("z_image").guidance_scale == 5.0  # the pipeline's default, with the CFG pass


def test_image_sizes_off_the_patch_grid_are_refused_in_one_line(make_plugin):
    from mmrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"^config key 'plugin.height': got 18; allowed: a multiple of 4 [^\n]*$"):
        make_plugin("z_image", height=18, width=16)


def test_two_grpo_steps_train_the_lora_with_ratio_one(train_config, tmp_path):
    changed = train_two_steps(Trainer(train_config("z_image", tmp_path)), frozen_components=True)
    assert any(".feed_forward.w2.lora_B" in key for key in changed)  # the default targets include the FFN
    assert any(key.startswith(("noise_refiner.", "base_model.model.noise_refiner.")) for key in changed)


def test_the_turbo_recipe_runs_a_step_on_the_tiny_pipeline(pipelines, tmp_path):
    """configs/flow/z_image_turbo_pickscore.yaml as written (no CFG pass, guidance 0, 6 steps with one trained step
    drawn from 1-3, EMA, gradient checkpointing, two optimizer steps per rollout), on the tiny pipeline at 16 px with
    the test reward: the combination loads, trains at ratio 1 and evaluates."""
    trainer = run_recipe_step("z_image_turbo_pickscore.yaml", pipelines["z_image"], tmp_path, "plugin.dataset=null",
                              "plugin.prompts=[a cat, a dog, a red car]", "plugin.eval_prompts=[a blue house]",
                              "plugin.resolution=16", "plugin.max_sequence_length=16",
                              "rewards.functions=[{name: test_brightness}]")
    assert (trainer.plugin.cfg, trainer.plugin.guidance_scale) == (False, 0.0)
