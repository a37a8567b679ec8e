"""share_prompt_forward: the teacher-forced passes compute each distinct prompt once and the completions on top of
its KV cache (mmrl.plugins.vlm.prefix); log-probs, entropies and adapter gradients are those of the plain
per-sample pass, which is also an independent check of the M-RoPE positions it continues."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mmrl.plugins.vlm.plugin import replay_prompts
from mmrl.plugins.vlm.prefix import distinct_prompts, shared_prompt_hidden
from mmrl.rollout import Rollout
from tests.vlm.conftest import make_plugin, prompt_batch
from tests.vlm.test_decode import BUILD_ADAPTERS


def _perturb_lora(plugin, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in plugin.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)


def _interleaved(plugin, seed):
    """A rollout whose groups are interleaved (as the spread layout deals them) over images of different sizes."""
    rows = plugin.dataset("train")[:3]
    group_ids = torch.tensor([0, 1, 2, 0, 1, 2, 1, 0])
    batch = replace(prompt_batch([rows[g] for g in group_ids.tolist()], 1, seed=seed), group_ids=group_ids,
                    group_size=3)
    return plugin.rollout(plugin.policy(), batch)


def _pass(plugin, prompts, completions, width, share):
    plugin.config.share_prompt_forward = share
    plugin.model.zero_grad()
    logp, entropy = plugin.token_logp(plugin.policy(), prompts, completions, width, with_entropy=True)
    (logp.sum() + 0.5 * entropy.sum()).backward()
    grads = {name: p.grad.clone() for name, p in plugin.model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy.detach(), grads


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe",
                                    "glm4v", "glm4v_moe", "glm46v", "glm46v_moe", "internvl", "gemma4", "gemma3",
                                    "mistral3", "smolvlm", "idefics3"])
def test_shared_prompt_pass_matches_the_plain_pass(tiny_models, family, tmp_path):
    """Values and adapter gradients of the split pass equal the plain pass's, for interleaved groups, mixed image
    sizes and completions of different lengths (one of a single token); Qwen3-VL (pixels replayed, deepstack
    features) and Qwen3.5 (the completions continue the prompt's Gated DeltaNet conv and recurrent states, which
    the gradients flow back through), InternVL (plain 1-D positions continued past the left-padded prompts, tiles
    instead of grids), Gemma 4 (bidirectional attention inside the prompt's images, sliding windows, key/value
    sharing across layers, soft-capped logits), Gemma 3 (token types for the prompt pass only, fixed-size images) and
    Mistral 3 (plain positions read by Ministral 3's query scaling, padded images with their sizes), GLM-4.6V (dense
    and MoE) and SmolVLM2 / SmolVLM (frames of tiles as one row, plain positions) too when transformers has them."""
    if family not in tiny_models:
        from mmrl.plugins.vlm.adapters import vlm_adapters
        from mmrl.plugins.vlm.testing import build_tiny_model

        if BUILD_ADAPTERS.get(family, family) not in vlm_adapters:
            pytest.skip(f"transformers has no {BUILD_ADAPTERS.get(family, family)}")
        plugin = make_plugin(build_tiny_model(family, tmp_path / family))
    else:
        plugin = make_plugin(tiny_models[family])
    _perturb_lora(plugin, seed=5)
    rollout = _interleaved(plugin, seed=21)
    # each completion cut to at most these lengths (a sampled completion may have ended earlier, at its EOS)
    cut = [min(int(n), len(tokens)) for n, tokens in zip([10, 1, 7, 4, 10, 2, 9, 5], rollout.replay["completion_ids"],
                                                          strict=True)]
    completions = [tokens[:n] for tokens, n in zip(rollout.replay["completion_ids"], cut, strict=True)]
    prompts = replay_prompts(rollout.replay)
    shared = _pass(plugin, prompts, completions, rollout.num_actions, share=True)
    plain = _pass(plugin, prompts, completions, rollout.num_actions, share=False)
    plugin.config.share_prompt_forward = True
    torch.testing.assert_close(shared[0], plain[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(shared[1], plain[1], rtol=0, atol=1e-5)
    assert shared[2].keys() == plain[2].keys() and shared[2]
    for name in plain[2]:  # to float32 rounding at the gradient's own scale (Gemma 4's tiny build has large ones)
        scale = float(plain[2][name].abs().max())
        torch.testing.assert_close(shared[2][name], plain[2][name], rtol=1e-4, atol=max(1e-6, 2e-5 * scale))
    mask = torch.arange(rollout.num_actions) < torch.tensor(cut).unsqueeze(1)
    assert (shared[0][~mask] == 0).all() and (shared[0][mask] < 0).all()
    # Without gradients (the reference and old-policy passes) every family splits; with them, a family whose cache
    # updates states in place (Qwen3.5) runs the plain pass, so the values above were the plain pass's twice there.
    assert plugin._can_share_prompts(plugin.model) == plugin.adapter.cache_keeps_gradients
    values = []
    with torch.no_grad():
        assert plugin._can_share_prompts(plugin.model)
        for share in (True, False):
            plugin.config.share_prompt_forward = share
            values.append(plugin.token_logp(plugin.policy(), prompts, completions, rollout.num_actions,
                                            with_entropy=True))
    plugin.config.share_prompt_forward = True
    torch.testing.assert_close(values[0], values[1], rtol=0, atol=1e-5)


def test_each_distinct_prompt_runs_once(tiny_models):
    """The language model sees the 3 distinct prompts once (their full width) and the 8 completions once."""
    plugin = make_plugin(tiny_models["qwen2_5_vl"])
    rollout = _interleaved(plugin, seed=22)
    prompts, completions = replay_prompts(rollout.replay), rollout.replay["completion_ids"]
    inputs, width = plugin.adapter.collate(prompts, completions)
    num_completion = int(inputs["input_ids"].shape[1]) - width
    calls = []
    language_model = plugin.model.model.language_model
    hook = language_model.register_forward_pre_hook(
        lambda _module, _args, kwargs: calls.append(tuple(kwargs["inputs_embeds"].shape[:2])), with_kwargs=True)
    try:
        with torch.no_grad():
            hidden, _ = shared_prompt_hidden(plugin.adapter, plugin.policy(), prompts, inputs, width, num_completion)
    finally:
        hook.remove()
    assert calls == [(3, width), (8, num_completion - 1)]
    assert hidden.shape == (8, num_completion, 32)


def test_distinct_prompts_compare_values_not_objects(tiny_models):
    """Copies of a prompt (as after a device move) are recognised; a prompt differing in one token is not."""
    plugin = make_plugin(tiny_models["qwen2_5_vl"])
    rows = plugin.dataset("train")[:2]
    prompts = plugin.encode_rows(rows, torch.tensor([0, 1]), model=plugin.model)
    copy = {key: value.clone() for key, value in prompts[0].items()}
    changed = {**copy, "input_ids": copy["input_ids"].clone()}
    changed["input_ids"][3] += 1
    unique, index = distinct_prompts([prompts[0], prompts[1], copy, changed, prompts[1]])
    assert index == [0, 1, 0, 2, 1] and len(unique) == 3 and unique[0] is prompts[0]
    inputs, width = plugin.adapter.collate(prompts, [torch.tensor([5, 6]), torch.tensor([7])])
    assert shared_prompt_hidden(plugin.adapter, plugin.model, prompts, inputs, width, 2) is None  # nothing repeats
    untyped = [{key: value for key, value in prompts[0].items() if key != "mm_token_type_ids"}] * 2
    inputs, width = plugin.adapter.collate(untyped, [torch.tensor([5, 6]), torch.tensor([7])])
    assert "mm_token_type_ids" not in inputs  # no token types for M-RoPE: the plain pass runs
    assert shared_prompt_hidden(plugin.adapter, plugin.model, untyped, inputs, width, 2) is None


def test_ratio_is_one_and_the_reference_shares_too(tiny_models):
    """The core's old-policy pass over the whole rollout (split pass, every prompt shared by its two samples) against
    the training forward of a reordered subset (split pass) and the plain pass; the reference through the disabled
    adapter equals its plain pass and differs from the policy."""
    from mmrl.trainer.learn import old_policy_pass

    plugin = make_plugin(tiny_models["qwen2_5_vl"])
    _perturb_lora(plugin, seed=6)
    rollout = plugin.rollout(plugin.policy(), prompt_batch(plugin.dataset("train")[:3], 2, seed=23))
    rollout = old_policy_pass(plugin, plugin.policy(), rollout)
    part: Rollout = rollout.select([5, 0, 3, 1])
    outputs = []
    for share in (True, False):
        plugin.config.share_prompt_forward = share
        with torch.no_grad():
            outputs.append(plugin.forward(plugin.policy(), part, need_reference=True))
    plugin.config.share_prompt_forward = True
    deviation = ((outputs[0].logp - part.old_logp).exp() - 1).abs()[part.mask > 0].max()
    assert float(deviation) < 1e-5
    torch.testing.assert_close(outputs[0].ref_logp, outputs[1].ref_logp, rtol=0, atol=1e-5)
    assert (outputs[0].logp - outputs[0].ref_logp)[part.mask > 0].abs().max() > 1e-4


def test_checkpointing_in_train_mode_runs_the_plain_pass(tiny_models):
    """Gradient checkpointing drops the KV cache in train mode with gradients on, so the plain pass runs; without
    gradients (the reference pass) the split pass still applies."""
    plugin = make_plugin(tiny_models["qwen2_5_vl"], gradient_checkpointing=True)
    plugin.model.train()
    try:
        assert not plugin._can_share_prompts(plugin.policy())
        with torch.no_grad():
            assert plugin._can_share_prompts(plugin.policy())
    finally:
        plugin.model.eval()
    assert plugin._can_share_prompts(plugin.policy())


def test_checkpointing_flag_is_read_from_the_instance_and_then_its_class(tiny_models):
    """The check reads the flag as getattr would: an instance's own value first (what gradient_checkpointing_enable
    sets), then a class-level declaration."""
    plugin = make_plugin(tiny_models["qwen2_5_vl"])
    policy = plugin.policy()

    class Declared(torch.nn.Module):
        gradient_checkpointing = True

    policy.train()
    try:
        assert plugin._can_share_prompts(policy)
        policy.add_module("declared", Declared())
        assert not plugin._can_share_prompts(policy)  # the class says True
        policy.declared.gradient_checkpointing = False
        assert plugin._can_share_prompts(policy)  # the instance overrides it
    finally:
        del policy.declared
        policy.eval()


def test_shared_prefill_applies_the_lm_head_to_no_prompt_position(tiny_models):
    """Generation's shared prefill keeps only its KV cache, so the LM head sees one position per distinct prompt
    there (not [u, P, V] logits, gigabytes with a 152k vocabulary and long image prompts)."""
    plugin = make_plugin(tiny_models["qwen2_5_vl"])
    rows = plugin.dataset("train")[:2]
    group_ids = torch.tensor([0, 1, 0, 1])
    prompts = plugin.encode_rows([rows[g] for g in group_ids.tolist()], group_ids, model=plugin.model)
    seen = []
    head = plugin.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda _module, args, _output: seen.append(tuple(args[0].shape[:2])))
    try:
        with torch.no_grad():
            plugin.adapter.generate(plugin.model, prompts, plugin.generation_config(False), share_prefill=True)
    finally:
        hook.remove()
    assert seen[0] == (2, 1)  # the prefill: 2 distinct prompts, one position each
    assert all(shape == (4, 1) for shape in seen[1:])  # then one position per sample and decode step


def test_the_reference_and_training_pass_share_one_collation_and_prompt_split(tiny_models):
    """forward(need_reference=True) collates the micro-batch once and splits its prompts (M-RoPE positions
    included) once for both passes; the log-probs are those of separate token_logp calls."""
    plugin = make_plugin(tiny_models["qwen2_5_vl"])
    _perturb_lora(plugin, seed=8)
    rollout = plugin.rollout(plugin.policy(), prompt_batch(plugin.dataset("train")[:2], 3, seed=29))
    calls = {"collate": 0, "rope_positions": 0}
    adapter = plugin.adapter
    for name in calls:
        original = getattr(adapter, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(adapter, name, counted)
    with torch.no_grad():
        output = plugin.forward(plugin.policy(), rollout, need_reference=True)
    # one collation of the samples, one of their distinct prompts; one position computation
    assert calls == {"collate": 2, "rope_positions": 1}
    for name in calls:
        delattr(adapter, name)
    prompts, completions = replay_prompts(rollout.replay), rollout.replay["completion_ids"]
    with torch.no_grad():
        logp, _ = plugin.token_logp(plugin.policy(), prompts, completions, rollout.num_actions, with_entropy=False)
        with plugin.reference_model(plugin.policy()) as reference:
            ref_logp, _ = plugin.token_logp(reference, prompts, completions, rollout.num_actions, with_entropy=False)
    torch.testing.assert_close(output.logp, logp, rtol=0, atol=1e-6)
    torch.testing.assert_close(output.ref_logp, ref_logp, rtol=0, atol=1e-6)
    assert (output.logp - output.ref_logp)[rollout.mask > 0].abs().max() > 1e-4
