"""Summarise a grounding-world run: held-out scores per kind before and after, a grid of boxes, the reward curve.

``python -m mmrl.plugins.vlm.grounding.report RUN_DIR`` (after ``mmrl train configs/vlm/grounding.yaml``) reads the
run folder the trainer wrote (``config.yaml``, ``metrics.jsonl``, ``samples/step_*/eval.jsonl``) and the run's
evaluation dataset, scores every saved evaluation answer again with the world's reward in the model family's box
convention (so the scores do not depend on how ``eval.rewards`` combined them), and writes

- ``summary.json``: per kind (``locate`` IoU, ``find`` detection score, ``count`` accuracy) and the share of answers
  in the ``<think>``/``<answer>`` format, at every evaluation of the run (``held_out``), and before/after;
- ``grid.png``: held-out images with the ground-truth boxes (black), the pretrained model's boxes (magenta) and the
  trained model's (cyan), each captioned with its question and scores before → after;
- ``reward_curve.png``: the training reward of every step (and its moving average) and the held-out score per kind
  at each evaluation.

``--compare RUN [RUN ...] --labels ... --out FILE`` draws the held-out locate IoU and the training reward of several
runs in one figure (the GRPO / GSPO / Dr. GRPO comparison of docs/vlm.md).

A folder that only ``mmrl eval`` wrote into (``evaluations.jsonl``, ``evaluations/step_*/`` with ``eval.jsonl``
and the evaluation's ``config.yaml``; no training log) gets the per-kind scores of each of its evaluations, printed
and written to ``evaluations.json`` (:func:`evaluation_report`): how a checkpoint, or another model given as
``plugin.model=…``, scores per kind.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mmrl.plugins.vlm.grounding import world
from mmrl.trainer.metrics import read_metrics

GROUND_TRUTH, BEFORE, AFTER = (0, 0, 0), (220, 0, 220), (0, 190, 200)
"""Box colours of the grid: none of them is a shape colour of the world."""


def _run_config(run: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load((run / "config.yaml").read_text())


def convention_of(run: Path) -> str:
    """The box convention of the run's model family (the VLM plugin's adapter for ``plugin.family``/``model``);
    ``run`` is a folder with the ``config.yaml`` of a training run or of one ``mmrl eval`` evaluation."""
    from mmrl.plugins.vlm.adapters import adapter_for

    plugin = _run_config(run)["plugin"]
    return adapter_for(plugin.get("family", "auto"), plugin["model"]).box_convention


def evaluation_rows(run: Path) -> list[dict[str, Any]]:
    """The run's evaluation rows, loaded by the VLM plugin's own loader (with ``resized_size``); ``run`` as in
    :func:`convention_of`."""
    from mmrl.plugins.vlm.adapters import adapter_for
    from mmrl.plugins.vlm.data import attach_sizes, load_jsonl

    plugin = _run_config(run)["plugin"]
    data = plugin["data"]
    if not data.get("eval"):
        raise ValueError(f"{run}: the run has no evaluation dataset (plugin.data.eval)")
    adapter = adapter_for(plugin.get("family", "auto"), plugin["model"])(
        plugin["model"], min_pixels=plugin.get("min_pixels", 3136), max_pixels=plugin.get("max_pixels", 401408))
    rows = load_jsonl(data["eval"], image_root=data.get("image_root"))
    return attach_sizes(rows, adapter.resized_size)


def evaluations(run: Path, folder: str = "samples") -> dict[int, list[dict[str, Any]]]:
    """step → the saved evaluation answers of that step (``samples/step_N/eval.jsonl``; ``folder="evaluations"``:
    those of ``mmrl eval``)."""
    found = {}
    for step_folder in sorted((run / folder).glob("step_*")):
        path = step_folder / "eval.jsonl"
        if path.is_file():
            found[int(step_folder.name.split("_")[-1])] = [json.loads(line) for line in path.read_text().splitlines()]
    if not found:
        raise FileNotFoundError(f"{run}: no evaluation answers under {folder}/step_*/eval.jsonl")
    return found


def align(rows: Sequence[dict[str, Any]], records: Sequence[dict[str, Any]], run: Path) -> list[dict[str, Any]]:
    """The dataset row of each saved answer (the evaluation answers the first rows in order, one per row)."""
    if len(records) > len(rows):
        raise ValueError(f"{run}: {len(records)} evaluation answers for {len(rows)} evaluation rows")
    for index, (row, record) in enumerate(zip(rows, records, strict=False)):
        if row["prompt"] != record["prompt"] or row["solution"] != record["solution"]:
            raise ValueError(f"{run}: evaluation answer {index} is for {record['prompt']!r}, not the dataset's row "
                             f"{index} ({row['prompt']!r}); was the dataset rewritten after the run?")
    return list(rows[:len(records)])


def sample_scores(rows: Sequence[dict[str, Any]], texts: Sequence[str], convention: str) -> list[float]:
    """The world's reward of each answer in ``convention``."""
    from mmrl.plugins.vlm.grounding.reward import grounding_world
    from mmrl.reward import RewardInput

    return grounding_world(RewardInput(rows=list(rows), payload={"completions": list(texts)}), convention=convention)


