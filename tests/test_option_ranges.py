"""Declared ranges of registry options (``Annotated[float, Range(...)]``): checked when a config loads, in one line
naming the key; every numeric option of every built-in registry entry declares one; the declared range agrees with
the entry's own runtime check at every bound."""

from __future__ import annotations

import copy
import importlib
import math
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Union

import pytest
import torch

from mmrl.cli import REGISTRIES, main, plugin_registries
from mmrl.config import ConfigError, load_config
from mmrl.config.schema import bind_options, option_kind
from mmrl.registry import ANY_FINITE, Range, callable_options, split_range
from mmrl.reward import RewardError, RewardInput, build_reward
from tests.helpers import BASE

ROOT = Path(__file__).resolve().parents[1]
OPTION_REGISTRIES_OF_PLUGINS = {"likelihood_estimators"}


# ------------------------------------------------------------------------------------------------------ Range itself
def test_range_text_and_membership():
    unit = Range(0, 1, high_open=True)
    assert unit.text == "in [0, 1)" and str(unit) == "in [0, 1)"
    assert 0 in unit and 0.999 in unit and 1 not in unit and -1e-12 not in unit
    assert math.nan not in unit and math.inf not in unit and True not in unit and "0.5" not in unit
    above_one = Range(1, low_open=True)
    assert above_one.text == "> 1" and 1 not in above_one and 1.0000001 in above_one and 1e300 in above_one
    assert Range(0).text == ">= 0" and Range(high=5, high_open=True).text == "< 5" and Range(high=5).text == "<= 5"
    assert Range(1e-3, 0.25).text == "in [0.001, 0.25]" and Range(784).text == ">= 784"
    assert ANY_FINITE.text == "" and str(ANY_FINITE) == "any finite value"
    assert -1e300 in ANY_FINITE and math.nan not in ANY_FINITE and -math.inf not in ANY_FINITE


@pytest.mark.parametrize("arguments", [
    {"low": 1, "high": 0},  # empty
    {"low": 1, "high": 1, "low_open": True},  # empty
    {"low_open": True},  # an open end without a bound
    {"low": math.nan},
    {"high": math.inf},
    {"low": True},
])
def test_a_malformed_range_is_refused_when_declared(arguments):
    with pytest.raises(ValueError, match="Range"):
        Range(**arguments)


def test_split_range_reads_annotated_alone_and_inside_optional():
    declared = Range(1, low_open=True)
    assert split_range(Annotated[float, declared]) == (float, declared)
    assert split_range(Annotated[float, declared] | None) == (Union[float, None], declared)  # noqa: UP007
    assert split_range(Annotated[float | None, declared]) == (float | None, declared)
    assert split_range(float) == (float, None) and split_range(Annotated[int, "other"]) == (int, None)


# ------------------------------------------------------------------------------------------------------ bind_options
def _toy(batch, *, count: Annotated[int, Range(1)] = 2, cap: Annotated[float, Range(1, low_open=True)] | None = None,
         offset: Annotated[float, ANY_FINITE] = 0.0, share: Annotated[float, Range(0, 1)] = 0.5):
    """A toy registry entry.

    Args:
        count: An integer >= 1.
        cap: A number > 1, or null.
        offset: Any finite number.
        share: A fraction.
    """


@pytest.mark.parametrize(("options", "key", "allowed"), [
    ({"count": 0}, "k.count", "an integer >= 1"),
    ({"count": 2.5}, "k.count", "an integer >= 1"),  # integer options are checked as integers
    ({"count": "two"}, "k.count", "an integer >= 1"),
    ({"cap": 1}, "k.cap", "a number > 1 or null"),
    ({"cap": math.nan}, "k.cap", "a finite number > 1 or null"),
    ({"offset": math.inf}, "k.offset", "a finite number"),
    ({"share": -0.0001}, "k.share", "a number in [0, 1]"),
    ({"share": 1.0001}, "k.share", "a number in [0, 1]"),
])
def test_bind_options_refuses_values_outside_the_declared_range(options, key, allowed):
    with pytest.raises(ConfigError) as info:
        bind_options(_toy, options, "k", "toy 'x'")
    assert (info.value.key, info.value.allowed) == (key, allowed) and "\n" not in str(info.value)


