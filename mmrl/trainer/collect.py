"""Steps 1–4 of a training step: prompts → rollout → rewards → advantages on the gathered batch.

The :class:`Collector` draws this process's share of the step's prompts from the shared stream, asks the plugin
for rollouts (scoring each chunk, asynchronously if configured), gathers rewards, validity flags and group ids from
every process, computes the group-relative advantages on the global batch and keeps this process's slice. With
DAPO dynamic sampling it repeats rounds until every process holds enough samples from groups with spread.
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
        pooled_adv: list[torch.Tensor] = []
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
            advantages, keep, round_metrics = self.credit(rollout, scored.scores, scored.valid)
            timings["advantage"] = timings.get("advantage", 0.0) + time.perf_counter() - tick
            if round_index == 0:
                first_round = round_metrics
            metrics.add_all(round_metrics)
            pooled.append(rollout)
            pooled_adv.append(advantages)
            pooled_keep.append(keep if dynamic.enabled else scored.valid.to(keep.device))
            if not dynamic.enabled:
                break
            kept = torch.cat(pooled_keep).sum().reshape(1).to(acc.device)
            if batch_is_full(acc.gather(kept), geometry.local_samples):
                break

        rollout = Rollout.concat(pooled) if len(pooled) > 1 else pooled[0]
        advantages = _concat_advantages(pooled_adv)
        selection = select_kept(torch.cat(pooled_keep).cpu(), geometry.local_samples)
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

    def credit(self, rollout: Rollout, scores: torch.Tensor, valid: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Gather, validate groups, compute advantages on the global batch, keep this process's slice.

        Returns ``(advantages [n] or [n, A], keep [n] (groups with spread, valid samples), metrics)``.
        """
        config, acc = self.config, self.accelerator
        algorithm = config.algorithm
        weights = self.scorer.weights
        n = len(rollout)
        device = acc.device
        g_scores = acc.gather(scores.to(device)).cpu()  # [B, K]
        g_valid = acc.gather(valid.to(device)).cpu()  # [B]
        g_groups = acc.gather(rollout.group_ids.to(device)).cpu()  # [B]
        validate_groups(g_groups, self.geometry.group_size, where="gathered rollout batch")
        credit = sample_advantages(
            g_scores, g_valid, g_groups, weights, self.estimator, algorithm.advantage.options,
            order=config.rewards.multi_reward, clip=algorithm.advantage_clip,
        )
        local = slice(acc.process_index * n, (acc.process_index + 1) * n)  # gather concatenates in process order
        advantages: torch.Tensor = credit.advantages[local]  # [n]
        # Spread among the valid members only: a skipped sample's placeholder reward must not fake a spread.
        spread = torch.zeros_like(g_valid)
        valid_index = g_valid.nonzero().flatten()
        if valid_index.numel():
            spread[valid_index] = groups_with_spread(credit.combined[valid_index], g_groups[valid_index],
                                                     tolerance=config.rollout.dynamic_sampling.tolerance)
        keep = spread[local]

        per_action = self.plugin.action_rewards(rollout, scores @ weights)
        if per_action is not None:  # per-action credit: normalise per (group, action position)
            width = per_action.shape[1]
            max_width = int(acc.gather(torch.tensor([width], device=device)).max())
            padded_mask = torch.nn.functional.pad(rollout.mask.float(), (0, max_width - rollout.mask.shape[1]))
            g_mask = acc.gather((padded_mask * valid.float().unsqueeze(1)).to(device)).cpu()  # [B, A_max]

            def normalised(values: torch.Tensor, clip: float | None) -> torch.Tensor:  # [n, A] → [B, A_max]
                padded = torch.nn.functional.pad(values.float(), (0, max_width - width))
                g_values = acc.gather(padded.to(device)).cpu()  # [B, A_max]
                return action_advantages(g_values, g_mask, g_groups, self.estimator, algorithm.advantage.options,
                                         clip=clip)

            if config.rewards.multi_reward == "normalize_then_sum":
                per_reward = [self._action_rewards_of(rollout, scores[:, k]) for k in range(scores.shape[1])]
                per_action_adv = _weighted_whitened(torch.stack([normalised(r, None) for r in per_reward], dim=-1),
                                                    g_mask, weights, algorithm.advantage_clip)
            else:
                per_action_adv = normalised(per_action, algorithm.advantage_clip)
            advantages = per_action_adv[local, :width]

        metrics = reward_metrics(self.scorer.names, g_scores, g_valid, credit.combined, credit.advantages, g_groups)
        return advantages.to(device), keep.to(device), metrics

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
                   advantages: torch.Tensor, group_ids: torch.Tensor) -> dict[str, float]:
    """Reward, advantage and group metrics of a gathered batch (valid samples only)."""
    metrics: dict[str, float] = {}
    good = valid.nonzero().flatten()
    if good.numel():
        for k, name in enumerate(names):
            column = scores[good, k].double()
            metrics[f"reward/{name}_mean"] = float(column.mean())
            metrics[f"reward/{name}_std"] = float(column.std(unbiased=False))
        metrics["reward/mean"] = float(combined[good].double().mean())
        metrics["reward/std"] = float(combined[good].double().std(unbiased=False))
        adv = advantages[good].double()
        metrics["advantage/mean"] = float(adv.mean())
        metrics["advantage/std"] = float(adv.std(unbiased=False))
        metrics["advantage/abs_max"] = float(adv.abs().max())
        spread = groups_with_spread(combined[good], group_ids[good])  # [n_valid], per sample
        _, first = torch.unique(group_ids[good], return_inverse=True)
        first_member = torch.full((int(first.max()) + 1,), len(first), dtype=torch.long).scatter_reduce(
            0, first, torch.arange(len(first)), reduce="amin"
        )  # one sample per group
        metrics["groups/no_spread_fraction"] = float((~spread[first_member]).float().mean())
    metrics["samples/invalid"] = float((~valid).sum())
    return metrics


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


def _concat_advantages(parts: list[torch.Tensor]) -> torch.Tensor:
    """Join per-round advantages: ``[n]`` pieces, or ``[n, A]`` pieces padded to one width."""
    if len(parts) == 1:
        return parts[0]
    if all(p.dim() == 1 for p in parts):
        return torch.cat(parts)
    width = max(p.shape[1] for p in parts if p.dim() == 2)
    expanded = [p.unsqueeze(1).expand(-1, width) if p.dim() == 1 else
                torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]
    return torch.cat(expanded)
