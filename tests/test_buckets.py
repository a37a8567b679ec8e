"""Rows that cannot share a batch (``Plugin.row_buckets``): the bucketed prompt stream, the trainer's steps and
evaluation over buckets, and the refusals (dynamic sampling, a changed layout at a resume, a malformed hook)."""

from __future__ import annotations

import itertools
import json

import pytest

from mmrl.config import ConfigError
from mmrl.plugin import plugin_registry
from mmrl.plugins.toy.plugin import ToyPlugin
from mmrl.rollout import RolloutError
from mmrl.testing import PROPERTIES, ConformanceError, check_plugin
from mmrl.trainer import Trainer
from mmrl.trainer.checkpoint import CheckpointError
from mmrl.trainer.sampler import PromptStream
from tests.helpers import BucketToy, toy_config

# 14 rows in three buckets, interleaved: a has 7 rows, b 2 (fewer than a chunk of 3), c 5.
KEYS = ["a", "c", "a", "b", "a", "c", "a", "c", "a", "b", "a", "c", "a", "c"]
ROWS = {key: [i for i, k in enumerate(KEYS) if k == key] for key in "abc"}


def _stream(seed=0, shuffle=True, keys=KEYS, prompts=3):
    return PromptStream(len(keys), seed, shuffle, buckets=keys, batch_prompts=prompts)


def _takes(stream, count):
    return [stream.take(stream.batch_prompts) for _ in range(count)]


# ------------------------------------------------------------------------------------------------ the stream
def test_every_take_is_one_bucket_and_an_epoch_covers_every_row():
    stream = _stream()
    assert stream.bucketed and stream.epoch_length == 3 * (3 + 1 + 2)  # ceil(7/3) + ceil(2/3) + ceil(5/3) chunks
    for epoch in range(3):
        chunks = [indices for indices, _ in _takes(stream, 6)]
        assert all(len({KEYS[i] for i in chunk}) == 1 for chunk in chunks), chunks
        assert {i for chunk in chunks for i in chunk} == set(range(len(KEYS))), epoch  # no row dropped
        assert sorted(KEYS[chunk[0]] for chunk in chunks) == ["a", "a", "a", "b", "c", "c"]
        assert stream.epoch == epoch + 1


def test_a_small_bucket_repeats_its_own_rows_and_a_partial_chunk_cycles_from_its_bucket_start():
    stream = _stream(shuffle=False)  # rows in dataset order, chunks in order of first appearance (a, c, b)
    a, b, c = ROWS["a"], ROWS["b"], ROWS["c"]
    expected = [a[0:3], a[3:6], [a[6], a[0], a[1]], c[0:3], [c[3], c[4], c[0]], [b[0], b[1], b[0]]]
    assert [indices for indices, _ in _takes(stream, 6)] == expected
    assert [indices for indices, _ in _takes(stream, 6)] == expected  # the next epoch, the same without shuffle
    shuffled = [indices for indices, _ in _takes(_stream(seed=4), 6)]
    small = [chunk for chunk in shuffled if KEYS[chunk[0]] == "b"]
    assert len(small) == 1 and sorted(set(small[0])) == b and len(small[0]) == 3


def test_positions_are_unique_stream_positions():
    positions = [p for _, chunk in _takes(_stream(), 13) for p in chunk]
    assert positions == list(range(39))


def test_the_bucketed_stream_is_deterministic_and_moves_with_the_seed_and_the_epoch():
    first, again, other = (_takes(_stream(seed), 12) for seed in (7, 7, 8))
    assert first == again
    assert first != other
    assert first[:6] != first[6:]  # epoch 1 is drawn anew


def test_a_take_of_another_size_and_a_malformed_layout_are_refused():
    with pytest.raises(ValueError, match="batch_prompts=3 prompts, not 4"):
        _stream().take(4)
    with pytest.raises(ValueError, match="needs batch_prompts"):
        PromptStream(len(KEYS), 0, buckets=KEYS)
    with pytest.raises(ValueError, match="13 keys for a dataset of 14"):
        PromptStream(len(KEYS), 0, buckets=KEYS[:-1], batch_prompts=3)


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_single_bucket_is_the_plain_stream(shuffle):
    plain = PromptStream(10, seed=3, shuffle=shuffle)
    single = PromptStream(10, seed=3, shuffle=shuffle, buckets=["x"] * 10, batch_prompts=4)
    assert not single.bucketed
    assert [single.take(n) for n in (4, 4, 3, 7)] == [plain.take(n) for n in (4, 4, 3, 7)]
    assert single.state_dict() == plain.state_dict() and "epoch_length" not in single.state_dict()


