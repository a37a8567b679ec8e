"""Where one dLLM training step spends its time, piece by piece (CPU time), on the toy recipe (configs/dllm/toy.yaml).

``benchmarks/step_floors.py`` compares the whole step with its compute floor; this script breaks the step itself
down, to find what ``other`` (the step's time outside the floor and the timed extras) is made of. It wraps the
plugin's, learner's and trainer's methods with CPU-time (``time.process_time``) counters and runs ``--steps``
restored steps (the same batch each time, as step_floors.py does, after ``--warmup`` untimed steps). Model calls
(``DLLMAdapter.model_logits``) are also counted by the piece they run in, so each piece's own work is its time
minus its model time. Pieces nest (``rollout`` holds ``decode``, ``reference`` and ``draw_plans``; ``update`` holds
``training_forwards``, ``backward``, ``old_policy_pass`` and ``optimizer_step``); the trainer's remainder is
``step`` minus ``collect`` and ``update``.

``--json`` writes ``settings`` (``config``, ``overrides``, ``steps``, ``warmup``, ``threads``), ``milliseconds``
(per piece, the median over the steps) and ``per_step`` (per piece, one value per step). Examples::

    OMP_NUM_THREADS=1 python benchmarks/dllm_step_parts.py --threads 1 --steps 9 --json parts.json
    # the smallest run (what tests/benchmarks/test_smoke.py does)
    python benchmarks/dllm_step_parts.py --threads 1 --steps 1 --warmup 0 --json parts.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

CONFIG = "configs/dllm/toy.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE", help="Recipe overrides.")
    parser.add_argument("--steps", type=int, default=9, help="Timed (restored) steps.")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed steps first.")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's).")
    parser.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    return args


class Counters:
    """CPU seconds per piece in the current step, with the model's time also charged to the innermost piece."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.stack: list[str] = []

    def wrap(self, owner: Any, name: str, piece: str) -> None:
        method = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            self.stack.append(piece)
            try:
                return method(*args, **kwargs)
            finally:
                self.stack.pop()
                spent = time.process_time() - start
                self.seconds[piece] += spent
                if piece == "model" and self.stack:
                    self.seconds[f"model in {self.stack[-1]}"] += spent

        setattr(owner, name, timed)


def measure(args: argparse.Namespace, trainer: Any) -> dict[str, list[float]]:
    from step_floors import Snapshot

    plugin, learner, counters = trainer.plugin, trainer.learner, Counters()
    score = plugin.score

    def scored(scorer: Any, replay: Any, *, plan: int = 0) -> Any:  # the rollout's no-grad scoring: the reference
        if counters.stack and counters.stack[-1] == "rollout":
            counters.stack.append("reference")
            start = time.process_time()
            try:
                return score(scorer, replay, plan=plan)
            finally:
                counters.stack.pop()
                counters.seconds["reference"] += time.process_time() - start
        return score(scorer, replay, plan=plan)

    plugin.score = scored
    for owner, name, piece in ((plugin, "rollout", "rollout"), (plugin, "_decode", "decode"),
                               (plugin, "draw_plans", "draw_plans"), (plugin, "encode_prompts", "encode_prompts"),
                               (plugin, "decode_texts", "decode_texts"), (trainer.collector, "collect", "collect"),
                               (learner, "update", "update"), (learner, "_micro_loss", "micro_loss"),
                               (learner, "old_policy_rollouts", "old_policy_pass"),
                               (learner, "_optimizer_step", "optimizer_step"),
                               (trainer.accelerator, "backward", "backward"),
                               (plugin.adapter, "model_logits", "model")):
        counters.wrap(owner, name, piece)
    for _ in range(args.warmup):
        trainer.training_step()
    snapshot = Snapshot(trainer)
    per_step: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.steps):
        snapshot.restore(trainer)
        counters.seconds.clear()
        start = time.process_time()
        trainer.training_step()
        counters.seconds["step"] = time.process_time() - start
        counters.seconds["trainer_rest"] = (counters.seconds["step"] - counters.seconds["collect"]
                                            - counters.seconds["update"])
        for piece, seconds in counters.seconds.items():
            per_step[piece].append(seconds * 1e3)
    snapshot.restore(trainer)
    return dict(per_step)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from mmrl.config import load_config
    from mmrl.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="dllm-step-parts-") as folder:
        config = load_config(str(ROOT / CONFIG), [f"run.output_dir={Path(folder) / 'run'}", "run.progress=false",
                                                  "run.cpu=true", *args.override])
        trainer = Trainer(config)
        try:
            per_step = measure(args, trainer)
        finally:
            trainer.close()
    medians = {piece: statistics.median(values) for piece, values in per_step.items()}
    print(f"dllm step pieces ({CONFIG}, {args.steps} steps, {torch.get_num_threads()} thread(s)), CPU ms, medians:")
    for piece, value in sorted(medians.items(), key=lambda item: -item[1]):
        print(f"  {piece:40s} {value:8.1f}")
    if args.json:
        args.json.write_text(json.dumps({"settings": {"config": CONFIG, "overrides": args.override,
                                                      "steps": args.steps, "warmup": args.warmup,
                                                      "threads": torch.get_num_threads()},
                                         "milliseconds": medians, "per_step": per_step}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
