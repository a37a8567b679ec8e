"""The VLM plugin against the rollout contract: rollout shapes and replay, ratio == 1 for micro-batches of any
composition, sampling follows the tempered softmax, seeding, greedy evaluation, the KL reference, adapter
save/load, freezing and config errors."""

from __future__ import annotations

import json

import pytest
import torch

from mmrl.config import ConfigError
from mmrl.config.schema import from_dict
from mmrl.plugin import Runtime
from mmrl.plugins.vlm.plugin import VLMPluginConfig, completion_lengths, replay_prompts
from mmrl.rollout import Rollout
from mmrl.trainer.learn import old_policy_pass
from tests.vlm.conftest import make_plugin, plugin_options, prompt_batch
from tests.vlm.test_decode import BUILD_ADAPTERS

PROMPTS, GROUP = 3, 2


def _rollout(plugin, seed=0, rows=None, group=GROUP, training=True):
    """A rollout; a training one with the old log-probs a run with several optimizer steps per rollout trains on:
    the plugin leaves them out and the core computes them with its forward under no_grad (``old_policy_pass``)."""
    rows = plugin.dataset("train")[:PROMPTS] if rows is None else rows
    rollout = plugin.rollout(plugin.policy(), prompt_batch(rows, group, seed=seed, training=training))
    if not training:
        return rollout
    assert rollout.old_logp is None
    return old_policy_pass(plugin, plugin.policy(), rollout)


def _ratio_deviation(logp, old_logp, mask):
    return float(((logp - old_logp).exp() - 1).abs()[mask > 0].max())


