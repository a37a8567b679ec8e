"""The FLUX.3 adapter on a tiny ``Flux3ModularPipeline`` (Qwen3-VL text encoder, FLUX.3 transformer, FLUX.2's
batch-normalised VAE) built from config classes, saved with ``save_pretrained`` (a ``modular_model_index.json``
folder) and loaded back through the plugin (``adapter: auto``): the plugin's ODE is the modular pipeline's own
sampler with and without CFG, for prompts of different text windows, the training forward gives ratio 1 on-policy
for any micro-batch split, GRPO steps train the LoRA, and a step-distilled (flow-map) transformer is refused."""

from __future__ import annotations

import pytest
import torch

from mmrl.trainer import Trainer
from tests.flow.checks import assert_ratio_one_for_any_split, perturb_lora, train_two_steps
from tests.flow.conftest import prompt_batch

# Two windows: the tiny tokenizer gives "a cat" and the empty negative prompt one 80-token window, LONG two.
TEXT_TOKENS = 160
LONG = "a big red dog " * 40


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus a tiny FLUX.3 modular pipeline, built once per session."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    root = tmp_path_factory.mktemp("flow_flux3")
    return {**pipelines, "flux3": save_tiny_pipeline("flux3", root / "tiny-flux3")}


def modular_pipeline(adapter, guidance_scale):
    """The adapter's loaded components in diffusers' FLUX.3 auto blocks without the prompt upsampler (prompts as
    written), with the guider at ``guidance_scale``."""
    from diffusers.guiders import ClassifierFreeGuidance
    from diffusers.modular_pipelines import Flux3AutoBlocks

    blocks = Flux3AutoBlocks()
    blocks.sub_blocks.pop("prompt_upsampler")
    pipeline = blocks.init_pipeline()
    source = adapter.pipeline
    pipeline.update_components(text_encoder=source.text_encoder, tokenizer=source.tokenizer,
                               transformer=source.transformer, vae=source.vae,
                               guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))
    return pipeline


@pytest.mark.parametrize("cfg", [True, False], ids=["cfg", "nocfg"])
@pytest.mark.parametrize(("height", "width"), [(16, 16), (16, 32)], ids=["16x16", "16x32"])
def test_evaluation_is_the_modular_pipeline_ode(make_plugin, cfg, height, width):
    # The guider runs the conditional and unconditional passes as two calls and combines them in the model's dtype;
    # the plugin runs [uncond; cond] split by text window and combines in float32: rounding only.
    plugin = make_plugin("flux3", eval_num_steps=4, max_sequence_length=TEXT_TOKENS, height=height, width=width,
                         cfg=cfg, **({"eval_guidance_scale": 3.0} if cfg else {}))
    assert plugin.adapter.name == "flux3"  # detected from modular_model_index.json
    assert plugin.cfg is cfg
    prompts = ["a cat", LONG]
    rollout = plugin.rollout(plugin.policy(), prompt_batch(prompts, 1, first_seed=5, training=False)).validate()
    assert rollout.payload["images"].shape == (2, 3, height, width)

    def pipeline(scale):
        images = []
        for prompt, seed in zip(prompts, (5, 6), strict=True):
            with torch.no_grad():
                images.append(modular_pipeline(plugin.adapter, scale)(
                    prompt=prompt, height=height, width=width, num_inference_steps=4,
                    generator=torch.Generator().manual_seed(seed), output="images", output_type="pt",
                    max_sequence_length=TEXT_TOKENS))
        return torch.cat(images)

    torch.testing.assert_close(rollout.payload["images"], pipeline(3.0 if cfg else 1.0), rtol=0, atol=1e-5)
    if cfg:  # guidance changes the images: the check can fail
        assert (rollout.payload["images"] - pipeline(1.0)).abs().max() > 1e-3


