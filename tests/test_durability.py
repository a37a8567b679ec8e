"""Long runs survive faults: SIGKILL at a random moment or inside a checkpoint write, resuming at an epoch
boundary, and SIGTERM/SIGINT finishing the step, checkpointing and exiting 0. Real processes are killed."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
BASE = ["run.progress=false", "eval.at_start=false", "eval.num_prompts=8", "rollout.prompts_per_step=8",
        "rollout.group_size=4", "algorithm.micro_batch_size=16", "algorithm.minibatches=2", "optim.lr=5e-3",
        "plugin.train_size=64", "plugin.eval_size=16", "plugin.min_length=4", "plugin.max_length=4"]


def _command(out: Path, *overrides: str, fault: list[str] | None = None) -> list[str]:
    args = ["configs/toy.yaml", f"run.output_dir={out}", *BASE, *overrides]
    if fault:
        return [sys.executable, str(ROOT / "tests" / "faults.py"), *fault, *args]
    return [sys.executable, "-m", "mmrl", "train", *args]


def _run(out: Path, *overrides: str, fault: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(_command(out, *overrides, fault=fault), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def _final_weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / f"step-{step:08d}" / "policy" / "trainable.safetensors"))


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    result = _run(out, "run.max_steps=10", "run.save_every=1")
    assert result.returncode == 0, result.stderr[-2000:]
    return _final_weights(out, 10)


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 4 (keep_last 2), trained once for the tests that start
    from one: each copies it into its own folder (:func:`_copy_run`)."""
    out = tmp_path_factory.mktemp("four_steps")
    result = _run(out, *FOUR_STEPS)
    assert result.returncode == 0, result.stderr[-2000:]
    return out


FOUR_STEPS = ("run.max_steps=4", "run.save_every=2")


def _copy_run(run: Path, out: Path) -> None:
    """A run folder moved elsewhere, as users move them: checkpoints name their step folders relatively and
    run.output_dir may change on resume (RESUMABLE_KEYS)."""
    shutil.copytree(run, out, dirs_exist_ok=True)


@pytest.mark.slow
def test_sigkill_at_a_random_moment_then_resume_lands_on_the_same_parameters(tmp_path, uninterrupted):
    target = random.randint(2, 7)
    process = subprocess.Popen(_command(tmp_path, "run.max_steps=10", "run.save_every=1"), cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def latest_step() -> int:
        try:  # written atomically (a rename), so it is read whole; older checkpoints get deleted (keep_last)
            return int((tmp_path / "checkpoints" / "latest").read_text().strip().split("-")[1])
        except FileNotFoundError:
            return 0

    def wait_for_checkpoint(step: int) -> float:
        deadline = time.time() + 120
        while latest_step() < step and process.poll() is None and time.time() < deadline:
            time.sleep(0.001)
        return time.perf_counter()

    # A random moment of the next step (sampling, update or checkpoint write): a uniform delay over one step's
    # duration as this machine runs it, measured between the two checkpoints before. A fixed window can outlast the
    # 3-8 steps left on a fast machine (~17 ms a step on an idle 2-core EPYC), and the run would finish unkilled.
    previous = wait_for_checkpoint(target - 1)
    step_seconds = wait_for_checkpoint(target) - previous
    time.sleep(random.uniform(0.0, step_seconds))
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, f"the run ended (rc {process.returncode}) before it was killed"
    killed_at = (tmp_path / "checkpoints" / "latest").read_text().strip()
    assert killed_at < "step-00000010"
    result = _run(tmp_path, "run.max_steps=10", "run.save_every=1", "run.resume=latest")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"resumed from {tmp_path / 'checkpoints' / killed_at}" in result.stdout, (killed_at, result.stdout)
    _assert_same_weights(_final_weights(tmp_path, 10), uninterrupted)


@pytest.mark.slow
def test_kill_inside_a_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, uninterrupted):
    result = _run(tmp_path, "run.max_steps=10", "run.save_every=1", fault=["kill-in-checkpoint", "6"])
    assert result.returncode == -signal.SIGKILL
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-00000005"
    assert (checkpoints / ".tmp-step-00000006").is_dir()  # the half-written one stays out of the way
    result = _run(tmp_path, "run.max_steps=10", "run.save_every=1", "run.resume=latest")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed from" in result.stdout and "step 5" in result.stdout
    assert not (checkpoints / ".tmp-step-00000006").exists()
    _assert_same_weights(_final_weights(tmp_path, 10), uninterrupted)


