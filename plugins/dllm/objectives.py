"""Ratio-free objectives of masked-diffusion RL, contributed to the core registries through entry points.

mmrl's pyproject.toml declares (as a third-party package would declare its own)

- ``policy_losses["wd1"]`` and ``advantage_estimators["wd1"]``: wd1's weighted likelihood
  (Tang et al. 2025, "wd1: Weighted Policy Optimization for Reasoning in Diffusion Language Models",
  arXiv:2507.08838);
- ``policy_losses["spg"]``: SPG's sandwich of bounds (Wang et al. 2025, "SPG: Sandwiched Policy Gradient for Masked
  Diffusion Language Models", arXiv:2510.09541).

The registries import this module on the first lookup of one of these names; nothing here registers on import.
:meth:`mmrl.plugins.dllm.plugin.DLLMPlugin.check_config` refuses an objective paired with another family's loss.

**wd1.** Per group, with ``A_j = r_j − mean(r)`` (wd1's code does not divide by the std),
``w⁺ = softmax(A/τ)`` and ``w⁻ = softmax(−A/τ)`` over the group, and the loss is
``−Σ_j w⁺_j·ℓ_j + Σ_j w⁻_j·ℓ_j = −Σ_j (w⁺_j − w⁻_j)·ℓ_j`` with ``ℓ_j`` the sequence log-likelihood estimate of the
current policy (wd1: d1's one-step estimate, prompt masked w.p. 0.15). No ratio, no old or reference policy. The
group softmax needs the whole group, but the trainer splits groups over micro-batches and processes, so the weights
are computed where groups are whole — in the advantage step, on the gathered batch: ``advantage: wd1`` returns
``w⁺ − w⁻`` per sample and ``policy_loss: wd1`` is ``−w·ℓ``. wd1 sums the loss over the group (its per-device batch is
one group); mmrl averages over samples, a factor ``1/G`` on the loss (a constant for a fixed group size). Read from
``wd1/trainers/rev_grpo_trainer.py`` at xiaohangt/wd1@0898985: the advantage ``r − mean`` (L628-638), the two
softmaxes over the device batch and the loss ``−Σ w⁺·ℓ + Σ w⁻·ℓ`` with ℓ the completion's summed per-token
log-probs (L144-158); ``rev_grpo_trainer_psr.py`` drops the ``w⁻`` term.

**SPG.** ``loss = −A·Ŝ`` with ``Ŝ`` a lower bound of ``log π`` (ELBO) for samples with ``A > 0`` and an upper bound
(the Rényi EUBO) for ``A ≤ 0``, so that pushing a negative sample down lowers a quantity that bounds its
likelihood from above. SPG's "mix" uses ``ω·EUBO + (1−ω)·ELBO`` for negatives (ω = 0.5; ω = 1 is pure EUBO). The dLLM
plugin with ``objective: spg`` returns two action columns per sample, ``[:, 0]`` = the ELBO and ``[:, 1]`` = the EUBO,
both computed from one set of masked forwards (SPG's code reduces the same per-token log-probabilities two ways).
Advantages are ``r − group mean`` (``advantage: dr_grpo``); no ratio, no clip, no KL.
"""

from __future__ import annotations

from typing import Annotated

import torch
from torch import Tensor

from mmrl.algos.policy_losses import broadcast_advantages, masked_mean
from mmrl.registry import Range

WEIGHT_TOLERANCE = 1e-4