def test_rollout_follows_the_contract(lora_plugins, family):
    plugin = lora_plugins[family]
    rows = plugin.dataset("train")[:PROMPTS]
    assert len({tuple(row["resized_size"]) for row in rows}) > 1  # mixed image sizes (after resizing too)
    rollout = _rollout(plugin).validate()
    n = PROMPTS * GROUP
    lengths = rollout.mask.sum(1)
    assert rollout.old_logp.shape == rollout.mask.shape == (n, int(lengths.max()))
    assert rollout.num_actions <= plugin.max_actions() == 10
    assert torch.equal(rollout.mask, (torch.arange(rollout.num_actions) < lengths.unsqueeze(1)).float())
    assert (rollout.old_logp[rollout.mask > 0] < 0).all() and (rollout.old_logp[rollout.mask == 0] == 0).all()
    assert len(rollout.payload["completions"]) == n and all(isinstance(t, str) for t in rollout.payload["completions"])
    replay = rollout.replay
    # The vision tower is frozen: its features are computed once per prompt and replayed instead of pixels.
    assert set(replay) == {"input_ids", "mm_token_type_ids", "image_embeds", "image_grid_thw", "completion_ids"}
    assert all(isinstance(value, list) and len(value) == n for value in replay.values())
    for i in range(n):
        assert len(replay["completion_ids"][i]) == int(lengths[i])
        assert replay["image_embeds"][i].shape == (int(replay["image_grid_thw"][i].prod(-1).sum()) // 4, 32)
        row = rows[i // GROUP]
        grid = replay["image_grid_thw"][i][0]
        assert [int(grid[2]) * 14, int(grid[1]) * 14] == row["resized_size"]
    # The G copies of a prompt share its tensors: the per-image repeat is right by construction.
    assert replay["image_embeds"][0] is replay["image_embeds"][1]
    assert replay["image_embeds"][0].shape != replay["image_embeds"][2].shape
    assert {"completion_length", "completion_clipped", "prompt_length", "image_tokens"} <= set(rollout.metrics)
    # truncated: a completion that used the whole budget without an EOS (algorithm.mask_truncated)
    ends_with_eos = [bool(torch.isin(ids[-1], torch.tensor(plugin.eos_ids))) for ids in replay["completion_ids"]]
    expected = [int(length) == plugin.max_actions() and not eos
                for length, eos in zip(lengths.tolist(), ends_with_eos, strict=True)]
    assert rollout.truncated.tolist() == expected
    assert rollout.metrics["completion_clipped"] == pytest.approx(sum(expected) / n)


def test_ratio_is_one_for_micro_batches_of_any_composition(lora_plugins, family):
    """The first inner step sees ratio 1 whatever subset and order of samples a micro-batch holds, including
    completions of different lengths (cut as if they had ended with EOS) and a rollout of wider action axis."""
    plugin = lora_plugins[family]
    rollout = _rollout(plugin, seed=1)
    cut = [int(length) for length in torch.tensor([10, 3, 7, 1, 5, 9]).clamp(max=rollout.num_actions)]
    completions = [tokens[:length] for tokens, length in zip(rollout.replay["completion_ids"], cut, strict=True)]
    prompts = replay_prompts(rollout.replay)
    width = rollout.num_actions + 2  # as after Rollout.concat with a wider round
    with torch.no_grad():
        old_logp, _ = plugin.token_logp(plugin.policy(), prompts, completions, width, with_entropy=False)
    mask = (torch.arange(width) < torch.tensor(cut).unsqueeze(1)).float()
    ragged = Rollout(group_ids=rollout.group_ids, old_logp=old_logp, mask=mask,
                     replay={**rollout.replay, "completion_ids": completions}).validate()
    deviations = []
    for indices in ([5, 0, 3], [2], [4, 1], [3, 2, 1, 0], list(range(6))):
        part = ragged.select(indices)
        with torch.no_grad():
            output = plugin.forward(plugin.policy(), part, need_reference=False)
        assert output.logp.shape == part.old_logp.shape
        deviations.append(_ratio_deviation(output.logp, part.old_logp, part.mask))
        print(f"first-step ratio deviation of micro-batch {indices}: {deviations[-1]:.3g}")
        assert (output.logp[part.mask == 0] == 0).all()
    assert max(deviations) < 1e-5, deviations
    # The recomputation is exact only for the same tokens: changing a completion token changes its log-prob.
    changed = [c.clone() for c in completions]
    changed[0][0] = (changed[0][0] + 1) % len(plugin.adapter.tokenizer)
    with torch.no_grad():
        other, _ = plugin.token_logp(plugin.policy(), prompts, changed, width, with_entropy=False)
    assert abs(float(other[0, 0] - old_logp[0, 0])) > 1e-4


def test_sampling_follows_the_tempered_softmax(lora_plugins, family):
    """generate under the plugin's generation config scores each sampled token with softmax(logits / T): the
    log-probs the plugin recomputes are the sampling distribution's (KV-cache numerics aside)."""
    plugin = lora_plugins[family]
    batch = prompt_batch(plugin.dataset("train")[:2], 2, seed=3)
    prompts = plugin.encode_rows(batch.rows, batch.group_ids)
    inputs, width = plugin.adapter.collate(prompts)
    config = plugin.generation_config(True)
    config.temperature = 0.7
    config.return_dict_in_generate, config.output_scores = True, True
    torch.manual_seed(0)
    with torch.no_grad():
        out = plugin.policy().generate(**inputs, generation_config=config)
    generated = out.sequences[:, width:]
    lengths = completion_lengths(generated, plugin.eos_ids)
    scores = torch.stack(out.scores, dim=1).log_softmax(-1)  # [n, C, V] after the logits processors
    sampled = scores.gather(-1, generated.unsqueeze(-1)).squeeze(-1)
    completions = [generated[i, :int(n)] for i, n in enumerate(lengths)]
    saved = plugin.config.temperature
    plugin.config.temperature = 0.7
    try:
        with torch.no_grad():
            logp, _ = plugin.token_logp(plugin.policy(), prompts, completions, generated.shape[1], with_entropy=False)
    finally:
        plugin.config.temperature = saved
    mask = torch.arange(generated.shape[1]) < lengths.unsqueeze(1)
    torch.testing.assert_close(logp[mask], sampled[mask], rtol=0, atol=1e-4)


@pytest.mark.parametrize("position", ["before", "after"])
def test_image_position_orders_the_user_turn_and_the_log_probs_follow(tiny_models, family, position):
    """plugin.image_position puts the image before or after the question; the rollout's log-probs are those of a
    plain transformers forward of the chat written by hand in that order (the processor called directly)."""
    from mmrl.plugins.vlm.plugin import row_images

    plugin = make_plugin(tiny_models[family], image_position=position)
    rows = plugin.dataset("train")[:2]
    rollout = _rollout(plugin, seed=4, rows=rows)
    image_part = "<|vision_start|><|image_pad|><|vision_end|>"
    model = plugin.policy()
    for i in range(len(rollout.group_ids)):
        row = rows[i // GROUP]
        question = plugin.question(row)
        user = image_part + question if position == "before" else question + image_part
        text = f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        inputs = plugin.adapter.processor(text=[text], images=plugin.adapter.load_images(row_images(row)),
                                          return_tensors="pt")
        prompt_ids = inputs["input_ids"][0]
        assert torch.equal(rollout.replay["input_ids"][i].flatten(), prompt_ids)
        completion = rollout.replay["completion_ids"][i]
        inputs["input_ids"] = torch.cat([prompt_ids, completion]).unsqueeze(0)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        if "mm_token_type_ids" in inputs:
            inputs["mm_token_type_ids"] = torch.cat(
                [inputs["mm_token_type_ids"][0], torch.zeros_like(completion)]).unsqueeze(0)
        with torch.no_grad():
            logits = model(**inputs).logits[0, len(prompt_ids) - 1:-1].float()  # [C, V]
        logits[:, plugin.adapter.suppressed_token_ids()] = -torch.inf  # never sampled: outside the distribution
        expected = (logits / plugin.config.temperature).log_softmax(-1).gather(-1, completion.unsqueeze(-1))[:, 0]
        torch.testing.assert_close(rollout.old_logp[i, :len(completion)], expected, rtol=0, atol=1e-5)


def test_image_position_is_validated(tiny_models):
    with pytest.raises(ConfigError, match="image_position"):
        from_dict(VLMPluginConfig, plugin_options(tiny_models["qwen2_5_vl"], image_position="middle"), "plugin")
    with pytest.raises(ValueError, match="image_position must be one of before, after, got 'middle'"):
        make_plugin(tiny_models["qwen2_5_vl"]).adapter.messages("q", 1, image_position="middle")


def test_checkpoint_generation_config_does_not_leak_into_sampling(tiny_models):
    """Qwen checkpoints ship top_k=1 / repetition_penalty in generation_config.json; sampling must ignore them
    (else the G samples of a prompt would all be the same)."""
    plugin = make_plugin(tiny_models["qwen2_vl"])
    hf_config = plugin.model.generation_config
    hf_config.top_k, hf_config.do_sample, hf_config.repetition_penalty = 1, True, 5.0
    rollout = _rollout(plugin, rows=plugin.dataset("train")[:1], group=4)
    assert len(set(rollout.payload["completions"])) > 1
    assert hf_config.top_k == 1  # restored after generate


def test_rollouts_are_reproducible_per_seed(lora_plugins):
    plugin = lora_plugins["qwen2_5_vl"]
    first, again, other = _rollout(plugin, seed=4), _rollout(plugin, seed=4), _rollout(plugin, seed=5)
    assert first.payload["completions"] == again.payload["completions"]
    assert torch.equal(first.old_logp, again.old_logp)
    assert first.payload["completions"] != other.payload["completions"]


def test_evaluation_decodes_greedily(lora_plugins):
    plugin = lora_plugins["qwen2_vl"]
    rollout = _rollout(plugin, seed=6, group=3, training=False).validate()
    assert rollout.num_actions == 0 and not rollout.replay
    texts = rollout.payload["completions"]
    assert texts[0] == texts[1] == texts[2] and texts[3] == texts[4] == texts[5]
    assert _rollout(plugin, seed=7, group=3, training=False).payload["completions"] == texts


def _perturb_lora(plugin, scale=0.5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in plugin.model.named_parameters():
            if "lora_B" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)


def test_reference_is_the_model_without_its_adapter(tiny_models):
    plugin = make_plugin(tiny_models["qwen2_5_vl"])
    rollout = _rollout(plugin, seed=8)
    with torch.no_grad():
        start = plugin.forward(plugin.policy(), rollout, need_reference=True)
    torch.testing.assert_close(start.ref_logp, start.logp, rtol=0, atol=1e-6)  # LoRA B = 0: KL starts at 0
    _perturb_lora(plugin)
    with torch.no_grad():
        moved = plugin.forward(plugin.policy(), rollout, need_reference=True)
    active = rollout.mask > 0
    assert (moved.logp - moved.ref_logp)[active].abs().max() > 1e-3
    torch.testing.assert_close(moved.ref_logp, start.ref_logp, rtol=0, atol=1e-6)
    assert moved.entropy is not None and (moved.entropy[active] > 0).all()
    assert plugin.reference_module() is None  # nothing for algorithm.ref_sync_every to sync
    assert moved.logp.requires_grad is False and moved.ref_logp.requires_grad is False


def test_saved_adapter_reproduces_log_probs(tiny_models, tmp_path):
    trained = make_plugin(tiny_models["qwen2_vl"])
    _perturb_lora(trained, seed=1)
    rollout = _rollout(trained, seed=9)
    trained.save_trainable(trained.policy(), tmp_path / "policy")
    assert {p.name for p in (tmp_path / "policy").iterdir()} == {"adapter_model.safetensors", "adapter_config.json"}
    fresh = make_plugin(tiny_models["qwen2_vl"])
    with torch.no_grad():
        before = fresh.forward(fresh.policy(), rollout, need_reference=False).logp
        fresh.load_trainable(fresh.policy(), tmp_path / "policy")
        after = fresh.forward(fresh.policy(), rollout, need_reference=False).logp
        expected = trained.forward(trained.policy(), rollout, need_reference=False).logp
    assert torch.equal(after, expected) and torch.equal(expected, rollout.old_logp)
    assert (before - after)[rollout.mask > 0].abs().max() > 1e-3
    # peft itself loads the folder onto the base model.
    from peft import PeftModel

    base = fresh.adapter.load_model(dtype=torch.float32, attn_implementation="eager")
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "policy"))
    with torch.no_grad():
        logp, _ = fresh.token_logp(loaded, replay_prompts(rollout.replay), rollout.replay["completion_ids"],
                                   rollout.num_actions, with_entropy=False)
    assert torch.equal(logp, expected)


def test_loading_an_adapter_of_another_rank_fails_clearly(tiny_models, tmp_path):
    plugin = make_plugin(tiny_models["qwen2_vl"])
    plugin.save_trainable(plugin.policy(), tmp_path)
    other = make_plugin(tiny_models["qwen2_vl"], lora={"rank": 2, "alpha": 8.0})
    with pytest.raises(ValueError, match="holds a LoRA of rank 4 and alpha 8.0; this run has rank 2"):
        other.load_trainable(other.policy(), tmp_path)
    with pytest.raises(FileNotFoundError, match="no LoRA adapter at"):
        other.load_trainable(other.policy(), tmp_path / "missing")


def test_lora_excludes_the_vision_tower_unless_asked(tiny_models):
    frozen = make_plugin(tiny_models["qwen2_5_vl"])
    trainable = [name for name, p in frozen.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name and "visual" not in name for name in trainable)
    assert any("mlp.gate_proj" in name for name in trainable)
    # Qwen2.5-VL's vision MLP also has gate/up/down projections: adapted only with freeze_vision false.
    open_vision = make_plugin(tiny_models["qwen2_5_vl"], freeze_vision=False)
    assert any("visual" in name and p.requires_grad for name, p in open_vision.model.named_parameters())


def test_full_finetuning_freezes_only_the_vision_tower(tiny_models):
    plugin = make_plugin(tiny_models["qwen2_vl"], lora=None)
    tower = plugin.adapter.vision_tower(plugin.model)
    assert not any(p.requires_grad for p in tower.parameters())
    vision = {id(p) for p in tower.parameters()}
    assert all(p.requires_grad for p in plugin.model.parameters() if id(p) not in vision)
    assert plugin._reference is None  # Runtime.needs_reference is False: no frozen copy kept
    with_reference = make_plugin(tiny_models["qwen2_vl"], Runtime(needs_reference=True), lora=None,
                                 freeze_vision=False)
    assert with_reference._reference is not None
    assert all(p.requires_grad for p in with_reference.model.parameters())
    rollout = _rollout(with_reference, seed=10)
    with torch.no_grad():
        output = with_reference.forward(with_reference.policy(), rollout, need_reference=True)
    torch.testing.assert_close(output.ref_logp, output.logp, rtol=0, atol=1e-6)
    # reference_module() (algorithm.ref_sync_every) is the model the reference is scored with
    assert with_reference.reference_module() is with_reference._reference
    with torch.no_grad():
        for p in with_reference.reference_module().parameters():
            p.add_(0.05 * torch.randn_like(p))
        moved = with_reference.forward(with_reference.policy(), rollout, need_reference=True)
    assert (moved.ref_logp - output.ref_logp).abs().max() > 1e-3


def test_reward_context_declares_the_familys_box_convention(lora_plugins, family):
    context = lora_plugins[family].reward_context()
    assert context == {"box_convention": family}
    assert json.loads(json.dumps(context)) == context  # the contract: JSON-serialisable


def test_completion_lengths_stop_at_the_first_eos():
    tokens = torch.tensor([[5, 9, 7, 9], [5, 6, 7, 8], [2, 9, 9, 9], [9, 1, 1, 1]])
    assert completion_lengths(tokens, [9, 2]).tolist() == [2, 4, 1, 1]


def test_save_samples_writes_prompts_outputs_and_rewards(lora_plugins, tmp_path):
    plugin = lora_plugins["qwen2_vl"]
    rollout = _rollout(plugin, seed=11, group=1)
    rollout.rows = plugin.dataset("train")[:PROMPTS]
    (path,) = plugin.save_samples(rollout, torch.tensor([0.5, 0.0, 1.0]), tmp_path, tag="eval")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["reward"] for r in records] == [0.5, 0.0, 1.0]
    assert records[0]["output"] == rollout.payload["completions"][0]
    assert records[0]["image"] == ["<in-memory image>"] and records[0]["task"] == "grounding"


