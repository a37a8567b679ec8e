"""One full mmrl training step of a plugin against its compute floor, measured side by side in one process.

The step is ``Trainer.training_step()`` on a shipped recipe: rollout, rewards, advantages, every inner epoch's
forwards and backwards, the optimizer. The floor (``benchmarks/floors``) is the model compute that step cannot do
without, run bare on the same modules, shapes and batch: the rollout's model calls, one bare forward and backward per
backward pass of the learner, one bare AdamW step (learning rate 0) per mini-batch. The difference is broken down
by timing, bare and on the same batch, the passes the step runs beyond the floor (``reference``: the KL reference
pass; ``old_logp``: a separate old-policy pass) and its log-prob math (``logprob_math``), and by the step's own
reward and advantage timers; what is left (``other``) is Python, data movement and everything else.

Every timed step is the same step: the trainable weights, optimizer state, prompt stream and RNG are restored
before each one (outside the timed region), so each round samples the same batch and the floor, built from one
captured step, has that step's shapes. Each round times every item once (step, floor, extras) in an order rotated
by one each round; ratios are ratios of the medians over the rounds (and per round, for the spread). Wall and CPU
time (``time.process_time``) are both recorded; the torch thread counts are in the settings.

Plugins and default recipes: ``toy`` configs/toy.yaml, ``flow`` configs/flow/shapes.yaml (the bundled 32x32 latent
SD3), ``vlm`` configs/vlm/toy_grounding.yaml (a tiny Qwen2.5-VL built in a temporary folder; ``--vlm-size small``
for the ~5M-parameter one), ``dllm`` configs/dllm/toy.yaml, ``dllm_canvas`` configs/dllm/toy_canvas.yaml (the
bundled tiny DiffusionGemma). ``--override`` changes the recipe (``key=value``).

``--json`` writes ``settings`` (``plugin``, ``config``, ``overrides``, ``device``, ``threads``, ``interop_threads``,
``rounds``, ``warmup``, ``torch``, ``cpu``), ``parameters`` (``total``, ``trainable``), ``floor`` (what the floor
runs), ``seconds`` and ``cpu_seconds`` (per item, one value per round), ``median_seconds``, ``floor_parts``
(``generation``, ``forward_backward``, ``optimizer`` medians), ``step_phases`` (the step's own ``rollout``,
``reward``, ``advantage``, ``train`` timers, medians), ``step_over_floor`` (ratio of the medians),
``step_over_floor_rounds``, ``cpu_step_over_floor``, ``step_over_floor_and_extras`` (the step over the floor plus
every measured extra: what the step spends beyond the compute its recipe requires, the KL reference and μ > 1's
old-policy passes included), ``breakdown`` (seconds: ``floor``, each extra,
``rewards_and_advantages``, ``other``), ``identical_steps`` (every timed step sampled the same batch) and, with
``--profile``, ``profile`` (the functions with the most own time in one step under cProfile).

``--plugin`` takes several plugins: each is measured in turn in this process (its own trainer on its default recipe,
built and closed before the next), with the same ``--override``, rounds and threads; each prints its summary, and
the JSON is a list of the plugins' dicts in the order given (one plugin: its dict, as above). Examples::

    python benchmarks/step_floors.py --plugin flow --threads 1 --rounds 9 --warmup 2 --json flow_floor.json
    python benchmarks/step_floors.py --plugin toy flow vlm dllm dllm_canvas --threads 1 --json floors.json
    python benchmarks/step_floors.py --plugin vlm --vlm-size small --threads 1
    # GPU: the same recipes in bf16 (and an SD3.5-Medium-sized transformer with random weights for flow)
    python benchmarks/step_floors.py --plugin flow --device cuda --flow-size sd35-medium --override \\
        run.mixed_precision=bf16 plugin.resolution=512 rollout.batch_size=8 algorithm.micro_batch_size=8 \\
        plugin.transformer_batch_size=8
    # the smallest run (tests/benchmarks/test_smoke.py runs every plugin so: toy alone, the other four in one run)
    python benchmarks/step_floors.py --plugin toy --rounds 1 --warmup 0 --threads 1 --json floor.json
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

RECIPES = {"toy": "configs/toy.yaml", "flow": "configs/flow/shapes.yaml", "vlm": "configs/vlm/toy_grounding.yaml",
           "dllm": "configs/dllm/toy.yaml", "dllm_canvas": "configs/dllm/toy_canvas.yaml"}
EXTRAS = ("reference", "old_logp", "logprob_math")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plugin", nargs="+", choices=sorted(RECIPES), default=["toy"], metavar="PLUGIN",
                        dest="plugins",
                        help=f"One or more of {', '.join(sorted(RECIPES))}, measured in turn in this process.")
    parser.add_argument("--config", default=None,
                        help="Recipe (default: the plugin's, see the module docstring); with one --plugin only.")
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE", help="Recipe overrides.")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--vlm-size", choices=["tiny", "small"], default="tiny", help="vlm: the model built.")
    parser.add_argument("--flow-size", choices=["recipe", "sd35-medium"], default="recipe",
                        help="flow: the recipe's pipeline, or SD3.5-Medium's transformer and VAE with random weights.")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2, help="Untimed training steps (and floors) first.")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's).")
    parser.add_argument("--profile", action="store_true", help="Also profile one step with cProfile.")
    parser.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be at least 1 and --warmup at least 0")
    repeated = sorted({plugin for plugin in args.plugins if args.plugins.count(plugin) > 1})
    if repeated:
        parser.error(f"--plugin names {', '.join(repeated)} more than once; give each plugin once")
    if args.config is not None and len(args.plugins) > 1:
        parser.error(f"--config names one recipe, but --plugin gives {len(args.plugins)} plugins; give one plugin")
    if args.vlm_size != "tiny" and "vlm" not in args.plugins:
        parser.error("--vlm-size is for --plugin vlm")
    if args.flow_size != "recipe" and "flow" not in args.plugins:
        parser.error("--flow-size is for --plugin flow")
    args.plugin = args.plugins[0]  # the plugin build_trainer and run measure; main sets each of args.plugins in turn
    return args


def build_trainer(args: argparse.Namespace, scratch: Path) -> Any:
    """The trainer of the plugin's recipe, writing into ``scratch`` (models built for the run go there too)."""
    from mmrl.config import load_config
    from mmrl.trainer import Trainer

    overrides = [f"run.output_dir={scratch / 'run'}", "run.progress=false", f"run.cpu={args.device == 'cpu'}"]
    if args.plugin == "vlm":
        from mmrl.config.loader import read_yaml
        from mmrl.plugins.vlm.testing import build_tiny_model

        plugin = read_yaml(ROOT / (args.config or RECIPES["vlm"]))["plugin"]
        family = plugin.get("tiny_model") or "qwen2_5_vl"
        folder = build_tiny_model(family, scratch / f"{args.vlm_size}-{family}", size=args.vlm_size)
        overrides.append(f"plugin.model={folder}")
    if args.plugin == "flow" and args.flow_size == "sd35-medium":
        from mmrl.plugins.flow.testing import save_tiny_pipeline

        device = torch.device(args.device)
        with torch.device(device):  # random init of 2.2B parameters is much faster on the GPU
            save_tiny_pipeline("sd3", scratch / "sd35-medium", size="sd35-medium",
                               dtype=torch.bfloat16 if device.type == "cuda" else None)
        overrides.append(f"plugin.model={scratch / 'sd35-medium'}")
    config = load_config(str(ROOT / (args.config or RECIPES[args.plugin])), [*overrides, *args.override])
    return Trainer(config)


