"""Steps 5–7 of a training step: μ inner epochs over mini-batches, gradient accumulation, the optimizer step, EMA.

The :class:`Learner` turns a :class:`~mmrl.trainer.collect.TrainingBatch` into parameter updates. Each mini-batch
is one optimizer step; its micro-batches (and, with ``algorithm.action_chunk_size``, column chunks of them) are
back-propagated one at a time with the step-wide denominators of :func:`mmrl.algos.aggregate`, so the accumulated
gradient is the gradient of the whole step's loss whatever the micro-batch size or the number of processes.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import replace
from typing import Any

import torch
from accelerate import Accelerator

from mmrl.algos import aggregate, aggregation_counts, broadcast_advantages, kl_estimators, log_ratio, policy_losses
from mmrl.algos.policy_losses import masked_means, reads_old_logp
from mmrl.algos.token_selection import entropy_threshold, high_entropy_mask, off_policy_sequence_mask
from mmrl.config import ConfigError, TrainConfig
from mmrl.plugin import Plugin
from mmrl.rollout import Rollout, RolloutError
from mmrl.seeding import derive_seed
from mmrl.trainer.collect import TrainingBatch, chunks, reduce_means
from mmrl.trainer.ema import EMA
from mmrl.trainer.entropy_control import AdaptiveEntropyCoef
from mmrl.trainer.geometry import BatchGeometry, batch_geometry, check_whole_groups
from mmrl.trainer.metrics import WeightedMeans
from mmrl.trainer.reference import ReferenceSync
from mmrl.trainer.sampler import group_minibatch_partition, minibatch_partition

LOSS_DRAW_TAG = 0x10557A6  # separates a policy loss's random draws (clip_cov) from every other seeded stream


def ratio_level(config: TrainConfig) -> str:
    """The importance-ratio level of the configured policy loss: its ``ratio_level`` option, else the loss's
    default, else ``"token"`` (losses without a ratio)."""
    loss = policy_losses.get(config.algorithm.policy_loss.name)
    default = inspect.signature(loss).parameters.get("ratio_level")
    return config.algorithm.policy_loss.options.get("ratio_level", "token" if default is None else default.default)


def needs_reference(config: TrainConfig) -> bool:
    """Whether the learner asks :meth:`Plugin.forward` for the reference policy: for the KL term (``kl_coef > 0``)
    or for a policy loss that reads the reference's log-probs (one that declares ``ref_logp``, the core's ``dgpo``).
    The trainer passes it to the plugin as ``Runtime.needs_reference``, so that a fully fine-tuned model keeps its
    frozen copy whenever either will ask."""
    loss = policy_losses.get(config.algorithm.policy_loss.name)
    return config.algorithm.kl_coef > 0 or "ref_logp" in inspect.signature(loss).parameters


def needs_old_logp(config: TrainConfig) -> bool:
    """Whether the run needs old-policy log-probs that differ from the training forward's.

    False exactly when every rollout batch is consumed by one optimizer step on the weights that sampled it: one
    inner epoch and one mini-batch. The micro-batches and action chunks of that step accumulate gradients on
    unchanged weights, so the old log-probs equal the detached training log-probs and the learner substitutes those
    for a missing ``old_logp`` (ratio ≡ 1, the same gradient): no old-policy pass runs, and ``recompute_old_logp``
    asks for none either (it would compute the same numbers again). When True, a rollout without ``old_logp`` gets
    them from the learner's old-policy pass (:meth:`Learner.old_policy_rollouts`).

    Also False for a policy loss that reads no ``old_logp`` (:func:`mmrl.algos.policy_losses.reads_old_logp`: the
    flow plugin's ``nft``, whose old policy enters through its own columns; ``dgpo`` without its clip or ``old``
    baseline) unless the core reads them itself
    (``off_policy_mask_threshold``, ``kl_importance_weighted``): the pass would compute numbers nothing uses.
    """
    algorithm = config.algorithm
    if not (algorithm.inner_epochs > 1 or algorithm.minibatches > 1):
        return False
    core_reads = algorithm.off_policy_mask_threshold is not None or algorithm.kl_importance_weighted
    return core_reads or reads_old_logp(policy_losses.get(algorithm.policy_loss.name), algorithm.policy_loss.options)


def chunked_geometry(config: TrainConfig, plugin: Plugin, num_processes: int) -> BatchGeometry | None:
    """The batch geometry with ``algorithm.action_chunk_size`` folded in, or None when it is not set.

    Checks that the plugin can recompute a subset of action columns, declares an action budget, and that the
    policy loss takes token-level ratios (chunk and sequence ratios need every action of a unit at once) and has no
    statistic over a whole micro-batch (a loss that sets ``needs_whole_micro_batch``: ``clip_cov``, ``kl_cov``).
    """
    size = config.algorithm.action_chunk_size
    if size is None:
        return None
    name = config.plugin.name
    if not plugin.supports_action_chunks:
        raise ConfigError("algorithm.action_chunk_size", size,
                          f"null: plugin {name!r} recomputes all actions in one forward")
    level = ratio_level(config)
    if level != "token":
        raise ConfigError("algorithm.action_chunk_size", size,
                          f"null with ratio_level {level!r}: chunk and sequence ratios need every action at once")
    loss_name = config.algorithm.policy_loss.name
    if getattr(policy_losses.get(loss_name), "needs_whole_micro_batch", False):
        raise ConfigError("algorithm.action_chunk_size", size,
                          f"null with policy_loss {loss_name!r}: its statistics span a whole micro-batch's actions")
    max_actions = plugin.max_actions()
    if max_actions is None:
        raise ConfigError("algorithm.action_chunk_size", size,
                          f"null: plugin {name!r} declares no action budget (max_actions)")
    return batch_geometry(config, num_processes, max_actions)


class Learner:
    """Applies the policy-gradient updates of one step.

    Args:
        config: The run's config.
        accelerator: The run's Accelerator; its gradient-accumulation count must equal
            ``geometry.backward_passes``.
        geometry: Batch sizes of the run.
        plugin: The modality plugin (recomputes log-probs).
        policy: The prepared (wrapped) trainable module.
        optimizer: The prepared optimizer.
        ema: The EMA of the trainable weights, if enabled.
        reference_sync: The soft update of the KL reference after every ``algorithm.ref_sync_every`` optimizer
            steps, if enabled.
        entropy_control: The adaptive entropy coefficient (``algorithm.entropy_target``), if enabled: its current
            value replaces ``algorithm.entropy_coef``, and it is updated after every optimizer step from that step's
            mean entropy over the trained actions (:mod:`mmrl.trainer.entropy_control`).

    Attributes:
        optimizer_steps: Optimizer steps taken so far (the learning-rate schedule is a function of it; saved in
            every checkpoint).
    """

    def __init__(self, config: TrainConfig, accelerator: Accelerator, geometry: BatchGeometry, plugin: Plugin,
                 policy: torch.nn.Module, optimizer: torch.optim.Optimizer, ema: EMA | None, *,
                 reference_sync: ReferenceSync | None = None, entropy_control: AdaptiveEntropyCoef | None = None):
        self.config = config
        self.accelerator = accelerator
        self.geometry = geometry
        self.plugin = plugin
        self.policy = policy
        self.optimizer = optimizer
        self.ema = ema
        self.reference_sync = reference_sync
        self.entropy_control = entropy_control
        # [2] float64 (Σ mask·entropy, Σ mask) over the trained actions of the optimizer step under way, this process:
        # adaptive entropy control's measurement (TRL's _entropy_window_stats); None between optimizer steps.
        self._entropy_window: torch.Tensor | None = None
        self._applied_entropy_coefs: list[float] = []  # the coefficient each optimizer step of update() trained with
        self.parameters = [p for p in policy.parameters() if p.requires_grad]
        self.policy_loss = policy_losses.get(config.algorithm.policy_loss.name)
        accepted = inspect.signature(self.policy_loss).parameters
        self.loss_accepts_chunks = "chunk_ids" in accepted
        # A loss that declares `group_ids` couples the samples of a group (DGPO's group sum): each of its calls gets
        # the rows' group ids, and every mini-batch and micro-batch holds whole groups on one process. One that
        # declares `ref_logp` gets the reference policy's log-probs (the plugin is asked for them whatever kl_coef).
        self.loss_reads_groups = "group_ids" in accepted
        self.loss_reads_reference = "ref_logp" in accepted
        # One that declares `generator` draws at random (clip_cov): each call gets its own seeded generator
        # (loss_generator), so the draws repeat with the run's seed and resume exactly.
        self.loss_draws = "generator" in accepted
        if self.loss_reads_groups:
            check_whole_groups(geometry, config.rollout.layout, f"policy_loss {config.algorithm.policy_loss.name!r}")
        self.kl_estimator = kl_estimators.get(config.algorithm.kl_estimator)
        self.optimizer_steps = 0

    def update(self, batch: TrainingBatch, step: int) -> dict[str, float]:
        """μ inner epochs over ``minibatches`` optimizer steps each; returns the step's policy/optimizer metrics."""
        config, acc, geometry = self.config, self.accelerator, self.geometry
        algorithm = config.algorithm
        device = acc.device
        rollout, advantages = batch.rollout.to(device), batch.advantages
        if self.loss_reads_groups:
            rollout, advantages = self._groups_together(rollout, advantages)
        need_reference = needs_reference(config) and rollout.ref_logp is None  # the KL term or the loss reads it
        # The same samples share a mini-batch on any number of processes (see minibatch_partition); a group-coupled
        # loss deals whole groups to the mini-batches instead (group_minibatch_partition).
        if self.loss_reads_groups:
            partitions = [group_minibatch_partition(geometry.samples, geometry.group_size, geometry.minibatches,
                                                    acc.num_processes, acc.process_index,
                                                    seed=derive_seed(config.run.seed, step, epoch))
                          for epoch in range(geometry.inner_epochs)]
        else:
            partitions = [minibatch_partition(geometry.samples, geometry.minibatches, config.rollout.layout,
                                              acc.num_processes, acc.process_index,
                                              seed=derive_seed(config.run.seed, step, epoch))
                          for epoch in range(geometry.inner_epochs)]
        # [μ] the rollout with each inner epoch's old log-probs; `current`: the first mini-batch's old policy is its
        # own training forward (no old-policy pass scored it)
        epoch_rollouts, current = self.old_policy_rollouts(rollout, first=partitions[0][0] if partitions[0] else ())
        column_chunks: list[torch.Tensor | None] = [None]
        if algorithm.action_chunk_size is not None:
            budget = self.plugin.max_actions()
            padded: dict[int, Rollout] = {}  # epochs that share a rollout share its padded copy
            for epoch_rollout in epoch_rollouts:
                if id(epoch_rollout) not in padded:
                    padded[id(epoch_rollout)] = epoch_rollout.pad_actions(budget)
            epoch_rollouts = [padded[id(r)] for r in epoch_rollouts]
            rollout = epoch_rollouts[0]
            if advantages.dim() == 2:
                advantages = torch.nn.functional.pad(advantages, (0, budget - advantages.shape[1]))
            column_chunks = list(torch.arange(budget).split(algorithm.action_chunk_size))
        max_actions = algorithm.max_actions or self.plugin.max_actions()
        if max_actions is None:
            width = torch.tensor([rollout.num_actions], device=device, dtype=torch.float64)
            max_actions = int(acc.reduce(width, "max").item())
        scale = geometry.backward_passes * acc.num_processes  # undo Accelerate's ÷GA and DDP's mean over processes
        means = WeightedMeans()
        deviations: list[float] = []  # max |ratio - 1| of every backward pass before this step's first update
        steps_before = self.optimizer_steps
        self._applied_entropy_coefs = []
        syncs_before = None if self.reference_sync is None else self.reference_sync.syncs
        loss_total = 0.0
        for epoch in range(geometry.inner_epochs):
            self.plugin.start_inner_epoch(epoch)
            rollout = epoch_rollouts[epoch]
            for position, members in enumerate(partitions[epoch]):
                indices = torch.tensor(members, dtype=torch.long)
                minibatch = rollout.select(indices)
                if current and epoch == 0 and position == 0:
                    # Before any update the training forward is the old policy: ratio ≡ 1 (see old_policy_rollouts).
                    minibatch = replace(minibatch, old_logp=None)
                mb_adv = advantages.index_select(0, indices.to(advantages.device))
                counts = torch.tensor(aggregation_counts(minibatch.mask), dtype=torch.float64, device=device)
                num_actions, num_sequences = acc.reduce(counts, "sum").tolist()  # step-wide denominators
                if num_actions == 0:
                    # No sample entered this mini-batch's loss on any process (all dropped by on_nonfinite: skip, or
                    # padding): its gradient is zero, and AdamW would still move the weights by its momentum and
                    # weight decay. Every process sees the same global count, so all skip it together; the
                    # schedule's position advances as if the step had been taken.
                    self.optimizer_steps += 1
                    continue
                step_loss = torch.zeros((), dtype=torch.float64, device=device)
                for micro in chunks(list(range(len(minibatch))), geometry.micro_batch_size):
                    index = torch.tensor(micro, dtype=torch.long)
                    part = minibatch.select(index)
                    part_adv = mb_adv.index_select(0, index.to(mb_adv.device))
                    lengths = part.mask.to(torch.float64).sum(dim=1)  # [n] active actions of whole rows
                    for columns in column_chunks:
                        with acc.accumulate(self.policy):
                            loss, part_metrics, deviation, weight = self._micro_loss(
                                part, part_adv, need_reference, num_actions, num_sequences, max_actions, columns,
                                lengths, generator=self.loss_generator(step, epoch, position, micro[0], columns),
                            )
                            acc.backward(loss * scale)
                            # The micro-batch's scalars read back in one transfer, not one .item() each.
                            part_metrics, (deviation, weight) = _read_scalars(part_metrics, (deviation, weight))
                            means.add_all(part_metrics, weight)
                            step_loss += loss.detach().to(torch.float64)
                            if self.optimizer_steps == steps_before:  # the first mini-batch: no update yet
                                deviations.append(deviation)
                            if acc.sync_gradients:
                                self._optimizer_step(means)
                if not acc.sync_gradients:
                    raise RuntimeError("gradient accumulation fell out of step with the micro-batches")
                loss_total += float(acc.reduce(step_loss, "sum"))
        out = reduce_means(means, acc.num_processes)
        out["loss/total"] = loss_total / geometry.optimizer_steps_per_step
        out["loss/first_step_ratio_deviation"] = float(
            acc.reduce(torch.tensor(max(deviations, default=0.0), device=device), "max"))
        out["optim/lr"] = self.lr(self.optimizer_steps)
        if self.reference_sync is not None and self.reference_sync.syncs != syncs_before:
            out["ref/syncs"] = float(self.reference_sync.syncs)  # the reference updates so far, on steps that made one
        if self.entropy_control is not None:
            # The coefficient after this step's updates (the next step's; TRL logs entropy_coef so) and the mean of
            # those the step's optimizer steps trained with, 0 where the gate was closed (Skywork-OR1's
            # actor/entropy_coeff_realized). Every process holds the same values.
            out["policy/entropy_coef"] = self.entropy_control.coef
            if self._applied_entropy_coefs:
                out["policy/entropy_coef_applied"] = _mean(self._applied_entropy_coefs)
        return out

    def lr(self, optimizer_step: int) -> float:
        """The learning rate of an optimizer step: linear warmup, then constant, linear or cosine decay to 0."""
        optim = self.config.optim
        total = max(self.config.run.max_steps * self.geometry.optimizer_steps_per_step, 1)
        if optim.warmup_steps and optimizer_step < optim.warmup_steps:
            return optim.lr * (optimizer_step + 1) / optim.warmup_steps
        progress = min(max(optimizer_step - optim.warmup_steps, 0) / max(total - optim.warmup_steps, 1), 1.0)
        if optim.scheduler == "linear":
            return optim.lr * (1.0 - progress)
        if optim.scheduler == "cosine":
            return optim.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
        return optim.lr

    def _groups_together(self, rollout: Rollout, advantages: torch.Tensor) -> tuple[Rollout, torch.Tensor]:
        """The rollout (and its advantages) with each group's samples consecutive, in the order of their group ids, for
        a group-coupled loss: the collector puts the samples that ``rewards.on_nonfinite: skip`` dropped after the
        kept ones (as padding, mask 0), which would cut the units of G consecutive samples that
        :func:`group_minibatch_partition` deals across two groups. A stable sort by group id brings each dropped
        sample back beside its group. Raises a one-line RolloutError when some unit of G samples still holds two
        groups (dynamic sampling that padded the batch with part of a group)."""
        ids = rollout.group_ids
        order = torch.sort(ids, stable=True).indices  # [n]
        if not torch.equal(order, torch.arange(len(order), device=order.device)):
            rollout = rollout.select(order.cpu())
            advantages = advantages.index_select(0, order.to(advantages.device))
        units = rollout.group_ids.reshape(-1, self.geometry.group_size)  # [n / G, G]
        if not bool((units == units[:, :1]).all()):
            raise RolloutError(f"policy_loss {self.config.algorithm.policy_loss.name!r} needs whole groups, but this "
                               f"process's batch holds part of a group (group ids {units.tolist()}): dynamic sampling "
                               "padded it with part of a group that rewards.on_nonfinite: skip had cut; use "
                               "on_nonfinite: error with this loss and dynamic sampling")
        return rollout, advantages

    def _optimizer_step(self, means: WeightedMeans) -> None:
        """Clip, set the scheduled learning rate, step, zero the gradients, update the EMA."""
        config = self.config
        if config.optim.max_grad_norm is not None:
            norm = self.accelerator.clip_grad_norm_(self.parameters, config.optim.max_grad_norm)
            if norm is not None:  # DeepSpeed clips inside its engine (gradient_clipping) and reports no norm
                means.add("optim/grad_norm", float(norm))
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr(self.optimizer_steps)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        if self.ema is not None and self.optimizer_steps % config.ema.update_every == 0:
            self.ema.update(step=self.optimizer_steps - 1)  # the warm-up follows the optimizer step, as Flow-GRPO
        if self.reference_sync is not None:
            self.reference_sync.after_optimizer_step(self.optimizer_steps)
        if self.entropy_control is not None:
            self._update_entropy_control()

    def _update_entropy_control(self) -> None:
        """At an optimizer step: the step's mean entropy over its trained actions on every process (the window's sums
        reduced together, so processes with more actions weigh more, as TRL) updates the coefficient for the next
        step. A collective: every process takes the same optimizer steps."""
        acc, control = self.accelerator, self.entropy_control
        window = self._entropy_window
        if window is None:  # a process with no backward pass in this step cannot happen; zeros keep the collective
            window = torch.zeros(2, dtype=torch.float64, device=acc.device)
        self._entropy_window = None
        total, count = acc.reduce(window, "sum").tolist()
        if count <= 0:
            raise RuntimeError("adaptive entropy control: an optimizer step trained actions but measured the entropy "
                               "of none")
        self._applied_entropy_coefs.append(control.applied)  # what this step trained with, before the update
        control.update(total / count)

    def loss_generator(self, step: int, epoch: int, minibatch: int, first_row: int, columns: torch.Tensor | None
                       ) -> torch.Generator | None:
        """The CPU generator of one policy-loss call, for a loss that declares ``generator`` (None otherwise): seeded
        from the run's seed, the step, the inner epoch, the mini-batch's position, the micro-batch's first row in it,
        the action chunk's first column and the process, so that it depends on where the call sits only (not on what
        else drew from the global RNG): a run repeats, and a resumed run draws what it would have."""
        if not self.loss_draws:
            return None
        first_column = 0 if columns is None else int(columns[0])
        seed = derive_seed(self.config.run.seed, step, epoch, minibatch, first_row, first_column,
                           self.accelerator.process_index, LOSS_DRAW_TAG)
        return torch.Generator().manual_seed(seed)

    def _micro_loss(self, part: Rollout, advantages: torch.Tensor, need_reference: bool, num_actions: float,
                    num_sequences: float, max_actions: int, columns: torch.Tensor | None, lengths: torch.Tensor,
                    generator: torch.Generator | None = None
                    ) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor, torch.Tensor]:
        """Loss of one micro-batch (or one action chunk of it) → (loss, metrics, max |ratio − 1|, metric weight).

        The metrics, the deviation and the weight are 0-dim tensors (or floats): :func:`_read_scalars` reads them
        back together, so a micro-batch costs one device-to-host transfer instead of one per scalar."""
        algorithm = self.config.algorithm
        if columns is None:
            output = self.plugin.forward(self.policy, part, need_reference=need_reference)
        else:
            part = part.select_actions(columns)
            if advantages.dim() == 2:
                advantages = advantages.index_select(1, columns.to(advantages.device))
            output = self.plugin.forward(self.policy, part, need_reference=need_reference, actions=columns)
        logp = output.logp.float()  # [n, A]
        if logp.shape != part.mask.shape:
            raise RolloutError(
                f"plugin forward returned logp {tuple(logp.shape)} for a rollout whose mask is {tuple(part.mask.shape)}"
            )
        # Without old_logp (needs_old_logp False: one optimizer step on the sampling weights) the old policy is the
        # current one: ratio ≡ 1, and the deviation below is 0 by construction.
        old_logp = part.old_logp if part.old_logp is not None else logp.detach()  # [n, A]
        options = dict(algorithm.policy_loss.options)
        if self.loss_accepts_chunks:
            options["chunk_ids"] = part.chunk_ids
        if self.loss_reads_groups:
            options["group_ids"] = part.group_ids
        if self.loss_reads_reference:
            reference = output.ref_logp if output.ref_logp is not None else part.ref_logp
            if reference is None:
                raise RolloutError(f"policy loss {algorithm.policy_loss.name!r} reads ref_logp, but plugin "
                                   f"{self.plugin.name!r} returned none (PolicyOutput.ref_logp) and the rollout "
                                   "carries none")
            options["ref_logp"] = reference.float()
        if self.loss_draws:
            options["generator"] = generator  # the loss refuses None (a direct call without one)
        per_action, metrics = self.policy_loss(logp, old_logp, advantages, part.mask, **options)  # [n, A]
        metrics = {f"policy/{k}": v for k, v in metrics.items()}
        deviation = max_ratio_deviation(logp.detach(), old_logp, part.mask)
        selected = None  # [n, A] bool, the high-entropy actions the policy term trains (top_entropy_quantile)
        if algorithm.top_entropy_quantile < 1:
            selected = self._high_entropy(output.entropy, part.mask)
            per_action = per_action * selected
            metrics["policy/high_entropy_fraction"] = selected.sum() / part.mask.sum().clamp(min=1)
        if algorithm.off_policy_mask_threshold is not None:
            # OPSM (mmrl.algos.token_selection): the policy term only, as TRL; the entropy bonus keeps its actions.
            kept, _ = off_policy_sequence_mask(logp, old_logp, advantages, part.mask,
                                               algorithm.off_policy_mask_threshold)
            per_action = per_action * kept
            metrics["policy/off_policy_masked_fraction"] = 1.0 - kept.sum() / part.mask.sum().clamp(min=1)
        # Action weights scale the policy term only, as TempFlow-GRPO (policy loss × 2.25·std_t, then + β·kl_loss;
        # Shredded-Pork/TempFlow-GRPO e66824e, scripts/train_sd3_pr.py) and verl-omni's grpo_guard loss (÷ Δt before
        # the KL is added): the KL coefficient stays β at every action.
        total = per_action if part.action_weights is None else per_action * part.action_weights
        diagnostics: dict[str, torch.Tensor] = {}  # [n, A] each, averaged over the mask together below
        if algorithm.kl_coef > 0:
            kl = output.kl
            if kl is None:
                ref = output.ref_logp if output.ref_logp is not None else part.ref_logp
                if ref is None:
                    raise RolloutError("kl_coef > 0 but the plugin returned neither kl nor ref_logp")
                # Padding columns enter as equal zeros: the per-action estimators give them 0 (the mask drops them
                # anyway), and k2_seq, which sums a row's columns, sums the real ones only.
                real = part.mask > 0
                kl = self.kl_estimator(logp.where(real, 0.0), ref.float().where(real, 0.0))
                if algorithm.kl_importance_weighted:
                    # DeepSeek-V3.2's unbiased KL: k times the token ratio, with its gradient. E_old[r·k] = E_θ[k] at
                    # each sampled state, and on-policy ∇(r·k) = k·∇log π + ∇k, the exact gradient there. TRL's
                    # use_bias_correction_kl takes the loss's coef_1, a geometric mean at its sequence level: no
                    # importance weight, so mmrl keeps the token ratio whatever the loss's level.
                    kl = kl * log_ratio(logp, old_logp, part.mask).exp()
            elif algorithm.kl_importance_weighted:
                raise RolloutError(f"algorithm.kl_importance_weighted weights a KL estimated from ref_logp, but plugin "
                                   f"{self.plugin.name!r} returned its own KL (PolicyOutput.kl); set it to false")
            total = total + algorithm.kl_coef * kl
            diagnostics["policy/kl"] = kl
        if self.entropy_control is not None:
            if output.entropy is None:
                raise RolloutError(f"algorithm.entropy_target steers the entropy bonus by the measured entropy, which "
                                   f"plugin {self.plugin.name!r} did not return (PolicyOutput.entropy)")
            # The window of the step's trained actions (TRL's effective mask), weighted by the mask as the metrics.
            trained = part.mask.to(torch.float64) if selected is None else part.mask.to(torch.float64) * selected
            entropy = output.entropy.detach().to(torch.float64).where(trained > 0, 0.0)  # [n, A]; padding may be NaN
            stats = torch.stack([(entropy * trained).sum(), trained.sum()])  # [2]
            self._entropy_window = stats if self._entropy_window is None else self._entropy_window + stats
        elif algorithm.entropy_coef > 0 and output.entropy is None:  # a bonus that would silently do nothing
            raise RolloutError(f"algorithm.entropy_coef {algorithm.entropy_coef} weighs an entropy bonus, but plugin "
                               f"{self.plugin.name!r} did not return entropy (PolicyOutput.entropy); set it to 0")
        if output.entropy is not None:
            diagnostics["policy/entropy"] = output.entropy
            # The adaptive coefficient, when on, is the one the previous optimizer step left (0 while the gate is shut).
            coef = algorithm.entropy_coef if self.entropy_control is None else self.entropy_control.applied
            if coef > 0:  # on the trained actions only (TRL's effective mask)
                bonus = output.entropy if selected is None else output.entropy * selected
                total = total - coef * bonus
        diagnostics["policy/advantage"] = broadcast_advantages(advantages, logp)
        metrics.update(zip(diagnostics, masked_means(list(diagnostics.values()), part.mask).unbind(), strict=True))
        loss = aggregate(total, part.mask, algorithm.aggregation, num_actions=num_actions,
                         num_sequences=num_sequences, max_actions=max_actions, sequence_lengths=lengths)
        if output.aux_loss is not None:
            # The plugin's model regulariser (PolicyOutput.aux_loss): the mean over the optimizer step's backward
            # passes on every process, once the learner's `scale` has undone Accelerate's and DDP's averaging.
            aux = output.aux_loss.float().reshape(())
            loss = loss + aux / (self.geometry.backward_passes * self.accelerator.num_processes)
            metrics["loss/aux"] = aux.detach()
        return loss, metrics, deviation, part.mask.sum()

    def _high_entropy(self, entropy: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        """``[n, A]`` bool: the active actions in the top ``top_entropy_quantile`` by entropy, the threshold taken over
        this backward pass's active actions on every process (:mod:`mmrl.algos.token_selection`). A collective: the
        processes run the same number of backward passes."""
        if entropy is None:
            raise RolloutError(f"algorithm.top_entropy_quantile needs per-action entropy, which plugin "
                               f"{self.plugin.name!r} did not return (PolicyOutput.entropy)")
        acc = self.accelerator
        values = entropy.detach().float()[mask > 0]  # [k] this process's active entropies
        if acc.num_processes > 1:
            # entropies are ≥ 0: a negative pad marks the other processes' padding (TRL's sentinel)
            values = acc.gather(acc.pad_across_processes(values, dim=0, pad_index=-1.0))
            values = values[values >= 0]
        threshold = entropy_threshold(values, 1.0 - self.config.algorithm.top_entropy_quantile)
        return high_entropy_mask(entropy.detach(), mask, threshold)

    def old_policy_rollouts(self, rollout: Rollout, first: list[int] | tuple[int, ...] = ()
                            ) -> tuple[list[Rollout], bool]:
        """The rollout each inner epoch trains on, with the old policy's log-probs the core decided on (``[μ]``), and
        whether the learner takes the first mini-batch's old log-probs from its training forward.

        - One optimizer step per rollout (:func:`needs_old_logp` False): the rollout as it is, except that
          ``recompute_old_logp`` drops the sampler's log-probs; a missing ``old_logp`` means the detached training
          log-probs (the old policy is the current one).
        - Otherwise the rollout's ``old_logp`` when the plugin returned them (and ``recompute_old_logp`` is off);
          else one old-policy pass (:func:`old_policy_pass`) on the weights that sampled, before any update, shared by
          every epoch, or one per epoch on that epoch's noise draw for a plugin that redraws its noise per epoch
          (:attr:`mmrl.plugin.Plugin.redraws_per_epoch`).
        - The samples ``first`` (the first mini-batch of inner epoch 0) train on the weights that sampled them, so
          their old log-probs are the detached training log-probs, as with one optimizer step per rollout (TRL and
          verl reuse them the same way): epoch 0's pass leaves them out when no later epoch reads it (one pass per
          epoch, or a single epoch) and the policy computes the same in training and eval mode
          (:func:`same_in_train_and_eval`), and the second value is True; the learner then hands that mini-batch
          ``old_logp=None``. Their rows of epoch 0's ``old_logp`` are NaN.
        """
        algorithm, epochs = self.config.algorithm, self.geometry.inner_epochs
        if not needs_old_logp(self.config):
            if algorithm.recompute_old_logp:
                rollout = replace(rollout, old_logp=None)
            return [rollout] * epochs, False
        redraws = self.plugin.redraws_per_epoch and epochs > 1
        if rollout.old_logp is not None and not algorithm.recompute_old_logp and not redraws:
            return [rollout] * epochs, False
        skip = list(first) if (redraws or epochs == 1) and same_in_train_and_eval(self.policy) else []
        passes = []
        for epoch in range(epochs if redraws else 1):
            self.plugin.start_inner_epoch(epoch)
            passes.append(old_policy_pass(self.plugin, self.policy, rollout, batch_size=self.config.rollout.batch_size,
                                          skip=skip if epoch == 0 else ()))
        return (passes if redraws else passes * epochs), bool(skip)


# Config entries that switch a stochastic layer on in training mode: dropout of every kind (hidden, attention,
# classifier), stochastic depth (drop_path_rate, stochastic_depth_prob) and LayerDrop (layerdrop).
TRAIN_MODE_CONFIG_KEYS = ("dropout", "drop_path", "drop_rate", "stochastic_depth", "layerdrop")
# Module classes (by name: timm's DropPath, torchvision's StochasticDepth, ...) that drop in training mode, and the
# attributes that hold their probability.
TRAIN_MODE_MODULE_NAMES = ("droppath", "stochasticdepth", "layerdrop")
TRAIN_MODE_PROBABILITIES = ("p", "drop_prob", "drop_rate", "prob")


def same_in_train_and_eval(module: torch.nn.Module) -> bool:
    """Whether ``module`` computes the same in training mode as in eval mode, as far as its modules show: no dropout
    module with ``p > 0``, no stochastic-depth or LayerDrop module (by class name) with a positive probability (or
    one whose probability it cannot read), no batch norm, and no model config (``module.config`` of any submodule,
    as transformers and remote-code models keep theirs; nested sub-configs included) with a positive dropout,
    drop-path, stochastic-depth or LayerDrop entry (:data:`TRAIN_MODE_CONFIG_KEYS`: the functional dropout of
    attention kernels, a vision tower's drop path). False keeps the learner's eval-mode old-policy pass for every
    sample; a module that branches on ``self.training`` in other ways cannot be seen from outside."""
    configs: dict[int, Any] = {}  # submodules share their model's config: read each once (to_dict is not cheap)
    for sub in module.modules():
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.p > 0:
            return False
        if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm):
            return False
        if any(name in type(sub).__name__.lower() for name in TRAIN_MODE_MODULE_NAMES):
            probabilities = [getattr(sub, name) for name in TRAIN_MODE_PROBABILITIES if hasattr(sub, name)]
            if not probabilities or any(not isinstance(p, (int, float)) or p > 0 for p in probabilities):
                return False
        config = getattr(sub, "config", None)
        if hasattr(config, "to_dict"):
            configs[id(config)] = config
    return not any(_positive_train_mode_entry(config.to_dict()) for config in configs.values())


