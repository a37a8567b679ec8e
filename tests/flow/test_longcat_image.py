"""The LongCat-Image adapter on a tiny ``LongCatImagePipeline`` (a two-layer Qwen2.5-VL text encoder on a byte-level
BPE tokenizer, a 1+1-block LongCat transformer, a tiny 16-channel FLUX-style VAE, FLUX.1's dynamically shifted
scheduler), built from config classes, saved and loaded back through ``from_pretrained``: the plugin's ODE is the
pipeline's own sampler (prompt rewriting off) with and without CFG, the cfg renorm on, off and clamped, at a square
and a non-square size; the prompt rows are the template-wrapped Qwen2.5-VL states with quoted text split into
characters, whatever their batch; the σ grid is the scheduler's as the pipeline sets it; the training forward gives
ratio 1 on-policy; GRPO steps train the LoRA; the exported LoRA loads into the pipeline's transformer; the recipe runs
a step; and bad options, lengths, sizes and pipelines are refused in one line."""

from __future__ import annotations

import json
import math

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

TOKENS = 512  # LongCatImagePipeline pads every prompt to its tokenizer_max_length; the only length it takes
SHORT, LONG = "a cat", 'a red dog on the house with a sign "the blue cat" in a green photo'
# LONG's parts as split_quotation cuts them (the quoted part, quotes included, is tokenized character by character)
LONG_PARTS = [("a red dog on the house with a sign ", False), ('"the blue cat"', True), (" in a green photo", False)]
TEMPLATE_PREFIX = ("<|im_start|>system\nAs an image captioning expert, generate a descriptive text prompt based on an "
                   "image content, suitable for input to a text-to-image model.<|im_end|>\n<|im_start|>user\n")
TEMPLATE_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus a tiny LongCat-Image, built once per session."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    folder = save_tiny_pipeline("longcat_image", tmp_path_factory.mktemp("flow_longcat") / "tiny-longcat-image")
    return {**pipelines, "longcat_image": folder}


@pytest.fixture
def longcat(make_plugin):
    """``longcat(**options)``: a FlowPlugin on the tiny LongCat-Image at 16 px with its 512 text tokens."""
    def build(**overrides):
        return make_plugin("longcat_image", **{"max_sequence_length": TOKENS, **overrides})

    return build


def _fresh_pipeline(plugin):
    """The plugin's folder as a new ``LongCatImagePipeline``: the expected values share no module or setting with
    the adapter's pipeline."""
    from diffusers import LongCatImagePipeline

    pipeline = LongCatImagePipeline.from_pretrained(plugin.config.model)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def _pipeline_images(pipeline, prompts, seeds, *, height, width, scale, renorm=True, renorm_min=0.0, negative=None):
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    with torch.no_grad():
        return pipeline(prompts, negative_prompt=negative, height=height, width=width, num_inference_steps=4,
                        guidance_scale=scale, generator=generators, output_type="pt", enable_prompt_rewrite=False,
                        enable_cfg_renorm=renorm, cfg_renorm_min=renorm_min).images


@pytest.mark.parametrize(("cfg", "options", "negative"), [
    (True, {}, ""), (True, {"enable_cfg_renorm": False}, "a blurry photo"), (True, {"cfg_renorm_min": 0.995}, ""),
    (False, {}, ""),
], ids=["cfg-renorm", "cfg-plain-negative", "cfg-renorm-min", "nocfg"])
@pytest.mark.parametrize(("height", "width"), [(16, 16), (16, 32)], ids=["16x16", "16x32"])
def test_evaluation_is_the_longcat_pipeline_ode(longcat, cfg, options, negative, height, width):
    # Prompts of different lengths (one with quoted text) in one batch; the pipeline makes two calls and combines in
    # the model's dtype (float32 here), the plugin one [uncond; cond] call combined in float32: rounding only.
    scale = 4.0 if cfg else None
    plugin = longcat(cfg=cfg, eval_num_steps=4, eval_guidance_scale=scale, negative_prompt=negative, height=height,
                     width=width, adapter_options=options)
    assert plugin.adapter.name == "longcat_image"  # adapter: auto, from model_index.json's LongCatImagePipeline
    prompts = [SHORT, LONG]
    rollout = plugin.rollout(plugin.policy(), prompt_batch(prompts, 1, first_seed=5, training=False)).validate()
    assert rollout.payload["images"].shape == (2, 3, height, width)
    pipeline = _fresh_pipeline(plugin)
    renorm = options.get("enable_cfg_renorm", True)
    renorm_min = options.get("cfg_renorm_min", 0.0)
    expected = _pipeline_images(pipeline, prompts, (5, 6), height=height, width=width, scale=4.0 if cfg else 1.0,
                                renorm=renorm, renorm_min=renorm_min, negative=negative)
    torch.testing.assert_close(rollout.payload["images"], expected, rtol=0, atol=1e-5)
    if cfg and not renorm_min:  # the renorm setting changes the images (so the check can fail)
        other = _pipeline_images(pipeline, prompts, (5, 6), height=height, width=width, scale=4.0,
                                 renorm=not renorm, renorm_min=0.0, negative=negative)
        assert (rollout.payload["images"] - other).abs().max() > 1e-3
    if renorm_min:  # the clamp's lower end bites: some tokens' factors are below 0.995 here
        unclamped = _pipeline_images(pipeline, prompts, (5, 6), height=height, width=width, scale=4.0,
                                     negative=negative)
        assert (rollout.payload["images"] - unclamped).abs().max() > 1e-4