def test_the_state_resumes_exactly_and_a_changed_layout_is_refused():
    original = _stream(seed=2)
    _takes(original, 8)  # into the second epoch
    state = original.state_dict()
    assert state == {"consumed": 24, "dataset_size": 14, "seed": 2, "epoch_length": 18}
    resumed = _stream(seed=2)
    resumed.load_state_dict(state)
    assert _takes(resumed, 9) == _takes(original, 9)

    moved = ["a" if key == "b" else key for key in KEYS]  # b's rows join a: 3 + 2 chunks, not 6
    with pytest.raises(ValueError, match=r"epochs of 18 prompts \(in buckets\), but this run's are 15 prompts"):
        _stream(seed=2, keys=moved).load_state_dict(state)
    with pytest.raises(ValueError, match="no buckets"):  # a bucketed state into a plain stream, and back
        PromptStream(len(KEYS), 2).load_state_dict(state)
    with pytest.raises(ValueError, match="no buckets"):
        _stream(seed=2).load_state_dict(PromptStream(len(KEYS), 2).state_dict())


# ------------------------------------------------------------------------------------------------ the trainer
class OneBucketToy(ToyPlugin):
    name = "one_bucket_toy"

    def row_buckets(self, split):
        return ["only"] * len(self.dataset(split))


class ShortBucketsToy(ToyPlugin):
    name = "short_buckets_toy"

    def row_buckets(self, split):
        return ["x"] * (len(self.dataset(split)) - 1)


class NumberBucketsToy(ToyPlugin):
    name = "number_buckets_toy"

    def row_buckets(self, split):
        return [index % 2 for index in range(len(self.dataset(split)))]


@pytest.fixture
def registered(monkeypatch):
    plugin_registry.names()  # the entry points are read before the test entries are added
    for cls in (BucketToy, OneBucketToy, ShortBucketsToy, NumberBucketsToy):
        monkeypatch.setitem(plugin_registry._entries, cls.name, cls)


# Prompts of lengths 3 to 5: three buckets of roughly a third of the rows each.
LENGTHS = ("plugin.min_length=3", "plugin.max_length=5")


def test_training_steps_draw_one_bucket_and_the_evaluation_samples_each_bucket_apart(tmp_path, registered):
    config = toy_config(tmp_path, "plugin.name=bucket_toy", *LENGTHS, "run.max_steps=3", "rollout.batch_size=8",
                        "eval.at_start=false", "eval.num_prompts=12", "eval.samples_per_prompt=2")
    trainer = Trainer(config)
    result = trainer.train()
    assert result.step == 3 and trainer.stream.bucketed
    training = [key for is_training, key in trainer.plugin.calls if is_training]
    assert len(training) == 3 * 32 // 8  # 32 samples per step in rollout calls of 8, none of them mixed

    rows = trainer.eval_rows[:12]
    keys = [f"len{len(row['digits'])}" for row in rows]
    assert len(set(keys)) == 3  # the evaluated prompts do span the buckets
    evaluation = [key for is_training, key in trainer.plugin.calls if not is_training]
    # Each bucket's samples in calls of their own (rollout.batch_size=8 cuts a bucket's 10 samples in two), buckets
    # in order of first appearance.
    assert [key for key, _ in itertools.groupby(evaluation)] == list(dict.fromkeys(keys))
    assert result.evaluations[3]["eval/samples"] == 24.0

    folder = tmp_path / "samples" / "step_000003"
    assert sorted(path.name for path in folder.iterdir()) == [f"eval_{key}.jsonl" for key in sorted(set(keys))]
    found = []
    for key in set(keys):
        records = [json.loads(line) for line in (folder / f"eval_{key}.jsonl").read_text().splitlines()]
        assert all(f"len{len(record['prompt'].split())}" == key for record in records)
        found += [record["prompt"] for record in records]
    assert sorted(found) == sorted(row["prompt"] for row in rows for _ in range(2))  # every sample, once


