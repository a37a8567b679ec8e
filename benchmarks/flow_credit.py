"""The flow plugin's credit strategies against each other at equal compute: reward against wall-clock and against
the number of transformer evaluations.

Every strategy trains the same model from the same initial weights with the same recipe (``--config``, by default
the tiny SD3 CPU recipe ``configs/flow/tiny_sd3.yaml`` with the weight-free JPEG-compressibility reward); only the
``plugin.credit`` section and what it needs change (docs/credit.md):

=================  ===========================================================================================
``step``           the recipe as it is (Flow-GRPO: every step but the last trained)
``chunk``          Chunk-GRPO, chunks over the trained steps, ``ratio_level: chunk``
``branch``         TempFlow-GRPO as released: a branch at every step but the last, 2 samples per step (G = 2·(S−1)),
                   noise-aware weights
``sliding_window`` MixGRPO, a window of 2 steps in steps 0..S−3 moving every ``--steps``/(positions) steps,
                   DPM-Solver++(2M) tail
``tree``           BranchGRPO, a binary tree of G leaves, per-depth advantages (``advantage: grpo``)
``tree_splits``    (optional variant) the same tree with SDE and training at the split steps only
``branch_points``  (optional variant) TempFlow-GRPO at designated branch points, the first 4 (or 2, 1) steps
                   splitting the recipe's group
``chunk_mean``     (optional variant) ``chunk`` with the released code's chunk-mean loss (``weighting: chunk_mean``)
=================  ===========================================================================================

Equal compute: a training step costs ``rollout + 3·train`` transformer row evaluations ("forward equivalents": a
training forward is followed by a backward of about twice its cost; a CFG pass counts once for every strategy alike).
The cheaper strategies get more prompts per step so that every strategy spends about the same per step as ``step`` does
with the recipe's ``prompts_per_step``; the calibration is measured (on a copy of the model, at 4 training steps spread
over the run, averaged: MixGRPO's cost changes as its window moves), not assumed. Each strategy then trains ``--steps``
steps from the same initial weights and seed, and is evaluated every ``--eval-every`` steps with the plain ODE sampler
on the recipe's evaluation prompts (the same prompts and noise for every strategy; the training rewards of ``branch``
and ``tree`` come from their own samplers and are not comparable). Wall-clock counts the training steps only
(evaluations excluded).

Writes ``results.json`` and, when matplotlib is installed (``pip install matplotlib``), ``flow_credit.png`` into
``--out``. ``results.json`` holds ``args`` (the arguments as strings), ``calibration`` (forward equivalents per prompt
of each calibrated strategy; empty under ``--equal-compute off``), ``rows`` (one summary per strategy, the table's
columns), ``records`` (per strategy and seed: ``prompts_per_step``, every training step's clock and cost, every
evaluation's reward), ``matplotlib`` (its version, null without a plot), ``torch`` and ``threads``. Examples
(docs/performance.md gives the exact commands behind its tables)::

    python benchmarks/flow_credit.py --steps 24 --eval-every 4 --seeds 0 1 --threads 1
    # the smallest run (what tests/benchmarks/test_smoke.py does): every strategy, calibrated, one step each
    python benchmarks/flow_credit.py --strategies step chunk branch sliding_window tree tree_splits --steps 1 \
        --eval-every 1 --eval-samples 1 --threads 1 --out out
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

STRATEGIES = ("step", "chunk", "branch", "sliding_window", "tree")
# tree with SDE (and training) at the split steps only; branch at a few points; chunk with GCPO's chunk-mean loss
VARIANTS = ("tree_splits", "branch_points", "chunk_mean")
TRAIN_COST = 3  # a training forward plus its backward, in forward evaluations
CALIBRATION_POINTS = 4  # training steps each strategy's cost is measured at


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "flow" / "tiny_sd3.yaml",
                        help="The base recipe (its plugin.model folder is built with the tiny SD3 if missing).")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES + VARIANTS)
    parser.add_argument("--steps", type=int, default=24, help="Training steps per strategy.")
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--eval-samples", type=int, default=4, help="Samples per evaluation prompt.")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="Run seeds (each strategy runs each).")
    parser.add_argument("--minibatches", type=int, default=2,
                        help="Optimizer steps per rollout for every strategy (Flow-GRPO: 2); with 1 the data is always "
                        "on policy and chunk-level ratios give exactly the step-level gradient.")
    parser.add_argument("--equal-compute", choices=["on", "off"], default="on",
                        help="Scale prompts per step to the cost of 'step' (off: the recipe's prompts per step).")
    parser.add_argument("--tree-advantage", default="grpo",
                        help="Advantage estimator of 'tree' (grpo: BranchGRPO's per-depth z-score).")
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="Config overrides applied to the base recipe for every strategy (e.g. optim.lr=0.01).")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads.")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "flow_credit")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, metavar="RESULTS_JSON",
                        help="Train nothing: write the table and plot of the records of these results.json files "
                        "(runs of different seeds made in parallel, one process each) into --out.")
    return parser.parse_args(argv)


def strategy_overrides(name: str, config: dict[str, Any], steps: int, tree_advantage: str = "grpo") -> None:
    """Turn the base recipe (a dict) into the recipe of strategy ``name`` (in place)."""
    plugin, rollout, algorithm = config["plugin"], config.setdefault("rollout", {}), config.setdefault("algorithm", {})
    num_steps = int(plugin.get("num_steps", 10))
    group = int(rollout.get("group_size", 8))
    fraction = float(plugin.get("timestep_fraction", 0.99))
    if name == "step":
        credit: dict[str, Any] = {"strategy": "step"}
    elif name in ("chunk", "chunk_mean"):
        # The steps plugin.train_steps trains: the window of Flow-GRPO-Fast recipes, else the first fraction.
        trained = int(plugin.get("window_size", 3)) if plugin.get("train_steps") == "window" \
            else int(num_steps * fraction)
        sizes = [1] + [2] * ((trained - 1) // 2) + ([1] if (trained - 1) % 2 else [])  # small chunks at high noise
        credit = {"strategy": "chunk", "chunk": {"sizes": sizes,
                                                 "weighting": "chunk_mean" if name == "chunk_mean" else "step"}}
        policy = algorithm.get("policy_loss", "grpo")
        algorithm["policy_loss"] = {**({"name": policy} if isinstance(policy, str) else policy), "ratio_level": "chunk"}
        algorithm["action_chunk_size"] = None
    elif name == "branch":  # the released method: a branch at every step 0..S−2, K = 2 samples each
        rollout["group_size"] = max(2, group // (num_steps - 1)) * (num_steps - 1)
        credit = {"strategy": "branch", "branch": {"points": None}, "noise_weighting": True}
    elif name == "branch_points":  # designated branch points: the first steps split the recipe's group
        count = next(c for c in (4, 2, 1) if group % c == 0 and group // c >= 2 and c < num_steps)
        credit = {"strategy": "branch", "branch": {"points": list(range(count))}, "noise_weighting": True}
    elif name == "sliding_window":
        size = 2
        positions = (num_steps - 2) - size + 1  # the default window range, MixGRPO's [0, S − 2)
        credit = {"strategy": "sliding_window", "sliding_window": {
            "size": size, "shift_every": max(1, math.ceil(steps / positions)), "solver": "dpm2m", "solver_steps": 0.5}}
    elif name in ("tree", "tree_splits"):
        depth = round(math.log2(group))
        if 2**depth != group:
            raise ValueError(f"tree needs a power-of-two group size, the recipe has {group}")
        splits = [min(2 * i, num_steps - 2) for i in range(depth)]
        credit = {"strategy": "tree", "tree": {"split_points": sorted(set(splits)), "branching": 2,
                                               "sde_steps": "splits" if name == "tree_splits" else "all"}}
        algorithm["advantage"] = tree_advantage
    else:
        raise ValueError(name)
    plugin["credit"] = credit
    if name in ("branch", "branch_points", "tree", "tree_splits"):
        rollout["layout"] = "contiguous"
        batch = rollout.get("batch_size")
        group = int(rollout.get("group_size", 8))
        if batch is not None and batch % group:
            rollout["batch_size"] = group


def build_config(base: dict[str, Any], name: str, *, steps: int, seed: int, prompts: int | None, out: Path,
                 eval_samples: int, minibatches: int, tree_advantage: str = "grpo") -> Any:
    from mmrl.config import load_config

    config = copy.deepcopy(base)
    strategy_overrides(name, config, steps, tree_advantage)
    config["algorithm"]["minibatches"] = minibatches
    run = config.setdefault("run", {})
    run.update({"output_dir": str(out), "max_steps": steps, "seed": seed, "progress": False, "save_every": 0,
                "cpu": True})
    config["eval"] = {"every": 0, "at_start": False, "save_samples": False, "samples_per_prompt": eval_samples}
    if prompts is not None:
        config["rollout"]["prompts_per_step"] = prompts
    return load_config(config)


#: The pipeline folder configs/flow/tiny_sd3.yaml names; the recipe's header builds it with
#: ``python -m mmrl.plugins.flow.testing sd3 runs/tiny-sd3-pipeline``.
TINY_RECIPE_MODEL = Path("runs/tiny-sd3-pipeline")


def ensure_pipeline(base: dict[str, Any], scratch: Path) -> None:
    """Point ``plugin.model`` at an existing pipeline folder. Only the tiny recipe's own folder may be missing: the
    same tiny SD3 is then built under ``scratch`` (and the substitution printed); any other missing model is an
    error, so a benchmark never measures a model other than the one its config names."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    named = Path(base["plugin"]["model"])
    model = named if named.is_absolute() else ROOT / named
    if (model / "model_index.json").is_file():
        base["plugin"]["model"] = str(model)
        return
    if model.resolve() != (ROOT / TINY_RECIPE_MODEL).resolve():
        raise SystemExit(f"flow_credit.py: plugin.model {named} is not a diffusers pipeline folder (no "
                         "model_index.json); build or download it first")
    built = scratch / "tiny-sd3-pipeline"
    if not (built / "model_index.json").is_file():
        save_tiny_pipeline("sd3", built)
    print(f"flow_credit.py: {named} is not built; using the same tiny SD3 built in {built}")
    base["plugin"]["model"] = str(built)


