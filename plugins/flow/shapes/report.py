"""Summarise a shapes-world run: the reward curve, the grids before and after, the held-out score per task.

``python -m mmrl.plugins.flow.shapes.report RUN_DIR`` (after ``mmrl train configs/flow/shapes.yaml``) reads the run
folder the trainer wrote (``metrics.jsonl``, ``samples/step_*/eval.png`` and ``eval.jsonl``) and adds

- ``reward_curve.png``: the mean training reward of every step (and its moving average), with the held-out
  evaluations as points;
- ``grid_before.png`` / ``grid_after.png``: copies of the first and last evaluation grids (held-out prompts, each
  captioned with its shapes score);
- ``summary.json``: the held-out score before and after, per task, and the wall-clock of the run; for an edit-world
  run (``configs/flow/shapes_edit.yaml``) the score of the unchanged input images (``unchanged_inputs``); for a
  guidance-free run (``plugin.cfg: false``, as the main job) also the pretrained model's score *with* CFG on the same
  prompts and noise (``pretrained_guided``; one more evaluation, ``--no-reference`` skips it),

and prints the held-out score before and after. ``--export DIR`` also writes small copies of the three pictures
(the docs' images/shapes folder holds those of a real run).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from mmrl.trainer.metrics import read_metrics


def _eval_folders(run: Path) -> list[Path]:
    folders = sorted(p for p in (run / "samples").glob("step_*") if (p / "eval.jsonl").is_file())
    if len(folders) < 2:
        raise FileNotFoundError(f"{run}: expected evaluations at the start and the end under samples/step_*/")
    return folders


def _check_rewards(config: dict[str, Any], run: Path) -> str:
    """The grids and eval.jsonl carry the evaluation's total reward: it is the world's score only when the
    evaluation is scored by ``shapes`` (the shapes world) or ``shape_edit`` (the edit world) alone, with partial
    credit and weight 1 (a dense companion such as ``shape_fidelity`` would be added into it). The evaluation's
    rewards are ``eval.rewards``, or the training rewards without it. Returns the reward's name."""
    own = (config.get("eval") or {}).get("rewards")
    key = "eval.rewards" if own is not None else "rewards.functions"
    functions = own if own is not None else (config.get("rewards") or {}).get("functions", [])
    specs = [item if isinstance(item, dict) else {"name": item} for item in functions]
    names = [spec.get("name") for spec in specs]
    if names not in (["shapes"], ["shape_edit"]):
        raise ValueError(f"{run}: the report reads the evaluation's total reward as the world's score, so the run's "
                         f"{key} must be [shapes] or [shape_edit] alone; it has {names}")
    spec = specs[0]
    if float(spec.get("weight", 1.0)) != 1.0 or (spec.get("args") or {}).get("strict", False):
        raise ValueError(f"{run}: the report reads the evaluation's total reward as the world's score, so {key}'s "
                         f"{names[0]} needs weight 1 and strict false; it has weight {spec.get('weight', 1.0)}, args "
                         f"{spec.get('args') or {}}")
    return names[0]


def _eval_rows(run: Path) -> tuple[list[dict[str, Any]], str]:
    """The evaluation rows the run used: its config.yaml read by the flow plugin's own loader (eval_prompts,
    eval_dataset or the dataset folder's test file; image paths resolved for an editing model), and the name of the
    reward that scores them."""
    import yaml

    from mmrl.config import from_dict
    from mmrl.plugins.flow.config import FlowPluginConfig, adapter_class, load_rows

    config = yaml.safe_load((run / "config.yaml").read_text())
    reward = _check_rewards(config, run)
    options = dict(config.get("plugin") or {})
    if options.pop("name", "flow") != "flow":
        raise ValueError(f"{run}: not a flow-plugin run (plugin.name {config['plugin']['name']!r})")
    plugin = from_dict(FlowPluginConfig, options, "plugin")
    adapter = adapter_class(plugin)  # as the plugin loads its rows: an editing model's name their input images
    return load_rows(plugin, "eval", images=adapter.name if adapter.image_conditioned else None,
                     max_images=None), reward


