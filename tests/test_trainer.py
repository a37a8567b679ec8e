"""The Accelerate trainer end to end with the reference plugin (single process, CPU)."""

import json

import pytest
import torch

from mmrl.reward import RewardError, reward_functions
from mmrl.rollout import RolloutError
from mmrl.trainer import Trainer
from mmrl.trainer.checkpoint import CheckpointError, list_checkpoints
from mmrl.trainer.ema import EMA
from tests.helpers import record_calls, record_gradients, toy_config


def _parameters(trainer):
    return {name: p.detach().clone() for name, p in trainer.plugin.model.named_parameters()}


def _mean(values):
    return sum(values) / len(values)


def _leaving_old_logp_out(trainer):
    """Make the trainer's toy plugin return training rollouts without ``old_logp`` (the toy scores its samples with
    its sampling logits; a plugin that cannot leaves them to the core), so the core's own handling is what runs."""
    original = trainer.plugin.rollout

    def rollout(policy, batch):
        result = original(policy, batch)
        if batch.training:
            result.old_logp = None
        return result

    trainer.plugin.rollout = rollout
    return trainer


@pytest.mark.parametrize(
    "overrides",
    [
        ("algorithm.advantage=grpo", "algorithm.aggregation=token_mean"),
        ("algorithm.advantage=dr_grpo", "algorithm.aggregation=seq_mean_token_sum_norm"),
        ("algorithm.policy_loss=gspo", "algorithm.aggregation=seq_mean_token_mean"),
    ],
    ids=["grpo", "dr_grpo+seq_mean_token_sum_norm", "gspo"],
)
def test_reference_plugin_learns(tmp_path, overrides):
    config = toy_config(tmp_path, "run.max_steps=60", "rollout.prompts_per_step=16", "rollout.group_size=8",
                        "eval.at_start=true", "eval.num_prompts=64", *overrides)
    result = Trainer(config).train()
    rewards = [record["reward/mean"] for record in result.history]
    first, last = _mean(rewards[:10]), _mean(rewards[-10:])
    before, after = result.evaluations[0]["eval/reward_mean"], result.evaluations[60]["eval/reward_mean"]
    assert last > first + 0.15, (first, last)
    assert after > before + 0.15, (before, after)


def test_first_inner_step_has_ratio_one_and_later_epochs_do_not(tmp_path):
    config = toy_config(tmp_path, "run.max_steps=3", "algorithm.inner_epochs=3", "algorithm.minibatches=2",
                        "algorithm.micro_batch_size=4", "optim.lr=3e-2")
    result = Trainer(config).train()
    for record in result.history:
        assert record["loss/first_step_ratio_deviation"] < 1e-5
        # Later inner epochs are off-policy: the ratio moves (clipping becomes possible).
        assert record["policy/ratio_max"] > 1.0 + 1e-4


def _first_step_gradients(tmp_path, name, *overrides):
    trainer = Trainer(toy_config(tmp_path / name, "run.max_steps=1", "eval.at_start=false", *overrides))
    captured = record_gradients(trainer, trainer.plugin.model)
    trainer.train()
    return captured[0]


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                  "seq_mean_token_sum_norm"])
def test_micro_batching_does_not_change_the_gradient(tmp_path, mode):
    """32 samples per optimizer step as 1 micro-batch of 32 or 8 micro-batches of 4: the same gradient."""
    whole = _first_step_gradients(tmp_path, "whole", f"algorithm.aggregation={mode}", "algorithm.micro_batch_size=32")
    split = _first_step_gradients(tmp_path, "split", f"algorithm.aggregation={mode}", "algorithm.micro_batch_size=4")
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_action_chunks_do_not_change_the_gradient(tmp_path, mode):
    """Back-propagating 2 action columns at a time (as flow models do per timestep) gives the same gradient."""
    whole = _first_step_gradients(tmp_path, "whole", f"algorithm.aggregation={mode}")
    chunked = _first_step_gradients(tmp_path, "chunked", f"algorithm.aggregation={mode}",
                                    "algorithm.action_chunk_size=2", "algorithm.micro_batch_size=8")
    for name in whole:
        torch.testing.assert_close(chunked[name], whole[name], rtol=1e-4, atol=1e-7)


def _with_old_logp(trainer, *, shift=0.0):
    """Make the trainer's toy plugin return training rollouts that carry their own ``old_logp`` (replacing the toy's
    own): the sampling weights' log-probs through the forward's computation, moved by
    ``shift`` (a wrong old policy, to show that the comparisons below can tell one apart)."""
    original, plugin = trainer.plugin.rollout, trainer.plugin

    def rollout(policy, batch):
        result = original(policy, batch)
        if batch.training:
            with torch.no_grad():
                logp, _ = plugin._token_logp(plugin.runtime.unwrap(policy), result.replay["prompt_ids"],
                                             result.replay["tokens"])
            result.old_logp = logp + shift
        return result

    trainer.plugin.rollout = rollout
    return trainer


def _train_beside_own_old_logp(core, tmp_path, common):
    """Train ``core`` recording its gradients, then the same run whose plugin returns its own old log-probs:
    (core's gradients, core's TrainResult, the other run's gradients)."""
    got = record_gradients(core, core.plugin.model)
    result = core.train()
    own = _with_old_logp(Trainer(toy_config(tmp_path / "own", *common)))
    expected = record_gradients(own, own.plugin.model)
    own.train()
    return got, result, expected


