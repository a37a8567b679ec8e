r"""GRPO-Guard's ratio normalisation (RatioNorm), a loss option of every strategy (``credit.ratio_norm: true``).

Wang et al. 2025, "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching via Regulated Clipping",
arXiv:2510.22319. For a Gaussian step x' ~ N(μ, s²·I) with per-element log-densities ℓ (averaged over the D latent
elements, as Flow-GRPO does), x' = μ_old + s·z and d = μ_θ − μ_old:

    ℓ_θ − ℓ_old = mean(z·d)/s − mean(d²)/(2s²).

The second term makes the log-ratio negative on average (the ratio's mean falls below 1, worst at the small-s,
low-noise steps), so PPO's upper clip rarely binds for positive advantages. RatioNorm removes it and rescales by s:

    log r' = s·(ℓ_θ − ℓ_old) + mean(d²)/(2s) = mean(z·d),

a log-ratio of mean 0 under the sampling policy whose scale no longer depends on the step's noise. It is exactly 0
on policy (d = 0, ℓ_θ = ℓ_old), and its gradient there is s·∇ℓ_θ (the mean(d²) term has zero gradient at d = 0).
The same form is used by Flow-Factory's GRPOGuardTrainer (X-GenGroup/Flow-Factory a0b2bc5,
``src/flow_factory/trainers/grpo.py:501-504``) and verl-omni's ``grpo_guard`` loss (verl-project/verl-omni a1139baf,
``verl_omni/trainer/diffusion/diffusion_algos.py:527-538``). The paper's second ingredient, the per-step gradient
reweighting by 1/Δσ, is ``credit.ratio_norm_reweight`` (:func:`.base.guard_reweighting`).

mmrl's core computes the ratio as exp(logp − old_logp), so the plugin returns
logp' = old_logp + mean((x' − μ_old)·(μ_θ − μ_old))/s from its forward (:func:`ratio_norm_log_ratio`; gradients flow
through μ_θ), the same value and gradient as old_logp + s·(ℓ_θ − ℓ_old) + mean(d²)/(2s) (:func:`ratio_norm_logp`).
The old transition means μ_old are stored in ``replay["means"]`` at sampling time; ``algorithm.recompute_old_logp``
replaces them by the recomputed ones (``PolicyOutput.replay``), so that the ratio is 1 on policy. Both reference
implementations take μ_old from the sampler and have no recompute of the old policy.
"""

from __future__ import annotations

import torch
from torch import Tensor


def ratio_norm_logp(logp: Tensor, old_logp: Tensor, mean: Tensor, old_mean: Tensor, std: Tensor) -> Tensor:
    """logp' with logp' − old_logp = s·(logp − old_logp) + mean((μ − μ_old)²)/(2s).

    Args:
        logp: ``[n]`` per-element-mean log-density under the current policy (with gradients).
        old_logp: ``[n]`` the same under the sampling policy.
        mean: ``[n, *latent]`` μ_θ (with gradients).
        old_mean: ``[n, *latent]`` μ_old, stored at sampling time.
        std: ``[n]`` or ``[n, 1, ..., 1]`` the transition std s (> 0).
    """
    n = logp.shape[0]
    s = std.reshape(n).to(logp.dtype)
    old = old_logp.detach().to(logp.dtype)
    mse = (mean - old_mean.detach().to(mean.dtype)).pow(2).reshape(n, -1).mean(dim=1).to(logp.dtype)
    safe = torch.where(s > 0, s, torch.ones_like(s))  # a deterministic step (std 0) has no ratio: keep it at 1
    return torch.where(s > 0, old + safe * (logp - old) + mse / (2 * safe), old + 0 * logp)


def ratio_norm_log_ratio(action: Tensor, mean: Tensor, old_mean: Tensor, std: Tensor) -> Tensor:
    """RatioNorm's log-ratio log r' = mean((x' − μ_old)·(μ_θ − μ_old))/s, a function of the old means alone.

    It equals ``ratio_norm_logp(logp, old_logp, ...) − old_logp`` in value and gradient whenever ``old_logp`` is the
    log-density of x' under μ_old (expand the two Gaussian log-densities), but reads neither log-density: the ratio
    then depends on the old policy only through the stored means, so a recompute of the old policy
    (``algorithm.recompute_old_logp``) that refreshes the means gives ratio 1 on policy whatever it stores as
    old_logp. Computed directly it also avoids the cancellation of two log-densities of scale 1/(2s²).

    Args:
        action: ``[n, *latent]`` the stored x'.
        mean: ``[n, *latent]`` μ_θ (with gradients).
        old_mean: ``[n, *latent]`` μ_old.
        std: ``[n]`` or ``[n, 1, ..., 1]`` the transition std s.

    Returns:
        ``[n]`` log r' (0 where s = 0: a deterministic step has no ratio).
    """
    n = mean.shape[0]
    s = std.reshape(n).to(mean.dtype)
    old = old_mean.detach().to(mean.dtype)
    noise = (action.detach().to(mean.dtype) - old).reshape(n, -1)  # s·z
    drift = (mean - old).reshape(n, -1)  # d
    safe = torch.where(s > 0, s, torch.ones_like(s))
    value = (noise * drift).mean(dim=1) / safe
    return torch.where(s > 0, value, torch.zeros_like(value))