def _task_of(rows: list[dict[str, Any]]) -> dict[str, str]:
    """prompt → task of the evaluation rows, so the report groups what was sampled. An edit-world run's tasks are its
    kinds of edit (an instruction names its kind)."""
    return {row["prompt"]: row.get("task", "all") for row in rows}


def unchanged_inputs(rows: list[dict[str, Any]], reward: str = "shape_edit") -> dict[str, float]:
    """An edit-world run's reference: the score (by the run's ``reward``) of each evaluation row's input image
    itself, per kind of edit: what a model that leaves every image as it was would score (0 by ``shape_edit``'s
    construction; 0.4 to 0.8 by the partial credit of ``shapes``)."""
    from mmrl.plugins.flow.shapes.edit_model import read_images
    from mmrl.plugins.flow.shapes.sampling import task_means
    from mmrl.reward import RewardInput
    from mmrl.rewards import reward_functions

    scorer = reward_functions.get(reward)()
    return task_means(rows, scorer(RewardInput(rows=list(rows), payload={"images": read_images(rows)})))


def _per_task(records: list[dict[str, Any]], tasks: dict[str, str]) -> dict[str, float]:
    groups: dict[str, list[float]] = {}
    for record in records:
        groups.setdefault(tasks.get(record["prompt"], "other"), []).append(float(record["reward"]))
    out = {task: sum(values) / len(values) for task, values in sorted(groups.items())}
    out["all"] = sum(float(r["reward"]) for r in records) / len(records)
    return out