def kind_means(rows: Sequence[dict[str, Any]], texts: Sequence[str], convention: str) -> dict[str, float]:
    """Mean score per kind, overall (``all``), and the share of answers in the format (``format``)."""
    from mmrl.reward import RewardInput
    from mmrl.rewards.reasoning import format_reward

    scores = sample_scores(rows, texts, convention)
    result = {}
    for kind in world.KINDS:
        values = [s for s, row in zip(scores, rows, strict=True) if row["kind"] == kind]
        if values:
            result[kind] = float(np.mean(values))
    result["all"] = float(np.mean(scores))
    result["format"] = float(np.mean(format_reward(RewardInput(rows=list(rows), payload={"completions": list(texts)}))))
    return result


def locate_by_objects(rows: Sequence[dict[str, Any]], texts: Sequence[str], convention: str) -> dict[str, list]:
    """Locate questions by the number of objects in their image: ``{"1": [questions, mean IoU], ...}``.

    With one object there is nothing to choose between, so how the locate score splits over these tells boxing
    precision from choosing the asked object among distractors (docs/vlm.md, "What the 300 steps change").
    """
    scores = sample_scores(rows, texts, convention)
    by_count: dict[int, list[float]] = {}
    for score, row in zip(scores, rows, strict=True):
        if row["kind"] == "locate":
            by_count.setdefault(len(row["objects"]), []).append(score)
    return {str(count): [len(values), float(np.mean(values))] for count, values in sorted(by_count.items())}


