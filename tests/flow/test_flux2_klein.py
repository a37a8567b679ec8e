"""The FLUX.2 [klein] adapter on tiny ``Flux2KleinPipeline`` s (Qwen3 text encoder, FLUX.2 transformer without the
guidance embedding, batch-normalised VAE), a base one and a step-distilled one, built from config classes, saved
and loaded back through ``from_pretrained``: the plugin's ODE is the pipeline's own sampler with and without CFG,
the distilled checkpoint refuses guidance it would ignore, the training forward gives ratio 1 on-policy, and GRPO
steps train the LoRA."""

from __future__ import annotations

import pytest
import torch

from mmrl.config import ConfigError
from mmrl.trainer import Trainer
from tests.flow.checks import assert_ratio_one_for_any_split, perturb_lora, run_recipe_step, train_two_steps
from tests.flow.conftest import prompt_batch

# The templated prompt ("<|im_start|>user\na big red dog<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
# is about 20 tokens in the tiny tokenizer; every prompt is padded to this length, as the pipeline pads it.
TEXT_TOKENS = 32


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus tiny FLUX.2 [klein] base and distilled pipelines, built once per session."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    root = tmp_path_factory.mktemp("flow_flux2_klein")
    return {**pipelines, **{kind: save_tiny_pipeline(kind, root / f"tiny-{kind}")
                            for kind in ("flux2_klein", "flux2_klein_distilled")}}


@pytest.mark.parametrize(("kind", "cfg"), [
    ("flux2_klein", True), ("flux2_klein", False), ("flux2_klein_distilled", None),
], ids=["base-cfg", "base-nocfg", "distilled"])
@pytest.mark.parametrize(("height", "width"), [(16, 16), (16, 32)], ids=["16x16", "16x32"])
def test_evaluation_is_the_klein_pipeline_ode(make_plugin, kind, cfg, height, width):
    # The pipeline runs the conditional and the unconditional pass as two calls and combines them in the model's
    # dtype; the plugin runs [uncond; cond] in one call and combines in float32: rounding only, 1e-5 on pixels
    # after 4 steps. Guidance 3 for the base model with cfg, 1 (no pass) without; the distilled pipeline ignores it.
    plugin = make_plugin(kind, eval_num_steps=4, max_sequence_length=TEXT_TOKENS, height=height, width=width,
                         **({} if cfg is None else {"cfg": cfg}),
                         **({"eval_guidance_scale": 3.0} if cfg else {}))
    assert plugin.adapter.name == "flux2_klein"  # detected from model_index.json
    assert plugin.cfg is bool(cfg)
    prompts = ["a cat", "a big red dog"]
    rollout = plugin.rollout(plugin.policy(), prompt_batch(prompts, 1, first_seed=5, training=False)).validate()
    assert rollout.payload["images"].shape == (2, 3, height, width)

    def pipeline(scale):
        generators = [torch.Generator().manual_seed(seed) for seed in (5, 6)]
        with torch.no_grad():
            return plugin.adapter.pipeline(prompt=prompts, height=height, width=width, num_inference_steps=4,
                                           guidance_scale=scale, generator=generators, output_type="pt",
                                           max_sequence_length=TEXT_TOKENS).images

    torch.testing.assert_close(rollout.payload["images"], pipeline(3.0 if cfg else 1.0), rtol=0, atol=1e-5)
    if kind == "flux2_klein":  # guidance changes the base model's images: the check can fail
        assert (rollout.payload["images"] - pipeline(1.0 if cfg else 3.0)).abs().max() > 1e-3


