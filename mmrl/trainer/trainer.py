"""The training loop on Hugging Face Accelerate.

One step::

    prompts ─► rollout ─► rewards ─► gather ─► advantages ─► μ × (mini-batches of micro-batches) ─► optimizer
      (1)        (2)        (3)         (4: on the global batch, each        (5)                         (6, 7: EMA)
                                         process keeps its slice)
    then metrics, evaluation every k steps (8) and checkpoints (9).

The trainer knows nothing about modalities: it hands :class:`~mmrl.plugin.PromptBatch` es to the plugin and gets
:class:`~mmrl.rollout.Rollout` s back, and all the math comes from :mod:`mmrl.algos`.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import gather_object, set_seed
from tqdm.auto import tqdm

from mmrl import __version__
from mmrl.algos import (
    advantage_estimators,
    aggregate,
    aggregation_counts,
    batch_is_full,
    broadcast_advantages,
    groups_with_spread,
    kl_estimators,
    policy_losses,
    select_kept,
    validate_groups,
)
from mmrl.config import ConfigError, TrainConfig, dump_config, to_dict
from mmrl.plugin import Plugin, PromptBatch, Runtime, plugin_registry
from mmrl.reward import RewardInput, RewardScorer, ScoredBatch
from mmrl.rollout import Rollout, RolloutError
from mmrl.trainer import checkpoint as ckpt
from mmrl.trainer.credit import action_advantages, sample_advantages
from mmrl.trainer.ema import EMA
from mmrl.trainer.geometry import BatchGeometry, batch_geometry
from mmrl.trainer.metrics import MetricsWriter, WeightedMeans, read_metrics
from mmrl.trainer.sampler import PromptStream, derive_seed, plan_local_batch

logger = logging.getLogger("mmrl")

EVAL_SEED_TAG = 0xE7A1  # separates evaluation seeds from training seeds


@dataclass
class TrainResult:
    """What :meth:`Trainer.train` returns.

    Attributes:
        step: Steps completed.
        history: The per-step metrics written to metrics.jsonl (main process; empty elsewhere).
        evaluations: ``{step: eval metrics}`` for every evaluation run.
        stopped_early: True when a SIGTERM/SIGINT ended the run after a checkpoint.
    """

    step: int
    history: list[dict[str, Any]] = field(default_factory=list)
    evaluations: dict[int, dict[str, float]] = field(default_factory=dict)
    stopped_early: bool = False


@dataclass
class _TrainingBatch:
    """This process's samples for the update phase of one step."""

    rollout: Rollout
    advantages: torch.Tensor  # [n] or [n, A]
    metrics: dict[str, float]


