"""Loss aggregation: from per-action losses ``[N, A]`` to the scalar that is back-propagated.

The denominators belong to the whole optimizer step: every micro-batch of the step and every process. Each
micro-batch contributes ``Σ (its numerator) / (step-wide denominator)``, so summing the micro-batch gradients gives
exactly the gradient of the full-batch loss, whatever the micro-batch size (TRL #5619 and ms-swift #10117 show the
two ways to get this wrong). The trainer passes the step-wide counts; without them the counts of the given tensor
are used, which is right for a single batch.

With m the mask, L the per-action loss, i a sequence and t an action, over the optimizer step:

=============================  ======================================================  ===========================
mode                           value                                                   denominator
=============================  ======================================================  ===========================
``token_mean``                 Σ_i Σ_t m·L / T                                          T = Σ_i Σ_t m (all actions)
``seq_mean_token_mean``        Σ_i (Σ_t m·L / Σ_t m) / S                                S = sequences with Σ_t m > 0
``seq_mean_token_sum``         Σ_i Σ_t m·L / S                                          S
``seq_mean_token_sum_norm``    Σ_i Σ_t m·L / (S·A_max)                                  S·A_max, A_max a constant
=============================  ======================================================  ===========================

``seq_mean_token_sum_norm`` is Dr.GRPO's length-unbiased form (Liu et al. 2025, arXiv:2503.20783, §3.1): each
sequence's summed loss is divided by one constant (the generation budget, e.g. ``max_new_tokens``) instead of its
own length. ``token_mean`` is DAPO's token-level loss (Yu et al. 2025, arXiv:2503.14476, eq. (8)) taken over the
optimizer step. ``seq_mean_token_mean`` is the original GRPO form (Shao et al. 2024, arXiv:2402.03300, eq. (3)).

Reference code read: TRL's ``loss_type`` branches (``trl/trainer/grpo_trainer.py`` L3124-3150 at
huggingface/trl@f2cd577) and verl's ``agg_loss`` (``verl/trainer/ppo/core_algos.py`` L1025-1080 at
volcengine/verl@b178a3c). TRL ``dapo`` is ``token_mean`` (its denominator ``num_items_in_batch`` counts the tokens of
the whole generation batch on every process, L2427: one optimizer step's with TRL's default ``steps_per_generation`` =
``gradient_accumulation_steps``; with k times as many, mmrl's ``minibatches: k``, each TRL step is about 1/k of
``token_mean``, a learning-rate scale mmrl does not copy; the same for ``cispo`` and ``vespo``); TRL ``grpo`` is
``seq_mean_token_mean`` and ``bnpo`` ``token_mean``, each normalised per micro-batch and averaged over the accumulation
steps, so they equal these modes when every micro-batch holds as many sequences (respectively tokens) as the others; TRL
``dr_grpo`` is ``seq_mean_token_sum_norm`` with A_max = ``max_completion_length``. verl's ``token-mean``,
``seq-mean-token-sum`` and ``seq-mean-token-mean`` are the modes of the same names (with its global batch counts); its
``seq-mean-token-sum-norm`` divides a micro-batch's summed sequence losses by A_max alone, with no mean over the
sequences (a learning-rate scale that grows with the micro-batch; mmrl and TRL keep the mean, as Dr.GRPO's objective
averages over the group).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mmrl.registry import Registry

# The step-wide counts are passed by :func:`aggregate` (the trainer), never set in a config: no mode has options.
aggregation_modes: Registry[Callable[..., Tensor]] = Registry(
    "aggregation mode", supplied=("num_actions", "num_sequences", "max_actions", "sequence_lengths")
)


def aggregation_counts(mask: Tensor) -> tuple[float, float]:
    """``(num_actions, num_sequences)`` of a mask ``[N, A]``: Σ m, and rows with Σ_t m > 0."""
    weights = mask.to(torch.float64)
    return float(weights.sum()), float((weights.sum(dim=1) > 0).sum())


def _row_sums(loss: Tensor, mask: Tensor) -> Tensor:
    return (loss * mask.to(loss.dtype)).sum(dim=1)  # [N]


@aggregation_modes.register("token_mean")
def token_mean(
    loss: Tensor, mask: Tensor, *, num_actions: float, num_sequences: float, max_actions: float,
    sequence_lengths: Tensor,
) -> Tensor:
    """Σ m·L over all actions of the step / number of actions in the step (DAPO token-level).

    Shapes:
        loss, mask ``[N, A]`` → scalar.
    """
    return _row_sums(loss, mask).sum() / max(num_actions, 1.0)


@aggregation_modes.register("seq_mean_token_mean")
def seq_mean_token_mean(
    loss: Tensor, mask: Tensor, *, num_actions: float, num_sequences: float, max_actions: float,
    sequence_lengths: Tensor,
) -> Tensor:
    """Per-sequence mean over its actions, then the mean over the step's sequences (original GRPO).

    Shapes:
        loss, mask ``[N, A]`` → scalar.
    """
    per_sequence = _row_sums(loss, mask) / sequence_lengths.to(loss.dtype).clamp(min=1.0)  # [N]; empty rows give 0
    return per_sequence.sum() / max(num_sequences, 1.0)


@aggregation_modes.register("seq_mean_token_sum")
def seq_mean_token_sum(
    loss: Tensor, mask: Tensor, *, num_actions: float, num_sequences: float, max_actions: float,
    sequence_lengths: Tensor,
) -> Tensor:
    """Per-sequence sum over its actions, then the mean over the step's sequences.

    Shapes:
        loss, mask ``[N, A]`` → scalar.
    """
    return _row_sums(loss, mask).sum() / max(num_sequences, 1.0)


@aggregation_modes.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    loss: Tensor, mask: Tensor, *, num_actions: float, num_sequences: float, max_actions: float,
    sequence_lengths: Tensor,
) -> Tensor:
    """Per-sequence sum divided by a constant A_max, then the mean over sequences (Dr.GRPO, arXiv:2503.20783).

    As Dr.GRPO's released code: ``masked_sum(..., constant_normalizer=generate_max_length)`` per sequence
    (``train_zero_math.py`` L286-291 at sail-sg/understand-r1-zero@dfca49d), then the mean over the mini-batch's
    sequences (``oat/algorithms/ppo.py`` L567-568 at sail-sg/oat@c1a074c).

    Shapes:
        loss, mask ``[N, A]`` → scalar.
    """
    return _row_sums(loss, mask).sum() / (max(num_sequences, 1.0) * max(max_actions, 1.0))


def aggregate(
    loss: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_actions: float | None = None,
    num_sequences: float | None = None,
    max_actions: float | None = None,
    sequence_lengths: Tensor | None = None,
) -> Tensor:
    """Reduce a per-action loss to a scalar with step-wide denominators.

    Args:
        loss: ``[N, A]`` per-action loss.
        mask: ``[N, A]`` 1 for actions that count (may hold fractional weights).
        mode: One of :data:`aggregation_modes` (table in the module docstring).
        num_actions: Σ mask over the whole optimizer step, all micro-batches and processes. Default: this mask's.
        num_sequences: Sequences with at least one active action, whole step. Default: this mask's.
        max_actions: Dr.GRPO's constant A_max. Default: the width A of this tensor; pass the generation budget
            so that the constant does not depend on padding.
        sequence_lengths: ``[N]`` active actions of each whole sequence, when ``loss`` holds only some of its
            action columns (the trainer's action chunks). Default: ``mask.sum(1)``.

    Returns:
        A 0-dim tensor. Summing it over the step's micro-batches gives the full-batch value.
    """
    if loss.shape != mask.shape or loss.dim() != 2:
        raise ValueError(f"loss and mask must share one [N, A] shape; got {tuple(loss.shape)}, {tuple(mask.shape)}")
    if num_actions is None or num_sequences is None:  # the trainer passes both: no local count (and no sync) then
        local_actions, local_sequences = aggregation_counts(mask)
        num_actions = local_actions if num_actions is None else num_actions
        num_sequences = local_sequences if num_sequences is None else num_sequences
    return aggregation_modes.get(mode)(
        loss,
        mask,
        num_actions=float(num_actions),
        num_sequences=float(num_sequences),
        max_actions=float(loss.shape[1]) if max_actions is None else float(max_actions),
        sequence_lengths=mask.to(torch.float64).sum(dim=1) if sequence_lengths is None else sequence_lengths,
    )