@pytest.mark.parametrize(
    "overrides",
    [
        ("algorithm.micro_batch_size=4",),
        ("algorithm.policy_loss=gspo", "algorithm.aggregation=seq_mean_token_mean", "algorithm.micro_batch_size=8"),
        ("algorithm.action_chunk_size=2", "algorithm.micro_batch_size=8", "algorithm.kl_coef=0.1"),
        ("rewards.functions=[{name: exact_match}, {name: token_accuracy}]", "rollout.dynamic_sampling.enabled=true",
         "rollout.dynamic_sampling.max_rounds=3"),
    ],
    ids=["grpo+micro-batches", "gspo", "action-chunks+kl", "dynamic-sampling"],
)
def test_training_without_old_logp_matches_training_with_it(tmp_path, overrides):
    """μ = 1 and one mini-batch: every sample trains one optimizer step on the weights that sampled it, so the
    learner's substitute old_logp = logp.detach() gives the same gradient, at every optimizer step, as old log-probs
    the plugin computed itself, and no old-policy pass runs. Gradients are compared, not parameters after AdamW (see
    tests.helpers.record_gradients)."""
    common = ("run.max_steps=4", "optim.lr=3e-2", *overrides)
    computed = _with_old_logp(Trainer(toy_config(tmp_path / "computed", *common)))
    expected = record_gradients(computed, computed.plugin.model)
    computed.train()
    skipped = _leaving_old_logp_out(Trainer(toy_config(tmp_path / "skipped", *common)))
    calls = record_calls(skipped.plugin, "forward")
    got = record_gradients(skipped, skipped.plugin.model)
    result = skipped.train()
    wrong = _with_old_logp(Trainer(toy_config(tmp_path / "wrong", *common)), shift=0.3)
    off = record_gradients(wrong, wrong.plugin.model)
    wrong.train()
    assert len(expected) == len(got) == 4 and expected[0].keys() == got[0].keys()
    assert calls and all(calls)  # training forwards only: no no-grad old-policy pass
    # The two runs differ by the last bits of old_logp (the sampler's vs the training forward's); gradients are
    # O(1e-2) here (clipped to norm 1), their float32 rounding ~1e-8, and a wrong old policy moves them by > 1e-2.
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        for name in want:
            torch.testing.assert_close(have[name], want[name], rtol=1e-4, atol=1e-6, msg=f"step {step}: {name}")
    # A wrong old policy (ratio e^-0.3 < 1 - ε: clipped for negative advantages) gives another gradient.
    assert max(float((off[0][name] - expected[0][name]).abs().max()) for name in expected[0]) > 1e-3
    for record in result.history:
        assert record["loss/first_step_ratio_deviation"] == 0.0  # by construction without old_logp
        assert record["policy/clip_fraction"] == 0.0


def test_needs_old_logp_only_for_several_optimizer_steps_per_rollout(tmp_path):
    from mmrl.plugin import Runtime
    from mmrl.trainer.learn import needs_old_logp

    assert needs_old_logp(toy_config(tmp_path, "algorithm.micro_batch_size=4")) is False
    assert needs_old_logp(toy_config(tmp_path, "algorithm.inner_epochs=2")) is True
    assert needs_old_logp(toy_config(tmp_path, "algorithm.minibatches=2")) is True
    # One optimizer step on the sampling weights: the training forward is the old policy, recompute or not.
    assert needs_old_logp(toy_config(tmp_path, "algorithm.recompute_old_logp=true")) is False
    assert needs_old_logp(toy_config(tmp_path, "algorithm.recompute_old_logp=true", "algorithm.minibatches=2")) is True
    assert needs_old_logp(toy_config(tmp_path, "algorithm.action_chunk_size=2")) is False
    assert not hasattr(Runtime(), "needs_old_logp")  # the core decides; plugins are never told


@pytest.mark.parametrize("minibatches, training_passes", [(1, 2), (2, 2)])
def test_recompute_old_logp_runs_its_pass_only_when_the_old_policy_differs_from_the_training_forward(
        tmp_path, minibatches, training_passes):
    """32 samples in micro-batches of 16: the training forwards take 2 plugin.forward calls per step; the recompute
    pass takes one more (no-grad, the 32 samples in one piece: rollout.batch_size is null), which only several
    optimizer steps per rollout need (at μ = 1 with one mini-batch it would compute the detached training log-probs
    again). Either way the plugin's old log-probs are replaced: made wrong here (shifted by 0.3, which clips), the
    run still gives the gradients of a run whose old log-probs come from the core."""
    common = ("run.max_steps=2", "optim.lr=3e-2", "algorithm.micro_batch_size=16",
              f"algorithm.minibatches={minibatches}")
    recomputed = _with_old_logp(Trainer(toy_config(tmp_path / "recomputed", *common,
                                                   "algorithm.recompute_old_logp=true")), shift=0.3)
    calls = record_calls(recomputed.plugin, "forward")
    got = record_gradients(recomputed, recomputed.plugin.model)
    assert recomputed.geometry.micro_batch_size * 2 == recomputed.config.rollout.prompts_per_step * \
        recomputed.config.rollout.group_size
    recomputed.train()
    old_passes = 0 if minibatches == 1 else 1
    assert len(calls) == 2 * (training_passes + old_passes)  # two training steps
    assert calls.count(False) == 2 * old_passes  # the no-grad recompute pass, one per step
    plain = Trainer(toy_config(tmp_path / "plain", *common))
    expected = record_gradients(plain, plain.plugin.model)
    plain.train()
    # Gradients, not parameters after AdamW, are compared (see tests.helpers.record_gradients).
    assert len(got) == len(expected) == 2 * minibatches
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        for name in want:
            torch.testing.assert_close(have[name], want[name], rtol=1e-4, atol=1e-6, msg=f"step {step}: {name}")


