"""Where a shapes-world model loses its points: each requirement of the ``shapes`` reward scored on its own.

The ``shapes`` score of an image is the mean of its requirement scores (:mod:`mmrl.rewards.shapes`): per object
*count* and *color*, and *position* for a relation. A held-out score of 0.7 may mean wrong colours, missing objects or
objects in the wrong order; this module tells them apart. For a run folder it samples the run's evaluation prompts
with the pretrained pipeline and with the run's trained weights (LoRA or full fine-tuning), both from the same
noise, with the evaluation sampler of :mod:`~mmrl.plugins.flow.shapes.sampling`, and prints per task the mean score
of each requirement kind and the share of images that meet every requirement::

    python -m mmrl.plugins.flow.shapes.requirements runs/flow/shapes            # writes requirements.json there
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

KINDS = ("count", "color", "position")


def requirement_means(rows: Sequence[dict[str, Any]], images: Tensor) -> dict[str, dict[str, float]]:
    """Per task (and ``"all"``): the mean score of each requirement kind in :data:`KINDS` over the images that have
    one, ``"all_right"`` (the share of images meeting every requirement, GenEval's accuracy), ``"score"`` (the
    mean ``shapes`` score) and ``"images"``.

    Args:
        rows: the dataset rows (with the world's ``objects`` / ``relation`` metadata), one per image.
        images: ``[N, 3, R, R]`` images in [0, 1].
    """
    from mmrl.reward import RewardInput
    from mmrl.rewards.images import read_images
    from mmrl.rewards.shapes import check_row, detect, requirement_scores

    if len(rows) != len(images):
        raise ValueError(f"requirement_means: {len(rows)} rows for {len(images)} images")
    for index, row in enumerate(rows):
        check_row(row, index)
    pixels = read_images(RewardInput(rows=list(rows), payload={"images": images}), reward="shapes")
    if not bool(pixels.finite.all()):
        raise ValueError(f"requirement_means: {int((~pixels.finite).sum())} images have non-finite pixels")
    sums: dict[str, dict[str, list[float]]] = {}
    for index, row in enumerate(rows):
        scores = requirement_scores(row, detect(pixels.numpy(index)))  # from an [R, R, 3] uint8 image
        values = [value for _, value in scores]
        for task in (row.get("task", "other"), "all"):
            bucket = sums.setdefault(task, {})
            for name, value in scores:
                bucket.setdefault(name.split("[")[0], []).append(value)
            bucket.setdefault("all_right", []).append(float(all(value == 1.0 for value in values)))
            bucket.setdefault("score", []).append(sum(values) / len(values))
    return {task: {**{key: sum(v) / len(v) for key, v in bucket.items()}, "images": float(len(bucket["score"]))}
            for task, bucket in sorted(sums.items())}


def _load_trained(pipeline: Any, policy: Path) -> None:
    """Put the trained weights saved in a checkpoint's ``policy`` folder into ``pipeline`` (in place)."""
    from safetensors.torch import load_file

    from mmrl.plugins.flow.plugin import LORA_WEIGHTS

    if (policy / LORA_WEIGHTS).is_file():
        pipeline.load_lora_weights(str(policy), weight_name=LORA_WEIGHTS)
        return
    full = policy / "trainable.safetensors"
    if not full.is_file():
        raise FileNotFoundError(f"{policy} holds neither {LORA_WEIGHTS} (LoRA) nor trainable.safetensors (full "
                                "fine-tuning)")
    state = load_file(str(full))
    result = pipeline.transformer.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"{full}: {len(result.unexpected_keys)} tensors are not the transformer's, e.g. "
                         f"{result.unexpected_keys[0]!r}")


