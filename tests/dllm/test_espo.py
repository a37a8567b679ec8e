"""ESPO (Ou et al. 2025, arXiv:2512.03759) in the dLLM plugin: the ``espo`` estimator, ``score_tail``, the core's
``k2_seq`` KL, against ESPO's trainer restated from its code (ML-GSAI/ESPO@b5f2dac ``espo/espo_trainer.py``), on a
tiny random masked LM and on the toy checkpoint (CPU)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from mmrl.algos import advantage_estimators, aggregate, kl_estimators, policy_losses
from mmrl.config import ConfigError, load_config
from mmrl.plugin import PromptBatch, Runtime, plugin_registry
from mmrl.plugins.dllm.estimators import draw_plan, exact_elbo, likelihood_estimators, score_plan
from mmrl.trainer import Trainer
from tests.dllm.test_estimators import MASK, PAD, TinyMaskedLM

torch.set_num_threads(1)


# ---------------------------------------------------------------------- ESPO's code, restated
def espo_mask_ratio(masked: Tensor, length: int) -> Tensor:
    """ESPO's mask ratio of a row with ``x`` masked positions out of ``length``: ``forward_process`` returns
    ``x / (target_len + 1)`` (L75), and ``_get_elbo`` divides the masked tokens' cross-entropy by it (L421-423)."""
    return masked.sum(-1, keepdim=True).to(torch.float64) / (length + 1)


def espo_elbo(scorer, prompt: Tensor, completion: Tensor, sets: Tensor, *, mask_id: int, reduce_var: bool) -> Tensor:
    """``_get_elbo_mc`` (L440-474) over the MC draws ``sets`` ``[M, B, G]`` (the masked positions of each draw's first
    forward): per draw ``_get_elbo`` (L376-438) with the whole completion as the target (no completion mask), the
    complement forward when ``reduce_var``, the two halved, the negative sum; then the mean over the draws."""
    width, length = prompt.shape[1], completion.shape[1]
    elbos = []
    for masked in sets:  # [B, G]
        p_mask = espo_mask_ratio(masked, length).expand(-1, length)  # [B, G]
        loss = torch.zeros(completion.shape, dtype=torch.float64)
        logits = scorer(torch.cat([prompt, torch.where(masked, mask_id, completion)], dim=1))[:, width:]
        loss[masked] = F.cross_entropy(logits[masked].double(), completion[masked], reduction="none") / p_mask[masked]
        if reduce_var:  # L425-435: the masked positions visible, every other completion position masked
            logits = scorer(torch.cat([prompt, torch.where(masked, completion, mask_id)], dim=1))[:, width:]
            loss[~masked] = F.cross_entropy(logits[~masked].double(), completion[~masked], reduction="none") / (
                length / (length + 1) - p_mask[~masked])
            loss = loss / 2
        elbos.append(-loss.sum(dim=-1))  # [B]
    return torch.stack(elbos).mean(dim=0)


def espo_loss(elbo: Tensor, old: Tensor, ref: Tensor, advantages: Tensor, length: int, *, epsilon: float,
              beta: float) -> Tensor:
    """``compute_loss`` (L160-231): the sequence ratio ``exp((ELBO − ELBO_old) / logits_to_keep)`` (L191), clipped
    at ``1 ± ε`` (L192), ``−min(r·A, clip(r)·A)`` summed over the batch and divided by its size (L193-195), plus
    ``β · k2(ELBO, ELBO_ref)`` summed and divided by ``batch_size · logits_to_keep`` (L197-201; ``compute_approx_kl``
    k2 L97-99: ``(log_probs − log_probs_base)² / 2``)."""
    batch = elbo.shape[0]
    coef_1 = torch.exp((elbo - old) / length)
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon)
    loss = -torch.min(coef_1 * advantages, coef_2 * advantages).sum() / batch
    kl = (elbo - ref) ** 2 / 2.0
    return loss + beta * kl.sum() / (batch * length)


def espo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """``_generate_and_score_completions`` L705-716 with ``leave_one_out = True`` and ``scale_rewards: false`` (its
    ``recipes/train.yaml``): each reward minus the mean of the other rewards of its group."""
    grouped = rewards.view(-1, group_size)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - baseline).view(-1)


