"""Which actions the policy term trains: the high-entropy minority (``algorithm.top_entropy_quantile``).

Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective Reinforcement Learning for
LLM Reasoning" (arXiv:2506.01939), train the policy gradient only on the top ρ = 20% of tokens by the entropy of the
policy's next-token distribution. TRL's GRPO trainer offers it as ``top_entropy_quantile`` ρ
(huggingface/trl@f2cd577 ``trl/trainer/grpo_trainer.py:1396-1432`` ``get_high_entropy_mask``: the threshold is
``torch.quantile`` (linear interpolation) at 1 − ρ of the active tokens' entropies of the micro-batch, gathered over
the processes; a token is kept when its entropy is at least the threshold; ``:3114-3115`` multiplies the policy
term by the mask before β·KL is added; ``:3156-3158`` restricts the entropy bonus to the same tokens; the loss
denominators still count every active token). mmrl computes the same mask, per micro-batch (per backward pass),
over all processes (:class:`mmrl.trainer.learn.Learner`).
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


__all__ = ["entropy_threshold", "high_entropy_mask"]