@pytest.mark.parametrize("override", ["algorithm.inner_epochs=2", "algorithm.minibatches=2"])
def test_the_core_computes_old_logp_that_a_rollout_leaves_out(tmp_path, override):
    """Several optimizer steps per rollout and a rollout without old_logp: the learner runs one no-grad
    old-policy pass per step, in eval mode, before the first update, and the run trains with the gradients of a run
    whose plugin computed the same old log-probs itself (a wrong old policy would move them by > 1e-3, see
    test_training_without_old_logp_matches_training_with_it)."""
    common = ("run.max_steps=2", "optim.lr=3e-2", "algorithm.micro_batch_size=16", override)
    core = _leaving_old_logp_out(Trainer(toy_config(tmp_path / "core", *common)))
    modes: list[tuple[bool, bool]] = []  # (gradients enabled, policy in training mode) of every forward
    forward = core.plugin.forward

    def recorded(policy, *args, **kwargs):
        modes.append((torch.is_grad_enabled(), policy.training))
        return forward(policy, *args, **kwargs)

    core.plugin.forward = recorded
    got, result, expected = _train_beside_own_old_logp(core, tmp_path, common)
    assert modes.count((False, False)) == 2 and (False, True) not in modes  # one eval-mode pass per step
    assert all(mode == (True, True) for mode in modes if mode[0])
    assert len(got) == len(expected) == 4
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        for name in want:
            torch.testing.assert_close(have[name], want[name], rtol=1e-4, atol=1e-6, msg=f"step {step}: {name}")
    for record in result.history:  # the old pass and the first training forward score the same weights
        assert record["loss/first_step_ratio_deviation"] < 1e-5


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_first_minibatch_is_its_own_old_policy_unless_the_policy_has_dropout(tmp_path, dropout):
    """μ = 1, two mini-batches, a rollout without old_logp: the first mini-batch trains on the sampling weights, so the
    old-policy pass scores only the second one's samples, and the run trains with the gradients of a run whose plugin
    computed every old log-prob itself. A policy with dropout computes differently in training mode than the
    eval-mode pass (the old policy): then every sample is scored."""
    common = ("run.max_steps=2", "optim.lr=3e-2", "algorithm.micro_batch_size=16", "algorithm.minibatches=2")
    core = _leaving_old_logp_out(Trainer(toy_config(tmp_path / "core", *common)))
    core.plugin.model.probe = torch.nn.Dropout(dropout)  # a module the forward never calls: only the guard reads it
    sizes: list[int] = []  # samples of every no-grad forward
    forward = core.plugin.forward

    def recorded(policy, rollout, **kwargs):
        if not torch.is_grad_enabled():
            sizes.append(len(rollout))
        return forward(policy, rollout, **kwargs)

    core.plugin.forward = recorded
    got, result, expected = _train_beside_own_old_logp(core, tmp_path, common)
    assert sizes == ([16, 16] if dropout == 0 else [32, 32])  # one pass per step, the second mini-batch or all
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        for name in want:
            torch.testing.assert_close(have[name], want[name], rtol=1e-4, atol=1e-6, msg=f"step {step}: {name}")
    for record in result.history:
        assert (record["loss/first_step_ratio_deviation"] == 0.0) if dropout == 0 else \
            (record["loss/first_step_ratio_deviation"] < 1e-5)


def test_old_policy_pass_leaves_out_the_skipped_samples(tmp_path):
    """``old_policy_pass(skip=...)`` scores the other samples as the full pass does; the skipped rows are NaN (and
    with everything skipped no forward runs)."""
    from mmrl.trainer.learn import old_policy_pass

    trainer = _leaving_old_logp_out(Trainer(toy_config(tmp_path, "run.max_steps=1", "algorithm.inner_epochs=2")))
    results = {}
    update = trainer.learner.update

    def recorded_update(batch, step):
        plugin, policy = trainer.plugin, trainer.policy
        calls = record_calls(plugin, "forward")
        rollout = batch.rollout
        results["full"] = old_policy_pass(plugin, policy, rollout, batch_size=8).old_logp
        results["part"] = old_policy_pass(plugin, policy, rollout, batch_size=8, skip=[0, 3, 5]).old_logp
        before = len(calls)
        results["none"] = old_policy_pass(plugin, policy, rollout, skip=list(range(len(rollout)))).old_logp
        results["forwards"] = len(calls) - before
        del plugin.forward
        return update(batch, step)

    trainer.learner.update = recorded_update
    trainer.train()
    full, part = results["full"], results["part"]
    kept = [i for i in range(full.shape[0]) if i not in (0, 3, 5)]
    assert part.shape == full.shape and bool(part[[0, 3, 5]].isnan().all())
    torch.testing.assert_close(part[kept], full[kept])
    assert results["forwards"] == 0 and bool(results["none"].isnan().all())