# ---------------------------------------------------------------------- the estimator on a tiny random model
@pytest.fixture(scope="module")
def model() -> TinyMaskedLM:
    torch.manual_seed(0)
    return TinyMaskedLM().eval()


def _batch() -> tuple[Tensor, Tensor, Tensor]:
    """Two samples with L = 3 and L = 5 real tokens, right-padded to width 6."""
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    completion = torch.tensor([[1, 5, 7, PAD, PAD, PAD], [2, 2, 9, 0, 3, PAD]])
    return prompt, completion, (completion != PAD).long()


def test_plan_is_espos_count_sampling_and_coupling():
    """Rows 0..M−1 mask a uniform x-subset S of the real tokens, x ~ U{0..L} (0 and L included, as ESPO's
    ``randint(0, target_len + 1)``), weighted (L+1)/x; rows M..2M−1 mask its complement, weighted (L+1)/(L−x); the
    tail is masked in every row; each of the L+1 counts is equally likely."""
    prompt, completion, mask = _batch()
    copies, draws = 1500, 2
    plan = draw_plan("espo", prompt.repeat(copies, 1), completion.repeat(copies, 1), mask.repeat(copies, 1),
                     num_samples=2 * draws, generator=torch.Generator().manual_seed(3))
    real = mask.repeat(copies, 1).bool()  # [B, G]
    first, second = plan.completion_masked[:draws] & real, plan.completion_masked[draws:] & real  # [M, B, G]
    assert torch.equal(second, real & ~first)  # complements among the real tokens
    assert plan.completion_masked[:, ~real].all()  # the tail is masked in every row (the plugin's default)
    length = real.sum(-1).double()  # [B]
    for rows, other in ((first, plan.weights[:draws]), (second, plan.weights[draws:])):
        size = rows.sum(-1).double()  # [M, B]
        expected = torch.where(rows, ((length + 1) / size.clamp(min=1)).unsqueeze(-1), 0.0)
        torch.testing.assert_close(other.double(), expected, rtol=1e-6, atol=0)
    for index, tokens in ((0, 3), (1, 5)):  # each count 0..L with probability 1/(L+1)
        counts = first[:, index::2].sum(-1).flatten()
        frequency = torch.bincount(counts, minlength=tokens + 1).double() / counts.numel()
        se = math.sqrt((1 / (tokens + 1)) * (1 - 1 / (tokens + 1)) / counts.numel())
        assert frequency.shape[0] == tokens + 1
        assert ((frequency - 1 / (tokens + 1)).abs() < 4 * se).all(), frequency
    single = draw_plan("espo", prompt, completion, mask, num_samples=3, generator=torch.Generator().manual_seed(3),
                       coupled=False)
    assert single.num_samples == 3  # without the coupling: one row per draw


@pytest.mark.parametrize("options", [{}, {"coupled": False}, {"stratified": True}])
@pytest.mark.parametrize("whole", [False, True])
def test_espo_is_unbiased_for_the_elbo(model, options, whole):
    """The mean over many draws matches the exact ELBO (enumerated), of the real tokens with the tail masked, or of
    every position (``whole``: what ``score_tail`` passes)."""
    prompt, completion, mask = _batch()
    if whole:
        completion = torch.where(completion == PAD, 4, completion)
        mask = torch.ones_like(mask)
    copies = 300
    with torch.no_grad():
        estimates = likelihood_estimators["espo"](
            model, prompt.repeat(copies, 1), completion.repeat(copies, 1), mask.repeat(copies, 1), mask_id=MASK,
            num_samples=4, generator=torch.Generator().manual_seed(1), **options)
    values = estimates.double().reshape(copies, 2)
    mean, se = values.mean(0), values.std(0) / math.sqrt(copies)
    exact = exact_elbo(model, prompt, completion, mask, mask_id=MASK).double()
    assert torch.all((mean - exact).abs() <= 4 * se), (options, mean, exact, se)