def test_bind_options_keeps_values_inside_the_declared_range_with_their_types():
    bound = bind_options(_toy, {"count": 3.0, "cap": 1.5, "offset": -1e300, "share": 1}, "k", "toy 'x'")
    assert bound == {"count": 3, "cap": 1.5, "offset": -1e300, "share": 1.0}
    assert type(bound["count"]) is int and type(bound["share"]) is float
    assert bind_options(_toy, {"cap": None}, "k", "toy 'x'") == {"cap": None}
    kinds = {option.name: option_kind(option) for option in callable_options(_toy)}
    assert kinds == {"count": "int, >= 1", "cap": "float | null, > 1", "offset": "float, any finite value",
                     "share": "float, in [0, 1]"}


def test_bind_options_calls_an_entrys_nested_binding_with_the_bound_options():
    calls = []

    class Outer:
        def __init__(self, inner: dict[str, Any] | None = None, level: Annotated[int, Range(0)] = 0):
            """Args:
                inner: Options of the inner entry.
                level: Any level >= 0.
            """

        @staticmethod
        def bind_nested_options(options, key):
            calls.append((options, key))
            return {**options, "inner": bind_options(_toy, options.get("inner") or {}, f"{key}.inner", "toy 'x'")}

    assert bind_options(Outer, {"inner": {"count": 4.0}, "level": 1}, "r.args", "outer") == {
        "inner": {"count": 4}, "level": 1}
    assert calls == [({"inner": {"count": 4.0}, "level": 1}, "r.args")]
    with pytest.raises(ConfigError) as info:
        bind_options(Outer, {"inner": {"count": 0}}, "r.args", "outer")
    assert info.value.key == "r.args.inner.count" and info.value.allowed == "an integer >= 1"


# ---------------------------------------------------------------------------------------- census of every registry
def _builtin_options() -> list[tuple[str, str, Any]]:
    """``(registry, entry, Option)`` for every option of every built-in entry of every registry ``mmrl list``
    shows. Entries that tests or third-party packages register are left out: they declare what they like."""
    registries = [(title, getattr(importlib.import_module(location.split(":")[0]), location.split(":")[1]))
                  for title, location, _ in REGISTRIES]
    # Of the plugins' own registries, those whose entries take options from a config (plugin.estimator_options);
    # the model adapters take their arguments from the plugin's own config fields and the credit strategies none.
    registries += [(title, entry_point.load()) for title, entry_point in plugin_registries()
                   if title.split()[0] in OPTION_REGISTRIES_OF_PLUGINS]
    found = []
    for title, registry in registries:
        for name in registry.names():
            if not getattr(registry.get(name), "__module__", "").startswith("mmrl."):
                continue
            found += [(title.split()[0], name, option) for option in registry.options(name)]
    return found


def _is_numeric(option) -> bool:
    """An int or float option (bool is not a number here), or an untyped one whose default is a number."""
    annotation = option.annotation
    members = typing.get_args(annotation) if typing.get_origin(annotation) in (Union, types.UnionType) else (
        annotation,)
    if any(member in (int, float) for member in members):
        return True
    untyped = annotation is Any
    return untyped and isinstance(option.default, (int, float)) and not isinstance(option.default, bool)


def _is_int(option) -> bool:
    members = typing.get_args(option.annotation) or (option.annotation,)
    return int in members and float not in members


OPTIONS = _builtin_options()
NUMERIC = [(registry, name, option) for registry, name, option in OPTIONS if _is_numeric(option)]
RANGED = [(registry, name, option) for registry, name, option in NUMERIC if option.range and option.range.text]
IDS = [f"{registry}.{name}.{option.name}" for registry, name, option in RANGED]


def test_the_census_reaches_every_registry_and_its_numeric_options():
    keys = {f"{registry}.{name}.{option.name}" for registry, name, option in NUMERIC}
    for key in ["advantage_estimators.grpo.eps", "advantage_estimators.wd1.temperature",
                "policy_losses.grpo.clip_low", "policy_losses.gspo.dual_clip", "policy_losses.spg.mix",
                "reward_functions.math.rel_tol", "reward_functions.jpeg_compressibility.quality",
                "reward_functions.remote.retries", "reward_functions.detection.max_pixels",
                "pairwise_judges.pointwise.tolerance", "likelihood_estimators.spg_upper.beta",
                "likelihood_estimators.spg_lower.block_length"]:
        assert key in keys, key
    # The estimators' and aggregation modes' parameters that their callers supply are not options.
    assert "likelihood_estimators.one_step.num_samples" not in keys and not any("aggregation" in k for k in keys)