def _encoded_by_hand(pipeline, parts):
    """A prompt's row computed here from the tokenizer and the text encoder: the parts' tokens (a quoted part one
    character at a time) right-padded to 512, the template around them, Qwen2.5-VL with the mask, the template's
    positions dropped."""
    tokenizer, encoder = pipeline.tokenizer, pipeline.text_encoder
    ids = []
    for text, quoted in parts:
        for piece in (list(text) if quoted else [text]):
            ids += tokenizer(piece, add_special_tokens=False).input_ids
    prefix = tokenizer(TEMPLATE_PREFIX, add_special_tokens=False).input_ids
    suffix = tokenizer(TEMPLATE_SUFFIX, add_special_tokens=False).input_ids
    pad = [tokenizer.pad_token_id] * (TOKENS - len(ids))
    input_ids = torch.tensor([prefix + ids + pad + suffix])
    mask = torch.tensor([[1] * (len(prefix) + len(ids)) + [0] * len(pad) + [1] * len(suffix)])
    with torch.no_grad():
        hidden = encoder(input_ids=input_ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    return hidden[:, len(prefix):len(prefix) + TOKENS], len(ids)  # [1, 512, D]


def test_prompt_rows_are_the_template_wrapped_qwen_states_whatever_their_batch(longcat):
    plugin = longcat()
    adapter, pipeline = plugin.adapter, _fresh_pipeline(plugin)
    together = adapter.encode_prompts([SHORT, LONG], TOKENS)
    assert set(together) == {"prompt_embeds"} and together["prompt_embeds"].shape == (2, TOKENS, 32)
    short, _ = _encoded_by_hand(pipeline, [(SHORT, False)])
    long, real = _encoded_by_hand(pipeline, LONG_PARTS)
    torch.testing.assert_close(together["prompt_embeds"][:1], short, rtol=0, atol=1e-5)
    torch.testing.assert_close(together["prompt_embeds"][1:], long, rtol=0, atol=1e-5)
    unsplit, unsplit_real = _encoded_by_hand(pipeline, [(LONG, False)])
    assert unsplit_real < real  # the quoted text costs a token per character: the split is seen
    assert (together["prompt_embeds"][1:] - unsplit).abs().max() > 1e-3
    alone = adapter.encode_prompts([LONG], TOKENS)["prompt_embeds"]
    torch.testing.assert_close(together["prompt_embeds"][1:], alone, rtol=0, atol=1e-5)
    assert adapter.encode_negative_prompt("", TOKENS)["prompt_embeds"].shape == (1, TOKENS, 32)  # a prompt's form
    with pytest.raises(ValueError, match=r"^plugin.max_sequence_length is 64; LongCatImagePipeline pads every prompt "
                                         r"to exactly 512 tokens[^\n]*$"):
        adapter.encode_prompts([SHORT], 64)


def test_rows_of_different_lengths_share_a_batch_as_they_would_alone(longcat):
    plugin = longcat(guidance_scale=4.0)
    perturb_lora(plugin, scale=0.1)
    adapter, policy = plugin.adapter, plugin.policy()
    conditioning = plugin.sampler.conditioning([SHORT, LONG])
    negative = plugin.sampler.negative_conditioning()
    latents = adapter.pack(torch.randn(2, *adapter.noise_shape(), generator=torch.Generator().manual_seed(1)))
    timesteps = torch.tensor([900.0, 300.0])
    with torch.no_grad():
        both = adapter.velocity(policy, latents, timesteps, conditioning, guidance_scale=4.0, negative=negative)
        first = adapter.velocity(policy, latents[:1], timesteps[:1], {k: v[:1] for k, v in conditioning.items()},
                                 guidance_scale=4.0, negative=negative)
    torch.testing.assert_close(both[:1], first, rtol=1e-5, atol=1e-5)


def test_renorm_is_the_pipelines_formula_and_its_options(longcat):
    """The guided velocity written out: v = v_u + w·(v_c − v_u) times clamp(‖v_c‖/(‖v‖ + 1e-8), min, 1) per token;
    the options, their refusals, and the ids the transformer gets."""
    generator = torch.Generator().manual_seed(0)
    uncond, cond = torch.randn(2, 4, 64, generator=generator), torch.randn(2, 4, 64, generator=generator)
    uncond[0, 0] = 1.2 * cond[0, 0]  # a token whose guided velocity (0.4 v_c) is shorter: its factor is clamped at 1
    guided = uncond + 4.0 * (cond - uncond)
    for options, low in (({}, 0.0), ({"cfg_renorm_min": 0.5}, 0.5)):
        adapter = longcat(adapter_options=options).adapter
        factor = [[min(max(float(cond[i, j].norm()) / (float(guided[i, j].norm()) + 1e-8), low), 1.0)
                   for j in range(4)] for i in range(2)]
        expected = guided * torch.tensor(factor).unsqueeze(-1)
        torch.testing.assert_close(adapter.combine_guidance(uncond, cond, 4.0), expected, rtol=1e-6, atol=1e-6)
        assert factor[0][0] == 1.0 and min(min(row) for row in factor[1:]) == max(low, min(factor[1])) < 1
    assert min(factor[1]) == 0.5  # the lower end of the clamp is exercised too
    plain = longcat(adapter_options={"enable_cfg_renorm": False}).adapter
    torch.testing.assert_close(plain.combine_guidance(uncond, cond, 4.0), guided, rtol=0, atol=0)
    off = longcat(adapter_options={"cfg_renorm_min": 1}).adapter  # the pipeline's documented "off"
    torch.testing.assert_close(off.combine_guidance(uncond, cond, 4.0), guided, rtol=0, atol=0)

    adapter = longcat(height=16, width=32).adapter
    image_ids, text_ids = adapter._position_ids(4 * 8, TOKENS, uncond)
    assert text_ids.shape == (TOKENS, 3) and text_ids[5].tolist() == [0, 5, 5]
    assert image_ids[0].tolist() == [1, 512, 512] and image_ids[1].tolist() == [1, 512, 513]  # row-major
    assert image_ids[-1].tolist() == [1, 512 + 3, 512 + 7]

    bad = {"enable_cfg_renorm": ("yes", r"enable_cfg_renorm: true or false [^\n]*; got 'yes'"),
           "cfg_renorm_min": (1.5, r"cfg_renorm_min: a number in \[0, 1\] [^\n]*; got 1.5")}
    for key, (value, message) in bad.items():
        with pytest.raises(ConfigError, match=rf"^config key 'plugin.adapter_options': [^\n]*{message}$"):
            longcat(adapter_options={key: value})
    with pytest.raises(ConfigError, match=r"^config key 'plugin.adapter_options': [^\n]*; 'guidance_rescale' is not "
                                          r"one$"):
        longcat(adapter_options={"guidance_rescale": 0.7})
    with pytest.raises(ConfigError, match=r"^config key 'plugin.adapter_options': [^\n]*cfg_renorm_min: unset with "
                                          r"plugin.cfg false[^\n]*$"):
        longcat(cfg=False, adapter_options={"cfg_renorm_min": 0.5})


@pytest.mark.parametrize(("height", "width"), [(16, 16), (32, 64)])
def test_the_sigma_grid_is_the_pipelines(longcat, height, width):
    """σ written out as the pipeline sets it: t = linspace(1, 1/S, S), μ = calculate_shift of the h/2·w/2 image
    tokens (base 0.5 at 256, 1.15 at 4096, linear), σ = e^μ / (e^μ + 1/t − 1), then 0; timesteps σ·1000."""
    adapter = longcat(height=height, width=width).adapter
    sigmas, timesteps = adapter.schedule(6)
    tokens = (height // 4) * (width // 4)
    mu = 0.5 + (1.15 - 0.5) * (tokens - 256) / (4096 - 256)
    t = torch.linspace(1, 1 / 6, 6, dtype=torch.float64)
    expected = torch.cat([math.exp(mu) / (math.exp(mu) + (1 / t - 1)), torch.zeros(1, dtype=torch.float64)]).float()
    torch.testing.assert_close(sigmas, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(timesteps, expected[:-1] * 1000, rtol=0, atol=1e-3)


def test_recomputed_logp_has_ratio_one_for_any_micro_batch_split(longcat):
    plugin = longcat(guidance_scale=4.5)
    perturb_lora(plugin, scale=0.1)
    rollout = plugin.rollout(plugin.policy(), prompt_batch([SHORT, LONG, "a dog"], 2)).validate()
    assert rollout.old_logp.shape == (6, 3)
    assert_ratio_one_for_any_split(plugin, rollout)  # other LoRA weights move the ratio: it can fail


def test_two_grpo_steps_train_the_lora_with_ratio_one(train_config, tmp_path):
    trainer = Trainer(train_config("longcat_image", tmp_path, max_sequence_length=TOKENS))
    assert trainer.plugin.cfg and trainer.plugin.guidance_scale == 4.5  # LongCatImagePipeline's defaults
    changed = train_two_steps(trainer, frozen_components=True)
    assert any(".attn.to_q.lora_B" in key for key in changed) and any("ff_context.net.2.lora_B" in key
                                                                       for key in changed)


def test_exported_lora_loads_into_the_pipelines_transformer(longcat, tmp_path):
    """LongCatImagePipeline has no load_lora_weights (no LoRA loader mixin); its transformer's load_lora_adapter
    reads the plugin's diffusers LoRA file and gives the policy's velocities."""
    plugin = longcat()
    perturb_lora(plugin, scale=0.1)
    plugin.save_trainable(plugin.policy(), tmp_path / "policy")
    rollout = plugin.rollout(plugin.policy(), prompt_batch([SHORT, LONG], 1))
    pipeline = type(plugin.adapter.pipeline).from_pretrained(plugin.config.model)
    assert not hasattr(pipeline, "load_lora_weights")
    pipeline.transformer.load_lora_adapter(str(tmp_path / "policy"), prefix="transformer",
                                           weight_name="pytorch_lora_weights.safetensors")
    assert_loaded_lora_gives_the_policy_velocities(plugin, rollout, pipeline.transformer, 4.5)


def test_other_pipelines_lengths_and_sizes_are_refused_in_one_line(longcat, pipelines, tmp_path):
    from diffusers import FluxPipeline

    from mmrl.plugins.flow.adapters.longcat_image import LongCatImageAdapter

    refused = r"^the longcat_image adapter drives LongCatImagePipeline, not FluxPipeline: set plugin.adapter: flux "
    with pytest.raises(ValueError, match=refused + r"\(or auto\)$"):
        LongCatImageAdapter(FluxPipeline.from_pretrained(pipelines["flux"]), torch.device("cpu"))
    with pytest.raises(ValueError, match=refused + r"\(or auto\)$"):
        longcat(model=str(pipelines["flux"]), adapter="longcat_image")
    assert json.loads((pipelines["longcat_image"] / "model_index.json").read_text())["_class_name"] == \
        "LongCatImagePipeline"
    with pytest.raises(ConfigError, match=r"^config key 'plugin.height': got 18; allowed: a multiple of 4[^\n]*$"):
        longcat(height=18, width=16)
    plugin = longcat(max_sequence_length=8)  # refused at the first prompt encoded, as Chroma's and Qwen-Image's
    with pytest.raises(ValueError, match=r"^plugin.max_sequence_length is 8; [^\n]*only 512 \(or null\) reproduces "
                                         r"it$"):
        plugin.rollout(plugin.policy(), prompt_batch([SHORT], 1))


def test_the_recipe_runs_a_step_on_the_tiny_pipeline(pipelines, tmp_path):
    """configs/flow/longcat_image_pickscore.yaml as written (Flow-GRPO's SD3.5 settings with LongCat's CFG 4.5 and
    renorm) on the tiny pipeline at 16 px with the test reward."""
    trainer = run_recipe_step("longcat_image_pickscore.yaml", pipelines["longcat_image"], tmp_path,
                              "plugin.dataset=null", "plugin.prompts=[a cat, a dog, a red car]",
                              "plugin.eval_prompts=[a blue house]", "plugin.resolution=16",
                              "plugin.transformer_batch_size=4", "algorithm.micro_batch_size=4",
                              "rewards.functions=[{name: test_brightness}]")
    plugin = trainer.plugin
    assert (plugin.adapter.name, plugin.cfg, plugin.guidance_scale) == ("longcat_image", True, 4.5)
    assert (plugin.adapter.enable_cfg_renorm, plugin.adapter.cfg_renorm_min) == (True, 0.0)