def _positive_train_mode_entry(entries: dict[str, Any]) -> bool:
    """Whether a config dict (or one nested in it: ``vision_config``, ``text_config``) has a positive
    :data:`TRAIN_MODE_CONFIG_KEYS` entry."""
    for key, value in entries.items():
        if isinstance(value, dict) and _positive_train_mode_entry(value):
            return True
        if (any(name in str(key).lower() for name in TRAIN_MODE_CONFIG_KEYS) and isinstance(value, (int, float))
                and value > 0):
            return True
    return False


@torch.no_grad()
def old_policy_pass(plugin: Plugin, policy: torch.nn.Module, rollout: Rollout, *,
                    batch_size: int | None = None, skip: list[int] | tuple[int, ...] = ()) -> Rollout:
    """``rollout`` with ``old_logp`` computed by :meth:`mmrl.plugin.Plugin.forward` on the current weights.

    This is how the core scores the old policy of a rollout that left ``old_logp`` out (the learner calls it before
    the first update of a step that needs them; a plugin's tests call it to get the old log-probs a training run
    would use). The pass runs under ``no_grad`` with the policy in eval mode, as sampling does (dropout off: the old
    policy is the one that sampled), in pieces of ``batch_size`` samples (``rollout.batch_size``, the bound sampling
    itself runs under; None: the whole rollout at once). The replay entries the plugin returns with the log-probs
    (``PolicyOutput.replay``, e.g. GRPO-Guard's old transition means) replace the sampler's in the returned rollout;
    ``rollout`` itself is not changed. A plugin that redraws its noise per inner epoch scores the draw selected by its
    last :meth:`mmrl.plugin.Plugin.start_inner_epoch`.

    Args:
        plugin: The plugin whose :meth:`~mmrl.plugin.Plugin.forward` scores the rollout.
        policy: The policy module, on the weights that sampled ``rollout``.
        rollout: A rollout of ``plugin``.
        batch_size: Samples per forward (None: all the scored samples).
        skip: Samples left out of the pass (the learner's first mini-batch, whose old log-probs are its training
            forward's, see :meth:`Learner.old_policy_rollouts`): their ``old_logp`` rows are NaN and their replay
            entries the rollout's (NaN, or 0 for integer entries, where the rollout has none).

    Returns:
        A shallow copy of ``rollout`` with ``old_logp`` ``[N, A]`` float32 and the plugin's replay entries.

    Raises:
        RolloutError: the plugin's log-probs do not match the rollout's mask ``[N, A]``.
    """
    left_out = set(skip)
    scored = [i for i in range(len(rollout)) if i not in left_out]
    if not scored:  # nothing to score: no forward, every row NaN
        return replace(rollout, old_logp=torch.full(rollout.mask.shape, math.nan, device=rollout.mask.device))
    size = batch_size or len(scored)
    parts, replays = [], []
    training = policy.training
    policy.eval()
    try:
        for piece in chunks(scored, size):
            part = rollout.select(torch.tensor(piece, dtype=torch.long))
            output = plugin.forward(policy, part, need_reference=False)
            parts.append(output.logp.float())
            replays.append(output.replay or {})
    finally:
        policy.train(training)
    old_logp = torch.cat(parts)  # [n, A], n = len(scored)
    if old_logp.shape != (len(scored), *rollout.mask.shape[1:]):
        raise RolloutError(f"plugin forward returned logp {tuple(old_logp.shape)} for a rollout whose mask is "
                           f"{(len(scored), *rollout.mask.shape[1:])}")
    entries = {key: torch.cat([r[key] for r in replays]) for key in replays[0]}
    if left_out:  # scatter the scored rows into [N, ...] tensors
        index = torch.tensor(scored, dtype=torch.long, device=old_logp.device)
        old_logp = old_logp.new_full(rollout.mask.shape, math.nan).index_copy(0, index, old_logp)  # [N, A]
        for key, values in entries.items():
            base = rollout.replay.get(key)
            if not isinstance(base, torch.Tensor) or base.shape[1:] != values.shape[1:] or base.dtype != values.dtype:
                fill = math.nan if values.is_floating_point() else 0
                base = values.new_full((len(rollout), *values.shape[1:]), fill)
            entries[key] = base.to(values.device).index_copy(0, index.to(values.device), values)
    replay = {**rollout.replay, **entries}
    return replace(rollout, old_logp=old_logp, replay=replay)


