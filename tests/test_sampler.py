"""The group-aware prompt stream and the process layouts."""

import pytest

from mmrl.trainer.sampler import PromptStream, derive_seed, local_sample_indices, plan_local_batch


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
