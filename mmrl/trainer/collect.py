"""Steps 1–4 of a training step: prompts → rollout → rewards → advantages on the gathered batch.

The :class:`Collector` draws this process's share of the step's prompts from the shared stream, asks the plugin
for rollouts (scoring each chunk, asynchronously if configured), gathers rewards, validity flags and group ids from
every process, computes the group-relative advantages on the global batch and keeps this process's slice. With
DAPO dynamic sampling it repeats rounds until every process holds enough samples from groups with spread, and
computes the advantages once, on the kept batch of all processes (:meth:`Collector.credit_kept`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from mmrl.algos import (
    advantage_estimators,
    batch_is_full,
    groups_with_spread,
    multi_reward_advantages,
    select_kept,
    validate_groups,
)
from mmrl.algos.dynamic_sampling import SelectionPlan
from mmrl.config import TrainConfig
from mmrl.plugin import Plugin, PromptBatch
from mmrl.reward import RewardInput, RewardScorer, ScoredBatch
from mmrl.rollout import Rollout, RolloutError
from mmrl.seeding import derive_seed
from mmrl.trainer.credit import action_advantages, sample_advantages
from mmrl.trainer.geometry import BatchGeometry
from mmrl.trainer.metrics import WeightedMeans
from mmrl.trainer.sampler import PromptStream, plan_local_batch


@dataclass
class TrainingBatch:
    """This process's samples for the update phase of one step.

    Attributes:
        rollout: Exactly ``geometry.local_samples`` samples (padding, if any, has mask 0).
        advantages: ``[n]`` per sample, or ``[n, A]`` per action.
        metrics: Reward, advantage, group and sampling metrics of the step (global).
    """

    rollout: Rollout
    advantages: torch.Tensor
    metrics: dict[str, float]


@dataclass
class ScoredRound:
    """One sampling round's credit inputs, gathered over processes (process p's n samples at rows [p·n, (p+1)·n)).

    Attributes:
        scores: ``[B, K]`` reward columns.
        valid: ``[B]`` bool.
        group_ids: ``[B]``.
        combined: ``[B]`` the weighted reward Σ_k w_k·r_k (0 for invalid samples).
        local: This process's rows.
        keep: ``[n]`` bool, this process's valid samples in groups with spread (the dynamic-sampling filter).
        action_values: The plugin's per-action rewards, gathered and padded to the widest process, ``[B, A_r]``:
            of the combined reward, or one per reward column with ``normalize_then_sum``; None without per-action
            credit.
        action_mask: ``[B, A_r]`` the action mask times validity (None without per-action credit).
        action_width: This process's width of the per-action rewards (None without per-action credit).
        metrics: The round's reward and group metrics.
    """

    scores: torch.Tensor
    valid: torch.Tensor
    group_ids: torch.Tensor
    combined: torch.Tensor
    local: slice
    keep: torch.Tensor
    action_values: list[torch.Tensor] | None
    action_mask: torch.Tensor | None
    action_width: int | None
    metrics: dict[str, float]

    @property
    def n(self) -> int:
        """Samples per process."""
        return self.local.stop - self.local.start


class Collector:
    """Turns the step's prompts into a training batch with advantages.

    Args:
        config: The run's config.
        accelerator: The run's Accelerator (for gathers and reductions).
        geometry: Batch sizes of the run.
        plugin: The modality plugin.
        scorer: The configured rewards.
        stream: The shared prompt stream (its position is part of every checkpoint).
        rows: The training prompt rows.
    """

    def __init__(self, config: TrainConfig, accelerator: Accelerator, geometry: BatchGeometry, plugin: Plugin,
                 scorer: RewardScorer, stream: PromptStream, rows: list[dict[str, Any]]):
        self.config = config
        self.accelerator = accelerator
        self.geometry = geometry
        self.plugin = plugin
        self.scorer = scorer
        self.stream = stream
        self.rows = rows
        self.estimator = advantage_estimators.get(config.algorithm.advantage.name)

    def collect(self, policy: torch.nn.Module, step: int, timings: dict[str, float]) -> TrainingBatch:
        """Sample, score and credit the prompts of ``step`` (several rounds under dynamic sampling)."""
        config, acc, geometry = self.config, self.accelerator, self.geometry
        dynamic = config.rollout.dynamic_sampling
        rounds = dynamic.max_rounds if dynamic.enabled else 1
        pooled: list[Rollout] = []
        scored_rounds: list[ScoredRound] = []
        pooled_keep: list[torch.Tensor] = []
        metrics = WeightedMeans()
        first_round: dict[str, float] = {}
        used_rounds = 0
        for round_index in range(rounds):
            used_rounds += 1
            plan = plan_local_batch(
                self.stream, prompts=geometry.prompts, group_size=geometry.group_size,
                num_processes=acc.num_processes, process_index=acc.process_index,
                layout=config.rollout.layout, seed=config.run.seed, step=step, round_index=round_index,
            )
            batch = PromptBatch(
                rows=[self.rows[i] for i in plan.dataset_indices],
                group_ids=torch.tensor(plan.group_ids, dtype=torch.long),
                group_size=geometry.group_size,
                seeds=torch.tensor(plan.seeds, dtype=torch.long),
                generator=self.generator(step, round_index),
                training=True,
                step=step,
                max_steps=config.run.max_steps,
            )
            policy.eval()
            rollout, scored = self.sample_and_score(policy, batch, timings)
            policy.train()

            tick = time.perf_counter()
            scored_round = self.score_round(rollout, scored.scores, scored.valid)
            timings["advantage"] = timings.get("advantage", 0.0) + time.perf_counter() - tick
            if round_index == 0:
                first_round = scored_round.metrics
            metrics.add_all(scored_round.metrics)
            pooled.append(rollout)
            scored_rounds.append(scored_round)
            keep = scored_round.keep if dynamic.enabled else scored_round.valid[scored_round.local]
            pooled_keep.append(keep.to(acc.device))
            if not dynamic.enabled:
                break
            kept = torch.cat(pooled_keep).sum().reshape(1).to(acc.device)
            if batch_is_full(acc.gather(kept), geometry.local_samples):
                break

        rollout = Rollout.concat(pooled) if len(pooled) > 1 else pooled[0]
        selection = select_kept(torch.cat(pooled_keep).cpu(), geometry.local_samples)
        tick = time.perf_counter()
        advantages, advantage_stats = self.credit_kept(scored_rounds, selection)  # [M] or [M, A], pooled order
        timings["advantage"] = timings.get("advantage", 0.0) + time.perf_counter() - tick
        rollout = rollout.select(selection.indices)
        advantages = advantages.index_select(0, selection.indices.to(advantages.device))
        keep_mask = (~selection.padded).to(rollout.mask.dtype).to(rollout.mask.device)
        rollout.mask = rollout.mask * keep_mask.unsqueeze(1)  # padding takes part without contributing
        truncated = self.truncated(rollout)  # [n] bool, or None when the plugin does not say
        if truncated is not None and config.algorithm.mask_truncated:
            # DAPO's overlong filtering (TRL mask_truncated_completions): out of the loss, after their rewards took
            # part in their groups' advantages.
            rollout.mask = rollout.mask * (~truncated).to(rollout.mask.dtype).unsqueeze(1)

        out = metrics.means()
        out.update({k: v for k, v in first_round.items() if k.startswith("groups/")})
        out.update(advantage_stats)
        out["samples/generated"] = float(used_rounds * geometry.samples)
        out["samples/rounds"] = float(used_rounds)
        out["samples/padded"] = float(acc.reduce(selection.padded.sum().to(acc.device).float(), "sum"))
        if truncated is not None:  # the share of the step's (kept) samples cut short by the generation budget
            counts = torch.stack([(truncated & ~selection.padded.to(truncated.device)).sum(),
                                  (~selection.padded).sum().to(truncated.device)]).float().to(acc.device)
            truncated_count, sample_count = acc.reduce(counts, "sum").tolist()
            out["samples/truncated"] = truncated_count / max(sample_count, 1.0)
            if config.algorithm.mask_truncated:
                out["samples/truncated_masked"] = truncated_count  # left out of the loss (samples/trained)
        rollout_means = WeightedMeans()
        rollout_means.add_all(rollout.metrics, prefix="rollout/")  # every round's (Rollout.concat pools them)
        out.update(reduce_means(rollout_means, acc.num_processes))
        return TrainingBatch(rollout=rollout, advantages=advantages, metrics=out)

    def truncated(self, rollout: Rollout) -> torch.Tensor | None:
        """``[n]`` bool ``rollout.truncated`` on the rollout's device; refuses ``algorithm.mask_truncated`` for a plugin
        whose rollouts do not say which samples were cut short."""
        if rollout.truncated is None:
            if self.config.algorithm.mask_truncated:
                raise RolloutError(f"algorithm.mask_truncated needs rollout.truncated, which plugin "
                                   f"{self.plugin.name!r} does not set (its samples cannot be cut short, or it does "
                                   "not say): set algorithm.mask_truncated to false")
            return None
        return rollout.truncated.to(rollout.mask.device)

    def sample_and_score(self, policy: torch.nn.Module, batch: PromptBatch, timings: dict[str, float],
                         scorer: RewardScorer | None = None) -> tuple[Rollout, ScoredBatch]:
        """Sample ``batch`` in plugin calls of ``rollout.batch_size`` samples and score it with ``scorer`` (default:
        the training rewards; the evaluation passes its own when ``eval.rewards`` is set).

        With ``rewards.async_scoring`` each chunk is scored in the reward worker pool while the next chunk is
        sampled; the scores are the same as synchronous scoring. Group-wise rewards need whole groups, so a scorer
        with one is always called on the whole batch.
        """
        scorer = self.scorer if scorer is None else scorer
        size = self.config.rollout.batch_size or len(batch) or 1
        overlap = self.config.rewards.async_scoring and not scorer.groupwise
        parts, futures = [], []
        tick = time.perf_counter()
        for chunk in chunks(list(range(len(batch))), size):
            index = torch.tensor(chunk, dtype=torch.long)
            sub = PromptBatch(
                rows=[batch.rows[i] for i in chunk], group_ids=batch.group_ids[index],
                group_size=batch.group_size, seeds=batch.seeds[index], generator=batch.generator,
                training=batch.training, step=batch.step, max_steps=batch.max_steps,
            )
            part = self.rollout(policy, sub)
            parts.append(part)
            if overlap:
                futures.append(scorer.submit(RewardInput(part.rows, part.payload, part.group_ids)))
        timings["rollout"] = timings.get("rollout", 0.0) + time.perf_counter() - tick
        tick = time.perf_counter()
        rollout = parts[0] if len(parts) == 1 else Rollout.concat(parts)
        if overlap:
            scored = ScoredBatch.concat([future.result() for future in futures])
        else:
            scored = scorer.score(RewardInput(rollout.rows, rollout.payload, rollout.group_ids))
        timings["reward"] = timings.get("reward", 0.0) + time.perf_counter() - tick
        return rollout, scored

    def rollout(self, policy: torch.nn.Module, batch: PromptBatch) -> Rollout:
        """One plugin call, checked against the contract (a rollout, the same samples, valid shapes)."""
        name = self.config.plugin.name
        rollout = self.plugin.rollout(policy, batch)
        if not isinstance(rollout, Rollout):
            raise RolloutError(f"plugin {name!r} returned {type(rollout).__name__}, not a Rollout")
        if len(rollout) != len(batch) or not torch.equal(rollout.group_ids.cpu(), batch.group_ids.cpu()):
            raise RolloutError(
                f"plugin {name!r} returned {len(rollout)} samples whose group_ids differ from the {len(batch)} "
                "prompts it was given"
            )
        if not rollout.rows:
            rollout.rows = batch.rows
        return rollout.validate()

    def score_round(self, rollout: Rollout, scores: torch.Tensor, valid: torch.Tensor) -> ScoredRound:
        """Gather one round's scores, validity flags and group ids from every process, check the groups, decide
        which of this process's samples dynamic sampling keeps, and collect (and gather) the plugin's per-action
        rewards. No advantage is computed here: that waits for the kept batch (:meth:`credit_kept`).

        The keep decision needs the round's combined reward Σ_k w_k·r_k of every valid member of a group, which is
        why it is taken per round, before any pooling.
        """
        config, acc = self.config, self.accelerator
        weights = self.scorer.weights
        n = len(rollout)
        device = acc.device
        g_scores = acc.gather(scores.to(device)).cpu()  # [B, K]
        g_valid = acc.gather(valid.to(device)).cpu()  # [B]
        g_groups = acc.gather(rollout.group_ids.to(device)).cpu()  # [B]
        validate_groups(g_groups, self.geometry.group_size, where="gathered rollout batch")
        local = slice(acc.process_index * n, (acc.process_index + 1) * n)  # gather concatenates in process order
        combined = torch.zeros(len(g_valid), dtype=torch.float32)  # [B], 0 for invalid samples
        spread = torch.zeros_like(g_valid)
        valid_index = g_valid.nonzero().flatten()
        if valid_index.numel():
            combined[valid_index] = g_scores[valid_index].to(torch.float32) @ weights.to(torch.float32)
            # Spread among the valid members only: a skipped sample's placeholder reward must not fake a spread.
            spread[valid_index] = groups_with_spread(combined[valid_index], g_groups[valid_index],
                                                     tolerance=config.rollout.dynamic_sampling.tolerance)

        action_values, action_mask, width = None, None, None
        per_action = self.plugin.action_rewards(rollout, scores @ weights)
        if per_action is not None:  # per-action credit: normalised per (group, action position) in credit_rows
            width = per_action.shape[1]
            max_width = int(acc.gather(torch.tensor([width], device=device)).max())
            padded_mask = torch.nn.functional.pad(rollout.mask.float(), (0, max_width - rollout.mask.shape[1]))
            action_mask = acc.gather((padded_mask * valid.float().unsqueeze(1)).to(device)).cpu()  # [B, A_max]

            def gathered(values: torch.Tensor) -> torch.Tensor:  # [n, A] → [B, A_max]
                padded = torch.nn.functional.pad(values.float(), (0, max_width - values.shape[1]))
                return acc.gather(padded.to(device)).cpu()

            if config.rewards.multi_reward == "normalize_then_sum":
                action_values = [gathered(self._action_rewards_of(rollout, scores[:, k]))
                                 for k in range(scores.shape[1])]
            else:
                action_values = [gathered(per_action)]

        metrics = reward_metrics(self.scorer.names, g_scores, g_valid, combined, g_groups)
        return ScoredRound(scores=g_scores, valid=g_valid, group_ids=g_groups, combined=combined, local=local,
                           keep=spread[local], action_values=action_values, action_mask=action_mask,
                           action_width=width, metrics=metrics)

    def credit_kept(self, rounds: list[ScoredRound], selection: SelectionPlan
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Advantages of this process's pooled samples (all rounds, in sampling order), computed once on the kept
        batch of all processes; ``(advantages [M] or [M, A], advantage metrics)``.

        verl's DAPO recipe filters the groups, pools generation batches until enough prompts are kept, truncates to
        the train batch and only then estimates advantages (``recipe/dapo/dapo_ray_trainer.py`` L255-288, then
        ``compute_advantage`` L323 at volcengine/verl@246cac4), so statistics over the batch (``batch_std``'s
        std, ``gpg``'s α, ``reinforce_pp_baseline``'s variance, ``normalize_then_sum``'s whitening) span the kept
        batch. Here too: the estimator runs on the *credited* samples, the valid members of every group of which
        at least one sample is trained on some process (kept by the spread filter and chosen by
        :func:`mmrl.algos.select_kept`, not padding). Invalid samples never count; padding gets 0 (mask 0 anyway).

        Whole groups (the usual case) make the credited samples exactly the trained ones. A group-local estimator
        then gives the same advantages as an estimate per round (a group's statistics only read its own members,
        gathered in the same order), bit for bit. ``select_kept`` can split a group, though, keeping the first
        members of a process's kept samples in sampling order: with ``rollout.layout: spread`` and a group size
        that the number of processes does not divide (each process holds a different number of each group's
        members, so the per-process cut falls at different groups), or whenever a kept group lost a member to
        ``rewards.on_nonfinite: skip`` (its kept count is no longer a multiple of G), on any layout. verl never
        splits: its groups are contiguous (``repeat(..., interleave=True)``, L191) and whole, and it keeps the first
        ``train_batch_size·n`` samples. mmrl credits a split group's members that the cut left out too: its group
        statistics stay those of all its valid members, as without dynamic sampling (a baseline from all of the
        prompt's sampled rewards, not from a remnant; a remnant of one member would get 0), and they count in the batch
        statistics, which thus span the kept *groups*; the left-out members are not trained.

        Order: accelerate's gather concatenates in process order, so a round's gathered rows are process p's n
        samples at [p·n, (p+1)·n); the rounds follow each other (round r at [r·B, (r+1)·B)). The pooled ``trained``
        flags are gathered the same way (process p's M = R·n pooled samples at [p·M, (p+1)·M)) and put back in
        that round-major order, so every process computes the same global credit and reads its own rows.
        """
        acc = self.accelerator
        valid = torch.cat([r.valid for r in rounds])  # [R·B]
        group_ids = torch.cat([r.group_ids for r in rounds])  # [R·B]
        batch = len(rounds[0].valid)
        # Global row of each of this process's pooled samples: round r's sample i at r·B + p·n + i.
        rows = torch.cat([torch.arange(r.local.start, r.local.stop) + k * batch for k, r in enumerate(rounds)])
        if self.config.rollout.dynamic_sampling.enabled:
            trained = torch.zeros(len(rows), dtype=torch.bool)  # [M]
            trained[selection.indices[~selection.padded]] = True
            g_trained = acc.gather(trained.to(acc.device)).cpu()  # [W·M], process-major
            # Every process's rows, in the process-major order of the gather.
            all_rows = torch.cat([torch.cat([torch.arange(p * r.n, (p + 1) * r.n) + k * batch
                                             for k, r in enumerate(rounds)]) for p in range(acc.num_processes)])
            trained_rows = torch.zeros_like(valid)
            trained_rows[all_rows] = g_trained
            credited = valid & torch.isin(group_ids, group_ids[trained_rows])  # [R·B]
        else:  # one round, every valid sample is trained (select_kept only moves the invalid ones to the end)
            credited = valid
        advantages, stats = self.credit_rows(rounds, credited)
        advantages = advantages[rows]  # [M] or [M, A]
        if advantages.dim() == 2:  # this process's widest round (the gathered width may exceed it)
            advantages = advantages[:, :max(r.action_width for r in rounds)]
        return advantages.to(acc.device), stats

    def credit_rows(self, rounds: list[ScoredRound], credited: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Advantages of the gathered rows of ``rounds`` (concatenated), computed over the ``credited [R·B]`` rows
        only (0 elsewhere): ``([R·B]`` or ``[R·B, A]``, advantage metrics of the sample-level advantages)."""
        config, algorithm = self.config, self.config.algorithm
        weights = self.scorer.weights
        scores = torch.cat([r.scores for r in rounds])  # [R·B, K]
        group_ids = torch.cat([r.group_ids for r in rounds])  # [R·B]
        credit = sample_advantages(
            scores, credited, group_ids, weights, self.estimator, algorithm.advantage.options,
            order=config.rewards.multi_reward, clip=algorithm.advantage_clip,
        )
        stats = advantage_metrics(credit.advantages, credited)
        with_actions = [r.action_values is not None for r in rounds]
        if not any(with_actions):
            return credit.advantages, stats
        if not all(with_actions):
            raise RolloutError(f"plugin {self.config.plugin.name!r} returned per-action rewards in some sampling "
                               "rounds of a step and None in others: action_rewards must answer alike every round")
        width = max(r.action_mask.shape[1] for r in rounds)

        def stacked(parts: list[torch.Tensor]) -> torch.Tensor:  # per-round [B, A_r] → [R·B, A]
            return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])

        mask = stacked([r.action_mask for r in rounds]) * credited.float().unsqueeze(1)  # [R·B, A]
        columns = [stacked([r.action_values[k] for r in rounds]) for k in range(len(rounds[0].action_values))]

        def normalised(values: torch.Tensor, clip: float | None) -> torch.Tensor:  # [R·B, A]
            return action_advantages(values, mask, group_ids, self.estimator, algorithm.advantage.options, clip=clip)

        if config.rewards.multi_reward == "normalize_then_sum":
            per_action = _weighted_whitened(torch.stack([normalised(c, None) for c in columns], dim=-1), mask,
                                            weights, algorithm.advantage_clip)
        else:
            per_action = normalised(columns[0], algorithm.advantage_clip)
        return per_action, stats

    def credit(self, rollout: Rollout, scores: torch.Tensor, valid: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """One batch credited whole (every valid sample, as a step without dynamic sampling): gather, validate
        groups, compute advantages on the global batch, keep this process's slice.

        Returns ``(advantages [n] or [n, A], keep [n] (groups with spread, valid samples), metrics)``.
        """
        scored = self.score_round(rollout, scores, valid)
        advantages, stats = self.credit_rows([scored], scored.valid)
        advantages = advantages[scored.local]
        if advantages.dim() == 2:
            advantages = advantages[:, :scored.action_width]
        device = self.accelerator.device
        return advantages.to(device), scored.keep.to(device), {**scored.metrics, **stats}

    def _action_rewards_of(self, rollout: Rollout, rewards: torch.Tensor) -> torch.Tensor:
        """The plugin's per-action rewards ``[n, A]`` of one reward column ``rewards [n]`` (``normalize_then_sum``).
        The hook sees a shallow copy: what it sets on the rollout (the tree's width pruning, its metrics) stays from
        the call with the combined reward."""
        copy = replace(rollout, metrics=dict(rollout.metrics))
        per_action = self.plugin.action_rewards(copy, rewards)
        if per_action is None:
            raise RolloutError(f"plugin {self.config.plugin.name!r} returned per-action rewards for the combined "
                               "reward but None for a single reward column")
        return per_action

    def generator(self, step: int, round_index: int) -> torch.Generator:
        """The per-process generator of a sampling round (for plugins that draw batched noise)."""
        seed = derive_seed(self.config.run.seed, step, round_index, self.accelerator.process_index)
        return torch.Generator(device=self.accelerator.device).manual_seed(seed)


def chunks(items: list[int], size: int) -> Iterator[list[int]]:
    """Consecutive pieces of ``items`` of at most ``size`` elements."""
    for start in range(0, len(items), max(size, 1)):
        yield items[start:start + size]


def reduce_means(means: WeightedMeans, num_processes: int) -> dict[str, float]:
    """Weighted means over all processes. Metric names may differ between processes (a process whose samples were
    all padding records none), so the partial sums travel as objects rather than as aligned tensors."""
    if num_processes == 1:
        return means.means()
    merged = WeightedMeans()
    for totals, weights in gather_object([(dict(means.totals), dict(means.weights))]):
        for name, total in totals.items():
            merged.totals[name] += total
            merged.weights[name] += weights[name]
    return merged.means()


def reward_metrics(names: list[str], scores: torch.Tensor, valid: torch.Tensor, combined: torch.Tensor,
                   group_ids: torch.Tensor) -> dict[str, float]:
    """Reward and group metrics of a gathered round (valid samples only)."""
    metrics: dict[str, float] = {}
    good = valid.nonzero().flatten()
    if good.numel():
        for k, name in enumerate(names):
            column = scores[good, k].double()
            metrics[f"reward/{name}_mean"] = float(column.mean())
            metrics[f"reward/{name}_std"] = float(column.std(unbiased=False))
        metrics["reward/mean"] = float(combined[good].double().mean())
        metrics["reward/std"] = float(combined[good].double().std(unbiased=False))
        spread = groups_with_spread(combined[good], group_ids[good])  # [n_valid], per sample
        _, first = torch.unique(group_ids[good], return_inverse=True)
        first_member = torch.full((int(first.max()) + 1,), len(first), dtype=torch.long).scatter_reduce(
            0, first, torch.arange(len(first)), reduce="amin"
        )  # one sample per group
        metrics["groups/no_spread_fraction"] = float((~spread[first_member]).float().mean())
    metrics["samples/invalid"] = float((~valid).sum())
    return metrics


def advantage_metrics(advantages: torch.Tensor, credited: torch.Tensor) -> dict[str, float]:
    """Mean, std and largest magnitude of the sample-level advantages of the credited samples (with dynamic
    sampling: the kept batch's)."""
    good = credited.nonzero().flatten()
    if not good.numel():
        return {}
    adv = advantages[good].double()
    return {"advantage/mean": float(adv.mean()), "advantage/std": float(adv.std(unbiased=False)),
            "advantage/abs_max": float(adv.abs().max())}


def _weighted_whitened(per_reward: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor,
                       clip: float | None) -> torch.Tensor:
    """GDPO's ``normalize_then_sum`` on per-action advantages: ``per_reward [B, A, K]`` (each reward already normalised
    per (group, action position)) → Σ_k w_k·A_k whitened over the active entries (``mask > 0``) → ``[B, A]``.

    :func:`mmrl.algos.multi_reward_advantages` with the identity as its estimator does the weighting and whitening,
    so per-action credit uses exactly the sample-level formula (and its eps)."""
    out = torch.zeros(per_reward.shape[:2], dtype=torch.float32)
    active = mask > 0
    if active.any():
        entries = per_reward[active]  # [M, K]
        whitened, _ = multi_reward_advantages(entries, weights.to(entries.dtype), torch.zeros(len(entries)),
                                              lambda rewards, group_ids: rewards, order="normalize_then_sum")
        out[active] = whitened.to(torch.float32)
    return out if clip is None else out.clamp(-clip, clip)