def calibration_steps(steps: int, points: int = CALIBRATION_POINTS) -> list[int]:
    """The training steps a strategy's cost is measured at: ``points`` spread evenly over a run of ``steps``."""
    count = max(1, min(points, steps))
    return sorted({i * steps // count for i in range(count)})


def calibrate(base: dict[str, Any], name: str, scratch: Path, eval_samples: int, steps: int = 1) -> float:
    """Forward equivalents per prompt of one training step of ``name``: the mean over training steps spread over a run
    of ``steps`` (:func:`calibration_steps`), since a strategy's cost may depend on the step (MixGRPO's window moves
    on, and the DPM-Solver tail after it shortens or lengthens)."""
    from mmrl.trainer import Trainer

    config = build_config(base, name, steps=steps, seed=12345, prompts=None, out=scratch / f"calibrate-{name}",
                          eval_samples=eval_samples, minibatches=1)
    trainer = Trainer(config)
    costs = []
    for step in calibration_steps(steps):
        trainer.step = step  # what the credit strategy reads (PromptBatch.step)
        before = dict(trainer.plugin.model_evaluations)
        trainer.training_step()
        costs.append(_cost(trainer.plugin.model_evaluations, before))
    trainer.scorer.close()
    return statistics.mean(costs) / config.rollout.prompts_per_step


def _cost(after: dict[str, int], before: dict[str, int]) -> float:
    return (after["rollout"] - before["rollout"]) + TRAIN_COST * (after["forward"] - before["forward"])


def train_one(base: dict[str, Any], name: str, seed: int, prompts: int | None, args: argparse.Namespace,
              out: Path) -> dict[str, Any]:
    from mmrl.trainer import Trainer

    config = build_config(base, name, steps=args.steps, seed=seed, prompts=prompts, out=out,
                          eval_samples=args.eval_samples, minibatches=args.minibatches,
                          tree_advantage=args.tree_advantage)
    trainer = Trainer(config)
    plugin = trainer.plugin
    record: dict[str, Any] = {"strategy": name, "seed": seed, "prompts_per_step": config.rollout.prompts_per_step,
                              "steps": [], "evals": []}
    clock = evaluations = forward_equivalents = 0.0

    def evaluate(step: int) -> None:
        metrics = trainer.evaluate()
        record["evals"].append({"step": step, "seconds": clock, "evaluations": evaluations,
                                "forward_equivalents": forward_equivalents,
                                "reward": metrics["eval/reward_mean"]})

    evaluate(0)
    for step in range(1, args.steps + 1):
        before = dict(plugin.model_evaluations)
        started = time.perf_counter()
        metrics = trainer.training_step()
        trainer.step += 1
        clock += time.perf_counter() - started
        evaluations += (plugin.model_evaluations["rollout"] - before["rollout"]
                        + plugin.model_evaluations["forward"] - before["forward"])
        forward_equivalents += _cost(plugin.model_evaluations, before)
        record["steps"].append({"step": step, "seconds": clock, "evaluations": evaluations,
                                "forward_equivalents": forward_equivalents,
                                "train_reward": metrics.get("reward/mean"),
                                "ratio_deviation": metrics.get("loss/first_step_ratio_deviation")})
        if step % args.eval_every == 0 or step == args.steps:
            evaluate(step)
    trainer.scorer.close()
    return record


def summarise(records: list[dict[str, Any]], strategies: list[str]) -> list[dict[str, Any]]:
    rows = []
    for name in strategies:
        runs = [r for r in records if r["strategy"] == name]
        finals = [r["evals"][-1]["reward"] for r in runs]
        gains = [r["evals"][-1]["reward"] - r["evals"][0]["reward"] for r in runs]
        best = [max(e["reward"] for e in r["evals"][1:]) - r["evals"][0]["reward"] for r in runs]
        steps = len(runs[0]["steps"])
        rows.append({
            "strategy": name,
            "prompts_per_step": runs[0]["prompts_per_step"],
            "evaluations_per_step": statistics.mean(r["steps"][-1]["evaluations"] / steps for r in runs),
            "forward_equivalents_per_step": statistics.mean(r["steps"][-1]["forward_equivalents"] / steps
                                                            for r in runs),
            "seconds_per_step": statistics.mean(r["steps"][-1]["seconds"] / steps for r in runs),
            "start_reward": statistics.mean(r["evals"][0]["reward"] for r in runs),
            "final_reward": statistics.mean(finals),
            "gain": statistics.mean(gains),
            "gain_min": min(gains),
            "gain_max": max(gains),
            "best_gain": statistics.mean(best),
            "max_ratio_deviation": max(s["ratio_deviation"] or 0.0 for r in runs for s in r["steps"]),
        })
    return rows


BYTES = 500_000  # jpeg_compressibility = −bytes / 500 000: a reward gain of 2e-6 is one JPEG byte saved per image


def reward_names(base: dict[str, Any]) -> list[str]:
    """The names of a recipe's reward functions (entries are names or ``{name: ..., ...}``)."""
    return [str(f.get("name") if isinstance(f, dict) else f) for f in base.get("rewards", {}).get("functions", [])]


def reward_unit(base: dict[str, Any]) -> tuple[str, float, int]:
    """How the table reports reward gains: (unit, scale, decimals). JPEG compressibility in bytes per image (its raw
    values are tiny), any other reward as it is."""
    if reward_names(base) == ["jpeg_compressibility"]:
        return "bytes/image", BYTES, 1
    return "reward", 1.0, 3


def markdown_table(rows: list[dict[str, Any]], seeds: int, unit: tuple[str, float, int] = ("bytes/image", BYTES, 1)
                   ) -> str:
    name, scale, digits = unit
    raw = 6 if name == "bytes/image" else 3
    lines = [
        "| strategy | prompts/step | transformer evals/step | forward-equivalents/step | s/step | eval reward at "
        f"start | final eval reward | final gain, {name} (mean of {seeds} seed(s) [min, max]) | best gain, "
        f"{name} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        gain, low, high, best = (f"{scale * row[key]:+.{digits}f}" for key in ("gain", "gain_min", "gain_max",
                                                                                "best_gain"))
        lines.append(
            f"| {row['strategy']} | {row['prompts_per_step']} | {row['evaluations_per_step']:.0f} | "
            f"{row['forward_equivalents_per_step']:.0f} | {row['seconds_per_step']:.2f} | "
            f"{row['start_reward']:.{raw}f} | {row['final_reward']:.{raw}f} | {gain} [{low}, {high}] | {best} |"
        )
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], strategies: list[str], path: Path, title: str, ylabel: str) -> str | None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for name in strategies:
        runs = [r for r in records if r["strategy"] == name]
        count = min(len(r["evals"]) for r in runs)
        reward = [statistics.mean(r["evals"][i]["reward"] for r in runs) for i in range(count)]
        seconds = [statistics.mean(r["evals"][i]["seconds"] for r in runs) for i in range(count)]
        work = [statistics.mean(r["evals"][i]["forward_equivalents"] for r in runs) for i in range(count)]
        axes[0].plot(seconds, reward, marker="o", label=name)
        axes[1].plot(work, reward, marker="o", label=name)
    axes[0].set_xlabel("training wall-clock (s)")
    axes[1].set_xlabel("transformer forward-equivalents (rollout + 3 x train)")
    axes[0].set_ylabel(ylabel)
    axes[1].legend()
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return matplotlib.__version__


