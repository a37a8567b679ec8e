"""``mmrl export RUN [--checkpoint NAME] OUT``: a run's trained policy as a folder its model library loads.

The run's config (as its checkpoint recorded it) builds the plugin, which loads the base model; the checkpoint's
policy weights are loaded into it (:meth:`mmrl.plugin.Plugin.load_trainable`); :meth:`mmrl.plugin.Plugin.export` writes
the folder. The folder is written under a temporary name next to ``OUT`` and renamed into place when complete, so
``OUT`` is either absent or whole.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

EXPORT_INFO = "mmrl_export.json"
"""What an export records next to the weights: the plugin, the base model, the run and checkpoint, the format."""


class ExportError(ValueError):
    """An export that cannot be made (no such run or checkpoint, an output folder in the way); one line."""


EXPORT_WEIGHTS = ("auto", "ema", "raw")


def export_run(run_dir: str | Path, out: str | Path, *, checkpoint: str | None = None,
               device: str = "cpu", weights: str = "auto") -> Path:
    """Export the policy of a run's checkpoint to ``out``.

    Args:
        run_dir: The run folder (``run.output_dir``), holding ``checkpoints/``.
        out: The folder to write; it must not exist or be empty.
        checkpoint: A checkpoint folder name in ``checkpoints/`` (``step-00000040``) or a path to one; None: the
            newest complete checkpoint (what ``run.resume=latest`` picks).
        device: Where the model is built to load the weights (``cpu`` needs no accelerator).
        weights: ``"raw"``: the trained weights; ``"ema"``: their exponential moving average (runs with
            ``ema.enabled``; Flow-GRPO saves only these); ``"auto"``: the EMA when the run evaluated with it
            (``ema.enabled`` and ``ema.use_for_eval``: the weights its evaluations scored) and the checkpoint holds
            it, else the trained weights (a checkpoint written before mmrl saved EMA weights holds none).
            ``mmrl_export.json`` records which (``"weights"``).

    Returns:
        ``out``.

    Raises:
        ExportError: ``out`` is a non-empty folder or a file, the run has no checkpoint, or ``checkpoint`` is not one.
    """
    from mmrl.config import TrainConfig, from_dict
    from mmrl.plugin import Runtime, plugin_registry
    from mmrl.trainer import checkpoint as ckpt

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"export folder {out} already exists and is not empty; choose another OUT or delete it")
    if weights not in EXPORT_WEIGHTS:
        raise ExportError(f"export weights {weights!r} is not one of {', '.join(EXPORT_WEIGHTS)}")
    found = _checkpoint_folder(Path(run_dir), checkpoint)
    state = ckpt.read_state(found)
    config = from_dict(TrainConfig, state["config"])
    ema_folder = found / ckpt.EMA_POLICY_FOLDER
    if weights == "auto":
        weights = "ema" if config.ema.enabled and config.ema.use_for_eval and ema_folder.is_dir() else "raw"
    if weights == "ema" and not ema_folder.is_dir():
        why = ("the run did not keep an EMA (ema.enabled is false)" if not config.ema.enabled
               else f"this checkpoint has no {ckpt.EMA_POLICY_FOLDER}/ (written by an mmrl before EMA exports)")
        raise ExportError(f"cannot export the EMA weights of {found.name}: {why}; use --weights raw")
    runtime = Runtime(device=torch.device(device), seed=config.run.seed)
    plugin = plugin_registry.get(config.plugin.name)(config.plugin.config, runtime)
    policy = plugin.policy()
    plugin.load_trainable(policy, ema_folder if weights == "ema" else found / "policy")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".tmp-{out.name}.{os.getpid()}")
    if staging.exists():
        shutil.rmtree(staging)
    try:
        fmt = plugin.export(policy, staging)
        info = {"plugin": config.plugin.name, "format": fmt, "run": str(Path(run_dir).resolve()),
                "checkpoint": found.name, "step": int(state["step"]), "weights": weights,
                "base_model": getattr(config.plugin.config, "model", None)}
        (staging / EXPORT_INFO).write_text(json.dumps(info, indent=2, default=str) + "\n")
        if out.exists():  # an empty folder: os.replace cannot replace a directory with one on every platform
            out.rmdir()
        os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


def _checkpoint_folder(run_dir: Path, name: str | None) -> Path:
    from mmrl.trainer import checkpoint as ckpt

    if name is None:
        if not run_dir.is_dir():
            raise ExportError(f"no run folder at {run_dir}")
        found = ckpt.resolve("latest", run_dir)
        if found is None:
            raise ExportError(f"run {run_dir} has no complete checkpoint in {ckpt.checkpoints_dir(run_dir)}")
        return found
    candidate = Path(name) if Path(name).is_dir() else ckpt.checkpoints_dir(run_dir) / name
    if not ckpt.is_complete(candidate):
        names = ", ".join(p.name for p in ckpt.list_checkpoints(run_dir)) or "none"
        raise ExportError(f"--checkpoint {name!r} is not a complete checkpoint of {run_dir} (checkpoints: {names})")
    return candidate
