"""TraceRL's trajectory-aware estimator (``estimator: trace``) against TraceRL's row construction restated from its
released code (Gen-Verse/dLLM-RL@10b4fd1 ``train/rl_llada.py`` L203-292), per-token log-probs against a plain loop
over the tokens, the ratio on-policy through the plugin, GRPO steps through the trainer, and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from transformers import BertConfig, BertForMaskedLM

from mmrl.config import ConfigError, load_config
from mmrl.plugin import PromptBatch, Runtime, plugin_registry
from mmrl.plugins.dllm.estimators import likelihood_estimators, plan_token_logprobs
from mmrl.plugins.dllm.generation import guided
from mmrl.plugins.dllm.masking import trace_groups, trace_plan
from mmrl.trainer import Trainer
from mmrl.trainer.learn import old_policy_pass

torch.set_num_threads(1)

VOCAB, PAD, MASK, EOS = 12, 0, 11, 2


# ---------------------------------------------------------------------- TraceRL restated
def _collapse_k_unique(steps: list[int], k: int) -> list[int]:
    """``collapse_k_unique`` (rl_llada.py L203-215): each step mapped to the last distinct step of its group of k."""
    distinct = sorted(set(steps))
    representative = {}
    for index, value in enumerate(distinct):
        representative[value] = distinct[min((index // k + 1) * k - 1, len(distinct) - 1)]
    return [representative[s] for s in steps]


def _tracerl_rows(prompt: list[int], response: list[int], step_map: list[int], *, shrink: int, post_num: int = 0,
                  pad_id: int = PAD, mask_id: int = MASK) -> list[tuple[list[int], list[bool]]]:
    """The TraceRL rows of one response, as ``prepare_inputs_and_labels_for_text`` builds them (L254-288): the
    prompt's positions get order −1 (never masked, never scored); for every distinct order value in increasing order,
    the row masks the positions whose order is >= it and scores those equal to it, except the response's pad ids
    beyond the first ``post_num`` (``tail_pad_b``); a row that scores nothing is skipped. Returns (noisy ids, scored).
    """
    order_full = [-1] * len(prompt) + _collapse_k_unique(step_map, shrink)
    base = prompt + response
    pads = [i >= len(prompt) and token == pad_id for i, token in enumerate(base)]
    seen, tail_pad = 0, []
    for is_pad in pads:
        seen += is_pad
        tail_pad.append(is_pad and seen > post_num)
    rows = []
    for step in sorted(set(order_full[len(prompt):])):
        scored = [o == step and not t for o, t in zip(order_full, tail_pad, strict=True)]
        if not any(scored):
            continue
        noisy = [mask_id if o >= step else token for o, token in zip(order_full, base, strict=True)]
        rows.append((noisy, scored))
    return rows


def _plan_rows(prompt: Tensor, completion: Tensor, real: Tensor, step_map: Tensor, shrink: int, tail: str):
    """mmrl's trace plan as TraceRL-style rows per sample: (model input, scored over prompt + completion)."""
    plan = trace_plan(prompt, completion, real, step_map=step_map, shrink=shrink, tail=tail)
    inputs = plan.model_inputs(prompt, completion, MASK).reshape(plan.num_samples, prompt.shape[0], -1)  # [N, B, T]
    scored = torch.cat([torch.zeros(*plan.scored.shape[:2], prompt.shape[1], dtype=torch.bool), plan.scored], -1)
    return plan, [[(inputs[n, b].tolist(), scored[n, b].tolist()) for n in range(plan.num_samples)
                   if scored[n, b].any()] for b in range(prompt.shape[0])]