def test_the_numeric_predicate_catches_typed_and_untyped_numbers():
    def entry(batch, *, a=0.5, b: int = 1, c: float | None = None, d: bool = True, e: str = "x", f=None):
        """Toy."""

    numeric = {option.name for option in callable_options(entry) if _is_numeric(option)}
    assert numeric == {"a", "b", "c"}


@pytest.mark.parametrize(("registry", "name", "option"), NUMERIC,
                         ids=[f"{registry}.{name}.{option.name}" for registry, name, option in NUMERIC])
def test_every_numeric_option_declares_a_range_or_any_finite(registry, name, option):
    assert option.range is not None, (
        f"{registry} {name!r}: option {option.name!r} is a number without a declared range; annotate it "
        "Annotated[float, Range(low, high, ...)] from what the code accepts, or Annotated[float, ANY_FINITE]")
    if option.default is not None and not option.required:
        assert option.default in option.range, (registry, name, option.name, option.default, option.range)


# ------------------------------------------------------------------------------------------ config load, every option
def _config(registry: str, name: str, option: str, value: Any) -> tuple[dict, str, Any]:
    """A run config that sets ``option`` of entry ``name`` to ``value``, the option's dotted key, and a function that
    reads the bound value back from the loaded config."""
    data = copy.deepcopy(BASE)
    if registry in ("advantage_estimators", "policy_losses"):
        field = "advantage" if registry == "advantage_estimators" else "policy_loss"
        data["algorithm"][field] = {"name": name, option: value}
        return data, f"algorithm.{field}.{option}", lambda c: getattr(c.algorithm, field).options[option]
    if registry == "reward_functions":
        required = {"per_frame": {"reward": "jpeg_compressibility"},  # the image reward it applies
                    "temporal_contrast": {"reward": "exact_match"},  # the accuracy reward it wraps
                    "correct_length_bonus": {"reward": "exact_match"},
                    "overlong_penalty": {"max_length": 16, "buffer": 4}}.get(name, {})
        data["rewards"] = {"functions": [{"name": name, "args": {**required, option: value}}]}
        return data, f"rewards.functions[0].args.{option}", lambda c: c.rewards.functions[0].args[option]
    if registry == "pairwise_judges":
        args = {"judge": name, "judge_args": {option: value}}
        data["rewards"] = {"functions": [{"name": "pref_winrate", "args": args}]}
        return (data, f"rewards.functions[0].args.judge_args.{option}",
                lambda c: c.rewards.functions[0].args["judge_args"][option])
    if registry == "likelihood_estimators":
        # random_masking also needs t_low <= t_high: the other bound at its loosest
        other = {("random_masking", "t_low"): {"t_high": 1.0}, ("random_masking", "t_high"): {"t_low": 1e-9}}
        options = {**other.get((name, option), {}), option: value}
        data = {"plugin": {"name": "dllm", "estimator": name, "estimator_options": options},
                "rewards": {"functions": [{"name": "exact_match"}]}}
        return data, f"plugin.estimator_options.{option}", lambda c: c.plugin.config.estimator_options[option]
    raise AssertionError(f"no config builder for registry {registry}")


def _outside(declared: Range, integer: bool) -> list[float]:
    """Values just outside each bound (the bound itself where it is open)."""
    values = []
    if declared.low is not None:
        values.append(declared.low if declared.low_open else
                      declared.low - 1 if integer else math.nextafter(declared.low, -math.inf))
    if declared.high is not None:
        values.append(declared.high if declared.high_open else
                      declared.high + 1 if integer else math.nextafter(declared.high, math.inf))
    return values


