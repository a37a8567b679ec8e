"""The rollout contract: validation, splitting and concatenation without knowing the modality."""

import pytest
import torch

from mmrl.rollout import Rollout, RolloutError


def _rollout(n=4, a=3, offset=0):
    return Rollout(
        group_ids=torch.arange(n) // 2 + offset,
        old_logp=-torch.rand(n, a),
        mask=torch.ones(n, a),
        payload={"completions": [f"text {i + offset}" for i in range(n)], "images": torch.rand(n, 3, 2, 2)},
        replay={"tokens": torch.arange(n * a).view(n, a), "nested": {"latents": torch.rand(n, a, 2)}},
        shared={"timesteps": torch.linspace(1, 0, 5)},
        chunk_ids=torch.zeros(n, a, dtype=torch.long),
        metrics={"length": 3.0},
    )


def test_select_indexes_every_per_sample_field():
    rollout = _rollout()
    picked = rollout.select([3, 0])
    assert picked.payload["completions"] == ["text 3", "text 0"]
    assert torch.equal(picked.replay["tokens"], rollout.replay["tokens"][[3, 0]])
    assert torch.equal(picked.replay["nested"]["latents"], rollout.replay["nested"]["latents"][[3, 0]])
    assert torch.equal(picked.shared["timesteps"], rollout.shared["timesteps"])  # shared values are not split
    assert len(picked) == 2 and picked.validate() is picked


def test_concat_pads_action_axes_with_zero_mask():
    joined = Rollout.concat([_rollout(2, 3), _rollout(2, 5, offset=10)])
    assert joined.old_logp.shape == (4, 5)
    assert joined.mask[:2, 3:].sum() == 0 and joined.mask[2:].sum() == 10
    assert joined.chunk_ids.shape == (4, 5)
    assert joined.payload["completions"][2] == "text 10"


def test_concat_pools_metrics_weighted_by_samples():
    first, second, third = _rollout(2, 3), _rollout(6, 3, offset=10), _rollout(4, 3, offset=20)
    first.metrics = {"length": 1.0, "only_first": 7.0}
    second.metrics = {"length": 3.0, "broken": float("nan")}
    third.metrics = {"length": 5.0, "broken": 2.0}
    assert Rollout.concat([first, second, third]).metrics == {
        "length": (2 * 1.0 + 6 * 3.0 + 4 * 5.0) / 12, "only_first": 7.0, "broken": 2.0}
    assert Rollout.concat([first]).metrics == first.metrics


def test_validate_names_the_offending_field():
    rollout = _rollout()
    rollout.payload["completions"] = ["only one"]
    with pytest.raises(RolloutError, match=r"payload\['completions'\]"):
        rollout.validate()
    rollout = _rollout()
    rollout.mask = torch.ones(4, 2)
    with pytest.raises(RolloutError, match="mask"):
        rollout.validate()
    rollout = _rollout()
    rollout.old_logp[0, 0] = float("nan")
    with pytest.raises(RolloutError, match="NaN"):
        rollout.validate()
    rollout = _rollout()
    rollout.replay["guidance"] = 4.5
    with pytest.raises(RolloutError, match="shared"):
        rollout.validate()


def test_concat_refuses_optional_fields_set_in_only_some_rollouts():
    first, second = _rollout(), _rollout()
    second.chunk_ids = None
    with pytest.raises(RolloutError, match="chunk_ids"):
        Rollout.concat([first, second])


def test_old_logp_may_be_missing_and_every_operation_keeps_it_missing():
    """A plugin may return old_logp=None (the learner computes them when needed); the mask fixes the action axis."""
    rollout = _rollout(4, 3)
    rollout.old_logp = None
    assert rollout.validate() is rollout and rollout.num_actions == 3
    assert rollout.select([2, 1]).old_logp is None
    sliced = rollout.select_actions(torch.tensor([0, 2]))
    assert sliced.old_logp is None and sliced.mask.shape == (4, 2) and sliced.num_actions == 2
    padded = rollout.pad_actions(5)
    assert padded.old_logp is None and padded.mask.shape == (4, 5) and padded.chunk_ids.shape == (4, 5)
    other = _rollout(2, 5, offset=10)
    other.old_logp = None
    joined = Rollout.concat([rollout, other])
    assert joined.old_logp is None and joined.mask.shape == (6, 5) and joined.mask[:4, 3:].sum() == 0
    assert rollout.to("cpu").old_logp is None
    with pytest.raises(RolloutError, match="old_logp is set in some rollouts and missing in others"):
        Rollout.concat([rollout, _rollout(2, 3, offset=10)])
    rollout.chunk_ids = torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(RolloutError, match=r"chunk_ids must be \[N, A\] = \(4, 3\)"):
        rollout.validate()


def test_to_moves_nested_tensors_copies_containers_and_walks_a_shared_row_once():
    rollout = _rollout()
    row = {"prompt": "p", "digits": [1, 2], "box": torch.ones(4, dtype=torch.float64)}
    rollout.rows = [row, row, {"prompt": "q", "digits": [3], "box": torch.zeros(4, dtype=torch.float64)}, row]
    rollout.payload["pairs"] = [("a", torch.ones(2)), ("b", torch.zeros(2))]
    moved = rollout.to(torch.float32)  # a dtype stands in for a device: Tensor.to takes either
    assert moved.replay["nested"]["latents"].dtype == torch.float32 and moved.mask.dtype == torch.float32
    assert moved.rows[0]["box"].dtype == torch.float32 and moved.rows[2]["box"].dtype == torch.float32
    assert moved.payload["pairs"][1][0] == "b" and isinstance(moved.payload["pairs"][1], tuple)
    # containers are copies: changing the moved rollout's lists leaves the original's alone
    moved.payload["completions"].append("extra")
    moved.rows[0]["digits"].append(9)
    assert len(rollout.payload["completions"]) == 4 and row["digits"] == [1, 2]
    assert rollout.rows[0]["box"].dtype == torch.float64
    # the samples of a group share their dataset row; the copy is made once and shared the same way
    assert moved.rows[0] is moved.rows[1] is moved.rows[3] and moved.rows[0] is not moved.rows[2]