@pytest.mark.slow
def test_resume_exactly_at_an_epoch_boundary(tmp_path, uninterrupted):
    # 64 training prompts, 8 per step: step 8 ends exactly at the end of the first epoch.
    first = _run(tmp_path, "run.max_steps=8", "run.save_every=1")
    assert first.returncode == 0, first.stderr[-2000:]
    state = json.loads((tmp_path / "checkpoints" / "step-00000008" / "trainer_state.json").read_text())
    assert state["stream"]["consumed"] == 64
    result = _run(tmp_path, "run.max_steps=10", "run.save_every=1", "run.resume=latest")
    assert result.returncode == 0, result.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if "reward/mean" in line]
    assert steps == list(range(1, 11))  # the resumed run trained steps 9 and 10, not zero steps
    _assert_same_weights(_final_weights(tmp_path, 10), uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_termination_signal_finishes_the_step_checkpoints_and_exits_0(tmp_path, sig):
    process = subprocess.Popen(_command(tmp_path, "run.max_steps=100000", "run.save_every=0"), cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 120
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 2) and time.time() < deadline:
        time.sleep(0.05)
    process.send_signal(sig)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-2000:]
    assert "stopped early after a checkpoint" in stdout
    stopped_at = int((tmp_path / "checkpoints" / "latest").read_text().strip().split("-")[1])
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert stopped_at == max(logged) >= 2


def _logged_steps(out: Path, key: str = "reward/mean", file: str = "metrics.jsonl") -> list[int]:
    return [json.loads(line)["step"] for line in (out / file).read_text().splitlines() if key in line]


@pytest.mark.slow
def test_a_finished_run_relaunched_with_resume_latest_survives_an_incomplete_folder(tmp_path, four_steps):
    """Issue 25, item 1: an older mmrl killed while re-saving the last step left a folder holding only
    trainer_state.json, which ``latest`` named; every later resume failed with a traceback."""
    common = FOUR_STEPS
    _copy_run(four_steps, tmp_path)
    last = tmp_path / "checkpoints" / "step-00000004"
    for part in ("accelerate", "policy"):
        shutil.rmtree(last / part)
    result = _run(tmp_path, *common, "run.resume=latest")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "skips incomplete checkpoint folder(s)" in result.stderr and str(last) in result.stderr
    assert f"resumed from {tmp_path / 'checkpoints' / 'step-00000002'} at step 2" in result.stdout
    assert (last / "policy").is_dir()  # steps 3 and 4 were trained again and step 4 saved whole
    relaunched = _run(tmp_path, *common, "run.resume=latest")  # a finished run: nothing to train or save
    assert relaunched.returncode == 0, relaunched.stderr[-2000:]
    assert f"resumed from {last} at step 4" in relaunched.stdout


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["rename .tmp-step-00000004", "delete .trash-old-step-00000004"])
def test_sigkill_inside_a_resave_keeps_the_step_resumable(tmp_path, entry, four_steps):
    """A run resumed from step 2 of a finished 4-step run saves step 4 again; SIGKILL between moving the old folder
    aside and renaming the new one in (the step then has no folder of its own), or while the old one is deleted."""
    common = FOUR_STEPS
    _copy_run(four_steps, tmp_path)
    expected = _final_weights(tmp_path, 4)
    branch = f"run.resume={tmp_path / 'checkpoints' / 'step-00000002'}"
    killed = _run(tmp_path, *common, branch, fault=["kill-at-operation", entry])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    result = _run(tmp_path, *common, "run.resume=latest")
    assert result.returncode == 0, result.stderr[-2000:]
    _assert_same_weights(_final_weights(tmp_path, 4), expected)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-00000002",
                                                                           "step-00000004"]