# Hand-made trajectories: width-3 prompts (the second left-padded), 8 completion positions, the tail after EOS filled
# with the pad id (as LLaDA fills it with <|endoftext|> after <|eot_id|>), decoded in two or four blocks.
PROMPTS = torch.tensor([[5, 6, 7], [PAD, 8, 9], [PAD, PAD, 4]])
COMPLETIONS = torch.tensor([[3, 4, 5, EOS, PAD, PAD, PAD, PAD],   # EOS in block 0, the tail in block 1
                            [6, 7, 8, 9, 10, 3, EOS, PAD],        # the tail decoded before real tokens
                            [4, 4, 5, 6, 7, 8, 9, 10]])            # no stop token: every position real
STEP_MAPS = torch.tensor([[2, 0, 3, 1, 4, 6, 4, 7],      # two blocks of 4, one token per step; tail steps 4, 6, 4, 7
                          [1, 1, 0, 3, 5, 5, 4, 4],      # several per step; step 2 commits nothing (a gap)
                          [0, 0, 2, 3, 4, 5, 7, 6]])     # four blocks of 2


def _real(completion: Tensor) -> Tensor:
    """Up to and including the first EOS (the plugin's completion_mask)."""
    after = (completion == EOS).long().cumsum(dim=1)
    return ((after == 0) | ((after == 1) & (completion == EOS))).long()


@pytest.mark.parametrize("shrink", [1, 2, 3, 8])
def test_trace_plan_rows_are_tracerls_rows(shrink):
    """tail "trajectory": exactly TraceRL's rows (with post_num 0 the pad tail is never scored; the EOS, not the pad
    id, is scored, as <|eot_id|> is in TraceRL); tail "masked": the same rows with the tail masked in every row."""
    real = _real(COMPLETIONS)
    for tail in ("trajectory", "masked"):
        plan, rows = _plan_rows(PROMPTS, COMPLETIONS, real, STEP_MAPS, shrink, tail)
        for b in range(3):
            expected = _tracerl_rows(PROMPTS[b].tolist(), COMPLETIONS[b].tolist(), STEP_MAPS[b].tolist(),
                                     shrink=shrink)
            if tail == "masked":
                width = PROMPTS.shape[1]
                expected = [([MASK if i >= width and not real[b, i - width] else t for i, t in enumerate(ids)], s)
                            for ids, s in expected]
            assert rows[b] == expected, (tail, shrink, b)
        # Each real token is scored in exactly one row, with weight N so that the row mean is the token's log-prob.
        assert torch.equal(plan.scored.sum(0), real.bool().long())
        assert bool((plan.weights[plan.scored] == plan.num_samples).all())
    # Sample 1 commits its tail (step 4, with its EOS) before two real tokens (step 5): their rows see the tail as
    # decoded with tail "trajectory" and masked with tail "masked".
    _, masked = _plan_rows(PROMPTS, COMPLETIONS, real, STEP_MAPS, 1, "masked")
    _, visible = _plan_rows(PROMPTS, COMPLETIONS, real, STEP_MAPS, 1, "trajectory")
    assert masked[0] == visible[0] and masked[1] != visible[1]


def test_trace_groups_merge_distinct_steps():
    # Distinct steps 0, 1, 3, 4, 5 → ranks 0..4 → groups of 2: {0, 1}, {3, 4}, {5}.
    assert trace_groups(torch.tensor([[5, 0, 3, 1, 4, 3]]), 2).tolist() == [[2, 0, 1, 0, 1, 1]]
    assert trace_groups(torch.tensor([[5, 0, 3, 1, 4, 3]]), 1).tolist() == [[4, 0, 2, 1, 3, 2]]


# ---------------------------------------------------------------------- log-probs against a plain loop
@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, initializer_range=0.5,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForMaskedLM(config).eval()
    return lambda ids: model(input_ids=ids).logits