def test_same_in_train_and_eval_reads_dropout_drop_path_batch_norm_and_model_configs():
    from types import SimpleNamespace

    from mmrl.trainer.learn import same_in_train_and_eval

    assert same_in_train_and_eval(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)))
    assert not same_in_train_and_eval(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)))
    assert not same_in_train_and_eval(torch.nn.Sequential(torch.nn.BatchNorm1d(2)))
    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(to_dict=lambda: {"attention_dropout": 0.0, "hidden_dropout_prob": None})
    assert same_in_train_and_eval(model)
    model.config = SimpleNamespace(to_dict=lambda: {"attention_dropout": 0.1})
    assert not same_in_train_and_eval(model)
    # stochastic depth and LayerDrop, in a config (nested sub-configs too) or as a module, read by class name
    model.config = SimpleNamespace(to_dict=lambda: {"vision_config": {"drop_path_rate": 0.1}, "id2label": {0: "a"}})
    assert not same_in_train_and_eval(model)
    model.config = SimpleNamespace(to_dict=lambda: {"vision_config": {"drop_path_rate": 0.0}, "layerdrop": 0.0})
    assert same_in_train_and_eval(model)
    model.config = SimpleNamespace(to_dict=lambda: {"layerdrop": 0.05})
    assert not same_in_train_and_eval(model)

    class DropPath(torch.nn.Module):
        def __init__(self, drop_prob):
            super().__init__()
            self.drop_prob = drop_prob

    class StochasticDepthBlock(torch.nn.Module):  # a probability under a name the check does not know
        def __init__(self):
            super().__init__()
            self.survival = 0.9

    assert same_in_train_and_eval(torch.nn.Sequential(torch.nn.Linear(2, 2), DropPath(0.0)))
    assert not same_in_train_and_eval(torch.nn.Sequential(torch.nn.Linear(2, 2), DropPath(0.1)))
    assert not same_in_train_and_eval(torch.nn.Sequential(StochasticDepthBlock()))


def _epoch_noise(trainer, *, declare: bool) -> list[tuple[str, object]]:
    """Give the trainer's toy plugin per-epoch 'noise': ``forward`` adds ``0.2 * epoch`` to every log-prob (as a Monte
    Carlo estimate redrawn per inner epoch shifts it), and ``redraws_per_epoch`` says ``declare``. The shift cancels
    in ``logp - old_logp`` exactly when epoch e's old log-probs were computed on epoch e's draw. Returns the list of
    ``("epoch", e)`` and ``("forward", gradients enabled)`` events, filled as the plugin is called."""
    plugin = trainer.plugin
    plugin.__class__ = type("EpochNoiseToy", (type(plugin),), {"redraws_per_epoch": property(lambda self: declare)})
    forward, events = plugin.forward, []
    epoch = [0]

    def start_inner_epoch(index):
        events.append(("epoch", index))
        epoch[0] = index

    def shifted(policy, rollout, **kwargs):
        events.append(("forward", torch.is_grad_enabled()))
        output = forward(policy, rollout, **kwargs)
        output.logp = output.logp + 0.2 * epoch[0]
        return output

    plugin.start_inner_epoch, plugin.forward = start_inner_epoch, shifted
    return events


def test_plugins_that_redraw_noise_per_epoch_get_old_logp_on_each_epochs_draw(tmp_path):
    """μ = 2 with noise redrawn per epoch (``redraws_per_epoch``): the learner runs one old-policy pass per epoch, each
    after ``start_inner_epoch(e)``, so epoch e's ratio compares the two policies on draw e and the run trains like a
    run without the noise; epoch 0's pass leaves out the first mini-batch (here all samples: one mini-batch), whose
    old log-probs are its own training forward's. One pass shared by both epochs (a plugin that does not declare the
    redraw) leaves epoch 1 with a ratio off by e^0.2 and other gradients."""
    common = ("run.max_steps=2", "optim.lr=3e-2", "algorithm.inner_epochs=2", "algorithm.micro_batch_size=16")
    runs = {}
    for name, declare in (("redraws", True), ("undeclared", False)):
        trainer = _leaving_old_logp_out(Trainer(toy_config(tmp_path / name, *common)))
        events = _epoch_noise(trainer, declare=declare)
        runs[name] = (record_gradients(trainer, trainer.plugin.model), events)
        trainer.train()
    plain = _leaving_old_logp_out(Trainer(toy_config(tmp_path / "plain", *common)))
    expected = record_gradients(plain, plain.plugin.model)
    plain.train()
    got, events = runs["redraws"]
    per_step = [("epoch", 0), ("epoch", 1), ("forward", False),  # epoch 0's pass has nothing left to score
                ("epoch", 0), ("forward", True), ("forward", True), ("epoch", 1), ("forward", True), ("forward", True)]
    assert events == per_step * 2
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        for name in want:
            torch.testing.assert_close(have[name], want[name], rtol=1e-4, atol=1e-6, msg=f"step {step}: {name}")
    shared, _ = runs["undeclared"]
    assert max(float((shared[1][name] - expected[1][name]).abs().max()) for name in expected[1]) > 1e-3