def test_prompts_are_qwen3_layers_9_18_27_without_thinking(make_plugin):
    adapter = make_plugin("flux2_klein", max_sequence_length=TEXT_TOKENS).adapter
    rows = adapter.encode_prompts(["a cat"], TEXT_TOKENS)["prompt_embeds"]  # [1, L, 3·16]
    tokenizer, encoder = adapter.pipeline.tokenizer, adapter.pipeline.text_encoder
    text = tokenizer.apply_chat_template([{"role": "user", "content": "a cat"}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
    assert text.endswith("<think>\n\n</think>\n\n")
    ids = tokenizer([text], padding="max_length", max_length=TEXT_TOKENS, return_tensors="pt")
    with torch.no_grad():
        hidden = encoder(**ids, output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[9], hidden[18], hidden[27]], dim=-1)  # [1, L, 3·D]: layer-major along the width
    assert rows.shape == (1, TEXT_TOKENS, 48)
    torch.testing.assert_close(rows, expected, rtol=0, atol=0)


def test_the_distilled_checkpoint_refuses_guidance_it_would_ignore(make_plugin, pipelines):
    plugin = make_plugin("flux2_klein_distilled", max_sequence_length=TEXT_TOKENS)
    assert (plugin.cfg, plugin.guidance_scale, plugin.eval_guidance_scale) == (False, 1.0, 1.0)
    with pytest.raises(ConfigError, match=r"^config key 'plugin.cfg': got True; allowed: false or null: the "
                                          r"flux2_klein adapter is step-distilled \(is_distilled in its "
                                          r"model_index.json\)[^\n]*$"):
        make_plugin("flux2_klein_distilled", cfg=True)
    with pytest.raises(ConfigError, match=r"^config key 'plugin.guidance_scale': got 4.0; allowed: null or 1.0 "
                                          r"with plugin.cfg false[^\n]*$"):
        make_plugin("flux2_klein_distilled", guidance_scale=4.0)
    base = make_plugin("flux2_klein", max_sequence_length=TEXT_TOKENS)
    assert (base.cfg, base.guidance_scale) == (True, 4.0)  # the pipeline's default, with the CFG pass


def test_the_transformer_gets_no_guidance_embedding(make_plugin):
    """guidance=None, as the pipeline passes it (the tiny transformer has no guidance embedding to take one)."""
    plugin = make_plugin("flux2_klein", max_sequence_length=TEXT_TOKENS)
    seen = []
    handle = plugin.adapter.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("guidance", "absent")), with_kwargs=True)
    try:
        plugin.rollout(plugin.policy(), prompt_batch(["a cat"], 1, training=False))
    finally:
        handle.remove()
    assert seen and all(value is None for value in seen)


@pytest.mark.parametrize("kind", ["flux2_klein", "flux2_klein_distilled"])
def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(make_plugin, kind):
    plugin = make_plugin(kind, max_sequence_length=TEXT_TOKENS)
    perturb_lora(plugin)
    policy = plugin.policy()
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog", "a red car"], 2)).validate()
    assert rollout.old_logp.shape == (6, 3)
    assert_ratio_one_for_any_split(plugin, rollout)  # other LoRA weights move the ratio: it can fail


def test_two_grpo_steps_train_the_lora_with_ratio_one(train_config, tmp_path):
    trainer = Trainer(train_config("flux2_klein", tmp_path, max_sequence_length=TEXT_TOKENS, guidance_scale=2.0))
    assert trainer.plugin.cfg
    changed = train_two_steps(trainer)
    assert any("single_transformer_blocks.0.attn.to_qkv_mlp_proj.lora_B" in key for key in changed)


def test_the_distilled_recipe_runs_a_step_on_the_tiny_pipeline(pipelines, tmp_path):
    """configs/flow/flux2_klein_pickscore.yaml as written (no CFG pass, 4 steps with one trained step drawn from 1-2,
    EMA, gradient checkpointing, two optimizer steps per rollout), on the tiny distilled pipeline at 16 px with the
    test reward: the combination loads, trains at ratio 1 and evaluates."""
    trainer = run_recipe_step("flux2_klein_pickscore.yaml", pipelines["flux2_klein_distilled"], tmp_path,
                              "plugin.dataset=null", "plugin.prompts=[a cat, a dog, a red car]",
                              "plugin.eval_prompts=[a blue house]", "plugin.resolution=16",
                              "plugin.eval_height=32", "plugin.eval_width=32",
                              f"plugin.max_sequence_length={TEXT_TOKENS}",
                              "rewards.functions=[{name: test_brightness}]")
    assert (trainer.plugin.cfg, trainer.plugin.guidance_scale) == (False, 1.0)
