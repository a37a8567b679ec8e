"""Batch arithmetic: how prompts, group size, processes, mini-batches and micro-batches relate.

Checked once at start-up, printed, and refused with a one-line error naming the key to change when it does not
divide (silent rounding of batch sizes is a recurring complaint in peers: flow_grpo #210, #106).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mmrl.config import ConfigError, TrainConfig


@dataclass(frozen=True)
class BatchGeometry:
    """Per-step sizes.

    Attributes:
        prompts: P, prompts per step over all processes.
        group_size: G.
        num_processes: W.
        samples: B = P·G, samples per step over all processes.
        local_samples: B / W, samples per process per step.
        minibatches: optimizer steps per inner epoch.
        minibatch_size: local samples per optimizer step on one process.
        micro_batch_size: samples per forward/backward.
        micro_steps: micro-batches per optimizer step.
        inner_epochs: μ.
        action_chunks: backward passes per micro-batch (action columns back-propagated a chunk at a time).
    """

    prompts: int
    group_size: int
    num_processes: int
    samples: int
    local_samples: int
    minibatches: int
    minibatch_size: int
    micro_batch_size: int
    micro_steps: int
    inner_epochs: int
    action_chunks: int = 1

    @property
    def optimizer_steps_per_step(self) -> int:
        return self.minibatches * self.inner_epochs

    @property
    def backward_passes(self) -> int:
        """Backward passes per optimizer step: Accelerate's gradient-accumulation count."""
        return self.micro_steps * self.action_chunks

    def describe(self) -> str:
        return (
            f"batch geometry: {self.prompts} prompts x G={self.group_size} = {self.samples} samples per step; "
            f"{self.num_processes} process(es) x {self.local_samples} samples; "
            f"{self.minibatches} optimizer step(s) per inner epoch x mu={self.inner_epochs} epoch(s); "
            f"each optimizer step = {self.num_processes} x {self.minibatch_size} samples in "
            f"{self.micro_steps} micro-batch(es) of <= {self.micro_batch_size}"
            + (f", each back-propagated in {self.action_chunks} action chunks" if self.action_chunks > 1 else "")
        )


def batch_geometry(config: TrainConfig, num_processes: int, max_actions: int | None = None) -> BatchGeometry:
    """Derive and check the batch sizes of a run on ``num_processes`` processes.

    ``max_actions`` (the plugin's action budget) is needed when ``algorithm.action_chunk_size`` is set.
    """
    rollout, algorithm = config.rollout, config.algorithm
    prompts, group_size = rollout.prompts_per_step, rollout.group_size
    samples = prompts * group_size
    if samples % num_processes:
        raise ConfigError(
            "rollout.prompts_per_step", prompts,
            f"a value for which prompts_per_step x group_size ({samples}) is divisible by {num_processes} processes",
        )
    if rollout.layout == "contiguous" and prompts % num_processes:
        raise ConfigError(
            "rollout.prompts_per_step", prompts,
            f"a multiple of {num_processes} processes: layout 'contiguous' keeps whole groups on one process",
        )
    local = samples // num_processes
    if local % algorithm.minibatches:
        raise ConfigError(
            "algorithm.minibatches", algorithm.minibatches,
            f"a divisor of the {local} samples each process holds per step",
        )
    minibatch_size = local // algorithm.minibatches
    micro = min(algorithm.micro_batch_size, minibatch_size)
    action_chunks = 1
    if algorithm.action_chunk_size is not None and max_actions is not None:
        action_chunks = math.ceil(max_actions / algorithm.action_chunk_size)
    return BatchGeometry(
        prompts=prompts,
        group_size=group_size,
        num_processes=num_processes,
        samples=samples,
        local_samples=local,
        minibatches=algorithm.minibatches,
        minibatch_size=minibatch_size,
        micro_batch_size=micro,
        micro_steps=math.ceil(minibatch_size / micro),
        inner_epochs=algorithm.inner_epochs,
        action_chunks=action_chunks,
    )


def check_whole_groups(geometry: BatchGeometry, layout: str, what: str) -> None:
    """Refuse, in one line naming the key to change, a geometry in which a mini-batch or micro-batch would not hold
    whole groups on one process: what a loss that couples the samples of a group needs (``what`` names it; see
    :func:`mmrl.trainer.sampler.group_minibatch_partition`).

    Upstream DGPO all-reduces its group sums over processes instead (Luo-Yihong/DGPO, ``train_sd3_dgpo.py``
    L184-185); keeping groups whole gives the same sums without a collective per backward pass.
    """
    size, processes = geometry.group_size, geometry.num_processes
    if processes > 1 and layout != "contiguous":
        raise ConfigError("rollout.layout", layout, f"'contiguous' with {what} on {processes} processes (its loss "
                          "couples the samples of a group, which must stay on one process)")
    groups = geometry.prompts // processes
    if geometry.prompts % processes or groups % geometry.minibatches:
        raise ConfigError("algorithm.minibatches", geometry.minibatches, f"a divisor of the {geometry.prompts} "
                          f"prompts / {processes} process(es) = {geometry.prompts / processes:g} groups per process "
                          f"with {what} (each mini-batch holds whole groups)")
    if geometry.micro_batch_size % size:
        raise ConfigError("algorithm.micro_batch_size", geometry.micro_batch_size, f"a multiple of rollout.group_size "
                          f"({size}) with {what} (each micro-batch holds whole groups; to bound memory set "
                          "algorithm.action_chunk_size instead)")