def test_evaluation_rollouts_may_omit_old_logp_in_any_run(tmp_path):
    trainer = Trainer(toy_config(tmp_path, "algorithm.inner_epochs=2", "eval.at_start=false"))
    original = trainer.plugin.rollout

    def rollout(policy, batch):
        result = original(policy, batch)
        if not batch.training:
            result.old_logp = None
        return result

    trainer.plugin.rollout = rollout
    assert "eval/reward_mean" in trainer.evaluate()


def test_action_chunks_need_the_token_ratio_level(tmp_path):
    from mmrl.config import ConfigError

    with pytest.raises(ConfigError, match="action_chunk_size"):
        Trainer(toy_config(tmp_path, "algorithm.action_chunk_size=2", "algorithm.policy_loss=gspo"))


def test_metrics_jsonl_holds_the_promised_metrics(tmp_path):
    config = toy_config(tmp_path, "run.max_steps=2", "algorithm.kl_coef=0.1", "algorithm.entropy_coef=0.01",
                        "eval.at_start=true")
    Trainer(config).train()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    for key in ["reward/mean", "reward/std", "reward/token_accuracy_mean", "reward/token_accuracy_std",
                "advantage/mean", "advantage/std", "policy/clip_fraction", "policy/approx_kl", "policy/kl",
                "policy/entropy", "groups/no_spread_fraction", "time/rollout", "time/reward", "time/train",
                "throughput/samples_per_second", "loss/total", "optim/grad_norm", "optim/lr"]:
        assert key in train[0], key
    assert train[0]["policy/kl"] == pytest.approx(0.0, abs=1e-7)  # the reference equals the policy at step 1
    assert any("eval/reward_mean" in r for r in records)
    assert (tmp_path / "samples" / "step_000000" / "eval.jsonl").is_file()
    assert (tmp_path / "config.yaml").is_file()


def test_resume_continues_exactly(tmp_path):
    straight = Trainer(toy_config(tmp_path / "straight", "run.max_steps=6"))
    straight.train()
    Trainer(toy_config(tmp_path / "split", "run.max_steps=3")).train()
    resumed = Trainer(toy_config(tmp_path / "split", "run.max_steps=6", "run.resume=latest"))
    result = resumed.train()
    assert result.history[0]["step"] == 4
    expected, got = _parameters(straight), _parameters(resumed)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    steps = [json.loads(line)["step"] for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps)


def test_checkpoints_rotate_and_latest_points_at_the_newest(tmp_path):
    Trainer(toy_config(tmp_path, "run.max_steps=5", "run.save_every=1", "run.keep_last=2")).train()
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step-00000004", "step-00000005"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000005"
    state = json.loads((tmp_path / "checkpoints" / "step-00000005" / "trainer_state.json").read_text())
    assert state["step"] == 5 and state["stream"]["consumed"] == 5 * 8
    assert (tmp_path / "checkpoints" / "step-00000005" / "policy" / "trainable.safetensors").is_file()


def test_resume_with_an_incompatible_config_is_refused(tmp_path):
    Trainer(toy_config(tmp_path, "run.max_steps=1")).train()
    with pytest.raises(CheckpointError, match="optim.lr"):
        Trainer(toy_config(tmp_path, "run.max_steps=2", "run.resume=latest", "optim.lr=1e-1")).train()


def test_dynamic_sampling_keeps_only_groups_with_spread(tmp_path):
    config = toy_config(tmp_path, "rewards.functions=[{name: exact_match}]", "rollout.dynamic_sampling.enabled=true",
                        "rollout.dynamic_sampling.max_rounds=6", "run.max_steps=1")
    trainer = Trainer(config)
    batch = trainer.collector.collect(trainer.policy, trainer.step, {})
    assert len(batch.rollout) == trainer.geometry.local_samples
    assert batch.metrics["samples/rounds"] > 1  # exact match is rare at first: most groups have no spread
    trained = batch.rollout.mask.sum(dim=1) > 0
    groups = batch.rollout.group_ids[trained]
    for group in groups.unique():
        assert batch.advantages[trained][groups == group].abs().sum() > 0


def test_dynamic_sampling_logs_the_rollout_metrics_of_every_round(tmp_path):
    # The rounds' rollouts are pooled; the logged rollout metrics are their mean over all generated samples, not
    # the first round's.
    config = toy_config(tmp_path, "rewards.functions=[{name: exact_match}]", "rollout.dynamic_sampling.enabled=true",
                        "rollout.dynamic_sampling.max_rounds=6", "run.max_steps=1")
    trainer = Trainer(config)
    rounds: list[tuple[int, float]] = []
    original = trainer.plugin.rollout

    def numbered_rollout(policy, batch):
        rollout = original(policy, batch)
        if batch.training:
            rollout.metrics["round"] = float(len(rounds))
            rounds.append((len(rollout), float(len(rounds))))
        return rollout

    trainer.plugin.rollout = numbered_rollout
    batch = trainer.collector.collect(trainer.policy, trainer.step, {})
    assert batch.metrics["samples/rounds"] == len(rounds) > 1
    expected = sum(n * value for n, value in rounds) / sum(n for n, _ in rounds)
    assert batch.metrics["rollout/round"] == pytest.approx(expected)