def test_espo_estimate_equals_espos_get_elbo_on_the_same_masks(model):
    """Given the same first-row masks, the estimate is ESPO's ``_get_elbo_mc`` (both with and without reduce_var),
    whole completion scored; and the estimate is draw_plan + score_plan."""
    prompt, completion, _ = _batch()
    completion = torch.where(completion == PAD, 4, completion)
    mask = torch.ones_like(completion)
    for coupled, num_samples in ((True, 4), (False, 3)):
        generator = torch.Generator().manual_seed(11)
        plan = draw_plan("espo", prompt, completion, mask, num_samples=num_samples, generator=generator,
                         coupled=coupled)
        with torch.no_grad():
            ours = score_plan(model, prompt, completion, plan, mask_id=MASK).double()
            draws = num_samples // 2 if coupled else num_samples
            theirs = espo_elbo(model, prompt, completion, plan.completion_masked[:draws], mask_id=MASK,
                               reduce_var=coupled)
            direct = likelihood_estimators["espo"](model, prompt, completion, mask, mask_id=MASK,
                                                   num_samples=num_samples, generator=torch.Generator().manual_seed(11),
                                                   coupled=coupled)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        assert torch.equal(direct.double(), ours)


# ---------------------------------------------------------------------- the loss through the plugin
BETA, EPSILON = 0.3, 0.05


def _plugin(**plugin):
    data = {"plugin": {"name": "dllm", "train_size": 64, "eval_size": 16, "estimator": "espo", "num_mc_samples": 4,
                       "score_tail": True, **plugin},
            "rewards": {"functions": [{"name": "gsm8k_answer"}]}}
    return plugin_registry.get("dllm")(load_config(data).plugin.config, Runtime())


def _moved(module, scale: float, seed: int):
    moved = copy.deepcopy(module)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return moved


@pytest.fixture(scope="module")
def toy():
    """The toy checkpoint with the ESPO settings, a rollout of 3 groups of 3 (some completions end before G, so the
    tail matters), and an old and a reference policy a little away from it."""
    plugin = _plugin()
    policy = plugin.policy()
    rows = plugin.dataset("train")[:3]
    batch = PromptBatch(rows=[row for row in rows for _ in range(3)], group_ids=torch.arange(9) // 3, group_size=3,
                        seeds=torch.arange(40, 49), generator=torch.Generator())
    rollout = plugin.rollout(policy, batch)
    real = rollout.replay["completion_mask"]
    assert (real.sum(1) < real.shape[1]).any()  # a tail after the stop token: score_tail changes something
    return plugin, policy, rollout, _moved(policy, 0.03, 1), _moved(policy, 0.03, 2)


def _espo_side(plugin, policy, rollout, old_model, ref_model, advantages):
    replay = rollout.replay
    width = int(replay["prompt_width"][0])
    prompt, completion = replay["prompt_ids"][:, :width], replay["completion_ids"]
    sets = replay["plan_masked"][:, 0, :2].transpose(0, 1).bool()  # [M, B, G]: the first row of each draw
    mask_id = plugin.adapter.mask_id
    elbo = espo_elbo(plugin.adapter.scorer(policy), prompt, completion, sets, mask_id=mask_id, reduce_var=True)
    with torch.no_grad():
        old = espo_elbo(plugin.adapter.scorer(old_model), prompt, completion, sets, mask_id=mask_id, reduce_var=True)
        ref = espo_elbo(plugin.adapter.scorer(ref_model), prompt, completion, sets, mask_id=mask_id, reduce_var=True)
    return elbo, old, ref, espo_loss(elbo, old, ref, advantages.double(), completion.shape[1], epsilon=EPSILON,
                                     beta=BETA)


def _mmrl_side(plugin, policy, rollout, old_model, ref_model, advantages, kl_estimator="k2_seq"):
    """The learner's composition (mmrl.trainer.learn ``_micro_loss``): policy loss + kl_coef · KL estimator per
    action, aggregated."""
    logp = plugin.forward(policy, rollout, need_reference=False).logp  # [N, G]
    with torch.no_grad():
        old = plugin.forward(old_model, rollout, need_reference=False).logp
        ref = plugin.forward(ref_model, rollout, need_reference=False).logp
    per_action, metrics = policy_losses.get("grpo")(logp, old, advantages, rollout.mask, clip_low=EPSILON,
                                                    clip_high=EPSILON)
    total = per_action + BETA * kl_estimators.get(kl_estimator)(logp, ref)
    return logp, aggregate(total, rollout.mask, "seq_mean_token_mean"), metrics


