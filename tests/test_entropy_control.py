"""Adaptive entropy control (algorithm.entropy_target; Skywork-OR1 arXiv:2505.22312, TRL's use_adaptive_entropy):
the controller against hand-computed sequences and a restatement of TRL's update, the trainer's wiring on the toy
plugin, the checkpoint, and the config checks."""

import math
import random
from pathlib import Path

import pytest
import torch

from mmrl.config import ConfigError, load_config
from mmrl.reward import Reward, reward_functions
from mmrl.rollout import RolloutError
from mmrl.trainer import Trainer
from mmrl.trainer.entropy_control import AdaptiveEntropyCoef, next_entropy_coef
from tests.helpers import toy_config


class _NanOnFirstCall(Reward):
    """NaN for every sample of the first batch it scores (all dropped under on_nonfinite: skip), then the parity of
    the prompt's length."""

    def __init__(self):
        self.calls = 0

    def __call__(self, batch):
        self.calls += 1
        return [math.nan if self.calls == 1 else float(len(p) % 2) for p in batch.prompts]


reward_functions.register("test_entropy_nan_on_first_call", _NanOnFirstCall)

# One optimizer step per training step, on-policy (ratio 1): each step's loss/total is then -mean(A) - c·mean(H).
ONE_STEP = ("algorithm.minibatches=1", "algorithm.micro_batch_size=64", "run.progress=false")


# ------------------------------------------------------------------------------------------------------- controller
def test_the_coefficient_follows_a_hand_computed_sequence():
    control = AdaptiveEntropyCoef(initial=0.01, target=0.5, delta=0.004, minimum=0.002, maximum=0.02)
    assert control.coef == 0.01 and control.applied == 0.0 and control.last_entropy == math.inf  # gate shut at first
    # entropy:          above   below   =target (up)  below: 0.022 clamps to 0.02  above ... down to the floor 0.002
    entropies = [0.7, 0.4, 0.5, 0.1, 0.1, 0.9, 0.9, 0.9, 0.9, 0.9, 0.3]
    coefs = [0.006, 0.010, 0.014, 0.018, 0.020, 0.016, 0.012, 0.008, 0.004, 0.002, 0.006]
    # the coefficient the next step trains with: coef while the entropy just measured was <= 0.5, else 0
    applied = [0.0, 0.010, 0.014, 0.018, 0.020, 0.0, 0.0, 0.0, 0.0, 0.0, 0.006]
    for entropy, coef, bonus in zip(entropies, coefs, applied, strict=True):
        assert control.update(entropy) == pytest.approx(coef, abs=1e-12)
        assert control.coef == pytest.approx(coef, abs=1e-12) and control.applied == pytest.approx(bonus, abs=1e-12)
    assert control.updates == len(entropies) and control.last_entropy == 0.3


def _trl_adaptive_entropy(coef, entropies, target, delta, lo, hi):
    """TRL f2cd577 trl/trainer/grpo_trainer.py, restated: __init__ (L823-830) sets _last_world_entropy = inf; each
    train step applies `coef if last <= target else 0` (L3176-3179), then at the optimizer-step boundary
    (L3196-3209) `coef = min(coef + delta, max)` if world_entropy <= target else `max(coef - delta, min)`, and
    last = world_entropy. Returns the (applied, coef after) pairs of each optimizer step."""
    last, out = float("inf"), []
    for world_entropy in entropies:
        apply_coef = coef if last <= target else 0.0
        if world_entropy <= target:
            coef = min(coef + delta, hi)
        else:
            coef = max(coef - delta, lo)
        last = world_entropy
        out.append((apply_coef, coef))
    return out


def test_the_controller_matches_trls_update_on_a_random_walk():
    rng = random.Random(0)
    for _ in range(20):
        lo = rng.uniform(0, 0.05)
        hi = lo + rng.uniform(0, 0.1)
        initial, target, delta = rng.uniform(lo, hi), rng.uniform(0.5, 2.0), rng.uniform(1e-4, 0.02)
        entropies = [target + rng.choice([-1, 1]) * rng.uniform(0, 0.3) for _ in range(60)]
        control = AdaptiveEntropyCoef(initial, target, delta, lo, hi)
        ours = []
        for entropy in entropies:
            applied = control.applied
            ours.append((applied, control.update(entropy)))
        for (a, c), (ta, tc) in zip(ours, _trl_adaptive_entropy(initial, entropies, target, delta, lo, hi),
                                    strict=True):
            assert a == pytest.approx(ta, abs=1e-12) and c == pytest.approx(tc, abs=1e-12)


