"""Pretrain the edit world's image-editing model (a small FLUX.1 Kontext) with flow matching.

The committed checkpoint (``plugins/flow/shapes/assets/edit_pipeline``) was made in two stages::

    python -m mmrl.plugins.flow.shapes.edit_pretrain --out /tmp/edit-stage1 \
        --wrong-edits 0.5 --steps 4000 --eval-every 500 --threads 1
    python -m mmrl.plugins.flow.shapes.edit_pretrain --out plugins/flow/shapes/assets/edit_pipeline \
        --init /tmp/edit-stage1 --wrong-edits 0.25 --lr 3e-4 --warmup 1 --steps 2000 --eval-every 1000 --threads 1

(15 + 8 minutes on one core each of a 2-core machine shared with other runs; the committed folder is the one a
``--steps 4000`` second stage wrote at its step-2000 evaluation, which is the folder of a ``--steps 2000`` run: the
learning rate is constant after the warm-up and the data and EMA depend on the step only). ``pretrain.json`` in
the folder records the exact arguments, the loss and the held-out ``shapes`` scores along the way and the
wall-clock, with the first stage's record under ``previous_stage``. The folder is rewritten atomically at every
evaluation; ``--init`` continues from such a folder.

Objective: rectified flow as FLUX.1 Kontext is trained (Black Forest Labs 2025, arXiv:2506.15742: the context
image's latent tokens are appended after the target's, with a constant offset on the first of the three rotary
position axes, and only the target tokens are noised and regressed): per training example the frozen autoencoder
encodes the input rendering to the context tokens c and the edited rendering to x0 (both shifted and scaled as the
pipeline does), σ ~ logit-normal(0, 1), x_σ = (1 − σ)·x0 + σ·ε, and the transformer, called exactly as the
``flux_kontext`` adapter calls it in RL (``call_transformer``: [x_σ; c] with the adapter's position ids, the output
cut to the target tokens), regresses the velocity ε − x0. The text encoders train with it. Examples are drawn on the
fly: a kind of edit uniformly, then one of its training edits (:func:`edits.all_edits`: training input scenes and
results only), then a random layout. With ``--wrong-edits p`` the target is drawn with probability p from an edit
that went wrong (:func:`edits.wrong_edit`: left unchanged, the other object edited, or another value) while the
instruction stays, so the model edits right only part of the time. AdamW with a linear warm-up, gradient clipping at
1, and an exponential moving average of the weights, which is what is saved.

Every ``--eval-every`` steps the EMA model edits the held-out rows' input images (the dataset files in
``--data``) with the evaluation sampler the plugin uses (plain Euler ODE, no guidance) and the ``shapes`` reward
scores the results against the edited scenes.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from mmrl.plugins.flow.shapes import edits
from mmrl.plugins.flow.shapes.edit_model import (
    EditModelConfig,
    adapter_for,
    build_edit_pipeline,
    condition_latents,
    read_images,
    sample_edits,
    to_pixels,
)
from mmrl.plugins.flow.shapes.pretrain import _swap, _write, optimizer_step

EDIT_DATA = Path(__file__).parent / "assets" / "edit_data"
"""The edit world's committed dataset (rows and input images, :func:`edits.write_dataset`)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mmrl.plugins.flow.shapes.edit_pretrain",
                                     description="Pretrain the edit world's image-editing model (flow matching).")
    parser.add_argument("--out", type=Path, required=True, help="Pipeline folder to write.")
    parser.add_argument("--data", type=Path, default=EDIT_DATA, help="Dataset folder (held-out rows for evaluation).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--ema", type=float, default=0.998, help="EMA decay of the saved weights.")
    parser.add_argument("--wrong-edits", type=float, default=0.0,
                        help="Share of targets drawn from an edit that went wrong (edits.wrong_edit).")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads.")
    parser.add_argument("--eval-every", type=int, default=500, help="Steps between evaluations (0: only the end).")
    parser.add_argument("--eval-steps", type=int, default=20, help="Euler steps of the evaluation sampler.")
    parser.add_argument("--eval-samples", type=int, default=2, help="Samples per held-out row.")
    parser.add_argument("--log-every", type=int, default=100, help="Steps between loss lines (0: none).")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--double-layers", type=int, default=EditModelConfig.double_layers,
                        help="Double-stream transformer blocks of a fresh model.")
    parser.add_argument("--single-layers", type=int, default=EditModelConfig.single_layers,
                        help="Single-stream transformer blocks of a fresh model.")
    parser.add_argument("--init", type=Path, default=None,
                        help="Continue from this pipeline folder (written by this script) instead of a fresh model.")
    return parser


def training_batch(rng: np.random.Generator, by_kind: dict[str, list[dict[str, Any]]], size: int,
                   wrong_edits: float) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """``size`` training examples: (instructions, input pixels ``[N, 3, R, R]``, target pixels ``[N, 3, R, R]``)
    (module docstring: a kind uniformly, one of its training edits, a random layout; a wrong target with
    probability ``wrong_edits``)."""
    kinds = list(by_kind)
    prompts, sources, targets = [], [], []
    for _ in range(size):
        rows = by_kind[kinds[int(rng.integers(len(kinds)))]]
        row = rows[int(rng.integers(len(rows)))]
        scene, drawn = row["source_row"], row["edit"]
        if wrong_edits and rng.random() < wrong_edits:
            drawn = edits.wrong_edit(scene, drawn, rng)  # another edit, or None: the input unchanged
        source, target = edits.render_pair(scene, drawn, rng)
        prompts.append(row["prompt"])
        sources.append(source)
        targets.append(target)
    return prompts, to_pixels(sources), to_pixels(targets)


