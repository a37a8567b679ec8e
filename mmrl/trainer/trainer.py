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

import importlib
import json
import logging
import math
import os
import time
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import gather_object, set_seed
from tqdm.auto import tqdm

from mmrl import __version__
from mmrl.config import ConfigError, TrainConfig, dump_config, eval_only_keys, to_dict
from mmrl.plugin import Plugin, PromptBatch, Runtime, plugin_registry
from mmrl.reward import RewardScorer
from mmrl.rollout import Rollout, RolloutError
from mmrl.seeding import derive_seed
from mmrl.trainer import checkpoint as ckpt
from mmrl.trainer.collect import Collector
from mmrl.trainer.ema import EMA
from mmrl.trainer.entropy_control import AdaptiveEntropyCoef
from mmrl.trainer.geometry import BatchGeometry, batch_geometry
from mmrl.trainer.learn import Learner, chunked_geometry, needs_reference, ratio_level
from mmrl.trainer.metrics import MetricsWriter, read_metrics
from mmrl.trainer.reference import ReferenceSync
from mmrl.trainer.sampler import PromptStream
from mmrl.trainer.signals import stop_requested, stop_signals
from mmrl.trainer.updates import UpdateMonitor

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


class CachedUnwrap:
    """``Runtime.unwrap``: Accelerate's ``unwrap_model``, remembered per wrapper object.

    ``unwrap_model`` costs about a millisecond on a small VLM (it walks the module tree for compiled regions and looks
    up the DeepSpeed package each call) and plugins call it several times a step; what it returns for a given
    wrapper (DDP's ``.module``, a compiled module's original) never changes, so it runs once per object. Entries are
    weak: a module that is dropped is forgotten.
    """

    _SELF = object()  # the module is its own bare module (no wrapper): stored without a reference to itself

    def __init__(self, unwrap: Callable[[torch.nn.Module], torch.nn.Module]):
        self._unwrap = unwrap
        self._known: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()

    def __call__(self, module: torch.nn.Module) -> torch.nn.Module:
        found = self._known.get(module)
        if found is None:
            bare = self._unwrap(module)
            found = self._SELF if bare is module else bare
            self._known[module] = found
        return module if found is self._SELF else found


