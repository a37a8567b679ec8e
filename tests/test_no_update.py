"""A step in which no sample entered the loss is warned about; a run in which no step did is an error."""

import pytest
import torch

from mmrl.reward import Reward, reward_functions
from mmrl.trainer import Trainer
from mmrl.trainer.updates import NoUpdateError
from tests.helpers import toy_config


@reward_functions.register("test_nan_always")
def _nan_always(batch):
    return [float("nan")] * len(batch)


@reward_functions.register("test_same_for_all")
def _same_for_all(batch):
    return [1.0] * len(batch)


class _NanOnFirstCall(Reward):
    """NaN for every sample of the first batch it scores, then the parity of the prompt's length."""

    def __init__(self):
        self.calls = 0

    def __call__(self, batch):
        self.calls += 1
        return [float("nan") if self.calls == 1 else float(len(p) % 2) for p in batch.prompts]


reward_functions.register("test_nan_on_first_call", _NanOnFirstCall)


def _stderr_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_a_run_in_which_every_reward_is_nan_under_skip_fails_naming_the_reward(tmp_path, capsys):
    config = toy_config(tmp_path, "rewards.functions=[{name: test_nan_always}]", "rewards.on_nonfinite=skip",
                        "run.max_steps=2")
    trainer = Trainer(config)
    with pytest.raises(NoUpdateError) as info:
        trainer.train()
    message = str(info.value)
    assert "\n" not in message
    assert message == ("no step of this run trained on any sample (2 step(s), nothing learned); at step 2: all 32 "
                       "samples had a NaN or infinite reward (reward 'test_nan_always'), and rewards.on_nonfinite=skip "
                       "drops such samples")
    warnings = [line for line in _stderr_lines(capsys) if line.startswith("mmrl: warning:")]
    assert warnings == [f"mmrl: warning: step {step} trained on no sample: all 32 samples had a NaN or infinite "
                        "reward (reward 'test_nan_always'), and rewards.on_nonfinite=skip drops such samples"
                        for step in (1, 2)]
    assert trainer.updates.empty_steps == [1, 2]


def test_a_run_in_which_only_some_steps_trained_on_nothing_warns_and_completes(tmp_path, capsys):
    config = toy_config(tmp_path, "rewards.functions=[{name: test_nan_on_first_call}]", "rewards.on_nonfinite=skip",
                        "run.max_steps=3")
    trainer = Trainer(config)
    result = trainer.train()
    assert result.step == 3 and trainer.updates.empty_steps == [1]
    assert [record["samples/trained"] for record in result.history] == [0.0, 32.0, 32.0]
    warnings = [line for line in _stderr_lines(capsys) if line.startswith("mmrl: warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("mmrl: warning: step 1 trained on no sample: all 32 samples")


def test_dynamic_sampling_that_keeps_nothing_names_the_missing_spread(tmp_path):
    config = toy_config(tmp_path, "rewards.functions=[{name: test_same_for_all}]",
                        "rollout.dynamic_sampling.enabled=true", "rollout.dynamic_sampling.max_rounds=2",
                        "run.max_steps=1")
    with pytest.raises(NoUpdateError) as info:
        Trainer(config).train()
    assert str(info.value).endswith("at step 1: dynamic sampling kept no sample in 2 round(s): no group had a reward "
                                    "spread above rollout.dynamic_sampling.tolerance=0.0")


def test_a_run_with_samples_in_every_step_reports_how_many_trained(tmp_path, capsys):
    result = Trainer(toy_config(tmp_path, "run.max_steps=1")).train()
    assert result.history[0]["samples/trained"] == 32.0
    assert not [line for line in _stderr_lines(capsys) if "warning" in line]


class _ValidOnFirstCall(Reward):
    """The parity of the prompt's length for the first batch it scores, then NaN for every sample."""

    def __init__(self):
        self.calls = 0

    def __call__(self, batch):
        self.calls += 1
        return [float(len(p) % 2) if self.calls == 1 else float("nan") for p in batch.prompts]


reward_functions.register("test_valid_on_first_call", _ValidOnFirstCall)


def test_a_step_that_trained_on_no_sample_leaves_the_weights_alone(tmp_path):
    """AdamW would move every weight on an empty step (its momentum from step 1, its weight decay): the learner
    skips the optimizer step instead, so the weights after steps 2 and 3 are exactly those after step 1."""
    overrides = ("rewards.functions=[{name: test_valid_on_first_call}]", "rewards.on_nonfinite=skip",
                 "optim.weight_decay=0.1", "algorithm.minibatches=2")
    after_one = Trainer(toy_config(tmp_path / "one", *overrides, "run.max_steps=1"))
    after_one.train()
    after_three = Trainer(toy_config(tmp_path / "three", *overrides, "run.max_steps=3"))
    result = after_three.train()
    assert after_three.updates.empty_steps == [2, 3]
    assert after_three.learner.optimizer_steps == 6  # the schedule's position still advances
    assert result.history[-1]["loss/first_step_ratio_deviation"] == 0.0
    one = dict(after_one.policy.named_parameters())
    for name, tensor in after_three.policy.named_parameters():
        assert torch.equal(tensor, one[name]), name  # no arithmetic touched them after step 1


def test_empty_step_warnings_are_rate_limited():
    """A run whose reward is NaN at every step would print a warning per step: the first three are printed, then
    only the 2^k-th (4, 8, 16, ...), each with a tally; every observation still returns its warning."""
    from mmrl.trainer.updates import _worth_printing

    printed = [count for count in range(1, 401) if _worth_printing(count)]
    assert printed == [1, 2, 3, 4, 8, 16, 32, 64, 128, 256]