def evaluate(pipeline: Any, transformer: Any, rows: list[dict[str, Any]], images: torch.Tensor, *, steps: int,
             samples: int, seed: int) -> dict[str, float]:
    """Mean ``shapes`` score of ``samples`` edits per row, overall and per kind of edit."""
    from mmrl.plugins.flow.shapes.sampling import score, task_means

    repeated = [row for row in rows for _ in range(samples)]
    inputs = images.repeat_interleave(samples, dim=0)
    edited = sample_edits(pipeline, [row["prompt"] for row in repeated], inputs, num_steps=steps, seed=seed,
                          transformer=transformer)
    return task_means(repeated, score(repeated, edited))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    if not 0.0 <= args.wrong_edits < 1.0:
        raise SystemExit(f"--wrong-edits must be in [0, 1), got {args.wrong_edits}")
    test_file = args.data / "test_metadata.jsonl"
    if not test_file.is_file():
        raise SystemExit(f"--data {args.data}: no test_metadata.jsonl there; write the dataset with python -m "
                         "mmrl.plugins.flow.shapes.edits FOLDER")
    previous = None
    if args.init is not None:
        from diffusers import FluxKontextPipeline

        record_path = args.init / "pretrain.json"
        if not record_path.is_file():
            raise SystemExit(f"--init {args.init}: no pretrain.json there; give a folder written by this script")
        previous = json.loads(record_path.read_text())
        pipeline = FluxKontextPipeline.from_pretrained(str(args.init))
        config = EditModelConfig(**previous["model"])
    else:
        config = EditModelConfig(double_layers=args.double_layers, single_layers=args.single_layers)
        pipeline = build_edit_pipeline(config, seed=args.seed)
    adapter = adapter_for(pipeline)
    pipeline.vae.eval().requires_grad_(False)  # the shapes world's autoencoder, trained before
    trained = {"transformer": pipeline.transformer, "text_encoder": pipeline.text_encoder,
               "text_encoder_2": pipeline.text_encoder_2}
    parameters = [p for module in trained.values() for p in module.parameters()]
    for module in trained.values():
        module.train().requires_grad_(True)
    ema = {name: copy.deepcopy(module).eval().requires_grad_(False) for name, module in trained.items()}
    optimizer = torch.optim.AdamW(parameters, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / max(args.warmup, 1)))

    by_kind: dict[str, list[dict[str, Any]]] = {kind: [] for kind in edits.EDITS}
    for row in edits.all_edits()["train"]:
        by_kind[row["task"]].append(row)
    held_out = [json.loads(line) for line in test_file.read_text().splitlines() if line.strip()]
    held_out_images = read_images(held_out, args.data)
    print(f"pretraining the edit model: {sum(p.numel() for p in pipeline.transformer.parameters()):,} transformer "
          f"parameters, {sum(len(v) for v in by_kind.values())} training edits, {len(held_out)} held-out rows; "
          f"{args.steps} steps of {args.batch_size} on {args.threads} thread(s)", flush=True)

    log: list[dict[str, Any]] = []
    started = time.perf_counter()
    bar = tqdm(range(1, args.steps + 1), desc="pretrain edits", dynamic_ncols=True, disable=not args.progress)
    running = math.nan
    for step in bar:
        prompts, sources, targets = training_batch(rng, by_kind, args.batch_size, args.wrong_edits)
        with torch.no_grad():
            context = condition_latents(adapter, sources)  # [N, T, 4C]
            x0 = condition_latents(adapter, targets)  # [N, T, 4C]: the same encoding, of the target
        conditioning = dict(adapter.encode_prompts(prompts, 12))
        conditioning["image_latents"] = context
        sigma = torch.sigmoid(torch.randn(args.batch_size, generator=generator))  # logit-normal(0, 1)
        noise = torch.randn(x0.shape, generator=generator)
        s = sigma.view(-1, 1, 1)
        noisy = (1 - s) * x0 + s * noise
        velocity = adapter.call_transformer(pipeline.transformer, noisy, sigma * 1000, conditioning, 1.0)
        loss = F.mse_loss(velocity.float(), noise - x0)
        value = optimizer_step(loss, optimizer, schedule, parameters, trained, ema, step, args.ema)
        running = value if math.isnan(running) else 0.98 * running + 0.02 * value
        bar.set_postfix(loss=f"{running:.4f}")
        if args.log_every and step % args.log_every == 0:
            tqdm.write(f"step {step}: loss {running:.4f}, {time.perf_counter() - started:.0f} s")
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            record = {"step": step, "loss": running, "seconds": time.perf_counter() - started}
            swapped = _swap(pipeline, ema)
            means = evaluate(pipeline, None, held_out, held_out_images, steps=args.eval_steps,
                             samples=args.eval_samples, seed=10_000)
            record.update({f"held_out/{key}": value for key, value in means.items()})
            log.append(record)
            tqdm.write(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}))
            _write(pipeline, args, argv, config, log, time.perf_counter() - started, previous,
                   script="mmrl.plugins.flow.shapes.edit_pretrain")
            _swap(pipeline, swapped)

    elapsed = time.perf_counter() - started
    print(f"wrote {args.out} in {elapsed / 60:.1f} min; held-out edit score {log[-1]['held_out/all']:.3f} "
          f"(eval sampler: {args.eval_steps} steps, no guidance)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
