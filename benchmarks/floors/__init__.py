"""Compute floors of one mmrl training step, one module per plugin (used by ``benchmarks/step_floors.py``).

A floor is the model compute a training step cannot do without, run bare on the very modules, shapes and batch of
one captured step: the rollout's model calls (generation, decoding, the denoiser at every sampling step, the VAE),
then, for every backward pass the learner makes (each inner epoch, mini-batch, micro-batch and action chunk), one
bare forward of the trained model on that pass's inputs and its backward, and one bare optimizer step per
mini-batch. Inputs are prepared once outside the timed region; the floor never runs plugin, trainer or reward code.

Each plugin module defines a :class:`Floor` subclass with the plugin's model calls, and the plugin's *extras*: the
bare model passes the step runs beyond the floor (the reference pass, a separate old-policy pass) and its log-prob
math, each timed on its own so that ``step − floor`` can be broken down.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from mmrl.plugin import PromptBatch
from mmrl.rollout import Rollout
from mmrl.seeding import derive_seed
from mmrl.trainer.collect import TrainingBatch, chunks
from mmrl.trainer.sampler import minibatch_partition


@dataclass
class Capture:
    """What one training step handed to its plugin and learner.

    Attributes:
        batches: The prompt batches of the plugin's rollout calls (one per ``rollout.batch_size`` chunk).
        rollouts: The rollouts those calls returned, in order.
        training: The training batch the learner received (rollout with advantages).
        step: The trainer's step index when the step ran (mini-batch partitions are seeded from it).
    """

    batches: list[PromptBatch] = field(default_factory=list)
    rollouts: list[Rollout] = field(default_factory=list)
    training: TrainingBatch | None = None
    step: int = 0


@contextmanager
def capturing(trainer: Any) -> Iterator[Capture]:
    """Record the plugin's rollout calls and the collector's training batch while the block runs."""
    capture = Capture(step=trainer.step)
    plugin, collector = trainer.plugin, trainer.collector
    rollout, collect = plugin.rollout, collector.collect

    def recorded_rollout(policy: Any, batch: PromptBatch) -> Rollout:
        result = rollout(policy, batch)
        if batch.training:
            capture.batches.append(batch)
            capture.rollouts.append(result)
        return result

    def recorded_collect(*args: Any, **kwargs: Any) -> TrainingBatch:
        capture.training = collect(*args, **kwargs)
        return capture.training

    plugin.rollout, collector.collect = recorded_rollout, recorded_collect
    try:
        yield capture
    finally:
        del plugin.rollout, collector.collect  # the instance attributes shadowed the bound methods


@dataclass
class TrainUnit:
    """One backward pass of the learner: inner epoch ``epoch``, samples ``indices`` of the training batch, and the
    ``inputs`` the plugin's floor prepared for its bare forward."""

    epoch: int
    indices: list[int]
    inputs: Any


class Floor:
    """The compute floor of one captured step (subclasses: one per plugin).

    Args:
        trainer: The :class:`~mmrl.trainer.Trainer` whose step was captured.
        capture: The captured step.

    Subclasses implement :meth:`generation` (the rollout's model calls), :meth:`unit_inputs` (inputs of one backward
    pass) and :meth:`loss` (the bare forward of one pass), and may add :meth:`extras`.
    """

    def __init__(self, trainer: Any, capture: Capture):
        if capture.training is None or not capture.rollouts:
            raise ValueError("the capture holds no training step")
        self.trainer = trainer
        self.capture = capture
        self.plugin = trainer.plugin
        self.policy = trainer.policy
        self.device = trainer.accelerator.device
        self.rollout = capture.training.rollout.to(self.device)
        parameters = [p for p in self.policy.parameters() if p.requires_grad]
        optim = trainer.config.optim
        # The same AdamW as the trainer's, with its own state and a learning rate of 0: the same arithmetic, and the
        # weights stay where the step left them (x − 0·update), so the floor does not change what the step samples.
        self.optimizer = torch.optim.AdamW(parameters, lr=0.0, betas=tuple(optim.betas),
                                           weight_decay=optim.weight_decay, eps=optim.eps)

    # ------------------------------------------------------------------ plugin parts
    def generation(self) -> None:
        """The rollout's model calls on the captured batch (no gradients)."""
        raise NotImplementedError

    def unit_inputs(self, epoch: int, indices: list[int], columns: torch.Tensor | None) -> Any:
        """Inputs of the bare forward of one backward pass: samples ``indices`` of the training batch, action
        columns ``columns`` (None: all), inner epoch ``epoch``."""
        raise NotImplementedError

    def loss(self, inputs: Any) -> torch.Tensor:
        """One bare forward of the trained model on ``inputs``, reduced to a scalar (:func:`scalar`) for the
        backward."""
        raise NotImplementedError

    def extras(self) -> dict[str, Callable[[], None]]:
        """Bare passes the step runs beyond the floor (``reference``, ``old_logp``) and its ``logprob_math``."""
        return {}

    def describe(self) -> dict[str, Any]:
        """What the floor runs, for the results file."""
        return {}

    # ------------------------------------------------------------------ the floor
    def run(self) -> dict[str, float]:
        """Run the floor once; returns the seconds of its parts (``generation``, ``forward_backward``,
        ``optimizer``)."""
        parts = {"generation": 0.0, "forward_backward": 0.0, "optimizer": 0.0}
        tick = self._clock()
        with torch.no_grad(), self.plugin.runtime.autocast():
            self.generation()
        parts["generation"], tick = self._clock() - tick, self._clock()
        for minibatch in self.schedule:
            for unit in minibatch:
                with self.plugin.runtime.autocast():
                    loss = self.loss(unit.inputs)
                loss.backward()
            tock = self._clock()
            parts["forward_backward"] += tock - tick
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            tick = self._clock()
            parts["optimizer"] += tick - tock
        return parts

    def backward_passes(self) -> int:
        return sum(len(minibatch) for minibatch in self.schedule)

    @cached_property
    def schedule(self) -> list[list[TrainUnit]]:
        """The learner's loop (mmrl.trainer.learn.Learner.update) over the captured batch: per inner epoch its
        seeded mini-batch partition, per mini-batch its micro-batches, per micro-batch its action-column chunks."""
        trainer, geometry = self.trainer, self.trainer.geometry
        config = trainer.config
        acc = trainer.accelerator
        column_chunks: list[torch.Tensor | None] = [None]
        if config.algorithm.action_chunk_size is not None:
            column_chunks = list(torch.arange(self.plugin.max_actions()).split(config.algorithm.action_chunk_size))
        schedule = []
        for epoch in range(geometry.inner_epochs):
            partition = minibatch_partition(geometry.samples, geometry.minibatches, config.rollout.layout,
                                            acc.num_processes, acc.process_index,
                                            seed=derive_seed(config.run.seed, self.capture.step, epoch))
            for members in partition:
                units = []
                for micro in chunks(list(members), geometry.micro_batch_size):
                    for columns in column_chunks:
                        units.append(TrainUnit(epoch, micro, self.unit_inputs(epoch, micro, columns)))
                schedule.append(units)
        return schedule

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def scalar(output: torch.Tensor) -> torch.Tensor:
    """The cheapest scalar that back-propagates into every output element (the floor's stand-in for a loss)."""
    return output.float().mean()