def plot_rewards(metrics: list[dict[str, Any]], path: Path, title: str = "shapes world: Flow-GRPO",
                 ylabel: str = "shapes score") -> Path:
    """The reward-curve PNG from metrics.jsonl records."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError("the shapes report draws its reward curve with matplotlib: pip install 'mmrl[plots]' "
                          "(or pip install matplotlib)") from error

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["reward/mean"]) for r in metrics if r.get("reward/mean") is not None]
    evals = [(r["step"], r["eval/reward_mean"]) for r in metrics if r.get("eval/reward_mean") is not None]
    figure, axis = plt.subplots(figsize=(5.0, 3.2), dpi=100)
    if train:
        steps, values = zip(*train, strict=True)
        axis.plot(steps, values, color="tab:blue", alpha=0.35, linewidth=1, label="training reward (batch mean)")
        window = max(1, len(values) // 10)
        smooth = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
                  for i in range(len(values))]
        axis.plot(steps, smooth, color="tab:blue", linewidth=2, label=f"moving average ({window} steps)")
    if evals:
        steps, values = zip(*evals, strict=True)
        axis.plot(steps, values, "o-", color="tab:red", linewidth=1.5, label="held-out prompts (eval sampler)")
    axis.set_xlabel("step")
    axis.set_ylabel(ylabel)
    axis.set_title(title, fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def guided_reference(run: str | Path) -> dict[str, float] | None:
    """The pretrained model's held-out score with classifier-free guidance, for a guidance-free run (``plugin.cfg``
    false on a model guided by its CFG pass, as the shapes world's SD3): the same evaluation prompts, samples, noise
    and sampler as the run's own evaluation, at the model's default guidance scale (SD3: 4.5). A guidance-free model
    after RL should be read against both its own start and this. None for a run that samples with guidance."""
    import tempfile

    from mmrl.config import load_config
    from mmrl.plugins.flow.config import adapter_class
    from mmrl.trainer import Trainer

    run = Path(run)
    plugin = load_config(run / "config.yaml").plugin.config
    adapter = adapter_class(plugin)  # the run's own model family: FLUX is guided without a CFG pass
    if not adapter.supports_cfg or plugin.cfg is not False:
        return None
    scale = adapter.default_guidance_scale
    with tempfile.TemporaryDirectory(prefix="shapes-guided-") as scratch:
        guided = load_config(run / "config.yaml", [
            "plugin.cfg=true", f"plugin.guidance_scale={scale}", "plugin.eval_guidance_scale=null",
            f"run.output_dir={scratch}", "run.progress=false", "eval.save_samples=false"])
        trainer = Trainer(guided)  # its LoRA starts at zero: the pretrained model
        try:
            metrics = trainer.evaluate()
        finally:
            trainer.scorer.close()
            trainer.eval_scorer.close()
    return {"guidance_scale": scale, "score": metrics["eval/reward_mean"]}


def report(run: str | Path, export: str | Path | None = None, *, reference: bool = True) -> dict[str, Any]:
    """Write the pictures and summary.json into ``run`` (and ``export``); return the summary. With ``reference``
    a guidance-free run's summary also holds :func:`guided_reference` (``pretrained_guided``)."""
    run = Path(run)
    metrics = read_metrics(run / "metrics.jsonl")
    folders = _eval_folders(run)
    first, last = folders[0], folders[-1]
    rows, reward = _eval_rows(run)
    tasks = _task_of(rows)
    edit_world = bool(rows) and all("edit" in row and "image" in row for row in rows)
    before = _per_task([json.loads(x) for x in (first / "eval.jsonl").read_text().splitlines()], tasks)
    after = _per_task([json.loads(x) for x in (last / "eval.jsonl").read_text().splitlines()], tasks)
    title = "edit world: Flow-GRPO (FLUX.1 Kontext)" if edit_world else "shapes world: Flow-GRPO"
    curve = plot_rewards(metrics, run / "reward_curve.png", title, f"{reward} score")
    shutil.copyfile(first / "eval.png", run / "grid_before.png")
    shutil.copyfile(last / "eval.png", run / "grid_after.png")
    step_times = [r["time/step"] for r in metrics if r.get("time/step") is not None]
    eval_times = [r["time/eval"] for r in metrics if r.get("time/eval") is not None]
    summary = {
        "run": str(run),
        "steps": int(last.name.split("_")[-1]),
        "held_out_before": before,
        "held_out_after": after,
        "world": "edit" if edit_world else "shapes",
        "train_seconds": round(sum(step_times), 1),
        "eval_seconds": round(sum(eval_times), 1),
    }
    if edit_world:
        summary["unchanged_inputs"] = unchanged_inputs(rows, reward)
    if reference:
        guided = guided_reference(run)
        if guided is not None:
            summary["pretrained_guided"] = guided
    (run / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if export is not None:
        export = Path(export)
        export.mkdir(parents=True, exist_ok=True)
        for name, source in (("grid_before.png", run / "grid_before.png"), ("grid_after.png", run / "grid_after.png"),
                             ("reward_curve.png", curve)):
            _small_copy(source, export / name)
    return summary


def _small_copy(source: Path, target: Path) -> None:
    """A palette PNG copy (the grids have few colours), so the docs' images stay small."""
    from PIL import Image

    with Image.open(source) as image:
        image.convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(target, optimize=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.plugins.flow.shapes.report",
                                     description="Reward curve, grids and held-out summary of a shapes-world run.")
    parser.add_argument("run", type=Path, help="The run folder (run.output_dir).")
    parser.add_argument("--export", type=Path, help="Also write small copies of the pictures here.")
    parser.add_argument("--no-reference", action="store_true",
                        help="For a guidance-free run, skip evaluating the pretrained model with CFG.")
    args = parser.parse_args(argv)
    summary = report(args.run, args.export, reference=not args.no_reference)
    before, after = summary["held_out_before"], summary["held_out_after"]
    what = "edit" if summary["world"] == "edit" else "shapes"
    print(f"held-out {what} score: {before['all']:.3f} before -> {after['all']:.3f} after "
          f"{summary['steps']} steps ({after['all'] - before['all']:+.3f})")
    unchanged = summary.get("unchanged_inputs")
    if unchanged is not None:
        print(f"  (the input images left as they are score {unchanged['all']:.3f})")
    guided = summary.get("pretrained_guided")
    if guided is not None:
        print(f"  (guidance-free sampling; the pretrained model with CFG {guided['guidance_scale']:g}, two transformer "
              f"passes per step, scores {guided['score']:.3f} on the same prompts and noise: "
              f"{after['all'] - guided['score']:+.3f} for the trained model without CFG)")
    for task in sorted(set(before) - {"all"}):
        print(f"  {task:14s} {before[task]:.3f} -> {after.get(task, float('nan')):.3f}")
    print(f"wrote {args.run / 'reward_curve.png'}, {args.run / 'grid_before.png'}, {args.run / 'grid_after.png'}, "
          f"{args.run / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
