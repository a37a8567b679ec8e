"""The shapes world's latent autoencoder: a small ``AutoencoderTiny`` (diffusers' TAESD class) trained here on the
world's renderings, so that the flow model works in a latent space as SD3 does.

Why a latent space. In pixel space the only thing that tells a square from a circle is a dozen corner pixels; the
Flow-GRPO policy gradient, estimated from a few dozen samples of 3,072-dimensional SDE noise, hardly sees them, and
RL on the pixel model could not move the shape of an object (docs/shapes.md). A 4× downsampling autoencoder with 8
channels turns a 32×32×3 image into 8×8×8 = 512 latent values in which an object is a few latent pixels whose
values the decoder renders as a whole shape: the noise the SDE sampler injects moves shapes, not speckle. (With 4
channels and 1,500 steps of a first try, the decoder blurred corners and squares came back round; 8 channels and a
smaller latent noise reconstruct every held-out rendering, see :func:`reconstruction_scores`.)

The committed checkpoint's autoencoder was made with ``python -m mmrl.plugins.flow.shapes.autoencoder --out FOLDER``
(the defaults; 8 minutes on one core; its ``autoencoder.json`` is copied into the pipeline's ``pretrain.json``).

Training (:func:`train_autoencoder`): images drawn as the pretraining script draws them (every training
composition, with the same share of one-attribute corruptions, so held-out compositions are never seen), mean
squared plus absolute error of the reconstruction in [-1, 1], a small L2 penalty on the latents (keeps them from
drifting in scale), and decoder inputs perturbed with Gaussian noise of a random scale up to ``latent_noise`` so
that the decoder renders clean shapes from the slightly-off latents a flow model produces. AdamW with a cosine
decay. Afterwards :func:`calibrate` sets ``shift_factor`` and ``scaling_factor`` to the latents' mean and inverse
standard deviation (SD3's convention: the flow model sees (z − shift)·scale, with unit variance, like its noise).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from mmrl.plugins.flow.shapes import world


def build_autoencoder(width: int = 32, latent_channels: int = 8, levels: int = 3) -> Any:
    """An untrained ``AutoencoderTiny``: ``levels`` resolutions (downsampling 2^(levels−1)), ``width`` channels,
    ``latent_channels`` latent channels; one residual block per level except the encoder's first and the decoder's
    last (full resolution is where a CPU spends its time)."""
    from diffusers import AutoencoderTiny

    if levels < 1:
        raise ValueError(f"levels must be at least 1, got {levels}")
    return AutoencoderTiny(
        in_channels=3, out_channels=3, latent_channels=latent_channels, act_fn="relu",
        encoder_block_out_channels=(width,) * levels, num_encoder_blocks=(0,) + (1,) * (levels - 1),
        decoder_block_out_channels=(width,) * levels, num_decoder_blocks=(1,) * (levels - 1) + (0,),
        scaling_factor=1.0, shift_factor=0.0,
    )


def pixels(rows: list[dict[str, Any]], rng: np.random.Generator) -> torch.Tensor:
    """``[N, 3, R, R]`` renderings of ``rows`` (a random layout each) in [0, 1]."""
    return torch.from_numpy(world.sample_images(rows, rng)).permute(0, 3, 1, 2).float() / 255


def _draw(rows: list[dict[str, Any]], count: int, caption_noise: float, rng: np.random.Generator) -> torch.Tensor:
    """``[count, 3, R, R]`` renderings in [0, 1] of random ``rows`` (one attribute changed with ``caption_noise``)."""
    picked = [rows[int(rng.integers(len(rows)))] for _ in range(count)]
    return pixels(world.with_caption_noise(picked, caption_noise, rng), rng)


def train_autoencoder(vae: Any, *, steps: int, batch_size: int = 32, lr: float = 3e-3, latent_noise: float = 0.05,
                      latent_penalty: float = 1e-3, caption_noise: float = 0.5, seed: int = 0,
                      progress: bool = True) -> list[dict[str, float]]:
    """Train ``vae`` in place on renderings of the training compositions (module docstring); returns the loss
    every 100 steps as ``{"step", "loss"}`` records."""
    if steps < 1 or batch_size < 1:
        raise ValueError(f"train_autoencoder: steps and batch_size must be >= 1, got {steps} and {batch_size}")
    if latent_noise < 0 or not 0 <= caption_noise < 1:
        raise ValueError(f"train_autoencoder: latent_noise must be >= 0 and caption_noise in [0, 1), got "
                         f"{latent_noise} and {caption_noise}")
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    rows = world.training_rows()
    vae.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: 0.5 * (1 + math.cos(math.pi * min(k, steps) / steps)))  # cosine to 0
    log: list[dict[str, float]] = []
    running = math.nan
    bar = tqdm(range(1, steps + 1), desc="autoencoder", dynamic_ncols=True, disable=not progress)
    for step in bar:
        x = _draw(rows, batch_size, caption_noise, rng) * 2 - 1  # [B, 3, R, R] in [-1, 1]
        z = vae.encoder(x)  # [B, C, R/f, R/f]
        scale = latent_noise * torch.rand(batch_size, 1, 1, 1, generator=generator)
        reconstruction = vae.decoder(z + scale * torch.randn(z.shape, generator=generator))
        loss = (F.mse_loss(reconstruction, x) + F.l1_loss(reconstruction, x)
                + latent_penalty * z.pow(2).mean())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        value = loss.item()
        running = value if math.isnan(running) else 0.98 * running + 0.02 * value
        bar.set_postfix(loss=f"{running:.4f}")
        if step % 100 == 0 or step == steps:
            log.append({"step": step, "loss": running})
    vae.eval().requires_grad_(False)
    return log


@torch.no_grad()
def calibrate(vae: Any, *, samples: int = 1024, seed: int = 1) -> dict[str, float]:
    """Set ``shift_factor`` and ``scaling_factor`` so that (z − shift)·scale has mean 0 and standard deviation 1 over
    ``samples`` renderings of the training compositions; returns the two values."""
    rng = np.random.default_rng(seed)
    z = vae.encoder(_draw(world.training_rows(), samples, 0.0, rng) * 2 - 1)
    shift, std = z.mean().item(), z.std().item()
    if not math.isfinite(std) or std <= 0:
        raise ValueError(f"the autoencoder's latents have standard deviation {std}; it did not train")
    vae.register_to_config(shift_factor=shift, scaling_factor=1.0 / std)
    return {"shift_factor": shift, "scaling_factor": 1.0 / std}


@torch.no_grad()
def reconstruction_scores(vae: Any, rows: list[dict[str, Any]], *, samples: int = 4, seed: int = 2) -> dict[str, float]:
    """The ``shapes`` score of renderings of ``rows`` after encoding and decoding (1.0 is a perfect autoencoder for
    the reward), with and without latent noise of the flow model's scale (0.1 of the latents' deviation)."""
    from mmrl.plugins.flow.shapes.sampling import score

    rng = np.random.default_rng(seed)
    repeated = [row for row in rows for _ in range(samples)]
    x = pixels(repeated, rng)
    z = vae.encoder(x * 2 - 1)
    noisy = z + 0.1 * z.std() * torch.randn(z.shape, generator=torch.Generator().manual_seed(seed))
    out = {}
    for name, latents in (("reconstruction", z), ("reconstruction_noisy", noisy)):
        images = ((vae.decoder(latents) + 1) / 2).clamp(0, 1)
        out[name] = score(repeated, images).mean().item()
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m mmrl.plugins.flow.shapes.autoencoder --out FOLDER``: train, calibrate and save the autoencoder
    (``AutoencoderTiny.from_pretrained(FOLDER)`` loads it; the pretraining script takes it with ``--vae``)."""
    import argparse
    import json
    import time
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m mmrl.plugins.flow.shapes.autoencoder",
                                     description="Train the shapes world's latent autoencoder.")
    parser.add_argument("--out", type=Path, required=True, help="Folder to write (save_pretrained).")
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--latent-noise", type=float, default=0.05,
                        help="Largest scale of the Gaussian noise added to the decoder's input in training.")
    parser.add_argument("--caption-noise", type=float, default=0.5,
                        help="Share of renderings with one attribute changed (the pretraining images' mix).")
    parser.add_argument("--latent-channels", type=int, default=8)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--levels", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads.")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    vae = build_autoencoder(args.width, args.latent_channels, args.levels)
    log = train_autoencoder(vae, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                            latent_noise=args.latent_noise, caption_noise=args.caption_noise, seed=args.seed,
                            progress=args.progress)
    record: dict[str, Any] = {"command": "python -m mmrl.plugins.flow.shapes.autoencoder " + " ".join(
        argv if argv is not None else sys.argv[1:]), "args": {
        key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}}
    record.update(calibrate(vae))
    record.update(reconstruction_scores(vae, world.split()["test"]))
    record["loss"] = log[-1]["loss"] if log else math.nan
    record["seconds"] = round(time.perf_counter() - started, 1)
    vae.save_pretrained(str(args.out))
    (Path(args.out) / "autoencoder.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}: held-out renderings score {record['reconstruction']:.3f} after encoding and "
          f"decoding ({record['reconstruction_noisy']:.3f} with latent noise), {record['seconds'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
