"""Which denoising steps of a rollout are stochastic and which are trained (pure torch, no diffusers).

A rollout of S steps runs each sample through steps 0..S−1 (σ from 1 down to 0). Three published schemes decide
which steps carry a trained action:

``"fraction"`` (Flow-GRPO, Liu et al. 2025, arXiv:2505.05470)
    SDE at every step; the first ⌊S·timestep_fraction⌋ steps are trained (0.99 with 10 steps trains 9, dropping the
    last, nearly deterministic step).
``"random"`` (DanceGRPO, Xue et al. 2025, arXiv:2505.07818)
    SDE at every step; each sample trains its own random ⌊(S−1)·timestep_fraction⌋ of the steps 0..S−2 (the last
    step is never trained; DanceGRPO uses timestep_fraction 0.6), drawn from the sample's seed.
``"window"`` (Flow-GRPO-Fast, flow_grpo README; MixGRPO's sliding window is the same idea, with a window that moves as
training progresses: ``plugin.credit.strategy: sliding_window``)
    SDE only inside a window of ``window_size`` consecutive steps, ODE before and after it; the window steps are
    trained. The window starts uniformly in [lo, hi − window_size] (default range [0, S/2), the high-noise half),
    drawn once per group so that all samples of a prompt explore at the same steps.

The action axis of the rollout contract holds the trained steps only: column j of a sample is its j-th trained
step, ``step_index[n, j]``. Every sample has the same number A of trained steps, so the mask is all ones and no
forward pass is spent on untrained steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.seeding import derive_seed

STEP_SELECTIONS: tuple[str, ...] = ("fraction", "random", "window")

_RANDOM_STEPS_TAG = 0x57E9  # separates the step draw from the sample's noise stream
_WINDOW_TAG = 0x3A1D


@dataclass(frozen=True)
class StepPlan:
    """The steps of one rollout batch.

    Attributes:
        step_index: ``[n, A]`` long, the denoising step of each action column, increasing along a row.
        stochastic: ``[n, S]`` bool, whether the sample takes an SDE step (True) or an ODE step at each step.
    """

    step_index: Tensor
    stochastic: Tensor

    @property
    def num_actions(self) -> int:
        return int(self.step_index.shape[1])

    def columns_at(self, step: int) -> list[tuple[int, Tensor | None]]:
        """The action columns that hold step ``step``, each with the rows whose column it is (None: every row)."""
        hits = self.step_index == step  # [n, A]
        columns = []
        for column in hits.any(dim=0).nonzero().flatten().tolist():
            rows = hits[:, column]
            columns.append((column, None if bool(rows.all()) else rows.nonzero().flatten()))
        return columns


def trained_step_count(selection: str, num_steps: int, *, timestep_fraction: float, window_size: int) -> int:
    """A, the number of trained steps per sample (the plugin's action budget)."""
    if selection == "fraction":
        return int(num_steps * timestep_fraction)
    if selection == "random":
        return int((num_steps - 1) * timestep_fraction)
    if selection == "window":
        return window_size
    raise ValueError(f"unknown step selection {selection!r}; expected one of {', '.join(STEP_SELECTIONS)}")


def default_window_range(num_steps: int, window_size: int) -> tuple[int, int]:
    """Flow-GRPO-Fast's ``sde_window_range`` default: the first half of the steps, widened to fit the window."""
    return 0, min(num_steps, max(num_steps // 2, window_size))


def plan_steps(
    selection: str,
    num_steps: int,
    *,
    seeds: Tensor,
    group_ids: Tensor,
    run_seed: int,
    timestep_fraction: float,
    window_size: int,
    window_range: tuple[int, int] | None = None,
) -> StepPlan:
    """The :class:`StepPlan` of n samples.

    Args:
        selection: ``"fraction"``, ``"random"`` or ``"window"`` (module docstring).
        num_steps: S, denoising steps of the rollout.
        seeds: ``[n]`` per-sample seeds (``PromptBatch.seeds``): the random-mode draw depends on these only.
        group_ids: ``[n]`` group of each sample: the window start depends on (run_seed, group id) only.
        run_seed: The run's base seed.
        timestep_fraction: Fraction of steps trained (fraction and random modes).
        window_size: Steps in the SDE window (window mode).
        window_range: ``(lo, hi)``: the window lies within steps lo..hi−1 (default :func:`default_window_range`).
    """
    n = int(seeds.shape[0])
    count = trained_step_count(selection, num_steps, timestep_fraction=timestep_fraction, window_size=window_size)
    if not 1 <= count <= num_steps:
        raise ValueError(f"{selection!r} step selection trains {count} of {num_steps} steps; it must train 1..S")
    stochastic = torch.ones(n, num_steps, dtype=torch.bool)
    if selection == "fraction":
        step_index = torch.arange(count).expand(n, count).clone()
    elif selection == "random":
        rows = []
        for seed in seeds.tolist():
            generator = torch.Generator().manual_seed(derive_seed(int(seed), _RANDOM_STEPS_TAG))
            rows.append(torch.randperm(num_steps - 1, generator=generator)[:count].sort().values)
        step_index = torch.stack(rows)
    else:
        lo, hi = window_range if window_range is not None else default_window_range(num_steps, window_size)
        if not 0 <= lo < hi <= num_steps or hi - lo < window_size:
            raise ValueError(f"window range [{lo}, {hi}) cannot hold a window of {window_size} of {num_steps} steps")
        starts = []
        for group in group_ids.tolist():
            generator = torch.Generator().manual_seed(derive_seed(run_seed, int(group), _WINDOW_TAG))
            starts.append(int(torch.randint(lo, hi - window_size + 1, (1,), generator=generator)))
        start = torch.tensor(starts, dtype=torch.long).unsqueeze(1)  # [n, 1]
        step_index = start + torch.arange(window_size)  # [n, W]
        steps = torch.arange(num_steps)  # [S]
        stochastic = (steps >= start) & (steps < start + window_size)  # [n, S]
    return StepPlan(step_index=step_index.long(), stochastic=stochastic)