@pytest.mark.parametrize(("overrides", "key", "allowed"), [
    ({"family": "llava"}, "plugin.family", "qwen2_5_vl, qwen2_vl"),
    ({"prompt_template": "Answer: {answer}"}, "plugin.prompt_template", "using {question}"),
    ({"min_pixels": 5000, "max_pixels": 4000}, "plugin.max_pixels", "at least min_pixels"),
    ({"data": {}}, "plugin.data.train", "exactly one of train"),
    ({"data": {"train": "a.jsonl", "synthetic": {}}}, "plugin.data.train", "exactly one of train"),
    ({"data": {"synthetic": {"tasks": ["ocr"]}}}, "plugin.data.synthetic.tasks[0]", "'grounding', 'counting'"),
    ({"top_p": 0.0}, "plugin.top_p", "> 0.0"),
    ({"lora": {"rank": 0}}, "plugin.lora.rank", ">= 1"),  # an optional section names its nested key that failed
])
def test_config_errors_name_the_key(overrides, key, allowed):
    options = plugin_options("unused", **overrides)
    with pytest.raises(ConfigError) as error:
        from_dict(VLMPluginConfig, options, "plugin")
    assert error.value.key == key and allowed in error.value.allowed, str(error.value)


def test_completions_never_contain_vision_placeholders(lora_plugins):
    """A sampled <|image_pad|> would be read as an image slot when the completion is fed back ("Image features and
    image tokens do not match"): placeholders are suppressed in sampling and in the scored distribution."""
    plugin = lora_plugins["qwen2_vl"]
    tokenizer = plugin.adapter.tokenizer
    placeholders = {tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>")}
    assert placeholders <= set(plugin.suppressed_ids)
    assert not set(plugin.suppressed_ids) & set(plugin.eos_ids)
    assert plugin.generation_config(True).suppress_tokens == plugin.suppressed_ids
    rollout = _rollout(plugin, seed=12, rows=plugin.dataset("train")[:4], group=4)
    sampled = torch.cat(rollout.replay["completion_ids"])
    assert not torch.isin(sampled, torch.tensor(sorted(placeholders))).any()


@pytest.mark.parametrize(("family", "options"), [("qwen2_5_vl", {}), ("qwen3_vl", {}), ("qwen3_5", {}), ("gemma3", {}),
                                                ("mistral3", {"cache_image_features": False}),
                                                ("glm46v_moe", {"cache_image_features": False}),
                                                ("smolvlm", {"cache_image_features": False}), ("idefics3", {})])
def test_memory_levers_keep_ratio_one_and_train(tiny_models, family, options, tmp_path):
    """sdpa attention, a bfloat16 base under float32 LoRA adapters and gradient checkpointing: the training forward
    (train mode, checkpointed) reproduces the rollout's log-probs and back-propagates into the adapters only. Qwen3-VL,
    Qwen3.5, Gemma 3 and Mistral 3 (from pixels) deviated by 3e-4 to 3e-3 while the no-grad passes shared the prompt
    pass and the checkpointed one could not. GLM-4.6V's MoE build runs its training pass with the router loss, whose
    logits the adapter's hooks carry out of the checkpointed language model; SmolVLM2 from pixels, v1 from features."""
    from mmrl.plugins.vlm.adapters import vlm_adapters
    from mmrl.plugins.vlm.testing import build_tiny_model

    if BUILD_ADAPTERS.get(family, family) not in vlm_adapters:
        pytest.skip(f"transformers has no {BUILD_ADAPTERS.get(family, family)}")
    model = tiny_models.get(family) or build_tiny_model(family, tmp_path / family)
    plugin = make_plugin(model, attn_implementation="sdpa", dtype="bfloat16", gradient_checkpointing=True,
                         logprob_chunk_size=3, **options)
    assert plugin.model.lm_head.weight.dtype == torch.bfloat16
    adapters = [p for name, p in plugin.model.named_parameters() if p.requires_grad]
    assert adapters and all(p.dtype == torch.float32 for p in adapters)
    rollout = _rollout(plugin, seed=13)
    plugin.model.train()
    output = plugin.forward(plugin.policy(), rollout, need_reference=False)
    assert _ratio_deviation(output.logp.detach(), rollout.old_logp, rollout.mask) < 1e-5
    (output.logp * rollout.mask).sum().backward()
    grads = [p.grad for p in adapters if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    plugin.model.eval()


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_cached_image_features_change_nothing_but_the_cost(tiny_models, family):
    """With the vision tower frozen, running it once per prompt (cache_image_features) gives the same samples and
    log-probs as re-running it from pixel_values in every pass; with the tower trainable the pixels are replayed."""
    cached = make_plugin(tiny_models[family])
    plain = make_plugin(tiny_models[family], cache_image_features=False)
    first, second = _rollout(cached, seed=14), _rollout(plain, seed=14)
    assert "image_embeds" in first.replay and "pixel_values" not in first.replay
    assert "pixel_values" in second.replay and "image_embeds" not in second.replay
    assert first.payload["completions"] == second.payload["completions"]
    torch.testing.assert_close(first.old_logp, second.old_logp, rtol=0, atol=1e-6)
    for pixels, embeds, grid in zip(second.replay["pixel_values"], first.replay["image_embeds"],
                                    first.replay["image_grid_thw"], strict=True):
        assert pixels.shape[0] == 4 * embeds.shape[0] == int(grid.prod(-1).sum())
    with torch.no_grad():
        output = cached.forward(cached.policy(), second.select([3, 1]), need_reference=True)
    torch.testing.assert_close(output.logp, second.old_logp[[3, 1]], rtol=0, atol=1e-6)
    trainable_tower = make_plugin(tiny_models[family], lora=None, freeze_vision=False)
    assert "pixel_values" in _rollout(trainable_tower, seed=14, group=1).replay


def test_fused_lm_head_matches_the_model_logits(tiny_models):
    """The fused head (hidden states through the chunked head) gives the log-probs, entropies and adapter gradients
    of the model's own logits; a head whose weight is not whole outside the call (FSDP, ZeRO-3) is refused."""
    plugin = make_plugin(tiny_models["qwen2_5_vl"])
    _perturb_lora(plugin, seed=2)
    rollout = _rollout(plugin, seed=15)
    prompts, completions = replay_prompts(rollout.replay), rollout.replay["completion_ids"]
    results = []
    for fused in (True, False):
        plugin.config.fused_lm_head = fused
        plugin.model.zero_grad()
        logp, entropy = plugin.token_logp(plugin.policy(), prompts, completions, rollout.num_actions,
                                          with_entropy=True)
        (logp.sum() + entropy.sum()).backward()
        grads = {n: p.grad.clone() for n, p in plugin.model.named_parameters() if p.grad is not None}
        results.append((logp.detach(), entropy.detach(), grads))
    plugin.config.fused_lm_head = True
    (logp_a, entropy_a, grads_a), (logp_b, entropy_b, grads_b) = results
    torch.testing.assert_close(logp_a, logp_b, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy_a, entropy_b, rtol=0, atol=1e-5)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        # The two heads sum the same float32 products in different orders, so an element that is a near-cancelling
        # sum carries an absolute error set by the tensor's scale, not its own: up to 1.2e-6 of the tensor's max here,
        # 1.9e-6 on an element of 4.8e-4 in CI under ATEN_CPU_CAPABILITY=avx2 and MKL_CBWR=COMPATIBLE.
        scale = float(grads_b[name].abs().max())
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-5 * scale + 1e-9)
    head = plugin.model.lm_head
    head.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # what ZeRO-3 leaves outside the call
    with pytest.raises(RuntimeError, match="fused_lm_head: false"):
        plugin.token_logp(plugin.policy(), prompts, completions, rollout.num_actions, with_entropy=False)


# GLM-4.1V and GLM-4.6V (M-RoPE positions, as Qwen2-VL's) check their shared prefill through the rollout's log-probs
# against a plain per-sample forward in test_glm4v.py and test_glm46v.py instead.
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "internvl", "gemma4", "gemma3", "mistral3", "smolvlm",
                                    "idefics3"])