class Trainer:
    """Group-relative RL trainer.

    Args:
        config: A validated :class:`~mmrl.config.TrainConfig`.
    """

    def __init__(self, config: TrainConfig):
        self.config = config
        self.run_dir = Path(config.run.output_dir)
        ckpt.check_run_folder(self.run_dir)  # in one line, before minutes of model loading
        self.accelerator, self.geometry = self._build_accelerator()
        acc = self.accelerator
        set_seed(derive_seed(config.run.seed, acc.process_index, 0x5EED) % (2**32))
        self.runtime = Runtime(
            device=acc.device,
            process_index=acc.process_index,
            num_processes=acc.num_processes,
            mixed_precision=config.run.mixed_precision,
            unwrap=CachedUnwrap(acc.unwrap_model),
            full_state_dict=lambda module: acc.get_state_dict(module),
            autocast=acc.autocast,
            seed=config.run.seed,
            needs_reference=needs_reference(config),
            ratio_level=ratio_level(config),
            inner_epochs=config.algorithm.inner_epochs,
        )
        self.plugin: Plugin = plugin_registry.get(config.plugin.name)(config.plugin.config, self.runtime)
        chunked = chunked_geometry(config, self.plugin, acc.num_processes)
        if chunked is not None:  # back-propagating action chunks multiplies the backward passes per step
            self.geometry = chunked
            acc.gradient_accumulation_steps = chunked.backward_passes
        # The plugin's facts for rewards (e.g. the VLM family's box convention): rewards that read them take their
        # defaults from them and refuse contradicting options here, at start-up; the trainer never looks inside.
        reward_context = self.plugin.reward_context()
        self.scorer = RewardScorer.from_config(config.rewards, context=reward_context)
        self.weights = self.scorer.weights
        # The held-out evaluation may be judged by other rewards than the ones trained on (eval.rewards).
        # eval.rewards naming the training rewards again reuses their scorer (a reward model is loaded once).
        same = config.eval.rewards is None or config.eval.rewards == config.rewards.functions
        self.eval_scorer = (self.scorer if same
                            else RewardScorer.from_config(replace(config.rewards, functions=config.eval.rewards),
                                                          context=reward_context))
        if self.scorer.groupwise and config.rollout.layout == "spread" and acc.num_processes > 1:
            raise ConfigError("rollout.layout", "spread",
                              "'contiguous' when a group-wise reward is used on several processes")
        self.train_rows = list(self.plugin.dataset("train"))
        self.eval_rows = list(self.plugin.dataset("eval"))
        if not self.eval_rows:  # the run evaluates at its end at least: an empty split would report nothing
            raise ConfigError("plugin", f"{config.plugin.name} with an empty 'eval' split",
                              "held-out prompts (every run is evaluated at its end): set the plugin's evaluation "
                              "prompts, see `mmrl explain`")
        # Rows that cannot share a batch (opaque bucket keys): each step then draws one bucket's chunk of prompts.
        train_buckets = self._row_buckets("train", len(self.train_rows))
        self._refuse_dynamic_sampling_over_buckets(train_buckets)
        self.stream = PromptStream(len(self.train_rows), seed=config.run.seed, buckets=train_buckets,
                                   batch_prompts=self.geometry.prompts)
        eval_buckets = self._row_buckets("eval", len(self.eval_rows))
        # The evaluated prompts' buckets (None: any of them can share a batch); evaluate() samples each apart.
        # One key is no bucketing; several make every process sample (and name its files) per bucket, even one whose
        # own samples all share a bucket, so the file names do not depend on how prompts were dealt out.
        evaluated = None if eval_buckets is None else eval_buckets[: len(self._evaluated_rows())]
        self.eval_buckets = evaluated if evaluated is not None and len(set(evaluated)) > 1 else None

        policy = self.plugin.policy()
        parameters = list(self.plugin.trainable_parameters(policy))
        if not parameters:
            raise RuntimeError(f"plugin {config.plugin.name!r} exposes no trainable parameters")
        optim = config.optim
        optimizer = torch.optim.AdamW(parameters, lr=optim.lr, betas=tuple(optim.betas),
                                      weight_decay=optim.weight_decay, eps=optim.eps)
        self.policy, self.optimizer = acc.prepare(policy, optimizer)
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        self.ema = EMA(trainable, config.ema.decay) if config.ema.enabled else None
        if self.ema is not None:
            acc.register_for_checkpointing(self.ema)
        self.reference_sync = None  # TR-DPO's soft reference update (algorithm.ref_sync_every)
        if config.algorithm.ref_sync_every:
            self.reference_sync = ReferenceSync.build(self.plugin, self.policy, config.algorithm.ref_sync_every,
                                                      config.algorithm.ref_sync_mix)
            acc.register_for_checkpointing(self.reference_sync)
        self.entropy_control = None  # Skywork-OR1's adaptive entropy coefficient (algorithm.entropy_target)
        if config.algorithm.entropy_target is not None:
            self.entropy_control = AdaptiveEntropyCoef.from_config(config.algorithm)
            acc.register_for_checkpointing(self.entropy_control)  # resumes with the coefficient and the gate it had
        acc.register_save_state_pre_hook(self._save_policy_hook)
        acc.register_load_state_pre_hook(self._load_policy_hook)

        self.collector = Collector(config, acc, self.geometry, self.plugin, self.scorer, self.stream, self.train_rows)
        self.learner = Learner(config, acc, self.geometry, self.plugin, self.policy, self.optimizer, self.ema,
                               reference_sync=self.reference_sync, entropy_control=self.entropy_control)
        self.updates = UpdateMonitor(config, self.geometry, self.scorer, acc.is_main_process)
        self.step = 0
        self.saved_step: int | None = None  # the step of the checkpoint this run last wrote or resumed from
        self.writer = MetricsWriter(self.run_dir / "metrics.jsonl", enabled=acc.is_main_process,
                                    accelerator=acc, use_trackers=bool(config.run.trackers))

    def _row_buckets(self, split: str, size: int) -> list[str] | None:
        """The plugin's :meth:`~mmrl.plugin.Plugin.row_buckets` of ``split`` (``size`` rows), checked against the
        contract."""
        buckets = self.plugin.row_buckets(split)
        if buckets is None:
            return None
        if not isinstance(buckets, list):
            found = f"a {type(buckets).__name__}"
        elif len(buckets) != size:
            found = f"{len(buckets)} keys"
        elif not all(isinstance(key, str) for key in buckets):
            row = next(row for row, key in enumerate(buckets) if not isinstance(key, str))
            found = f"a key that is not a string (row {row}: {buckets[row]!r})"
        else:
            return buckets
        raise RolloutError(f"plugin {self.config.plugin.name!r}'s row_buckets({split!r}) returned {found}; allowed: "
                           f"None or a list of {size} strings, one per row of dataset({split!r})")

    def _refuse_dynamic_sampling_over_buckets(self, buckets: list[str] | None) -> None:
        """Dynamic sampling pools a step's rounds into one batch, and each round takes the stream's next chunk, which
        may be another bucket's."""
        keys = list(dict.fromkeys(buckets or []))
        if len(keys) > 1 and self.config.rollout.dynamic_sampling.enabled:
            shown = ", ".join(keys[:3]) + (f", ... ({len(keys)} in all)" if len(keys) > 3 else "")
            raise ConfigError("rollout.dynamic_sampling.enabled", True,
                              f"false when plugin {self.config.plugin.name}'s training rows fall in several buckets "
                              f"({shown}): a step's sampling rounds would draw different buckets, which cannot "
                              "share a batch")

    def _evaluated_rows(self) -> list[dict[str, Any]]:
        """The held-out rows the evaluation samples: the first ``eval.num_prompts`` (all without it)."""
        num_prompts = self.config.eval.num_prompts
        return self.eval_rows[:num_prompts] if num_prompts else self.eval_rows

    def _build_accelerator(self) -> tuple[Accelerator, BatchGeometry]:
        """The Accelerator, with gradient accumulation set from the batch geometry of this many processes."""
        run = self.config.run
        cpu = run.cpu or _launched_without_accelerators()
        _import_group_default_modules()
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

    # ================================================================== public
    def train(self) -> TrainResult:
        """Run (or resume) training to ``run.max_steps``; returns the history and the evaluations.

        SIGTERM/SIGINT are honoured wherever they arrive (the evaluation before the first step, a training step, the
        final evaluation): the current piece of work finishes, a checkpoint is written and the run returns with
        ``stopped_early``. The final checkpoint is written before the final evaluation, so a run killed during that
        evaluation loses no training; relaunched with ``run.resume=latest`` it only evaluates.
        """
        config, acc = self.config, self.accelerator
        result = TrainResult(step=self.step)
        with stop_signals():
            if config.run.resume is None:
                ckpt.refuse_existing_run(self.run_dir)
            restored = self.restore_checkpoint()
            self.saved_step = self.step if restored is not None else None
            self._start_log(restored is not None)
            if config.run.trackers:
                acc.init_trackers(config.run.project_name, config=_flat_scalars(to_dict(config)))
            try:
                self._train_loop(result, evaluate_first=config.eval.at_start and restored is None)
            finally:  # reward worker pools stop however training ends (an error, an interrupt, a normal end)
                self.scorer.close(wait=False)
                self.eval_scorer.close(wait=False)
            result.step = self.step
        if config.run.trackers:
            acc.end_training()
        acc.wait_for_everyone()
        if not result.stopped_early:
            self.updates.check()  # NoUpdateError when no step of the run trained on any sample
        return result

    def _train_loop(self, result: TrainResult, evaluate_first: bool) -> None:
        config, acc = self.config, self.accelerator
        if evaluate_first and not self._should_stop():
            result.evaluations[0] = self.evaluate()
        bar = tqdm(total=config.run.max_steps, initial=self.step, desc="mmrl", dynamic_ncols=True,
                   disable=not (acc.is_main_process and config.run.progress))
        with bar:  # the bar is closed however the loop ends (a step that raises too)
            while self.step < config.run.max_steps:
                if self._should_stop():  # a signal during the evaluation before the first step, or at a resume
                    break
                metrics = self.training_step()
                self.step += 1
                self.updates.observe(self.step, metrics)  # warns when no sample entered the step's loss
                bar.update(1)
                bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}")
                if self.step % config.run.log_every == 0 or self.step == config.run.max_steps:
                    self.writer.write(self.step, metrics)
                    result.history.append({"step": self.step, **metrics})
                eval_due = config.eval.every and self.step % config.eval.every == 0
                if eval_due and self.step < config.run.max_steps:
                    result.evaluations[self.step] = self.evaluate()
                if config.run.save_every and self.step % config.run.save_every == 0:
                    self.save_checkpoint()
        # The final (or the interrupted run's) checkpoint, before the final evaluation. A run stopped before it did
        # anything (no step, no first evaluation) has nothing to keep.
        if self.saved_step != self.step and (self.step > 0 or result.evaluations):
            self.save_checkpoint()
        if self._should_stop():
            result.stopped_early = True
            return
        if not self._evaluated_at(self.step):  # a relaunched finished run was evaluated already
            result.evaluations[self.step] = self.evaluate()

    def close(self) -> None:
        """Release what the trainer holds across processes: the reward worker pools and the process group. Call it
        when the trainer is done (``mmrl train`` and ``mmrl eval`` do): a gloo or NCCL group left to the interpreter's
        exit can abort a process in its destructor ("terminate called without an active exception"). No collective
        works afterwards. Not a collective itself: after an error on one process it does not wait for the others.

        Destroying the group is not enough: a gloo group lives on while anything references it, and its worker threads
        with it. A worker that lets go of a finished collective's tensors after the interpreter has begun to shut
        down needs the GIL it can no longer take, and the process aborts ("terminate called without an active
        exception", seen in the two-process tests under load). So close() also drops the references the trainer and
        Accelerate hold to the DDP wrapper (its reducer holds the group): the group is freed here, its threads joined
        while the interpreter is alive, and ``policy`` is the bare module afterwards. The group defaults captured at
        import time are avoided at start-up (:func:`_import_group_default_modules`)."""
        self.scorer.close(wait=False)
        self.eval_scorer.close(wait=False)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.accelerator.state.destroy_process_group()
        if distributed:
            self.policy = self.learner.policy = self.runtime.unwrap(self.policy)
            self.accelerator.free_memory()  # Accelerate's references to the wrapped model (and a garbage collection)

    def training_step(self) -> dict[str, float]:
        """One full step: collect (with dynamic sampling), then update. Returns the step's metrics."""
        started = time.perf_counter()
        timings: dict[str, float] = {"rollout": 0.0, "reward": 0.0, "advantage": 0.0}  # seconds per phase
        batch = self.collector.collect(self.policy, self.step, timings)
        train_started = time.perf_counter()
        update_metrics = self.learner.update(batch, self.step)
        timings["train"] = time.perf_counter() - train_started
        elapsed = time.perf_counter() - started
        metrics = {**batch.metrics, **update_metrics}
        metrics.update({f"time/{name}": seconds for name, seconds in timings.items()})
        metrics["time/step"] = elapsed
        metrics["throughput/samples_per_second"] = batch.metrics["samples/generated"] / max(elapsed, 1e-9)
        return metrics

    @torch.no_grad()
    def evaluate(self, *, writer: MetricsWriter | None = None, samples_dir: Path | None = None) -> dict[str, float]:
        """Sample the held-out prompts (deterministic plugin sampling), score them, save the samples.

        Args:
            writer: Where the metrics line goes (default: the run's metrics.jsonl).
            samples_dir: Folder of the per-step sample folders (default: the run's ``samples/``).
        """
        config, acc = self.config, self.accelerator
        started = time.perf_counter()
        rows = self._evaluated_rows()
        mine = evaluation_share(len(rows), config.eval.samples_per_prompt, acc.process_index, acc.num_processes)
        scorer = self.eval_scorer
        # (bucket key or None, rollout, scores [n, K], valid [n]) per plugin call of this process, buckets in order
        # of first appearance among its samples; the scores below are concatenated in that order.
        parts: list[tuple[str | None, Rollout, torch.Tensor, torch.Tensor]] = []
        context = self.ema.swapped_in() if self.ema is not None and config.ema.use_for_eval else nullcontext()
        with context:
            self.policy.eval()
            for key, samples in self._evaluation_pieces(mine):
                rollout, scored = self.collector.sample_and_score(self.policy, self._evaluation_batch(rows, samples),
                                                                  {}, scorer)
                parts.append((key, rollout, scored.scores, scored.valid))
            self.policy.train()
        scores = torch.cat([part[2] for part in parts]) if parts else torch.zeros(0, len(scorer.weights))  # [n, K]
        valid = torch.cat([part[3] for part in parts]) if parts else torch.zeros(0, dtype=torch.bool)  # [n]
        gathered = gather_object([(scores.tolist(), valid.tolist())])
        all_scores = [row for part, _ in gathered for row in part]
        all_valid = [flag for _, part in gathered for flag in part]
        metrics: dict[str, float] = {}
        if all_scores:
            table = torch.tensor(all_scores, dtype=torch.float64)[torch.tensor(all_valid, dtype=torch.bool)]
            metrics["eval/reward_mean"] = float((table.float() @ scorer.weights).mean()) if len(table) else math.nan
            for k, name in enumerate(scorer.names):
                metrics[f"eval/{name}_mean"] = float(table[:, k].mean()) if len(table) else math.nan
        metrics["eval/samples"] = float(len(all_scores))
        metrics["time/eval"] = time.perf_counter() - started
        if config.eval.save_samples and parts:
            folder = (samples_dir or self.run_dir / "samples") / f"step_{self.step:06d}"
            tag = "eval" if acc.num_processes == 1 else f"eval_rank{acc.process_index}"
            for key, rollout, part_scores, _ in parts:
                combined = part_scores @ scorer.weights if part_scores.numel() else torch.zeros(0)  # [n_part]
                self.plugin.save_samples(rollout, combined, folder, tag=tag if key is None else f"{tag}_{key}")
        (writer or self.writer).write(self.step, metrics)
        return metrics

    def _evaluation_pieces(self, mine: list[int]) -> list[tuple[str | None, list[int]]]:
        """This process's evaluation samples in pieces that may share a batch: ``(bucket key, samples)`` per bucket
        of :attr:`eval_buckets`, in order of first appearance among ``mine``, when the evaluated prompts span several
        buckets; else one piece ``(None, mine)`` (none when ``mine`` is empty)."""
        if not mine:
            return []
        if self.eval_buckets is None:
            return [(None, mine)]
        per_prompt = self.config.eval.samples_per_prompt
        pieces: dict[str, list[int]] = {}
        for k in mine:
            pieces.setdefault(self.eval_buckets[k // per_prompt], []).append(k)
        return list(pieces.items())

    def _evaluation_batch(self, rows: list[dict[str, Any]], samples: list[int]) -> PromptBatch:
        """The evaluation samples ``samples`` (indices ``prompt * samples_per_prompt + j``) as one plugin batch; each
        sample's seed depends on its index only, so not on the piece it is sampled in."""
        config = self.config
        per_prompt = config.eval.samples_per_prompt
        return PromptBatch(
            rows=[rows[k // per_prompt] for k in samples],
            group_ids=torch.tensor([k // per_prompt for k in samples], dtype=torch.long),
            group_size=per_prompt,
            seeds=torch.tensor([derive_seed(config.run.seed, EVAL_SEED_TAG, k) for k in samples]),
            generator=self.collector.generator(EVAL_SEED_TAG, 0),
            training=False,
            step=self.step,
            max_steps=config.run.max_steps,
        )

    def evaluate_checkpoint(self) -> dict[str, float]:
        """``mmrl eval``: evaluate the checkpoint ``run.resume`` names (or the initial policy without it).

        The record goes to ``evaluations.jsonl`` (with the checkpoint evaluated) and the samples to
        ``evaluations/step_N``, with the config of the evaluation (``config.yaml``: which model, data and settings
        made those samples, read by reports of the samples): the training history in metrics.jsonl, the run's
        config.yaml and the training evaluations' samples are never touched by a later evaluation.
        """
        found = self.restore_checkpoint()
        writer = MetricsWriter(self.run_dir / "evaluations.jsonl", enabled=self.accelerator.is_main_process,
                               fields={"checkpoint": str(found) if found else "initial policy"})
        folder = self.run_dir / "evaluations"
        metrics = self.evaluate(writer=writer, samples_dir=folder)
        if self.accelerator.is_main_process:
            step_folder = folder / f"step_{self.step:06d}"
            step_folder.mkdir(parents=True, exist_ok=True)
            ckpt.write_text_atomic(step_folder / "config.yaml", dump_config(self.config))
        return metrics

    def save_checkpoint(self) -> Path:
        """Write a checkpoint of the current step atomically (see :mod:`mmrl.trainer.checkpoint`).

        A write that fails on any process (a full disk, say) fails on every process together, after the partial
        folder is removed: the previous checkpoint stays the newest, and the error says what happened in one line.
        """
        acc = self.accelerator
        tmp = ckpt.temporary_path(self.run_dir, self.step)
        final = self.run_dir / "checkpoints" / ckpt.checkpoint_name(self.step)
        failure: BaseException | None = None
        try:
            if acc.is_main_process:
                ckpt.begin(self.run_dir, self.step)
            acc.wait_for_everyone()
            acc.save_state(str(tmp / "accelerate"))
        except Exception as error:  # noqa: BLE001 - any failed write (torch: RuntimeError, safetensors: its own)
            failure = error  # raised below on every process together, so that none waits at a barrier forever
        failed = torch.tensor([0.0 if failure is None else 1.0], device=acc.device)
        if float(acc.reduce(failed, "max").item()) > 0:
            raise ckpt.save_failed(self.run_dir, self.step, failure, clean_up=acc.is_main_process) from failure
        if acc.is_main_process:
            state = {
                "step": self.step,
                "optimizer_steps": self.learner.optimizer_steps,
                "stream": self.stream.state_dict(),
                "num_processes": acc.num_processes,
                "config": to_dict(self.config),
                "mmrl_version": __version__,
            }
            try:
                final = ckpt.commit(self.run_dir, self.step, state, self.config.run.keep_last)
            except OSError as error:  # the state file or a rename: the previous checkpoint is still in place
                failure = error
        failed = torch.tensor([0.0 if failure is None else 1.0], device=acc.device)
        if float(acc.reduce(failed, "max").item()) > 0:
            raise ckpt.save_failed(self.run_dir, self.step, failure, clean_up=acc.is_main_process) from failure
        self.saved_step = self.step
        return final

    # ================================================================== checkpoints and signals (step 9)
    def _save_policy_hook(self, models: list[Any], weights: list[Any], output_dir: str) -> None:
        # Every process: gathering the full weights is a collective under FSDP/ZeRO-3; the main process writes.
        self.plugin.save_trainable(self.policy, Path(output_dir).parent / "policy")
        if self.ema is not None:  # the averaged weights too, in the plugin's format, for `mmrl export`
            with self.ema.swapped_in():
                self.plugin.save_trainable(self.policy, Path(output_dir).parent / ckpt.EMA_POLICY_FOLDER)
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
        if self.accelerator.is_main_process:  # finish or undo a save that a kill interrupted
            ckpt.recover(self.run_dir)
        self.accelerator.wait_for_everyone()
        found = ckpt.resolve(resume, self.run_dir)
        if found is None:
            if self.accelerator.is_main_process:
                print(f"run.resume=latest: no checkpoint in {self.run_dir / 'checkpoints'} yet; starting at step 0",
                      flush=True)
            return None
        state = ckpt.read_state(found)
        ckpt.check_compatible(state["config"], to_dict(self.config), found, eval_only_keys(self.config))
        if state.get("num_processes", 1) != self.accelerator.num_processes and self.accelerator.is_main_process:
            print(f"resuming a run of {state['num_processes']} process(es) on {self.accelerator.num_processes}",
                  flush=True)
        try:  # before the weights load: a stream of another layout (the rows' buckets changed) fails in one line
            self.stream.load_state_dict(state["stream"])
        except ValueError as error:
            raise ckpt.CheckpointError(f"cannot resume from {found}: {error}") from error
        self.accelerator.load_state(str(found / "accelerate"))
        self.step = int(state["step"])
        self.learner.optimizer_steps = int(state["optimizer_steps"])
        if self.accelerator.is_main_process:
            print(f"resumed from {found} at step {self.step}", flush=True)
        return found

    def _start_log(self, resumed: bool) -> None:
        """Write config.yaml and set metrics.jsonl up for the steps to come: cut to the resumed step (a killed run
        logged steps after its checkpoint that will be redone), or emptied for a run that starts at step 0 (an
        attempt killed before its first checkpoint)."""
        if not self.accelerator.is_main_process:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.write_text_atomic(self.run_dir / "config.yaml", dump_config(self.config))
        _truncate_metrics(self.run_dir / "metrics.jsonl", self.step if resumed else None)
        logger.info(self.geometry.describe())
        print(self.geometry.describe(), flush=True)

    def _evaluated_at(self, step: int) -> bool:
        """Whether metrics.jsonl already holds the evaluation of ``step`` (a relaunched finished run); the main
        process reads the log and every process gets its answer."""
        found = 0.0
        if self.accelerator.is_main_process and (self.run_dir / "metrics.jsonl").is_file():
            records = read_metrics(self.run_dir / "metrics.jsonl")
            found = float(any(r.get("step") == step and "eval/samples" in r for r in records))
        flag = torch.tensor([found], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, "max").item() > 0)

    def _should_stop(self) -> bool:
        """Whether any process received SIGTERM/SIGINT (a collective: every process calls it at the same points)."""
        flag = torch.tensor([1.0 if stop_requested() else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, "max").item() > 0)

# ====================================================================== helpers
def _import_group_default_modules() -> None:
    """Import, before the process group forms, the torch modules whose functions take ``group.WORLD`` as a default
    argument value: Python evaluates it once, at import, so a module first imported while a group exists keeps that
    group alive after ``destroy_process_group`` for as long as the interpreter runs (with its gloo worker threads:
    :meth:`Trainer.close`). Imported before, the default is None (torch resolves None to the current group).
    ``torch.distributed.nn.functional`` (``broadcast(tensor, src, group=group.WORLD)``, torch 2.14) is imported by
    ``torch._dynamo``, which the first ``torch.optim`` optimizer imports; ``fsdp.sharded_grad_scaler``
    (``ShardedGradScaler(process_group=dist.group.WORLD)``) by Accelerate when it prepares an FSDP model, so it is
    imported here only for FSDP launches (it takes a second)."""
    if not torch.distributed.is_available() or torch.distributed.is_initialized():
        return
    importlib.import_module("torch.distributed.nn.functional")
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        importlib.import_module("torch.distributed.fsdp.sharded_grad_scaler")


def _launched_without_accelerators() -> bool:
    """True for a multi-process launch on a machine with no GPU: Accelerate then needs ``cpu=True`` to form a gloo
    group, otherwise every process silently runs alone and they all write the same run folder."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    from accelerate.utils import is_cuda_available, is_mps_available, is_xpu_available

    return not (is_cuda_available() or is_xpu_available() or is_mps_available())


def _flat_scalars(data: Any, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    if isinstance(data, dict):
        for key, value in data.items():
            flat.update(_flat_scalars(value, f"{prefix}{key}."))
    elif isinstance(data, (int, float, str, bool)):
        flat[prefix[:-1]] = data
    return flat


def _truncate_metrics(path: Path, step: int | None) -> None:
    """Drop metrics lines written after ``step``, or every line when ``step`` is None."""
    if not path.is_file():
        return
    kept = [] if step is None else [record for record in read_metrics(path) if record.get("step", 0) <= step]
    ckpt.write_text_atomic(path, "".join(json.dumps(record) + "\n" for record in kept))


def evaluation_share(num_prompts: int, samples_per_prompt: int, process_index: int, num_processes: int) -> list[int]:
    """The evaluation samples (indices ``prompt * samples_per_prompt + j``) one process rolls out.

    Whole prompts are dealt out in turn, so every sample of a prompt is scored on one process: a group-wise reward
    (one call per group) then sees the whole group in the evaluation too. Each sample's noise is seeded from its
    index, so the scores do not depend on how many processes share the work.
    """
    return [prompt * samples_per_prompt + j for prompt in range(process_index, num_prompts, num_processes)
            for j in range(samples_per_prompt)]
