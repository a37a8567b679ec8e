"""The rollout contract: what a plugin hands to the core after sampling.

One :class:`Rollout` holds N samples organised in groups (the G samples of one prompt share a group id) and an
*action axis* A. What an action is belongs to the plugin:

======================  ==========================================  =====================================
plugin                  an action is                                 A
======================  ==========================================  =====================================
reference (``toy``)     one generated token                           max generated length
vlm                     one completion token                          max completion length in the batch
flow                    one SDE denoising step (x_t → x_{t−1})        number of sampled steps
dllm                    one completion token (grpo; ELBO/L for the    completion length (wd1: 1, spg: 2:
                        ELBO estimators), or the whole completion      a sequence-level score)
======================  ==========================================  =====================================

The core only ever sees ``old_logp[N, A]``, ``mask[N, A]`` and the optional per-action extras (``old_logp`` may be
None: the learner then computes it when the run needs it, see :meth:`mmrl.plugin.Plugin.rollout`; ``mask`` fixes A);
it never looks inside ``payload`` (read by rewards) or ``replay`` (read back by the plugin to recompute log-probs).
Everything in ``payload`` and ``replay`` is per sample: tensors have N as their first dimension and lists have N
items, so the core can split, shuffle and concatenate rollouts without knowing the modality. Values shared by all
samples (a timestep grid, a guidance scale) go in ``shared``. When rollouts of different widths are concatenated
(dynamic sampling pools several rounds), tensors are right-padded with zeros along their non-batch dimensions: pad
token ids and attention masks alike come out consistent, and padded actions carry mask 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor

# Optional per-action tensors, all [N, A]. Credit is not among them: per-action rewards come from the one credit hook,
# mmrl.plugin.Plugin.action_rewards, and advantages are always the core's.
ACTION_FIELDS = ("action_weights", "chunk_ids", "ref_logp")


class RolloutError(ValueError):
    """A plugin returned a rollout that breaks the contract (shapes, lengths, group ids)."""


@dataclass
class Rollout:
    """N sampled trajectories, their action log-probs and everything needed to score and replay them.

    Attributes:
        group_ids: ``[N]`` int64, the group (prompt) of each sample; the trainer checks it against the batch.
        old_logp: ``[N, A]`` float32, log-prob of each action under the policy that sampled it, or None: the
            learner then computes them with the plugin's forward under ``no_grad`` when the run needs them (several
            optimizer steps per rollout) and uses the detached training log-probs when it does not (one optimizer
            step on the weights that sampled it). Evaluation rollouts never need them.
        mask: ``[N, A]`` float32, 1 for actions that are trained, 0 for padding or untrained steps.
        payload: Per-sample outputs that rewards read, e.g. ``{"images": [N,3,H,W]}`` or
            ``{"completions": list[str]}``.
        replay: Per-sample tensors the plugin needs to recompute log-probs of the stored actions
            (token ids, latents before and after each step, image tensors, mask seeds, ...).
        shared: Values common to all samples (not split).
        rows: The dataset row (prompt and metadata) of each sample; the trainer fills it in.
        action_weights: ``[N, A]`` optional weight on each action's policy term (TempFlow-GRPO's noise-aware
            weights); the KL and entropy terms are not weighted.
        chunk_ids: ``[N, A]`` optional chunk index of each action, for the chunk ratio level (Chunk-GRPO).
        ref_logp: ``[N, A]`` optional reference log-probs computed at sampling time.
        truncated: ``[N]`` bool, optional: True for a sample that ran out of its generation budget before it
            finished (a completion without its end-of-sequence token). Logged as ``samples/truncated``; with
            ``algorithm.mask_truncated`` such samples leave the loss (DAPO's overlong filtering). None where the
            plugin's samples cannot be cut short (images) or it does not say.
        metrics: Scalars the plugin wants logged for this rollout (not split).
    """

    group_ids: Tensor
    old_logp: Tensor | None
    mask: Tensor
    payload: dict[str, Any] = field(default_factory=dict)
    replay: dict[str, Any] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    action_weights: Tensor | None = None
    chunk_ids: Tensor | None = None
    ref_logp: Tensor | None = None
    truncated: Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.group_ids.shape[0])

    @property
    def num_actions(self) -> int:
        return int(self.mask.shape[1])

    def validate(self) -> Rollout:
        """Check every shape and length against N and A; raise :class:`RolloutError` naming the first offender."""
        if self.group_ids.dim() != 1:
            raise RolloutError(f"rollout.group_ids must be [N], got shape {tuple(self.group_ids.shape)}")
        n = len(self)
        if self.mask.dim() != 2 or self.mask.shape[0] != n:
            raise RolloutError(f"rollout.mask must be [N={n}, A], got shape {tuple(self.mask.shape)}")
        if self.old_logp is not None:
            if self.old_logp.shape != self.mask.shape:
                raise RolloutError(
                    f"rollout.old_logp must match mask [N, A] = {tuple(self.mask.shape)}, got "
                    f"{tuple(self.old_logp.shape)}"
                )
            if not torch.isfinite(self.old_logp[self.mask > 0]).all():
                raise RolloutError("rollout.old_logp holds NaN or infinite values on unmasked actions")
        for name in ACTION_FIELDS:
            value = getattr(self, name)
            if value is not None and value.shape != self.mask.shape:
                raise RolloutError(
                    f"rollout.{name} must be [N, A] = {tuple(self.mask.shape)}, got {tuple(value.shape)}"
                )
        if self.truncated is not None and (self.truncated.shape != (n,) or self.truncated.dtype != torch.bool):
            raise RolloutError(f"rollout.truncated must be a bool [N={n}] tensor, got {self.truncated.dtype} of shape "
                               f"{tuple(self.truncated.shape)}")
        for section in ("payload", "replay"):
            _check_per_sample(getattr(self, section), n, f"rollout.{section}")
        if self.rows and len(self.rows) != n:
            raise RolloutError(f"rollout.rows has {len(self.rows)} entries for N={n} samples")
        return self

    def select(self, indices: Tensor | Sequence[int]) -> Rollout:
        """The samples at ``indices`` (a new rollout; tensors are indexed, lists re-ordered)."""
        index = torch.as_tensor(indices, dtype=torch.long, device=self.group_ids.device)
        updates = {f.name: _take(getattr(self, f.name), index) for f in fields(self) if f.name not in _UNSPLIT}
        if not self.rows:  # rows are filled in by the trainer; before that the list is empty
            updates["rows"] = []
        return replace(self, **updates)

    def select_actions(self, columns: Tensor) -> Rollout:
        """The same samples restricted to the action columns ``columns`` (``old_logp``, ``mask`` and the optional
        per-action fields are sliced; ``payload`` and ``replay`` are per sample and stay whole)."""
        columns = columns.to(self.mask.device)
        updates: dict[str, Any] = {"mask": self.mask.index_select(1, columns)}
        for name in ("old_logp", *ACTION_FIELDS):
            value = getattr(self, name)
            if value is not None:
                updates[name] = value.index_select(1, columns.to(value.device))
        return replace(self, **updates)

    def to(self, device: torch.device | str) -> Rollout:
        """Move every tensor (including nested ones) to ``device``."""
        memo: dict[int, Any] = {}
        return replace(self, **{f.name: _move(getattr(self, f.name), device, memo) for f in fields(self)})

    @staticmethod
    def concat(rollouts: Sequence[Rollout]) -> Rollout:
        """Concatenate rollouts along N. Action axes of different widths are right-padded (mask 0).

        ``shared`` is taken from the first rollout; each of the ``metrics`` is the mean over the rollouts that
        report it, weighted by their samples (a non-finite value is left out), as one rollout of all the samples
        would report it.
        """
        if not rollouts:
            raise RolloutError("cannot concatenate an empty list of rollouts")
        width = max(r.num_actions for r in rollouts)
        padded = [r._pad_actions(width) for r in rollouts]
        first = padded[0]
        updates: dict[str, Any] = {"metrics": _pooled_metrics(rollouts)}
        for f in fields(first):
            if f.name in _UNSPLIT:
                continue
            updates[f.name] = _cat([getattr(r, f.name) for r in padded], f"rollout.{f.name}")
        return replace(first, **updates)

    def pad_actions(self, width: int) -> Rollout:
        """Right-pad the action axis to ``width`` columns with mask 0 (no-op when already that wide)."""
        if width < self.num_actions:
            raise RolloutError(f"cannot pad {self.num_actions} actions down to {width}")
        return self._pad_actions(width)

    def _pad_actions(self, width: int) -> Rollout:
        extra = width - self.num_actions
        if extra == 0:
            return self
        pad = torch.nn.functional.pad
        updates: dict[str, Any] = {"mask": pad(self.mask, (0, extra))}
        for name in ("old_logp", *ACTION_FIELDS):
            value = getattr(self, name)
            if value is not None:
                updates[name] = pad(value, (0, extra))
        return replace(self, **updates)


_UNSPLIT = frozenset({"shared", "metrics"})


def _pooled_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Each metric's mean over the rollouts reporting it, weighted by their sample counts (finite values only)."""
    totals: dict[str, float] = {}
    weights: dict[str, float] = {}
    for rollout in rollouts:
        for name, value in rollout.metrics.items():
            value = float(value)
            if math.isfinite(value) and len(rollout) > 0:
                totals[name] = totals.get(name, 0.0) + value * len(rollout)
                weights[name] = weights.get(name, 0.0) + len(rollout)
    return {name: totals[name] / weights[name] for name in totals}


def _check_per_sample(value: Any, n: int, where: str) -> None:
    if isinstance(value, Tensor):
        if value.dim() == 0 or value.shape[0] != n:
            raise RolloutError(f"{where} must have N={n} as first dimension, got shape {tuple(value.shape)}")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_per_sample(item, n, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        if len(value) != n:
            raise RolloutError(f"{where} must hold N={n} items, got {len(value)}")
    elif value is not None:
        raise RolloutError(
            f"{where} holds a {type(value).__name__}; per-sample values must be tensors, lists or dicts of them "
            "(put values shared by all samples in rollout.shared)"
        )


def _take(value: Any, index: Tensor) -> Any:
    if value is None or (isinstance(value, list) and not value):
        return value
    if isinstance(value, Tensor):
        return value.index_select(0, index.to(value.device))
    if isinstance(value, Mapping):
        return {key: _take(item, index) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        picked = [value[i] for i in index.tolist()]
        return type(value)(picked) if isinstance(value, tuple) else picked
    raise RolloutError(f"cannot split a {type(value).__name__} per sample")


def _cat(values: list[Any], where: str) -> Any:
    first = values[0]
    missing = [v is None for v in values]
    if any(missing):
        if not all(missing):
            raise RolloutError(f"{where} is set in some rollouts and missing in others")
        return None
    if isinstance(first, Tensor):
        return torch.cat(_pad_trailing(values, where), dim=0)
    if isinstance(first, Mapping):
        keys = set(first)
        if any(set(v) != keys for v in values):
            raise RolloutError(f"{where} has different keys across rollouts")
        return {key: _cat([v[key] for v in values], f"{where}[{key!r}]") for key in first}
    if isinstance(first, (list, tuple)):
        joined = [item for v in values for item in v]
        return type(first)(joined) if isinstance(first, tuple) else joined
    raise RolloutError(f"cannot concatenate {where} of type {type(first).__name__}")


def _pad_trailing(tensors: list[Tensor], where: str) -> list[Tensor]:
    """Right-pad with zeros along every non-batch dimension to the largest size (e.g. token ids of different
    lengths from two sampling rounds; their attention masks pad with zeros the same way)."""
    if len({t.dim() for t in tensors}) != 1:
        raise RolloutError(f"cannot concatenate {where}: tensors of different ranks")
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    padded = []
    for tensor in tensors:
        pads: list[int] = []
        for dim in reversed(range(1, tensor.dim())):
            pads.extend([0, shape[dim - 1] - tensor.shape[dim]])
        padded.append(torch.nn.functional.pad(tensor, pads) if any(pads) else tensor)
    return padded


# Values that hold no tensor, recognised by their exact type (a set lookup; ``isinstance(x, Mapping)`` on every
# string of a payload is an ABC check).
_LEAF_TYPES = frozenset({str, int, float, bool, bytes, type(None)})


def _move(value: Any, device: torch.device | str, memo: dict[int, Any] | None = None) -> Any:
    """``value`` with every tensor in it moved to ``device``; containers are copied. ``memo`` maps the id of a
    mapping already moved in this call to its copy: the G samples of a group share one dataset row, which is walked
    once and stays shared in the copy."""
    kind = type(value)
    if kind in _LEAF_TYPES:
        return value
    if isinstance(value, Tensor):
        return value.to(device)
    if kind is list or kind is tuple:
        # A list of plain values (completion strings, a row's token ids) has nothing to move: copy it in one call
        # instead of visiting every item.
        if all(type(item) in _LEAF_TYPES for item in value):
            return list(value) if kind is list else value
        moved = [_move(item, device, memo) for item in value]
        return moved if kind is list else tuple(moved)
    if isinstance(value, Mapping):
        memo = {} if memo is None else memo
        if id(value) not in memo:
            memo[id(value)] = {key: _move(item, device, memo) for key, item in value.items()}
        return memo[id(value)]
    if isinstance(value, list):
        return [_move(item, device, memo) for item in value]
    if isinstance(value, tuple):
        return tuple(_move(item, device, memo) for item in value)
    return value
