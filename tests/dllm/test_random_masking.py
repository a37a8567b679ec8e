"""UniGRPO's random masking (``estimator: random_masking``) against dLLM-RL's row construction restated from its code
(Gen-Verse/dLLM-RL@10b4fd1 ``train/rl_llada.py`` L301-399), its law by enumeration, its per-token columns against a
loop over the rows, and through the plugin: the action mask, the ratio on-policy, per-sample plans, the refusals."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from mmrl.config import ConfigError, load_config
from mmrl.plugin import PromptBatch, Runtime, plugin_registry
from mmrl.plugins.dllm.estimators import draw_plan, likelihood_estimators, plan_token_logprobs, score_plan
from mmrl.plugins.dllm.masking import SampleStreams, random_masking_plan
from mmrl.trainer.learn import old_policy_pass
from tests.dllm.test_estimators import MASK, PAD, TinyMaskedLM

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model() -> TinyMaskedLM:
    torch.manual_seed(0)
    return TinyMaskedLM().eval()


def _batch() -> tuple[Tensor, Tensor, Tensor]:
    """Two samples with L = 3 and L = 5 real tokens, right-padded to width 6."""
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    completion = torch.tensor([[1, 5, 7, PAD, PAD, PAD], [2, 2, 9, 0, 3, PAD]])
    return prompt, completion, (completion != PAD).long()


# ---------------------------------------------------------------------- dLLM-RL's construction, restated
def dllm_rl_rows(prompt: Tensor, completion: Tensor, real: Tensor, t_uniforms: Tensor, r_uniforms: Tensor, *,
                 lower: float, upper: float, coupled: bool) -> list[list[tuple[Tensor, Tensor]]]:
    """``prepare_inputs_and_labels_for_text`` for ``method == "random_masking"`` (L301-345) or ``"coupled"``
    (L347-399), one sample at a time, with the uniforms it would draw given explicitly (``t_uniforms [D, B]`` for its
    ``torch.rand(1)``, ``r_uniforms [D, B, G]`` for the completion part of its ``torch.rand(L)``: the prompt part is
    cleared at once). ``post_num`` makes the pads after the first ``post_num`` the tail (``tail_pad_b``): mmrl's
    positions after the first stop token. Returns, per sample, its rows ``(noisy ids [P+G], p_mask [G])``; a row
    that masks nothing is dropped (``if not rand_mask.any(): continue``; ``if comp_mask.any()``)."""
    width = prompt.shape[1]
    samples = []
    for b in range(completion.shape[0]):
        tail = ~real[b].bool()  # tail_pad_b over the completion
        rows = []
        for d in range(t_uniforms.shape[0]):
            t = (upper - lower) * float(t_uniforms[d, b]) + lower
            rand_mask = torch.cat([torch.zeros(width, dtype=torch.bool), r_uniforms[d, b] < t])  # prompt cleared
            rand_mask[width:] &= ~tail
            masks = [rand_mask]
            if coupled:
                comp_mask = torch.zeros_like(rand_mask)
                comp_mask[width:] = ~rand_mask[width:] & ~tail
                masks.append(comp_mask)
            for mask in masks:
                if not mask.any():
                    continue
                noisy = torch.cat([prompt[b], completion[b]])
                noisy[mask] = MASK
                noisy[width:][tail] = MASK  # noisy_ids[tail_pad_b] = mask_id
                rows.append((noisy, mask[width:]))
        samples.append(rows)
    return samples


@pytest.mark.parametrize("coupled", [False, True])
def test_plan_rows_are_dllm_rls_rows(coupled):
    """From the same uniforms (t first, then the positions, as the plan draws them), the plan's non-empty rows are
    dLLM-RL's rows (coupled: the sets, then the complements), the prompt is never masked, the tail is masked in every
    row and never scored."""
    prompt, completion, real = _batch()
    draws, lower, upper = 6, 0.2, 0.7
    num_samples = 2 * draws if coupled else draws
    plan = draw_plan("random_masking", prompt, completion, real, num_samples=num_samples,
                     generator=torch.Generator().manual_seed(5), t_low=lower, t_high=upper, coupled=coupled)
    assert plan.prompt_masked is None
    source = torch.Generator().manual_seed(5)
    t_uniforms = torch.rand(draws, 2, generator=source, dtype=torch.float64)
    r_uniforms = torch.rand(draws, 2, completion.shape[1], generator=source, dtype=torch.float64)
    expected = dllm_rl_rows(prompt, completion, real, t_uniforms, r_uniforms, lower=lower, upper=upper,
                            coupled=coupled)
    inputs = plan.model_inputs(prompt, completion, MASK).view(num_samples, 2, -1)  # [N, B, P+G]
    order = (list(range(draws)) if not coupled else
             [row for d in range(draws) for row in (d, draws + d)])  # dLLM-RL appends S then S^c per draw
    for b, rows in enumerate(expected):
        ours = [(inputs[n, b], plan.scored[n, b]) for n in order if plan.scored[n, b].any()]
        assert len(ours) == len(rows)
        for (ids, scored), (their_ids, their_mask) in zip(ours, rows, strict=True):
            assert torch.equal(ids, their_ids) and torch.equal(scored, their_mask)
    assert plan.completion_masked[:, ~real.bool()].all()
    assert not plan.scored[:, ~real.bool()].any()


def test_mask_counts_follow_the_law_of_a_uniform_rate():
    """P(|S| = k) = ∫ C(L,k) t^k (1−t)^{L−k} dt / (t_high − t_low) over t ∈ [t_low, t_high], by the frequencies of
    many draws (within 4.5 standard errors), for L = 3 and 5."""
    prompt, completion, real = _batch()
    copies, lower, upper = 4000, 0.1, 0.9
    plan = random_masking_plan(prompt.repeat(copies, 1), completion.repeat(copies, 1), real.repeat(copies, 1),
                               num_samples=1, generator=torch.Generator().manual_seed(2), t_low=lower, t_high=upper)
    grid = torch.linspace(lower, upper, 20_001, dtype=torch.float64)
    for index, length in ((0, 3), (1, 5)):
        counts = plan.scored[0, index::2].sum(-1)
        frequency = torch.bincount(counts, minlength=length + 1).double() / counts.numel()
        for k in range(length + 1):
            p = float(torch.trapezoid(math.comb(length, k) * grid ** k * (1 - grid) ** (length - k), grid)) / (
                upper - lower)
            se = math.sqrt(p * (1 - p) / counts.numel())
            assert abs(float(frequency[k]) - p) < 4.5 * se, (length, k, float(frequency[k]), p)


@pytest.mark.parametrize("coupled", [False, True])
def test_token_columns_average_each_tokens_logprob_over_the_rows_that_mask_it(model, coupled):
    """The plugin's per-token column ``(w·ℓ).mean(draws)`` is, for each real token, the mean of its log-prob over the
    rows that mask it, each row run through the model on its own (dLLM-RL's rows); 0 for a token no row masks. The
    estimate is the sum of the columns and equals draw_plan + score_plan."""
    prompt, completion, real = _batch()
    num_samples = 4
    plan = draw_plan("random_masking", prompt, completion, real, num_samples=num_samples,
                     generator=torch.Generator().manual_seed(9), coupled=coupled)
    with torch.no_grad():
        token_logp = plan_token_logprobs(model, prompt, completion, plan, mask_id=MASK)  # [N, B, G]
        columns = (plan.weights * token_logp).mean(dim=0)  # [B, G]
        estimate = likelihood_estimators["random_masking"](model, prompt, completion, real, mask_id=MASK,
                                                           num_samples=num_samples,
                                                           generator=torch.Generator().manual_seed(9),
                                                           coupled=coupled)
        inputs = plan.model_inputs(prompt, completion, MASK).view(num_samples, 2, -1)
        expected = torch.zeros(2, completion.shape[1], dtype=torch.float64)
        for b in range(2):
            for i in range(completion.shape[1]):
                rows = [n for n in range(num_samples) if plan.completion_masked[n, b, i] and real[b, i]]
                values = [model(inputs[n, b].unsqueeze(0))[0, prompt.shape[1] + i].double().log_softmax(-1)[
                    completion[b, i]] for n in rows]
                expected[b, i] = sum(values) / len(values) if values else 0.0
    torch.testing.assert_close(columns.double(), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(estimate.double(), expected.sum(-1), rtol=0, atol=1e-5)
    assert torch.equal(estimate, score_plan(model, prompt, completion, plan, mask_id=MASK))
    if coupled:  # every real token is masked in exactly one row of each pair
        assert torch.equal(plan.completion_masked[:2] & real.bool(), real.bool() & ~plan.completion_masked[2:])


def test_a_batched_plan_is_every_sample_drawn_alone():
    prompt, completion, real = _batch()
    seeds = [4, 5]
    streams = SampleStreams([torch.Generator().manual_seed(s) for s in seeds])
    batched = [random_masking_plan(prompt, completion, real, num_samples=4, generator=streams, coupled=True)
               for _ in range(2)]
    for b, seed in enumerate(seeds):
        generator = torch.Generator().manual_seed(seed)
        for plan in batched:
            own = random_masking_plan(prompt[b:b + 1], completion[b:b + 1], real[b:b + 1], num_samples=4,
                                      generator=generator, coupled=True)
            assert torch.equal(plan.completion_masked[:, b], own.completion_masked[:, 0])
            assert torch.equal(plan.weights[:, b], own.weights[:, 0])


# ---------------------------------------------------------------------- through the plugin (toy checkpoint)
def _plugin(runtime: Runtime | None = None, **plugin):
    data = {"plugin": {"name": "dllm", "train_size": 64, "eval_size": 16, "estimator": "random_masking",
                       "num_mc_samples": 2, **plugin},
            "rewards": {"functions": [{"name": "gsm8k_answer"}]}}
    return plugin_registry.get("dllm")(load_config(data).plugin.config, runtime or Runtime())


def test_plugin_columns_mask_and_ratio_one():
    """Per-token columns (each token's mean log-prob over the draws that mask it), the action mask = the real tokens
    some draw of the sample's plans masks, π_old, π_ref and π_θ equal on each epoch's plan (the ratio is 1)."""
    plugin = _plugin(Runtime(needs_reference=True, inner_epochs=2))
    policy = plugin.policy()
    rows = plugin.dataset("train")[:6]
    batch = PromptBatch(rows=rows, group_ids=torch.arange(6) // 2, group_size=2, seeds=torch.arange(20, 26),
                        generator=torch.Generator())
    rollout = plugin.rollout(policy, batch)
    replay = rollout.replay
    assert plugin.num_plans() == 2 and replay["plan_masked"].shape[1:3] == (2, 2)  # [N, E, D, G]
    covered = replay["plan_weights"].ne(0).flatten(1, 2).any(dim=1)  # [N, G]
    assert torch.equal(rollout.mask.bool(), covered & replay["completion_mask"].bool())
    assert (rollout.mask.sum(1) < replay["completion_mask"].sum(1)).any()  # some real token is in no draw
    rollout = old_policy_pass(plugin, policy, rollout)
    for epoch in range(2):
        plugin.start_inner_epoch(epoch)
        out = plugin.forward(policy, rollout, need_reference=True)
        prompt, completion = replay["prompt_ids"], replay["completion_ids"]
        masked = replay["plan_masked"][:, epoch].transpose(0, 1).bool()  # [D, N, G]
        with torch.no_grad():
            for n in range(completion.shape[0]):
                for i in range(completion.shape[1]):
                    values = []
                    for d in range(masked.shape[0]):
                        if masked[d, n, i] and replay["completion_mask"][n, i]:
                            row = torch.cat([prompt[n], torch.where(masked[d, n], plugin.adapter.mask_id,
                                                                    completion[n])]).unsqueeze(0)
                            logits = plugin.adapter.logits(plugin.model, row)[0, prompt.shape[1] + i].double()
                            values.append(logits.log_softmax(-1)[completion[n, i]])
                    expected = sum(values) / len(values) if values else 0.0
                    assert abs(float(out.logp[n, i]) - float(expected)) < 2e-5
        ref = rollout.ref_logp if epoch == 0 else replay["epoch_ref_logp"][:, epoch]
        assert torch.equal(out.ref_logp, ref) and torch.equal(out.logp.detach(), out.ref_logp)
        if epoch == 0:
            assert torch.equal(out.logp.detach(), rollout.old_logp)


@pytest.mark.parametrize(("overrides", "key", "match"), [
    ({"estimator_options": {"t_low": 0.0}}, "plugin.estimator_options.t_low", r"in \(0, 1\]"),
    ({"estimator_options": {"t_high": 1.5}}, "plugin.estimator_options.t_high", r"in \(0, 1\]"),
    ({"estimator_options": {"t_low": 0.8, "t_high": 0.5}}, "plugin.estimator_options.t_low", "<= t_high"),
    ({"estimator_options": {"coupled": True}, "num_mc_samples": 3}, "plugin.num_mc_samples", "an even number"),
    ({"num_mc_samples": 0}, "plugin.num_mc_samples", ">= 1"),
    ({"objective": "spg"}, "plugin.objective", "grpo or wd1 with estimator random_masking"),
    ({"estimator_options": {"eps": 0.1}}, "plugin.estimator_options.eps", "t_low"),
])
def test_config_refuses_bad_options(overrides, key, match):
    data = {"plugin": {"name": "dllm", "estimator": "random_masking", **overrides},
            "rewards": {"functions": [{"name": "gsm8k_answer"}]}}
    with pytest.raises(ConfigError, match=match) as info:
        load_config(data)
    assert info.value.key == key
    assert "\n" not in str(info.value)


def test_direct_calls_refuse_bad_options():
    prompt, completion, real = _batch()
    for options, match in (({"t_low": 0.0}, "0 < t_low <= t_high <= 1"), ({"t_low": 0.6, "t_high": 0.5}, "t_low"),
                           ({"coupled": True, "num_samples": 3}, "even num_samples")):
        kwargs = {"num_samples": 2, **options}
        with pytest.raises(ValueError, match=match):
            random_masking_plan(prompt, completion, real, generator=torch.Generator(), **kwargs)
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        random_masking_plan(prompt, completion, real, num_samples=0, generator=torch.Generator())


@pytest.mark.parametrize("coupled", [False, True])
def test_columns_tend_to_the_elbo_term_under_a_rate_tilted_by_t(model, coupled):
    """With many draws, column i tends to Σ_{S∋i} log p(x^i | c, x_S)·∫ t^{|S|}(1−t)^{L−|S|} dt / ∫ t dt over
    [t_low, t_high]: the ELBO's per-token term E[log p(x^i | c, x_S) | i ∈ S] with the rate drawn ∝ t instead of
    uniformly (coupled: the same law for a range symmetric about 1/2). Checked against the enumeration within 4.5
    standard errors over copies (plus the O(1/N) of a ratio of sums); the ELBO's own term differs."""
    from tests.dllm.test_estimators import _logp_table

    prompt, completion, real = _batch()
    copies, draws, lower, upper = 120, 200, 0.2, 0.8
    plan = random_masking_plan(prompt.repeat(copies, 1), completion.repeat(copies, 1), real.repeat(copies, 1),
                               num_samples=draws, generator=torch.Generator().manual_seed(4), t_low=lower,
                               t_high=upper, coupled=coupled)
    with torch.no_grad():
        token_logp = plan_token_logprobs(model, prompt.repeat(copies, 1), completion.repeat(copies, 1), plan,
                                         mask_id=MASK, micro_batch=4096)
    columns = (plan.weights * token_logp).mean(dim=0).double().view(copies, 2, -1)  # [copies, B, G]
    grid = torch.linspace(lower, upper, 20_001, dtype=torch.float64)
    for b, length in ((0, 3), (1, 5)):
        table = _logp_table(model, prompt[b], completion[b], list(range(length)))
        norm = float(torch.trapezoid(grid, grid))
        for i in range(length):
            limit = elbo_term = 0.0
            for subset, logp in table.items():
                if i in subset:
                    size = len(subset)
                    limit += float(logp[i]) * float(torch.trapezoid(grid ** size * (1 - grid) ** (length - size),
                                                                    grid)) / norm
                    elbo_term += float(logp[i]) * math.factorial(size - 1) * math.factorial(length - size) / \
                        math.factorial(length)  # ∫_0^1 t^{|S|−1}(1−t)^{L−|S|} dt
            values = columns[:, b, i]
            mean, se = float(values.mean()), float(values.std()) / math.sqrt(copies)
            assert abs(mean - limit) < 4.5 * se + 2e-3, (b, i, mean, limit, se)
            assert abs(limit - elbo_term) > 1e-3  # a different target than the ELBO's own term


def _masked_rate_mean(table: dict, length: int, i: int, lower: float, upper: float, coupled: bool) -> float:
    """E[log p(x^i | c, x_S) | i ∈ S] for the row that masks token i, enumerated: t ~ U(lower, upper), S ~ Bern(t)^L;
    coupled, the row that masks i is S (w.p. t, others masked at rate t) or S^c (w.p. 1 − t, a set T ∋ i arising as
    the complement of a Bernoulli(t) set: t^{L−|T|}(1−t)^{|T|})."""
    grid = torch.linspace(lower, upper, 20_001, dtype=torch.float64)
    total = 0.0
    for subset, logp in table.items():
        if i in subset:
            size = len(subset)
            density = grid ** size * (1 - grid) ** (length - size)
            if coupled:
                density = density + (1 - grid) ** size * grid ** (length - size)
            total += float(logp[i]) * float(torch.trapezoid(density, grid))
    norm = float(torch.trapezoid(grid, grid)) + (float(torch.trapezoid(1 - grid, grid)) if coupled else 0.0)
    return total / norm


@pytest.mark.parametrize(("draws", "lower", "upper", "coupled"), [
    (2, 0.1, 0.9, False), (3, 0.2, 0.5, False), (4, 0.2, 0.6, True)])
def test_column_mean_at_few_draws_is_the_limit_times_the_chance_some_draw_masks_the_token(
        model, draws, lower, upper, coupled):
    """At N draws E[column i] = (1 − (1 − p̄)^N)·E[log p(x^i | c, x_S) | i ∈ S], p̄ = (t_low + t_high)/2 (coupled:
    every pair masks i once, the factor is 1 and the conditional law a mixture of the rates t and 1 − t): the draws
    that mask i average iid draws of the conditional law, so the only finite-N effect is the tokens no draw masks.
    Within 4.5 standard errors over copies, for L = 3 and 5."""
    from tests.dllm.test_estimators import _logp_table

    prompt, completion, real = _batch()
    copies = 3000
    plan = random_masking_plan(prompt.repeat(copies, 1), completion.repeat(copies, 1), real.repeat(copies, 1),
                               num_samples=draws, generator=torch.Generator().manual_seed(6), t_low=lower,
                               t_high=upper, coupled=coupled)
    with torch.no_grad():
        token_logp = plan_token_logprobs(model, prompt.repeat(copies, 1), completion.repeat(copies, 1), plan,
                                         mask_id=MASK, micro_batch=4096)
    columns = (plan.weights * token_logp).mean(dim=0).double().view(copies, 2, -1)  # [copies, B, G]
    covered = 1.0 if coupled else 1 - (1 - (lower + upper) / 2) ** draws
    for b, length in ((0, 3), (1, 5)):
        table = _logp_table(model, prompt[b], completion[b], list(range(length)))
        for i in range(length):
            expected = covered * _masked_rate_mean(table, length, i, lower, upper, coupled)
            values = columns[:, b, i]
            mean, se = float(values.mean()), float(values.std()) / math.sqrt(copies)
            assert abs(mean - expected) < 4.5 * se, (b, i, mean, expected, se)


@pytest.mark.parametrize(("estimator", "options", "forwards"), [
    ("random_masking", {"coupled": True}, 2), ("sdmc", {"quadrature": "gauss-2", "masking": "bernoulli"}, 2)])
def test_grpo_steps_train_with_ratio_one(tmp_path, estimator, options, forwards):
    """Two GRPO steps of two inner epochs with a k3 KL, a new plan per epoch: the core's old-policy pass and the
    training forward score the same plan, so every first inner step has ratio exactly 1; the weights move."""
    from mmrl.trainer import Trainer

    base = {
        "plugin": {"name": "dllm", "attn_implementation": "eager", "train_size": 64, "eval_size": 4,
                   "estimator": estimator, "estimator_options": options, "num_mc_samples": forwards},
        "run": {"max_steps": 2, "seed": 0, "progress": False, "save_every": 0, "output_dir": str(tmp_path)},
        "rollout": {"prompts_per_step": 2, "group_size": 4},
        "algorithm": {"inner_epochs": 2, "micro_batch_size": 8, "kl_coef": 0.01,
                      "aggregation": "seq_mean_token_mean"},
        "optim": {"lr": 1e-4},
        "rewards": {"functions": [{"name": "gsm8k_answer"}]},
        "eval": {"at_start": False, "every": 0},
    }
    trainer = Trainer(load_config(base))
    before = {name: p.detach().clone() for name, p in trainer.plugin.policy().named_parameters()}
    history = trainer.train().history
    assert [record["step"] for record in history] == [1, 2]
    assert all(record["loss/first_step_ratio_deviation"] == 0.0 for record in history)
    assert any(not torch.equal(before[name], p) for name, p in trainer.plugin.policy().named_parameters())
