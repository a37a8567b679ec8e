"""Configs: validation errors name the key, the value and what is allowed; overrides; round trips."""

import dataclasses
import math
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from mmrl.config import ConfigError, TrainConfig, dump_config, from_dict, load_config, parse_override
from mmrl.config.loader import yaml_load
from tests.helpers import BASE

ROOT = Path(__file__).resolve().parents[1]


def _error(*overrides):
    with pytest.raises(ConfigError) as info:
        load_config(BASE, list(overrides))
    return str(info.value)


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("run.max_step=3", ["'run.max_step'", "did you mean 'max_steps'"]),
        ("rollout.group_size=1", ["'rollout.group_size'", "got 1", ">= 2"]),
        ("optim.lr=fast", ["'optim.lr'", "'fast'", "a number"]),
        ("run.cpu=3", ["'run.cpu'", "true or false"]),
        ("algorithm.advantage=median", ["'algorithm.advantage.name'", "grpo"]),
        ("algorithm.policy_loss.clip_hgh=0.3", ["clip_hgh", "clip_high=0.2"]),
        ("algorithm.policy_loss.ratio_level=tok", ["ratio_level", "'sequence'"]),
        ("algorithm.policy_loss.dual_clip=big", ["dual_clip", "a number or null"]),
        ("algorithm.aggregation=mean", ["'algorithm.aggregation'", "token_mean"]),
        ("algorithm.kl_estimator=k4", ["kl_estimator", "k3"]),
        ("plugin.name=nope", ["'plugin.name'", "toy"]),
        ("plugin.task=sum", ["'plugin.task'", "'reverse'"]),
        ("plugin.max_length=2", ["'plugin.max_length'", "min_length"]),
        ("rewards.functions=[]", ["'rewards.functions'", "at least one"]),
        ("rewards.functions=[{name: bleu}]", ["rewards.functions[0].name", "token_accuracy"]),
        ("rewards.functions=[{name: exact_match, args: {fild: x}}]", ["args.fild", "field='solution'"]),
        ("run.trackers=[tensorbored]", ["run.trackers", "tensorboard"]),
        ("optim.betas=[0.9]", ["optim.betas", "two numbers"]),
        ("rollout.layout=diagonal", ["rollout.layout", "'contiguous'"]),
    ],
)
def test_bad_values_fail_with_one_line_naming_key_value_and_allowed(override, fragments):
    message = _error(override)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_overrides_parse_yaml_scalars_including_bare_exponents():
    assert parse_override("optim.lr=1e-4") == (["optim", "lr"], 1e-4)
    assert parse_override("run.resume=null") == (["run", "resume"], None)
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert yaml_load("lr: 3e-4")["lr"] == 3e-4
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_override("no_equals_sign")


def test_options_override_keeps_the_default_entry():
    config = load_config(BASE, ["algorithm.policy_loss.clip_high=0.28"])
    assert config.algorithm.policy_loss.name == "grpo"
    assert config.algorithm.policy_loss.options == {"clip_high": 0.28}


