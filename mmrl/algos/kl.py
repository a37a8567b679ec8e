"""Per-action KL estimators ``fn(logp[N,A], ref_logp[N,A]) -> [N,A]`` for KL(π_θ ‖ π_ref).

With x = log π_θ(a) − log π_ref(a) on actions a sampled from π_θ (Schulman 2020, "Approximating KL Divergence",
http://joschu.net/blog/kl-approx.html):

- k1 = x: unbiased, high variance, can be negative;
- k2 = ½·x²: biased, low variance; its gradient is the gradient of the true KL to first order;
- k3 = e^{−x} + x − 1 = (π_ref/π_θ) − log(π_ref/π_θ) − 1: unbiased and always ≥ 0 (GRPO, Shao et al. 2024,
  arXiv:2402.03300, eq. (4)).

x is clamped to ±20 first so that k3's exponential stays finite, as verl clamps it before k3 (``kl_penalty_forward``,
``verl/trainer/ppo/core_algos.py`` L1890-1896 at volcengine/verl@b178a3c); verl then also clamps k3 itself to
[−10, 10], which zeroes its gradient wherever k3 > 10 (π_ref/π_θ above ~14, or π_θ/π_ref above e^11). mmrl does
not: there the KL term is what should pull the policy back. TRL computes k3 without any clamp
(``trl/trainer/grpo_trainer.py`` L3068-3073 at huggingface/trl@f2cd577); within ±20 mmrl's k3 is TRL's. The clamp
also applies to k1 and k2 (verl clamps neither), where it only matters beyond |x| = 20. A plugin may skip these and
return its own per-action KL (the flow plugin uses the closed-form KL between Gaussian means).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from mmrl.algos.ratios import LOG_RATIO_CLAMP
from mmrl.registry import Registry

kl_estimators: Registry[Callable[[Tensor, Tensor], Tensor]] = Registry("KL estimator",
                                                                    entry_point_group="mmrl.kl_estimators")


def _log_ratio(logp: Tensor, ref_logp: Tensor) -> Tensor:
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp and ref_logp must share one shape; got {tuple(logp.shape)}, {tuple(ref_logp.shape)}")
    return (logp - ref_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


@kl_estimators.register("k1")
def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log π_θ − log π_ref (unbiased, can be negative).

    Shapes:
        logp, ref_logp ``[N, A]`` → ``[N, A]``.
    """
    return _log_ratio(logp, ref_logp)


@kl_estimators.register("k2")
def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = ½·(log π_θ − log π_ref)² (low variance; gradient-correct to first order).

    Shapes:
        logp, ref_logp ``[N, A]`` → ``[N, A]``.
    """
    return 0.5 * _log_ratio(logp, ref_logp) ** 2


@kl_estimators.register("k3")
def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = π_ref/π_θ − log(π_ref/π_θ) − 1 (unbiased, non-negative; GRPO's estimator).

    Shapes:
        logp, ref_logp ``[N, A]`` → ``[N, A]``.
    """
    x = _log_ratio(logp, ref_logp)
    return (-x).exp() + x - 1.0
