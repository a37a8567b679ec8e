"""Long runs survive faults: SIGKILL at a random moment or inside a checkpoint write, resuming at an epoch
boundary, and SIGTERM/SIGINT finishing the step, checkpointing and exiting 0. Real processes are killed."""

from __future__ import annotations

import json
import random
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


@pytest.mark.slow
def test_sigkill_at_a_random_moment_then_resume_lands_on_the_same_parameters(tmp_path, uninterrupted):
    target = random.randint(2, 7)
    process = subprocess.Popen(_command(tmp_path, "run.max_steps=10", "run.save_every=1"), cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = tmp_path / "checkpoints" / f"step-{target:08d}"
    deadline = time.time() + 120
    while not marker.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    time.sleep(random.uniform(0.0, 0.05))  # a random moment of the next step: sampling, update or checkpoint write
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