def test_prompts_are_the_text_encoder_steps_windows(make_plugin):
    from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

    adapter = make_plugin("flux3", max_sequence_length=TEXT_TOKENS).adapter
    encoded = adapter.encode_prompts(["a cat", LONG], TEXT_TOKENS)
    assert encoded["prompt_lengths"].tolist() == [80, 160]
    assert encoded["prompt_embeds"].shape == (2, TEXT_TOKENS, 8 * 16)  # layers 4, 8, ..., 32 of width 16
    for i, prompt in enumerate(["a cat", LONG]):
        expected = Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds(
            adapter.pipeline.text_encoder, adapter.pipeline.tokenizer, prompt, max_sequence_length=TEXT_TOKENS)
        length = expected.shape[1]
        torch.testing.assert_close(encoded["prompt_embeds"][i:i + 1, :length], expected, rtol=0, atol=0)
        assert not encoded["prompt_embeds"][i, length:].any()


def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(make_plugin):
    plugin = make_plugin("flux3", max_sequence_length=TEXT_TOKENS, cfg=True, guidance_scale=2.0)
    perturb_lora(plugin)
    rollout = plugin.rollout(plugin.policy(), prompt_batch(["a cat", LONG, "a red car"], 2)).validate()
    assert rollout.old_logp.shape == (6, 3)
    assert_ratio_one_for_any_split(plugin, rollout)  # other LoRA weights move the ratio: it can fail


def test_two_grpo_steps_train_the_lora_with_ratio_one(train_config, tmp_path):
    trainer = Trainer(train_config("flux3", tmp_path, max_sequence_length=TEXT_TOKENS, guidance_scale=2.0))
    assert trainer.plugin.cfg
    changed = train_two_steps(trainer)
    assert any("single_transformer_blocks.0.attn.to_q.lora_B" in key for key in changed)


def test_a_flow_map_transformer_is_refused(pipelines):
    from mmrl.plugins.flow.adapters.flux3 import Flux3Adapter, load_modular_pipeline

    pipeline = load_modular_pipeline(str(pipelines["flux3"]), torch.float32)
    pipeline.transformer.register_to_config(flow_map=True)
    with pytest.raises(ValueError, match=r"^the flux3 adapter does not train step-distilled \(flow-map\) FLUX.3"):
        Flux3Adapter(pipeline, torch.device("cpu"))


def test_a_guider_the_plugin_would_not_reproduce_is_refused(pipelines):
    from diffusers.guiders import ClassifierFreeGuidance

    from mmrl.plugins.flow.adapters.flux3 import Flux3Adapter, load_modular_pipeline

    pipeline = load_modular_pipeline(str(pipelines["flux3"]), torch.float32)
    assert (pipeline.scheduler.config.shift, pipeline.guider.guidance_scale) == (6.93, 3.5)  # the blocks' defaults
    pipeline.update_components(guider=ClassifierFreeGuidance(guidance_rescale=0.7))
    with pytest.raises(ValueError, match=r"^the flux3 adapter combines guidance as v_u \+ w·\(v_c − v_u\)"):
        Flux3Adapter(pipeline, torch.device("cpu"))


def test_a_folder_without_modular_index_is_refused(tmp_path):
    from mmrl.plugins.flow.adapters.flux3 import load_modular_pipeline

    with pytest.raises(FileNotFoundError, match=r"has no modular_model_index.json \(not a diffusers modular pipeline, "
                                                r"which the flux3 adapter loads\)$"):
        load_modular_pipeline(str(tmp_path), torch.float32)
    # a regular diffusers folder: the line names the adapter its model_index.json class takes
    (tmp_path / "model_index.json").write_text('{"_class_name": "Flux2Pipeline"}')
    with pytest.raises(FileNotFoundError, match=r"which the flux3 adapter loads\): its model_index.json names "
                                                r"Flux2Pipeline; set plugin.adapter: flux2 \(or auto\)$"):
        load_modular_pipeline(str(tmp_path), torch.float32)
