r"""Deterministic solvers for the untrained tail of a trajectory (pure torch).

MixGRPO-Flash (Li et al. 2025, arXiv:2507.21802) samples the steps after the SDE window with a higher-order ODE
solver on fewer steps: they are not trained, so any sampler of the same ODE will do. Here the tail runs on a subset
of the rollout's own σ grid (so the model sees timesteps of the training schedule):

``"euler"``
    x_{i+1} = x_i − (σ_i − σ_{i+1})·v_i.
``"dpm2m"``
    DPM-Solver++(2M) (Lu et al. 2022, "DPM-Solver++", arXiv:2211.01095, Alg. 2, midpoint form) in the flow
    parameterisation α_σ = 1 − σ, x̂0 = x − σ·v, λ = log(α/σ):

        h_i = λ_{i+1} − λ_i,  r_i = h_{i−1}/h_i,  D_i = (1 + 1/(2r_i))·x̂0_i − 1/(2r_i)·x̂0_{i−1}
        x_{i+1} = (σ_{i+1}/σ_i)·x_i − α_{i+1}·(e^{−h_i} − 1)·D_i

    The first step uses D_0 = x̂0_0, which is exactly the Euler step, and the step to σ = 0 returns x̂0 (first order
    at the end, as diffusers' ``lower_order_final``). One model evaluation per step, like Euler, but second order.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

SOLVERS = ("euler", "dpm2m")


def tail_grid(start: int, num_steps: int, fraction: float) -> list[int]:
    """Indices into the σ grid ``[S+1]`` that the tail from step ``start`` visits: ⌈fraction·(S − start)⌉ steps
    spread evenly over ``start..S`` (both ends included). Empty when ``start == S``."""
    remaining = num_steps - start
    if remaining <= 0:
        return []
    count = max(1, math.ceil(fraction * remaining - 1e-9))
    points = torch.linspace(start, num_steps, count + 1).round().long().unique().tolist()
    return [int(p) for p in points]


def ode_tail(velocity: Callable[[Tensor, int], Tensor], x: Tensor, sigmas: Tensor, grid: list[int],
             solver: str = "euler") -> Tensor:
    """Integrate the flow ODE from σ = ``sigmas[grid[0]]`` to ``sigmas[grid[-1]]`` through the grid points.

    Args:
        velocity: ``velocity(x, i) -> v``, the model at grid index i (σ = sigmas[i]).
        x: ``[B, ...]`` the state at ``sigmas[grid[0]]`` (float32 or float64).
        sigmas: ``[S+1]`` the full σ grid.
        grid: Increasing grid indices (from :func:`tail_grid`).
        solver: ``"euler"`` or ``"dpm2m"``.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown ODE solver {solver!r}; expected one of {', '.join(SOLVERS)}")
    previous_x0: Tensor | None = None
    previous_h: float | None = None
    for here, there in zip(grid[:-1], grid[1:], strict=True):
        sigma, sigma_next = float(sigmas[here]), float(sigmas[there])
        v = velocity(x, here).to(x.dtype)
        x0 = x - sigma * v
        if solver == "euler" or sigma_next == 0.0 or sigma >= 1.0:
            x = x - (sigma - sigma_next) * v  # at σ_next = 0 this is x̂0
            previous_x0, previous_h = x0, None
            continue
        h = _lam(sigma_next) - _lam(sigma)
        if previous_x0 is None or previous_h is None:
            d = x0
        else:
            r = previous_h / h
            d = (1 + 1 / (2 * r)) * x0 - 1 / (2 * r) * previous_x0
        x = (sigma_next / sigma) * x - (1 - sigma_next) * math.expm1(-h) * d
        previous_x0, previous_h = x0, h
    return x


def _lam(sigma: float) -> float:
    return math.log((1 - sigma) / sigma)
