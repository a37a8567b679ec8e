"""Atomic checkpoints: write aside, rename into place, then point ``latest`` at it.

Layout of a run folder::

    checkpoints/
        step-00000040/
            policy/               the trainable weights as the plugin saves them (LoRA adapter or full weights)
            policy_ema/           with ema.enabled: the EMA of those weights, in the same format (what `mmrl export`
                                  writes by default when the run evaluated with the EMA)
            accelerate/           optimizer, per-process RNG states, EMA, synced reference, adaptive entropy
                                  coefficient (Accelerate's save_state)
            trainer_state.json    step, optimizer steps, sampler position, the resolved config
        latest                    the name of the newest complete checkpoint, replaced atomically

A checkpoint is written into ``.tmp-step-N`` (every process writes its part, then the main process adds
``trainer_state.json``, the last file) and renamed to ``step-N``. No complete checkpoint is ever deleted before
its replacement is complete: re-saving a step that already has a checkpoint renames the old folder to
``.old-step-N`` first, renames the new one into place, and only then deletes the old one; rotation and clean-up
rename a folder to ``.trash-...`` before deleting it, so a folder named ``step-N`` is never half deleted.

A kill at any file operation therefore leaves, besides complete ``step-*`` folders, at most a complete or
incomplete ``.tmp-``, an ``.old-`` and a ``.trash-`` folder. :func:`recover` (run before every save and resume)
finishes or undoes the interrupted swap and removes the rest, and ``resume=latest`` only ever picks a complete
checkpoint, warning about any incomplete ``step-*`` folder it skips (one left by an older mmrl, say).
Every file operation goes through :func:`_before_operation`, the hook the durability tests use to kill a save at
each operation deterministically.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any

logger = logging.getLogger("mmrl")

CHECKPOINT_PREFIX = "step-"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
TRASH_PREFIX = ".trash-"
LATEST = "latest"
STATE_FILE = "trainer_state.json"
# What a complete checkpoint holds: the state file is written last, into the temporary folder, before the rename.
REQUIRED_FOLDERS = ("accelerate", "policy")
EMA_POLICY_FOLDER = "policy_ema"  # written beside policy/ when ema.enabled

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


def _before_operation(operation: str, path: Path) -> None:
    """Called before every file operation of a save, a rotation or a recovery (``operation`` names it). Does
    nothing; the durability tests replace it to stop the process at a chosen operation."""


def _replace(source: Path, target: Path) -> None:
    _before_operation("rename", source)
    os.replace(source, target)


def _remove_tree(path: Path) -> None:
    """Delete a folder so that it is never seen half deleted under its own name: rename it to ``.trash-...``
    first (atomic), then delete the renamed folder."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name.lstrip('.')}")
    if trash.exists():
        _delete(trash)
    _replace(path, trash)
    _delete(trash)


