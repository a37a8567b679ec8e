"""The command line: list, explain, train, eval, and `python -m mmrl`."""

import subprocess
import sys
from pathlib import Path

import pytest

from mmrl.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_list_shows_every_registry(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for heading in ["advantage_estimators:", "policy_losses:", "kl_estimators:", "aggregation_modes:", "plugins:",
                    "reward_functions:", "pairwise_judges", "likelihood_estimators"]:
        assert heading in out
    for entry in ["grpo", "dr_grpo", "rloo", "batch_std", "gspo", "reinforce", "k1", "k2", "k3", "token_mean",
                  "seq_mean_token_sum_norm", "toy", "token_accuracy"]:
        assert f"  {entry}" in out, entry


def test_list_options_shows_defaults(capsys):
    assert main(["list", "--options"]) == 0
    out = capsys.readouterr().out
    assert "clip_high = 0.2" in out and "dual_clip = None" in out


def test_explain_prints_help_and_references(capsys):
    assert main(["explain", "--plugin", "toy"]) == 0
    out = capsys.readouterr().out
    assert "rollout.group_size" not in out  # keys are shown per section
    assert "group_size (int, >= 2) = 8" in out and "DeepSeekMath" in out
    assert "  lr (float, > 0.0) = 1.0e-05" in out and "  decay (float, >= 0.0 and <= 1.0) = 0.9" in out
    assert "plugin (toy):" in out and "task" in out


def test_train_then_eval_from_the_command_line(tmp_path, capsys):
    args = ["configs/toy.yaml", f"run.output_dir={tmp_path}", "run.max_steps=3", "run.progress=false",
            "eval.num_prompts=8", "run.save_every=0"]
    import os

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert main(["train", *args]) == 0
        out = capsys.readouterr().out
        assert "held-out reward:" in out and "done: 3 steps" in out
        assert main(["eval", *args, "run.resume=latest"]) == 0
        assert "eval/reward_mean" in capsys.readouterr().out
    finally:
        os.chdir(cwd)


def test_missing_checkpoint_is_one_line(tmp_path, capsys):
    code = main(["eval", str(ROOT / "configs" / "toy.yaml"), f"run.output_dir={tmp_path}",
                 f"run.resume={tmp_path / 'nowhere'}"])
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("mmrl: CheckpointError:") and "\n" not in err


@pytest.mark.parametrize("command", [[sys.executable, "-m", "mmrl", "list"]])
def test_python_dash_m(command):
    result = subprocess.run(command, capture_output=True, text=True, cwd=str(ROOT))
    assert result.returncode == 0 and "policy_losses:" in result.stdout


@pytest.mark.parametrize(
    ("override", "allowed"),
    [
        ("optim.lr=.nan", "a finite number > 0.0"),
        ("optim.lr=.inf", "a finite number > 0.0"),
        ("optim.lr=1e400", "a finite number > 0.0"),
        ("optim.lr=-1", "a number > 0.0"),
        ("optim.max_grad_norm=.nan", "a finite number > 0.0 or null"),
    ],
)
def test_bad_numbers_end_train_with_one_line_before_any_model_is_built(override, allowed, tmp_path, capsys,
                                                                       monkeypatch):
    import mmrl.trainer

    def no_trainer(*args, **kwargs):
        raise AssertionError("the config was accepted: a Trainer (and its model) was being built")

    monkeypatch.setattr(mmrl.trainer, "Trainer", no_trainer)
    run_dir = tmp_path / "run"
    code = main(["train", str(ROOT / "configs" / "toy.yaml"), override, f"run.output_dir={run_dir}"])
    captured = capsys.readouterr()
    key = override.split("=")[0]
    assert code == 2
    assert captured.err.count("\n") == 1 and captured.err.startswith(f"mmrl: config key '{key}': got ")
    assert captured.err.rstrip().endswith(f"allowed: {allowed}"), captured.err
    assert captured.out == "" and not run_dir.exists()


@pytest.mark.parametrize("plugin", ["toy", "flow", "dllm", "vlm"])
def test_explain_shows_required_fields_and_defaults_as_a_user_writes_them(plugin, capsys):
    assert main(["explain", "--plugin", plugin]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    defaults = [line.split(") = ", 1)[1] for line in lines if line.startswith("  ") and ") = " in line]
    assert len(defaults) > 40 and not [d for d in defaults if d.startswith("<") or " object at 0x" in d], defaults
    # Registry choices: one line with the default entry's name (not a `name` sub-field without a default).
    assert "  advantage (name or {name, options}) = grpo" in lines
    assert "  policy_loss (name or {name, options}) = grpo" in lines
    # Defaults as in YAML: null and false rather than Python's None and False.
    assert "  advantage_clip (float | null, > 0.0) = null" in lines and "  cpu (bool) = false" in lines
    assert "  betas (list[float]) = [0.9, 0.999]" in lines and "  project_name (str) = mmrl" in lines
    # List and optional sections: the items' fields, with `required` where there is no default.
    assert "  functions (list[mapping]) = []" in lines and "  functions[].name (str) = required" in lines
    assert "  functions[].weight (float) = 1.0" in lines and "  rewards[].name (str) = required" in lines
    section = lines[lines.index(f"plugin ({plugin}):"):]
    if plugin in ("flow", "vlm"):
        assert "  model (str) = required" in section
    if plugin != "toy":
        assert any(line.startswith("  lora (mapping | null) = ") for line in section)
        assert any(line.startswith("  lora.rank (int, >= 1) = ") for line in section)
