"""Group-aware prompt sampling over processes.

All processes read one deterministic stream of prompt indices: epoch e is a permutation of the dataset seeded
by (seed, e), and the stream is the concatenation of the epochs. A step takes the next P prompts of the stream and
repeats each G times, giving a global batch of B = P·G samples in a fixed global order (sample k belongs to
prompt k // G). A *layout* decides which global samples each process holds:

- ``spread``: sample k goes to process k mod W, so the G copies of a prompt are dealt over the processes and
  group statistics need the gathered rewards (Flow-GRPO, TRL);
- ``contiguous``: process r holds the block [r·B/W, (r+1)·B/W), whole groups when P is divisible by W
  (DanceGRPO; a plugin can then share initial noise within a group).

The only state is the number of prompts consumed, so resuming is exact, and no epoch boundary can leave an
exhausted sampler behind (verl #7401): the stream simply continues into the next epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The seed mixing is the core's public API (mmrl.seeding); the names stay importable from here.
from mmrl.seeding import MASK64, derive_seed, splitmix64  # noqa: F401


class PromptStream:
    """The shared, deterministic stream of prompt indices.

    Args:
        dataset_size: Number of prompt rows.
        seed: Base seed; epoch e is ``randperm(dataset_size)`` under seed ``derive_seed(seed, e)``.
        shuffle: Permute each epoch (False: 0, 1, 2, ... every epoch).
    """

    def __init__(self, dataset_size: int, seed: int, shuffle: bool = True):
        if dataset_size < 1:
            raise ValueError("the prompt dataset is empty")
        self.dataset_size = dataset_size
        self.seed = seed
        self.shuffle = shuffle
        self.consumed = 0
        self._cached_epoch = -1
        self._permutation: list[int] = []

    @property
    def epoch(self) -> int:
        return self.consumed // self.dataset_size

    def _order(self, epoch: int) -> list[int]:
        if epoch != self._cached_epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(derive_seed(self.seed, epoch))
                self._permutation = torch.randperm(self.dataset_size, generator=generator).tolist()
            else:
                self._permutation = list(range(self.dataset_size))
            self._cached_epoch = epoch
        return self._permutation

    def take(self, count: int) -> tuple[list[int], list[int]]:
        """The next ``count`` prompts: ``(dataset indices, stream positions)``. Positions are unique over the run
        and serve as group ids."""
        indices, positions = [], []
        for position in range(self.consumed, self.consumed + count):
            epoch, offset = divmod(position, self.dataset_size)
            indices.append(self._order(epoch)[offset])
            positions.append(position)
        self.consumed += count
        return indices, positions

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed, "dataset_size": self.dataset_size, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["dataset_size"] != self.dataset_size or state["seed"] != self.seed:
            raise ValueError(
                f"sampler state is for a dataset of {state['dataset_size']} prompts with seed {state['seed']}, "
                f"but this run has {self.dataset_size} prompts and seed {self.seed}"
            )
        self.consumed = int(state["consumed"])


def local_sample_indices(num_samples: int, num_processes: int, process_index: int, layout: str) -> list[int]:
    """Global sample indices held by ``process_index`` under ``layout`` (see the module docstring)."""
    if num_samples % num_processes:
        raise ValueError(f"{num_samples} samples cannot be split evenly over {num_processes} processes")
    if layout == "spread":
        return list(range(process_index, num_samples, num_processes))
    if layout == "contiguous":
        per_process = num_samples // num_processes
        return list(range(process_index * per_process, (process_index + 1) * per_process))
    raise ValueError(f"layout must be 'spread' or 'contiguous', got {layout!r}")


def minibatch_partition(num_samples: int, minibatches: int, layout: str, num_processes: int, process_index: int,
                        seed: int) -> list[list[int]]:
    """This process's local sample indices in each mini-batch of one inner epoch.

    The partition is a function of the global batch and the seed alone, so the same samples meet in the same
    mini-batch (and take the same optimizer step) on any number of processes. It is stratified so that every
    process holds exactly its share of every mini-batch: the strata are the shares of the largest process count the
    batch geometry allows (W* = B / minibatches processes of ``minibatches`` samples each, under ``layout``), and
    each stratum deals one sample to each mini-batch in a seeded random order. The share of a process under any
    allowed count W (W divides W*) is a union of whole strata, hence balanced. Under ``contiguous`` a stratum is
    ``minibatches`` consecutive samples (so a group's members are spread over the mini-batches); under ``spread`` it
    is samples ``W*`` apart.

    Args:
        num_samples: B, samples in the global batch (a multiple of ``minibatches x num_processes``).
        minibatches: Mini-batches per inner epoch.
        layout: The run's ``rollout.layout`` (see :func:`local_sample_indices`).
        num_processes: W.
        process_index: This process.
        seed: Seed of this inner epoch (the same on every process).

    Returns:
        ``minibatches`` lists of indices into this process's ``B / W`` local samples, each of length
        ``B / (W x minibatches)``, in increasing order.
    """
    if num_samples % (minibatches * num_processes):
        raise ValueError(f"{num_samples} samples cannot form {minibatches} mini-batches on {num_processes} processes")
    if minibatches == 1:  # one mini-batch holds every local sample (each stratum's deal is randperm(1) = [0])
        return [list(range(len(local_sample_indices(num_samples, num_processes, process_index, layout))))]
    strata = num_samples // minibatches  # W*: the most processes this geometry allows
    generator = torch.Generator().manual_seed(seed)
    assignment = [0] * num_samples  # [B] mini-batch of each global sample
    for stratum in range(strata):
        dealt = torch.randperm(minibatches, generator=generator).tolist()
        for member, sample in enumerate(local_sample_indices(num_samples, strata, stratum, layout)):
            assignment[sample] = dealt[member]
    mine = local_sample_indices(num_samples, num_processes, process_index, layout)
    return [[i for i, sample in enumerate(mine) if assignment[sample] == m] for m in range(minibatches)]


@dataclass
class LocalBatchPlan:
    """The samples one process draws in one sampling round.

    Attributes:
        dataset_indices: Row index of each local sample.
        group_ids: Stream position of the sample's prompt (unique per group over the run).
        global_indices: Position of each sample in the global batch.
        seeds: Per-sample seeds from (run seed, step, round, global index).
    """

    dataset_indices: list[int]
    group_ids: list[int]
    global_indices: list[int]
    seeds: list[int]


def plan_local_batch(
    stream: PromptStream,
    *,
    prompts: int,
    group_size: int,
    num_processes: int,
    process_index: int,
    layout: str,
    seed: int,
    step: int,
    round_index: int,
) -> LocalBatchPlan:
    """Advance ``stream`` by ``prompts`` prompts and return this process's share of the P·G samples.

    Every process calls this with the same stream state and arguments, so the streams stay in lock-step.
    """
    indices, positions = stream.take(prompts)
    mine = local_sample_indices(prompts * group_size, num_processes, process_index, layout)
    return LocalBatchPlan(
        dataset_indices=[indices[k // group_size] for k in mine],
        group_ids=[positions[k // group_size] for k in mine],
        global_indices=mine,
        seeds=[derive_seed(seed, step, round_index, k) for k in mine],
    )