def test_the_pure_rule_moves_up_at_or_below_the_target_and_clamps():
    kwargs = {"target": 1.0, "delta": 0.1, "minimum": 0.0, "maximum": 0.25}
    assert next_entropy_coef(0.1, 1.0, **kwargs) == pytest.approx(0.2)  # at the target: up (TRL's <=)
    assert next_entropy_coef(0.2, 0.5, **kwargs) == 0.25  # clamped to the maximum
    assert next_entropy_coef(0.05, 1.5, **kwargs) == 0.0  # clamped to the minimum


def test_the_state_round_trips_and_the_restored_controller_continues_alike():
    control = AdaptiveEntropyCoef(0.0, 1.0, 0.01, 0.0, 1.0)
    fresh = AdaptiveEntropyCoef(0.0, 1.0, 0.01, 0.0, 1.0)
    fresh.load_state_dict(control.state_dict())  # before any update: the infinite entropy survives
    assert fresh.last_entropy == math.inf and fresh.applied == 0.0
    for entropy in (0.5, 0.7, 1.3):
        control.update(entropy)
    restored = AdaptiveEntropyCoef(0.0, 1.0, 0.01, 0.0, 1.0)
    restored.load_state_dict(control.state_dict())
    assert restored.state_dict() == control.state_dict()
    for entropy in (0.2, 1.5, 0.9):
        assert restored.update(entropy) == control.update(entropy)
    with pytest.raises(ValueError, match="lacks last_entropy"):
        restored.load_state_dict({"coef": 0.1, "updates": 1})


@pytest.mark.parametrize(("arguments", "match"), [
    ({"target": math.nan}, "target must be a finite number"),
    ({"delta": 0.0}, "delta must be a finite number > 0"),
    ({"minimum": 0.5, "maximum": 0.1, "initial": 0.2}, r"0 <= min <= max"),
    ({"initial": 2.0}, r"initial entropy coefficient must lie in \[0.0, 1.0\]"),
])
def test_the_controller_refuses_bad_settings_in_one_line(arguments, match):
    settings = {"initial": 0.0, "target": 1.0, "delta": 0.01, "minimum": 0.0, "maximum": 1.0, **arguments}
    with pytest.raises(ValueError, match=match):
        AdaptiveEntropyCoef(**settings)


def test_a_non_finite_entropy_is_refused_rather_than_lowering_the_coefficient():
    control = AdaptiveEntropyCoef(0.1, 1.0, 0.01, 0.0, 1.0)
    with pytest.raises(ValueError, match="mean entropy of nan"):
        control.update(math.nan)
    assert control.coef == 0.1 and control.updates == 0


# ------------------------------------------------------------------------------------------------------------ trainer
def _check_losses(history, applied):
    """On-policy GRPO with one optimizer step per training step: ratio 1, so the token-mean loss is
    -Σm·A/Σm - c·Σm·H/Σm, the two means the step logs as policy/advantage and policy/entropy."""
    for row, coef in zip(history, applied, strict=True):
        expected = -row["policy/advantage"] - coef * row["policy/entropy"]
        assert row["loss/total"] == pytest.approx(expected, abs=1e-5), (row, coef)


def test_below_the_target_the_coefficient_rises_each_optimizer_step_and_trains_from_the_second(tmp_path):
    # The toy policy's entropy is about 1.9 nats: a target of 10 lies above it, so every update raises c by δ.
    trainer = Trainer(toy_config(tmp_path, "run.max_steps=3", *ONE_STEP, "algorithm.entropy_coef=0.01",
                                 "algorithm.entropy_target=10.0", "algorithm.entropy_coef_delta=0.02"))
    history = trainer.train().history
    assert [row["policy/entropy_coef"] for row in history] == pytest.approx([0.03, 0.05, 0.07])
    applied = [0.0, 0.03, 0.05]  # the first step's gate is shut (no entropy measured yet)
    assert [row["policy/entropy_coef_applied"] for row in history] == pytest.approx(applied)
    _check_losses(history, applied)
    assert trainer.entropy_control.updates == 3 and trainer.entropy_control.last_entropy < 10.0