def test_dynamic_sampling_pads_when_rounds_run_out(tmp_path):
    config = toy_config(tmp_path, "rewards.functions=[{name: exact_match}]", "rollout.dynamic_sampling.enabled=true",
                        "rollout.dynamic_sampling.max_rounds=1", "run.max_steps=1")
    trainer = Trainer(config)
    batch = trainer.collector.collect(trainer.policy, trainer.step, {})
    assert batch.metrics["samples/padded"] > 0
    padded = batch.rollout.mask.sum(dim=1) == 0
    assert int(padded.sum()) == int(batch.metrics["samples/padded"])
    trainer.learner.update(batch, trainer.step)  # padding takes part without contributing


@reward_functions.register("test_nan_for_even_samples")
def _nan_reward(batch):
    return [float("nan") if i % 2 == 0 else 1.0 for i in range(len(batch))]


def test_nan_rewards_stop_the_run_naming_the_reward(tmp_path):
    config = toy_config(tmp_path, "rewards.functions=[{name: token_accuracy}, {name: test_nan_for_even_samples}]")
    trainer = Trainer(config)
    with pytest.raises(RewardError, match="test_nan_for_even_samples"):
        trainer.train()
    for scorer in (trainer.scorer, trainer.eval_scorer):  # a run that ends in an error still stops its workers
        with pytest.raises(RewardError, match="after close"):
            scorer.submit(None)


def test_nan_rewards_can_be_skipped(tmp_path):
    config = toy_config(tmp_path, "rewards.functions=[{name: token_accuracy}, {name: test_nan_for_even_samples}]",
                        "rewards.on_nonfinite=skip", "run.max_steps=2")
    result = Trainer(config).train()
    assert result.history[0]["samples/invalid"] == 16
    assert all(torch.isfinite(torch.tensor(r["loss/total"])) for r in result.history)


@reward_functions.register("test_length_parity")
def _length_parity(batch):
    return [float(len(prompt) % 2) for prompt in batch.prompts]


def test_evaluation_can_be_scored_by_its_own_rewards(tmp_path):
    config = toy_config(tmp_path, "run.max_steps=1", "eval.at_start=true",
                        "eval.rewards=[{name: test_length_parity, weight: 2.0}]")
    trainer = Trainer(config)
    result = trainer.train()
    parity = _mean([len(row["prompt"]) % 2 for row in trainer.eval_rows])  # one sample per held-out prompt
    for metrics in result.evaluations.values():
        assert metrics["eval/test_length_parity_mean"] == pytest.approx(parity)
        assert metrics["eval/reward_mean"] == pytest.approx(2.0 * parity)
        assert "eval/token_accuracy_mean" not in metrics
    assert "reward/token_accuracy_mean" in result.history[0]  # training still scores rewards.functions
    assert "reward/test_length_parity_mean" not in result.history[0]


@pytest.mark.parametrize("value, match", [("[]", "eval.rewards"), ("[{name: nope}]", "eval.rewards\\[0\\].name")])
def test_bad_evaluation_rewards_are_named(tmp_path, value, match):
    from mmrl.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        toy_config(tmp_path, f"eval.rewards={value}")


def test_a_plugin_that_breaks_the_rollout_contract_is_named(tmp_path, monkeypatch):
    trainer = Trainer(toy_config(tmp_path))
    original = trainer.plugin.rollout

    def shuffled_groups(policy, batch):
        rollout = original(policy, batch)
        rollout.group_ids = rollout.group_ids.flip(0) + 1
        return rollout

    monkeypatch.setattr(trainer.plugin, "rollout", shuffled_groups)
    with pytest.raises(RolloutError, match="group_ids"):
        trainer.train()


def test_ema_warm_up_follows_the_optimizer_step_as_flow_grpo():
    """d = min(0.9, (1 + s)/(10 + s)) with s the 0-based optimizer step of the update (Flow-GRPO's EMAModuleWrapper
    called with the global step): with updates every 8 steps the first uses s = 7, d = 8/17, not (1 + 0)/(10 + 0)."""
    weight = torch.nn.Parameter(torch.zeros(1))
    ema = EMA([weight], decay=0.9)
    assert ema.current_decay(7) == pytest.approx(8 / 17) and ema.current_decay(80) == pytest.approx(0.9)
    expected = 0.0
    for k, value in enumerate([1.0, 2.0, 3.0], start=1):  # the weight at the k-th update, made after step 8k - 1
        with torch.no_grad():
            weight.fill_(value)
        ema.update(step=8 * k - 1)
        d = min(0.9, 8 * k / (8 * k + 9))
        expected = d * expected + (1 - d) * value
    assert ema.shadow[0].item() == pytest.approx(expected) and ema.updates == 3


def test_ema_is_checkpointed_and_used_for_eval(tmp_path):
    config = toy_config(tmp_path, "ema.enabled=true", "ema.update_every=1", "run.max_steps=3")
    trainer = Trainer(config)
    trainer.train()
    assert trainer.ema.updates == 3
    files = [p.name for p in (tmp_path / "checkpoints" / "step-00000003" / "accelerate").iterdir()]
    assert any(name.startswith("custom_checkpoint") for name in files)
    resumed = Trainer(toy_config(tmp_path, "ema.enabled=true", "ema.update_every=1", "run.max_steps=3",
                                 "run.resume=latest"))
    resumed.restore_checkpoint()
    for a, b in zip(resumed.ema.shadow, trainer.ema.shadow, strict=True):
        assert torch.equal(a, b)