def wd1_weights(rewards: Tensor, group_ids: Tensor, *, temperature: Annotated[float, Range(0, low_open=True)] = 1.0,
                negatives: bool = True) -> Tensor:
    """wd1's sample weights ``w⁺ − w⁻``: group softmaxes of ``±(r − group mean)/τ`` (arXiv:2507.08838).

    A group of one sample, or a group whose rewards are all equal, gets weight 0 (``w⁺ = w⁻``).

    Args:
        temperature: τ > 0 of the softmax (wd1's code: 1).
        negatives: Subtract the negative-sample weights ``w⁻`` (wd1); False keeps ``w⁺`` only (wd1's ``_psr``
            variant, positive-sample reinforcement).

    Shapes:
        rewards ``[N]``, group_ids ``[N]`` → ``[N]``, each in (−1, 1) (in (0, 1] without negatives).
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"wd1 weights take rewards [N] and group_ids [N]; got {tuple(rewards.shape)} and "
                         f"{tuple(group_ids.shape)}")
    if not temperature > 0:
        raise ValueError(f"wd1 temperature must be > 0, got {temperature}")
    r = rewards.to(torch.float64)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    num_groups = counts.numel()
    sums = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add(0, inverse, r)
    advantage = r - (sums / counts.to(r.dtype))[inverse]  # [N]

    def group_softmax(scores: Tensor) -> Tensor:
        peak = torch.full((num_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
        peak = peak.scatter_reduce(0, inverse, scores, reduce="amax")
        exp = (scores - peak[inverse]).exp()
        total = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add(0, inverse, exp)
        return exp / total[inverse]

    positive = group_softmax(advantage / temperature)
    weights = positive - group_softmax(-advantage / temperature) if negatives else positive
    single = counts[inverse] == 1
    return torch.where(single, torch.zeros_like(weights), weights).to(rewards.dtype)


def wd1_policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> tuple[Tensor, dict]:
    """wd1's weighted likelihood: ``L = −w·ℓ`` with ``w`` from ``advantage: wd1`` (no ratio, no clip).

    ``old_logp`` only feeds the diagnostics. The weights must come from the ``wd1`` advantage estimator (``|w| ≤ 1``);
    group-normalised advantages larger than 1 in magnitude raise, since they mean the estimator was not set.

    Shapes:
        logp, old_logp, mask ``[N, A]``; advantages ``[N]`` or ``[N, A]`` → loss ``[N, A]``.
    """
    weights = broadcast_advantages(advantages, logp).to(logp.dtype)  # [N, A]
    active = mask > 0
    if active.any() and float(weights.detach()[active].abs().max()) > 1.0 + WEIGHT_TOLERANCE:
        raise ValueError("policy_loss wd1 takes the softmax weights of `algorithm.advantage: wd1` (|w| <= 1); got "
                         f"advantages up to {float(weights.detach()[active].abs().max()):.3g}")
    loss = -weights * logp
    metrics = {
        "weight_positive_fraction": masked_mean((weights > 0).float(), mask),
        "weight_abs_mean": masked_mean(weights.abs(), mask),
        "logp_mean": masked_mean(logp, mask),
        "approx_kl": masked_mean(0.5 * (logp.detach() - old_logp) ** 2, mask),
    }
    return loss, metrics


def spg_policy_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, mix: Annotated[float, Range(0, 1)] = 0.5
) -> tuple[Tensor, dict]:
    """SPG: ``−A·ELBO`` for ``A > 0``; ``−A·(ω·EUBO + (1−ω)·ELBO)`` for ``A ≤ 0`` (arXiv:2510.09541).

    Column 0 of ``logp`` holds the ELBO (lower bound), column 1 the EUBO (upper bound) of each sample, as the dLLM
    plugin returns them with ``objective: spg``; the per-action loss puts each term on its column, so a
    per-sequence sum (``aggregation: seq_mean_token_sum``) is the SPG loss of the sample. No ratio, no clip.

    Args:
        mix: ω in [0, 1], the weight of the upper bound for non-positive advantages (SPG "mix": 0.5; 1.0: "EUBO"
            only; 0.0: the ELBO for every sample).

    Shapes:
        logp, old_logp, mask ``[N, 2]``; advantages ``[N]`` or ``[N, 2]`` → loss ``[N, 2]``.
    """
    if logp.dim() != 2 or logp.shape[1] != 2:
        raise ValueError(f"policy_loss spg needs two action columns (ELBO, EUBO) per sample, got logp "
                         f"{tuple(logp.shape)}; set plugin.objective: spg")
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"spg mix must be in [0, 1], got {mix}")
    adv = broadcast_advantages(advantages, logp).to(logp.dtype)  # [N, 2]
    positive = adv > 0
    weight_lower = torch.where(positive[:, 0], 1.0, 1.0 - mix).to(logp.dtype)  # [N]
    weight_upper = torch.where(positive[:, 1], 0.0, mix).to(logp.dtype)
    loss = torch.stack([-adv[:, 0] * weight_lower * logp[:, 0], -adv[:, 1] * weight_upper * logp[:, 1]], dim=1)
    row_mask = mask[:, :1]
    metrics = {
        "positive_fraction": masked_mean(positive[:, :1].float(), row_mask),
        "elbo_mean": masked_mean(logp[:, :1], row_mask),
        "eubo_mean": masked_mean(logp[:, 1:], mask[:, 1:]),
        "bound_gap": masked_mean(logp[:, 1:] - logp[:, :1], row_mask),
        "approx_kl": masked_mean(0.5 * (logp.detach() - old_logp) ** 2, mask),
    }
    return loss, metrics


__all__ = ["spg_policy_loss", "wd1_policy_loss", "wd1_weights"]