def merge(args: argparse.Namespace) -> int:
    """``--merge``: one table and plot from the records of several results.json files (same strategies and recipe)."""
    from mmrl.config.loader import read_yaml

    results = [json.loads(Path(path).read_text()) for path in args.merge]
    strategies = [row["strategy"] for row in results[0]["rows"]]
    configs = {result["args"]["config"] for result in results}
    if len(configs) != 1 or any([row["strategy"] for row in r["rows"]] != strategies for r in results):
        raise SystemExit(f"--merge: the files must share one recipe and strategy list; got recipes {sorted(configs)}")
    records = [record for result in results for record in result["records"]]
    seeds = sorted({record["seed"] for record in records})
    args.config = Path(configs.pop())
    base = read_yaml(args.config)
    return _write_results(args, base, records, strategies, seeds, results[0]["calibration"])


def _write_results(args: argparse.Namespace, base: dict[str, Any], records: list[dict[str, Any]],
                   strategies: list[str], seeds: list[int], calibration: dict[str, float]) -> int:
    rows = summarise(records, strategies)
    unit = reward_unit(base)
    table = markdown_table(rows, len(seeds), unit)
    rewards = ", ".join(reward_names(base))
    title = f"Flow credit strategies, {Path(str(args.config)).stem} ({len(seeds)} seed(s))"
    args.out.mkdir(parents=True, exist_ok=True)
    version = plot(records, strategies, args.out / "flow_credit.png", title, f"eval reward ({rewards})")
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "calibration": calibration, "rows": rows,
              "records": records, "matplotlib": version, "torch": torch.__version__,
              "threads": torch.get_num_threads()}
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    print(table)
    print(f"wrote {args.out / 'results.json'}" + (f" and {args.out / 'flow_credit.png'}" if version else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        return merge(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    from mmrl.config.loader import apply_overrides, read_yaml

    args.out.mkdir(parents=True, exist_ok=True)
    base = read_yaml(args.config)
    # One rollout call per step and no fixed transformer batches, for every strategy: the shared-prefix engine batches
    # the nodes of all groups of a call together, and fixed batches would pad its small trunk batches.
    apply_overrides(base, ["rollout.batch_size=null", "plugin.transformer_batch_size=null", *args.override])
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        ensure_pipeline(base, args.out)
        prompts: dict[str, int | None] = {name: None for name in args.strategies}
        calibration: dict[str, float] = {}
        if args.equal_compute == "on":
            for name in sorted(set(args.strategies) | {"step"}):
                calibration[name] = calibrate(base, name, scratch, args.eval_samples, args.steps)
                print(f"calibration: {name} costs {calibration[name]:.0f} forward-equivalents per prompt", flush=True)
            target = calibration["step"] * int(base.get("rollout", {}).get("prompts_per_step", 16))
            for name in args.strategies:
                prompts[name] = max(1, round(target / calibration[name]))
        records = []
        for seed in args.seeds:
            for name in args.strategies:
                started = time.perf_counter()
                records.append(train_one(base, name, seed, prompts[name], args, scratch / f"{name}-{seed}"))
                print(f"{name} seed {seed}: {time.perf_counter() - started:.0f} s, eval rewards "
                      f"{[round(e['reward'], 4) for e in records[-1]['evals']]}", flush=True)
    return _write_results(args, base, records, args.strategies, args.seeds, calibration)


if __name__ == "__main__":
    raise SystemExit(main())