def compare(run: str | Path, *, samples: int = 8, seed: int = 0, checkpoint: str = "latest") -> dict[str, Any]:
    """Requirement means of the pretrained and the trained model on the run's evaluation prompts (written to
    ``run/requirements.json`` and returned).

    Args:
        run: the run folder (``run.output_dir``): its ``config.yaml`` names the pipeline, the evaluation prompts and
            the evaluation sampler; its ``checkpoints/`` hold the trained weights.
        samples: images per prompt (the same noise for both models).
        seed: noise seed (sample k of the batch uses ``seed + k``).
        checkpoint: a ``checkpoints/step-*`` folder name, or ``"latest"``.
    """
    from diffusers import StableDiffusion3Pipeline

    from mmrl.config import load_config
    from mmrl.plugins.flow.adapters.sd3 import SD3Adapter
    from mmrl.plugins.flow.config import load_rows
    from mmrl.plugins.flow.shapes.sampling import sample
    from mmrl.trainer.checkpoint import checkpoints_dir, list_checkpoints, resolve

    run = Path(run)
    if samples < 1:
        raise ValueError(f"requirements: samples must be >= 1, got {samples}")
    plugin = load_config(run / "config.yaml").plugin.config  # the run's FlowPluginConfig, defaults filled in
    rows = load_rows(plugin, "eval")
    if not rows:
        raise FileNotFoundError(f"{run}: its config names no evaluation prompts")
    complete = list_checkpoints(run)
    found = resolve("latest", run) if checkpoint == "latest" else checkpoints_dir(run) / checkpoint
    if found not in complete:
        raise FileNotFoundError(f"{run}: no complete checkpoint {checkpoint!r}; it has "
                                f"{[path.name for path in complete] or 'none'} (or 'latest')")
    policy = found / "policy"
    repeated = [row for row in rows for _ in range(samples)]
    prompts = [row["prompt"] for row in repeated]
    options = {"num_steps": plugin.eval_num_steps, "seed": seed,  # the trainer's evaluation sampler
               "guidance_scale": plugin.resolved_guidance_scales(SD3Adapter.default_guidance_scale,
                                                                 guided_by_cfg=SD3Adapter.supports_cfg)[1],
               "max_sequence_length": plugin.max_sequence_length or SD3Adapter.default_max_sequence_length}
    pipeline = StableDiffusion3Pipeline.from_pretrained(plugin.model)
    before = requirement_means(repeated, sample(pipeline, prompts, **options))
    _load_trained(pipeline, policy)
    after = requirement_means(repeated, sample(pipeline, prompts, **options))
    result = {"run": str(run), "checkpoint": found.name, "samples_per_prompt": samples, "seed": seed,
              "before": before, "after": after}
    (run / "requirements.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def format_table(result: dict[str, Any]) -> str:
    """The before → after table that :func:`main` prints."""
    lines = [f"{'task':14s} {'images':>6s}  " + "  ".join(f"{kind:>13s}" for kind in (*KINDS, "all_right", "score"))]
    for task, before in result["before"].items():
        after = result["after"][task]
        cells = []
        for kind in (*KINDS, "all_right", "score"):
            cells.append(f"{before[kind]:.2f} -> {after[kind]:.2f}" if kind in before else f"{'-':>13s}")
        lines.append(f"{task:14s} {int(before['images']):6d}  " + "  ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.plugins.flow.shapes.requirements",
                                     description="Each shapes requirement scored on its own, pretrained vs trained.")
    parser.add_argument("run", type=Path, help="The run folder (run.output_dir).")
    parser.add_argument("--samples", type=int, default=8, help="Images per evaluation prompt.")
    parser.add_argument("--seed", type=int, default=0, help="Noise seed (both models see the same noise).")
    parser.add_argument("--checkpoint", default="latest", help="A checkpoints/step-* folder name, or latest.")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's).")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        result = compare(args.run, samples=args.samples, seed=args.seed, checkpoint=args.checkpoint)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"requirements: {error}") from None
    print(f"requirement scores, pretrained -> {result['checkpoint']} ({args.samples} images per prompt, same noise):")
    print(format_table(result))
    print(f"wrote {args.run / 'requirements.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
