"""Sampling and scoring the shapes world's model outside the trainer (pretraining evaluations, the report).

:func:`sample` draws images exactly as the flow plugin's evaluation does (the plain Euler ODE on the scheduler's σ
grid, true classifier-free guidance through the SD3 adapter's ``velocity``), only with its own noise seeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def sample(pipeline: Any, prompts: Sequence[str], *, num_steps: int, guidance_scale: float, seed: int,
           max_sequence_length: int = 12, batch_size: int = 64, transformer: Any = None) -> Tensor:
    """``[N, 3, R, R]`` images in [0, 1] for ``prompts`` (one each), the noise of sample k drawn from a generator
    seeded with ``seed + k``; ``transformer`` overrides the pipeline's (e.g. a training copy)."""
    from mmrl.plugins.flow.adapters.sd3 import SD3Adapter
    from mmrl.plugins.flow.sde import sde_step
    from mmrl.plugins.flow.shapes.world import RESOLUTION

    adapter = SD3Adapter(pipeline, torch.device("cpu"))
    adapter.set_size(RESOLUTION, RESOLUTION)  # the world's square images
    module = transformer if transformer is not None else pipeline.transformer
    sigmas, timesteps = adapter.schedule(num_steps)
    negative = adapter.encode_negative_prompt("", max_sequence_length) if guidance_scale != 1.0 else None
    out = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            chunk = list(prompts[start:start + batch_size])
            n = len(chunk)
            conditioning = adapter.encode_prompts(chunk, max_sequence_length)
            latents = torch.cat([
                torch.randn((1, *adapter.noise_shape()), generator=torch.Generator().manual_seed(seed + k))
                for k in range(start, start + n)
            ])
            for s in range(num_steps):
                velocity = adapter.velocity(module, latents, timesteps[s].expand(n), conditioning,
                                            guidance_scale=guidance_scale, negative=negative)
                latents = sde_step("ode", velocity, latents, sigmas[s], sigmas[s + 1], noise_level=0.0).prev_sample
            out.append(adapter.decode(latents))
    return torch.cat(out)


def score(rows: Sequence[dict[str, Any]], images: Tensor, strict: bool = False) -> Tensor:
    """``[N]`` shapes-reward scores of ``images`` for ``rows``."""
    from mmrl.reward import RewardInput
    from mmrl.rewards.shapes import ShapesReward

    return ShapesReward(strict=strict)(RewardInput(rows=list(rows), payload={"images": images}))


def task_means(rows: Sequence[dict[str, Any]], scores: Tensor) -> dict[str, float]:
    """Mean score per task and overall."""
    means: dict[str, list[float]] = {}
    for row, value in zip(rows, scores.tolist(), strict=True):
        means.setdefault(row["task"], []).append(value)
    out = {task: sum(values) / len(values) for task, values in means.items()}
    out["all"] = float(scores.mean())
    return out
