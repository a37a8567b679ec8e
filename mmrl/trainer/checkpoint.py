"""Atomic checkpoints: write to a temporary folder, rename, then point ``latest`` at it.

Layout of a run folder::

    checkpoints/
        step-00000040/
            policy/               the trainable weights as the plugin saves them (LoRA adapter or full weights)
            accelerate/           optimizer, per-process RNG states, EMA (Accelerate's save_state)
            trainer_state.json    step, optimizer steps, sampler position, the resolved config
        latest                    the name of the newest complete checkpoint, replaced atomically, written last

A kill at any moment leaves either the previous checkpoint or the new one, never a half-written folder that
``resume=latest`` would pick up: incomplete folders keep their ``.tmp-`` prefix and are removed on the next save.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

CHECKPOINT_PREFIX = "step-"
TMP_PREFIX = ".tmp-"
LATEST = "latest"
STATE_FILE = "trainer_state.json"

# Config keys that may change between a checkpoint and its resumption; everything else must match.
RESUMABLE_KEYS = (
    "run.output_dir",
    "run.max_steps",
    "run.resume",
    "run.save_every",
    "run.keep_last",
    "run.log_every",
    "run.progress",
    "run.trackers",
    "run.project_name",
    "eval.",
)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete, or written by an incompatible config."""


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace`` (atomic on POSIX)."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with tmp.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def begin(run_dir: str | Path, step: int) -> Path:
    """Create (after removing any leftover) the temporary folder for the checkpoint of ``step``.

    Call on the main process only, then wait for every process before writing into it.
    """
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for leftover in root.glob(f"{TMP_PREFIX}*"):
        if leftover.is_dir():
            shutil.rmtree(leftover)
        else:
            leftover.unlink()
    tmp = root / f"{TMP_PREFIX}{checkpoint_name(step)}"
    tmp.mkdir()
    return tmp


def temporary_path(run_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"{TMP_PREFIX}{checkpoint_name(step)}"


def commit(run_dir: str | Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Main process, after every process has written: add the state file, rename, update ``latest``, rotate."""
    root = checkpoints_dir(run_dir)
    tmp = temporary_path(run_dir, step)
    write_text_atomic(tmp / STATE_FILE, json.dumps(state, indent=2, sort_keys=True))
    final = root / checkpoint_name(step)
    if final.exists():  # a checkpoint of the same step from an earlier, interrupted attempt
        shutil.rmtree(final)
    os.replace(tmp, final)
    write_text_atomic(root / LATEST, final.name + "\n")
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
             and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def resolve(resume: str, run_dir: str | Path) -> Path | None:
    """The checkpoint folder meant by ``run.resume``: ``"latest"`` (None when the run has none yet) or a path."""
    if resume == "latest":
        root = checkpoints_dir(run_dir)
        marker = root / LATEST
        if marker.is_file():
            candidate = root / marker.read_text().strip()
            if (candidate / STATE_FILE).is_file():
                return candidate
        complete = list_checkpoints(run_dir)
        return complete[-1] if complete else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"run.resume={resume!r} is not a complete checkpoint (no {STATE_FILE} in it)")
    return path


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text())


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two config dicts, ignoring :data:`RESUMABLE_KEYS`."""
    flat_saved, flat_current = _flatten(saved), _flatten(current)
    differing = []
    for key in sorted(set(flat_saved) | set(flat_current)):
        if any(key == allowed or (allowed.endswith(".") and key.startswith(allowed)) for allowed in RESUMABLE_KEYS):
            continue
        if flat_saved.get(key, "<absent>") != flat_current.get(key, "<absent>"):
            differing.append(key)
    return differing


def check_compatible(saved: dict[str, Any], current: dict[str, Any], checkpoint: Path) -> None:
    """Refuse to resume from a checkpoint whose config differs in anything that changes the run."""
    differing = config_differences(saved, current)
    if differing:
        flat_saved, flat_current = _flatten(saved), _flatten(current)
        details = "; ".join(
            f"{key}: checkpoint {flat_saved.get(key, '<absent>')!r}, now {flat_current.get(key, '<absent>')!r}"
            for key in differing[:6]
        )
        raise CheckpointError(
            f"cannot resume from {checkpoint}: the config differs in {len(differing)} key(s): {details}"
        )


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        flat: dict[str, Any] = {}
        for key, value in data.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: data}
