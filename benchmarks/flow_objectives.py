"""The flow plugin's training objectives against each other at equal compute: held-out score against the number of
transformer evaluations and against wall-clock.

Every objective trains the same model from the same initial weights, seed and evaluation noise with the same recipe
(``--config``, by default the shapes world's main job ``configs/flow/shapes.yaml``, docs/shapes.md); only what the
objective needs changes, as in the commands of docs/shapes.md ("Forward-process objectives"):

=============  =========================================================================================================
``flow_grpo``  the recipe as it is (Flow-GRPO: SDE log-probs, the pinned 3-step window, two optimizer steps a rollout)
``awm``        Advantage Weighted Matching (``plugin.likelihood: matching``, docs/flow.md section 16): ODE rollouts,
               K = 4 discrete times, ``ghuber``, advantages × 0.2, EMA KL 1, velocity KL 1e-4, clip range 1
``nft``        DiffusionNFT (``plugin.likelihood: nft``, section 17): rollouts by the old policy with DPM-Solver++(2M),
               K = 5 of the 10 grid times, β = 1, decay type 1, no KL
``dgpo``       DGPO (``plugin.likelihood: dgpo``, section 18): ODE rollouts, M = 4 of the grid steps 0..6, the
               released PickScore recipe's β_DPO 10, clip range 0.05 against the fast EMA (rollouts by it after step
               200) and velocity KL 1e-3; one optimizer step per step, whole groups per micro-batch (32 = 4 groups)
=============  =========================================================================================================

The objectives are the table :data:`OBJECTIVES`: a new one (a ``plugin.likelihood`` value and its registered policy
loss) is one :class:`Objective` entry there.

**Cost, measured.** A forward hook on the transformer counts every call and its rows (one row = one sample's velocity;
a CFG call on ``[uncond; cond]`` counts its 2n rows), split by whether the call's output carries a graph. A call with a
graph is a training forward, followed by its backward (about twice a forward): it costs 3 forward-equivalents per row;
every other call (rollout steps, the old policy's, the EMA's and the reference's velocities, which all run under
``torch.no_grad``) costs 1. Rows the sampler pads to ``plugin.transformer_batch_size`` are evaluated and counted. This
is flow_credit.py's "rollout + 3 × train" unit, with the no-grad forwards of the training phase (which flow_credit's
sampler counter puts with the trained ones) counted once, as the released code runs them: AWM's reference and EMA
forwards under ``torch.no_grad`` beside each time's training forward (scxue/advantage_weighted_matching be51372,
``advantage_weighted_matching/scripts/train_sd3_awm.py`` L1271-1280), DiffusionNFT's old-policy forward under
``torch.no_grad`` before it (NVlabs/DiffusionNFT 24af555, ``scripts/train_nft_sd3.py`` L873-883; upstream also runs
its LoRA-off reference forward there whatever its KL weight, L894-905, which mmrl skips when ``algorithm.kl_coef`` is
0), DGPO's reference (LoRA off) and fast-EMA forwards under ``torch.no_grad`` before each time's training forward
(Luo-Yihong/DGPO 01ceb4b, ``scripts/train_sd3_dgpo.py`` L1110-1120; mmrl scores the EMA's in the rollout, as
docs/flow.md section 18 says, which the hook counts the same). The evaluation's calls are not training compute and are
left out.

**Equal compute.** ``--budget`` is in steps of the reference objective (``flow_grpo``): each objective's cost per
step is measured first on one training step of a throwaway trainer (the reference objective's too, whether or not it is
trained), and each objective then trains ``round(budget × cost(flow_grpo) / cost(objective))`` steps (its cosine
schedule over those), from the same initial weights and seed, evaluated at the fractions 0, 1/P, …, 1 of its steps
(``--eval-points`` P) with the recipe's held-out evaluation (the same prompts and noise for every objective). The
cost of every training step is measured again during the run and recorded, so the forward-equivalents at each
evaluation are the counted ones, not the calibration's. Wall-clock counts the training steps only (evaluations
excluded); the objectives of a seed run back to back in one process on ``--threads`` threads.

Writes ``results.json`` and, when matplotlib is installed (``pip install matplotlib``), ``flow_objectives.png`` into
``--out``. ``results.json`` holds ``args`` (the arguments as strings), ``objectives`` (the :data:`OBJECTIVES`
entries run, with every override applied), ``calibration`` (per objective the measured
counts of one training step: ``grad_calls``, ``grad_rows``, ``no_grad_calls``, ``no_grad_rows``, ``sampler_rows``
(the flow sampler's own row counter, a cross-check: equal to the hook's rows without CFG and padding) and
``forward_equivalents``), ``budget`` (``reference``, ``steps``, ``forward_equivalents`` and ``objective_steps``),
``rows`` (one summary per objective, the table's columns, and the ``seeds`` it averages), ``records`` (per
objective and seed: ``steps_trained``, every training step's clock and counts, every evaluation's score),
``matplotlib`` (its version, null without a plot), ``torch`` and ``threads``.
Examples (docs/performance.md gives the exact commands behind its table)::

    python benchmarks/flow_objectives.py --budget 100 --eval-points 4 --seeds 0 --threads 1
    # the smallest run (what tests/benchmarks/test_smoke.py does): every objective, one step each
    python benchmarks/flow_objectives.py --budget 1 --eval-points 1 --eval-samples 1 --threads 1 --out out \\
        --override rollout.prompts_per_step=2 plugin.transformer_batch_size=8 eval.num_prompts=1
    # an objective added later, at the first example's setting, then one table of both runs
    python benchmarks/flow_objectives.py --objectives dgpo --budget 100 --eval-points 4 --seeds 0 --threads 1 \\
        --out out_dgpo
    python benchmarks/flow_objectives.py --merge runs/bench/flow_objectives/results.json out_dgpo/results.json \\
        --out merged
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from flow_credit import ensure_pipeline  # noqa: E402  (benchmarks/ is on the path above)

TRAIN_COST = 3  # a training forward plus its backward, in forward evaluations (as flow_credit.py)
COUNTS = ("grad_calls", "grad_rows", "no_grad_calls", "no_grad_rows")


class Objective(NamedTuple):
    """One training objective of the flow plugin, as overrides of the base recipe (a NamedTuple: the script is also
    loaded as a bare module, which dataclasses' annotation lookup cannot resolve).

    Args:
        label: The name in the table and the plot.
        likelihood: ``plugin.likelihood`` (``sde`` for the SDE log-probs of Flow-GRPO and its relatives).
        policy_loss: ``algorithm.policy_loss`` as a YAML flow mapping, or None for the recipe's.
        overrides: Further ``KEY=VALUE`` overrides of the recipe (``mmrl train`` syntax) the objective needs.
        source: Where the settings come from.
    """

    label: str
    likelihood: str
    policy_loss: str | None = None
    overrides: tuple[str, ...] = ()
    source: str = ""

    def all_overrides(self) -> list[str]:
        """The overrides that turn the base recipe into this objective's, in the order they are applied."""
        loss = [] if self.policy_loss is None else [f"algorithm.policy_loss={self.policy_loss}"]
        return [f"plugin.likelihood={self.likelihood}", *loss, *self.overrides]


#: The objectives, by the name ``--objectives`` takes. The settings are docs/shapes.md's commands ("Forward-process
#: objectives"), which the 5-seed equal-steps tables there were run with (DGPO's: its author's single shapes run,
#: with the released PickScore recipe's β_DPO and clip range, docs/performance.md). A new objective is one entry: its
#: ``plugin.likelihood`` value, its registered policy loss and its settings, as the ``dgpo`` entry was added.
OBJECTIVES: dict[str, Objective] = {
    "flow_grpo": Objective("Flow-GRPO (the recipe)", "sde", source="configs/flow/shapes.yaml as it is"),
    "awm": Objective(
        "AWM", "matching", "{name: grpo, clip_low: 0.9999, clip_high: 1.0}",
        ("plugin.train_steps=fraction", "plugin.timestep_fraction=0.9", "plugin.share_initial_noise=false",
         "plugin.matching={num_times: 4, time_sampler: discrete, weighting: ghuber, advantage_scale: 0.2, "
         "ema_kl_coef: 1.0}",
         "algorithm.minibatches=1", "algorithm.kl_coef=1.0e-4"),
        source="docs/shapes.md, Forward-process objectives (docs/flow.md section 16)"),
    "nft": Objective(
        "DiffusionNFT", "nft", "{name: nft, adv_clip_max: 5.0}",
        ("plugin.train_steps=fraction", "plugin.timestep_fraction=0.5", "plugin.share_initial_noise=false",
         "plugin.nft={beta: 1.0, decay_type: 1}", "algorithm.minibatches=1", "algorithm.kl_coef=0"),
        source="docs/shapes.md, Forward-process objectives (docs/flow.md section 17)"),
    "dgpo": Objective(
        "DGPO", "dgpo", "{name: dgpo, beta_dpo: 10.0, clip_range: 0.05}",
        ("plugin.train_steps=fraction", "plugin.share_initial_noise=false",
         "plugin.dgpo={num_times: 4, trunc_steps: 6, ema_ref: true, switch_ema_ref: 200}",
         "algorithm.kl_coef=1.0e-3", "algorithm.minibatches=1", "rollout.layout=contiguous"),
        source="docs/flow.md section 18; beta_dpo 10, clip_range 0.05, kl_coef 1e-3, 4 of the grid steps 0..6, "
        "fast-EMA reference switched in at step 200: the released PickScore recipe's (Luo-Yihong/DGPO 01ceb4b, "
        "config/dgpo.py; configs/flow/sd35_dgpo_pickscore.yaml)"),
}
REFERENCE = "flow_grpo"  # --budget counts steps of this objective
CALIBRATION_SEED = 12345  # the throwaway trainer that measures a step's cost (as flow_credit.py)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed: a whole number >= 1")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "flow" / "shapes.yaml",
                        help="The base recipe, the reference objective's as it is.")
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=list(OBJECTIVES))
    parser.add_argument("--budget", type=positive_int, default=100,
                        help=f"Training compute per objective, in training steps of {REFERENCE!r} (its measured "
                        "forward-equivalents per step times this).")
    parser.add_argument("--eval-points", type=positive_int, default=4,
                        help="Evaluate at the budget fractions 0, 1/P, ..., 1 (P = this).")
    parser.add_argument("--eval-samples", type=positive_int, default=None,
                        help="Samples per held-out prompt (default: the recipe's eval.samples_per_prompt).")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="Run seeds (each objective runs each).")
    parser.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="Config overrides applied to the base recipe before every objective's own.")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads.")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "flow_objectives")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, metavar="RESULTS_JSON",
                        help="Train nothing: write the table and plot of the records of these results.json files "
                        "(runs of different seeds or --objectives at one setting, one process each) into --out.")
    args = parser.parse_args(argv)
    if len(set(args.objectives)) != len(args.objectives):
        parser.error(f"--objectives names an objective twice ({' '.join(args.objectives)}); name each once")
    return args