def test_async_scoring_trains_exactly_like_synchronous_scoring(tmp_path):
    """Each rollout chunk is scored in the worker pool while the next is sampled; nothing else changes."""
    runs = {}
    for mode in ("false", "true"):
        trainer = Trainer(toy_config(tmp_path / mode, "run.max_steps=2", "rollout.batch_size=8",
                                     f"rewards.async_scoring={mode}", "rewards.num_workers=2"))
        result = trainer.train()
        runs[mode] = ([r["reward/mean"] for r in result.history], _parameters(trainer))
    assert runs["true"][0] == runs["false"][0]
    for name, tensor in runs["false"][1].items():
        assert torch.equal(runs["true"][1][name], tensor), name


def test_learning_rate_schedules(tmp_path):
    """Linear warmup over 4 optimizer steps, then linear or cosine decay to 0 over the remaining ones."""
    import math

    for scheduler in ("constant", "linear", "cosine"):
        trainer = Trainer(toy_config(tmp_path / scheduler, "run.max_steps=12", "algorithm.minibatches=1",
                                     f"optim.scheduler={scheduler}", "optim.warmup_steps=4", "optim.lr=0.1"))
        assert [trainer.learner.lr(s) for s in range(4)] == pytest.approx([0.025, 0.05, 0.075, 0.1])
        # 12 optimizer steps in all: after warmup, progress runs over 8 steps.
        expected = {
            "constant": [0.1] * 9,
            "linear": [0.1 * (1 - k / 8) for k in range(9)],
            "cosine": [0.1 * 0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(9)],
        }[scheduler]
        assert [trainer.learner.lr(4 + k) for k in range(9)] == pytest.approx(expected)


def test_metrics_reach_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    Trainer(toy_config(tmp_path, "run.max_steps=2", "run.trackers=[tensorboard]")).train()
    events = list(tmp_path.rglob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_a_skipped_sample_does_not_give_its_group_a_spread(tmp_path):
    """Dynamic sampling keeps groups whose *valid* rewards differ; a NaN-skipped member's placeholder 0 is not one."""
    trainer = Trainer(toy_config(tmp_path, "rollout.dynamic_sampling.enabled=true", "rewards.on_nonfinite=skip"))
    assert trainer.geometry.group_size == 4
    rollout = trainer.collector.collect(trainer.policy, 0, {}).rollout.select(torch.arange(8))
    rollout.group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])  # two whole groups of 4
    scores = torch.tensor([[1.0], [1.0], [1.0], [0.0], [1.0], [0.0], [1.0], [0.0]])
    valid = torch.tensor([True, True, True, False, True, True, True, True])  # sample 3 was skipped
    advantages, keep, _ = trainer.collector.credit(rollout, scores, valid)
    assert keep.tolist() == [False] * 4 + [True] * 4
    assert advantages[:4].abs().sum() == 0


@pytest.mark.parametrize("processes", [1, 2, 3, 8])
def test_each_evaluation_prompt_is_scored_whole_on_one_process(processes):
    from mmrl.trainer.trainer import evaluation_share

    prompts, per_prompt = 7, 4
    shares = [evaluation_share(prompts, per_prompt, rank, processes) for rank in range(processes)]
    assert sorted(k for share in shares for k in share) == list(range(prompts * per_prompt))  # each sample once
    for share in shares:  # a group-wise eval reward sees every sample of its group on one process
        owned = {k // per_prompt for k in share}
        assert sorted(share) == [p * per_prompt + j for p in sorted(owned) for j in range(per_prompt)]
    assert shares[0] == list(range(prompts * per_prompt)) if processes == 1 else len(shares[0]) < prompts * per_prompt


def test_a_plugin_without_held_out_prompts_is_refused_before_training(tmp_path, monkeypatch):
    """Every run evaluates at its end: an empty 'eval' split would report no samples and a NaN score."""
    from mmrl.config import ConfigError
    from mmrl.plugins.toy.plugin import ToyPlugin

    original = ToyPlugin.dataset
    monkeypatch.setattr(ToyPlugin, "dataset", lambda self, split: [] if split == "eval" else original(self, split))
    with pytest.raises(ConfigError, match="empty 'eval' split"):
        Trainer(toy_config(tmp_path))


def test_evaluation_rewards_equal_to_the_training_ones_share_their_scorer(tmp_path):
    same = Trainer(toy_config(tmp_path / "same", "eval.rewards=[{name: token_accuracy}]"))
    assert same.eval_scorer is same.scorer  # a reward model would otherwise be loaded twice
    other = Trainer(toy_config(tmp_path / "other", "eval.rewards=[{name: token_accuracy, weight: 2.0}]"))
    assert other.eval_scorer is not other.scorer
    assert other.eval_scorer.weights.tolist() == [2.0]


def test_a_training_step_that_raises_closes_the_progress_bar_and_the_reward_pools(tmp_path, monkeypatch):
    import mmrl.trainer.trainer as trainer_module

    bars = []

    class RecordingBar:
        def __init__(self, *args, **kwargs):
            self.closed = False
            bars.append(self)

        def update(self, count):
            pass

        def set_postfix(self, **kwargs):
            pass

        def close(self):
            self.closed = True

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()
            return False

    monkeypatch.setattr(trainer_module, "tqdm", RecordingBar)
    trainer = Trainer(toy_config(tmp_path, "run.max_steps=3", "eval.at_start=false"))
    closed = []
    close = trainer.scorer.close
    trainer.scorer.close = lambda **kwargs: (closed.append(kwargs), close(**kwargs))
    step = trainer.training_step
    calls = []

    def failing_second_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a step that fails")
        return step()

    trainer.training_step = failing_second_step
    with pytest.raises(RuntimeError, match="a step that fails"):
        trainer.train()
    assert len(bars) == 1 and bars[0].closed
    assert closed and all(kwargs == {"wait": False} for kwargs in closed)  # eval may share this scorer


def test_max_ratio_deviation_covers_active_actions_only():
    from mmrl.trainer.learn import max_ratio_deviation

    old = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.2, 0.4, 0.1]]))
    new = torch.log(torch.tensor([[0.6, 0.25, 5.0], [0.1, 0.4, 0.1]]))  # ratios 1.2, 1, 10 / 0.5, 1, 1
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the ratio 10 is padding
    assert float(max_ratio_deviation(new, old, mask)) == pytest.approx(0.5, rel=1e-6)  # |0.5 − 1| beats |1.2 − 1|
    assert float(max_ratio_deviation(new, old, torch.zeros(2, 3))) == 0.0
    assert float(max_ratio_deviation(new[:, :0], old[:, :0], mask[:, :0])) == 0.0
    nan = new.clone()
    nan[0, 0] = float("nan")
    assert torch.isnan(max_ratio_deviation(nan, old, mask))


