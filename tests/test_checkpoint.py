"""Checkpoints survive a kill at every file operation of a save, a re-save and a rotation.

A kill is simulated by raising :class:`Killed` (a ``BaseException``, which no mmrl code catches) from the
``_before_operation`` hook of :mod:`mmrl.trainer.checkpoint` at the k-th operation, for every k: the folder is left
exactly as a SIGKILL at that moment would leave it. ``tests/test_durability.py`` kills real processes.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from mmrl.config import ConfigError
from mmrl.trainer import Trainer
from mmrl.trainer import checkpoint as ckpt
from tests.helpers import toy_config


class Killed(BaseException):
    """Stands for SIGKILL: nothing catches it, no clean-up runs."""


def _save(run: Path, step: int, content: str, keep_last: int = 2) -> None:
    """A checkpoint as the trainer writes one (parts by every process, then the state file by the main one)."""
    tmp = ckpt.begin(run, step)
    for part in ckpt.REQUIRED_FOLDERS:
        (tmp / part).mkdir()
        (tmp / part / "weights.bin").write_text(content)
    ckpt.commit(run, step, {"step": step, "content": content}, keep_last)


def _content(folder: Path) -> str:
    texts = {(folder / part / "weights.bin").read_text() for part in ckpt.REQUIRED_FOLDERS}
    state = json.loads((folder / ckpt.STATE_FILE).read_text())["content"]
    assert texts == {state}, f"{folder} mixes two checkpoints: {texts} and {state}"
    return state


class _Operations:
    """The ``_before_operation`` hook: counts operations, kills at ``kill_at``, and checks that a folder named
    ``step-*`` is never deleted in place (only ``.trash-``/``.tmp-`` files and folders are)."""

    def __init__(self, kill_at: int | None = None):
        self.kill_at, self.count, self.log = kill_at, 0, []

    def __call__(self, operation: str, path: Path) -> None:
        if operation == "delete":
            assert path.name.startswith((ckpt.TRASH_PREFIX, ckpt.TMP_PREFIX)), f"deleted {path} in place"
        self.log.append(f"{operation} {path.name}")
        if self.count == self.kill_at:
            raise Killed(self.log[-1])
        self.count += 1


SCENARIOS = {
    # name: (setup saves, the save that is killed, checkpoints a resume may land on and their contents)
    "new step with rotation": ([(2, "two"), (3, "three")], (4, "four"), {"step-00000003": "three",
                                                                          "step-00000004": "four"}),
    "re-save of the latest step": ([(3, "three"), (4, "old four")], (4, "new four"),
                                   {"step-00000004": ("old four", "new four")}),
}


def _operations_of(tmp_path: Path, setup, save) -> int:
    run = tmp_path / "count"
    for step, content in setup:
        _save(run, step, content)
    hook = _Operations()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ckpt, "_before_operation", hook)
        _save(run, *save)
    return hook.count


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_kill_at_every_file_operation_leaves_a_resumable_checkpoint(tmp_path, scenario):
    setup, save, allowed = SCENARIOS[scenario]
    total = _operations_of(tmp_path, setup, save)
    assert total >= 6  # mkdir, state file (write, rename), swap, marker (write, rename), rotation or old removal
    for kill_at in range(total):
        run = tmp_path / f"kill-{kill_at}"
        for step, content in setup:
            _save(run, step, content)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ckpt, "_before_operation", _Operations(kill_at))
            with pytest.raises(Killed):
                _save(run, *save)
        ckpt.recover(run)  # what the next resume does first
        found = ckpt.resolve("latest", run)
        assert found is not None and ckpt.is_complete(found), kill_at
        expected = allowed.get(found.name)
        assert expected is not None, (kill_at, found.name)
        assert _content(found) in (expected if isinstance(expected, tuple) else (expected,)), kill_at
        assert not ckpt.incomplete_checkpoints(run), kill_at
        leftovers = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith((".old-", ".trash-"))]
        assert leftovers == [], (kill_at, leftovers)
        _save(run, *save)  # and the interrupted save succeeds when the run goes on
        assert _content(run / "checkpoints" / ckpt.checkpoint_name(save[0])) == save[1]


def test_resaving_a_step_replaces_it_only_once_the_new_one_is_complete(tmp_path):
    _save(tmp_path, 4, "old")
    hook = _Operations()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ckpt, "_before_operation", hook)
        _save(tmp_path, 4, "new")
    swap = hook.log.index("rename step-00000004")  # the old folder moves aside ...
    assert hook.log[swap - 1] == f"rename {ckpt.TMP_PREFIX}{ckpt.STATE_FILE}.{__import__('os').getpid()}"  # ... once
    assert hook.log[swap + 1] == "rename .tmp-step-00000004"  # the new one is complete, and is renamed in at once
    assert _content(tmp_path / "checkpoints" / "step-00000004") == "new"


def test_resume_latest_skips_an_incomplete_folder_with_a_warning(tmp_path, caplog):
    """The folder an older mmrl left when killed while re-saving: only trainer_state.json, named by latest."""
    _save(tmp_path, 3, "three")
    broken = tmp_path / "checkpoints" / "step-00000004"
    broken.mkdir()
    (broken / ckpt.STATE_FILE).write_text(json.dumps({"step": 4}))
    ckpt.write_text_atomic(tmp_path / "checkpoints" / ckpt.LATEST, broken.name + "\n")
    with caplog.at_level(logging.WARNING, logger="mmrl"):
        found = ckpt.resolve("latest", tmp_path)
    assert found == tmp_path / "checkpoints" / "step-00000003"
    assert "step-00000004" in caplog.text and "incomplete" in caplog.text
    with pytest.raises(ckpt.CheckpointError, match="missing accelerate, policy"):
        ckpt.resolve(str(broken), tmp_path)


def test_a_fresh_run_into_a_folder_holding_another_run_is_refused(tmp_path):
    _save(tmp_path, 3, "three")
    with pytest.raises(ConfigError, match="run.resume=latest"):
        ckpt.refuse_existing_run(tmp_path)
    ckpt.refuse_existing_run(tmp_path / "elsewhere")  # a new folder is fine


def test_mmrl_train_refuses_a_full_folder_before_building_anything(tmp_path, monkeypatch, capsys):
    from mmrl.cli import main

    _save(tmp_path, 3, "three")
    monkeypatch.setattr(Trainer, "__init__", lambda self, config: pytest.fail("built before the folder check"))
    assert main(["train", "configs/toy.yaml", f"run.output_dir={tmp_path}"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "holds step-00000003" in error and "run.resume=latest" in error


def test_an_unusable_output_dir_is_one_line_before_anything_is_built(tmp_path, monkeypatch):
    in_the_way = tmp_path / "file"
    in_the_way.write_text("")
    built = []
    monkeypatch.setattr(Trainer, "_build_accelerator", lambda self: built.append(1))
    for path, match in [(in_the_way, "a file of that name is in the way"),
                        (in_the_way / "run", "a folder that can be created")]:
        with pytest.raises(ConfigError, match=match) as error:
            Trainer(toy_config(path))
        assert "\n" not in str(error.value)
    assert built == []


def test_a_full_disk_names_the_cause_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno

    trainer = Trainer(toy_config(tmp_path, "run.max_steps=2", "run.save_every=1"))
    trainer.train()
    original = trainer.accelerator.save_state

    def full_disk(output_dir, **kwargs):
        original(output_dir, **kwargs)  # writes the parts, then the device is full
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534") from OSError(
            errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer.accelerator, "save_state", full_disk)
    trainer.step = 3
    with pytest.raises(ckpt.CheckpointError) as error:
        trainer.save_checkpoint()
    message = str(error.value)
    assert "no space left on device" in message and "step-00000002 is intact" in message, message
    assert "\n" not in message
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()] == ["step-00000001",
                                                                                   "step-00000002"]
    assert ckpt.resolve("latest", tmp_path).name == "step-00000002"


def test_a_run_killed_at_every_operation_of_a_resave_resumes_to_the_same_weights(tmp_path):
    """The re-save window with the real trainer: a run resumed from step 2 of a finished 4-step run re-saves step 4
    over the old one (and rotates step 2 away); killed at each file operation of that save, ``resume=latest``
    always finds a complete checkpoint and lands on the parameters of an uninterrupted run."""
    common = ("run.max_steps=4", "run.save_every=2", "run.keep_last=1")
    reference = tmp_path / "reference"
    Trainer(toy_config(reference, *common, "run.keep_last=2")).train()
    expected = _policy(reference, 4)
    hook = _Operations()
    counted = tmp_path / "counted"
    shutil.copytree(reference, counted)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ckpt, "_before_operation", hook)
        Trainer(toy_config(counted, *common, f"run.resume={counted / 'checkpoints' / 'step-00000002'}")).train()
    saves = [k for k, entry in enumerate(hook.log) if entry == "mkdir .tmp-step-00000004"]
    assert len(saves) == 1
    for kill_at in range(saves[0], hook.count):
        run = tmp_path / f"kill-{kill_at}"
        shutil.copytree(reference, run)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ckpt, "_before_operation", _Operations(kill_at))
            with pytest.raises(Killed):
                Trainer(toy_config(run, *common, f"run.resume={run / 'checkpoints' / 'step-00000002'}")).train()
        resumed = Trainer(toy_config(run, *common, "run.resume=latest"))
        resumed.train()
        got = _policy(run, 4)
        for name, tensor in expected.items():  # same process, same kernels, same order: bit-identical
            assert torch.equal(got[name], tensor), (kill_at, hook.log[kill_at], name)


def _policy(run: Path, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run / "checkpoints" / ckpt.checkpoint_name(step) / "policy" / "trainable.safetensors"))


@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs of our own (a real full disk, a real read-only mount); skipped where mounting is not
    permitted (not root, or a container without the capability)."""
    mounted = []

    def mount(size: str) -> Path:
        point = tmp_path / f"mount{len(mounted)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_a_real_full_disk_keeps_the_previous_checkpoint(tmpfs):
    disk = tmpfs("700k")  # one toy checkpoint (~420 KiB) fits, a second one beside it does not
    trainer = Trainer(toy_config(disk, "run.max_steps=2", "run.save_every=1"))
    with pytest.raises(ckpt.CheckpointError, match="no space left on device") as error:
        trainer.train()
    assert "step-00000001 is intact" in str(error.value) and "\n" not in str(error.value)
    assert [p.name for p in (disk / "checkpoints").iterdir() if p.is_dir()] == ["step-00000001"]
    assert ckpt.is_complete(disk / "checkpoints" / "step-00000001")


def test_resuming_into_a_read_only_run_is_one_line_before_anything_is_built(tmpfs, monkeypatch):
    disk = tmpfs("2m")
    Trainer(toy_config(disk, "run.max_steps=1")).train()
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    monkeypatch.setattr(Trainer, "_build_accelerator", lambda self: pytest.fail("built before the folder check"))
    with pytest.raises(ConfigError, match="a folder this process can write .Read-only file system") as error:
        Trainer(toy_config(disk, "run.max_steps=2", "run.resume=latest"))
    assert "\n" not in str(error.value)
