"""InternVL3.5's MoE checkpoints (``family: internvl`` with a Qwen3-MoE language model, ``internvl_moe`` build): the
adapter is MoE per checkpoint (the dense and the refused GPT-OSS text configs are not), default LoRA adapts the
attention projections only, the batched rollout's log-probs equal a plain per-sample transformers forward of the
hand-written chat (ratio 1), the training pass's router loss equals ``Qwen3MoeForCausalLM``'s own ``aux_loss`` on the
same language model and inputs (padding included), and a training step with the router loss and LoRA on the fused
experts (``lora.target_parameters``) moves the experts' adapters and only adapters."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from mmrl.config import load_config
from mmrl.plugins.vlm.plugin import PassInputs, replay_prompts, row_images
from mmrl.trainer import Trainer
from mmrl.trainer.learn import old_policy_pass
from tests.vlm.conftest import assert_old_logp_is_a_plain_forward, make_plugin, plugin_options, prompt_batch

EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from mmrl.plugins.vlm.adapters import vlm_adapters
    from mmrl.plugins.vlm.testing import build_tiny_model

    if "internvl" not in vlm_adapters:
        pytest.skip("transformers has no internvl")
    return build_tiny_model("internvl_moe", tmp_path_factory.mktemp("internvl_moe") / "internvl_moe")


@pytest.fixture(scope="module")
def plugin(moe_model):
    """A LoRA plugin with the router loss on, shared by the tests that sample and score (they change no weights)."""
    return make_plugin(moe_model, max_new_tokens=8, router_aux_loss_coef=0.5)


@pytest.fixture(scope="module")
def rollout(plugin):
    """3 rows (1, 5 and 3 tiles: prompts of different lengths, left-padded) × G=2 with their old log-probs."""
    rows = plugin.dataset("train")[:3]
    batch = prompt_batch(rows, 2, seed=4)
    return rows, old_policy_pass(plugin, plugin.policy(), plugin.rollout(plugin.policy(), batch)).validate()


def _with_text_model_type(source, target, model_type):
    """A copy of the checkpoint folder whose text config names another model type."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config["text_config"]["model_type"] = model_type
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_moe_per_checkpoint_and_default_lora_on_attention(moe_model, plugin, tmp_path):
    """``family: auto`` gives the InternVL adapter, MoE from the text config (a ``qwen3`` text config is dense, a
    ``gpt_oss`` one refused); the default LoRA targets adapt the attention projections of the language model only
    (the experts are parameters, the MLP names match nothing; peft rewrites nothing), the routers' top-k is read."""
    from mmrl.plugins.vlm.adapters import adapter_for
    from mmrl.plugins.vlm.adapters.internvl import InternVLAdapter

    assert adapter_for("auto", str(moe_model)) is InternVLAdapter
    adapter = plugin.adapter
    assert adapter.name == "internvl" and adapter.moe and adapter.num_experts_per_tok == 2
    text = plugin.model.config.text_config
    assert text.model_type == "qwen3_moe" and text.num_experts == 4 and text.norm_topk_prob
    dense = InternVLAdapter(str(_with_text_model_type(moe_model, tmp_path / "dense", "qwen3")),
                            min_pixels=adapter.min_pixels, max_pixels=adapter.max_pixels)
    assert not dense.moe
    with pytest.raises(ValueError, match="gpt_oss"):
        InternVLAdapter(str(_with_text_model_type(moe_model, tmp_path / "gpt_oss", "gpt_oss")),
                        min_pixels=adapter.min_pixels, max_pixels=adapter.max_pixels)
    adapted = {name.rsplit(".lora_", 1)[0] for name, _ in plugin.model.named_parameters() if ".lora_A." in name}
    assert {name.rsplit(".", 1)[-1] for name in adapted} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert all(".language_model." in name for name in adapted)
    assert not getattr(plugin.model.peft_config["default"], "target_parameters", None)


def test_log_probs_equal_a_plain_forward_and_ratio_is_one(plugin, rollout):
    """Each sample's old log-probs (mixed tile counts, left padding, shared prefill and prompt forward, the feature
    cache) equal a plain forward of the chat written by hand with the processor on the row's raw image; the training
    forward on a reordered subset gives ratio 1."""
    rows, sampled = rollout

    def processor_inputs(row):
        images = row_images(row)
        assert len(images) == 1 and images[0].size == tuple(row["image_size"])  # the raw image
        question = plugin.question(row)
        text = "<|im_start|>user\n<IMG_CONTEXT>\n" + question + "<|im_end|>\n<|im_start|>assistant\n"
        return plugin.adapter.processor(text=[text], images=images, return_tensors="pt")

    assert len({plugin.adapter.tiles_per_image(row["image_size"]) for row in rows}) == 3
    assert_old_logp_is_a_plain_forward(plugin, sampled, rows, 2, processor_inputs, atol=1e-5)
    part = sampled.select([5, 0, 3])
    output = plugin.forward(plugin.policy(), part, need_reference=True)  # gradients on: the router loss too
    assert float((output.logp.detach() - part.old_logp).abs().max()) < 1e-5
    assert output.aux_loss is not None


