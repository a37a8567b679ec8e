"""Run ``mmrl train`` with an injected fault, for the durability tests.

    python tests/faults.py FAULT ARG CONFIG [overrides...]

Faults (each injected deterministically, at a named point rather than after a delay):

- ``kill-in-checkpoint STEP``: SIGKILL while the checkpoint of STEP is being written, after every file is in the
  temporary folder and before it is renamed into place, the worst moment for a non-atomic writer.
- ``kill-at-operation ENTRY``: SIGKILL just before the checkpoint file operation ENTRY, as the checkpoint module
  names its operations (e.g. ``"rename .tmp-step-00000004"``, the moment a re-saved step has no folder of its own).
- ``kill-after-step STEP``: SIGKILL once step STEP is logged (before any checkpoint when ``run.save_every=0``).
- ``term-in-evaluation K``: SIGTERM to itself at the start of the K-th evaluation (1: the first one).
- ``term-at-startup 0``: SIGTERM to itself while the trainer is being built.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmrl.cli import main  # noqa: E402
from mmrl.trainer import Trainer, checkpoint  # noqa: E402
from mmrl.trainer.metrics import MetricsWriter  # noqa: E402


def _kill(sig: int = signal.SIGKILL) -> None:
    os.kill(os.getpid(), sig)


def kill_in_checkpoint(step: str) -> None:
    original = checkpoint.commit

    def commit(run_dir, at_step, state, keep_last):
        if at_step == int(step):
            _kill()
        return original(run_dir, at_step, state, keep_last)

    checkpoint.commit = commit


def kill_at_operation(entry: str) -> None:
    def before(operation: str, path: Path) -> None:
        if f"{operation} {path.name}" == entry:
            _kill()

    checkpoint._before_operation = before


def kill_after_step(step: str) -> None:
    original = MetricsWriter.write

    def write(self, at_step, metrics):
        original(self, at_step, metrics)
        if at_step == int(step) and "reward/mean" in metrics:
            _kill()

    MetricsWriter.write = write


def term_in_evaluation(count: str) -> None:
    original, calls = Trainer.evaluate, []

    def evaluate(self, **kwargs):
        calls.append(1)
        if len(calls) == int(count):
            _kill(signal.SIGTERM)  # handled as a stop request: the evaluation still finishes
        return original(self, **kwargs)

    Trainer.evaluate = evaluate


def term_at_startup(_: str) -> None:
    original = Trainer._build_accelerator

    def build(self):
        _kill(signal.SIGTERM)
        return original(self)

    Trainer._build_accelerator = build


FAULTS = {"kill-in-checkpoint": kill_in_checkpoint, "kill-at-operation": kill_at_operation,
          "kill-after-step": kill_after_step, "term-in-evaluation": term_in_evaluation,
          "term-at-startup": term_at_startup}


if __name__ == "__main__":
    fault, argument, *rest = sys.argv[1:]
    if fault not in FAULTS:
        raise SystemExit(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    FAULTS[fault](argument)
    sys.exit(main(["train", *rest]))