class Trainer:
    """Group-relative RL trainer.

    Args:
        config: A validated :class:`~mmrl.config.TrainConfig`.
    """

    def __init__(self, config: TrainConfig):
        self.config = config
        self.run_dir = Path(config.run.output_dir)
        self.accelerator, self.geometry = self._build_accelerator()
        acc = self.accelerator
        set_seed(derive_seed(config.run.seed, acc.process_index, 0x5EED) % (2**32))
        self.runtime = Runtime(
            device=acc.device,
            process_index=acc.process_index,
            num_processes=acc.num_processes,
            mixed_precision=config.run.mixed_precision,
            unwrap=lambda module: acc.unwrap_model(module),
            full_state_dict=lambda module: acc.get_state_dict(module),
            autocast=acc.autocast,
            seed=config.run.seed,
            needs_reference=config.algorithm.kl_coef > 0,
        )
        algorithm = config.algorithm
        self.estimator = advantage_estimators.get(algorithm.advantage.name)
        self.policy_loss = policy_losses.get(algorithm.policy_loss.name)
        self.loss_accepts_chunks = "chunk_ids" in _parameters(self.policy_loss)
        self.kl_estimator = kl_estimators.get(algorithm.kl_estimator)

        self.plugin: Plugin = plugin_registry.get(config.plugin.name)(config.plugin.config, self.runtime)
        self._configure_action_chunks()
        self.scorer = RewardScorer.from_config(config.rewards)
        self.weights = self.scorer.weights
        if self.scorer.groupwise and config.rollout.layout == "spread" and acc.num_processes > 1:
            raise ConfigError("rollout.layout", "spread",
                              "'contiguous' when a group-wise reward is used on several processes")
        self.train_rows = list(self.plugin.dataset("train"))
        self.eval_rows = list(self.plugin.dataset("eval"))
        self.stream = PromptStream(len(self.train_rows), seed=config.run.seed)

        policy = self.plugin.policy()
        parameters = list(self.plugin.trainable_parameters(policy))
        if not parameters:
            raise RuntimeError(f"plugin {config.plugin.name!r} exposes no trainable parameters")
        optim = config.optim
        optimizer = torch.optim.AdamW(parameters, lr=optim.lr, betas=tuple(optim.betas),
                                      weight_decay=optim.weight_decay, eps=optim.eps)
        self.policy, self.optimizer = acc.prepare(policy, optimizer)
        self.parameters = [p for p in self.policy.parameters() if p.requires_grad]
        self.ema = EMA(self.parameters, config.ema.decay) if config.ema.enabled else None
        if self.ema is not None:
            acc.register_for_checkpointing(self.ema)
        acc.register_save_state_pre_hook(self._save_policy_hook)
        acc.register_load_state_pre_hook(self._load_policy_hook)

        self.step = 0
        self.optimizer_steps = 0
        self._stop_requested = False
        self.writer = MetricsWriter(self.run_dir / "metrics.jsonl", enabled=acc.is_main_process,
                                    accelerator=acc, use_trackers=bool(config.run.trackers))

    def _build_accelerator(self) -> tuple[Accelerator, BatchGeometry]:
        """The Accelerator, with gradient accumulation set from the batch geometry of this many processes."""
        run = self.config.run
        cpu = run.cpu or _launched_without_accelerators()
        state = PartialState(cpu=cpu)
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != state.num_processes:
            raise RuntimeError(
                f"launched as {launched} processes but Accelerate formed a group of {state.num_processes}; "
                "on CPU-only machines launch with `accelerate launch --multi_gpu --num_processes N` or torchrun"
            )
        geometry = batch_geometry(self.config, state.num_processes)
        accelerator = Accelerator(
            cpu=cpu,
            mixed_precision=run.mixed_precision,
            gradient_accumulation_steps=geometry.micro_steps,
            log_with=list(run.trackers) or None,
            project_dir=str(self.run_dir),
            step_scheduler_with_optimizer=False,
        )
        if accelerator.gradient_accumulation_steps != geometry.micro_steps:
            raise ConfigError("gradient_accumulation_steps (Accelerate/DeepSpeed config)",
                              accelerator.gradient_accumulation_steps,
                              "'auto': mmrl derives it from the batch geometry")
        return accelerator, geometry

    def _configure_action_chunks(self) -> None:
        """Check ``algorithm.action_chunk_size`` against the plugin and fold the chunks into the accumulation."""
        size = self.config.algorithm.action_chunk_size
        if size is None:
            return
        if not self.plugin.supports_action_chunks:
            raise ConfigError("algorithm.action_chunk_size", size,
                              f"null: plugin {self.config.plugin.name!r} recomputes all actions in one forward")
        level = self.config.algorithm.policy_loss.options.get("ratio_level", _default_ratio_level(self.policy_loss))
        if level != "token":
            raise ConfigError("algorithm.action_chunk_size", size,
                              f"null with ratio_level {level!r}: chunk and sequence ratios need every action at once")
        max_actions = self.plugin.max_actions()
        if max_actions is None:
            raise ConfigError("algorithm.action_chunk_size", size,
                              f"null: plugin {self.config.plugin.name!r} declares no action budget (max_actions)")
        self.geometry = batch_geometry(self.config, self.accelerator.num_processes, max_actions)
        self.accelerator.gradient_accumulation_steps = self.geometry.backward_passes

    # ================================================================== public
    def train(self) -> TrainResult:
        """Run (or resume) training to ``run.max_steps``; returns the history and the evaluations."""
        config, acc = self.config, self.accelerator
        self.restore_checkpoint()
        if acc.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(dump_config(config))
            logger.info(self.geometry.describe())
            print(self.geometry.describe(), flush=True)
        if config.run.trackers:
            acc.init_trackers(config.run.project_name, config=_flat_scalars(to_dict(config)))
        result = TrainResult(step=self.step)
        if config.eval.at_start and self.step == 0:
            result.evaluations[0] = self.evaluate()
        bar = tqdm(total=config.run.max_steps, initial=self.step, desc="mmrl", dynamic_ncols=True,
                   disable=not (acc.is_main_process and config.run.progress))
        with self._signals():
            while self.step < config.run.max_steps:
                metrics = self.training_step()
                self.step += 1
                bar.update(1)
                bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}")
                if self.step % config.run.log_every == 0 or self.step == config.run.max_steps:
                    self.writer.write(self.step, metrics)
                    result.history.append({"step": self.step, **metrics})
                eval_due = config.eval.every and self.step % config.eval.every == 0
                if eval_due and self.step < config.run.max_steps:
                    result.evaluations[self.step] = self.evaluate()
                if self._should_stop():
                    self.save_checkpoint()
                    result.stopped_early = True
                    break
                if config.run.save_every and self.step % config.run.save_every == 0:
                    self.save_checkpoint()
        bar.close()
        if not result.stopped_early:
            result.evaluations[self.step] = self.evaluate()
            if not (config.run.save_every and self.step % config.run.save_every == 0):
                self.save_checkpoint()
        result.step = self.step
        self.scorer.close()
        if config.run.trackers:
            acc.end_training()
        acc.wait_for_everyone()
        return result

    def training_step(self) -> dict[str, float]:
        """One full step: collect (with dynamic sampling), then update. Returns the step's metrics."""
        started = time.perf_counter()
        timings: dict[str, float] = {"rollout": 0.0, "reward": 0.0, "advantage": 0.0}  # seconds per phase
        batch = self._collect(timings)
        train_started = time.perf_counter()
        update_metrics = self._update(batch)
        timings["train"] = time.perf_counter() - train_started
        elapsed = time.perf_counter() - started
        metrics = {**batch.metrics, **update_metrics}
        metrics.update({f"time/{name}": seconds for name, seconds in timings.items()})
        metrics["time/step"] = elapsed
        metrics["throughput/samples_per_second"] = batch.metrics["samples/generated"] / max(elapsed, 1e-9)
        metrics["optim/lr"] = self._lr(self.optimizer_steps)
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Sample the held-out prompts (deterministic plugin sampling), score them, save the samples."""
        config, acc = self.config, self.accelerator
        started = time.perf_counter()
        rows = self.eval_rows[: config.eval.num_prompts] if config.eval.num_prompts else self.eval_rows
        per_prompt = config.eval.samples_per_prompt
        total = len(rows) * per_prompt
        mine = list(range(acc.process_index, total, acc.num_processes))
        rollout: Rollout | None = None
        scores, valid = torch.zeros(0, len(self.weights)), torch.zeros(0, dtype=torch.bool)
        context = self.ema.swapped_in() if self.ema is not None and config.ema.use_for_eval else nullcontext()
        with context:
            self.policy.eval()
            if mine:
                batch = PromptBatch(
                    rows=[rows[k // per_prompt] for k in mine],
                    group_ids=torch.tensor([k // per_prompt for k in mine], dtype=torch.long),
                    group_size=per_prompt,
                    seeds=torch.tensor([derive_seed(config.run.seed, EVAL_SEED_TAG, k) for k in mine]),
                    generator=self._generator(EVAL_SEED_TAG, 0),
                    training=False,
                    step=self.step,
                    max_steps=config.run.max_steps,
                )
                rollout, scored = self._sample_and_score(batch, {})
                scores, valid = scored.scores, scored.valid
            self.policy.train()
        combined = scores @ self.weights if scores.numel() else torch.zeros(0)
        gathered = gather_object([(scores.tolist(), valid.tolist())])
        all_scores = [row for part, _ in gathered for row in part]
        all_valid = [flag for _, part in gathered for flag in part]
        metrics: dict[str, float] = {}
        if all_scores:
            table = torch.tensor(all_scores, dtype=torch.float64)[torch.tensor(all_valid, dtype=torch.bool)]
            metrics["eval/reward_mean"] = float((table.float() @ self.weights).mean()) if len(table) else math.nan
            for k, name in enumerate(self.scorer.names):
                metrics[f"eval/{name}_mean"] = float(table[:, k].mean()) if len(table) else math.nan
        metrics["eval/samples"] = float(len(all_scores))
        metrics["time/eval"] = time.perf_counter() - started
        if config.eval.save_samples and rollout is not None:
            folder = self.run_dir / "samples" / f"step_{self.step:06d}"
            tag = "eval" if acc.num_processes == 1 else f"eval_rank{acc.process_index}"
            self.plugin.save_samples(rollout, combined, folder, tag=tag)
        self.writer.write(self.step, metrics)
        return metrics

    def save_checkpoint(self) -> Path:
        """Write a checkpoint of the current step atomically (see :mod:`mmrl.trainer.checkpoint`)."""
        acc = self.accelerator
        if acc.is_main_process:
            ckpt.begin(self.run_dir, self.step)
        acc.wait_for_everyone()
        tmp = ckpt.temporary_path(self.run_dir, self.step)
        acc.save_state(str(tmp / "accelerate"))
        acc.wait_for_everyone()
        final = self.run_dir / "checkpoints" / ckpt.checkpoint_name(self.step)
        if acc.is_main_process:
            state = {
                "step": self.step,
                "optimizer_steps": self.optimizer_steps,
                "stream": self.stream.state_dict(),
                "num_processes": acc.num_processes,
                "config": to_dict(self.config),
                "mmrl_version": __version__,
            }
            final = ckpt.commit(self.run_dir, self.step, state, self.config.run.keep_last)
        acc.wait_for_everyone()
        return final

    # ================================================================== collect (steps 1-4)
    def _collect(self, timings: dict[str, float]) -> _TrainingBatch:
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
                layout=config.rollout.layout, seed=config.run.seed, step=self.step, round_index=round_index,
            )
            batch = PromptBatch(
                rows=[self.train_rows[i] for i in plan.dataset_indices],
                group_ids=torch.tensor(plan.group_ids, dtype=torch.long),
                group_size=geometry.group_size,
                seeds=torch.tensor(plan.seeds, dtype=torch.long),
                generator=self._generator(self.step, round_index),
                training=True,
                step=self.step,
                max_steps=config.run.max_steps,
            )
            self.policy.eval()
            rollout, scored = self._sample_and_score(batch, timings)
            self.policy.train()

            tick = time.perf_counter()
            advantages, keep, round_metrics = self._credit(rollout, scored.scores, scored.valid)
            timings["advantage"] += time.perf_counter() - tick
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
        keep = torch.cat(pooled_keep)
        plan = select_kept(keep.cpu(), geometry.local_samples)
        rollout = rollout.select(plan.indices)
        advantages = advantages.index_select(0, plan.indices.to(advantages.device))
        rollout.mask = rollout.mask * (~plan.padded).to(rollout.mask.dtype).to(rollout.mask.device).unsqueeze(1)

        out = metrics.means()
        out.update({k: v for k, v in first_round.items() if k.startswith("groups/")})
        generated = float(used_rounds * geometry.samples)
        padded = acc.reduce(plan.padded.sum().to(acc.device).float(), "sum")
        out["samples/generated"] = generated
        out["samples/rounds"] = float(used_rounds)
        out["samples/padded"] = float(padded)
        rollout_means = WeightedMeans()
        rollout_means.add_all(rollout.metrics, prefix="rollout/")
        out.update(self._reduce_means(rollout_means))
        return _TrainingBatch(rollout=rollout, advantages=advantages, metrics=out)

    def _sample_and_score(self, batch: PromptBatch, timings: dict[str, float]) -> tuple[Rollout, ScoredBatch]:
        """Sample ``batch`` in plugin calls of ``rollout.batch_size`` and score it.

        With ``rewards.async_scoring`` each chunk is scored in the reward worker pool while the next chunk is
        sampled; the scores are the same as synchronous scoring. Group-wise rewards need whole groups, so a
        scorer with one is always called on the whole batch.
        """
        size = self.config.rollout.batch_size or len(batch) or 1
        overlap = self.config.rewards.async_scoring and not self.scorer.groupwise
        parts, futures = [], []
        tick = time.perf_counter()
        for chunk in _chunks(list(range(len(batch))), size):
            index = torch.tensor(chunk, dtype=torch.long)
            sub = PromptBatch(
                rows=[batch.rows[i] for i in chunk], group_ids=batch.group_ids[index],
                group_size=batch.group_size, seeds=batch.seeds[index], generator=batch.generator,
                training=batch.training, step=batch.step, max_steps=batch.max_steps,
            )
            part = self._checked_rollout(sub)
            parts.append(part)
            if overlap:
                futures.append(self.scorer.submit(RewardInput(part.rows, part.payload, part.group_ids)))
        timings["rollout"] = timings.get("rollout", 0.0) + time.perf_counter() - tick
        tick = time.perf_counter()
        if len(parts) == 1:
            rollout = parts[0]
        else:
            rollout = Rollout.concat(parts)
            means = WeightedMeans()
            for part in parts:
                means.add_all(part.metrics, weight=len(part))
            rollout.metrics = means.means()
        if overlap:
            scored = ScoredBatch.concat([future.result() for future in futures])
        else:
            scored = self.scorer.score(RewardInput(rollout.rows, rollout.payload, rollout.group_ids))
        timings["reward"] = timings.get("reward", 0.0) + time.perf_counter() - tick
        return rollout, scored

    def _checked_rollout(self, batch: PromptBatch) -> Rollout:
        rollout = self.plugin.rollout(self.policy, batch)
        if not isinstance(rollout, Rollout):
            raise RolloutError(f"plugin {self.config.plugin.name!r} returned {type(rollout).__name__}, not a Rollout")
        if len(rollout) != len(batch) or not torch.equal(rollout.group_ids.cpu(), batch.group_ids.cpu()):
            raise RolloutError(
                f"plugin {self.config.plugin.name!r} returned {len(rollout)} samples whose group_ids differ from "
                f"the {len(batch)} prompts it was given"
            )
        if not rollout.rows:
            rollout.rows = batch.rows
        return rollout.validate()

    def _credit(self, rollout: Rollout, scores: torch.Tensor, valid: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Gather, validate groups, compute advantages on the global batch, keep this process's slice."""
        config, acc = self.config, self.accelerator
        algorithm = config.algorithm
        n = len(rollout)
        device = acc.device
        g_scores = acc.gather(scores.to(device)).cpu()  # [B, K]
        g_valid = acc.gather(valid.to(device)).cpu()  # [B]
        g_groups = acc.gather(rollout.group_ids.to(device)).cpu()  # [B]
        validate_groups(g_groups, self.geometry.group_size, where="gathered rollout batch")
        credit = sample_advantages(
            g_scores, g_valid, g_groups, self.weights, self.estimator, algorithm.advantage.options,
            order=config.rewards.multi_reward, clip=algorithm.advantage_clip,
        )
        start = acc.process_index * n
        local = slice(start, start + n)
        advantages: torch.Tensor = credit.advantages[local]  # [n]
        spread = groups_with_spread(credit.combined, g_groups, tolerance=config.rollout.dynamic_sampling.tolerance)
        spread[~g_valid] = False
        keep = spread[local] & g_valid[local]

        local_combined = scores @ self.weights  # [n]
        per_action = self.plugin.action_rewards(rollout, local_combined)
        if per_action is not None:
            width = torch.tensor([per_action.shape[1]], device=device)
            max_width = int(acc.gather(width).max())
            padded_rewards = torch.nn.functional.pad(per_action.float(), (0, max_width - per_action.shape[1]))
            padded_mask = torch.nn.functional.pad(rollout.mask.float(), (0, max_width - rollout.mask.shape[1]))
            g_rewards = acc.gather(padded_rewards.to(device)).cpu()
            g_mask = acc.gather((padded_mask * valid.float().unsqueeze(1)).to(device)).cpu()
            per_action_adv = action_advantages(g_rewards, g_mask, g_groups, self.estimator,
                                               algorithm.advantage.options, clip=algorithm.advantage_clip)
            advantages = per_action_adv[local, : per_action.shape[1]]
            rollout.action_rewards = per_action
        if rollout.action_advantages is not None:
            advantages = rollout.action_advantages.float().cpu()

        metrics = _reward_metrics(self.scorer.names, g_scores, g_valid, credit.combined, credit.advantages, g_groups)
        return advantages.to(device), keep.to(device), metrics

    # ================================================================== update (steps 5-7)
    def _update(self, batch: _TrainingBatch) -> dict[str, float]:
        config, acc, geometry = self.config, self.accelerator, self.geometry
        algorithm = config.algorithm
        rollout, advantages = batch.rollout, batch.advantages
        device = acc.device
        rollout = rollout.to(device)
        need_reference = algorithm.kl_coef > 0 and rollout.ref_logp is None
        if algorithm.recompute_old_logp:
            rollout.old_logp = self._recompute_old_logp(rollout)
        column_chunks: list[torch.Tensor | None] = [None]
        if algorithm.action_chunk_size is not None:
            budget = self.plugin.max_actions()
            rollout = rollout.pad_actions(budget)
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
        loss_total = 0.0
        for epoch in range(geometry.inner_epochs):
            order = torch.randperm(
                len(rollout), generator=torch.Generator().manual_seed(derive_seed(config.run.seed, self.step, epoch))
            )
            for mb in range(geometry.minibatches):
                indices = order[mb * geometry.minibatch_size:(mb + 1) * geometry.minibatch_size]
                minibatch = rollout.select(indices)
                mb_adv = advantages.index_select(0, indices.to(advantages.device))
                counts = torch.tensor(aggregation_counts(minibatch.mask), dtype=torch.float64, device=device)
                num_actions, num_sequences = acc.reduce(counts, "sum").tolist()
                step_loss = torch.zeros((), dtype=torch.float64, device=device)
                for micro in _chunks(list(range(len(minibatch))), geometry.micro_batch_size):
                    index = torch.tensor(micro, dtype=torch.long)
                    part = minibatch.select(index)
                    part_adv = mb_adv.index_select(0, index.to(mb_adv.device))
                    lengths = part.mask.to(torch.float64).sum(dim=1)  # [n] active actions of whole rows
                    for columns in column_chunks:
                        with acc.accumulate(self.policy):
                            loss, part_metrics, deviation, weight = self._micro_loss(
                                part, part_adv, need_reference, num_actions, num_sequences, max_actions, columns,
                                lengths,
                            )
                            acc.backward(loss * scale)
                            means.add_all(part_metrics, weight)
                            step_loss += loss.detach().to(torch.float64)
                            if self.optimizer_steps == steps_before:  # the first mini-batch: no update yet
                                deviations.append(deviation)
                            if acc.sync_gradients:
                                self._optimizer_step(means)
                if not acc.sync_gradients:
                    raise RuntimeError("gradient accumulation fell out of step with the micro-batches")
                loss_total += float(acc.reduce(step_loss, "sum"))
        out = self._reduce_means(means)
        out["loss/total"] = loss_total / geometry.optimizer_steps_per_step
        out["loss/first_step_ratio_deviation"] = float(acc.reduce(torch.tensor(max(deviations), device=device), "max"))
        return out

    def _optimizer_step(self, means: WeightedMeans) -> None:
        """Clip, set the scheduled learning rate, step, zero the gradients, update the EMA."""
        config = self.config
        if config.optim.max_grad_norm is not None:
            norm = self.accelerator.clip_grad_norm_(self.parameters, config.optim.max_grad_norm)
            if norm is not None:  # DeepSpeed clips inside its engine (gradient_clipping) and reports no norm
                means.add("optim/grad_norm", float(norm))
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr(self.optimizer_steps)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        if self.ema is not None and self.optimizer_steps % config.ema.update_every == 0:
            self.ema.update()

    def _micro_loss(self, part: Rollout, advantages: torch.Tensor, need_reference: bool, num_actions: float,
                    num_sequences: float, max_actions: int, columns: torch.Tensor | None, lengths: torch.Tensor
                    ) -> tuple[torch.Tensor, dict[str, Any], float, float]:
        """Loss of one micro-batch (or one action chunk of it) → (loss, metrics, |ratio − 1| max, metric weight)."""
        algorithm = self.config.algorithm
        if columns is None:
            output = self.plugin.forward(self.policy, part, need_reference=need_reference)
        else:
            part = part.select_actions(columns)
            if advantages.dim() == 2:
                advantages = advantages.index_select(1, columns.to(advantages.device))
            output = self.plugin.forward(self.policy, part, need_reference=need_reference, actions=columns)
        logp = output.logp.float()  # [n, A]
        if logp.shape != part.old_logp.shape:
            raise RolloutError(
                f"plugin forward returned logp {tuple(logp.shape)} for a rollout with old_logp "
                f"{tuple(part.old_logp.shape)}"
            )
        options = dict(algorithm.policy_loss.options)
        if self.loss_accepts_chunks:
            options["chunk_ids"] = part.chunk_ids
        per_action, metrics = self.policy_loss(logp, part.old_logp, advantages, part.mask, **options)
        metrics = {f"policy/{k}": v for k, v in metrics.items()}
        active = part.mask > 0
        deviation = float((logp.detach() - part.old_logp).exp().sub(1).abs()[active].max()) if active.any() else 0.0
        total = per_action
        if algorithm.kl_coef > 0:
            kl = output.kl
            if kl is None:
                ref = output.ref_logp if output.ref_logp is not None else part.ref_logp
                if ref is None:
                    raise RolloutError("kl_coef > 0 but the plugin returned neither kl nor ref_logp")
                kl = self.kl_estimator(logp, ref.float())
            total = total + algorithm.kl_coef * kl
            metrics["policy/kl"] = _masked_mean(kl, part.mask)
        if output.entropy is not None:
            metrics["policy/entropy"] = _masked_mean(output.entropy, part.mask)
            if algorithm.entropy_coef > 0:
                total = total - algorithm.entropy_coef * output.entropy
        if part.action_weights is not None:
            total = total * part.action_weights
        metrics["policy/advantage"] = _masked_mean(broadcast_advantages(advantages, logp), part.mask)
        loss = aggregate(total, part.mask, algorithm.aggregation, num_actions=num_actions,
                         num_sequences=num_sequences, max_actions=max_actions, sequence_lengths=lengths)
        return loss, metrics, deviation, float(part.mask.sum())

    @torch.no_grad()
    def _recompute_old_logp(self, rollout: Rollout) -> torch.Tensor:
        parts = []
        for chunk in _chunks(list(range(len(rollout))), self.geometry.micro_batch_size):
            part = rollout.select(torch.tensor(chunk, dtype=torch.long))
            parts.append(self.plugin.forward(self.policy, part, need_reference=False).logp.float())
        return torch.cat(parts)

    def _reduce_means(self, means: WeightedMeans) -> dict[str, float]:
        """Weighted means over all processes. Metric names may differ between processes (a process whose samples
        were all padding records none), so the partial sums travel as objects rather than as aligned tensors."""
        if self.accelerator.num_processes == 1:
            return means.means()
        merged = WeightedMeans()
        for totals, weights in gather_object([(dict(means.totals), dict(means.weights))]):
            for name, total in totals.items():
                merged.totals[name] += total
                merged.weights[name] += weights[name]
        return merged.means()

    def _lr(self, optimizer_step: int) -> float:
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

    def _generator(self, step: int, round_index: int) -> torch.Generator:
        device = self.accelerator.device
        generator = torch.Generator(device=device)
        seed = derive_seed(self.config.run.seed, step, round_index, self.accelerator.process_index)
        return generator.manual_seed(seed)

    # ================================================================== checkpoints and signals (step 9)
    def _save_policy_hook(self, models: list[Any], weights: list[Any], output_dir: str) -> None:
        # Every process: gathering the full weights is a collective under FSDP/ZeRO-3; the main process writes.
        self.plugin.save_trainable(self.policy, Path(output_dir).parent / "policy")
        weights.clear()  # the plugin saved what is trainable; frozen weights are rebuilt from the config

    def _load_policy_hook(self, models: list[Any], input_dir: str) -> None:
        self.plugin.load_trainable(self.policy, Path(input_dir).parent / "policy")
        models.clear()

    def restore_checkpoint(self) -> Path | None:
        """Load the checkpoint ``run.resume`` names (``latest`` or a path) into this trainer; returns its folder, or
        None when there is nothing to resume from."""
        resume = self.config.run.resume
        if not resume:
            return None
        found = ckpt.resolve(resume, self.run_dir)
        if found is None:
            if self.accelerator.is_main_process:
                print(f"run.resume=latest: no checkpoint in {self.run_dir / 'checkpoints'} yet; starting at step 0",
                      flush=True)
            return None
        state = ckpt.read_state(found)
        ckpt.check_compatible(state["config"], to_dict(self.config), found)
        if state.get("num_processes", 1) != self.accelerator.num_processes and self.accelerator.is_main_process:
            print(f"resuming a run of {state['num_processes']} process(es) on {self.accelerator.num_processes}",
                  flush=True)
        self.accelerator.load_state(str(found / "accelerate"))
        self.step = int(state["step"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self.stream.load_state_dict(state["stream"])
        if self.accelerator.is_main_process:
            _truncate_metrics(self.run_dir / "metrics.jsonl", self.step)
            print(f"resumed from {found} at step {self.step}", flush=True)
        return found

    def _should_stop(self) -> bool:
        flag = torch.tensor([1.0 if self._stop_requested else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, "max").item() > 0)

    @contextmanager
    def _signals(self) -> Iterator[None]:
        """SIGTERM/SIGINT: finish the current step, checkpoint, exit cleanly (pre-emptible clusters rely on it)."""

        def request_stop(signum: int, frame: Any) -> None:
            self._stop_requested = True

        previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                previous[sig] = signal.signal(sig, request_stop)
            except ValueError:  # not the main thread (e.g. inside some test runners): leave the default
                pass
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


# ====================================================================== helpers
def _launched_without_accelerators() -> bool:
    """True for a multi-process launch on a machine with no GPU: Accelerate then needs ``cpu=True`` to form a gloo
    group, otherwise every process silently runs alone and they all write the same run folder."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    from accelerate.utils import is_cuda_available, is_mps_available, is_xpu_available

    return not (is_cuda_available() or is_xpu_available() or is_mps_available())


def _chunks(items: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(items), max(size, 1)):
        yield items[start:start + size]


def _parameters(fn: Any) -> set[str]:
    return set(inspect.signature(fn).parameters)


def _default_ratio_level(fn: Any) -> str:
    parameter = inspect.signature(fn).parameters.get("ratio_level")
    return "token" if parameter is None else parameter.default


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    weights = mask.float()
    return float((values.detach().float() * weights).sum() / weights.sum().clamp(min=1.0))


def _concat_advantages(parts: list[torch.Tensor]) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    if all(p.dim() == 1 for p in parts):
        return torch.cat(parts)
    width = max(p.shape[1] for p in parts if p.dim() == 2)
    expanded = [p.unsqueeze(1).expand(-1, width) if p.dim() == 1 else
                torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]
    return torch.cat(expanded)


def _reward_metrics(names: list[str], scores: torch.Tensor, valid: torch.Tensor, combined: torch.Tensor,
                    advantages: torch.Tensor, group_ids: torch.Tensor) -> dict[str, float]:
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
        spread = groups_with_spread(combined[good], group_ids[good])
        unique_groups, first = _first_of_groups(group_ids[good])
        metrics["groups/no_spread_fraction"] = float((~spread[first]).float().mean()) if unique_groups else 0.0
    metrics["samples/invalid"] = float((~valid).sum())
    return metrics


def _first_of_groups(group_ids: torch.Tensor) -> tuple[int, torch.Tensor]:
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    first = torch.full((unique.numel(),), group_ids.numel(), dtype=torch.long)
    first = first.scatter_reduce(0, inverse, torch.arange(group_ids.numel()), reduce="amin")
    return unique.numel(), first


def _flat_scalars(data: Any, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    if isinstance(data, dict):
        for key, value in data.items():
            flat.update(_flat_scalars(value, f"{prefix}{key}."))
    elif isinstance(data, (int, float, str, bool)):
        flat[prefix[:-1]] = data
    return flat


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metrics lines written after ``step`` (a killed run logged steps that the resume will redo)."""
    if not path.is_file():
        return
    kept = [record for record in read_metrics(path) if record.get("step", 0) <= step]
    ckpt.write_text_atomic(path, "".join(json.dumps(record) + "\n" for record in kept))
