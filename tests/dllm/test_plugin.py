"""The dLLM plugin's rollout contract on the bundled toy checkpoint: shared mask plans, ratio 1, references."""

from __future__ import annotations

import pytest
import torch

from mmrl.config import ConfigError, load_config
from mmrl.plugin import PromptBatch, Runtime, plugin_registry
from mmrl.plugins.dllm import toy
from mmrl.rollout import Rollout
from mmrl.trainer.learn import old_policy_pass

torch.set_num_threads(1)


# The algorithm each objective pairs with (DLLMPlugin.check_config refuses the others).
PAIRED_ALGORITHM = {"wd1": {"policy_loss": "wd1", "advantage": "wd1"}, "spg": {"policy_loss": "spg"}}


def _config(**plugin):
    data = {"plugin": {"name": "dllm", "train_size": 64, "eval_size": 16, **plugin},
            "algorithm": PAIRED_ALGORITHM.get(plugin.get("objective"), {}),
            "rewards": {"functions": [{"name": "gsm8k_answer"}]}}
    return load_config(data).plugin.config


def _plugin(runtime: Runtime | None = None, **plugin):
    return plugin_registry.get("dllm")(_config(**plugin), runtime or Runtime())


def _scored(plugin, rollout, policy=None):
    """The rollout with the old log-probs a training run uses: the dLLM plugin leaves them out and the core scores
    them with the plugin's forward under no_grad (mmrl.trainer.learn.old_policy_pass)."""
    return old_policy_pass(plugin, policy if policy is not None else plugin.policy(), rollout)


def _batch(rows, seeds, training=True):
    n = len(rows)
    return PromptBatch(rows=rows, group_ids=torch.arange(n) // 2, group_size=2, seeds=torch.tensor(seeds),
                       generator=torch.Generator(), training=training)


@pytest.fixture(scope="module")
def plugin():
    return _plugin()


@pytest.fixture(scope="module")
def rows(plugin):
    return plugin.dataset("train")[:6]


def test_rollout_contract_and_ratio_one_on_any_micro_batch(plugin, rows):
    rollout = plugin.rollout(plugin.policy(), _batch(rows, list(range(100, 106)))).validate()
    assert rollout.old_logp is None  # left to the core
    rollout = _scored(plugin, rollout)
    n, g = len(rows), plugin.config.gen_length
    # grpo: one action per completion position, trained up to and including the first EOS.
    assert rollout.old_logp.shape == (n, g) and torch.equal(rollout.mask, rollout.replay["completion_mask"].float())
    assert rollout.replay["completion_ids"].shape == (n, g)
    stops = torch.tensor(plugin.adapter.stop_ids)
    assert rollout.truncated.tolist() == [not bool(torch.isin(ids, stops).any()) for ids in rollout.replay[
        "completion_ids"]]  # no stop token in the generated length (algorithm.mask_truncated)
    assert rollout.replay["plan_masked"].shape == (n, 1, 4, g)  # per sample: [N, plans, draws, L], μ = 1
    assert (rollout.replay["step_map"] >= 0).all()
    assert len(rollout.payload["completions"]) == n
    # The plan scores real completion tokens only; the tail after the first EOS is masked in every draw.
    real = rollout.replay["completion_mask"].bool()[:, None, None]
    assert (rollout.replay["plan_masked"] | real).all()
    assert not ((rollout.replay["plan_weights"] != 0) & ~real).any()
    # forward() on the whole rollout reproduces old_logp exactly (the same rows through the same code); a shuffled
    # subset is another batch shape, whose matmuls may round differently on other CPUs: equal to float32 rounding.
    full = plugin.forward(plugin.policy(), rollout, need_reference=False).logp
    assert torch.equal(full, rollout.old_logp)
    part = rollout.select(torch.tensor([4, 1, 3]))
    torch.testing.assert_close(plugin.forward(plugin.policy(), part, need_reference=False).logp, part.old_logp,
                               rtol=0, atol=1e-5)


