"""The dLLM plugin end to end through ``mmrl.trainer.Trainer`` on the bundled toy checkpoint (CPU, 1-2 steps)."""

from __future__ import annotations

import json

import pytest
import torch

from mmrl.config import load_config
from mmrl.trainer import Trainer
from tests.helpers import record_calls, record_gradients

torch.set_num_threads(1)

BASE = {
    "plugin": {"name": "dllm", "attn_implementation": "eager", "train_size": 256, "eval_size": 8,
               "num_mc_samples": 2},
    "run": {"max_steps": 2, "seed": 0, "progress": False, "save_every": 0},
    "rollout": {"prompts_per_step": 4, "group_size": 4},
    "algorithm": {"inner_epochs": 2, "micro_batch_size": 8},
    "optim": {"lr": 1e-3},
    "rewards": {"functions": [{"name": "gsm8k_answer"}]},
    "eval": {"at_start": False, "num_prompts": 4},
}


def _train(tmp_path, *overrides: str):
    trainer = Trainer(load_config(BASE, [f"run.output_dir={tmp_path}", *overrides]))
    before = {name: p.detach().clone() for name, p in trainer.plugin.policy().named_parameters()}
    result = trainer.train()
    changed = {name for name, p in trainer.plugin.policy().named_parameters() if not torch.equal(before[name], p)}
    return trainer, result, changed


def test_two_grpo_steps_with_kl_train_and_save(tmp_path):
    # One inner epoch: each step's single update happens after the loss is computed, so the KL of step 1 is 0, and the
    # old policy is the training forward itself (ratio exactly 1: no old-policy pass).
    trainer, result, changed = _train(tmp_path, "algorithm.kl_coef=0.04", "algorithm.inner_epochs=1")
    history = result.history
    assert [record["step"] for record in history] == [1, 2]
    for record in history:
        assert record["loss/first_step_ratio_deviation"] == 0.0
        assert "reward/gsm8k_answer_mean" in record
    assert history[0]["policy/kl"] == pytest.approx(0.0, abs=1e-7)  # the reference is the policy at step 1
    assert history[1]["policy/kl"] > 0
    assert changed  # the weights moved
    assert (tmp_path / "checkpoints" / "step-00000002" / "policy" / "trainable.safetensors").is_file()
    samples = (tmp_path / "samples" / "step_000002" / "eval.jsonl").read_text().splitlines()
    assert len(samples) == 4 and "output" in json.loads(samples[0])


def _with_old_logp(trainer):
    """Make the dLLM plugin's training rollouts carry the sampling policy's estimates on plan 0, scored by the plugin
    itself (it leaves them to the core)."""
    plugin, original = trainer.plugin, trainer.plugin.rollout

    def rollout(policy, batch):
        result = original(policy, batch)
        if batch.training:
            assert result.old_logp is None
            with torch.no_grad(), plugin.runtime.autocast():
                result.old_logp = plugin.score(plugin.adapter.scorer(plugin.runtime.unwrap(policy)), result.replay,
                                               plan=0).float()
        return result

    trainer.plugin.rollout = rollout
    return trainer


def test_one_optimizer_step_per_rollout_skips_the_scoring_pass_and_trains_the_same(tmp_path):
    """μ = 1, one mini-batch: nobody scores the sampling policy (old_logp None; the core uses the detached training
    estimate) and every optimizer step gets the gradient of a run whose rollouts carry scored estimates; with μ = 2
    the core's old-policy pass scores π_old on epoch 1's mask plan before the first update (epoch 0's one mini-batch
    trains on the sampling weights and is its own old policy), and the first inner step's ratio is 1. Gradients are
    compared, not parameters after AdamW (see tests.helpers.record_gradients: BERT's key biases)."""
    runs = {}
    for name, overrides in (("fast", ["algorithm.inner_epochs=1"]), ("scored", ["algorithm.inner_epochs=1"]),
                            ("epochs", ["algorithm.inner_epochs=2"])):
        trainer = Trainer(load_config(BASE, [f"run.output_dir={tmp_path / name}", "eval.every=0", *overrides]))
        if name == "scored":
            _with_old_logp(trainer)
        gradients = record_gradients(trainer, trainer.plugin.policy())
        calls = record_calls(trainer.plugin, "score")
        result = trainer.train()
        runs[name] = (trainer, calls, result, gradients)
    fast, fast_calls, fast_result, fast_gradients = runs["fast"]
    scored, scored_calls, scored_result, scored_gradients = runs["scored"]
    assert fast.plugin.redraws_per_epoch is False and runs["epochs"][0].plugin.redraws_per_epoch is True
    # 2 steps x 16 samples in micro-batches of 8: two training forwards per step; the scoring pass, one per rollout.
    assert fast_calls == [True] * 4
    assert sorted(scored_calls) == [False, False, True, True, True, True]
    # μ = 2: π_old scored on epoch 1's mask plan, one pass per rollout (epoch 0's single mini-batch trains on the
    # sampling weights: its old log-probs are its training forward's)
    assert runs["epochs"][1].count(False) == 2
    assert all(record["loss/first_step_ratio_deviation"] < 1e-5 for record in runs["epochs"][2].history)
    assert all(record["loss/first_step_ratio_deviation"] == 0.0 for record in fast_result.history)
    assert len(fast_gradients) == len(scored_gradients) == 2 and fast_gradients[0].keys() == scored_gradients[0].keys()
    for step, (got, expected) in enumerate(zip(fast_gradients, scored_gradients, strict=True)):
        assert any(g.abs().max() > 1e-4 for g in expected.values())  # a real gradient, not only rounding noise
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=f"step {step}: {name}")
    assert [r["reward/mean"] for r in fast_result.history] == [r["reward/mean"] for r in scored_result.history]