def test_resolved_config_round_trips_through_yaml(tmp_path):
    config = load_config(BASE, ["algorithm.policy_loss=gspo", "optim.lr=1e-3"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(config))
    again = load_config(path)
    assert dump_config(again) == dump_config(config)


def test_every_recipe_in_configs_validates():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs"
    recipes = [p for p in root.rglob("*.yaml") if "accelerate" not in p.parts]
    assert recipes
    for recipe in recipes:
        load_config(recipe)


def test_missing_and_malformed_files_fail_cleanly(tmp_path):
    with pytest.raises(ConfigError, match="existing YAML file"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="valid YAML"):
        load_config(bad)


def test_cli_config_error_exits_2_with_one_line_and_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mmrl", "train", "configs/toy.yaml", "run.max_step=3"],
        capture_output=True, text=True, cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]),
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mmrl: config key 'run.max_step'")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("override", "key", "allowed"),
    [
        ("optim.lr=.nan", "'optim.lr'", "a finite number > 0.0"),
        ("optim.lr=.inf", "'optim.lr'", "a finite number > 0.0"),
        ("optim.lr=1e400", "'optim.lr'", "a finite number > 0.0"),  # overflows to inf when read
        ("optim.max_grad_norm=.nan", "'optim.max_grad_norm'", "a finite number > 0.0 or null"),
        ("optim.weight_decay=-.inf", "'optim.weight_decay'", "a finite number >= 0.0"),
        ("optim.betas=[.nan, 0.999]", "'optim.betas[0]'", "a finite number"),
        ("ema.decay=.nan", "'ema.decay'", "a finite number >= 0.0 and <= 1.0"),
        ("rollout.dynamic_sampling.tolerance=.inf", "'rollout.dynamic_sampling.tolerance'", "a finite number"),
        ("algorithm.kl_coef=.inf", "'algorithm.kl_coef'", "a finite number >= 0.0"),
        ("algorithm.advantage_clip=.nan", "'algorithm.advantage_clip'", "a finite number > 0.0 or null"),
        ("algorithm.policy_loss.clip_high=.nan", "'algorithm.policy_loss.clip_high'", "a finite number"),
        ("algorithm.advantage.eps=.inf", "'algorithm.advantage.eps'", "a finite number"),
        ("plugin.temperature=.nan", "'plugin.temperature'", "a finite number > 0.0"),
        ("rewards.functions=[{name: token_accuracy, weight: .nan}]", "'rewards.functions[0].weight'",
         "a finite number"),
        ("rewards.functions=[{name: math, args: {rel_tol: .inf}}]", "'rewards.functions[0].args.rel_tol'",
         "a finite number"),
        ("eval.rewards=[{name: token_accuracy, weight: -.inf}]", "'eval.rewards[0].weight'", "a finite number"),
    ],
)
def test_nan_and_infinite_numbers_are_refused_naming_the_key(override, key, allowed):
    message = _error(override)
    assert "\n" not in message
    assert f"config key {key}:" in message and f"allowed: {allowed}" in message, message


def _dataclasses_in(annotation):
    """The config dataclasses an annotation holds: itself, or inside ``X | None`` and ``list[X]``."""
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return [annotation]
    return [found for arg in typing.get_args(annotation) for found in _dataclasses_in(arg)]


def _float_fields(cls, path, seen=None):
    """``(dataclass, dotted path, field name, is a list)`` for every float field reachable from ``cls``."""
    seen = set() if seen is None else seen
    if cls in seen:
        return []
    seen.add(cls)
    found = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        annotation = hints[field.name]
        if field.metadata.get("registry"):  # a registry choice: its options are checked by the entry's signature
            continue
        nested = _dataclasses_in(annotation)
        if nested:
            for sub in nested:
                found += _float_fields(sub, f"{path}.{field.name}", seen)
            continue
        members = {annotation, *typing.get_args(annotation)}
        if list[float] in members:
            found.append((cls, path, field.name, True))
        elif float in members:
            found.append((cls, path, field.name, False))
    return found


def _all_float_fields():
    from mmrl.plugin import plugin_registry

    hints = typing.get_type_hints(TrainConfig)
    fields = []
    for section in dataclasses.fields(TrainConfig):
        if section.name != "plugin":
            fields += _float_fields(hints[section.name], section.name)
    for name in plugin_registry.names():
        fields += _float_fields(plugin_registry.get(name).config_class, f"plugin[{name}]")
    return fields


FLOAT_FIELDS = _all_float_fields()


def test_the_float_field_census_reaches_core_plugin_and_nested_sections():
    keys = {f"{path}.{name}" for _, path, name, _ in FLOAT_FIELDS}
    for key in ["optim.lr", "optim.betas", "ema.decay", "rewards.functions.weight", "eval.rewards.weight",
                "rollout.dynamic_sampling.tolerance", "plugin[toy].temperature", "plugin[flow].lora.alpha",
                "plugin[flow].credit.chunk.sample_fraction", "plugin[vlm].top_p", "plugin[dllm].spg_beta"]:
        assert key in keys, key


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(("cls", "path", "name", "is_list"), FLOAT_FIELDS,
                         ids=[f"{path}.{name}" for _, path, name, _ in FLOAT_FIELDS])
def test_every_float_field_of_every_config_refuses_non_finite_values(cls, path, name, is_list, bad):
    # The field alone (its type and declared range) in a one-field section, so that no other field is needed.
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    probe = dataclasses.make_dataclass(
        "Probe", [(name, typing.get_type_hints(cls)[name], dataclasses.field(default=None, metadata=field.metadata))]
    )
    with pytest.raises(ConfigError) as info:
        from_dict(probe, {name: [bad, 0.5] if is_list else bad}, path)
    expected = f"{path}.{name}[0]" if is_list else f"{path}.{name}"
    assert info.value.key == expected and "a finite number" in info.value.allowed, str(info.value)
    assert "\n" not in str(info.value)