def _loop_logprobs(model, prompt: Tensor, completion: Tensor, real: Tensor, step_map: Tensor, shrink: int,
                   tail: str, mask_id: int = MASK) -> Tensor:
    """For every real token: one forward of the context TraceRL defines (its group and every later group masked, via
    the restated collapse_k_unique; the tail masked too with tail "masked") and log_softmax at its position."""
    out = torch.zeros(completion.shape, dtype=torch.float64)
    for b in range(completion.shape[0]):
        order = _collapse_k_unique(step_map[b].tolist(), shrink)
        for i in range(completion.shape[1]):
            if not real[b, i]:
                continue
            row = completion[b].clone()
            hidden = [j for j in range(len(order)) if order[j] >= order[i] or (tail == "masked" and not real[b, j])]
            row[hidden] = mask_id
            with torch.no_grad():
                logits = model(torch.cat([prompt[b], row]).unsqueeze(0))[0, prompt.shape[1] + i].double()
            out[b, i] = logits.log_softmax(-1)[completion[b, i]]
    return out


@pytest.mark.parametrize(("shrink", "tail"), [(1, "trajectory"), (2, "masked"), (3, "trajectory"), (8, "masked")])
def test_per_token_logprobs_match_a_loop_over_tokens(bert, shrink, tail):
    real = _real(COMPLETIONS)
    plan = trace_plan(PROMPTS, COMPLETIONS, real, step_map=STEP_MAPS, shrink=shrink, tail=tail)
    with torch.no_grad():
        token_logp = plan_token_logprobs(bert, PROMPTS, COMPLETIONS, plan, mask_id=MASK)  # [N, B, L]
    per_token = (plan.weights * token_logp).mean(0)  # what the plugin puts in each token column
    expected = _loop_logprobs(bert, PROMPTS, COMPLETIONS, real.bool(), STEP_MAPS, shrink, tail)
    torch.testing.assert_close(per_token.double(), expected, rtol=0, atol=2e-5)
    # The registered estimator: the sum, the same whether the rows of the three completions go in one forward or in
    # forwards of two rows.
    estimator = likelihood_estimators["trace"]
    with torch.no_grad():
        packed = estimator(bert, PROMPTS, COMPLETIONS, real, mask_id=MASK, step_map=STEP_MAPS, shrink=shrink, tail=tail)
        split = estimator(bert, PROMPTS, COMPLETIONS, real, mask_id=MASK, step_map=STEP_MAPS, shrink=shrink, tail=tail,
                          micro_batch=2)
    torch.testing.assert_close(packed.double(), expected.sum(1), rtol=0, atol=1e-4)
    torch.testing.assert_close(split, packed, rtol=0, atol=1e-5)
    # The context matters on this model (else the check above could not tell contexts apart): d1's one-step score
    # (every completion position masked) gives other log-probs, unless one group holds every step (shrink 8: at
    # most 8 distinct steps here), where trace with the tail masked is the one-step score.
    one_step = likelihood_estimators["one_step"](bert, PROMPTS, COMPLETIONS, real, mask_id=MASK)
    if shrink == 8 and tail == "masked":
        torch.testing.assert_close(packed, one_step, rtol=0, atol=1e-5)
    else:
        assert (packed - one_step).abs().max() > 1e-1


def test_rows_are_one_forward_per_step_group(bert):
    """Forwarded rows = the step groups holding real tokens, summed over completions, in one batch."""
    calls = []

    def counting(ids):
        calls.append(ids.shape[0])
        return bert(ids)

    real = _real(COMPLETIONS)
    likelihood_estimators["trace"](counting, PROMPTS, COMPLETIONS, real, mask_id=MASK, step_map=STEP_MAPS, shrink=2)
    groups = sum(len(_tracerl_rows(PROMPTS[b].tolist(), COMPLETIONS[b].tolist(), STEP_MAPS[b].tolist(), shrink=2))
                 for b in range(3))
    assert calls == [groups]


# ---------------------------------------------------------------------- through the plugin (toy checkpoint)
def _plugin(runtime: Runtime | None = None, algorithm: dict | None = None, **plugin):
    data = {"plugin": {"name": "dllm", "train_size": 64, "eval_size": 16, "estimator": "trace",
                       "gen_length": 4, "block_length": 2, "steps": 4, **plugin},
            "algorithm": algorithm or {}, "rewards": {"functions": [{"name": "gsm8k_answer"}]}}
    return plugin_registry.get("dllm")(load_config(data).plugin.config, runtime or Runtime())


