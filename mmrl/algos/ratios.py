"""Importance-ratio levels: per action, per chunk of actions, or per sequence.

The clipped losses take ``log r`` as an ``[N, A]`` tensor where every action carries the log-ratio of the unit it
belongs to. At the token level that unit is the action itself; at the chunk and sequence levels it is the masked
*mean* of the per-action log-ratios over the unit, i.e. the log of the geometric mean of the per-action ratios.

References:
    GSPO — Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071, eq. (7):
        s_i = exp((1/|o_i|) Σ_t log(π_θ/π_old)).
    Chunk-GRPO — "Sample By Step, Optimize By Chunk" (2025), arXiv:2510.21583: the same geometric
        mean taken over a chunk of consecutive denoising steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

RATIO_LEVELS = ("token", "chunk", "sequence")

# exp(±20) is 5e8: far outside any clip range, and finite in float32. verl clamps the token-level log-ratio at the same
# value (core_algos.py L1212 at volcengine/verl@b178a3c) and GSPO's sequence log-ratio at +10 only (L1298); TRL does
# not clamp (grpo_trainer.py L3055-3066 at huggingface/trl@f2cd577). The clamp changes a clipped loss only where a
# ratio leaves [e^-20, e^20] (a negative advantage's unclipped side past e^20 without dual-clip, or a vanishing ratio):
# numerical failures, not signal.
LOG_RATIO_CLAMP = 20.0


def log_ratio(
    logp: Tensor,
    old_logp: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    chunk_ids: Tensor | None = None,
) -> Tensor:
    """Log importance ratio at the requested level, broadcast back to every action.

    Args:
        logp: ``[N, A]`` log-probs under the current policy (with gradients).
        old_logp: ``[N, A]`` log-probs under the policy that sampled the actions.
        mask: ``[N, A]`` 1 for actions that count, 0 for padding. Masked actions do not enter unit means.
        level: ``"token"``, ``"chunk"`` or ``"sequence"``.
        chunk_ids: ``[N, A]`` integer chunk index of every action (required for ``"chunk"``). Chunks are per
            sequence: the same id in two rows names two different chunks.

    Returns:
        ``[N, A]`` log-ratio, clamped to ±20 before any exponentiation by the caller.
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape or logp.dim() != 2:
        raise ValueError(
            f"logp, old_logp and mask must share one [N, A] shape; got {tuple(logp.shape)}, "
            f"{tuple(old_logp.shape)}, {tuple(mask.shape)}"
        )
    delta = logp - old_logp.detach()  # [N, A]
    weights = mask.to(delta.dtype)  # [N, A]
    if level == "token":
        unit_delta = delta
    elif level == "sequence":
        count = weights.sum(dim=1, keepdim=True).clamp(min=1.0)  # [N, 1]
        unit_delta = ((delta * weights).sum(dim=1, keepdim=True) / count).expand_as(delta)  # [N, A]
    elif level == "chunk":
        if chunk_ids is None:
            raise ValueError("ratio level 'chunk' needs chunk_ids [N, A] from the rollout; the plugin provided none")
        if chunk_ids.shape != delta.shape:
            raise ValueError(f"chunk_ids must be [N, A] = {tuple(delta.shape)}, got {tuple(chunk_ids.shape)}")
        unit_delta = _chunk_mean(delta, weights, chunk_ids)
    else:
        raise ValueError(f"ratio level must be one of {RATIO_LEVELS}, got {level!r}")
    return unit_delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _chunk_mean(delta: Tensor, weights: Tensor, chunk_ids: Tensor) -> Tensor:
    """Masked mean of ``delta`` over each (row, chunk) unit, broadcast back to ``[N, A]``."""
    num_rows, num_actions = delta.shape
    _, dense = torch.unique(chunk_ids, return_inverse=True)  # [N, A] in 0..C-1
    num_chunks = int(dense.max().item()) + 1 if dense.numel() else 1
    rows = torch.arange(num_rows, device=delta.device).unsqueeze(1)  # [N, 1]
    unit = (rows * num_chunks + dense).flatten()  # [N*A] global (row, chunk) index
    num_units = num_rows * num_chunks
    sums = torch.zeros(num_units, dtype=delta.dtype, device=delta.device).index_add(
        0, unit, (delta * weights).flatten()
    )  # [U], differentiable w.r.t. delta
    counts = torch.zeros(num_units, dtype=delta.dtype, device=delta.device).index_add(0, unit, weights.flatten())
    means = sums / counts.clamp(min=1.0)  # [U]
    return means[unit].view(num_rows, num_actions)