def floor_class(plugin: str) -> Any:
    if plugin == "toy":
        from floors.toy import ToyFloor
        return ToyFloor
    if plugin == "flow":
        from floors.flow import FlowFloor
        return FlowFloor
    if plugin == "vlm":
        from floors.vlm import VLMFloor
        return VLMFloor
    if plugin == "dllm_canvas":
        from floors.canvas import CanvasFloor
        return CanvasFloor
    from floors.dllm import DLLMFloor
    return DLLMFloor


class Snapshot:
    """The state a training step changes (trainable weights, optimizer and EMA state, prompt stream, step counters,
    RNG), so that the same step can be run again."""

    def __init__(self, trainer: Any):
        self.parameters = [p.detach().clone() for p in trainer.policy.parameters() if p.requires_grad]
        self.optimizer = copy.deepcopy(trainer.optimizer.state_dict())
        self.ema = None if trainer.ema is None else copy.deepcopy(trainer.ema.state_dict())
        self.stream = copy.deepcopy(trainer.stream.state_dict())
        self.step, self.optimizer_steps = trainer.step, trainer.learner.optimizer_steps
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def restore(self, trainer: Any) -> None:
        with torch.no_grad():
            trainable = [p for p in trainer.policy.parameters() if p.requires_grad]
            for saved, parameter in zip(self.parameters, trainable, strict=True):
                parameter.copy_(saved)
                parameter.grad = None
        trainer.optimizer.load_state_dict(copy.deepcopy(self.optimizer))
        if self.ema is not None:
            trainer.ema.load_state_dict(copy.deepcopy(self.ema))
        trainer.stream.load_state_dict(copy.deepcopy(self.stream))
        trainer.step, trainer.learner.optimizer_steps = self.step, self.optimizer_steps
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