def _inside(declared: Range, integer: bool) -> list[float]:
    """Each closed bound, and a value strictly inside."""
    low, high = declared.low, declared.high
    values = [bound for bound, is_open in ((low, declared.low_open), (high, declared.high_open))
              if bound is not None and not is_open]
    if low is not None and high is not None:
        values.append((low + high) // 2 if integer else (low + high) / 2)
    elif low is not None:
        values.append(low + 1)
    else:
        values.append(high - 1)
    return values


@pytest.mark.parametrize(("registry", "name", "option"), RANGED, ids=IDS)
def test_every_ranged_option_refuses_values_outside_its_range_when_the_config_loads(registry, name, option):
    integer = _is_int(option)
    for value in _outside(option.range, integer):
        data, key, _ = _config(registry, name, option.name, int(value) if integer else value)
        with pytest.raises(ConfigError) as info:
            load_config(data)
        message = str(info.value)
        assert info.value.key == key and "\n" not in message, message
        noun = "an integer" if integer else "a number"
        assert info.value.allowed.startswith(f"{noun} {option.range.text}"), message


@pytest.mark.parametrize(("registry", "name", "option"), RANGED, ids=IDS)
def test_every_ranged_option_keeps_values_inside_its_range(registry, name, option):
    integer = _is_int(option)
    for value in _inside(option.range, integer):
        value = int(value) if integer else float(value)
        data, _, read = _config(registry, name, option.name, value)
        bound = read(load_config(data))
        assert bound == value and type(bound) is type(value), (bound, value)


# Hand-derived from each function's own check or the paper: the allowed text a user reads for a value just outside.
@pytest.mark.parametrize(("registry", "name", "option", "value", "allowed"), [
    ("policy_losses", "grpo", "clip_low", 1.0, "a number in [0, 1)"),  # 1 − ε_low must stay > 0
    ("policy_losses", "grpo", "clip_high", -0.01, "a number >= 0"),
    ("policy_losses", "gspo", "dual_clip", 1.0, "a number > 1 or null"),  # Ye et al. 2020, eq. (5): c > 1
    ("policy_losses", "grpo", "delta", 1.0, "a number > 1 or null"),  # r = 1 must stay below the cap
    ("policy_losses", "spg", "mix", 1.5, "a number in [0, 1]"),
    ("policy_losses", "nft", "adv_clip_max", 0.0, "a number > 0"),  # r divides by A_max
    ("policy_losses", "cispo", "clip_low", 1.0, "a number in [0, 1) or null"),  # the weight's floor 1 − ε_low > 0
    ("policy_losses", "sapo", "tau_neg", 0.0, "a number > 0"),  # the gate is scaled by 4/τ
    ("policy_losses", "gmpo", "clip_high", -0.1, "a number >= 0"),  # the log-space interval must hold 0 (r = 1)
    ("policy_losses", "dgpo", "beta_dpo", 0.0, "a number > 0"),  # β = 0 makes every group weight σ(0) = 1/2
    ("policy_losses", "dgpo", "clip_range", 1.0, "a number in (0, 1) or null"),  # the ratio's lower bound 1 − c > 0
    ("policy_losses", "clip_cov", "clip_low", 1.5, "a number in [0, 1]"),  # 1: the lower bound 0 never binds
    ("policy_losses", "kl_cov", "kl_cov_ratio", 0.0, "a number in (0, 1]"),  # a share, at least one action anyway
    ("policy_losses", "vespo", "k_neg", -0.5, "a number >= 0"),  # w^k is unbounded as w → 0 for k < 0
    ("policy_losses", "vespo", "lambda_pos", 0.0, "a number >= 0.0001"),  # TRL's floor of λ (it clamps, mmrl refuses)
    ("policy_losses", "luspo", "clip_low", 1.0, "a number in [0, 1)"),  # 1 − ε_low must stay > 0
    ("advantage_estimators", "grpo", "eps", -1e-6, "a number >= 0"),
    ("advantage_estimators", "wd1", "temperature", 0.0, "a number > 0"),
    ("advantage_estimators", "gpg", "f_norm", 0.0, "a number > 0"),  # the centred reward is divided by it
    ("advantage_estimators", "gpg", "eps", -1e-6, "a number >= 0"),  # added to the group std (scale_rewards)
    ("likelihood_estimators", "spg_upper", "beta", 0.5, "a number >= 1"),
    ("likelihood_estimators", "elbo_t", "eps", 1.0, "a number in [0, 1)"),
    ("likelihood_estimators", "random_masking", "t_low", 0.0, "a number in (0, 1]"),  # a masking rate
    ("likelihood_estimators", "one_step", "p_mask_prompt", 1.5, "a number in [0, 1]"),
    ("likelihood_estimators", "spg_lower", "block_length", 0, "an integer >= 1"),
    ("reward_functions", "jpeg_compressibility", "quality", 101, "an integer in [1, 100]"),
    ("reward_functions", "iou", "max_pixels", 783, "an integer >= 784 or null"),  # one 28 × 28 patch
    ("reward_functions", "math", "abs_tol", -1e-9, "a number >= 0"),  # math.isclose refuses negative tolerances
    ("reward_functions", "exact_match", "max_chars", 0, "an integer >= 1"),
    ("reward_functions", "countdown", "format_score", 1.1, "a number in [0, 1]"),
    ("reward_functions", "shapes", "min_area_fraction", 1.0, "a number in [0, 1)"),
    ("reward_functions", "remote", "retries", -1, "an integer >= 0"),
    ("pairwise_judges", "pointwise", "tolerance", -0.5, "a number >= 0"),
])
def test_out_of_range_messages_name_key_value_and_range(registry, name, option, value, allowed):
    data, key, _ = _config(registry, name, option, value)
    with pytest.raises(ConfigError) as info:
        load_config(data)
    assert str(info.value) == f"config key '{key}': got {value!r}; allowed: {allowed}"


def test_cli_refuses_an_out_of_range_option_in_one_line_before_building_anything(monkeypatch, capsys):
    import mmrl.trainer

    class NoTrainer:
        def __init__(self, *args, **kwargs):
            raise AssertionError("the trainer (and its models) must not be built for a config error")

    monkeypatch.setattr(mmrl.trainer, "Trainer", NoTrainer)
    assert main(["train", str(ROOT / "configs" / "toy.yaml"), "algorithm.policy_loss.clip_low=-1"]) == 2
    err = capsys.readouterr().err
    assert err == "mmrl: config key 'algorithm.policy_loss.clip_low': got -1.0; allowed: a number in [0, 1)\n"
    result = subprocess.run([sys.executable, "-m", "mmrl", "train", "configs/toy.yaml",
                             "algorithm.policy_loss.clip_low=-1"], capture_output=True, text=True, cwd=str(ROOT),
                            timeout=300)
    assert result.returncode == 2 and result.stderr == err and result.stdout == ""


def test_list_and_explain_show_the_ranges(capsys):
    assert main(["list", "--options"]) == 0
    out = capsys.readouterr().out
    assert "clip_low = 0.2  (float, in [0, 1))" in out and "dual_clip = None  (float | null, > 1)" in out
    assert "quality = 95  (int, in [1, 100])" in out and "beta = 1.5  (float, >= 1)" in out
    assert "num_samples" not in out and "num_actions" not in out  # supplied by the caller, not options
    assert main(["explain"]) == 0
    out = capsys.readouterr().out
    assert "  policy_loss.clip_low (float, in [0, 1)) = 0.2\n      Option of policy loss 'grpo': " in out
    assert "  advantage.eps (float, >= 0) = 1.0e-06" in out


# -------------------------------------------------------------------- the declared ranges agree with the runtime checks
def _loss_probe(name: str, option: str, columns: int = 3, **inputs: Any):
    """``inputs``: the data a loss declares besides the four columns (dgpo's group_ids and ref_logp)."""
    def accepts(value: float) -> bool:
        logp = torch.zeros(2, columns)
        try:
            importlib.import_module("mmrl.algos").policy_losses.get(name)(
                logp, logp, torch.tensor([1.0, -1.0]), torch.ones(2, columns), **inputs, **{option: value})
        except ValueError:
            return False
        return True
    return accepts


def _advantage_probe(name: str, option: str):
    def accepts(value: float) -> bool:
        estimator = importlib.import_module("mmrl.algos").advantage_estimators.get(name)
        try:
            estimator(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), **{option: value})
        except ValueError:
            return False
        return True
    return accepts