def _batch(plugin, seeds):
    rows = plugin.dataset("train")[: len(seeds)]
    return PromptBatch(rows=rows, group_ids=torch.arange(len(rows)) // 2, group_size=2, seeds=torch.tensor(seeds),
                       generator=torch.Generator())


@pytest.mark.parametrize("sampler", ["llada", "dream"])
def test_plugin_scores_the_sampled_trajectory_per_token_with_ratio_one(sampler):
    """Greedy decoding (LLaDA's sampler: two blocks of two positions; Dream's: one block), shrink 1, tail
    "trajectory": every real token is the argmax (the mask token excluded) of its trace row, i.e. the row is the
    sampler's state when it committed the token. The columns equal the loop over tokens; π_old, π_ref and π_θ agree
    exactly (the ratio is 1) and one plan serves every epoch."""
    geometry = {"block_length": 2} if sampler == "llada" else {"block_length": 4, "sampler": "dream"}
    plugin = _plugin(Runtime(needs_reference=True, inner_epochs=2), temperature=0.0,
                     estimator_options={"shrink": 1, "tail": "trajectory"}, **geometry)
    policy = plugin.policy()
    rollout = plugin.rollout(policy, _batch(plugin, [1, 2, 3, 4, 5, 6]))
    replay = rollout.replay
    assert plugin.num_plans() == 1 and not plugin.redraws_per_epoch and "plan_masked" not in replay
    prompt, completion, real = replay["prompt_ids"], replay["completion_ids"], replay["completion_mask"]
    step_map = replay["step_map"]
    if sampler == "llada":  # block 0 at steps 0-1, block 1 at steps 2-3
        assert bool((step_map[:, :2] < 2).all() and (step_map[:, 2:] >= 2).all())

    def model(ids):
        return plugin.adapter.logits(plugin.model, ids)

    expected = _loop_logprobs(model, prompt, completion, real.bool(), step_map, 1, "trajectory", plugin.adapter.mask_id)
    rollout = old_policy_pass(plugin, policy, rollout)
    torch.testing.assert_close(rollout.old_logp.double(), expected, rtol=0, atol=2e-5)
    out = plugin.forward(policy, rollout, need_reference=True)
    assert torch.equal(out.logp.detach(), rollout.old_logp) and torch.equal(rollout.ref_logp, rollout.old_logp)
    for b in range(completion.shape[0]):  # greedy decoding chose each token in exactly its trace row's context
        for i in range(completion.shape[1]):
            if real[b, i]:
                row = torch.where(step_map[b] >= step_map[b, i], plugin.adapter.mask_id, completion[b])
                with torch.no_grad():
                    logits = model(torch.cat([prompt[b], row]).unsqueeze(0))[0, prompt.shape[1] + i]
                logits[plugin.adapter.mask_id] = float("-inf")
                assert int(logits.argmax()) == int(completion[b, i])


