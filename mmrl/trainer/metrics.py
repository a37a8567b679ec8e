"""Metrics: weighted accumulation over micro-batches, and the run's metrics.jsonl (plus Accelerate trackers)."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from torch import Tensor


class WeightedMeans:
    """Accumulate ``value × weight`` per name; :meth:`means` returns Σ value·weight / Σ weight."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)

    def add(self, name: str, value: float | Tensor, weight: float = 1.0) -> None:
        value = float(value.detach().float().item()) if isinstance(value, Tensor) else float(value)
        if math.isfinite(value) and weight > 0:
            self.totals[name] += value * weight
            self.weights[name] += weight

    def add_all(self, values: dict[str, float | Tensor], weight: float = 1.0, prefix: str = "") -> None:
        for name, value in values.items():
            self.add(prefix + name, value, weight)

    def means(self) -> dict[str, float]:
        return {name: self.totals[name] / self.weights[name] for name in self.totals if self.weights[name] > 0}


class MetricsWriter:
    """Appends one JSON line per logged step to ``metrics.jsonl`` and forwards to Accelerate's trackers.

    Only the main process writes; the others hold a writer that does nothing. ``fields`` are added to every record
    (``mmrl eval`` names the checkpoint it evaluated).
    """

    def __init__(self, path: str | Path, *, enabled: bool, accelerator: Any = None, use_trackers: bool = False,
                 fields: dict[str, Any] | None = None):
        self.path = Path(path)
        self.fields = dict(fields or {})
        self.enabled = enabled
        self.accelerator = accelerator
        self.use_trackers = use_trackers
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in sorted({**metrics, **self.fields}.items())}}
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.use_trackers and self.accelerator is not None:
            numeric = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            self.accelerator.log(numeric, step=step)


def _plain(value: Any) -> Any:
    if isinstance(value, Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read a metrics.jsonl back (used by tests, benchmarks and the plotting helpers)."""
    with Path(path).open() as handle:
        return [json.loads(line) for line in handle if line.strip()]
