"""Benchmark: does each core policy loss learn, side by side, on the dLLM toy world (CPU).

Every variant trains configs/dllm/toy.yaml (the bundled tiny masked diffusion LM, 2-digit addition, exact-answer
reward, 16 prompts × 8 samples per step, μ = 2 inner epochs, lr 1e-4, KL 0.1 to the pretrained weights) with
``plugin.estimator=one_step`` and ``plugin.estimator_options={p_mask_prompt: 0.15}`` (d1's per-token columns, one
per answer token, like an autoregressive LM's), at equal steps and seeds; only the policy loss, its options and the
aggregation change (``VARIANTS``). The second inner epoch trains on data one optimizer step old, so the ratio
leaves 1 there and the losses differ; on the first every ratio is 1, and the losses differ by their aggregation only
(Clip-Cov and KL-Cov also by the actions they pick).

Each loss runs with its documented recipe (docs/algorithms.md, section "Policy losses": the paper's or upstream's
defaults and the aggregation recommended there; the table ``RECIPES`` says which), plus two algorithm options on
``grpo``: DeepSeek-V3.2's off-policy sequence masking (``algorithm.off_policy_mask_threshold`` δ, with a δ small
enough to mask something on this toy, see ``OPSM_THRESHOLD``) and its importance-weighted KL
(``algorithm.kl_importance_weighted``). The KL weight stays the toy's 0.1 for every loss (the toy needs it: without
it the carry fix leaks into no-carry problems, docs/dllm.md section 8), also where a loss's own recipe sets none
(GSPO's TRL recipe ``beta=0``, the Clip-Cov / KL-Cov recipes ``kl_coef: 0``): the comparison is of the policy term.
``dgpo`` is left out: its columns must be per-sample likelihood terms against a reference (flow's ``likelihood:
dgpo``, −dsm per trained time), and the dLLM plugin's columns are token log-probs.

Recorded per variant and seed: the greedy held-out accuracy curve (``eval/reward_mean`` on the 500 held-out
problems), the mean over steps of the training reward (``reward/mean``) and of every ``policy/*`` metric the loss
and the options log (the clip fractions, ``off_policy_masked_fraction``, ``approx_kl``, ...: each a mean over the
step's micro-batches of both inner epochs, the first of which is on-policy), and the seconds per run (evaluations
included). Writes a markdown table (mean ± half the range over seeds per evaluation step), a second table of the
training metrics and, when matplotlib is installed, a PNG into ``--output-dir``; the training runs themselves go to
a temporary folder (a run folder holding another run's checkpoints is refused by the trainer).

``--json`` also writes the raw results: ``{variant: {seed: {"curve": {step: held-out accuracy}, "train_reward_mean":
float, "metrics": {name: mean over steps}, "seconds": float}}}``.

    OMP_NUM_THREADS=1 python benchmarks/policy_losses.py --threads 1 --seeds 0 1 2 --steps 60 --eval-every 15 \
        --json policy_losses.json --output-dir runs/bench_policy_losses
    # the smallest run (what tests/benchmarks/test_smoke.py does)
    python benchmarks/policy_losses.py --seeds 0 --steps 1 --eval-every 1 --output-dir out --json t.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(Path(__file__).resolve().parent) not in sys.path:  # run as a script or loaded by path: its sibling imports
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from dllm_estimators import _reset_accelerate, training_plot  # noqa: E402  (benchmarks/ is on the path above)

CONFIG = ROOT / "configs" / "dllm" / "toy.yaml"
# Every variant: d1's per-token columns (one_step, the prompt masked at 0.15 per inner epoch).
COMMON = ["plugin.estimator=one_step", "plugin.estimator_options={p_mask_prompt: 0.15}"]
# OPSM's δ on a negative-advantage sample's mean per-token log-ratio log π_old − log π_θ. Measured on this toy (seed 0,
# 10 steps, the policy metrics' mean over both inner epochs): δ = 0.5 (TRL's example) masks 0.07% of the actions,
# 0.1 masks 0.5%, 0.05 1.4%, 0.02 3.5%; with lr ≈ 0 nothing (the ratio is the weights' change, not the fresh prompt
# mask). 0.02 masks a few percent (2.6% of the actions over 60 steps and seeds 0-2, docs/performance.md section
# "Policy losses on the dLLM toy").
OPSM_THRESHOLD = 0.02
VARIANTS: dict[str, list[str]] = {
    # the toy's own loss: PPO-clip with DAPO's clip-higher (0.2 / 0.28), token_mean (d1); the baseline
    "grpo": [],
    # GSPO arXiv:2507.18071 §5.1 ε = (3e-4, 4e-4) on the sequence ratio; TRL's GSPO recipe (loss_type="grpo",
    # huggingface/trl@f2cd577 docs/source/paper_index.md L83-96) is the per-sequence mean, then over sequences
    # (trl/trainer/grpo_trainer.py L3124); its beta=0 is not taken (module docstring)
    "gspo": ["algorithm.policy_loss={name: gspo, clip_low: 3.0e-4, clip_high: 4.0e-4}",
             "algorithm.aggregation=seq_mean_token_mean"],
    # CISPO (MiniMax-M1; ScaleRL's ε_max = 5): no lower bound, weight ≤ 5, token_mean
    "cispo": ["algorithm.policy_loss={name: cispo, clip_low: null, clip_high: 4.0}"],
    # SAPO arXiv:2511.20347: τ_pos 1.0, τ_neg 1.05, per-sequence mean (verl forces it, TRL's default)
    "sapo": ["algorithm.policy_loss={name: sapo, tau_pos: 1.0, tau_neg: 1.05}",
             "algorithm.aggregation=seq_mean_token_mean"],
    # GMPO arXiv:2507.20673: log-space clip (−0.4, 0.4) per token before the geometric mean, per-sequence mean
    "gmpo": ["algorithm.policy_loss={name: gmpo, clip_low: 0.4, clip_high: 0.4}",
             "algorithm.aggregation=seq_mean_token_mean"],
    # REINFORCE with the group baseline (no ratio): the toy's token_mean, so its first epoch is grpo's gradient
    "reinforce": ["algorithm.policy_loss={name: reinforce}"],
    # VESPO arXiv:2602.10693, TRL's defaults (k, λ) = (2, 3) for A ≥ 0 and (3, 2) for A < 0; token_mean (TRL)
    "vespo": ["algorithm.policy_loss={name: vespo, k_pos: 2.0, lambda_pos: 3.0, k_neg: 3.0, lambda_neg: 2.0}"],
    # LUSPO arXiv:2602.05261 §5.1: ε = (2e-3, 2.5e-3) on GSPO's ratio, × |o_i|; seq_mean_token_mean (TRL's step)
    "luspo": ["algorithm.policy_loss={name: luspo, clip_low: 2.0e-3, clip_high: 2.5e-3}",
              "algorithm.aggregation=seq_mean_token_mean"],
    # Clip-Cov arXiv:2505.22617, verl's actor.yaml defaults (the authors' recipes widen the clip to [0, 2])
    "clip_cov": ["algorithm.policy_loss={name: clip_cov, clip_low: 0.2, clip_high: 0.2, clip_cov_ratio: 2.0e-4, "
                 "clip_cov_lb: 1.0, clip_cov_ub: 5.0}"],
    # KL-Cov arXiv:2505.22617, the authors' β = 1 and verl's k = 2e-4 (their 32B recipe's k_percent 0.02)
    "kl_cov": ["algorithm.policy_loss={name: kl_cov, kl_cov_ratio: 2.0e-4, ppo_kl_coef: 1.0}"],
    # DeepSeek-V3.2 OPSM (eq. 9) on the toy's grpo
    "grpo_opsm": [f"algorithm.off_policy_mask_threshold={OPSM_THRESHOLD}"],
    # the same with TRL's example δ = 0.5, which masks almost nothing here
    "grpo_opsm_trl": ["algorithm.off_policy_mask_threshold=0.5"],
    # DeepSeek-V3.2's unbiased KL: β·r·k3 at the token level, on the toy's grpo
    "grpo_kl_iw": ["algorithm.kl_importance_weighted=true"],
}
# (variant, loss and options, aggregation, source) for the table in the docs and the markdown output
RECIPES = {
    "grpo": ("grpo, ε 0.2 / 0.28 (the toy's; DAPO clip-higher)", "token_mean", "PPO; DAPO arXiv:2503.14476"),
    "gspo": ("gspo, ε 3e-4 / 4e-4, sequence ratio", "seq_mean_token_mean", "GSPO arXiv:2507.18071; TRL's recipe"),
    "cispo": ("cispo, no lower bound, ε_high 4 (weight ≤ 5)", "token_mean", "MiniMax-M1 arXiv:2506.13585; ScaleRL"),
    "sapo": ("sapo, τ_pos 1.0, τ_neg 1.05", "seq_mean_token_mean", "SAPO arXiv:2511.20347; TRL, verl"),
    "gmpo": ("gmpo, log-space ε 0.4 / 0.4", "seq_mean_token_mean", "GMPO arXiv:2507.20673; TRL, verl"),
    "reinforce": ("reinforce", "token_mean", "Williams 1992, group baseline"),
    "vespo": ("vespo, (k, λ) = (2, 3) for A ≥ 0, (3, 2) for A < 0", "token_mean", "VESPO arXiv:2602.10693; TRL"),
    "luspo": ("luspo, ε 2e-3 / 2.5e-3", "seq_mean_token_mean", "LUSPO arXiv:2602.05261 §5.1; TRL"),
    "clip_cov": ("clip_cov, ε 0.2 / 0.2, ρ 2e-4, (lb, ub) = (1, 5)", "token_mean", "arXiv:2505.22617; verl"),
    "kl_cov": ("kl_cov, k 2e-4, β 1", "token_mean", "arXiv:2505.22617; verl, the authors' code"),
    "grpo_opsm": (f"grpo (as the toy) + off_policy_mask_threshold δ = {OPSM_THRESHOLD}", "token_mean",
                  "DeepSeek-V3.2 arXiv:2512.02556 eq. 9; TRL"),
    "grpo_opsm_trl": ("grpo (as the toy) + off_policy_mask_threshold δ = 0.5 (TRL's example)", "token_mean",
                      "DeepSeek-V3.2 arXiv:2512.02556 eq. 9; TRL"),
    "grpo_kl_iw": ("grpo (as the toy) + kl_importance_weighted", "token_mean",
                   "DeepSeek-V3.2 arXiv:2512.02556; TRL use_bias_correction_kl"),
}
# training metrics shown in the markdown (each a mean over steps; absent where the loss does not log it)
SHOWN_METRICS = ["policy/clip_fraction", "policy/off_policy_masked_fraction", "policy/approx_kl", "policy/kl"]


def training_curves(variants: dict[str, list[str]], seeds: list[int], steps: int, eval_every: int) -> dict:
    """Train the toy world once per variant and seed; returns ``{variant: {seed: run}}`` (see the module docstring).

    The runs go to a temporary folder that is removed afterwards; each run builds its own Accelerator, whose global
    state is reset between runs (``dllm_estimators._reset_accelerate``).
    """
    from mmrl.config import load_config
    from mmrl.trainer import Trainer

    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-policy-losses-") as runs:
        for name, overrides in variants.items():
            for seed in seeds:
                started = time.perf_counter()
                config = load_config(CONFIG, [
                    *COMMON, *overrides, f"run.seed={seed}", f"run.max_steps={steps}", f"eval.every={eval_every}",
                    f"run.output_dir={Path(runs) / f'{name}_seed{seed}'}", "run.progress=false",
                    "eval.save_samples=false", "run.log_every=1",
                ])
                result = Trainer(config).train()
                _reset_accelerate()
                curve = {step: metrics["eval/reward_mean"] for step, metrics in sorted(result.evaluations.items())}
                keys = sorted({key for row in result.history for key in row if key.startswith("policy/")})
                metrics = {key: _mean([row[key] for row in result.history if key in row]) for key in keys}
                results.setdefault(name, {})[seed] = {
                    "curve": curve,
                    "train_reward_mean": _mean([row["reward/mean"] for row in result.history]),
                    "metrics": metrics,
                    "seconds": time.perf_counter() - started,
                }
                print(json.dumps({"variant": name, "seed": seed, **results[name][seed]}), flush=True)
    return results


def _mean(values: list[float]) -> float:
    if not values:
        raise ValueError("no values to average: the run logged no step")
    return float(sum(values) / len(values))


def _cell(values: list[float], digits: int = 3) -> str:
    mean = sum(values) / len(values)
    return f"{mean:.{digits}f} ± {(max(values) - min(values)) / 2:.{digits}f}"


def accuracy_markdown(results: dict) -> str:
    """Held-out accuracy per evaluation step (mean ± half the range over seeds) and minutes per run."""
    steps = sorted({step for runs in results.values() for run in runs.values() for step in run["curve"]})
    lines = ["| variant | " + " | ".join(f"step {s}" for s in steps) + " | minutes per run |",
             "|---|" + "---|" * (len(steps) + 1)]
    for name, runs in results.items():
        cells = [_cell([run["curve"][step] for run in runs.values() if step in run["curve"]]) for step in steps]
        minutes = sum(run["seconds"] for run in runs.values()) / len(runs) / 60
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {minutes:.2f} |")
    return "\n".join(lines)


def metrics_markdown(results: dict) -> str:
    """Training reward and the logged policy metrics, each a mean over steps (mean ± half the range over seeds)."""
    lines = ["| variant | loss and options | aggregation | training reward | "
             + " | ".join(key.removeprefix("policy/") for key in SHOWN_METRICS) + " | other metrics |",
             "|---|---|---|---|" + "---|" * (len(SHOWN_METRICS) + 1)]
    for name, runs in results.items():
        loss, aggregation, _ = RECIPES.get(name, (name, "", ""))
        cells = [_cell([run["train_reward_mean"] for run in runs.values()])]
        for key in SHOWN_METRICS:
            values = [run["metrics"][key] for run in runs.values() if key in run["metrics"]]
            cells.append(_cell(values, 4) if values else "—")
        generic = {"ratio_mean", "ratio_min", "ratio_max", "clip_fraction_low", "clip_fraction_high", "advantage",
                   "entropy", "dual_clip_fraction"}
        others = sorted({key for run in runs.values() for key in run["metrics"]} - set(SHOWN_METRICS)
                        - {f"policy/{key}" for key in generic})
        extra = ", ".join(f"{key.removeprefix('policy/')} {_cell([run['metrics'][key] for run in runs.values()], 4)}"
                          for key in others)
        lines.append(f"| {name} | {loss} | {aggregation} | " + " | ".join(cells) + f" | {extra or '—'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=15)
    parser.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS), help="only these variants")
    parser.add_argument("--output-dir", default="runs/bench_policy_losses", help="where the plot goes")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.steps < 1 or args.eval_every < 1:
        parser.error(f"--threads, --steps and --eval-every must be >= 1, got {args.threads}, {args.steps}, "
                     f"{args.eval_every}")
    torch.set_num_threads(args.threads)
    variants = VARIANTS if not args.variants else {name: VARIANTS[name] for name in args.variants}
    results = training_curves(variants, args.seeds, args.steps, args.eval_every)
    print(accuracy_markdown(results))
    print()
    print(metrics_markdown(results))
    plot = Path(args.output_dir) / "policy_losses_training.png"
    plot.parent.mkdir(parents=True, exist_ok=True)
    if training_plot(results, plot, title="dLLM toy world: each policy loss (one_step, μ = 2)", dashed_prefix="grpo_"):
        print(f"plot: {plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
