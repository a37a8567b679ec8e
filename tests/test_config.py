"""Configs: validation errors name the key, the value and what is allowed; overrides; round trips."""

import subprocess
import sys

import pytest

from mmrl.config import ConfigError, dump_config, load_config, parse_override
from mmrl.config.loader import yaml_load
from tests.helpers import BASE


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
