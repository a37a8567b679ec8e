"""DAPO dynamic sampling: spread filter, balanced selection, the stop rule."""

import pytest
import torch

from mmrl.algos import batch_is_full, groups_with_spread, select_kept, validate_groups
from mmrl.algos.groups import GroupError


def test_groups_without_spread_are_dropped():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5000001])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    keep = groups_with_spread(rewards, groups)
    assert keep.tolist() == [False] * 3 + [True] * 3 + [True] * 3
    assert groups_with_spread(rewards, groups, tolerance=1e-3).tolist() == [False] * 3 + [True] * 3 + [False] * 3


def test_a_group_of_one_sample_is_dropped_unlike_dapo_code_which_keeps_it():
    """Its advantage is 0 here (nothing to compare with), so it carries no gradient; DAPO's recipe keeps it."""
    keep = groups_with_spread(torch.tensor([0.3, 1.0, 0.0]), torch.tensor([5, 7, 7]))
    assert keep.tolist() == [False, True, True]


def test_selection_takes_kept_samples_first_then_pads():
    keep = torch.tensor([False, True, True, False, True, False])
    plan = select_kept(keep, 4)
    assert plan.indices.tolist() == [1, 2, 4, 0]
    assert plan.padded.tolist() == [False, False, False, True]
    full = select_kept(torch.tensor([True] * 6), 4)
    assert full.indices.tolist() == [0, 1, 2, 3] and not full.padded.any()


def test_a_process_with_everything_filtered_pads_completely():
    plan = select_kept(torch.zeros(8, dtype=torch.bool), 4)
    assert plan.padded.all() and len(plan.indices) == 4


def test_pool_smaller_than_target_is_an_error():
    with pytest.raises(ValueError, match="fewer"):
        select_kept(torch.ones(3, dtype=torch.bool), 4)


def test_the_slowest_process_decides_when_to_stop():
    assert not batch_is_full(torch.tensor([12, 3]), 8)
    assert batch_is_full(torch.tensor([12, 8]), 8)


def test_group_sizes_are_validated():
    validate_groups(torch.tensor([4, 4, 9, 9]), 2)
    with pytest.raises(GroupError, match="group_size=2"):
        validate_groups(torch.tensor([4, 4, 4, 9]), 2)