# ------------------------------------------------------------------------------------------------ counting


def _first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor of a module's output (a tensor, a tuple such as diffusers' ``return_dict=False``, or a
    ``ModelOutput``)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for t in (_first_tensor(v) for v in value) if t is not None), None)
    if isinstance(value, dict):
        return next((t for t in (_first_tensor(v) for v in value.values()) if t is not None), None)
    return None


class TransformerCounter:
    """Counts the calls of the given modules and their rows (the first dimension of ``hidden_states``, or of the
    first positional tensor), split by whether the output carries a graph (``requires_grad``: a backward will run
    through it) or not.

    Use as a context manager; :attr:`counts` keeps counting across uses, read differences around the work measured.
    """

    def __init__(self, modules: list[nn.Module]):
        unique = {id(m): m for m in modules}
        self.modules = list(unique.values())
        self.counts = {key: 0 for key in COUNTS}
        self._handles: list[Any] = []

    def _hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"flow_objectives.py: a call of {type(module).__name__} without a hidden_states tensor "
                            "to count rows of")
        first = _first_tensor(output)
        if first is None:
            raise TypeError(f"flow_objectives.py: {type(module).__name__} returned no tensor")
        kind = "grad" if first.requires_grad else "no_grad"
        self.counts[f"{kind}_calls"] += 1
        self.counts[f"{kind}_rows"] += int(hidden.shape[0])

    def __enter__(self) -> TransformerCounter:
        self._handles = [m.register_forward_hook(self._hook, with_kwargs=True) for m in self.modules]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)