def test_router_loss_is_transformers_qwen3_moe_aux_loss(plugin, rollout):
    """The training pass's aux_loss is router_aux_loss_coef × the ``aux_loss`` of transformers'
    ``Qwen3MoeForCausalLM`` around the same language model, called with the inputs the language model gets in the
    plugin's pass (merged image embeddings, positions, the mask with left prompt and right completion padding);
    the log-probs are those of the pass without it; a no-grad pass and coefficient 0 add none. transformers' wrapper
    itself fails on ``output_router_logits``, which the adapter works around."""
    from transformers import Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    _, sampled = rollout
    prepared = PassInputs(plugin, replay_prompts(sampled.replay), sampled.replay["completion_ids"])
    mask = prepared.inputs["attention_mask"]
    assert bool((mask == 0).any()) and bool((mask[:, -1] == 0).any())  # left and right padding
    language_model = plugin.model.model.language_model
    hooks = (dict(language_model._forward_hooks), dict(plugin.model._forward_hooks))
    output = plugin.forward(plugin.policy(), sampled, need_reference=False)
    assert output.aux_loss.requires_grad
    assert (dict(language_model._forward_hooks), dict(plugin.model._forward_hooks)) == hooks  # held for the call only
    seen = {}

    def keep(_module, _args, kwargs):
        seen.update({key: kwargs[key] for key in ("inputs_embeds", "attention_mask", "position_ids")})

    handle = language_model.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            plugin.model(**plugin.adapter._positioned(prepared.inputs), use_cache=False)
    finally:
        handle.remove()
    causal = Qwen3MoeForCausalLM(plugin.model.config.text_config)
    causal.model = language_model  # the same weights (and LoRA layers)
    with torch.no_grad():
        reference = causal(**seen, output_router_logits=True, use_cache=False)
        plain = plugin.forward(plugin.policy(), sampled, need_reference=False)
    assert torch.equal(seen["attention_mask"], mask) and len(reference.router_logits) == 2
    assert float(output.aux_loss.detach()) == pytest.approx(0.5 * float(reference.aux_loss), rel=1e-6)
    unmasked = load_balancing_loss_func(reference.router_logits, 4, 2, None)  # the padding counted: another value
    assert abs(float(unmasked) - float(reference.aux_loss)) > 1e-4
    assert plain.aux_loss is None
    torch.testing.assert_close(output.logp.detach(), plain.logp, rtol=0, atol=1e-5)
    plugin.config.router_aux_loss_coef = 0.0
    try:
        assert plugin.forward(plugin.policy(), sampled, need_reference=False).aux_loss is None
    finally:
        plugin.config.router_aux_loss_coef = 0.5
    with torch.no_grad(), pytest.raises(TypeError, match="router_logits"):
        plugin.model(**plugin.adapter._positioned(prepared.inputs), output_router_logits=True, use_cache=False)


def test_a_training_step_with_the_router_loss_and_lora_on_the_experts(moe_model, tmp_path):
    """One GRPO step with router_aux_loss_coef > 0 and ``lora.target_parameters`` on the fused experts: ratio 1,
    the router loss is logged, the experts' (both fused tensors') and the attention's adapters move, nothing else
    does. (The router loss alone reaches the experts: a layer's experts feed the next layer's router.)"""
    lora = {"rank": 4, "alpha": 8.0, "target_parameters": list(EXPERTS)}
    options = plugin_options(moe_model, lora=lora, router_aux_loss_coef=0.01, max_new_tokens=8)
    trainer = Trainer(load_config({
        "plugin": {"name": "vlm", **options},
        "run": {"output_dir": str(tmp_path / "run"), "max_steps": 1, "seed": 0, "progress": False, "cpu": True},
        "rollout": {"prompts_per_step": 3, "group_size": 2, "batch_size": 6},
        "algorithm": {"micro_batch_size": 6, "minibatches": 1},
        "optim": {"lr": 5.0e-2},
        "rewards": {"functions": [{"name": "format"}, {"name": "iou"}]},
        "eval": {"at_start": False, "num_prompts": 2},
    }))
    model = trainer.plugin.model
    assert trainer.plugin.adapter.moe
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    history = trainer.train().history
    assert history[0]["loss/aux"] > 0 and history[0]["loss/first_step_ratio_deviation"] < 1e-5
    changed = {name for name, p in model.named_parameters() if not torch.equal(before[name], p)}
    assert changed and all("lora_" in name for name in changed)
    # peft wraps the experts module once per target parameter: one lora_B per fused tensor
    assert sum(".mlp.experts." in name and ".lora_B." in name for name in changed) >= len(EXPERTS)
    assert any(".q_proj.lora_B" in name for name in changed)
    assert np.isfinite(history[0]["loss/aux"])
