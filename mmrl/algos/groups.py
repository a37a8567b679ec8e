"""Group bookkeeping shared by the estimators: dense group indices, per-group statistics, validation.

A batch holds N samples; ``group_ids[N]`` says which prompt each came from. Ids are arbitrary integers (they
need not be contiguous or sorted): the G copies of a prompt share one id.
"""

from __future__ import annotations

import torch
from torch import Tensor


class GroupError(ValueError):
    """A batch whose group structure does not match what the run promised (sizes, ids, shapes)."""


def dense_group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group ids to 0..K-1.

    Args:
        group_ids: ``[N]`` integer group id per sample.

    Returns:
        ``(index[N], K)``: the dense index of each sample's group and the number of groups.
    """
    if group_ids.dim() != 1:
        raise GroupError(f"group_ids must be 1-D [N], got shape {tuple(group_ids.shape)}")
    _, index = torch.unique(group_ids, sorted=True, return_inverse=True)
    num_groups = int(index.max().item()) + 1 if index.numel() else 0
    return index, num_groups


def group_sum(values: Tensor, index: Tensor, num_groups: int) -> Tensor:
    """Sum ``values[N]`` per group → ``[K]`` (float64 accumulation, returned in values' dtype)."""
    out = torch.zeros(num_groups, dtype=torch.float64, device=values.device)
    out.index_add_(0, index, values.to(torch.float64))
    return out.to(values.dtype)


def group_stats(values: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group count, mean and unbiased (Bessel-corrected) std.

    Computed in float64 so that groups of identical rewards give an exact zero spread.

    Args:
        values: ``[N]`` values (rewards).
        group_ids: ``[N]`` group id per sample.

    Returns:
        ``(count[N], mean[N], std[N])`` broadcast back to the samples. For a group of one sample the std is 0
        (there is no spread to measure), not NaN.
    """
    index, num_groups = dense_group_index(group_ids)
    values64 = values.to(torch.float64)  # [N]
    ones = torch.ones_like(values64)
    count = torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(0, index, ones)  # [K]
    total = torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(0, index, values64)
    mean = total / count  # [K]
    centered = values64 - mean[index]  # [N]
    squares = torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(0, index, centered**2)
    variance = squares / (count - 1).clamp(min=1)  # [K], unbiased; 0 for singletons
    return count[index], mean[index], variance.sqrt()[index]


def validate_groups(group_ids: Tensor, group_size: int, *, where: str = "batch") -> None:
    """Stop with a clear error unless every group id occurs exactly ``group_size`` times.

    Wrong group ids silently turn GRPO into batch normalisation (Search-R1#88), so the trainer checks the
    gathered batch every step.
    """
    index, num_groups = dense_group_index(group_ids)
    sizes = torch.bincount(index, minlength=num_groups)  # [K]
    bad = (sizes != group_size).nonzero().flatten()
    if bad.numel():
        unique_ids = torch.unique(group_ids, sorted=True)
        examples = ", ".join(f"id {int(unique_ids[k])} has {int(sizes[k])}" for k in bad[:4].tolist())
        raise GroupError(
            f"{where}: every group must hold exactly group_size={group_size} samples, but {bad.numel()} of "
            f"{num_groups} groups do not ({examples})"
        )


def has_spread(values: Tensor, group_ids: Tensor, *, tolerance: float = 0.0) -> Tensor:
    """``[N]`` bool: whether the sample's group has any spread, i.e. max − min > tolerance.

    DAPO's dynamic sampling drops groups without spread: their group-relative advantage is zero for every
    member, so they carry no policy-gradient signal.
    """
    index, num_groups = dense_group_index(group_ids)
    values64 = values.to(torch.float64)
    high = torch.full((num_groups,), -torch.inf, dtype=torch.float64, device=values.device)
    low = torch.full((num_groups,), torch.inf, dtype=torch.float64, device=values.device)
    high = high.scatter_reduce(0, index, values64, reduce="amax")
    low = low.scatter_reduce(0, index, values64, reduce="amin")
    return (high - low)[index] > tolerance