def test_objectives_refuse_another_familys_loss_when_the_config_loads(tmp_path):
    """plugin.objective and algorithm.policy_loss / advantage are checked together (DLLMPlugin.check_config), in one
    line naming the key, before any model is built."""
    from mmrl.config import ConfigError

    cases = [
        (["plugin.objective=spg"], "algorithm.policy_loss.name", "spg with plugin.objective spg"),
        (["plugin.objective=wd1", "algorithm.advantage=wd1"], "algorithm.policy_loss.name", "wd1 with plugin"),
        (["algorithm.policy_loss=spg", "algorithm.advantage=dr_grpo"], "algorithm.policy_loss.name",
         "spg needs plugin.objective spg"),
        (["plugin.objective=wd1", "algorithm.policy_loss=wd1"], "algorithm.advantage.name", "wd1 with policy_loss wd1"),
        (["algorithm.advantage=wd1"], "algorithm.advantage.name", "other than wd1 with policy_loss grpo"),
    ]
    for overrides, key, allowed in cases:
        with pytest.raises(ConfigError, match=allowed) as raised:
            load_config(BASE, [f"run.output_dir={tmp_path}", *overrides])
        assert raised.value.key == key and "\n" not in str(raised.value), overrides
    # The pairs the docs name load.
    load_config(BASE, [f"run.output_dir={tmp_path}", "plugin.objective=spg", "algorithm.policy_loss=spg",
                       "algorithm.advantage=dr_grpo"])
    load_config(BASE, [f"run.output_dir={tmp_path}", "plugin.objective=wd1", "algorithm.policy_loss=wd1",
                       "algorithm.advantage=wd1"])


def test_wd1_and_spg_objectives_train(tmp_path):
    _, wd1, changed = _train(tmp_path / "wd1", "run.max_steps=1", "plugin.objective=wd1",
                             "plugin.estimator_options.p_mask_prompt=0.15", "algorithm.advantage=wd1",
                             "algorithm.policy_loss=wd1")
    record = wd1.history[0]
    assert record["loss/first_step_ratio_deviation"] < 1e-5 and "policy/weight_abs_mean" in record and changed
    _, spg, changed = _train(tmp_path / "spg", "run.max_steps=1", "plugin.objective=spg",
                             "algorithm.advantage=dr_grpo", "algorithm.policy_loss=spg",
                             "algorithm.aggregation=seq_mean_token_sum")
    record = spg.history[0]
    assert record["loss/first_step_ratio_deviation"] < 1e-5 and "policy/bound_gap" in record and changed


def test_lora_with_a_kl_to_the_adapter_off_model(tmp_path):
    trainer, result, changed = _train(tmp_path, "run.max_steps=1", "plugin.lora={rank: 4, alpha: 8.0}",
                                      "plugin.estimator=coupled", "algorithm.kl_coef=0.01")
    record = result.history[0]
    assert record["loss/first_step_ratio_deviation"] < 1e-5
    assert record["policy/ratio_max"] > 1.0 + 1e-6  # the second inner epoch is off-policy: the ratio moves
    assert 0.0 < record["policy/kl"] < 1e-2
    assert changed and all("lora_" in name for name in changed)
    assert (tmp_path / "checkpoints" / "step-00000001" / "policy" / "adapter_model.safetensors").is_file()


