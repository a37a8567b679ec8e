"""The command line: list, explain, train, eval, and `python -m mmrl`."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mmrl.cli import main
from mmrl.reward import RewardError, reward_functions

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


def test_list_shows_the_plugins_own_registries_and_choices(capsys):
    """Issue 23 part 5: the flow plugin's credit strategies, model adapters and SDE kinds, the dLLM estimators and
    adapters, the VLM adapters, each under its plugin's name, from the entry-point group mmrl.registries."""
    assert main(["list"]) == 0
    sections = _sections(capsys.readouterr().out)
    assert {"step", "chunk", "branch", "tree", "sliding_window"} <= sections["credit_strategies (plugin flow)"]
    assert {"sd3", "flux"} <= sections["model_adapters (plugin flow)"]
    assert {"masked_lm", "llada", "dream"} <= sections["model_adapters (plugin dllm)"]
    assert {"coupled", "one_step", "spg_lower"} <= sections["likelihood_estimators (plugin dllm)"]
    assert {"qwen2_vl", "qwen2_5_vl"} <= sections["model_adapters (plugin vlm)"]
    # plugin.sde names an entry of the SDE-kind registry (a package can add one), no longer a fixed choice.
    assert {"flow_grpo", "dance_grpo", "cps"} <= sections["sde_kinds (plugin flow)"]
    assert not any(line.startswith("plugin.sde:") for line in sections["choices (plugin flow)"])
    assert "plugin.objective: grpo | wd1 | spg (default grpo)" in sections["choices (plugin dllm)"]
    assert "plugin.task: reverse | sort | copy (default reverse)" in sections["choices (plugin toy)"]


def test_list_shows_a_registry_a_third_party_announces(capsys, monkeypatch):
    """A package announces a registry of its own through the entry-point group mmrl.registries, as the built-in
    plugins do; `mmrl list` shows it under its plugin's name."""
    from importlib import metadata

    from mmrl.registry import REGISTRY_GROUP, Registry

    extra = Registry("widget")
    extra.register("spinner")(lambda: None)
    module = type(sys)("third_party_widgets")
    module.widgets = extra
    monkeypatch.setitem(sys.modules, "third_party_widgets", module)
    announced = metadata.EntryPoint(name="acme.widgets", value="third_party_widgets:widgets", group=REGISTRY_GROUP)
    # A registry whose module needs a missing extra is listed with the one line that names it.
    unavailable = metadata.EntryPoint(name="acme.gadgets", value="third_party_gadgets:gadgets", group=REGISTRY_GROUP)
    monkeypatch.setitem(sys.modules, "third_party_gadgets", None)  # importing it raises ImportError
    real = metadata.entry_points

    def entry_points(**selection):
        found = real(**selection)
        return [*found, announced, unavailable] if selection.get("group") == REGISTRY_GROUP else found

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert _sections(out)["widgets (plugin acme)"] == {"spinner"}
    assert "gadgets (plugin acme):\n  (unavailable: import of third_party_gadgets halted; None in sys.modules)" in out


def _sections(out: str) -> dict[str, set[str]]:
    """``mmrl list``'s output as {heading: entry names (or whole lines for the choices)}."""
    sections: dict[str, set[str]] = {}
    for line in out.splitlines():
        if not line.startswith(" ") and line.endswith(":"):
            current = sections.setdefault(line[:-1], set())
        elif line.startswith("  "):
            text = line.strip()
            current.add(text if text.startswith("plugin.") else text.split()[0])
    return sections


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


@pytest.fixture
def small_toy_run(tmp_path, monkeypatch):
    """`mmrl train` arguments for a two-step toy run in tmp_path."""
    monkeypatch.chdir(ROOT)
    return ["train", "configs/toy.yaml", f"run.output_dir={tmp_path / 'run'}", "run.max_steps=2", "run.progress=false",
            "run.save_every=0", "rollout.prompts_per_step=4", "rollout.group_size=2", "eval.num_prompts=4"]


def _cli_raises(batch):
    raise ValueError("cannot parse\nthe completion")


def _cli_nan(batch):
    return [float("nan")] * len(batch)


reward_functions.register("test_cli_raises", _cli_raises)
reward_functions.register("test_cli_nan", _cli_nan)


def test_a_reward_that_raises_ends_train_with_one_line_naming_reward_and_sample(small_toy_run, capsys, monkeypatch):
    monkeypatch.delenv("MMRL_TRACEBACK", raising=False)
    code = main([*small_toy_run, "rewards.functions=[{name: test_cli_raises}]"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert re.fullmatch(r"mmrl: RewardError: reward 'test_cli_raises' raised ValueError: cannot parse the completion "
                        r"on sample 0 of \d+ \(prompt '[^']*'\)\n", err), err


@pytest.mark.parametrize("how", ["flag before the command", "flag after the command", "environment"])
def test_traceback_for_developers(how, small_toy_run, monkeypatch):
    monkeypatch.delenv("MMRL_TRACEBACK", raising=False)
    args = [*small_toy_run, "rewards.functions=[{name: test_cli_raises}]"]
    if how == "flag before the command":
        args = ["--traceback", *args]
    elif how == "flag after the command":
        args = [*args, "--traceback"]
    else:
        monkeypatch.setenv("MMRL_TRACEBACK", "1")
    with pytest.raises(RewardError) as info:
        main(args)
    assert isinstance(info.value.__cause__, ValueError)


def test_a_run_that_never_trained_on_a_sample_exits_non_zero_naming_the_cause(small_toy_run, capsys, monkeypatch):
    monkeypatch.delenv("MMRL_TRACEBACK", raising=False)
    code = main([*small_toy_run, "rewards.functions=[{name: test_cli_nan}]", "rewards.on_nonfinite=skip"])
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert code == 1
    assert lines[-1] == ("mmrl: NoUpdateError: no step of this run trained on any sample (2 step(s), nothing "
                         "learned); at step 2: all 8 samples had a NaN or infinite reward (reward 'test_cli_nan'), "
                         "and rewards.on_nonfinite=skip drops such samples")
    assert [line.split(":")[:3] for line in lines[:-1]] == [["mmrl", " warning", f" step {step} trained on no sample"]
                                                            for step in (1, 2)]
    assert "done:" not in captured.out and "held-out reward" not in captured.out


def test_explain_with_an_unknown_plugin_prints_one_line_and_nothing_else(capsys):
    assert main(["explain", "--plugin", "nope"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("mmrl: unknown plugin 'nope'; registered: ") and captured.err.count("\n") == 1
    assert "toy" in captured.err


def test_a_reader_that_goes_away_is_not_an_error():
    """`mmrl list | head -1`: the pipe closes while mmrl still writes. The command ends quietly with 0 instead of a
    BrokenPipeError traceback (the read end is closed before mmrl starts, so every write fails: no race)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        code = "import sys; from mmrl.cli import main; sys.exit(main(['list']))"
        result = subprocess.run([sys.executable, "-c", code],
                                stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr
