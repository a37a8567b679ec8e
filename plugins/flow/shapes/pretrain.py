"""Pretrain the shapes world's text-to-image model with flow matching and write the pipeline folder.

The committed checkpoint (``plugins/flow/shapes/assets/pipeline``) was made by::

    python -m mmrl.plugins.flow.shapes.autoencoder --out /tmp/shapes-vae
    python -m mmrl.plugins.flow.shapes.pretrain --vae /tmp/shapes-vae --out plugins/flow/shapes/assets/pipeline \
        --caption-noise 0.5 --steps 4000 --eval-every 1000 --threads 1

(the autoencoder first, :mod:`~mmrl.plugins.flow.shapes.autoencoder`; then 4,000 steps of 64 images, half of them
drawn from a caption with one attribute wrong; 8 + 22 minutes on one core each of a 2-core machine).
``pretrain.json`` in the folder records the exact arguments, the loss and held-out scores along the way, the
wall-clock and the autoencoder's own record (and, after ``--init``, the previous stage's record under
``previous_stage``). Runs are deterministic for a seed and a thread count on one machine and torch build, and the
learning rate is constant after warm-up, so the folder a longer run writes at step k is the folder of a
``--steps k`` run. The folder is rewritten (atomically) at every evaluation, so a long run can be stopped and its
last evaluated weights used; ``--init`` continues from such a folder. ``--vae identity`` builds the first, pixel-space
model instead (docs/shapes.md, "History").

Objective: rectified flow as SD3 trains it (Esser et al. 2024, arXiv:2403.03206): per image x0 (its latents through
the pipeline's frozen autoencoder, shifted and scaled to unit variance), σ ~ logit-normal(0, 1), ε ~ N(0, I),
x_σ = (1 − σ)·x0 + σ·ε, and the transformer (given timestep 1000·σ) regresses the velocity ε − x0 with a mean
squared error. The text encoders are trained with it, and 10% of the prompts are replaced by the empty prompt so
that classifier-free guidance works (the plugin's negative prompt is ""). Images are rendered on the fly: every
example draws a task uniformly, then one of the task's training compositions (:func:`world.training_rows`), then a
random layout, so no held-out composition is ever seen. With ``--caption-noise p``, each image is drawn with
probability p from :func:`world.corrupt_row` of its row (one colour, shape, count or relation changed) while the
caption stays: captions that are sometimes wrong, as alt-text is, make a model that can draw each prompt but does so
only part of the time. AdamW with a linear warm-up, gradient clipping at 1, and an
exponential moving average of the weights, which is what is saved.

Every ``--eval-every`` steps the EMA model samples the held-out prompts (and as many training prompts) with the
plugin's evaluation sampler and the ``shapes`` reward scores them. The length of the run is chosen to leave room for
RL: the model draws the right objects most of the time but gets compositions, counts and positions only partly
right.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from mmrl.plugins.flow.shapes import world
from mmrl.plugins.flow.shapes.autoencoder import pixels
from mmrl.plugins.flow.shapes.model import ModelConfig, build_pipeline, encode_prompts, pixels_to_latents


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mmrl.plugins.flow.shapes.pretrain",
                                     description="Pretrain the shapes world's text-to-image model (flow matching).")
    parser.add_argument("--out", type=Path, required=True, help="Pipeline folder to write.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--ema", type=float, default=0.998, help="EMA decay of the saved weights.")
    parser.add_argument("--drop-prompt", type=float, default=0.1, help="Share of empty prompts (for CFG).")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads.")
    parser.add_argument("--eval-every", type=int, default=500, help="Steps between evaluations (0: only the end).")
    parser.add_argument("--eval-steps", type=int, default=20, help="Euler steps of the evaluation sampler.")
    parser.add_argument("--eval-guidance", type=float, default=4.5, help="CFG scale of the evaluation sampler.")
    parser.add_argument("--eval-samples", type=int, default=2, help="Samples per evaluation prompt.")
    parser.add_argument("--log-every", type=int, default=100, help="Steps between loss lines (0: none).")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--patch-size", type=int, default=ModelConfig.patch_size,
                        help="Transformer patch side (with --init: the folder's).")
    parser.add_argument("--layers", type=int, default=ModelConfig.layers,
                        help="Transformer joint blocks (with --init: the folder's).")
    parser.add_argument("--vae", default=None,
                        help="A fresh model's autoencoder: a folder written by python -m "
                             "mmrl.plugins.flow.shapes.autoencoder, or 'identity' for a pixel-space model (with "
                             "--init: the folder's own).")
    parser.add_argument("--caption-noise", type=float, default=0.0,
                        help="Share of images drawn from a caption with one attribute wrong (world.corrupt_row).")
    parser.add_argument("--init", type=Path, default=None,
                        help="Continue from this pipeline folder (written by this script) instead of a fresh model.")
    return parser


def _pick(rng: np.random.Generator, by_task: dict[str, list[dict[str, Any]]], tasks: list[str]) -> dict[str, Any]:
    rows = by_task[tasks[int(rng.integers(len(tasks)))]]
    return rows[int(rng.integers(len(rows)))]


def evaluate(pipeline: Any, transformer: Any, rows: list[dict[str, Any]], *, steps: int, guidance: float,
             samples: int, seed: int) -> dict[str, float]:
    """Mean shapes score of ``samples`` images per row, overall and per task."""
    from mmrl.plugins.flow.shapes.sampling import sample, score, task_means

    repeated = [row for row in rows for _ in range(samples)]
    images = sample(pipeline, [row["prompt"] for row in repeated], num_steps=steps, guidance_scale=guidance,
                    seed=seed, transformer=transformer)
    return task_means(repeated, score(repeated, images))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    if not 0.0 <= args.caption_noise < 1.0:
        raise SystemExit(f"--caption-noise must be in [0, 1), got {args.caption_noise}")
    if args.init is not None and args.vae is not None:
        raise SystemExit("--vae is for a fresh model; with --init the folder's autoencoder is kept")
    previous = None
    if args.init is not None:
        pipeline, config, previous = _load(args.init)
        autoencoder_record = previous.get("autoencoder")
    else:
        config, vae, autoencoder_record = _autoencoder(args)
        pipeline = build_pipeline(config, seed=args.seed, vae=vae)
    pipeline.vae.eval().requires_grad_(False)  # the autoencoder is trained before, by its own script
    trained = {"transformer": pipeline.transformer, "text_encoder": pipeline.text_encoder,
               "text_encoder_2": pipeline.text_encoder_2, "text_encoder_3": pipeline.text_encoder_3}
    parameters = [p for module in trained.values() for p in module.parameters()]
    for module in trained.values():
        module.train().requires_grad_(True)
    ema = {name: copy.deepcopy(module).eval().requires_grad_(False) for name, module in trained.items()}
    optimizer = torch.optim.AdamW(parameters, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / max(args.warmup, 1)))

    by_task: dict[str, list[dict[str, Any]]] = {task: [] for task in world.TASKS}
    for row in world.training_rows():
        by_task[row["task"]].append(row)
    tasks = list(by_task)
    held_out = world.split()["test"]
    train_probe = [row for k, row in enumerate(world.split()["train"]) if k % 3 == 0]
    print(f"pretraining the shapes model: {sum(p.numel() for p in pipeline.transformer.parameters()):,} transformer "
          f"parameters, {sum(len(v) for v in by_task.values())} training compositions, {len(held_out)} held-out "
          f"prompts; {args.steps} steps of {args.batch_size} on {args.threads} thread(s)", flush=True)

    log: list[dict[str, Any]] = []
    started = time.perf_counter()
    bar = tqdm(range(1, args.steps + 1), desc="pretrain", dynamic_ncols=True, disable=not args.progress)
    running = math.nan
    for step in bar:
        rows = [_pick(rng, by_task, tasks) for _ in range(args.batch_size)]
        # With caption noise, some images are drawn from a row with one attribute changed; the caption stays.
        images = pixels(world.with_caption_noise(rows, args.caption_noise, rng), rng)
        prompts = ["" if rng.random() < args.drop_prompt else row["prompt"] for row in rows]
        with torch.no_grad():
            x0 = pixels_to_latents(pipeline, images)
        conditioning = encode_prompts(pipeline, prompts)
        sigma = torch.sigmoid(torch.randn(args.batch_size, generator=generator))  # logit-normal(0, 1)
        noise = torch.randn(x0.shape, generator=generator)
        s = sigma.view(-1, 1, 1, 1)
        noisy = (1 - s) * x0 + s * noise
        velocity = pipeline.transformer(hidden_states=noisy, timestep=sigma * 1000,
                                        encoder_hidden_states=conditioning["prompt_embeds"],
                                        pooled_projections=conditioning["pooled_prompt_embeds"], return_dict=False)[0]
        loss = F.mse_loss(velocity.float(), noise - x0)
        value = optimizer_step(loss, optimizer, schedule, parameters, trained, ema, step, args.ema)
        running = value if math.isnan(running) else 0.98 * running + 0.02 * value
        bar.set_postfix(loss=f"{running:.4f}")
        if args.log_every and step % args.log_every == 0:
            tqdm.write(f"step {step}: loss {running:.4f}, {time.perf_counter() - started:.0f} s")
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            record = {"step": step, "loss": running, "seconds": time.perf_counter() - started}
            swapped = _swap(pipeline, ema)
            for name, rows_ in (("held_out", held_out), ("train", train_probe)):
                means = evaluate(pipeline, None, rows_, steps=args.eval_steps, guidance=args.eval_guidance,
                                 samples=args.eval_samples, seed=10_000)
                record.update({f"{name}/{key}": value for key, value in means.items()})
            log.append(record)
            tqdm.write(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}))
            # The EMA weights are the checkpoint; writing it at every evaluation keeps a long run's progress.
            _write(pipeline, args, argv, config, log, time.perf_counter() - started, previous, autoencoder_record)
            _swap(pipeline, swapped)

    elapsed = time.perf_counter() - started
    print(f"wrote {args.out} in {elapsed / 60:.1f} min; held-out shapes score "
          f"{log[-1]['held_out/all']:.3f} (eval sampler: {args.eval_steps} steps, CFG {args.eval_guidance})")
    return 0


def optimizer_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, schedule: Any,
                   parameters: list[torch.nn.Parameter], trained: dict[str, torch.nn.Module],
                   ema: dict[str, torch.nn.Module], step: int, ema_decay: float) -> float:
    """One pretraining update shared by the shapes world's scripts: backward, gradients clipped at norm 1, the
    optimizer and learning-rate steps, then the EMA copies ``ema`` moved towards the ``trained`` modules with decay
    min(``ema_decay``, (1 + step) / (10 + step)) (a short warm-up of the average). Returns the loss value."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(parameters, 1.0)
    optimizer.step()
    schedule.step()
    decay = min(ema_decay, (1 + step) / (10 + step))
    with torch.no_grad():
        for name, module in trained.items():
            for shadow, live in zip(ema[name].parameters(), module.parameters(), strict=True):
                shadow.lerp_(live, 1 - decay)
    return loss.item()


def _autoencoder(args: argparse.Namespace) -> tuple[ModelConfig, Any, dict[str, Any] | None]:
    """A fresh model's config, its trained autoencoder (None for the pixel identity) and the autoencoder's record
    (``autoencoder.json``), from ``--vae``."""
    from diffusers import AutoencoderTiny

    if args.vae is None:
        raise SystemExit("--vae is required for a fresh model: a folder written by python -m "
                         "mmrl.plugins.flow.shapes.autoencoder, or 'identity'")
    sizes = {"patch_size": args.patch_size, "layers": args.layers}
    if args.vae == "identity":
        return ModelConfig(vae="identity", **sizes), None, None
    folder = Path(args.vae)
    if not (folder / "autoencoder.json").is_file():
        raise SystemExit(f"--vae {folder}: no autoencoder.json there; give a folder written by python -m "
                         "mmrl.plugins.flow.shapes.autoencoder, or 'identity'")
    vae = AutoencoderTiny.from_pretrained(str(folder))
    record = json.loads((folder / "autoencoder.json").read_text())
    levels = len(vae.config.encoder_block_out_channels)
    config = ModelConfig(vae="tiny", vae_width=vae.config.encoder_block_out_channels[0], vae_levels=levels,
                         latent_channels=vae.config.latent_channels, **sizes)
    return config, vae, record