def max_ratio_deviation(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """max |π/π_old − 1| over the active actions (``mask > 0``), 0 when there are none, as a 0-dim tensor.

    |r − 1| >= 0, so zeroing the inactive entries leaves the maximum of the active ones without a host-side
    ``any()`` (and a NaN among the active ones still shows).

    Shapes:
        logp, old_logp, mask ``[n, A]`` → scalar.
    """
    if mask.numel() == 0:
        return torch.zeros((), dtype=logp.dtype, device=logp.device)
    return (logp - old_logp).exp().sub(1).abs().masked_fill(mask <= 0, 0.0).max()


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _read_scalars(metrics: dict[str, Any], extra: tuple[Any, ...]) -> tuple[dict[str, float], list[float]]:
    """``metrics`` (floats or 0-dim tensors) and the ``extra`` scalars as Python floats, the tensors read back in one
    ``tolist()`` per device (each as float32, as :meth:`WeightedMeans.add` reads a tensor)."""
    values = [*metrics.values(), *extra]
    by_device: dict[torch.device, list[int]] = {}
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append(i)
    for tensors in by_device.values():
        with torch.no_grad():  # no detach needed; a 0-dim float32 tensor (the usual metric) goes in as it is
            read = torch.stack([_as_float32_scalar(values[i]) for i in tensors]).tolist()
        for i, value in zip(tensors, read, strict=True):
            values[i] = value
    values = [float(value) for value in values]
    return dict(zip(metrics, values[:len(metrics)], strict=True)), values[len(metrics):]


def _as_float32_scalar(value: torch.Tensor) -> torch.Tensor:
    """A one-element tensor as a 0-dim float32 tensor (itself when it is one already)."""
    if value.dtype != torch.float32:
        value = value.float()
    return value if value.dim() == 0 else value.reshape(())