def test_above_the_target_the_coefficient_falls_to_its_floor_and_no_bonus_trains(tmp_path):
    trainer = Trainer(toy_config(tmp_path, "run.max_steps=3", *ONE_STEP, "algorithm.entropy_coef=0.05",
                                 "algorithm.entropy_target=0.5", "algorithm.entropy_coef_delta=0.02",
                                 "algorithm.entropy_coef_min=0.02"))
    history = trainer.train().history
    assert [row["policy/entropy_coef"] for row in history] == pytest.approx([0.03, 0.02, 0.02])
    assert [row["policy/entropy_coef_applied"] for row in history] == [0.0, 0.0, 0.0]
    _check_losses(history, [0.0, 0.0, 0.0])


def test_the_measured_entropy_is_the_mean_over_the_optimizer_steps_trained_actions(tmp_path):
    # Two optimizer steps per training step, two micro-batches each: the controller sees each optimizer step's
    # mask-weighted mean over both of its micro-batches, recomputed here from the training forwards' outputs.
    trainer = Trainer(toy_config(tmp_path, "run.max_steps=2", "algorithm.minibatches=2", "algorithm.micro_batch_size=8",
                                 "algorithm.entropy_target=10.0", "run.progress=false"))
    forwards, measured = _record_entropies(trainer)
    trainer.train()
    assert len(forwards) == 8 and len(measured) == 4  # 2 steps × 2 optimizer steps × 2 micro-batches
    for k, entropy in enumerate(measured):
        window = forwards[2 * k:2 * k + 2]
        total = sum(float((h * m).sum()) for h, m in window)
        count = sum(float(m.sum()) for _, m in window)
        assert entropy == pytest.approx(total / count, rel=1e-9)


def test_the_first_step_trains_exactly_as_without_a_bonus(tmp_path):
    # The gate is shut until a first entropy is measured: step 1 is the static run with entropy_coef 0 (same code).
    runs = {}
    for name, options in (("static", ()), ("adaptive", ("algorithm.entropy_coef=0.5", "algorithm.entropy_target=9.0"))):
        trainer = Trainer(toy_config(tmp_path / name, "run.max_steps=1", *ONE_STEP, *options))
        trainer.train()
        runs[name] = {n: p.detach().clone() for n, p in trainer.plugin.model.named_parameters()}
    for name, value in runs["static"].items():
        assert torch.equal(runs["adaptive"][name], value), name


def test_a_resumed_run_continues_the_coefficient_sequence_of_one_that_was_not_stopped(tmp_path):
    # Two optimizer steps per training step; the target lies above the entropy so the gate opens after the first
    # update and the coefficient climbs: a resume that rebuilt the controller from the config would restart at 0.01
    # with the gate shut.
    adaptive = ["algorithm.entropy_coef=0.01", "algorithm.entropy_target=10.0", "algorithm.entropy_coef_delta=0.01",
                "algorithm.minibatches=2", "run.progress=false"]
    straight = Trainer(toy_config(tmp_path / "straight", *adaptive, "run.max_steps=4"))
    expected = straight.train().history
    Trainer(toy_config(tmp_path / "split", *adaptive, "run.max_steps=2")).train()
    resumed = Trainer(toy_config(tmp_path / "split", *adaptive, "run.max_steps=4", "run.resume=latest"))
    history = resumed.train().history
    assert resumed.entropy_control.state_dict() == straight.entropy_control.state_dict()
    assert resumed.entropy_control.updates == 8
    keys = ("policy/entropy_coef", "policy/entropy_coef_applied", "policy/entropy", "loss/total")
    assert [[row[k] for k in keys] for row in history[-2:]] == [[row[k] for k in keys] for row in expected[-2:]]
    assert [row["policy/entropy_coef"] for row in expected] == pytest.approx([0.03, 0.05, 0.07, 0.09])
    for name, value in resumed.plugin.model.named_parameters():
        assert torch.equal(value, dict(straight.plugin.model.named_parameters())[name]), name


def test_a_plugin_without_entropy_is_refused_in_one_line(tmp_path):
    trainer = Trainer(toy_config(tmp_path, "run.max_steps=1", "algorithm.entropy_target=1.0", "run.progress=false"))
    _without_entropy(trainer)
    with pytest.raises(RolloutError, match=r"algorithm\.entropy_target .* did not return \(PolicyOutput\.entropy\)"):
        trainer.train()