def _delete(path: Path) -> None:
    _before_operation("delete", path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace`` (atomic on POSIX)."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    _before_operation("write", tmp)
    with tmp.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    _replace(tmp, path)


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` holds a whole checkpoint: its state file (written last) and every part."""
    return (folder / STATE_FILE).is_file() and all((folder / part).is_dir() for part in REQUIRED_FOLDERS)


def _step_of(folder: Path) -> str:
    """``step-00000040`` for ``step-00000040``, ``.tmp-step-00000040`` or ``.old-step-00000040``."""
    name = folder.name
    for prefix in (TMP_PREFIX, OLD_PREFIX):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def recover(run_dir: str | Path) -> None:
    """Finish or undo a save that a kill interrupted; call on the main process only, before saving or resuming.

    - a complete ``.tmp-step-N`` whose ``step-N`` is missing or incomplete was about to be renamed into place:
      rename it (an incomplete ``step-N`` is removed first);
    - ``.old-step-N`` is the previous checkpoint of a step being re-saved: deleted once ``step-N`` is complete,
      renamed back otherwise;
    - ``.trash-*`` folders are deleted; incomplete ``.tmp-`` folders are left for :func:`begin` to delete.
    """
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return
    for tmp in sorted(root.glob(f"{TMP_PREFIX}{CHECKPOINT_PREFIX}*")):
        final = root / _step_of(tmp)
        if tmp.is_dir() and is_complete(tmp) and not is_complete(final):
            if final.exists():
                _remove_tree(final)
            _replace(tmp, final)
    for old in sorted(root.glob(f"{OLD_PREFIX}{CHECKPOINT_PREFIX}*")):
        final = root / _step_of(old)
        if is_complete(final):
            _remove_tree(old)
        elif is_complete(old):
            if final.exists():
                _remove_tree(final)
            _replace(old, final)
        else:  # not a checkpoint we made
            _remove_tree(old)
    for trash in root.glob(f"{TRASH_PREFIX}*"):
        _delete(trash)


def begin(run_dir: str | Path, step: int) -> Path:
    """Recover from an interrupted save, then create the empty temporary folder for the checkpoint of ``step``.

    Call on the main process only, then wait for every process before writing into it.
    """
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    recover(run_dir)
    for leftover in root.glob(f"{TMP_PREFIX}*"):  # incomplete checkpoints and state files of a killed save
        if leftover.is_dir():
            _remove_tree(leftover)
        else:
            _delete(leftover)
    tmp = temporary_path(run_dir, step)
    _before_operation("mkdir", tmp)
    tmp.mkdir()
    return tmp


def temporary_path(run_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"{TMP_PREFIX}{checkpoint_name(step)}"


def commit(run_dir: str | Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Main process, after every process has written: add the state file, swap the folder into place, update
    ``latest``, rotate. The previous checkpoint of the same step, if any, is deleted only after the swap."""
    root = checkpoints_dir(run_dir)
    tmp = temporary_path(run_dir, step)
    write_text_atomic(tmp / STATE_FILE, json.dumps(state, indent=2, sort_keys=True))
    final = root / checkpoint_name(step)
    aside = root / f"{OLD_PREFIX}{final.name}"
    if final.exists():  # a checkpoint of the same step: a relaunched run, or an earlier interrupted attempt
        _replace(final, aside)
    _replace(tmp, final)
    write_text_atomic(root / LATEST, final.name + "\n")
    if aside.exists():
        _remove_tree(aside)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        _remove_tree(old)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and is_complete(p)]
    return sorted(found, key=lambda p: p.name)


def incomplete_checkpoints(run_dir: str | Path) -> list[Path]:
    """``step-*`` folders that lack part of a checkpoint (``resume=latest`` skips them with a warning)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
                  and not is_complete(p))


def resolve(resume: str, run_dir: str | Path) -> Path | None:
    """The checkpoint folder meant by ``run.resume``: ``"latest"`` (None when the run has none yet) or a path.

    ``latest`` is the checkpoint the ``latest`` marker names when it is complete (a run resumed from an older
    checkpoint of the same folder leaves newer ones of the abandoned attempt behind, so the highest step is not
    always the newest), else the complete checkpoint of the highest step. Incomplete ``step-*`` folders are skipped
    with a warning naming them.
    """
    if resume == "latest":
        root = checkpoints_dir(run_dir)
        skipped = incomplete_checkpoints(run_dir)
        if skipped:
            logger.warning("run.resume=latest skips incomplete checkpoint folder(s) %s",
                           ", ".join(str(p) for p in skipped))
        marker = root / LATEST
        if marker.is_file():
            candidate = root / marker.read_text().strip()
            if is_complete(candidate):
                return candidate
        complete = list_checkpoints(run_dir)
        return complete[-1] if complete else None
    path = Path(resume)
    if not is_complete(path):
        missing = [part for part in (STATE_FILE, *REQUIRED_FOLDERS) if not (path / part).exists()]
        raise CheckpointError(f"run.resume={resume!r} is not a complete checkpoint (missing {', '.join(missing)})")
    return path


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text())


def config_differences(saved: dict[str, Any], current: dict[str, Any], allowed: Collection[str] = ()) -> list[str]:
    """Dotted keys whose values differ between two config dicts, ignoring :data:`RESUMABLE_KEYS` and ``allowed``
    (dotted keys, or prefixes ending in ``.``; a key also covers what is nested under it)."""
    flat_saved, flat_current = _flatten(saved), _flatten(current)
    ignored = (*RESUMABLE_KEYS, *allowed)
    differing = []
    for key in sorted(set(flat_saved) | set(flat_current)):
        if any(key == name or key.startswith(name if name.endswith(".") else f"{name}.") for name in ignored):
            continue
        if flat_saved.get(key, "<absent>") != flat_current.get(key, "<absent>"):
            differing.append(key)
    return differing


def with_current_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's recorded config read through today's schema: keys that a later mmrl added are filled with their
    defaults (e.g. ``plugin.lora.dropout``, which the flow plugin's LoRA section gained with the shared
    :class:`mmrl.policy.LoraConfig`), so that a checkpoint written before them still resumes. A config the schema
    refuses is returned as recorded: :func:`check_compatible` then names the keys that differ."""
    from mmrl.config import ConfigError, TrainConfig, from_dict, to_dict
    from mmrl.registry import RegistryError

    try:
        return to_dict(from_dict(TrainConfig, saved))
    except (ConfigError, RegistryError):
        return saved


def check_compatible(saved: dict[str, Any], current: dict[str, Any], checkpoint: Path,
                     allowed: Collection[str] = ()) -> None:
    """Refuse to resume from a checkpoint whose config differs in anything that changes the run (a key added since
    the checkpoint was written counts as its default, :func:`with_current_defaults`). ``allowed``: more keys that may
    differ, the config's evaluation-only ones (:func:`mmrl.config.eval_only_keys`) where the trainer calls it."""
    saved = with_current_defaults(saved)
    differing = config_differences(saved, current, allowed)
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


# ---------------------------------------------------------------------------------------------- run folder checks
def check_run_folder(run_dir: str | Path) -> None:
    """Fail fast, before any model is built, when the run folder cannot be created or written.

    Writes and deletes a probe file in the folder and in its ``checkpoints/`` (when present): permissions alone do
    not tell (root ignores them; a read-only mount refuses everyone).
    """
    from mmrl.config import ConfigError

    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError("run.output_dir", str(path), "a folder (a file of that name is in the way)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError("run.output_dir", str(path),
                          f"a folder that can be created ({error.strerror or error}: {error.filename})") from None
    for folder in (path, checkpoints_dir(path)):
        if not folder.is_dir():
            continue
        probe = folder / f"{TMP_PREFIX}write-test.{os.getpid()}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            raise ConfigError("run.output_dir", str(path),
                              f"a folder this process can write ({error.strerror or error}: {folder})") from None


def refuse_existing_run(run_dir: str | Path) -> None:
    """A run that starts afresh (``run.resume`` null) in a folder holding another run's checkpoints would mix the
    two: its checkpoints rotate among the old ones (deleting its own first) and ``latest`` stops meaning anything.
    Refuse it in one line, naming the ways on."""
    from mmrl.config import ConfigError

    found = list_checkpoints(run_dir)
    if found:
        raise ConfigError("run.output_dir", str(run_dir),
                          f"a folder without another run's checkpoints (it holds {found[-1].name}): continue that run "
                          "with run.resume=latest, or start afresh in another folder (or after deleting this one)")


def save_failed(run_dir: str | Path, step: int, error: BaseException | None, *, clean_up: bool) -> CheckpointError:
    """The one-line error of a checkpoint write that failed (on this or another process). With ``clean_up`` (the
    main process) the partial folder is removed first, freeing what it took."""
    tmp = temporary_path(run_dir, step)
    free = _free_bytes(run_dir)
    if clean_up and tmp.exists():
        _remove_tree(tmp)
    if error is None:
        reason = "it failed on another process"
    elif _out_of_space(error, free):
        reason = f"no space left on device ({free / 2**20:.1f} MiB free in {run_dir})"
    else:
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")
    kept = list_checkpoints(run_dir)
    previous = f"the previous checkpoint {kept[-1]} is intact" if kept else "no earlier checkpoint exists"
    return CheckpointError(f"could not write the checkpoint of step {step}: {reason}; {previous}")


def _free_bytes(run_dir: str | Path) -> int:
    try:
        return shutil.disk_usage(run_dir).free
    except OSError:
        return -1


def _out_of_space(error: BaseException, free: int) -> bool:
    """ENOSPC anywhere in the error's chain, or a write error (torch reports one as ``unexpected pos``) on a
    device with less than 1 MiB left."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return 0 <= free < 2**20
