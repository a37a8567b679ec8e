"""Benchmarks of the dLLM likelihood estimators on the bundled toy masked diffusion LM (CPU).

Part 1 (``--part variance``): every estimator's spread at an equal budget of masked forwards per completion.
Completions are sampled (temperature 1) from the toy model for held-out prompts; each estimator is run ``--repeats``
times per completion with independent mask draws. Reported per estimator and budget: the mean bias against the exact
ELBO (enumerated over all mask subsets; the completions are at most 4 tokens), the standard deviation of one
estimate (root mean over completions of the per-completion variance), and the standard deviation of the difference
``est(θ') − est(θ)`` between the model and a slightly perturbed copy — with the two scored on one shared mask plan
(as the plugin does for π_θ / π_old / π_ref) and on independent plans.

Part 2 (``--part training``): held-out greedy accuracy against RL steps on the toy world (configs/dllm/toy.yaml) for
the one_step (per-token ratio), elbo_l, coupled and coupled_cv (sequence ratio) estimators at the same number of masked
forwards per completion, over several seeds. Writes a table and, when matplotlib is installed, a PNG into
``--output-dir``; the training runs themselves go to a temporary folder (so the benchmark can be run again: a run
folder holding another run's checkpoints is refused by the trainer).

``--json`` also writes the raw results: for ``variance`` a list of rows (``estimator``, ``name``, ``forwards``,
``bias_vs_exact_elbo``, ``sd``, ``sd_difference_shared_plan``, ``sd_difference_independent_plans``, ``seconds``,
``elbo_t_exact_sd``: elbo_t's exact sd at that number of forwards, the reference of the variance goal),
for ``training`` ``{estimator: {seed: {"curve": {step: held-out accuracy}, "seconds": ...}}}``.

    python benchmarks/dllm_estimators.py --part variance --threads 1
    python benchmarks/dllm_estimators.py --part training --threads 1 --seeds 0 1 2 --steps 60 --eval-every 15
    # the smallest runs (what tests/benchmarks/test_smoke.py does)
    python benchmarks/dllm_estimators.py --part variance --completions 2 --repeats 2 --budgets 2 --json v.json
    python benchmarks/dllm_estimators.py --part training --seeds 0 --steps 1 --eval-every 1 --output-dir out \
        --json t.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from mmrl.plugins.dllm import toy
from mmrl.plugins.dllm.adapters import MaskedLMAdapter
from mmrl.plugins.dllm.estimators import draw_plan, exact_elbo, score_plan
from mmrl.plugins.dllm.generation import completion_mask, generate

# (label, estimator, options): every row gets the budget's number of masked forwards (one_step without prompt
# masking is deterministic and always takes one).
ESTIMATORS = [
    ("one_step (d1, clean prompt: 1 forward)", "one_step", {}),
    ("one_step (d1, prompt masked 0.15)", "one_step", {"p_mask_prompt": 0.15}),
    ("elbo_t (t-sampling, eps 1e-3)", "elbo_t", {}),
    ("elbo_l iid", "elbo_l", {"stratified": False}),
    ("elbo_l stratified", "elbo_l", {"stratified": True}),
    ("coupled (complementary pairs)", "coupled", {}),
    ("coupled_cv (full row + pairs, control 1)", "coupled_cv", {}),
    ("coupled_cv (full row + pairs, control 0)", "coupled_cv", {"control": 0.0}),
    ("spg_lower (block masking, 2 blocks)", "spg_lower", {"masking": "block", "block_length": 2}),
    ("spg_upper (EUBO, beta 1.5)", "spg_upper", {"beta": 1.5}),
]


def _sampled_completions(adapter, model, count: int, seed: int):
    rows = toy.addition_splits()["eval"][:count]
    prompt_ids, _ = toy.encode_examples(adapter.tokenizer, [r["prompt"] for r in rows], ["0"] * count)
    generators = [torch.Generator().manual_seed(seed + i) for i in range(count)]
    out = generate(adapter.scorer(model), prompt_ids, mask_id=adapter.mask_id, gen_length=toy.GEN_LENGTH,
                   block_length=toy.GEN_LENGTH, steps=toy.GEN_LENGTH, temperature=1.0, generators=generators)
    real = completion_mask(out.completion_ids, adapter.stop_ids)
    return prompt_ids, out.completion_ids, real  # the tail after EOS is masked in every forward


@torch.no_grad()
def exact_elbo_t_sd(scorer, prompt, completion, real, mask_id: int, budgets: list[int], eps: float = 1e-3) -> dict:
    """The exact sd of ``elbo_t`` (the benchmark's root mean over completions of the per-completion variance).

    One draw is ``Y = g(S)/t`` with ``t ~ U(ε, 1)`` and ``S ~ Bern(t)`` over the real tokens, so with
    ``m_k(l) = mean_{|S|=l} g(S)^k`` (enumerated: the completions have at most 4 real tokens),
    ``E[Y^k] = ∫_ε^1 Σ_l C(L,l) t^l (1−t)^{L−l} m_k(l) / t^k dt / (1−ε)``, integrated on a log-spaced grid; N draws
    divide the variance by N. The 1/t weights make the sampled sd heavy-tailed, so 100 repetitions estimate it
    poorly; this is the value they estimate.
    """
    grid = torch.logspace(math.log10(eps), 0.0, 200_001, dtype=torch.float64)
    variances = []
    for b in range(completion.shape[0]):
        positions = real[b].nonzero().squeeze(-1).tolist()
        size = len(positions)
        rows, sizes = [], []
        for l in range(1, size + 1):
            for subset in itertools.combinations(positions, l):
                row = torch.where(real[b].bool(), completion[b], mask_id)  # the tail masked
                row[list(subset)] = mask_id
                rows.append(torch.cat([prompt[b], row]))
                sizes.append(l)
        logits = scorer(torch.stack(rows))[:, prompt.shape[1]:].double().log_softmax(-1)
        logp = logits.gather(-1, completion[b].expand(len(rows), -1).unsqueeze(-1)).squeeze(-1)  # [R, G]
        masked = torch.stack(rows)[:, prompt.shape[1]:] == mask_id
        g = (logp * (masked & real[b].bool())).sum(-1)  # [R]
        sizes_t = torch.tensor(sizes)
        first = second = 0.0
        for l in range(1, size + 1):
            values = g[sizes_t == l]
            density = math.comb(size, l) * grid ** l * (1 - grid) ** (size - l) / (1 - eps)
            first += float(torch.trapezoid(density * values.mean() / grid, grid))
            second += float(torch.trapezoid(density * (values ** 2).mean() / grid ** 2, grid))
        variances.append(second - first ** 2)
    single = sum(variances) / len(variances)
    return {budget: math.sqrt(single / budget) for budget in budgets}


@torch.no_grad()
def variance_table(args: argparse.Namespace) -> list[dict]:
    adapter = MaskedLMAdapter(str(toy.ASSETS))
    model = adapter.load_model(attn_implementation="eager").eval()
    perturbed = adapter.load_model(attn_implementation="eager").eval()
    generator = torch.Generator().manual_seed(123)
    for p in perturbed.parameters():
        p.add_(args.perturbation * torch.randn(p.shape, generator=generator) * p.abs().mean())
    scorer, scorer2 = adapter.scorer(model), adapter.scorer(perturbed)
    prompt, completion, real = _sampled_completions(adapter, model, args.completions, seed=7)
    exact = exact_elbo(scorer, prompt, completion, real, mask_id=adapter.mask_id)  # [C]
    exact_t = exact_elbo_t_sd(scorer, prompt, completion, real, adapter.mask_id, args.budgets)
    print(json.dumps({"elbo_t exact sd by forwards": exact_t}), flush=True)
    c, r = prompt.shape[0], args.repeats
    rep = lambda t: t.repeat(r, 1)  # noqa: E731 — row k·C + i is repeat k of completion i
    rows = []
    for budget in args.budgets:
        for label, name, options in ESTIMATORS:
            started = time.perf_counter()
            plan = draw_plan(name, rep(prompt), rep(completion), rep(real), num_samples=budget,
                             generator=torch.Generator().manual_seed(budget), **options)
            other = draw_plan(name, rep(prompt), rep(completion), rep(real), num_samples=budget,
                              generator=torch.Generator().manual_seed(10_000 + budget), **options)
            forwards = plan.num_samples
            base = score_plan(scorer, rep(prompt), rep(completion), plan, mask_id=adapter.mask_id,
                              micro_batch=4096).double().view(r, c)
            shared = score_plan(scorer2, rep(prompt), rep(completion), plan, mask_id=adapter.mask_id,
                                micro_batch=4096).double().view(r, c)
            independent = score_plan(scorer2, rep(prompt), rep(completion), other, mask_id=adapter.mask_id,
                                     micro_batch=4096).double().view(r, c)
            rows.append({
                "estimator": label, "name": name, "forwards": forwards,
                "bias_vs_exact_elbo": float((base.mean(0) - exact.double()).mean()),
                "sd": float(base.var(0).mean().sqrt()),
                "sd_difference_shared_plan": float((shared - base).var(0).mean().sqrt()),
                "sd_difference_independent_plans": float((independent - base).var(0).mean().sqrt()),
                "seconds": round(time.perf_counter() - started, 2),
            })
            print(json.dumps(rows[-1]), flush=True)
    for row in rows:
        row["elbo_t_exact_sd"] = exact_t.get(row["forwards"])
    return rows


def variance_markdown(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"{args.completions} sampled completions (1-4 tokens incl. EOS), {args.repeats} repetitions each; θ' = θ "
        f"with every weight perturbed by {args.perturbation}·mean|w|·N(0,1).",
        "",
        "| estimator | forwards | bias vs exact ELBO | sd of the estimate | sd of est(θ')−est(θ), shared plan | "
        "same, independent plans |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['estimator']} | {row['forwards']} | {row['bias_vs_exact_elbo']:+.3f} | {row['sd']:.3f} "
                     f"| {row['sd_difference_shared_plan']:.4f} | {row['sd_difference_independent_plans']:.3f} |")
    exact = {row["forwards"]: row["elbo_t_exact_sd"] for row in rows if row.get("elbo_t_exact_sd")}
    lines += ["", "elbo_t's exact sd (enumerated, eps 1e-3): "
              + ", ".join(f"{value:.3f} at {budget} forwards" for budget, value in sorted(exact.items()))]
    return "\n".join(lines)


def training_curves(args: argparse.Namespace) -> dict:
    from mmrl.config import load_config
    from mmrl.trainer import Trainer

    config_path = Path(__file__).resolve().parents[1] / "configs" / "dllm" / "toy.yaml"
    variants = {
        "one_step": ["plugin.estimator=one_step", "plugin.estimator_options={p_mask_prompt: 0.15}"],
        "elbo_l": ["plugin.estimator=elbo_l"],
        "coupled": ["plugin.estimator=coupled"],
        "coupled_cv": ["plugin.estimator=coupled_cv"],
    }
    results: dict = {}
    if args.estimators:
        variants = {name: variants[name] for name in args.estimators}
    with tempfile.TemporaryDirectory(prefix="bench-dllm-") as runs:
        for name, overrides in variants.items():
            for seed in args.seeds:
                started = time.perf_counter()
                output = Path(runs) / f"{name}_seed{seed}"
                config = load_config(config_path, [
                    *overrides, f"plugin.num_mc_samples={args.forwards}", f"run.seed={seed}",
                    f"run.max_steps={args.steps}", f"eval.every={args.eval_every}", f"run.output_dir={output}",
                    "run.progress=false", "eval.save_samples=false",
                ])
                result = Trainer(config).train()
                _reset_accelerate()  # each run builds its own Accelerator
                curve = {step: metrics["eval/reward_mean"] for step, metrics in sorted(result.evaluations.items())}
                results.setdefault(name, {})[seed] = {"curve": curve, "seconds": time.perf_counter() - started}
                print(json.dumps({"estimator": name, "seed": seed, **results[name][seed]}), flush=True)
    return results


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()


def training_markdown(results: dict) -> str:
    steps = sorted({step for runs in results.values() for run in runs.values() for step in run["curve"]})
    lines = ["| estimator | " + " | ".join(f"step {s}" for s in steps) + " | minutes per run |",
             "|---|" + "---|" * (len(steps) + 1)]
    for name, runs in results.items():
        cells = []
        for step in steps:
            values = [run["curve"][step] for run in runs.values() if step in run["curve"]]
            mean = sum(values) / len(values)
            spread = (max(values) - min(values)) / 2
            cells.append(f"{mean:.3f} ± {spread:.3f}")
        minutes = sum(run["seconds"] for run in runs.values()) / len(runs) / 60
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {minutes:.1f} |")
    return "\n".join(lines)


def training_plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name, runs in results.items():
        steps = sorted(next(iter(runs.values()))["curve"])
        values = torch.tensor([[run["curve"][s] for s in steps] for run in runs.values()])
        ax.plot(steps, values.mean(0).tolist(), marker="o", label=name)
        ax.fill_between(steps, values.min(0).values.tolist(), values.max(0).values.tolist(), alpha=0.2)
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title("Toy world: GRPO with each likelihood estimator")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["variance", "training"], required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--completions", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--budgets", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--perturbation", type=float, default=0.02)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=15)
    parser.add_argument("--forwards", type=int, default=2, help="masked forwards per completion in part 2")
    parser.add_argument("--output-dir", default="runs/bench_dllm", help="where the training part's plot goes")
    parser.add_argument("--estimators", nargs="+", default=None, help="part 2: only these estimators")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.part == "variance":
        rows = variance_table(args)
        print(variance_markdown(rows, args))
        raw = rows
    else:
        results = training_curves(args)
        print(training_markdown(results))
        plot = Path(args.output_dir) / "dllm_estimators_training.png"
        plot.parent.mkdir(parents=True, exist_ok=True)
        if training_plot(results, plot):
            print(f"plot: {plot}")
        raw = results
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=2, default=str))


if __name__ == "__main__":
    main()
