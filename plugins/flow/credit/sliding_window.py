r"""``credit.strategy: sliding_window`` — MixGRPO's SDE window that moves forward as training progresses.

Li et al. 2025, "MixGRPO: Unlocking Flow-based GRPO Efficiency with Mixed ODE-SDE", arXiv:2507.21802. Every sample
takes SDE steps inside a window of W consecutive steps [l, l + W) and ODE (Euler) steps outside it; only the window
is trained, so the whole terminal advantage goes to the window steps and the training cost is W steps per sample.

Window start at training step t (``PromptBatch.step``), within ``window_range`` [lo, hi) (default [0, S − 2)), with
P = ⌊(hi − lo − W)/stride⌋ + 1 positions:

- ``progressive`` (MixGRPO's default): l = lo + stride·(⌊t / shift_every⌋ mod P) with ``roll_back`` (back to lo after
  the last position), l = lo + stride·min(⌊t / shift_every⌋, P − 1) without. ``shift_every: null`` spreads the sweep
  over the run: shift_every = ⌈max_steps / P⌉ (``PromptBatch.max_steps``);
- ``random``: l drawn uniformly from the P positions, from (run seed, t).

Every sample of a training step shares the window (it is a function of t only), so resuming is exact.

The range: MixGRPO's trainer sets ``max_timesteps = sampling_steps - 2`` and trains ``range(cur_timestep,
min(cur_timestep + group_size, max_timesteps))`` (Tencent-Hunyuan/MixGRPO e5cdd6a, ``fastvideo/train_grpo_flux.py:919``,
``fastvideo/utils/grpo_states.py:148``), so its window never reaches step S − 2, nor the last step S − 1, whose
transition is nearly deterministic (SD3.5's 10-step grid: Δσ = 0.0089 there; GRPO-Guard's 1/Δσ weight 8.6). The
default [0, S − 2) is that range; an explicit ``window_range`` may end at S − 1 (Flow-GRPO trains steps 0..S − 2,
``timestep_fraction`` 0.99: yifan123/flow_grpo ac4c86e, ``scripts/train_sd3.py:345``), never at S. Where MixGRPO
differs: near the end of its range it truncates the window (fewer than W steps, and an empty one at
``cur_timestep == max_timesteps``); here the window always has W steps (P full positions), so A is constant.

MixGRPO-Flash: ``solver: dpm2m`` integrates the steps after the window with DPM-Solver++(2M), and ``solver_steps: f``
takes only ⌈f·(S − l − W)⌉ of them (on a subset of the σ grid; :mod:`.solvers`). Neither touches a trained step, so
ratio == 1 is unaffected.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from mmrl.config import ConfigError
from mmrl.plugins.flow.credit.base import CreditStrategy
from mmrl.plugins.flow.credit.solvers import tail_grid
from mmrl.plugins.flow.schedule import StepPlan
from mmrl.rollout import Rollout
from mmrl.seeding import derive_seed

if TYPE_CHECKING:
    from mmrl.plugin import PromptBatch
    from mmrl.plugins.flow.config import FlowPluginConfig
    from mmrl.plugins.flow.credit.config import SlidingWindowCreditConfig
    from mmrl.plugins.flow.sampler import FlowSampler

_RANDOM_WINDOW_TAG = 0x51D3


def window_bounds(options: SlidingWindowCreditConfig, num_steps: int) -> tuple[int, int]:
    """[lo, hi): the steps the window may cover; null is MixGRPO's [0, S − 2) (see the module docstring)."""
    if options.window_range is None:
        return 0, num_steps - 2
    return int(options.window_range[0]), int(options.window_range[1])


def window_start(options: SlidingWindowCreditConfig, num_steps: int, *, step: int, max_steps: int,
                 run_seed: int) -> int:
    """The first SDE step of the window at training step ``step`` (see the module docstring)."""
    lo, hi = window_bounds(options, num_steps)
    positions = (hi - lo - options.size) // options.stride + 1
    if options.schedule == "random":
        generator = torch.Generator().manual_seed(derive_seed(run_seed, step, _RANDOM_WINDOW_TAG))
        return lo + options.stride * int(torch.randint(positions, (1,), generator=generator))
    shift_every = options.shift_every or max(1, math.ceil(max(max_steps, 1) / positions))
    moves = step // shift_every
    moves = moves % positions if options.roll_back else min(moves, positions - 1)
    return lo + options.stride * moves


def window_plan(n: int, num_steps: int, start: int, size: int) -> StepPlan:
    """Every sample: SDE in [start, start + size), ODE elsewhere; the window steps are trained."""
    steps = torch.arange(num_steps)
    stochastic = ((steps >= start) & (steps < start + size)).expand(n, num_steps).clone()
    return StepPlan(step_index=(start + torch.arange(size)).expand(n, size).clone(), stochastic=stochastic)


class SlidingWindowCredit(CreditStrategy):
    """MixGRPO: an SDE window of W steps that slides over the schedule as training progresses."""

    name = "sliding_window"

    def validate(self, config: FlowPluginConfig, path: str) -> None:
        options = config.credit.sliding_window
        steps = config.num_steps
        lo, hi = window_bounds(options, steps)
        if not 0 <= lo < hi <= steps - 1 or hi - lo < options.size:
            default = f" (null is [0, {steps - 2}) with num_steps {steps})" if options.window_range is None else ""
            raise ConfigError(f"{path}.sliding_window.window_range", options.window_range,
                              f"[lo, hi] with 0 <= lo < hi <= {steps - 1} and hi - lo >= size ({options.size}); the "
                              f"last step {steps - 1} is never trained{default}")

    def num_actions(self, config: FlowPluginConfig) -> int:
        return config.credit.sliding_window.size

    def sample(self, sampler: FlowSampler, policy: nn.Module, batch: PromptBatch) -> Rollout:
        options, num_steps = self.credit.sliding_window, self.config.num_steps
        start = window_start(options, num_steps, step=batch.step, max_steps=batch.max_steps,
                             run_seed=sampler.runtime.seed)
        plan = window_plan(len(batch), num_steps, start, options.size)
        tail = None
        if options.solver != "euler" or options.solver_steps < 1.0:
            tail = tail_grid(start + options.size, num_steps, options.solver_steps)
        rollout = sampler.chain_rollout(policy, batch, plan, tail=tail or None, solver=options.solver)
        rollout.metrics["window_start"] = float(start)
        return rollout