def _load(folder: Path) -> tuple[Any, ModelConfig, dict[str, Any]]:
    """A pipeline folder written by this script: the pipeline, its model config and its ``pretrain.json``."""
    from diffusers import StableDiffusion3Pipeline

    record_path = Path(folder) / "pretrain.json"
    if not record_path.is_file():
        raise SystemExit(f"--init {folder}: no pretrain.json there; give a pipeline folder written by this script")
    record = json.loads(record_path.read_text())
    pipeline = StableDiffusion3Pipeline.from_pretrained(str(folder))
    return pipeline, ModelConfig(**record["model"]), record


def _write(pipeline: Any, args: argparse.Namespace, argv: list[str] | None, config: ModelConfig,
           log: list[dict[str, Any]], elapsed: float, previous: dict[str, Any] | None = None,
           autoencoder: dict[str, Any] | None = None, script: str = "mmrl.plugins.flow.shapes.pretrain") -> None:
    """Save the pipeline (with the EMA weights swapped in) and ``pretrain.json`` into ``args.out``, atomically:
    a sibling temporary folder, then a rename. ``previous`` (the ``pretrain.json`` of an ``--init`` folder) is kept
    in it, so the record lists every stage of the checkpoint; ``script`` is the module whose command made it."""
    import shutil

    target = Path(args.out)
    staging = target.with_name(target.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    pipeline.save_pretrained(str(staging))
    summary = {
        "command": f"python -m {script} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "model": config.to_dict(),
        "seconds": round(elapsed, 1),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "log": log,
    }
    if autoencoder is not None:
        summary["autoencoder"] = autoencoder
    if previous is not None:
        summary["previous_stage"] = previous
    (staging / "pretrain.json").write_text(json.dumps(summary, indent=1) + "\n")
    previous = target.with_name(target.name + ".old")
    shutil.rmtree(previous, ignore_errors=True)
    if target.exists():
        target.rename(previous)
    staging.rename(target)
    shutil.rmtree(previous, ignore_errors=True)


def _swap(pipeline: Any, modules: dict[str, Any]) -> dict[str, Any]:
    """Put ``modules`` into the pipeline; return the ones they replaced."""
    previous = {name: getattr(pipeline, name) for name in modules}
    for name, module in modules.items():
        setattr(pipeline, name, module)
    return previous


if __name__ == "__main__":
    raise SystemExit(main())