def test_plugin_trace_with_guidance_and_the_wd1_sequence_estimate():
    """cfg_scale: every trace row is scored with the guided logits (as the sampler decoded); objective wd1: the
    sequence estimate is the sum of the token log-probs."""
    plugin = _plugin(cfg_scale=1.0, estimator_options={"shrink": 2})
    policy = plugin.policy()
    rollout = old_policy_pass(plugin, policy, plugin.rollout(policy, _batch(plugin, [7, 8, 9, 10])))
    prompt, completion, real = (rollout.replay[k] for k in ("prompt_ids", "completion_ids", "completion_mask"))
    model = guided(lambda ids: plugin.adapter.logits(plugin.model, ids), scale=1.0, mask_id=plugin.adapter.mask_id,
                   pad_id=plugin.adapter.pad_id, prompt_length=prompt.shape[1])
    expected = _loop_logprobs(model, prompt, completion, real.bool(), rollout.replay["step_map"], 2, "masked",
                              plugin.adapter.mask_id)
    torch.testing.assert_close(rollout.old_logp.double(), expected, rtol=0, atol=2e-5)
    wd1 = _plugin(objective="wd1", estimator_options={"shrink": 2},
                  algorithm={"policy_loss": {"name": "wd1"}, "advantage": {"name": "wd1"}})
    sequence = wd1.score(wd1.adapter.scorer(wd1.policy()), rollout.replay)
    plain = _plugin(estimator_options={"shrink": 2})
    tokens = plain.score(plain.adapter.scorer(plain.policy()), rollout.replay)
    torch.testing.assert_close(sequence[:, 0], tokens.sum(1), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- training
def test_grpo_steps_with_trace_train_with_ratio_one(tmp_path):
    """Two GRPO steps of two inner epochs with a k3 KL: the core's old-policy pass and the training forward rebuild
    the same rows from the step map, so every first inner step has ratio exactly 1; the weights move."""
    base = {
        "plugin": {"name": "dllm", "attn_implementation": "eager", "train_size": 64, "eval_size": 4,
                   "estimator": "trace", "estimator_options": {"shrink": 2}, "block_length": 2},
        "run": {"max_steps": 2, "seed": 0, "progress": False, "save_every": 0, "output_dir": str(tmp_path)},
        "rollout": {"prompts_per_step": 2, "group_size": 4},
        "algorithm": {"inner_epochs": 2, "micro_batch_size": 8, "kl_coef": 0.01},
        "optim": {"lr": 1e-4},
        "rewards": {"functions": [{"name": "gsm8k_answer"}]},
        "eval": {"at_start": False, "every": 0},
    }
    trainer = Trainer(load_config(base))
    before = {name: p.detach().clone() for name, p in trainer.plugin.policy().named_parameters()}
    history = trainer.train().history
    assert [record["step"] for record in history] == [1, 2]
    assert all(record["loss/first_step_ratio_deviation"] == 0.0 for record in history)
    assert all(0 < record["policy/kl"] < 1 for record in history)  # the k3 KL acts on the per-token columns
    assert any(not torch.equal(before[name], p) for name, p in trainer.plugin.policy().named_parameters())


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("overrides", "key", "match"), [
    ({"objective": "spg"}, "plugin.objective", "grpo or wd1 with estimator trace"),
    ({"estimator_options": {"shrink": 0}}, "plugin.estimator_options.shrink", "an integer >= 1"),
    ({"estimator_options": {"tail": "visible"}}, "plugin.estimator_options.tail", "masked"),
    ({"estimator_options": {"p_mask_prompt": 0.15}}, "plugin.estimator_options.p_mask_prompt", "shrink=8"),
])
def test_config_refuses_what_trace_cannot_do(overrides, key, match):
    data = {"plugin": {"name": "dllm", "estimator": "trace", **overrides},
            "rewards": {"functions": [{"name": "gsm8k_answer"}]}}
    with pytest.raises(ConfigError, match=match) as info:
        load_config(data)
    assert info.value.key == key


def test_direct_calls_refuse_a_missing_or_bad_step_map(bert):
    real = _real(COMPLETIONS)
    estimator = likelihood_estimators["trace"]
    with pytest.raises(ValueError, match="needs step_map"):
        estimator(bert, PROMPTS, COMPLETIONS, real, mask_id=MASK)
    with pytest.raises(ValueError, match=r"step_map must be \[B, L\] = \(3, 8\)"):
        estimator(bert, PROMPTS, COMPLETIONS, real, mask_id=MASK, step_map=STEP_MAPS[:, :4])
    undecoded = STEP_MAPS.clone()
    undecoded[1, 2] = -1  # a real token the sampler never committed (canvas step maps use -1)
    with pytest.raises(ValueError, match="no decoding step .* position 2 of sample 1"):
        estimator(bert, PROMPTS, COMPLETIONS, real, mask_id=MASK, step_map=undecoded)
    with pytest.raises(ValueError, match="shrink must be a positive int"):
        estimator(bert, PROMPTS, COMPLETIONS, real, mask_id=MASK, step_map=STEP_MAPS, shrink=0)
    with pytest.raises(ValueError, match="integer tensor"):
        estimator(bert, PROMPTS, COMPLETIONS, real, mask_id=MASK, step_map=STEP_MAPS.float())