def _wd1_probe(value: float) -> bool:
    from mmrl.plugins.dllm.objectives import wd1_weights

    try:
        wd1_weights(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), temperature=value)
    except ValueError:
        return False
    return True


def _plan_probe(name: str, option: str, **fixed: Any):
    def accepts(value: float) -> bool:
        from mmrl.plugins.dllm.estimators import draw_plan

        prompt, completion = torch.ones(1, 3, dtype=torch.long), torch.ones(1, 4, dtype=torch.long)
        try:
            draw_plan(name, prompt, completion, torch.ones(1, 4), num_samples=2,
                      generator=torch.Generator().manual_seed(0), **fixed, **{option: value})
        except ValueError:
            return False
        return True
    return accepts


def _trace_probe(value: float) -> bool:
    """TraceRL's plan checks its shrink when built from a step map (``trace_plan``)."""
    from mmrl.plugins.dllm.masking import trace_plan

    try:
        trace_plan(torch.ones(1, 3, dtype=torch.long), torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4),
                   step_map=torch.arange(4).unsqueeze(0), shrink=value)
    except ValueError:
        return False
    return True


def _uniform_plan_probe(option: str):
    """Canvas models' noise plans check their options when drawn (``draw_uniform_plan``)."""
    def accepts(value: float) -> bool:
        from mmrl.plugins.dllm.canvas import draw_uniform_plan

        try:
            draw_uniform_plan(torch.ones(1, 4), canvas_length=4, vocab_size=10, num_samples=2,
                              generators=[torch.Generator().manual_seed(0)], **{option: value})
        except ValueError:
            return False
        return True
    return accepts