def test_a_sample_is_the_same_alone_or_in_a_batch_with_other_prompt_widths(plugin, rows):
    long_rows = [r for r in plugin.dataset("train") if len(r["prompt"]) == 6][:2]
    short_row = next(r for r in plugin.dataset("train") if len(r["prompt"]) == 4)
    together = _scored(plugin, plugin.rollout(plugin.policy(),
                                              _batch([*long_rows, short_row, short_row], [1, 2, 3, 4])))
    alone = _scored(plugin, plugin.rollout(plugin.policy(), _batch([short_row, short_row], [3, 4])))
    assert together.replay["prompt_ids"].shape[1] == 6 and alone.replay["prompt_ids"].shape[1] == 4
    for key in ("completion_ids", "completion_mask", "plan_masked", "plan_weights"):
        assert torch.equal(together.replay[key][2:], alone.replay[key]), key
    assert torch.allclose(together.old_logp[2:], alone.old_logp, atol=1e-6)  # left padding is hidden
    # Rollouts of different prompt widths concatenate (prompts right-padded with zeros) and still replay (to float32
    # rounding: the pooled batch has other shapes than the two it was scored in).
    pooled = Rollout.concat([alone, together])
    assert pooled.replay["prompt_ids"].shape[1] == 6
    torch.testing.assert_close(plugin.forward(plugin.policy(), pooled, need_reference=False).logp, pooled.old_logp,
                               rtol=0, atol=1e-5)