def difference(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in after}


def sampler_rows(trainer: Any) -> int:
    """The flow sampler's own count of training rows so far (its ``rollout`` and ``forward`` phases; a CFG pass
    once, padding not counted): a cross-check of the hook's rows, equal to them without CFG and padding."""
    evaluations = trainer.plugin.model_evaluations
    return int(evaluations["rollout"] + evaluations["forward"])


def forward_equivalents(counts: dict[str, int]) -> int:
    """Rows without a graph once, rows with one (forward + backward) :data:`TRAIN_COST` times."""
    return counts["no_grad_rows"] + TRAIN_COST * counts["grad_rows"]


def counted_modules(trainer: Any) -> list[nn.Module]:
    """The transformer(s) a flow trainer calls: the trained one (LoRA in place: its reference, EMA and old policy are
    the same module with the adapter off or other weights swapped in), and full fine-tuning's frozen reference copy."""
    plugin = trainer.plugin
    modules = [trainer.runtime.unwrap(trainer.policy)]
    reference = plugin.reference_module() if hasattr(plugin, "reference_module") else None
    if reference is not None:
        modules.append(reference)
    return modules


# ------------------------------------------------------------------------------------------------ configs


def objective_config(base: dict[str, Any], name: str) -> dict[str, Any]:
    """The recipe of objective ``name``: a new dict, the objective's overrides applied to ``base``."""
    from mmrl.config.loader import apply_overrides

    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; allowed: {', '.join(OBJECTIVES)}")
    return apply_overrides(copy.deepcopy(base), OBJECTIVES[name].all_overrides())