def question_counts(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    """How many of ``rows`` ask each kind of question."""
    return {kind: sum(1 for row in rows if row["kind"] == kind) for kind in world.KINDS}


# ---------------------------------------------------------------------------------------------------------- pictures
def _plt():
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError("the grounding report draws its curves with matplotlib: pip install 'mmrl[plots]' "
                          "(or pip install matplotlib)") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    return [float(np.mean(values[max(0, i - window + 1):i + 1])) for i in range(len(values))]


def plot_curve(metrics: list[dict[str, Any]], held_out: dict[int, dict[str, float]], path: Path,
               title: str = "grounding world: GRPO") -> Path:
    """Training reward per step (and its moving average), held-out score per kind at each evaluation."""
    plt = _plt()
    train = [(r["step"], r["reward/mean"]) for r in metrics if r.get("reward/mean") is not None]
    figure, (left, right) = plt.subplots(1, 2, figsize=(9.0, 3.2), dpi=100)
    if train:
        steps, values = zip(*train, strict=True)
        window = max(1, len(values) // 10)
        left.plot(steps, values, color="tab:blue", alpha=0.3, linewidth=1, label="batch mean")
        left.plot(steps, _moving_average(values, window), color="tab:blue", linewidth=2,
                  label=f"moving average ({window} steps)")
    left.set_title("training reward (format + world)", fontsize=9)
    left.set_xlabel("step")
    left.legend(fontsize=7, loc="lower right")
    left.grid(alpha=0.3)
    steps = sorted(held_out)
    for kind, colour in zip((*world.KINDS, "all"), ("tab:red", "tab:green", "tab:purple", "black"), strict=True):
        right.plot(steps, [held_out[s].get(kind, float("nan")) for s in steps], "o-", color=colour, markersize=3,
                   linewidth=1.5 if kind != "all" else 2.5, label=kind)
    right.set_title("held-out score per kind", fontsize=9)
    right.set_xlabel("step")
    right.legend(fontsize=7, loc="lower right")
    right.grid(alpha=0.3)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def _boxes(text: str, row: dict[str, Any], convention: str) -> list[list[float]]:
    from mmrl.rewards.boxes import parse_boxes

    return parse_boxes(text, convention, row["image_size"], row.get("resized_size"))  # type: ignore[arg-type]


def _truth(row: dict[str, Any]) -> list[list[float]]:
    solution = row["solution"]
    if row["kind"] == "locate":
        return [solution]
    if row["kind"] == "find":
        return list(solution)
    return [o["box"] for o in row["objects"] if o["color"] == row["subject"]["color"]]


def draw_grid(rows: Sequence[dict[str, Any]], before: Sequence[str], after: Sequence[str], convention: str,
              path: Path, *, per_kind: int = 4, columns: int = 4) -> Path:
    """Held-out images (``per_kind`` of each kind) with the true boxes and the boxes written before and after."""
    from PIL import Image, ImageDraw

    cell, caption = 240, 40
    scores_before = sample_scores(rows, before, convention)
    scores_after = sample_scores(rows, after, convention)
    chosen = [i for kind in world.KINDS for i in [j for j, row in enumerate(rows) if row["kind"] == kind][:per_kind]]
    lines = (len(chosen) + columns - 1) // columns
    canvas = Image.new("RGB", (columns * cell, lines * (cell + caption) + 24), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 4), "true box: black   before RL: magenta   after RL: cyan   (count: the counted shapes' boxes)",
              fill=(0, 0, 0))
    for position, index in enumerate(chosen):
        row = rows[index]
        image = Image.fromarray(world.record_image(row))
        scale = min((cell - 8) / image.width, (cell - 8) / image.height)
        image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))))
        x0 = (position % columns) * cell + 4
        y0 = (position // columns) * (cell + caption) + 28
        canvas.paste(image, (x0, y0))
        for boxes, colour, width in ((_truth(row), GROUND_TRUTH, 3),
                                     (_boxes(before[index], row, convention), BEFORE, 2),
                                     (_boxes(after[index], row, convention), AFTER, 2)):
            if row["kind"] == "count" and colour != GROUND_TRUTH:
                continue
            for box in boxes:
                corners = [x0 + box[0] * scale, y0 + box[1] * scale, x0 + box[2] * scale - 1,
                           y0 + box[3] * scale - 1]
                draw.rectangle(corners, outline=colour, width=width)
        text = row["problem"]
        if row["kind"] == "count":
            text += f" ({row['solution']})"
        draw.text((x0, y0 + image.height + 2), text, fill=(0, 0, 0))
        draw.text((x0, y0 + image.height + 14), f"{scores_before[index]:.2f} -> {scores_after[index]:.2f}",
                  fill=(0, 0, 0))
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)
    return path


# ---------------------------------------------------------------------------------------------------------- report
def held_out_scores(run: Path, found: dict[int, list[dict[str, Any]]] | None = None) -> dict[int, dict[str, float]]:
    """step → per-kind held-out scores of every evaluation of the run (``found``: its :func:`evaluations`, when
    already read)."""
    rows = evaluation_rows(run)
    convention = convention_of(run)
    found = evaluations(run) if found is None else found
    return {step: kind_means(align(rows, records, run), [r["output"] for r in records], convention)
            for step, records in found.items()}