def test_one_step_gives_d1_per_token_log_probs(rows):
    # Independent formula (d1's _get_per_token_logps): every completion position masked, one forward, the log-softmax
    # of each real token; the token columns hold them, zero after the first EOS.
    plugin = _plugin(estimator="one_step")
    rollout = _scored(plugin, plugin.rollout(plugin.policy(), _batch(rows[:4], [5, 6, 7, 8])))
    prompt, completion = rollout.replay["prompt_ids"], rollout.replay["completion_ids"]
    real = rollout.replay["completion_mask"].bool()
    inputs = torch.cat([prompt, torch.full_like(completion, plugin.adapter.mask_id)], dim=1)
    attention = (inputs != plugin.adapter.pad_id).long()
    with torch.no_grad():
        logits = plugin.model(input_ids=inputs, attention_mask=attention,
                              position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits
    logp = logits[:, prompt.shape[1]:].log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(rollout.old_logp, torch.where(real, logp, 0.0), rtol=0, atol=1e-5)


def test_elbo_columns_spread_the_estimate_and_spg_returns_both_bounds(rows):
    grpo = _plugin(estimator="coupled", num_mc_samples=2)
    wd1 = _plugin(objective="wd1", estimator="coupled", num_mc_samples=2)
    a = _scored(grpo, grpo.rollout(grpo.policy(), _batch(rows[:4], [1, 2, 3, 4])))
    b = _scored(wd1, wd1.rollout(wd1.policy(), _batch(rows[:4], [1, 2, 3, 4])))
    real = a.replay["completion_mask"].float()
    sequence = b.old_logp[:, 0]  # wd1: the sequence estimate (same seeds, same plans)
    torch.testing.assert_close(a.old_logp, real * (sequence / real.sum(1)).unsqueeze(1), rtol=0, atol=1e-6)
    assert grpo.max_actions() == grpo.config.gen_length and wd1.max_actions() == 1
    # With one draw of weight 1 per token the EUBO is (1/β)·log p^β = log p per token: both columns agree.
    spg = _plugin(objective="spg", estimator="one_step")
    c = _scored(spg, spg.rollout(spg.policy(), _batch(rows[:4], [1, 2, 3, 4])))
    assert c.old_logp.shape == (4, 2) and spg.max_actions() == 2
    assert torch.allclose(c.old_logp[:, 0], c.old_logp[:, 1], atol=1e-5)
    d = _plugin(objective="spg", num_mc_samples=6)
    e = _scored(d, d.rollout(d.policy(), _batch(rows[:4], [1, 2, 3, 4])))
    assert not torch.allclose(e.old_logp[:, 0], e.old_logp[:, 1])
    assert torch.equal(d.forward(d.policy(), e, need_reference=False).logp, e.old_logp)


def test_reference_is_scored_with_the_same_plan():
    full = _plugin(runtime=Runtime(needs_reference=True))
    rows = full.dataset("train")[:4]
    rollout = _scored(full, full.rollout(full.policy(), _batch(rows, [1, 2, 3, 4])))
    assert torch.equal(rollout.ref_logp, rollout.old_logp)  # the frozen copy equals the policy at the start
    with torch.no_grad():
        for p in full.policy().parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = full.forward(full.policy(), rollout, need_reference=True)
    assert torch.equal(out.ref_logp, rollout.ref_logp)
    assert not torch.equal(out.logp, rollout.old_logp)
    # reference_module() (algorithm.ref_sync_every) is the copy the reference is scored with: moved onto the
    # policy, a new rollout's reference log-probs are the policy's
    with torch.no_grad():
        for target, p in zip(full.reference_module().parameters(), full.policy().parameters(), strict=True):
            target.copy_(p)
    moved = _scored(full, full.rollout(full.policy(), _batch(rows, [5, 6, 7, 8])))
    torch.testing.assert_close(moved.ref_logp, moved.old_logp, rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError, match="needs_reference"):
        _plugin().forward(full.policy(), rollout, need_reference=True)


def test_lora_trains_the_adapter_only_and_its_reference_is_the_adapter_off_model(tmp_path):
    lora = _plugin(runtime=Runtime(needs_reference=True), lora={"rank": 4, "alpha": 8.0})
    assert lora.reference_module() is None  # nothing to sync: the reference is the adapter-off model
    trainable = [name for name, p in lora.policy().named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    rows = lora.dataset("train")[:4]
    with torch.no_grad():
        for name, p in lora.policy().named_parameters():
            if "lora_B" in name:
                p.add_(0.05)
    rollout = _scored(lora, lora.rollout(lora.policy(), _batch(rows, [1, 2, 3, 4])))
    base = _plugin()  # the checkpoint without any adapter scores the stored completions with the stored plans
    assert torch.allclose(rollout.ref_logp, base.forward(base.policy(), rollout, need_reference=False).logp,
                          atol=1e-6)
    assert not torch.allclose(rollout.old_logp, rollout.ref_logp)
    lora.save_trainable(lora.policy(), tmp_path)
    assert (tmp_path / "adapter_model.safetensors").is_file() and (tmp_path / "adapter_config.json").is_file()
    again = _plugin(lora={"rank": 4, "alpha": 8.0})
    again.load_trainable(again.policy(), tmp_path)
    assert torch.equal(again.forward(again.policy(), rollout, need_reference=False).logp, rollout.old_logp)


def test_evaluation_rollouts_are_greedy_and_train_nothing(plugin, rows):
    a = plugin.rollout(plugin.policy(), _batch(rows[:4], [1, 2, 3, 4], training=False))
    b = plugin.rollout(plugin.policy(), _batch(rows[:4], [9, 8, 7, 6], training=False))
    assert a.payload["completions"] == b.payload["completions"]
    assert float(a.mask.sum()) == 0.0 and "plan_masked" not in a.replay


def test_config_errors_name_the_key():
    cases = [
        ({"block_length": 3}, "plugin.block_length"),
        ({"gen_length": 8, "block_length": 4, "steps": 3}, "plugin.steps"),
        ({"estimator": "elbo_x"}, "plugin.estimator"),
        ({"estimator": "elbo_l", "estimator_options": {"p_mask_prompt": 0.1}}, "plugin.estimator_options"),
        ({"estimator": "one_step", "estimator_options": {"p_mask_prompt": "high"}}, "plugin.estimator_options"),
        ({"estimator": "coupled", "num_mc_samples": 3}, "plugin.num_mc_samples"),
        ({"estimator": "coupled_cv", "num_mc_samples": 1}, "plugin.num_mc_samples"),
        ({"estimator": "coupled_cv", "objective": "spg"}, "plugin.estimator"),
        ({"adapter": "gpt"}, "plugin.adapter"),
        ({"objective": "ppo"}, "plugin.objective"),
        ({"prompt_template": "no fields"}, "plugin.prompt_template"),
        ({"normalize_by_length": True}, "plugin.normalize_by_length"),  # grpo: the aggregation weights tokens
    ]
    for options, key in cases:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            _config(**options)


def test_files_dataset_and_prompt_template(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"prompt": "2+2", "solution": "4"}\n{"prompt": "3+4", "solution": "7"}\n')
    (folder / "test.jsonl").write_text('{"prompt": "1+1", "solution": "2"}\n')
    plugin = _plugin(dataset=str(folder), prompt_template="{prompt}=")
    assert [r["prompt"] for r in plugin.dataset("train")] == ["2+2", "3+4"]
    ids, lengths = plugin.encode_prompts(plugin.dataset("eval"))
    assert plugin.adapter.tokenizer.decode(ids[0]) == "1+1=" and lengths.tolist() == [4]
    bad = _plugin(dataset=str(folder), prompt_template="{question}")
    with pytest.raises(ValueError, match="prompt_template"):
        bad.encode_prompts(bad.dataset("train"))
    # Left padding is the leading run of the pad id: a prompt that starts with it would lose its first token.
    digit_pad = _plugin(dataset=str(folder), pad_token_id=plugin.adapter.tokenizer.convert_tokens_to_ids("3"))
    digit_pad.encode_prompts(plugin.dataset("eval"))  # "1+1=" does not start with "3"
    with pytest.raises(ValueError, match="prompt 1 starts with the padding token id"):
        digit_pad.encode_prompts(digit_pad.dataset("train"))


def test_encoded_prompts_of_repeated_rows_are_each_rows_own(plugin):
    """A group's samples share a row object (each distinct text is tokenized once): every row still gets the ids of
    its own text tokenized alone, left-padded to the longest, whether its row object is shared, equal or new."""
    rows = plugin.dataset("train")[:3]
    batch = [rows[0]] * 3 + [rows[1], dict(rows[0]), rows[2], rows[1]]
    ids, lengths = plugin.encode_prompts(batch)  # [7, w]
    tokenizer, width = plugin.adapter.tokenizer, ids.shape[1]
    for row, got, length in zip(batch, ids.tolist(), lengths.tolist(), strict=True):
        alone = tokenizer(plugin.config.prompt_template.format_map(row), add_special_tokens=False)["input_ids"]
        assert got == [plugin.adapter.pad_id] * (width - len(alone)) + alone and length == len(alone)


def test_bundled_checkpoint_is_the_default():
    assert (toy.ASSETS / "model.safetensors").is_file() and (toy.ASSETS / "tokenizer.json").is_file()
    plugin = _plugin()
    assert plugin.adapter.name == "masked_lm"
    assert (plugin.adapter.mask_id, plugin.adapter.stop_ids, plugin.adapter.pad_id) == (1, (2,), 0)


# Written in characters the toy tokenizer knows (digits and "+="): the generation prompt gains "00" without thinking.
THINKING_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}="
                     "{% if enable_thinking is defined and not enable_thinking %}00{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template_and_are_checked():
    """``chat_template_kwargs`` are the chat template's variables (TRL's GRPOConfig.chat_template_kwargs): the
    prompt text changes with them; keys the plugin sets, and kwargs without chat_template, are refused."""
    texts = {}
    for kwargs in ({}, {"enable_thinking": False}):
        plugin = _plugin(chat_template=True, chat_template_kwargs=kwargs)
        plugin.adapter.tokenizer.chat_template = THINKING_TEMPLATE
        ids, lengths = plugin.encode_prompts(plugin.dataset("train")[:1])
        texts[bool(kwargs)] = plugin.adapter.tokenizer.decode(ids[0, -int(lengths[0]):])
    assert texts[True] == texts[False] + "00" and texts[False].endswith("==")  # the prompt's "=" and the template's
    with pytest.raises(ConfigError, match="chat_template_kwargs.tokenize"):
        _config(chat_template=True, chat_template_kwargs={"tokenize": True})
    with pytest.raises(ConfigError, match="chat_template_kwargs.*unless chat_template is true"):
        _config(chat_template_kwargs={"enable_thinking": False})
