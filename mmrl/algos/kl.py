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

``k2_seq`` is k2 of the **sequence** log-ratio instead of each action's: x_i = Σ_a (log π_θ − log π_ref)[i, a], and
every column of row i holds ½·x_i²/A (A the number of columns), so the columns of a row sum to ½·x_i² and their mean
is ½·x_i²/A. ESPO (Ou et al. 2025, arXiv:2512.03759) regularises the sequence ELBO so
(ML-GSAI/ESPO@b5f2dac ``espo/espo_trainer.py`` L197-201: ``compute_approx_kl(elbo, ref_elbo, "k2")`` summed and
divided by ``batch_size * logits_to_keep``, the completion budget; "robust KL regularization" in its trainer's
docstring, L118): k3 of a sequence log-ratio would take ``exp`` of tens of nats, k2 is a polynomial in it.
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


@kl_estimators.register("k2_seq")
def kl_k2_seq(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 of the sequence log-ratio, spread over the columns: ½·(Σ_a (log π_θ − log π_ref)[i, a])² / A in every column
    of row i (ESPO's KL on the sequence ELBO).

    The sequence log-ratio is the sum of the row's columns, so the columns must hold the sequence's log-probs in
    additive form (with ELBO estimators the dLLM plugin's real columns hold ``ELBO / L``, summing to the ELBO); the
    learner zeroes the padding columns of both arguments before the call, and every column of the sequence must be in
    the call (refused with ``algorithm.action_chunk_size``). With ``aggregation:
    seq_mean_token_mean`` each sequence contributes the mean of its columns, ``½·x_i²/A``: ESPO's
    ``k2(ELBO_θ − ELBO_ref) / logits_to_keep`` with A the generation budget (ML-GSAI/ESPO@b5f2dac
    ``espo/espo_trainer.py`` L197-201, ``compute_approx_kl`` L77-108). The gradient is ``x_i/A·∇x_i`` for the whole
    sequence. Each column's log-ratio is clamped to ±20 as in :func:`kl_k2` (per column, before the sum; ESPO does not
    clamp, and with ELBO / L columns the clamp would need a sequence log-ratio of 20·L nats); the sum is not clamped.

    Shapes:
        logp, ref_logp ``[N, A]`` → ``[N, A]`` (every column of a row equal).
    """
    x = _log_ratio(logp, ref_logp).sum(dim=1, keepdim=True)  # [N, 1] the sequence log-ratio
    width = max(logp.shape[1], 1)
    return (0.5 * x**2 / width).expand_as(logp)