_ROWS = {
    "choice": {"solution": "A"}, "count": {"solution": 3}, "countdown": {"numbers": [1, 2], "target": 3},
    "sudoku": {"puzzle": "1234341221434321", "solution": "1234341221434321"},
}


def _reward_probe(name: str, option: str, completion: str = "<answer>3.5</answer>", row: dict | None = None,
                  **fixed: Any):
    """Build ``name`` with the option and score one sample: accepted unless building or scoring raises."""
    def accepts(value: float) -> bool:
        rows = [row or _ROWS.get(name, {"prompt": "p", "solution": "3.5"})]
        try:
            build_reward(name, {**fixed, option: value})(RewardInput(rows=rows, payload={"completions": [completion]}))
        except (RewardError, ValueError):
            return False
        return True
    return accepts


def _constructor_probe(build):
    def accepts(value: float) -> bool:
        try:
            build(value)
        except RewardError:
            return False
        return True
    return accepts


def _positive_probe(option: str):
    """The model-backed image rewards check these options first, with ``_check_positive``, before loading a model."""
    def accepts(value: float) -> bool:
        from mmrl.rewards.image_models import _check_positive

        try:
            _check_positive("probe", **{option: value})
        except RewardError:
            return False
        return True
    return accepts


def _probes() -> dict[str, Any]:
    from mmrl.rewards.preference import PointwiseJudge
    from mmrl.rewards.remote import RemoteReward
    from mmrl.rewards.shape_edits import ShapeEditReward
    from mmrl.rewards.shapes import ShapeFidelityReward, ShapesReward

    probes = {}
    for loss in ("grpo", "gspo"):
        for option in ("clip_low", "clip_high", "dual_clip", "delta"):
            probes[f"policy_losses.{loss}.{option}"] = _loss_probe(loss, option)
    probes["policy_losses.spg.mix"] = _loss_probe("spg", "mix", columns=2)
    probes["policy_losses.nft.adv_clip_max"] = _loss_probe("nft", "adv_clip_max", columns=2)
    for loss, options in (("cispo", ("clip_low", "clip_high")), ("sapo", ("tau_pos", "tau_neg")),
                          ("gmpo", ("clip_low", "clip_high"))):
        for option in options:
            probes[f"policy_losses.{loss}.{option}"] = _loss_probe(loss, option)
    for loss, options in (("vespo", ("k_pos", "lambda_pos", "k_neg", "lambda_neg")),
                          ("luspo", ("clip_low", "clip_high", "delta"))):
        for option in options:
            probes[f"policy_losses.{loss}.{option}"] = _loss_probe(loss, option)
    for option in ("beta_dpo", "clip_range"):
        probes[f"policy_losses.dgpo.{option}"] = _loss_probe("dgpo", option, group_ids=torch.tensor([0, 0]),
                                                             ref_logp=torch.zeros(2, 3))
    for option in ("clip_low", "clip_high", "dual_clip", "clip_cov_ratio"):
        probes[f"policy_losses.clip_cov.{option}"] = _loss_probe("clip_cov", option, generator=torch.Generator())
    for option in ("kl_cov_ratio", "ppo_kl_coef"):
        probes[f"policy_losses.kl_cov.{option}"] = _loss_probe("kl_cov", option)
    probes["advantage_estimators.wd1.temperature"] = _wd1_probe
    probes["advantage_estimators.gpg.f_norm"] = _advantage_probe("gpg", "f_norm")
    for name in ("one_step", "spg_lower", "spg_upper"):
        probes[f"likelihood_estimators.{name}.p_mask_prompt"] = _plan_probe(name, "p_mask_prompt")
    probes["likelihood_estimators.elbo_t.eps"] = _plan_probe("elbo_t", "eps")
    probes["likelihood_estimators.spg_upper.beta"] = _plan_probe("spg_upper", "beta")
    for option in ("eps", "self_conditioning_p"):
        probes[f"likelihood_estimators.uniform_one_step.{option}"] = _uniform_plan_probe(option)
    for name in ("spg_lower", "spg_upper"):
        probes[f"likelihood_estimators.{name}.block_length"] = _plan_probe(name, "block_length", masking="block")
    probes["likelihood_estimators.trace.shrink"] = _trace_probe
    # t ~ U(t_low, t_high) also needs t_low <= t_high: probe each bound with the other at its loosest
    probes["likelihood_estimators.random_masking.t_low"] = _plan_probe("random_masking", "t_low", t_high=1.0)
    probes["likelihood_estimators.random_masking.t_high"] = _plan_probe("random_masking", "t_high", t_low=1e-9)
    for name in ("exact_match", "token_accuracy", "format", "choice", "math", "count", "gsm8k_answer", "countdown",
                 "sudoku", "numeric_match", "word_accuracy", "rouge", "relative_accuracy"):
        probes[f"reward_functions.{name}.max_chars"] = _reward_probe(name, "max_chars")
    probes["reward_functions.numeric_match.decimals"] = _reward_probe("numeric_match", "decimals")
    for name in ("math", "gsm8k_answer"):
        for option in ("rel_tol", "abs_tol"):
            probes[f"reward_functions.{name}.{option}"] = _reward_probe(name, option)
    probes["reward_functions.countdown.format_score"] = _reward_probe("countdown", "format_score")
    boxes = {"completion": "[0, 0, 10, 10]", "row": {"solution": [0, 0, 10, 10], "image_size": [100, 100]}}
    probes["reward_functions.detection.iou_threshold"] = _reward_probe(
        "detection", "iou_threshold", convention="absolute", **boxes)
    for name in ("iou", "giou", "detection"):  # qwen2_5_vl without a resized size runs smart_resize on the options
        probes[f"reward_functions.{name}.min_pixels"] = _reward_probe(name, "min_pixels", convention="qwen2_5_vl",
                                                                      max_pixels=16384 * 28 * 28, **boxes)
        probes[f"reward_functions.{name}.max_pixels"] = _reward_probe(name, "max_pixels", convention="qwen2_5_vl",
                                                                      min_pixels=0, **boxes)
    for name in ("jpeg_compressibility", "jpeg_incompressibility"):
        for option in ("quality", "divisor"):
            probes[f"reward_functions.{name}.{option}"] = _constructor_probe(
                lambda value, name=name, option=option: build_reward(name, {option: value}))
    for name in ("clip_score", "pickscore"):
        probes[f"reward_functions.{name}.divisor"] = _positive_probe("divisor")
    for name in ("clip_score", "pickscore", "hpsv2", "aesthetic", "clip_image_similarity", "clip_directional", "clap"):
        probes[f"reward_functions.{name}.batch_size"] = _positive_probe("batch_size")
    probes["reward_functions.clap.sample_rate"] = _positive_probe("sample_rate")  # checked first, as batch_size
    for name, cls in (("shapes", ShapesReward), ("shape_fidelity", ShapeFidelityReward),
                      ("shape_edit", ShapeEditReward)):
        for option in ("max_color_distance", "min_area_fraction"):
            probes[f"reward_functions.{name}.{option}"] = _constructor_probe(
                lambda value, cls=cls, option=option: cls(**{option: value}))
    for option in ("timeout", "retries", "backoff"):
        probes[f"reward_functions.remote.{option}"] = _constructor_probe(
            lambda value, option=option: RemoteReward(check_server=False, token_env=None, **{option: value}))
    from mmrl.rewards.videos import PerFrameReward, check_stride, temporal_consistency

    probes["reward_functions.per_frame.stride"] = _constructor_probe(
        lambda value: PerFrameReward(reward="jpeg_compressibility", stride=value))
    video = torch.zeros(1, 3, 3, 4, 4, dtype=torch.uint8)  # [N, C, F, H, W]
    probes["reward_functions.temporal_consistency.stride"] = _constructor_probe(
        lambda value: temporal_consistency(RewardInput(rows=[{}], payload={"videos": video}), stride=value))
    # clip_temporal_consistency checks both before loading its model, with these two functions.
    probes["reward_functions.clip_temporal_consistency.stride"] = _constructor_probe(
        lambda value: check_stride("clip_temporal_consistency", value))
    probes["reward_functions.clip_temporal_consistency.batch_size"] = _positive_probe("batch_size")
    from mmrl.rewards.length import overlong_penalty

    lengths = RewardInput(rows=[{}], payload={"completion_tokens": torch.tensor([3])})
    for option, fixed in (("max_length", {"buffer": 1}), ("buffer", {"max_length": 100}),
                          ("factor", {"max_length": 10, "buffer": 4})):
        probes[f"reward_functions.overlong_penalty.{option}"] = _constructor_probe(
            lambda value, option=option, fixed=fixed: overlong_penalty(lengths, **fixed, **{option: value}))
    from mmrl.rewards.temporal_contrast import TemporalContrastReward

    for option in ("bonus", "ratio"):
        probes[f"reward_functions.temporal_contrast.{option}"] = _constructor_probe(
            lambda value, option=option: TemporalContrastReward(reward="exact_match", **{option: value}))
    from mmrl.rewards.length import CorrectLengthBonus

    for option in ("bonus", "min_tokens", "max_tokens", "min_correct"):
        fixed = {"min_tokens": 0} if option == "max_tokens" else {}
        probes[f"reward_functions.correct_length_bonus.{option}"] = _constructor_probe(
            lambda value, option=option, fixed=fixed: CorrectLengthBonus(reward="exact_match", **fixed,
                                                                         **{option: value}))
    probes["pairwise_judges.pointwise.tolerance"] = _constructor_probe(
        lambda value: PointwiseJudge(reward="jpeg_compressibility", tolerance=value))
    return probes