def test_canvas_models_refuse_trace(tmp_path):
    """DiffusionGemma has no mask token and its step map records argmax changes of a uniform-noise canvas, not
    commits: the canvas adapter refuses every masked-model estimator, trace included."""
    from mmrl.plugins.dllm.testing import save_tiny_diffusion_gemma

    checkpoint = save_tiny_diffusion_gemma(tmp_path / "model", canvas_length=4)
    data = {"plugin": {"name": "dllm", "model": checkpoint, "train_size": 8, "eval_size": 2, "gen_length": 4,
                       "block_length": 4, "steps": 4, "estimator": "trace"},
            "run": {"output_dir": str(tmp_path / "run")}, "rewards": {"functions": [{"name": "gsm8k_answer"}]}}
    with pytest.raises(ConfigError, match="uniform_one_step \\(or null\\) for the diffusion_gemma canvas model"):
        Trainer(load_config(data))


def test_tracerl_recipe_uses_tracerls_numbers():
    """configs/dllm/llada8b_tracerl_math.yaml against TraceRL's configs/rl_llada.yaml (Gen-Verse/dLLM-RL@10b4fd1):
    shrink 8, eps 0.2, 32 tasks x 8 responses, 512 tokens in blocks of 32 with 512 steps at temperature 0.8,
    prompts up to 512 tokens, lr 1e-6, betas (0.9, 0.999), no weight decay, max grad norm 1.0, 50 steps."""
    from pathlib import Path

    config = load_config(Path(__file__).resolve().parents[2] / "configs" / "dllm" / "llada8b_tracerl_math.yaml")
    plugin, algorithm, optim = config.plugin.config, config.algorithm, config.optim
    assert plugin.resolved_estimator == "trace" and plugin.per_token and plugin.lora is None
    assert plugin.estimator_options == {"shrink": 8, "tail": "trajectory"}
    assert (plugin.gen_length, plugin.block_length, plugin.steps, plugin.max_prompt_length) == (512, 32, 512, 512)
    assert plugin.temperature == pytest.approx(0.8) and plugin.remasking == "low_confidence"
    assert (config.rollout.prompts_per_step, config.rollout.group_size, config.run.max_steps) == (32, 8, 50)
    options = algorithm.policy_loss.options
    assert algorithm.policy_loss.name == "grpo" and options["clip_low"] == options["clip_high"] == pytest.approx(0.2)
    assert algorithm.advantage.name == "grpo" and algorithm.aggregation == "token_mean"
    assert (algorithm.inner_epochs, algorithm.minibatches) == (1, 8)
    assert (optim.lr, optim.betas, optim.weight_decay, optim.max_grad_norm) == (1e-6, [0.9, 0.999], 0.0, 1.0)


def test_an_empty_batch_gives_an_empty_plan():
    """No completions (an empty micro-batch): one empty row, nothing scored, as the drawn plans give."""
    from mmrl.plugins.dllm.masking import trace_plan

    plan = trace_plan(torch.ones(0, 3, dtype=torch.long), torch.ones(0, 4, dtype=torch.long), torch.ones(0, 4),
                      step_map=torch.zeros(0, 4, dtype=torch.long), shrink=8)
    assert tuple(plan.weights.shape) == (1, 0, 4) and tuple(plan.completion_masked.shape) == (1, 0, 4)