def test_dllm_estimator_options_refuse_non_finite_numbers():
    data = {"plugin": {"name": "dllm", "estimator": "one_step", "estimator_options": {"p_mask_prompt": math.nan}},
            "rewards": {"functions": [{"name": "exact_match"}]}}
    with pytest.raises(ConfigError) as info:
        load_config(data)
    assert info.value.key == "plugin.estimator_options.p_mask_prompt"
    assert info.value.allowed == "a finite number in [0, 1]"  # with the option's declared range
    data["plugin"]["estimator_options"] = {"p_mask_prompt": 0.15}
    assert load_config(data).plugin.config.estimator_options == {"p_mask_prompt": 0.15}


def test_evaluation_only_keys_are_named_per_plugin_and_only_they_may_differ_from_a_checkpoint(tmp_path):
    """The fields declared `eval_only` change an evaluation and nothing of training: `eval_only_keys` names them in
    the flat layout of a saved config, `mmrl explain` marks them, and the checkpoint check lets exactly those (and
    the core's resumable keys) differ; a key that only starts like one (`plugin.data.evaluation`) is not covered."""
    from mmrl.config import eval_only_keys, to_dict
    from mmrl.config.schema import describe_fields
    from mmrl.plugins.dllm.plugin import DLLMPluginConfig
    from mmrl.trainer.checkpoint import CheckpointError, check_compatible, config_differences

    expected = {
        "configs/toy.yaml": ["plugin.eval_size", "ema.use_for_eval"],
        "configs/dllm/toy.yaml": ["plugin.eval_dataset", "plugin.eval_temperature", "plugin.eval_remasking",
                                  "plugin.dream_sampler.eval_top_p", "ema.use_for_eval"],
        "configs/flow/shapes.yaml": ["plugin.eval_height", "plugin.eval_width", "plugin.eval_condition_size",
                                     "plugin.eval_buckets", "plugin.eval_num_steps", "plugin.eval_guidance_scale",
                                     "plugin.eval_dataset",
                                     "plugin.eval_prompts", "ema.use_for_eval"],
        "configs/vlm/grounding.yaml": ["plugin.data.eval", "ema.use_for_eval"],
        "configs/vlm/toy_grounding.yaml": ["plugin.data.eval", "plugin.data.synthetic.eval_size",
                                           "ema.use_for_eval"],
    }
    for path, keys in expected.items():
        config = load_config(str(ROOT / path))
        assert eval_only_keys(config) == keys, path
        flat = _flat(to_dict(config))
        assert all(key in flat for key in keys), path  # the saved config's own spelling of each key
    rows = {name: kind for name, kind, *_ in describe_fields(DLLMPluginConfig)}
    assert rows["eval_temperature"] == "float, >= 0.0, evaluation only" and rows["temperature"] == "float, >= 0.0"

    saved = {"plugin": {"name": "vlm", "data": {"eval": "a.jsonl", "evaluation": 1, "train": "t.jsonl"}},
             "eval": {"every": 5}, "optim": {"lr": 1e-4}}
    current = {"plugin": {"name": "vlm", "data": {"eval": "b.jsonl", "evaluation": 2, "train": "t.jsonl"}},
               "eval": {"every": 7}, "optim": {"lr": 1e-4}}
    assert config_differences(saved, current) == ["plugin.data.eval", "plugin.data.evaluation"]
    assert config_differences(saved, current, ["plugin.data.eval"]) == ["plugin.data.evaluation"]
    current["plugin"]["data"]["evaluation"] = 1
    check_compatible(saved, current, tmp_path, ["plugin.data.eval"])
    with pytest.raises(CheckpointError, match=r"plugin.data.eval: checkpoint 'a.jsonl', now 'b.jsonl'"):
        check_compatible(saved, current, tmp_path)


def test_training_prompts_do_not_depend_on_the_number_of_held_out_prompts():
    # why plugin.eval_size is an evaluation-only key: a checkpoint evaluated on more held-out prompts trained on the
    # same prompts, and none of those it is evaluated on
    from mmrl.plugins.toy.task import make_splits

    def splits(eval_size):
        return make_splits("reverse", num_digits=4, min_length=2, max_length=4, train_size=40, eval_size=eval_size,
                           seed=3)

    small, large = splits(10), splits(30)
    assert small["train"] == large["train"] and large["eval"][:10] == small["eval"]
    assert not {r["prompt"] for r in large["train"]} & {r["prompt"] for r in large["eval"]}


def _flat(data, prefix=""):
    if isinstance(data, dict):
        return {k: v for key, value in data.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: data}