def signature(capture: Any) -> list[Any]:
    """What identifies a step's batch: each rollout call's action mask (shape and active actions)."""
    return [(tuple(call.mask.shape), float(call.mask.sum())) for call in capture.rollouts]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure one plugin: ``args.plugin`` is a single plugin here (``main`` runs each of ``--plugin`` in turn)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="step-floors-") as folder:
        trainer = build_trainer(args, Path(folder))
        try:
            return measure(args, trainer)
        finally:
            trainer.close()


def measure(args: argparse.Namespace, trainer: Any) -> dict[str, Any]:
    from floors import capturing

    device = trainer.accelerator.device
    for _ in range(args.warmup):
        trainer.training_step()
    snapshot = Snapshot(trainer)
    with capturing(trainer) as capture:
        trainer.training_step()
    floor = floor_class(args.plugin)(trainer, capture)
    extras = floor.extras()
    expected = signature(capture)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    records: dict[str, list[dict[str, float]]] = {name: [] for name in ("step", "floor", *extras)}
    identical = True

    def timed(name: str) -> None:
        nonlocal identical
        if name == "step":
            snapshot.restore(trainer)
        synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        if name == "step":
            with capturing(trainer) as again:
                metrics = trainer.training_step()
            details = {f"phase_{key[5:]}": value for key, value in metrics.items() if key.startswith("time/")}
            identical = identical and signature(again) == expected
        elif name == "floor":
            details = {f"part_{key}": value for key, value in floor.run().items()}
        else:
            extras[name]()
            details = {}
        synchronize()
        records[name].append({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, **details})

    names = list(records)
    for _ in range(args.warmup):  # the steps were warmed up above
        for name in names[1:]:
            timed(name)
    for rows in records.values():
        rows.clear()
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            timed(name)
    snapshot.restore(trainer)

    results = summarise(args, trainer, floor, records, identical)
    if args.profile:
        results["profile"] = profile_step(trainer, snapshot)
    return results