def report(run: str | Path, export: str | Path | None = None) -> dict[str, Any]:
    """Write summary.json, grid.png and reward_curve.png into ``run`` (and small copies into ``export``)."""
    run = Path(run)
    metrics = read_metrics(run / "metrics.jsonl")
    rows = evaluation_rows(run)
    convention = convention_of(run)
    found = evaluations(run)
    if len(found) < 2:
        raise FileNotFoundError(f"{run}: expected evaluations at the start and the end under samples/step_*/")
    held_out = held_out_scores(run, found)
    first, last = min(found), max(found)
    aligned = align(rows, found[first], run)
    draw_grid(aligned, [r["output"] for r in found[first]], [r["output"] for r in found[last]], convention,
              run / "grid.png")
    plot_curve(metrics, held_out, run / "reward_curve.png")
    step_times = [r["time/step"] for r in metrics if r.get("time/step") is not None]
    eval_times = [r["time/eval"] for r in metrics if r.get("time/eval") is not None]
    summary = {
        "run": str(run),
        "convention": convention,
        "steps": last,
        "questions": question_counts(aligned),
        "held_out_before": held_out[first],
        "held_out_after": held_out[last],
        "held_out": {str(step): scores for step, scores in sorted(held_out.items())},
        "locate_by_objects_before": locate_by_objects(aligned, [r["output"] for r in found[first]], convention),
        "locate_by_objects_after": locate_by_objects(aligned, [r["output"] for r in found[last]], convention),
        "train_seconds": round(sum(step_times), 1),
        "eval_seconds": round(sum(eval_times), 1),
    }
    (run / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if export is not None:
        export = Path(export)
        export.mkdir(parents=True, exist_ok=True)
        for name in ("grid.png", "reward_curve.png"):
            _small_copy(run / name, export / name)
    return summary


def evaluation_report(run: str | Path) -> dict[str, Any]:
    """Per-kind scores of the evaluations ``mmrl eval`` wrote into ``run``; writes ``evaluations.json``.

    Each ``evaluations/step_N/eval.jsonl`` (the answers of the last evaluation of a checkpoint of step N, or of the
    initial policy at step 0) is scored again with the world's reward, on the rows and in the convention of the
    ``config.yaml`` beside it (the evaluation's own config); the checkpoint it came from is the one the last
    ``evaluations.jsonl`` record of that step names.
    """
    run = Path(run)
    checkpoints: dict[int, str] = {}
    log = run / "evaluations.jsonl"
    if log.is_file():
        for record in read_metrics(log):
            if "step" in record:
                checkpoints[int(record["step"])] = str(record.get("checkpoint", ""))
    scored = {}
    for step, records in evaluations(run, "evaluations").items():
        folder = run / "evaluations" / f"step_{step:06d}"
        if not (folder / "config.yaml").is_file():
            raise FileNotFoundError(f"{folder}: no config.yaml beside eval.jsonl (written by `mmrl eval` since "
                                    "this report could read it); evaluate the checkpoint again")
        convention = convention_of(folder)
        aligned = align(evaluation_rows(folder), records, folder)
        texts = [r["output"] for r in records]
        scored[str(step)] = {"checkpoint": checkpoints.get(step, ""), "convention": convention,
                             "questions": question_counts(aligned),
                             "held_out": kind_means(aligned, texts, convention),
                             "locate_by_objects": locate_by_objects(aligned, texts, convention)}
    summary = {"run": str(run), "evaluations": scored}
    (run / "evaluations.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def compare(runs: Sequence[str | Path], labels: Sequence[str], path: str | Path, max_step: int | None = None) -> Path:
    """One figure: held-out locate IoU at each evaluation and the training reward's moving average, per run.

    Runs given as ``RUN1,RUN2,...`` are averaged over their seeds (the shaded band spans their range); ``max_step``
    draws only the steps up to it (equal samples for runs of different lengths)."""
    plt = _plt()
    figure, (left, right) = plt.subplots(1, 2, figsize=(9.0, 3.2), dpi=100)
    for label, group in zip(labels, runs, strict=True):
        folders = [Path(p) for p in str(group).split(",")]
        curves = [held_out_scores(folder) for folder in folders]
        steps = sorted(s for s in set.intersection(*(set(c) for c in curves)) if max_step is None or s <= max_step)
        values = np.array([[c[s]["locate"] for s in steps] for c in curves])  # [seeds, evaluations]
        line = left.plot(steps, values.mean(0), "o-", markersize=3, label=label)[0]
        if len(folders) > 1:
            left.fill_between(steps, values.min(0), values.max(0), color=line.get_color(), alpha=0.15)
        rewards = []
        for folder in folders:
            metrics = read_metrics(folder / "metrics.jsonl")
            rewards.append([r["reward/mean"] for r in metrics if r.get("reward/mean") is not None
                            and (max_step is None or r["step"] <= max_step)])
        width = min(len(r) for r in rewards)
        mean = np.mean([r[:width] for r in rewards], axis=0)
        right.plot(range(1, width + 1), _moving_average(list(mean), max(1, width // 10)), color=line.get_color(),
                   label=label)
    left.set_title("held-out locate IoU", fontsize=9)
    right.set_title("training reward (moving average)", fontsize=9)
    for axis in (left, right):
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def _small_copy(source: Path, target: Path) -> None:
    """A palette PNG copy, so the docs' images stay small."""
    from PIL import Image

    with Image.open(source) as image:
        image.convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(target, optimize=True)


def _print_evaluations(parser: argparse.ArgumentParser, run: Path) -> None:
    """Print and write (:func:`evaluation_report`) the per-kind scores of what `mmrl eval` wrote into ``run``."""
    try:
        summary = evaluation_report(run)
    except (FileNotFoundError, ValueError) as error:  # no answers, no config beside them, rewritten data
        parser.error(str(error))
    for step, entry in sorted(summary["evaluations"].items(), key=lambda item: int(item[0])):
        scores = entry["held_out"]
        kinds = ", ".join(f"{kind} {scores[kind]:.3f}" for kind in (*world.KINDS, "format") if kind in scores)
        print(f"evaluation at step {step} ({entry['checkpoint'] or 'checkpoint not recorded'}; "
              f"{entry['convention']} boxes): all {scores['all']:.3f}; {kinds}")
        by_objects = entry["locate_by_objects"]
        if by_objects:
            print("  locate by objects in the image: " + ", ".join(
                f"{count}: {mean:.3f} ({questions})" for count, (questions, mean) in by_objects.items()))
    print(f"wrote {run / 'evaluations.json'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.plugins.vlm.grounding.report",
                                     description="Held-out scores per kind, box grid and reward curve of a "
                                                 "grounding-world run.")
    parser.add_argument("run", type=Path, nargs="?", help="the run folder (run.output_dir)")
    parser.add_argument("--export", type=Path, help="also write small copies of the pictures here")
    parser.add_argument("--compare", nargs="+", help="runs to draw in one figure (RUN or RUN1,RUN2 for seeds)")
    parser.add_argument("--labels", nargs="+", help="a label per --compare entry")
    parser.add_argument("--out", type=Path, help="the --compare figure")
    parser.add_argument("--max-step", type=int, help="--compare: draw the steps up to this one only")
    args = parser.parse_args(argv)
    if args.compare:
        if not args.labels or len(args.labels) != len(args.compare) or args.out is None:
            parser.error("--compare needs --labels (one per run) and --out")
        print(f"wrote {compare(args.compare, args.labels, args.out, args.max_step)}")
        return 0
    if args.run is None:
        parser.error("give a run folder, or --compare")
    missing = [name for name in ("config.yaml", "metrics.jsonl") if not (args.run / name).is_file()]
    if missing and (args.run / "evaluations").is_dir():  # only what `mmrl eval` writes
        _print_evaluations(parser, args.run)
        return 0
    if missing:
        parser.error(f"{args.run} is neither a training run folder (no {' or '.join(missing)}) nor an `mmrl eval` "
                     "folder (evaluations/): the report reads what `mmrl train` or `mmrl eval` writes")
    try:
        summary = report(args.run, args.export)
    except (FileNotFoundError, ValueError) as error:  # evaluations missing, no eval dataset, rewritten data
        parser.error(str(error))
    before, after = summary["held_out_before"], summary["held_out_after"]
    print(f"held-out grounding world ({summary['convention']} boxes): {before['all']:.3f} before -> "
          f"{after['all']:.3f} after {summary['steps']} steps ({after['all'] - before['all']:+.3f})")
    for kind in (*world.KINDS, "format"):
        if kind in before:
            print(f"  {kind:7s} {before[kind]:.3f} -> {after[kind]:.3f} ({after[kind] - before[kind]:+.3f})")
    if summary["locate_by_objects_before"]:  # a world written without locate questions has none
        by_objects = zip(summary["locate_by_objects_before"].items(), summary["locate_by_objects_after"].values(),
                         strict=True)
        print("  locate by objects in the image: " + ", ".join(
            f"{count}: {before_mean:.3f} -> {after_mean:.3f} ({questions})"
            for (count, (questions, before_mean)), (_, after_mean) in by_objects))
    print(f"wrote {args.run / 'grid.png'}, {args.run / 'reward_curve.png'}, {args.run / 'summary.json'}")
    if (args.run / "evaluations").is_dir():  # `mmrl eval` of the run's checkpoints, on its own data and settings
        _print_evaluations(parser, args.run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