def test_read_scalars_reads_tensors_as_float32_and_keeps_floats():
    from mmrl.trainer.learn import _read_scalars

    third = torch.tensor(1 / 3, dtype=torch.float64)
    metrics, extra = _read_scalars({"a": 0.1, "b": third, "c": torch.tensor([2.5])}, (torch.tensor(7.0), 3))
    assert metrics == {"a": 0.1, "b": float(third.float().item()), "c": 2.5} and extra == [7.0, 3.0]
    assert metrics["b"] != 1 / 3  # read through float32, as WeightedMeans.add reads a tensor
    assert list(metrics) == ["a", "b", "c"]
    # Tensors are stacked per device (a loss may return some diagnostics on the CPU): a meta tensor next to CPU
    # ones is read on its own, which fails for want of data, not with a device mismatch in torch.stack.
    with pytest.raises(NotImplementedError, match="meta"):
        _read_scalars({"a": torch.tensor(1.5), "x": torch.empty((), device="meta")}, ())


def test_micro_batch_diagnostics_are_the_masked_means_of_kl_entropy_and_advantage(tmp_path):
    """The learner's own diagnostics (computed in one stacked reduction with the policy loss's) against one masked
    mean each, on a rollout with padding and a fractional mask."""
    from mmrl.plugin import PolicyOutput

    trainer = Trainer(toy_config(tmp_path, "algorithm.kl_coef=0.1"))
    rollout = trainer.collector.collect(trainer.policy, 0, {}).rollout.select(torch.arange(12))
    generator = torch.Generator().manual_seed(3)
    shape = rollout.mask.shape
    rollout.mask = rollout.mask * torch.rand(shape, generator=generator).clamp(min=0.1)
    rollout.mask[0] = 0.0
    logp = rollout.old_logp + 0.1 * torch.randn(shape, generator=generator)
    entropy, ref = torch.rand(shape, generator=generator), logp - 0.2 * torch.rand(shape, generator=generator)
    advantages = torch.randn(len(rollout), generator=generator)
    trainer.plugin.forward = lambda *args, **kwargs: PolicyOutput(logp=logp, ref_logp=ref, entropy=entropy)
    _, metrics, _, weight = trainer.learner._micro_loss(rollout, advantages, False, 50.0, 10.0, 6, None,
                                                        rollout.mask.double().sum(1))

    def mean(values):
        return float((values * rollout.mask).sum() / rollout.mask.sum())

    kl = trainer.learner.kl_estimator(logp, ref)
    assert float(metrics["policy/kl"]) == pytest.approx(mean(kl), rel=1e-6)
    assert float(metrics["policy/entropy"]) == pytest.approx(mean(entropy), rel=1e-6)
    assert float(metrics["policy/advantage"]) == pytest.approx(mean(advantages.unsqueeze(1).expand(shape)), rel=1e-6)
    assert float(weight) == pytest.approx(float(rollout.mask.sum()), rel=1e-6)
    trainer.close()


def test_runtime_unwrap_runs_accelerate_once_per_wrapper_and_forgets_dropped_modules():
    """`Runtime.unwrap` (CachedUnwrap) returns what the wrapped unwrap returns, calls it once per module object, and
    holds no module alive."""
    import gc
    import weakref

    from mmrl.trainer.trainer import CachedUnwrap

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    calls = []

    def unwrap(module):
        calls.append(type(module).__name__)
        return getattr(module, "module", module)

    cached = CachedUnwrap(unwrap)
    bare, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    wrapper = Wrapper(bare)
    assert cached(wrapper) is bare and cached(wrapper) is bare
    assert cached(other) is other and cached(other) is other
    assert calls == ["Wrapper", "Linear"]
    dropped = weakref.ref(other)
    del other
    gc.collect()
    assert dropped() is None  # not kept alive by the cache (an unwrapped module is stored without itself)
