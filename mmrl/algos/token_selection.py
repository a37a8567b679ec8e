"""Which actions the policy term trains: the high-entropy minority (``algorithm.top_entropy_quantile``) and the
sequences that stay close enough to the policy that sampled them (``algorithm.off_policy_mask_threshold``).

High-entropy minority. Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective
Reinforcement Learning for LLM Reasoning" (arXiv:2506.01939), train the policy gradient only on the top ρ = 20% of
tokens by the entropy of the policy's next-token distribution. TRL's GRPO trainer offers it as ``top_entropy_quantile``
ρ (huggingface/trl@f2cd577 ``trl/trainer/grpo_trainer.py:1396-1432`` ``get_high_entropy_mask``: the threshold is
``torch.quantile`` (linear interpolation) at 1 − ρ of the active tokens' entropies of the micro-batch, gathered over the
processes; a token is kept when its entropy is at least the threshold; ``:3114-3115`` multiplies the policy term by the
mask before β·KL is added; ``:3156-3158`` restricts the entropy bonus to the same tokens; the loss denominators still
count every active token). mmrl computes the same mask, per micro-batch (per backward pass), over all processes
(:class:`mmrl.trainer.learn.Learner`).

Off-policy sequence masking (OPSM). DeepSeek-AI 2025, "DeepSeek-V3.2" (arXiv:2512.02556, eq. (9)): a sequence
whose advantage is negative and whose sampled tokens the current policy has moved away from, by a mean log-ratio
(1/|o_i|)·Σ_t log(π_old(o_t)/π_θ(o_t)) above δ, is left out of the policy term: M_{i,t} = 0 if A_{i,t} < 0 and the
mean exceeds δ, else 1. The mean is a one-sample estimate of KL(π_old‖π_θ) on the sequence's own tokens; negative
samples far off-policy are the ones whose gradient misleads most. TRL ships it as ``off_policy_mask_threshold``
(huggingface/trl@f2cd577 ``trl/trainer/grpo_trainer.py:2920-2940`` ``get_off_policy_mask``, applied at
``:3111-3112`` to the policy term only, before the KL term is added; the entropy bonus and the loss denominators keep
every token). TRL compares with the inference engine's log-probs when vLLM sampled, else the old policy's; mmrl's
sampler is the policy itself, so π_old is the rollout's ``old_logp`` (or the old-policy pass), as TRL without vLLM.
For per-action advantages (flow's per-step credit) the rule is applied per action, with the row's one mean.
"""

from __future__ import annotations

import torch
from torch import Tensor


def entropy_threshold(values: Tensor, quantile: float) -> Tensor | None:
    """The ``quantile`` (in [0, 1]) of ``values`` (1-D, the active tokens' entropies) by ``torch.quantile``'s linear
    interpolation, as a 0-dim float32 tensor; None when ``values`` is empty."""
    if values.numel() == 0:
        return None
    return torch.quantile(values.float(), quantile)


def high_entropy_mask(entropy: Tensor, mask: Tensor, threshold: Tensor | None) -> Tensor:
    """``[N, A]`` bool: the active actions whose entropy is at least ``threshold`` (none when it is None).

    Args:
        entropy: ``[N, A]`` per-action entropy of the policy (detached).
        mask: ``[N, A]`` 1 for active actions.
        threshold: From :func:`entropy_threshold` over the active entropies that share it.
    """
    active = mask > 0
    if threshold is None:
        return torch.zeros_like(active)
    return (entropy.float() >= threshold.to(entropy.device)) & active


def off_policy_sequence_mask(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, threshold: float
                             ) -> tuple[Tensor, Tensor]:
    """OPSM's keep mask (DeepSeek-V3.2 eq. (9)): an action is kept unless its advantage is negative and its row's mean
    log(π_old/π_θ) over the active actions exceeds ``threshold`` δ.

    Args:
        logp: ``[N, A]`` current log-probs (detached here: the mask is a constant of the loss).
        old_logp: ``[N, A]`` log-probs of the policy that sampled.
        advantages: ``[N]`` or ``[N, A]``.
        mask: ``[N, A]`` 1 for active actions; padding enters neither the mean nor the result.
        threshold: δ >= 0 (TRL's example: 0.5). On-policy the mean is 0 and nothing is dropped.

    Returns:
        ``(keep [N, A] bool, divergence [N] float32)``: the actions the policy term keeps (active ones only) and each
        row's mean log-ratio (0 for a row with no active action).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # [N, 1]
    active = mask > 0  # [N, A]
    weights = active.to(torch.float32)
    log_gap = (old_logp.detach().float() - logp.detach().float()).where(active, 0.0)  # [N, A]
    divergence = log_gap.sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)  # [N]
    far = divergence > threshold  # [N]
    keep = ~((advantages < 0) & far.unsqueeze(1)) & active  # [N, A]
    return keep, divergence


__all__ = ["entropy_threshold", "high_entropy_mask", "off_policy_sequence_mask"]