def test_a_process_whose_samples_share_one_bucket_still_names_them_by_bucket(tmp_path, registered):
    # the file names follow the evaluated prompts' buckets, not how they were dealt out to the processes
    trainer = Trainer(toy_config(tmp_path, "plugin.name=bucket_toy", *LENGTHS, "eval.num_prompts=12",
                                 "eval.samples_per_prompt=2"))
    one = [k for k in range(24) if trainer.eval_buckets[k // 2] == trainer.eval_buckets[0]]
    assert trainer._evaluation_pieces(one) == [(trainer.eval_buckets[0], one)]
    pieces = trainer._evaluation_pieces(list(range(24)))
    assert [key for key, _ in pieces] == list(dict.fromkeys(trainer.eval_buckets))
    assert sorted(k for _, samples in pieces for k in samples) == list(range(24))


def test_dynamic_sampling_over_several_buckets_is_refused(tmp_path, registered):
    config = toy_config(tmp_path, "plugin.name=bucket_toy", *LENGTHS, "rollout.dynamic_sampling.enabled=true")
    with pytest.raises(ConfigError) as raised:
        Trainer(config)
    message = str(raised.value)
    assert raised.value.key == "rollout.dynamic_sampling.enabled" and "\n" not in message
    assert "plugin bucket_toy's training rows fall in several buckets" in message
    assert all(key in message for key in ("len3", "len4", "len5"))


def test_one_bucket_trains_and_names_its_samples_as_without_buckets(tmp_path, registered):
    config = toy_config(tmp_path, "plugin.name=one_bucket_toy", "run.max_steps=1", "eval.at_start=false",
                        "rollout.dynamic_sampling.enabled=true")  # allowed: one bucket is no constraint
    trainer = Trainer(config)
    trainer.train()
    assert not trainer.stream.bucketed and "epoch_length" not in trainer.stream.state_dict()
    assert sorted(path.name for path in (tmp_path / "samples" / "step_000001").iterdir()) == ["eval.jsonl"]


def test_a_resume_whose_buckets_changed_is_refused_in_one_line(tmp_path, registered):
    common = ("run.max_steps=1", "eval.at_start=false", "run.save_every=1")
    Trainer(toy_config(tmp_path, "plugin.name=bucket_toy", *LENGTHS, *common)).train()
    resumed = Trainer(toy_config(tmp_path, "plugin.name=bucket_toy", *LENGTHS, *common, "run.max_steps=2",
                                 "run.resume=latest"))
    resumed.stream = PromptStream(len(resumed.train_rows), 0)  # the same rows, no longer bucketed
    with pytest.raises(CheckpointError, match="no buckets") as raised:
        resumed.restore_checkpoint()
    assert "\n" not in str(raised.value)


def test_malformed_row_buckets_are_refused_naming_the_plugin(tmp_path, registered):
    with pytest.raises(RolloutError, match=r"plugin 'short_buckets_toy'.s row_buckets\('train'\) returned 511 keys; "
                                           r"allowed: None or a list of 512 strings"):
        Trainer(toy_config(tmp_path, "plugin.name=short_buckets_toy"))
    with pytest.raises(RolloutError, match=r"returned a key that is not a string \(row 0: 0\); allowed"):
        Trainer(toy_config(tmp_path, "plugin.name=number_buckets_toy"))


# ------------------------------------------------------------------------------------------------ the kit
TINY = {"train_size": 8, "eval_size": 4, "min_length": 3, "max_length": 5, "hidden_size": 8}


def test_the_conformance_kit_checks_row_buckets(tmp_path):
    assert "row buckets" in check_plugin(BucketToy, TINY, directory=tmp_path / "good")
    assert PROPERTIES.index("row buckets") == PROPERTIES.index("datasets") + 1
    with pytest.raises(ConformanceError, match=r"fails 'row buckets': row_buckets\('train'\) returned 7 keys for "
                                               r"the 8 rows"):
        check_plugin(ShortBucketsToy, TINY, directory=tmp_path / "short")
