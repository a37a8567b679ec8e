"""Group-aware prompt sampling over processes.

All processes read one deterministic stream of prompt indices: epoch e is a permutation of the dataset seeded
by (seed, e), and the stream is the concatenation of the epochs. A step takes the next P prompts of the stream and
repeats each G times, giving a global batch of B = P·G samples in a fixed global order (sample k belongs to
prompt k // G). A *layout* decides which global samples each process holds:

- ``spread``: sample k goes to process k mod W, so the G copies of a prompt are dealt over the processes and
  group statistics need the gathered rewards (Flow-GRPO, TRL);
- ``contiguous``: process r holds the block [r·B/W, (r+1)·B/W), whole groups when P is divisible by W
  (DanceGRPO; a plugin can then share initial noise within a group).

Rows that cannot share a batch (:meth:`mmrl.plugin.Plugin.row_buckets`, e.g. images of different sizes) make a
*bucketed* stream: epoch e deals each bucket's rows, in an order seeded by (seed, e), into chunks of P prompts
(the last chunk of a bucket is filled up by cycling from the start of that bucket's order, so no row is dropped),
and puts the chunks in a seeded order; every step then takes one whole chunk, hence one bucket. Its epochs are
P x (number of chunks) prompts long, which may exceed the dataset: rows that fill a chunk up appear twice.

The only state is the number of prompts consumed, so resuming is exact, and no epoch boundary can leave an
exhausted sampler behind (verl #7401): the stream simply continues into the next epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The seed mixing is the core's public API (mmrl.seeding); the names stay importable from here.
from mmrl.seeding import MASK64, derive_seed, splitmix64  # noqa: F401

# Purpose tags of a bucketed epoch's two kinds of draws (any constants: they keep the streams apart).
_BUCKET_ORDER_TAG, _CHUNK_ORDER_TAG = 0xB0C4, 0xC4C0


class PromptStream:
    """The shared, deterministic stream of prompt indices.

    Args:
        dataset_size: Number of prompt rows.
        seed: Base seed; epoch e is ``randperm(dataset_size)`` under seed ``derive_seed(seed, e)``.
        shuffle: Permute each epoch (False: 0, 1, 2, ... every epoch; with buckets, each bucket's rows in dataset
            order and the chunks in bucket order).
        buckets: The bucket of each row (:meth:`mmrl.plugin.Plugin.row_buckets`), ``dataset_size`` keys. None, or a
            single distinct key, gives the plain stream above. With several keys every :meth:`take` returns one
            whole chunk of ``batch_prompts`` rows of one bucket (see the module docstring): bucket b's rows in
            the order ``randperm`` draws under ``derive_seed(seed, e, tag, b)`` (b counts the buckets in their order
            of first appearance), the chunks in the order drawn under ``derive_seed(seed, e, another tag)``.
        batch_prompts: P, the prompts of one :meth:`take`; required with several buckets.
    """

    def __init__(self, dataset_size: int, seed: int, shuffle: bool = True, *, buckets: list[str] | None = None,
                 batch_prompts: int | None = None):
        if dataset_size < 1:
            raise ValueError("the prompt dataset is empty")
        self.dataset_size = dataset_size
        self.seed = seed
        self.shuffle = shuffle
        self.consumed = 0
        self._cached_epoch = -1
        self._permutation: list[int] = []
        self.batch_prompts = batch_prompts
        self._bucket_rows = _rows_per_bucket(buckets, dataset_size)  # [[row, ...] per bucket], or None
        if self._bucket_rows is not None and (batch_prompts is None or batch_prompts < 1):
            raise ValueError(f"a stream over {len(self._bucket_rows)} buckets needs batch_prompts (the prompts of "
                             f"one take, a positive integer), got {batch_prompts!r}")

    @property
    def bucketed(self) -> bool:
        """Whether the rows fall in several buckets (every :meth:`take` is then one bucket's chunk)."""
        return self._bucket_rows is not None

    @property
    def epoch_length(self) -> int:
        """Prompts per epoch: ``dataset_size``, or P x (number of chunks) when bucketed."""
        if self._bucket_rows is None:
            return self.dataset_size
        return self.batch_prompts * sum(-(-len(rows) // self.batch_prompts) for rows in self._bucket_rows)

    @property
    def epoch(self) -> int:
        return self.consumed // self.epoch_length

    def _order(self, epoch: int) -> list[int]:
        if epoch != self._cached_epoch:
            if self._bucket_rows is not None:
                self._permutation = self._bucketed_order(epoch)
            elif self.shuffle:
                generator = torch.Generator().manual_seed(derive_seed(self.seed, epoch))
                self._permutation = torch.randperm(self.dataset_size, generator=generator).tolist()
            else:
                self._permutation = list(range(self.dataset_size))
            self._cached_epoch = epoch
        return self._permutation

    def _bucketed_order(self, epoch: int) -> list[int]:
        """The row indices of a bucketed epoch: its chunks of P rows of one bucket each, one after another."""
        size = self.batch_prompts
        chunks: list[list[int]] = []
        for b, rows in enumerate(self._bucket_rows):
            if self.shuffle:
                generator = torch.Generator().manual_seed(derive_seed(self.seed, epoch, _BUCKET_ORDER_TAG, b))
                rows = [rows[i] for i in torch.randperm(len(rows), generator=generator).tolist()]
            count = -(-len(rows) // size)  # ceil: the last chunk is filled up from the start of the bucket's order
            cycled = [rows[i % len(rows)] for i in range(count * size)]
            chunks += [cycled[start:start + size] for start in range(0, len(cycled), size)]
        if self.shuffle:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, epoch, _CHUNK_ORDER_TAG))
            chunks = [chunks[i] for i in torch.randperm(len(chunks), generator=generator).tolist()]
        return [row for chunk in chunks for row in chunk]

    def take(self, count: int) -> tuple[list[int], list[int]]:
        """The next ``count`` prompts: ``(dataset indices, stream positions)``. Positions are unique over the run
        and serve as group ids. A bucketed stream takes exactly ``batch_prompts`` prompts, one chunk."""
        if self._bucket_rows is not None and count != self.batch_prompts:
            raise ValueError(f"a stream over {len(self._bucket_rows)} buckets takes whole chunks of "
                             f"batch_prompts={self.batch_prompts} prompts, not {count}")
        length = self.epoch_length
        indices, positions = [], []
        for position in range(self.consumed, self.consumed + count):
            epoch, offset = divmod(position, length)
            indices.append(self._order(epoch)[offset])
            positions.append(position)
        self.consumed += count
        return indices, positions

    def state_dict(self) -> dict[str, int]:
        state = {"consumed": self.consumed, "dataset_size": self.dataset_size, "seed": self.seed}
        if self._bucket_rows is not None:  # a plain stream's state stays as it always was
            state["epoch_length"] = self.epoch_length
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["dataset_size"] != self.dataset_size or state["seed"] != self.seed:
            raise ValueError(
                f"sampler state is for a dataset of {state['dataset_size']} prompts with seed {state['seed']}, "
                f"but this run has {self.dataset_size} prompts and seed {self.seed}"
            )
        # A state without the key is a plain stream's (as every state before buckets existed).
        theirs = state.get("epoch_length")
        ours = self.epoch_length if self._bucket_rows is not None else None
        if theirs != ours:
            raise ValueError(f"sampler state has epochs of {_describe_epoch(theirs)}, but this run's are "
                             f"{_describe_epoch(ours)}: the rows' buckets (or the prompts per take) changed since "
                             "it was saved")
        if ours is not None and int(state["consumed"]) % self.batch_prompts:
            raise ValueError(f"sampler state consumed {state['consumed']} prompts, not a whole number of this "
                             f"run's chunks of {self.batch_prompts} prompts")
        self.consumed = int(state["consumed"])


def _rows_per_bucket(buckets: list[str] | None, dataset_size: int) -> list[list[int]] | None:
    """The row indices of each bucket, buckets in order of first appearance; None when there are fewer than two."""
    if buckets is None:
        return None
    if len(buckets) != dataset_size:
        raise ValueError(f"buckets has {len(buckets)} keys for a dataset of {dataset_size} prompts (one per row)")
    rows: dict[str, list[int]] = {}
    for index, key in enumerate(buckets):
        rows.setdefault(key, []).append(index)
    return list(rows.values()) if len(rows) > 1 else None


def _describe_epoch(length: int | None) -> str:
    return "the dataset's length (no buckets)" if length is None else f"{length} prompts (in buckets)"


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


def group_minibatch_partition(num_samples: int, group_size: int, minibatches: int, num_processes: int,
                              process_index: int, seed: int) -> list[list[int]]:
    """This process's local sample indices in each mini-batch of one inner epoch, whole groups at a time: the
    partition of a loss that couples the samples of a group (a policy loss that declares ``group_ids``, DGPO).

    :func:`minibatch_partition` of the groups (units of G consecutive samples, the ``contiguous`` layout's), each
    group's G local samples listed together in order. The learner then cuts each mini-batch into micro-batches of
    ``micro_batch_size`` consecutive samples, whole groups when it is a multiple of G. Needs every process to hold
    whole groups (``rollout.layout: contiguous``, or one process) and a whole number of groups per mini-batch on each
    process; :func:`mmrl.trainer.geometry.check_whole_groups` refuses the geometries that cannot.

    Args:
        num_samples: B = P·G, samples in the global batch.
        group_size: G.
        minibatches: Mini-batches per inner epoch.
        num_processes: W.
        process_index: This process.
        seed: Seed of this inner epoch (the same on every process).

    Returns:
        ``minibatches`` lists of indices into this process's ``B / W`` local samples, each of length
        ``B / (W x minibatches)``, in increasing order.
    """
    if num_samples % group_size:
        raise ValueError(f"{num_samples} samples are not whole groups of {group_size}")
    groups = num_samples // group_size
    if groups % (minibatches * num_processes):
        raise ValueError(f"{groups} groups cannot form {minibatches} mini-batches of whole groups on {num_processes} "
                         "processes")
    dealt = minibatch_partition(groups, minibatches, "contiguous", num_processes, process_index, seed)
    return [[g * group_size + member for g in part for member in range(group_size)] for part in dealt]


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