def summarise(args: argparse.Namespace, trainer: Any, floor: Any, records: dict[str, list[dict[str, float]]],
              identical: bool) -> dict[str, Any]:
    median = {name: statistics.median(r["wall"] for r in rows) for name, rows in records.items()}
    cpu_median = {name: statistics.median(r["cpu"] for r in rows) for name, rows in records.items()}
    parts = {key[5:]: statistics.median(r[key] for r in records["floor"])
             for key in records["floor"][0] if key.startswith("part_")}
    phases = {key[6:]: statistics.median(r[key] for r in records["step"])
              for key in records["step"][0] if key.startswith("phase_")}
    rewards = phases.get("reward", 0.0) + phases.get("advantage", 0.0)
    breakdown = {"floor": median["floor"], **{name: median[name] for name in EXTRAS if name in median},
                 "rewards_and_advantages": rewards}
    breakdown["other"] = median["step"] - sum(breakdown.values())
    module = trainer.plugin.runtime.unwrap(trainer.policy)
    return {
        "settings": {"plugin": args.plugin, "config": args.config or RECIPES[args.plugin], "overrides": args.override,
                     "device": args.device, "vlm_size": args.vlm_size, "flow_size": args.flow_size,
                     "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
                     "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "rounds": args.rounds,
                     "warmup": args.warmup, "torch": torch.__version__, "cpu": cpu_name()},
        "parameters": {"total": sum(p.numel() for p in module.parameters()),
                       "trainable": sum(p.numel() for p in module.parameters() if p.requires_grad)},
        "floor": {**floor.describe(), "backward_passes": floor.backward_passes(),
                  "optimizer_steps": len(floor.schedule)},
        "seconds": {name: [r["wall"] for r in rows] for name, rows in records.items()},
        "cpu_seconds": {name: [r["cpu"] for r in rows] for name, rows in records.items()},
        "median_seconds": median,
        "floor_parts": parts,
        "step_phases": phases,
        "step_over_floor": median["step"] / median["floor"],
        "step_over_floor_rounds": [s["wall"] / f["wall"] for s, f in zip(records["step"], records["floor"],
                                                                         strict=True)],
        "cpu_step_over_floor": cpu_median["step"] / cpu_median["floor"],
        "step_over_floor_and_extras": median["step"] / (median["floor"] + sum(median[name] for name in EXTRAS
                                                                            if name in median)),
        "breakdown": breakdown,
        "identical_steps": identical,
    }


def profile_step(trainer: Any, snapshot: Snapshot, top: int = 25) -> list[dict[str, Any]]:
    """The ``top`` functions by own time in one (restored) step under cProfile."""
    snapshot.restore(trainer)
    profiler = cProfile.Profile()
    profiler.enable()
    trainer.training_step()
    profiler.disable()
    snapshot.restore(trainer)
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive, own, cumulative, callers)}
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    return [{"function": f"{Path(file).name}:{line}({name})", "calls": calls, "own_seconds": own,
             "cumulative_seconds": cumulative} for (file, line, name), (_, calls, own, cumulative, _) in rows]


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``'s model name where there is one) and its core count."""
    name = platform.processor() or platform.machine()
    info = Path("/proc/cpuinfo")
    if info.is_file():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {os.cpu_count()} logical CPUs"


def table(results: dict[str, Any]) -> str:
    settings, breakdown, parts = results["settings"], results["breakdown"], results["floor_parts"]
    rounds = ", ".join(f"{ratio:.2f}" for ratio in results["step_over_floor_rounds"])
    extras = ", ".join(f"{name} {breakdown[name] * 1e3:.1f} ms" for name in EXTRAS if name in breakdown) or "none"
    return "\n".join([
        f"{settings['plugin']} ({settings['config']}), {settings['device']}, {settings['threads']} thread(s), "
        f"{settings['rounds']} rounds; {settings['cpu']}; torch {settings['torch']}",
        f"step {results['median_seconds']['step'] * 1e3:.1f} ms, floor {results['median_seconds']['floor'] * 1e3:.1f}"
        f" ms: step / floor {results['step_over_floor']:.3f} (rounds {rounds}; CPU time "
        f"{results['cpu_step_over_floor']:.3f}); step / (floor + extras) {results['step_over_floor_and_extras']:.3f}",
        f"floor: generation {parts['generation'] * 1e3:.1f} ms, forward+backward "
        f"{parts['forward_backward'] * 1e3:.1f} ms, optimizer {parts['optimizer'] * 1e3:.1f} ms",
        f"rest: {extras}, rewards and advantages {breakdown['rewards_and_advantages'] * 1e3:.1f} ms, "
        f"other {breakdown['other'] * 1e3:.1f} ms; identical steps: {results['identical_steps']}",
    ])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = []
    for plugin in args.plugins:
        runs.append(run(argparse.Namespace(**{**vars(args), "plugin": plugin})))
        print(table(runs[-1]), flush=True)
    if args.json:  # one plugin: its dict, as before several plugins could be given; several: the list
        args.json.write_text(json.dumps(runs[0] if len(runs) == 1 else runs, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