def build_config(base: dict[str, Any], name: str, *, steps: int, seed: int, out: Path,
                 eval_samples: int | None) -> Any:
    from mmrl.config import load_config

    config = objective_config(base, name)
    run = config.setdefault("run", {})
    run.update({"output_dir": str(out), "max_steps": steps, "seed": seed, "progress": False, "save_every": 0,
                "cpu": True})
    evaluation = config.setdefault("eval", {})
    evaluation.update({"every": 0, "at_start": False, "save_samples": False})
    if eval_samples is not None:
        evaluation["samples_per_prompt"] = eval_samples
    return load_config(config)


def calibrate(base: dict[str, Any], name: str, scratch: Path, eval_samples: int | None) -> dict[str, int]:
    """The counts of one training step of ``name`` on a throwaway trainer (its first step: these objectives cost the
    same at every step, which the run's own per-step counts then show)."""
    from mmrl.trainer import Trainer

    config = build_config(base, name, steps=1, seed=CALIBRATION_SEED, out=scratch / f"calibrate-{name}",
                          eval_samples=eval_samples)
    trainer = Trainer(config)
    sampler_before = sampler_rows(trainer)
    with TransformerCounter(counted_modules(trainer)) as counter:
        trainer.training_step()
        counts = counter.snapshot()
    counts["sampler_rows"] = sampler_rows(trainer) - sampler_before
    trainer.scorer.close()
    trainer.eval_scorer.close()
    return {**counts, "forward_equivalents": forward_equivalents(counts)}


def steps_for(budget_fe: float, cost: float) -> int:
    """Training steps of an objective of ``cost`` forward-equivalents per step within ``budget_fe``."""
    return max(1, round(budget_fe / cost))


def eval_steps(steps: int, points: int) -> list[int]:
    """The steps at the fractions 0, 1/points, ..., 1 of ``steps`` (rounded; repeats dropped)."""
    return sorted({round(j * steps / points) for j in range(points + 1)})


# ------------------------------------------------------------------------------------------------ training


