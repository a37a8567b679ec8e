"""The group-aware prompt stream and the process layouts."""

import pytest

from mmrl.trainer.sampler import (
    PromptStream,
    derive_seed,
    local_sample_indices,
    minibatch_partition,
    plan_local_batch,
)


def test_stream_is_deterministic_and_crosses_epochs_seamlessly():
    a, b = PromptStream(5, seed=3), PromptStream(5, seed=3)
    first = a.take(4)[0] + a.take(4)[0] + a.take(4)[0]
    assert first == b.take(12)[0]
    assert sorted(first[:5]) == list(range(5)) and sorted(first[5:10]) == list(range(5))  # whole epochs
    assert a.epoch == 2


def test_stream_state_resumes_exactly_even_at_an_epoch_boundary():
    a = PromptStream(6, seed=1)
    a.take(6)  # exactly one epoch
    resumed = PromptStream(6, seed=1)
    resumed.load_state_dict(a.state_dict())
    assert resumed.take(9) == a.take(9)
    with pytest.raises(ValueError, match="seed"):
        PromptStream(6, seed=2).load_state_dict(a.state_dict())


def test_layouts_partition_the_global_batch():
    for layout in ("spread", "contiguous"):
        parts = [local_sample_indices(12, 3, r, layout) for r in range(3)]
        assert sorted(i for part in parts for i in part) == list(range(12))
    assert local_sample_indices(8, 2, 1, "spread") == [1, 3, 5, 7]
    assert local_sample_indices(8, 2, 1, "contiguous") == [4, 5, 6, 7]


def test_spread_layout_deals_each_group_over_processes_and_contiguous_keeps_it():
    def groups_of(layout, rank):
        plan = plan_local_batch(PromptStream(10, seed=0), prompts=2, group_size=4, num_processes=2,
                                process_index=rank, layout=layout, seed=0, step=0, round_index=0)
        return plan.group_ids

    assert groups_of("spread", 0) == [0, 0, 1, 1] and groups_of("spread", 1) == [0, 0, 1, 1]
    assert groups_of("contiguous", 0) == [0, 0, 0, 0] and groups_of("contiguous", 1) == [1, 1, 1, 1]


def test_sample_seeds_depend_on_the_global_index_not_the_layout():
    def seeds(processes):
        found = {}
        for rank in range(processes):
            plan = plan_local_batch(PromptStream(10, seed=0), prompts=2, group_size=4, num_processes=processes,
                                    process_index=rank, layout="spread", seed=0, step=5, round_index=0)
            found.update(zip(plan.global_indices, plan.seeds, strict=True))
        return found

    assert seeds(1) == seeds(2) == seeds(4)
    assert len(set(seeds(1).values())) == 8
    assert derive_seed(1, 2) != derive_seed(2, 1)


def test_uneven_split_is_refused():
    with pytest.raises(ValueError, match="evenly"):
        local_sample_indices(10, 3, 0, "spread")


def _global_minibatches(num_samples, minibatches, layout, num_processes, seed):
    """Each mini-batch as the set of global sample indices that its members have, over all processes."""
    found = [set() for _ in range(minibatches)]
    for rank in range(num_processes):
        mine = local_sample_indices(num_samples, num_processes, rank, layout)
        parts = minibatch_partition(num_samples, minibatches, layout, num_processes, rank, seed)
        assert [len(p) for p in parts] == [num_samples // (num_processes * minibatches)] * minibatches
        assert sorted(i for p in parts for i in p) == list(range(len(mine)))  # every local sample, once
        for m, part in enumerate(parts):
            found[m] |= {mine[i] for i in part}
    return found


@pytest.mark.parametrize("layout", ["spread", "contiguous"])
@pytest.mark.parametrize("num_samples, minibatches", [(32, 4), (128, 2), (24, 3)])
def test_the_same_samples_share_a_minibatch_on_any_number_of_processes(layout, num_samples, minibatches):
    counts = [w for w in range(1, num_samples + 1) if num_samples % (w * minibatches) == 0]
    assert len(counts) >= 3
    reference = _global_minibatches(num_samples, minibatches, layout, 1, seed=7)
    assert sorted(len(m) for m in reference) == [num_samples // minibatches] * minibatches
    for num_processes in counts[1:]:
        assert _global_minibatches(num_samples, minibatches, layout, num_processes, seed=7) == reference


def test_minibatch_partitions_are_random_across_seeds_and_stratified_within_a_process():
    partitions = {tuple(map(tuple, minibatch_partition(32, 4, "contiguous", 1, 0, seed))) for seed in range(20)}
    assert len(partitions) == 20
    for seed in range(20):  # contiguous strata: every run of 4 consecutive samples meets all 4 mini-batches
        parts = minibatch_partition(32, 4, "contiguous", 1, 0, seed)
        owner = {i: m for m, part in enumerate(parts) for i in part}
        for start in range(0, 32, 4):
            assert sorted(owner[i] for i in range(start, start + 4)) == [0, 1, 2, 3]


def test_a_partition_the_processes_cannot_share_evenly_is_refused():
    with pytest.raises(ValueError, match="cannot form 3 mini-batches on 2 processes"):
        minibatch_partition(16, 3, "spread", 2, 0, seed=0)


@pytest.mark.parametrize("layout", ["contiguous", "spread"])
def test_one_minibatch_holds_every_local_sample_in_order(layout):
    """minibatches = 1 returns every local sample at once (no seeded deal), as the dealing loop would."""
    for num_processes in (1, 2, 4):
        for rank in range(num_processes):
            assert minibatch_partition(16, 1, layout, num_processes, rank, seed=3) == [list(range(16 // num_processes))]
    with pytest.raises(ValueError, match="layout"):
        minibatch_partition(16, 1, "diagonal", 1, 0, seed=3)