def test_shared_prefill_generates_from_the_same_distribution(tiny_models, family, tmp_path):
    """Prefilling each distinct prompt once and copying its cache to its samples (groups interleaved as the spread
    layout deals them, images of different sizes) gives the logits of a plain batched generate; InternVL's, Gemma
    4's and Gemma 3's shared prefill passes the plain positions generate computes from the padding mask (Gemma 4 and
    3: with the bidirectional image blocks inside the shared prompt; Gemma 3: its token types trimmed with the
    prompt; Mistral 3: its images' sizes left out with the pixels)."""
    from mmrl.plugins.vlm.adapters import vlm_adapters
    from mmrl.plugins.vlm.testing import build_tiny_model

    if family not in vlm_adapters:
        pytest.skip(f"transformers has no {family}")
    plugin = make_plugin(tiny_models.get(family) or build_tiny_model(family, tmp_path / family))
    _perturb_lora(plugin, seed=3)
    rows = plugin.dataset("train")[:3]
    group_ids = torch.tensor([0, 1, 2, 0, 1, 2, 1, 0])
    prompts = plugin.encode_rows([rows[g] for g in group_ids.tolist()], group_ids, model=plugin.model)
    config = plugin.generation_config(False)
    config.return_dict_in_generate, config.output_logits = True, True
    with torch.no_grad():
        plain, width = plugin.adapter.generate(plugin.model, prompts, config, share_prefill=False, decoder="hf")
        shared, shared_width = plugin.adapter.generate(plugin.model, prompts, config, share_prefill=True,
                                                       decoder="hf")
    assert width == shared_width
    assert torch.equal(plain.sequences, shared.sequences)
    torch.testing.assert_close(torch.stack(shared.logits, 1), torch.stack(plain.logits, 1), rtol=0, atol=1e-5)
    assert not torch.equal(plain.sequences[0], plain.sequences[1])  # different prompts, different outputs