def train_one(base: dict[str, Any], name: str, seed: int, steps: int, args: argparse.Namespace, out: Path
              ) -> dict[str, Any]:
    from mmrl.trainer import Trainer

    config = build_config(base, name, steps=steps, seed=seed, out=out, eval_samples=args.eval_samples)
    trainer = Trainer(config)
    record: dict[str, Any] = {"objective": name, "seed": seed, "steps_trained": steps, "steps": [], "evals": [],
                              "load_average": [os.getloadavg()[0]]}  # the machine's 1-minute load, start and end
    totals = {key: 0 for key in COUNTS}
    clock = 0.0
    fe = 0
    due = set(eval_steps(steps, args.eval_points))

    def evaluate(step: int) -> None:
        metrics = trainer.evaluate()
        record["evals"].append({"step": step, "seconds": clock, "forward_equivalents": fe,
                                "score": metrics["eval/reward_mean"]})

    with TransformerCounter(counted_modules(trainer)) as counter:
        evaluate(0)
        for step in range(1, steps + 1):
            before, sampler_before = counter.snapshot(), sampler_rows(trainer)
            started = time.perf_counter()
            metrics = trainer.training_step()
            trainer.step += 1
            seconds = time.perf_counter() - started
            counts = difference(counter.snapshot(), before)
            sampled = sampler_rows(trainer) - sampler_before
            clock += seconds
            fe += forward_equivalents(counts)
            for key in COUNTS:
                totals[key] += counts[key]
            record["steps"].append({"step": step, "seconds": clock, "step_seconds": seconds, **counts,
                                    "sampler_rows": sampled,
                                    "forward_equivalents": fe, "train_reward": metrics.get("reward/mean")})
            if step in due:  # its calls fall between two steps' counts: not training compute
                evaluate(step)
    record["totals"] = totals
    record["load_average"].append(os.getloadavg()[0])
    trainer.scorer.close()
    trainer.eval_scorer.close()
    return record


# ------------------------------------------------------------------------------------------------ reporting


def summarise(records: list[dict[str, Any]], objectives: list[str], points: int) -> list[dict[str, Any]]:
    rows = []
    for name in objectives:
        runs = [r for r in records if r["objective"] == name]
        if not runs:
            raise ValueError(f"no records of objective {name!r}")
        per_step = [s["forward_equivalents"] - (r["steps"][i - 1]["forward_equivalents"] if i else 0)
                    for r in runs for i, s in enumerate(r["steps"])]
        count = min(len(r["evals"]) for r in runs)
        scores = [[r["evals"][i]["score"] for r in runs] for i in range(count)]
        gains = [r["evals"][-1]["score"] - r["evals"][0]["score"] for r in runs]
        steps = [len(r["steps"]) for r in runs]
        rows.append({
            "objective": name,
            "label": OBJECTIVES[name].label if name in OBJECTIVES else name,
            "seeds": sorted(r["seed"] for r in runs),
            "steps": statistics.mean(steps),
            "forward_equivalents_per_step": statistics.mean(per_step),
            "forward_equivalents_per_step_min": min(per_step),
            "forward_equivalents_per_step_max": max(per_step),
            "grad_rows_per_step": statistics.mean(r["totals"]["grad_rows"] / len(r["steps"]) for r in runs),
            "no_grad_rows_per_step": statistics.mean(r["totals"]["no_grad_rows"] / len(r["steps"]) for r in runs),
            "calls_per_step": statistics.mean((r["totals"]["grad_calls"] + r["totals"]["no_grad_calls"])
                                              / len(r["steps"]) for r in runs),
            "forward_equivalents": statistics.mean(r["steps"][-1]["forward_equivalents"] for r in runs),
            "seconds_per_step": statistics.mean(r["steps"][-1]["seconds"] / len(r["steps"]) for r in runs),
            # less sensitive to the load of a shared machine: the median and the fastest step of all seeds
            "seconds_per_step_median": statistics.median(s["step_seconds"] for r in runs for s in r["steps"]),
            "seconds_per_step_fastest": min(s["step_seconds"] for r in runs for s in r["steps"]),
            "seconds": statistics.mean(r["steps"][-1]["seconds"] for r in runs),
            "fractions": [round(i / points, 4) for i in range(count)] if count == points + 1 else None,
            "scores": [statistics.mean(s) for s in scores],
            "scores_min": [min(s) for s in scores],
            "scores_max": [max(s) for s in scores],
            "gain": statistics.mean(gains),
            "gain_min": min(gains),
            "gain_max": max(gains),
        })
    return rows