# Ranged options whose function does not check them itself: the range comes from the math, said in a comment there.
UNCHECKED_AT_RUNTIME = {"advantage_estimators.grpo.eps", "advantage_estimators.batch_std.eps",
                        "advantage_estimators.grpo_passk.eps", "advantage_estimators.reinforce_pp_baseline.eps",
                        "advantage_estimators.gpg.eps"}


def test_every_ranged_option_is_probed_or_named_unchecked():
    assert set(IDS) == set(_probes()) | UNCHECKED_AT_RUNTIME


PROBED = [(ranged, key) for ranged, key in zip(RANGED, IDS, strict=True) if key not in UNCHECKED_AT_RUNTIME]


@pytest.mark.parametrize(("ranged", "key"), PROBED, ids=[key for _, key in PROBED])
def test_declared_range_agrees_with_the_functions_own_check_at_each_bound(ranged, key):
    _, _, option = ranged
    accepts = _probes()[key]
    integer = _is_int(option)
    declared = option.range
    for bound in (declared.low, declared.high):
        if bound is None:
            continue
        step = 1 if integer else max(abs(bound), 1.0) * 1e-6
        for value in (bound - step, bound, bound + step):
            value = int(value) if integer else float(value)
            assert accepts(value) == (value in declared), (key, value, declared)


# --------------------------------------------------------------- adaptive entropy control (core AlgorithmConfig fields)
@pytest.mark.parametrize(("key", "refused", "accepted"), [
    ("entropy_coef_delta", 0.0, 1e-9),  # a step of 0 would freeze the coefficient
    ("entropy_coef_min", -1e-9, 0.0),
    ("entropy_coef_max", -1e-9, 0.0),
    ("entropy_target", ".inf", -1e3),  # any finite target: a continuous policy's entropy can be negative
])
def test_the_adaptive_entropy_bounds_are_checked_when_the_config_loads(tmp_path, key, refused, accepted):
    adaptive = [f"run.output_dir={tmp_path}", "algorithm.entropy_target=1.0", "algorithm.entropy_coef=0.0"]
    with pytest.raises(ConfigError, match=rf"config key 'algorithm\.{key}': got -?(1e-09|0\.0|inf)"):
        load_config(BASE, [*adaptive, f"algorithm.{key}={refused}"])
    assert getattr(load_config(BASE, [*adaptive, f"algorithm.{key}={accepted}"]).algorithm, key) == accepted