# ------------------------------------------------------------------------------------------------------------- config
def test_the_options_default_to_trls_and_a_fixed_coefficient(tmp_path):
    algorithm = toy_config(tmp_path).algorithm
    assert algorithm.entropy_target is None  # TRL's use_adaptive_entropy=False
    assert (algorithm.entropy_coef_delta, algorithm.entropy_coef_min, algorithm.entropy_coef_max) == (0.005, 0.0, 1.0)
    trainer = Trainer(toy_config(tmp_path, "algorithm.entropy_coef=0.01"))
    assert trainer.entropy_control is None and trainer.learner.entropy_control is None


@pytest.mark.parametrize(("overrides", "key", "allowed"), [
    (("algorithm.entropy_coef_delta=0.01",), "algorithm.entropy_coef_delta", "0.005 while algorithm.entropy_target "
                                                                             "is null"),
    (("algorithm.entropy_coef_max=0.5",), "algorithm.entropy_coef_max", "1.0 while algorithm.entropy_target is null"),
    (("algorithm.entropy_target=1.0", "algorithm.entropy_coef_min=0.2", "algorithm.entropy_coef_max=0.1",
      "algorithm.entropy_coef=0.1"), "algorithm.entropy_coef_min", r"a number <= algorithm.entropy_coef_max \(0.1\)"),
    (("algorithm.entropy_target=1.0", "algorithm.entropy_coef=0.01", "algorithm.entropy_coef_min=0.02"),
     "algorithm.entropy_coef", r"a number in \[algorithm.entropy_coef_min, algorithm.entropy_coef_max\] = "
                               r"\[0.02, 1.0\]"),
    (("algorithm.entropy_target=1.0", "algorithm.entropy_coef=2.0"), "algorithm.entropy_coef", r".*= \[0.0, 1.0\]"),
    (("algorithm.entropy_target=.inf",), "algorithm.entropy_target", "a finite number"),
])
def test_inconsistent_options_are_config_errors_naming_the_key(tmp_path, overrides, key, allowed):
    with pytest.raises(ConfigError, match=rf"config key '{key}': got .*; allowed: {allowed}"):
        toy_config(tmp_path, *overrides)


def test_a_negative_target_is_accepted_for_continuous_policies(tmp_path):
    assert toy_config(tmp_path, "algorithm.entropy_target=-3.5").algorithm.entropy_target == -3.5


@pytest.mark.parametrize(("config", "extra", "match"), [
    ("configs/flow/shapes.yaml", [], "plugin flow"),
    ("configs/dllm/toy.yaml", [], "plugin dllm"),
    ("configs/vlm/toy_grounding.yaml", ["plugin.entropy=false"], "plugin.entropy"),
])
def test_plugins_without_entropy_refuse_a_target_or_a_fixed_bonus_when_the_config_is_loaded(config, extra, match):
    # Not only at the first training forward, after a whole rollout (a flow or dLLM step costs minutes on a GPU); a
    # fixed bonus on a plugin without entropy would do nothing, silently.
    path = str(Path(__file__).resolve().parents[1] / config)
    allowed = rf"config key 'algorithm\.entropy_target': got 0\.2; allowed: null .*{match}"
    with pytest.raises(ConfigError, match=allowed):
        load_config(path, ["algorithm.entropy_target=0.2", *extra])
    allowed = rf"config key 'algorithm\.entropy_coef': got 0\.01; allowed: 0 .*{match}"
    with pytest.raises(ConfigError, match=allowed):
        load_config(path, ["algorithm.entropy_coef=0.01", *extra])
    if extra:  # the vlm plugin computes entropy by default
        assert load_config(path, ["algorithm.entropy_target=0.2"]).algorithm.entropy_target == 0.2
        assert load_config(path, ["algorithm.entropy_coef=0.01"]).algorithm.entropy_coef == 0.01


def test_a_fixed_bonus_on_a_plugin_that_returns_no_entropy_is_refused_in_one_line(tmp_path):
    trainer = Trainer(toy_config(tmp_path, "run.max_steps=1", "algorithm.entropy_coef=0.01", "run.progress=false"))
    _without_entropy(trainer)
    with pytest.raises(RolloutError, match=r"^algorithm\.entropy_coef 0\.01 weighs an entropy bonus, but plugin 'toy' "
                                           r"did not return entropy \(PolicyOutput\.entropy\); set it to 0$"):
        trainer.train()


