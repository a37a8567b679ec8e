"""A reward that fails is named in one line, with the sample (or group) that makes it fail."""

from types import SimpleNamespace

import pytest
import torch

from mmrl.config import ConfigError
from mmrl.reward import Reward, RewardError, RewardInput, RewardScorer, reward_functions


def _batch(prompts, group_ids=None):
    return RewardInput(
        rows=[{"prompt": p} for p in prompts],
        payload={"completions": [p[::-1] for p in prompts]},
        group_ids=torch.tensor(group_ids if group_ids is not None else range(len(prompts))),
    )


def _divides_by_prompt_length_minus_three(batch):
    return [1.0 / (len(p) - 3) for p in batch.prompts]  # a user bug: ZeroDivisionError on 3-character prompts


def _needs_batches_of_at_most_two(batch):
    if len(batch) > 2:
        raise MemoryError("out of memory")
    return [0.0] * len(batch)


def _reads_a_missing_column(batch):
    return [float(v == "x") for v in batch.column("solution")]


def _already_named(batch):
    raise RewardError("reward 'named': the server said no")


class _GroupwiseFailsOnGroupSeven(Reward):
    groupwise = True

    def __call__(self, batch):
        if 7 in batch.group_ids.tolist():
            raise KeyError("judge")
        return [0.5] * len(batch)


def _score(name, fn, batch):
    return RewardScorer([name], [fn], [1.0]).score(batch)


def test_a_reward_that_raises_is_named_with_the_first_sample_that_fails_alone():
    batch = _batch(["abcd", "abcde", "abc", "xyz", "abcdef"])  # samples 2 and 3 have 3 characters
    with pytest.raises(RewardError) as info:
        _score("my_reward", _divides_by_prompt_length_minus_three, batch)
    message = str(info.value)
    assert message == ("reward 'my_reward' raised ZeroDivisionError: float division by zero on sample 2 of 5 "
                       "(prompt 'abc')")
    assert isinstance(info.value.__cause__, ZeroDivisionError)  # the original traceback stays reachable


def test_a_failure_no_single_sample_reproduces_names_the_batch():
    with pytest.raises(RewardError) as info:
        _score("batchy", _needs_batches_of_at_most_two, _batch(["a", "b", "c"]))
    assert str(info.value) == ("reward 'batchy' raised MemoryError: out of memory on a batch of 3 samples "
                               "(no sample fails on its own)")


def test_the_reported_error_is_the_batch_error_even_when_the_sample_fails_differently_alone():
    def fails(batch):
        if "bad" in batch.prompts:
            raise (ValueError("in a batch") if len(batch) > 1 else TypeError("alone"))
        return [0.0] * len(batch)

    with pytest.raises(RewardError) as info:
        _score("picky", fails, _batch(["a", "bad", "c"]))
    assert str(info.value) == "reward 'picky' raised ValueError: in a batch on sample 1 of 3 (prompt 'bad')"


def test_a_long_prompt_and_a_multi_line_message_stay_on_one_line():
    def raises_multi_line(batch):
        raise ValueError("first line\nsecond   line")

    with pytest.raises(RewardError) as info:
        _score("wordy", raises_multi_line, _batch(["p" * 100]))
    assert str(info.value) == (f"reward 'wordy' raised ValueError: first line second line on sample 0 of 1 "
                               f"(prompt '{'p' * 57}...')")


def test_a_groupwise_reward_is_named_with_the_group():
    batch = _batch(["a", "b", "c", "d"], group_ids=[3, 3, 7, 7])
    with pytest.raises(RewardError) as info:
        _score("judge", _GroupwiseFailsOnGroupSeven(), batch)
    assert str(info.value) == "reward 'judge' raised KeyError: 'judge' on group 7 (samples [2, 3])"


def test_a_reward_error_raised_by_the_reward_gets_its_name_once():
    with pytest.raises(RewardError) as info:
        _score("exact", _reads_a_missing_column, _batch(["a", "b"]))
    assert str(info.value) == ("reward 'exact': dataset rows [0, 1] have no 'solution' field, which this reward "
                               "reads")
    with pytest.raises(RewardError) as info:
        _score("named", _already_named, _batch(["a"]))
    assert str(info.value) == "reward 'named': the server said no"


class _NeedsWeights(Reward):
    def __init__(self, path: str = "weights.pt"):
        raise FileNotFoundError(f"[Errno 2] No such file or directory: {path!r}")


class _RefusesItsOptions(Reward):
    def __init__(self, size: int = 1):
        raise RewardError(f"size must be even, got {size}")


class _ConfigErrorInConstructor(Reward):
    def __init__(self):
        raise ConfigError("rewards.functions[0].args", {}, "something else")


reward_functions.register("test_needs_weights", _NeedsWeights)
reward_functions.register("test_refuses_its_options", _RefusesItsOptions)
reward_functions.register("test_config_error_in_constructor", _ConfigErrorInConstructor)


def _config(name, args=None):
    spec = SimpleNamespace(name=name, args=args or {}, weight=1.0)
    return SimpleNamespace(functions=[spec], on_nonfinite="error", num_workers=1)


def test_a_reward_that_cannot_be_built_is_named():
    with pytest.raises(RewardError) as info:
        RewardScorer.from_config(_config("test_needs_weights", {"path": "w.pt"}))
    assert str(info.value) == ("reward 'test_needs_weights' could not be built: FileNotFoundError: [Errno 2] No such "
                               "file or directory: 'w.pt'")
    with pytest.raises(RewardError) as info:
        RewardScorer.from_config(_config("test_refuses_its_options", {"size": 3}))
    assert str(info.value) == "reward 'test_refuses_its_options': size must be even, got 3"
    with pytest.raises(ConfigError):  # config errors keep their own one-line form (and exit code 2)
        RewardScorer.from_config(_config("test_config_error_in_constructor"))


def test_nonfinite_scores_are_counted_per_reward():
    def half_nan(batch):
        return [float("nan") if i % 2 else 1.0 for i in range(len(batch))]

    def fine(batch):
        return [1.0] * len(batch)

    scorer = RewardScorer(["half_nan", "fine"], [half_nan, fine], [1.0, 1.0], on_nonfinite="skip")
    scorer.score(_batch(["a", "b", "c", "d", "e"]))
    scorer.score(_batch(["a", "b"]))
    assert scorer.nonfinite_counts == {"half_nan": 3, "fine": 0}


def test_asynchronous_scoring_raises_the_same_line():
    batch = _batch(["abcd", "abc"])
    with RewardScorer(["my_reward"], [_divides_by_prompt_length_minus_three], [1.0], num_workers=2) as scorer:
        with pytest.raises(RewardError) as info:
            scorer.submit(batch).result()
    assert str(info.value) == ("reward 'my_reward' raised ZeroDivisionError: float division by zero on sample 1 of 2 "
                               "(prompt 'abc')")