def test_espo_loss_and_gradient_equal_espos_trainer(toy):
    """mmrl's loss with the ESPO settings (estimator espo with 2 coupled draws, score_tail, policy_loss grpo at ε,
    kl_estimator k2_seq at β, seq_mean_token_mean, rloo advantages) equals ESPO's compute_loss restated, in value and
    gradient, with some ratios clipped and some not."""
    plugin, policy, rollout, old_model, ref_model = toy
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    advantages = advantage_estimators.get("rloo")(rewards, rollout.group_ids)
    torch.testing.assert_close(advantages, espo_advantages(rewards, 3))
    params = [p for p in policy.parameters() if p.requires_grad]
    elbo, old, _, theirs = _espo_side(plugin, policy, rollout, old_model, ref_model, advantages)
    logp, ours, _ = _mmrl_side(plugin, policy, rollout, old_model, ref_model, advantages)
    torch.testing.assert_close(logp.sum(1).double(), elbo, rtol=1e-5, atol=1e-5)  # the columns sum to the ELBO
    ratio = torch.exp((elbo - old) / rollout.mask.shape[1]).detach()
    clipped = ((ratio - 1).abs() > EPSILON) & (advantages != 0)
    assert clipped.any() and (~clipped & (advantages != 0)).any()  # both branches of the clip are exercised
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-6)
    got = torch.autograd.grad(ours, params)
    expected = torch.autograd.grad(theirs, params)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g.double(), e.double(), rtol=1e-4, atol=1e-7)
    # The comparison can fail: the per-action k2 (k2 of ELBO/G) is G times smaller than ESPO's KL.
    _, other, _ = _mmrl_side(plugin, policy, rollout, old_model, ref_model, advantages, kl_estimator="k2")
    assert abs(float(other.detach()) - float(theirs.detach())) > 1e-3


def test_score_tail_scores_the_whole_generated_length(toy):
    """The same samples (same seeds, same completions) with the plugin's default: the tail after the stop token is
    masked in every row, never scored and not an action; with score_tail (ESPO) every position is masked, unmasked
    and scored like the others and every column is an action holding ELBO / G."""
    plugin, policy, rollout, _, _ = toy
    default = _plugin(score_tail=False)
    batch = PromptBatch(rows=[row for row in plugin.dataset("train")[:3] for _ in range(3)],
                        group_ids=torch.arange(9) // 3, group_size=3, seeds=torch.arange(40, 49),
                        generator=torch.Generator())
    masked = default.rollout(policy, batch)
    assert torch.equal(masked.replay["completion_ids"], rollout.replay["completion_ids"])
    real = masked.replay["completion_mask"].bool()  # [N, G]
    tail = ~real.unsqueeze(1).unsqueeze(1)  # [N, 1, 1, G]
    assert masked.replay["plan_masked"].masked_select(tail.expand_as(masked.replay["plan_masked"])).all()
    assert not masked.replay["plan_weights"].masked_select(tail.expand_as(masked.replay["plan_weights"])).any()
    assert torch.equal(masked.mask.bool(), real) and rollout.mask.bool().all()
    visible = ~rollout.replay["plan_masked"] & tail  # ESPO: the tail is visible in some rows, scored in others
    scored = (rollout.replay["plan_weights"] != 0) & tail
    assert visible.any() and scored.any()
    whole = plugin.forward(policy, rollout, need_reference=False).logp
    torch.testing.assert_close(whole, whole[:, :1].expand_as(whole))  # ELBO / G in every column
    short = real.sum(1) < real.shape[1]
    assert not torch.allclose(default.forward(policy, masked, need_reference=False).logp.sum(1)[short],
                              whole.sum(1)[short])


def test_ratio_is_exactly_one_on_policy(toy):
    plugin, policy, rollout, _, _ = toy
    first = plugin.forward(policy, rollout, need_reference=False).logp
    with torch.no_grad():
        second = plugin.forward(policy, rollout, need_reference=False).logp
    assert torch.equal(first, second)
    _, metrics = policy_losses.get("grpo")(first, second, torch.ones(9), rollout.mask, clip_low=0.2, clip_high=0.2)
    assert float(metrics["ratio_min"]) == float(metrics["ratio_max"]) == 1.0
    assert torch.equal(kl_estimators.get("k2_seq")(first, second), torch.zeros_like(first))