# ----------------------------------------------------------------------------------------- measurement and wiring
def test_action_chunks_measure_the_same_entropy_as_whole_rows(tmp_path):
    # One optimizer step over the same rollout and weights: the chunks' windows add up to the whole rows' window.
    measured = {}
    for name, options in (("rows", ()), ("chunks", ("algorithm.action_chunk_size=2",))):
        trainer = Trainer(toy_config(tmp_path / name, "run.max_steps=1", "algorithm.minibatches=1",
                                     "algorithm.micro_batch_size=8", "algorithm.entropy_target=10.0",
                                     "run.progress=false", *options))
        trainer.train()
        assert trainer.entropy_control.updates == 1
        measured[name] = trainer.entropy_control.last_entropy
    assert measured["chunks"] == pytest.approx(measured["rows"], rel=1e-9)


def test_with_top_entropy_quantile_the_measured_entropy_is_that_of_the_selected_actions(tmp_path):
    # TRL measures over its effective mask (completion mask × entropy mask, grpo_trainer.py L3166, L3190 @f2cd577):
    # restated here from the training forward's entropies, with the (1 − ρ)-quantile over the backward pass's
    # active actions (one micro-batch per optimizer step).
    trainer = Trainer(toy_config(tmp_path, "run.max_steps=1", "algorithm.minibatches=2",
                                 "algorithm.micro_batch_size=16", "algorithm.top_entropy_quantile=0.2",
                                 "algorithm.entropy_target=10.0", "run.progress=false"))
    forwards, measured = _record_entropies(trainer)
    trainer.train()
    assert len(forwards) == len(measured) == 2
    for (entropy, mask), value in zip(forwards, measured, strict=True):
        active = entropy[mask > 0]
        threshold = torch.quantile(active.float(), 0.8).double()
        chosen = active[active >= threshold]
        assert 0 < len(chosen) < len(active)
        assert value == pytest.approx(float(chosen.mean()), rel=1e-6)
        assert value > float(active.mean())  # not the mean over every active action


def test_a_step_that_trained_on_no_sample_leaves_the_controller_alone(tmp_path):
    # Every reward of the first step is NaN and dropped (rewards.on_nonfinite: skip): its two optimizer steps are
    # skipped, so the coefficient keeps c_0 and the gate stays shut; the next steps update it twice each.
    trainer = Trainer(toy_config(tmp_path, "run.max_steps=3", "algorithm.minibatches=2", "run.progress=false",
                                 "rewards.functions=[{name: test_entropy_nan_on_first_call}]",
                                 "rewards.on_nonfinite=skip", "algorithm.entropy_target=10.0",
                                 "algorithm.entropy_coef_delta=0.01"))
    history = trainer.train().history
    assert trainer.entropy_control.updates == 4
    assert [row["policy/entropy_coef"] for row in history] == pytest.approx([0.0, 0.02, 0.04])
    assert "policy/entropy_coef_applied" not in history[0]  # no optimizer step trained
    assert [row["policy/entropy_coef_applied"] for row in history[1:]] == pytest.approx([0.005, 0.025])


def test_evaluation_does_not_move_the_controller(tmp_path):
    trainer = Trainer(toy_config(tmp_path, "run.max_steps=1", *ONE_STEP, "algorithm.entropy_target=10.0"))
    trainer.train()
    state = trainer.entropy_control.state_dict()
    trainer.evaluate()
    assert trainer.entropy_control.state_dict() == state


def _record_entropies(trainer: Trainer) -> tuple[list, list]:
    """Hooks on ``trainer``: ``(forwards, measured)``, filled as it trains with each training forward's
    ``(entropy, mask)`` (float64) and each entropy the controller is updated with."""
    forwards, measured = [], []
    forward, update = trainer.plugin.forward, trainer.entropy_control.update

    def recorded_forward(policy, part, **kwargs):
        output = forward(policy, part, **kwargs)
        if torch.is_grad_enabled():
            forwards.append((output.entropy.detach().double(), part.mask.double()))
        return output

    def recorded_update(entropy):
        measured.append(entropy)
        return update(entropy)

    trainer.plugin.forward, trainer.entropy_control.update = recorded_forward, recorded_update
    return forwards, measured


def _without_entropy(trainer: Trainer) -> None:
    """Make ``trainer``'s plugin return no entropy from its forward."""
    forward = trainer.plugin.forward

    def without_entropy(policy, part, **kwargs):
        output = forward(policy, part, **kwargs)
        output.entropy = None
        return output

    trainer.plugin.forward = without_entropy