def test_each_inner_epoch_scores_its_own_mask_plan(tmp_path):
    """μ = 2 with one_step prompt masking (d1: a new mask seed per inner iteration): the training forwards of epoch e
    use plan e, and the learner takes π_old and π_ref on that plan from the plugin (PolicyOutput.old_logp / ref_logp),
    so at a negligible learning rate every ratio and the KL stay at their on-policy values in both epochs."""
    trainer = Trainer(load_config(BASE, [
        f"run.output_dir={tmp_path}", "run.max_steps=1", "eval.every=0", "plugin.estimator=one_step",
        "plugin.num_mc_samples=1", "plugin.estimator_options={p_mask_prompt: 0.5}", "algorithm.kl_coef=0.04",
        "optim.lr=1e-12",
    ]))
    plans: list[tuple[bool, int]] = []
    score = trainer.plugin.score

    def recorded(scorer, replay, *, plan=0):
        plans.append((torch.is_grad_enabled(), plan))
        return score(scorer, replay, plan=plan)

    trainer.plugin.score = recorded
    record = trainer.train().history[0]
    # No grad: π_ref on plans 0 and 1 (rollout), π_old on plan 1 (the core; epoch 0's single mini-batch is its own
    # old policy); training: two micro-batches in each epoch, with grad.
    assert sorted(p for grad, p in plans if not grad) == [0, 1, 1]
    assert [p for grad, p in plans if grad] == [0, 0, 1, 1]
    assert record["policy/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert record["policy/ratio_min"] == pytest.approx(1.0, abs=1e-5)
    assert record["policy/kl"] == pytest.approx(0.0, abs=1e-6)  # the reference is the policy at step 1


def test_a_lora_checkpoint_of_the_previous_format_resumes_exactly(tmp_path):
    """Checkpoints written before mmrl.policy: the dLLM adapter file without peft's ``base_model.model.`` prefix and a
    recorded config whose plugin.lora has no ``init`` key. Resuming one continues the run as if never stopped."""
    from safetensors.torch import load_file, save_file

    lora = "plugin.lora={rank: 4, alpha: 8.0}"
    options = [lora, "algorithm.inner_epochs=1", "eval.save_samples=false", "optim.lr=1e-2"]
    straight, _, _ = _train(tmp_path / "straight", *options)
    _train(tmp_path / "split", "run.max_steps=1", *options)
    checkpoint = tmp_path / "split" / "checkpoints" / "step-00000001"
    weights = checkpoint / "policy" / "adapter_model.safetensors"
    state = load_file(str(weights))
    assert state and all(name.startswith("base_model.model.") for name in state)
    save_file({name.removeprefix("base_model.model."): tensor for name, tensor in state.items()}, str(weights))
    recorded = json.loads((checkpoint / "trainer_state.json").read_text())
    del recorded["config"]["plugin"]["lora"]["init"]
    (checkpoint / "trainer_state.json").write_text(json.dumps(recorded))

    resumed, result, _ = _train(tmp_path / "split", "run.resume=latest", *options)
    assert [record["step"] for record in result.history] == [2]
    expected = dict(straight.plugin.policy().named_parameters())
    for name, parameter in resumed.plugin.policy().named_parameters():
        torch.testing.assert_close(parameter.detach(), expected[name].detach(), rtol=0, atol=1e-7)


@pytest.mark.parametrize("minibatches", [1, 2])
def test_the_first_minibatch_reuses_its_training_forward_as_the_old_policy(tmp_path, minibatches):
    """μ = 2 with a plan per epoch: epoch 0's first mini-batch trains on the sampling weights, so the learner takes
    its old log-probs from its own training forward (ratio exactly 1) instead of scoring plan 0 in a separate pass.
    The values it uses equal those of the separate pass (``old_policy_pass`` on plan 0, before the update), and the
    samples of later mini-batches and of epoch 1 are still scored by the pass."""
    from mmrl.seeding import derive_seed
    from mmrl.trainer.learn import old_policy_pass, same_in_train_and_eval
    from mmrl.trainer.sampler import minibatch_partition

    trainer = Trainer(load_config(BASE, [f"run.output_dir={tmp_path}", "run.max_steps=1", "eval.every=0",
                                         "algorithm.kl_coef=0.04", f"algorithm.minibatches={minibatches}"]))
    plugin, learner, policy = trainer.plugin, trainer.learner, trainer.policy
    assert plugin.redraws_per_epoch and same_in_train_and_eval(policy)
    separate: dict[int, torch.Tensor] = {}  # plan -> [N, A] the separate old-policy pass, on the sampling weights
    scored: list[tuple[bool, int, int]] = []  # (gradients enabled, plan, samples) of every forward
    used: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (epoch, logp, old_logp, mask) per loss
    update, forward, loss = learner.update, plugin.forward, learner.policy_loss

    def recorded_update(batch, step):
        rollout = batch.rollout.to(trainer.accelerator.device)
        for plan in range(2):
            plugin.start_inner_epoch(plan)
            separate[plan] = old_policy_pass(plugin, policy, rollout).old_logp
        scored.clear()
        return update(batch, step)

    def recorded_forward(policy, rollout, **kwargs):
        scored.append((torch.is_grad_enabled(), plugin._inner_epoch, len(rollout)))
        return forward(policy, rollout, **kwargs)

    def recorded_loss(logp, old_logp, advantages, mask, **options):
        used.append((plugin._inner_epoch, logp.detach().clone(), old_logp.clone(), mask.clone()))
        return loss(logp, old_logp, advantages, mask, **options)

    learner.update, plugin.forward, learner.policy_loss = recorded_update, recorded_forward, recorded_loss
    record = trainer.train().history[0]
    partition = minibatch_partition(16, minibatches, trainer.config.rollout.layout, 1, 0,
                                    seed=derive_seed(trainer.config.run.seed, 0, 0))
    first = list(partition[0])  # epoch 0's first mini-batch, in the learner's order
    # Without grad the core scores plan 1 for every sample, and plan 0 only for the later mini-batches.
    assert sorted((plan, n) for grad, plan, n in scored if not grad) == sorted(
        [(1, 16)] + ([(0, 16 - len(first))] if minibatches > 1 else []))
    micro = -(-len(first) // 8)  # micro-batches of 8 in the first mini-batch
    epoch0 = [(logp, old, mask) for epoch, logp, old, mask in used if epoch == 0][:micro]
    logp = torch.cat([logp for logp, _, _ in epoch0])  # [n, A]
    mask = torch.cat([mask for _, _, mask in epoch0]) > 0
    assert all(torch.equal(old, logp) for logp, old, _ in epoch0)  # ratio exactly 1
    torch.testing.assert_close(logp[mask], separate[0][first][mask], rtol=1e-5, atol=1e-6)
    assert record["loss/first_step_ratio_deviation"] == 0.0
    # Later mini-batches of epoch 0 and all of epoch 1 train against the pass's old log-probs (finite, not NaN rows).
    later = [old for epoch, _, old, _ in used if epoch == 0][micro:] + [old for epoch, _, old, _ in used if epoch == 1]
    assert len(later) == len(used) - micro and all(bool(torch.isfinite(old).all()) for old in later)


def test_a_checkpoint_is_evaluated_with_other_evaluation_settings_but_not_other_training_ones(tmp_path):
    """`mmrl eval RUN run.resume=latest plugin.eval_temperature=...` evaluates the trained checkpoint with another
    decoding than the run's evaluations used (an evaluation-only key, `eval_only_keys`), while a key that changes
    training (the rollout temperature) is still refused in one line naming it."""
    from mmrl.trainer.checkpoint import CheckpointError

    _train(tmp_path, "run.max_steps=1", "run.save_every=1")
    resume = [f"run.output_dir={tmp_path}", "run.max_steps=1", "run.save_every=1", "run.resume=latest"]
    trainer = Trainer(load_config(BASE, [*resume, "plugin.eval_temperature=0.7", "plugin.eval_remasking=random"]))
    try:
        metrics = trainer.evaluate_checkpoint()
    finally:
        trainer.close()
    assert trainer.step == 1 and "eval/reward_mean" in metrics
    record = json.loads((tmp_path / "evaluations.jsonl").read_text().splitlines()[-1])
    assert record["checkpoint"].endswith("step-00000001")
    saved = (tmp_path / "evaluations" / "step_000001" / "config.yaml").read_text()
    assert "eval_temperature: 0.7" in saved and "eval_remasking: random" in saved
    with pytest.raises(CheckpointError, match=r"differs in 1 key\(s\): plugin.temperature: checkpoint 1.0, now 0.5"):
        Trainer(load_config(BASE, [*resume, "plugin.temperature=0.5"])).evaluate_checkpoint()
