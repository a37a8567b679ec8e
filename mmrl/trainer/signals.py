"""SIGTERM/SIGINT as a request to stop, honoured by the trainer at its next safe point.

Pre-emptible clusters send SIGTERM and wait a grace period before SIGKILL; a user presses Ctrl-C. Either way a run
should finish the piece of work under way, write a checkpoint and exit cleanly rather than die mid-write. While
:func:`stop_signals` is active the two signals only set a flag (:func:`stop_requested`); the trainer reads it at its
safe points (before each step, after the final checkpoint) through a collective, so every process stops at the same
step. The context nests: ``mmrl train`` enters it before the models are built, so a signal during start-up is
honoured too, and :meth:`mmrl.trainer.Trainer.train` enters it again for library callers.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)

_depth = 0
_requested: int | None = None  # the signal number received while installed


def stop_requested() -> bool:
    """True once SIGTERM or SIGINT arrived while :func:`stop_signals` was active (reset when it is next entered)."""
    return _requested is not None


def _request_stop(signum: int, frame: Any) -> None:
    global _requested
    _requested = signum


@contextmanager
def stop_signals() -> Iterator[None]:
    """Turn SIGTERM/SIGINT into a stop request for the duration of the block (outside the main thread, where
    handlers cannot be installed, the signals keep their default behaviour)."""
    global _depth, _requested
    previous: dict[int, Any] = {}
    if _depth == 0:
        _requested = None
        for sig in SIGNALS:
            try:
                previous[sig] = signal.signal(sig, _request_stop)
            except ValueError:  # not the main thread (e.g. inside some test runners): leave the default
                pass
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        for sig, handler in previous.items():
            signal.signal(sig, handler)