def test_qwen3_vl_adapter_rolls_out_and_recomputes(tmp_path):
    """Qwen3-VL (when transformers has it): 16-pixel patches, shared prefill, ratio 1 on a reordered subset, KL
    reference through the disabled adapter, and the feature cache with its deepstack features: the replay carries
    the pooled features and the deepstack features ``[layers, tokens, hidden]`` instead of pixels, the log-probs
    through them equal the pixel path's, and the deepstack features matter (zeroed, the log-probs change)."""
    from mmrl.plugins.vlm.adapters import vlm_adapters

    if "qwen3_vl" not in vlm_adapters:
        pytest.skip("transformers has no Qwen3-VL")
    from mmrl.plugins.vlm.testing import build_tiny_model

    path = build_tiny_model("qwen3_vl", tmp_path / "qwen3")
    plugins = []
    for cache in (True, False):
        torch.manual_seed(0)  # the same LoRA A in both
        plugins.append(make_plugin(path, max_new_tokens=6, cache_image_features=cache))
        _perturb_lora(plugins[-1], seed=4)
    plugin, plain = plugins
    assert plugin.adapter.name == "qwen3_vl" and plugin.adapter.image_factor == 32 and plugin.cache_features
    rollout = _rollout(plugin, seed=16).validate()
    replay = rollout.replay
    assert "pixel_values" not in replay and "image_embeds" in replay
    layers = len(plugin.model.config.vision_config.deepstack_visual_indexes)
    for embeds, deepstack in zip(replay["image_embeds"], replay["image_deepstack"], strict=True):
        assert deepstack.shape == (layers, *embeds.shape)
    part = rollout.select([3, 0, 4])
    with torch.no_grad():
        output = plugin.forward(plugin.policy(), part, need_reference=True)
    assert _ratio_deviation(output.logp, part.old_logp, part.mask) < 1e-5
    assert (output.logp - output.ref_logp)[part.mask > 0].abs().max() > 1e-4
    rows = plugin.dataset("train")[:PROMPTS]
    prompts = plain.encode_rows([row for row in rows for _ in range(GROUP)])
    assert "pixel_values" in prompts[0] and "image_deepstack" not in prompts[0]
    completions = replay["completion_ids"]
    with torch.no_grad():
        pixel_logp, _ = plain.token_logp(plain.policy(), prompts, completions, rollout.num_actions,
                                         with_entropy=False)
        cached = replay_prompts(replay)
        zeroed = [{**p, "image_deepstack": torch.zeros_like(p["image_deepstack"])} for p in cached]
        without, _ = plugin.token_logp(plugin.policy(), zeroed, completions, rollout.num_actions, with_entropy=False)
    torch.testing.assert_close(pixel_logp * rollout.mask, rollout.old_logp * rollout.mask, rtol=0, atol=1e-5)
    assert ((without - rollout.old_logp).abs() * rollout.mask).max() > 1e-4