@pytest.mark.slow
def test_sigterm_during_the_first_evaluation_checkpoints_and_the_resume_does_not_repeat_it(tmp_path):
    common = ("run.max_steps=3", "eval.at_start=true")
    stopped = _run(tmp_path, *common, fault=["term-in-evaluation", "1"])
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert "stopped early after a checkpoint" in stopped.stdout
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000000"
    assert _logged_steps(tmp_path, "eval/samples") == [0]
    resumed = _run(tmp_path, *common, "run.resume=latest")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _logged_steps(tmp_path, "eval/samples") == [0, 3]  # the first evaluation is not repeated
    assert _logged_steps(tmp_path) == [1, 2, 3]


@pytest.mark.slow
def test_sigterm_during_the_final_evaluation_keeps_the_trained_steps(tmp_path):
    stopped = _run(tmp_path, "run.max_steps=3", fault=["term-in-evaluation", "1"])  # the final evaluation
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000003"
    assert _logged_steps(tmp_path, "eval/samples") == [3]


@pytest.mark.slow
def test_sigterm_during_startup_exits_cleanly_with_nothing_to_keep(tmp_path):
    stopped = _run(tmp_path, "run.max_steps=3", fault=["term-at-startup", "0"])
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert "stopped early before the first step" in stopped.stdout
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
def test_a_restart_after_a_kill_before_the_first_checkpoint_starts_a_clean_log(tmp_path):
    killed = _run(tmp_path, "run.max_steps=4", "run.save_every=0", fault=["kill-after-step", "2"])
    assert killed.returncode == -signal.SIGKILL
    assert _logged_steps(tmp_path) == [1, 2]
    result = _run(tmp_path, "run.max_steps=4", "run.save_every=0", "run.resume=latest")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "starting at step 0" in result.stdout
    assert _logged_steps(tmp_path) == [1, 2, 3, 4]


@pytest.mark.slow
def test_evaluating_a_checkpoint_never_touches_the_training_log(tmp_path, four_steps):
    _copy_run(four_steps, tmp_path)
    history = (tmp_path / "metrics.jsonl").read_text()
    run_config = (tmp_path / "config.yaml").read_text()
    step_2 = tmp_path / "checkpoints" / "step-00000002"
    for resume in (str(step_2), "latest", "latest"):
        result = subprocess.run([sys.executable, "-m", "mmrl", "eval", "configs/toy.yaml", f"run.output_dir={tmp_path}",
                                 *BASE, "run.max_steps=4", f"run.resume={resume}"],
                                cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "metrics.jsonl").read_text() == history
    assert (tmp_path / "config.yaml").read_text() == run_config
    # Each evaluation's samples come with the config that made them: step 4's is the last call's (resume latest).
    assert f"resume: {step_2}" in (tmp_path / "evaluations" / "step_000002" / "config.yaml").read_text()
    assert "resume: latest" in (tmp_path / "evaluations" / "step_000004" / "config.yaml").read_text()
    records = [json.loads(line) for line in (tmp_path / "evaluations.jsonl").read_text().splitlines()]
    assert [(r["step"], Path(r["checkpoint"]).name) for r in records] == [
        (2, "step-00000002"), (4, "step-00000004"), (4, "step-00000004")]


def test_a_fresh_run_into_a_finished_run_is_refused_in_one_line(tmp_path):
    (tmp_path / "checkpoints" / "step-00000002" / "accelerate").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000002" / "policy").mkdir()
    (tmp_path / "checkpoints" / "step-00000002" / "trainer_state.json").write_text("{}")
    result = _run(tmp_path, "run.max_steps=2")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "run.resume=latest" in result.stderr, result.stderr
