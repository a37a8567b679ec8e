"""Run ``mmrl train`` with an injected fault, for the durability tests.

    python tests/faults.py kill-in-checkpoint STEP CONFIG [overrides...]

``kill-in-checkpoint`` SIGKILLs the process while the checkpoint of STEP is being written: after every file is in
the temporary folder and before it is renamed into place, the worst moment for a non-atomic writer.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmrl.cli import main  # noqa: E402
from mmrl.trainer import checkpoint  # noqa: E402


def kill_in_checkpoint(step: int) -> None:
    original = checkpoint.commit

    def commit(run_dir, at_step, state, keep_last):
        if at_step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(run_dir, at_step, state, keep_last)

    checkpoint.commit = commit


if __name__ == "__main__":
    fault, step, *rest = sys.argv[1:]
    if fault != "kill-in-checkpoint":
        raise SystemExit(f"unknown fault {fault!r}")
    kill_in_checkpoint(int(step))
    sys.exit(main(["train", *rest]))