def test_chat_template_kwargs_reach_the_processors_template(tiny_models):
    """``chat_template_kwargs`` are passed to the processor's chat template with every prompt (Qwen3.5's and
    GLM-4.5V's ``enable_thinking``: an empty think block opens the answer); a key the plugin sets is refused."""
    from mmrl.plugins.vlm.testing import CHAT_TEMPLATE

    switch = ("{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}")
    texts = []
    for kwargs in ({}, {"enable_thinking": False}):
        plugin = make_plugin(tiny_models["qwen2_vl"], chat_template_kwargs=kwargs)
        plugin.adapter.processor.chat_template = CHAT_TEMPLATE.replace(
            "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n" + switch + "{% endif %}")
        prompt = plugin.encode_rows(plugin.dataset("train")[:1])[0]
        texts.append(plugin.adapter.tokenizer.decode(prompt["input_ids"]))
    assert texts[0].endswith("<|im_start|>assistant\n") and texts[1] == texts[0] + "<think>\n\n</think>\n\n"
    with pytest.raises(ConfigError, match="chat_template_kwargs.add_generation_prompt"):
        from_dict(VLMPluginConfig, plugin_options(tiny_models["qwen2_vl"],
                                                  chat_template_kwargs={"add_generation_prompt": False}), "plugin")