# ---------------------------------------------------------------------- the trainer and the config
ESPO_TOY = {
    "plugin": {"name": "dllm", "attn_implementation": "eager", "train_size": 256, "eval_size": 8,
               "estimator": "espo", "num_mc_samples": 4, "score_tail": True},
    "run": {"max_steps": 2, "seed": 0, "progress": False, "save_every": 0},
    "rollout": {"prompts_per_step": 4, "group_size": 3},
    "algorithm": {"advantage": "rloo", "policy_loss": {"name": "grpo", "clip_low": 0.2, "clip_high": 0.2},
                  "aggregation": "seq_mean_token_mean", "kl_coef": 0.01, "kl_estimator": "k2_seq",
                  "inner_epochs": 2, "micro_batch_size": 6},
    "optim": {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.01, "max_grad_norm": 0.2},
    "rewards": {"functions": [{"name": "gsm8k_answer"}]},
    "eval": {"at_start": False, "every": 0},
}


def test_two_grpo_steps_with_the_espo_settings(tmp_path):
    trainer = Trainer(load_config(ESPO_TOY, [f"run.output_dir={tmp_path}"]))
    before = {name: p.detach().clone() for name, p in trainer.plugin.policy().named_parameters()}
    history = trainer.train().history
    assert [record["step"] for record in history] == [1, 2]
    for record in history:
        assert record["loss/first_step_ratio_deviation"] == 0.0  # π_old on the same plans: ratio exactly 1
        assert math.isfinite(record["loss/total"])
    assert history[0]["policy/kl"] > 0  # epoch 2 of step 1 has moved away from the reference
    assert any(not torch.equal(before[name], p) for name, p in trainer.plugin.policy().named_parameters())


def test_refusals():
    with pytest.raises(ConfigError, match="even number for the espo estimator"):
        _plugin(num_mc_samples=3)
    _plugin(num_mc_samples=3, estimator_options={"coupled": False})  # one forward per draw: any count
    with pytest.raises(ConfigError, match="score_tail"):
        load_config({"plugin": {"name": "dllm", "estimator": "trace", "score_tail": True},
                     "rewards": {"functions": [{"name": "gsm8k_answer"}]}})
    with pytest.raises(ValueError, match="even num_samples"):
        prompt, completion, mask = _batch()
        draw_plan("espo", prompt, completion, mask, num_samples=3, generator=torch.Generator())


def test_k2_seq_is_refused_with_the_spg_objective():
    """objective spg's two columns are two estimates of one sequence log-likelihood (ELBO and EUBO), not additive
    parts of it: k2_seq's sum would take k2 of ΔELBO + ΔEUBO (about twice the sequence log-ratio, four times the KL
    each column's k2 gives), so the config is refused; grpo's token columns and wd1's single column are accepted."""
    base = {"rewards": {"functions": [{"name": "gsm8k_answer"}]}}
    spg = {"plugin": {"name": "dllm", "objective": "spg"},
           "algorithm": {"policy_loss": {"name": "spg"}, "kl_coef": 0.01, "kl_estimator": "k2_seq"}, **base}
    with pytest.raises(ConfigError, match="k2_seq"):
        load_config(spg)
    load_config({**spg, "algorithm": {**spg["algorithm"], "kl_estimator": "k3"}})  # per-column KL: accepted
    load_config({"plugin": {"name": "dllm", "objective": "wd1"}, **base, "algorithm": {
        "policy_loss": {"name": "wd1"}, "advantage": "wd1", "kl_coef": 0.01, "kl_estimator": "k2_seq"}})


def test_recipe_loads():
    config = load_config(Path(__file__).resolve().parents[2] / "configs" / "dllm" / "llada8b_espo_gsm8k.yaml")
    plugin = config.plugin.config
    assert (plugin.estimator, plugin.score_tail, config.algorithm.kl_estimator) == ("espo", True, "k2_seq")