def seeds_note(own: list[int], seeds: int) -> str:
    """`` (seeds 0, 1)`` for an objective with fewer seeds than the table's ``seeds``, else nothing."""
    return "" if len(own) == seeds else f" (seeds {', '.join(map(str, own))} of {seeds})"


def markdown_table(rows: list[dict[str, Any]], seeds: int, points: int) -> str:
    fractions = " · ".join(f"{j}/{points}" if 0 < j < points else str(j // points) for j in range(points + 1))
    lines = [
        f"| objective | steps | transformer rows/step, with graph + without | forward-equivalents/step | "
        "s/step (mean, median, fastest) | "
        f"held-out score at budget {fractions} (mean of {seeds} seed(s)) | final gain [min, max] |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        scores = " · ".join(f"{s:.3f}" for s in row["scores"])
        lines.append(
            f"| {row['label']}{seeds_note(row['seeds'], seeds)} | {row['steps']:g} | {row['grad_rows_per_step']:.0f} + "
            f"{row['no_grad_rows_per_step']:.0f} | {row['forward_equivalents_per_step']:.0f} | "
            f"{row['seconds_per_step']:.2f}, {row['seconds_per_step_median']:.2f}, "
            f"{row['seconds_per_step_fastest']:.2f} | {scores} | "
            f"{row['gain']:+.3f} [{row['gain_min']:+.3f}, {row['gain_max']:+.3f}] |")
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], objectives: list[str], path: Path, title: str, seeds: int) -> str | None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for name in objectives:
        runs = [r for r in records if r["objective"] == name]
        count = min(len(r["evals"]) for r in runs)
        score = [statistics.mean(r["evals"][i]["score"] for r in runs) for i in range(count)]
        work = [statistics.mean(r["evals"][i]["forward_equivalents"] for r in runs) for i in range(count)]
        seconds = [statistics.mean(r["evals"][i]["seconds"] for r in runs) for i in range(count)]
        label = OBJECTIVES[name].label if name in OBJECTIVES else name
        label += seeds_note(sorted(r["seed"] for r in runs), seeds)
        axes[0].plot(work, score, marker="o", label=label)
        axes[1].plot(seconds, score, marker="o", label=label)
    axes[0].set_xlabel("transformer forward-equivalents (no-grad rows + 3 x rows with a graph)")
    axes[1].set_xlabel("training wall-clock (s)")
    axes[0].set_ylabel("held-out score (mean over seeds)")
    axes[0].legend()
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return matplotlib.__version__


def merge(args: argparse.Namespace) -> int:
    """``--merge``: one table and plot from the records of several results.json files: runs of different seeds, or of
    different objectives (``--objectives``) at the same setting, one process each.

    The files must agree on the budget, the evaluation points and samples and the overrides, and name a recipe of the
    same file name (the path may differ: a clean export of a commit and the working tree name one recipe by different
    paths). The recipe's content is not stored, so the measured cost is checked instead: every file calibrates the
    reference objective, and its counts must be the same in every file, as must those and the step count of an
    objective that several files ran. An objective and seed that two files both ran is refused. Objectives keep the
    order in which the files first name them; a row averages the seeds its objective has (its ``seeds``)."""
    from mmrl.config.loader import read_yaml

    results = [json.loads(Path(path).read_text()) for path in args.merge]
    first = results[0]
    objectives: list[str] = []
    calibration: dict[str, dict[str, int]] = {}
    objective_steps: dict[str, int] = {}
    seen: dict[tuple[str, int], Path] = {}
    for path, result in zip(args.merge, results, strict=True):
        same = (Path(result["args"]["config"]).name == Path(first["args"]["config"]).name
                and all(result["args"][key] == first["args"][key] for key in ("budget", "eval_points",
                                                                             "eval_samples", "override")))
        if not same:
            raise SystemExit(f"--merge: {path} differs from {args.merge[0]} in its recipe, budget, evaluation "
                             "points, evaluation samples or overrides; merge only runs of one setting")
        reference = result["budget"]["reference"]
        for name, counts in result["calibration"].items():
            if calibration.setdefault(name, counts) != counts:
                raise SystemExit(f"--merge: {path} measured {name!r} at {counts} per step, another file at "
                                 f"{calibration[name]}; merge only runs of one recipe and code")
        if reference != first["budget"]["reference"] or reference not in result["calibration"]:
            raise SystemExit(f"--merge: {path} has no calibration of the reference objective "
                             f"{first['budget']['reference']!r}; merge only runs with one reference")
        for name, steps in result["budget"]["objective_steps"].items():
            if objective_steps.setdefault(name, steps) != steps:
                raise SystemExit(f"--merge: {path} trains {name!r} {steps} steps, another file "
                                 f"{objective_steps[name]}; merge only runs of one budget")
        for row in result["rows"]:
            if row["objective"] not in objectives:
                objectives.append(row["objective"])
        for record in result["records"]:
            key = (record["objective"], record["seed"])
            if key in seen:
                raise SystemExit(f"--merge: {path} and {seen[key]} both hold {key[0]!r} seed {key[1]}; "
                                 "merge each run once")
            seen[key] = Path(path)
    records = [record for result in results for record in result["records"]]
    seeds = sorted({record["seed"] for record in records})
    args.config = Path(first["args"]["config"])
    args.eval_points = int(first["args"]["eval_points"])
    read_yaml(args.config)  # a one-line error if the recipe is gone
    budget = {**first["budget"], "objective_steps": {name: objective_steps[name] for name in objectives}}
    return _write_results(args, records, objectives, seeds, calibration, budget)


def _write_results(args: argparse.Namespace, records: list[dict[str, Any]], objectives: list[str], seeds: list[int],
                   calibration: dict[str, dict[str, int]], budget: dict[str, Any]) -> int:
    rows = summarise(records, objectives, args.eval_points)
    table = markdown_table(rows, len(seeds), args.eval_points)
    title = (f"Flow objectives at equal compute, {Path(str(args.config)).stem}, budget {budget['steps']} "
             f"{budget['reference']} steps ({len(seeds)} seed(s))")
    args.out.mkdir(parents=True, exist_ok=True)
    version = plot(records, objectives, args.out / "flow_objectives.png", title, len(seeds))
    table_entries = {name: {**OBJECTIVES[name]._asdict(), "overrides": OBJECTIVES[name].all_overrides()}
                     for name in objectives if name in OBJECTIVES}
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "objectives": table_entries,
              "calibration": calibration, "budget": budget, "rows": rows, "records": records, "matplotlib": version,
              "torch": torch.__version__, "threads": torch.get_num_threads()}
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    print(table)
    print(f"wrote {args.out / 'results.json'}" + (f" and {args.out / 'flow_objectives.png'}" if version else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        return merge(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    from mmrl.config.loader import apply_overrides, read_yaml

    base = apply_overrides(read_yaml(args.config), args.override)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        ensure_pipeline(base, args.out)
        calibration: dict[str, dict[str, int]] = {}
        for name in [REFERENCE] + [n for n in args.objectives if n != REFERENCE]:
            calibration[name] = calibrate(base, name, scratch, args.eval_samples)
            counts = calibration[name]
            print(f"calibration: {name} costs {counts['forward_equivalents']} forward-equivalents per step "
                  f"({counts['grad_rows']} rows with a graph in {counts['grad_calls']} calls, "
                  f"{counts['no_grad_rows']} without in {counts['no_grad_calls']})", flush=True)
        budget_fe = args.budget * calibration[REFERENCE]["forward_equivalents"]
        steps = {name: steps_for(budget_fe, calibration[name]["forward_equivalents"]) for name in args.objectives}
        budget = {"reference": REFERENCE, "steps": args.budget, "forward_equivalents": budget_fe,
                  "objective_steps": steps}
        print(f"budget: {budget_fe} forward-equivalents; steps {steps}", flush=True)
        records = []
        for seed in args.seeds:
            for name in args.objectives:
                started = time.perf_counter()
                records.append(train_one(base, name, seed, steps[name], args, scratch / f"{name}-{seed}"))
                print(f"{name} seed {seed}: {time.perf_counter() - started:.0f} s, held-out scores "
                      f"{[round(e['score'], 4) for e in records[-1]['evals']]}", flush=True)
    return _write_results(args, records, args.objectives, args.seeds, calibration, budget)


if __name__ == "__main__":
    raise SystemExit(main())
