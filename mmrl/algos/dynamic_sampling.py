"""DAPO dynamic sampling: keep only groups whose rewards differ, sample more until the batch is full.

A group whose G rewards are all equal has zero group-relative advantage for every member: it costs a backward
pass and contributes no policy gradient (only KL and entropy terms), and it shrinks the effective batch as the
policy improves. DAPO (Yu et al. 2025, arXiv:2503.14476, §3.2) over-samples, drops those groups and keeps sampling
until the batch is full. verl bounds the extra rounds with ``max_num_gen_batches``.

DAPO's released code (its recipe in verl, ``recipe/dapo/dapo_ray_trainer.py`` L244-288 at volcengine/verl@246cac4,
since moved to verl-recipe) keeps the groups whose reward has a population std > 0 (and any group of one sample),
concatenates generation batches until ``train_batch_size`` prompts are kept, cuts the batch to that size, and
raises an error once ``max_num_gen_batches`` batches were drawn without filling it. mmrl differs in three ways:
the spread test is max − min > ``tolerance`` (the same groups at ``tolerance`` 0); a group of one sample is dropped
(its advantage is 0 here, see :mod:`mmrl.algos.advantages`, so it carries no policy gradient); and when the rounds
run out the step goes on padded (below, logged as ``samples/padded``) instead of stopping the run, so that a hard
stretch of the prompt stream costs one weaker step, not the job.

Process balance. Every process keeps exactly ``target_per_process`` samples, taking its kept samples in sampling
order. Sampling stops when *every* process has enough (a global min), so all processes run the same number of
rounds and the same number of backward passes: none waits on another at a collective, and a process whose groups
were all filtered out simply keeps sampling with the others (peers hang here: verl PR #5228, OpenRLHF #1270). If
the bounded number of rounds runs out, a process that is still short pads with filtered-out samples whose mask is
zeroed: they take part in the collectives and contribute nothing to the loss or to its denominators.

With group-contiguous layouts and ``target_per_process`` a multiple of G, the kept samples of a process are whole
groups. When groups span processes unevenly, or a kept group lost a member to a skipped reward, the per-process cut
may drop the last members of a group; the trainer still computes its advantages on the whole group
(:meth:`mmrl.trainer.collect.Collector.credit_kept`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.algos.groups import has_spread


def groups_with_spread(rewards: Tensor, group_ids: Tensor, *, tolerance: float = 0.0) -> Tensor:
    """``[N]`` bool keep-mask: True for samples whose group's rewards differ by more than ``tolerance``.

    Args:
        rewards: ``[N]`` (gathered over processes, so that every process agrees on the decision).
        group_ids: ``[N]``.
        tolerance: Spreads (max − min) at or below this count as none.
    """
    return has_spread(rewards, group_ids, tolerance=tolerance)


@dataclass
class SelectionPlan:
    """What one process trains on after dynamic sampling.

    Attributes:
        indices: ``[target]`` positions into the process's pooled samples (all rounds concatenated).
        padded: ``[target]`` bool, True where the sample is padding (mask zeroed, loss-free).
    """

    indices: Tensor
    padded: Tensor


def select_kept(keep: Tensor, target: int) -> SelectionPlan:
    """Choose ``target`` samples from a process's pool: kept ones first in sampling order, then padding.

    Args:
        keep: ``[M]`` bool over the pooled samples of this process (all rounds, in order).
        target: Samples this process must train on (equal on every process).

    Raises:
        ValueError: if the pool holds fewer than ``target`` samples in total.
    """
    if keep.numel() < target:
        raise ValueError(f"the pool holds {keep.numel()} samples, fewer than the {target} a process trains on")
    kept = keep.nonzero().flatten()[:target]
    dropped = (~keep).nonzero().flatten()[: target - kept.numel()]
    indices = torch.cat([kept, dropped])
    padded = torch.cat([torch.zeros_like(kept, dtype=torch.bool), torch.ones_like(dropped, dtype=torch.bool)])
    return SelectionPlan(indices=indices, padded=padded)


def batch_is_full(kept_per_process: Tensor, target: int) -> bool:
    """True when every process holds at least ``target`` kept samples (the min over processes decides)."""
    return bool(kept_per_process.min().item() >= target)
