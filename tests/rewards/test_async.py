"""Asynchronous scoring: RewardScorer.submit gives exactly score()'s results, overlaps with the caller, and stops."""

from __future__ import annotations

import threading

import pytest
import torch

from mmrl.config import ConfigError, RewardsConfig, from_dict, load_config
from mmrl.reward import RewardError, RewardInput, RewardScorer, ScoredBatch, build_reward
from tests.helpers import BASE

from .conftest import random_images


def batches(count: int, n: int = 6) -> list[RewardInput]:
    result = []
    for k in range(count):
        images = random_images(n, seed=100 + k)
        result.append(RewardInput(rows=[{"prompt": ["a cat", "a dog", "a car"][i % 3]} for i in range(n)],
                                  payload={"images": images}, group_ids=torch.arange(n) // 3))
    return result


def image_scorer(tiny_models, num_workers: int = 2, on_nonfinite: str = "error") -> RewardScorer:
    names = ["clip_score", "jpeg_compressibility", "pref_winrate"]
    args = [{"model": tiny_models.clip_config, "pretrained": tiny_models.clip_weights}, {},
            {"judge_args": {"reward": "jpeg_incompressibility"}}]
    functions = [build_reward(name, a) for name, a in zip(names, args, strict=True)]
    return RewardScorer(names, functions, [1.0, 0.5, 1.0], on_nonfinite, num_workers=num_workers)


def test_async_scores_are_bitwise_identical_to_sync(tiny_models):
    work = batches(5)
    with image_scorer(tiny_models, num_workers=3) as scorer:
        futures = [scorer.submit(batch) for batch in work]  # several in flight at once
        asynchronous = [future.result(timeout=60) for future in futures]
        synchronous = [scorer.score(batch) for batch in work]
    for a, s in zip(asynchronous, synchronous, strict=True):
        assert torch.equal(a.scores, s.scores) and torch.equal(a.valid, s.valid)
        assert a.scores.dtype == torch.float32 and a.scores.shape == (6, 3)
    joined = ScoredBatch.concat(asynchronous)
    assert torch.equal(joined.scores, torch.cat([s.scores for s in synchronous]))


def test_async_applies_the_same_nonfinite_policy(tiny_models):
    batch = batches(1)[0]
    batch.payload["images"][2] = float("nan")
    with image_scorer(tiny_models, on_nonfinite="error") as strict:
        with pytest.raises(RewardError) as sync_error:
            strict.score(batch)
        with pytest.raises(RewardError) as async_error:
            strict.submit(batch).result(timeout=60)
    assert str(async_error.value) == str(sync_error.value)
    assert "reward 'clip_score' returned NaN or infinite scores for samples [2]" in str(async_error.value)
    with image_scorer(tiny_models, on_nonfinite="skip") as lenient:
        got, expected = lenient.submit(batch).result(timeout=60), lenient.score(batch)
    assert torch.equal(got.scores, expected.scores) and got.valid.tolist() == [True, True, False, True, True, True]


def test_scoring_overlaps_with_the_caller():
    """The reward waits for the caller's "rollout" to start: only a truly asynchronous submit can finish."""
    rollout_started = threading.Event()
    reward_running = threading.Event()

    def waiting_reward(batch: RewardInput) -> list[float]:
        reward_running.set()
        assert rollout_started.wait(timeout=10), "submit() ran the reward in the caller's thread"
        return [1.0] * len(batch)

    scorer = RewardScorer(["wait"], [waiting_reward], [1.0], num_workers=1)
    future = scorer.submit(RewardInput(rows=[{}] * 3, payload={}))
    assert reward_running.wait(timeout=10)  # the reward runs while the caller goes on...
    rollout_started.set()  # ...e.g. sampling the next chunk
    assert future.result(timeout=10).scores[:, 0].tolist() == [1.0, 1.0, 1.0]
    scorer.close()


def test_close_is_idempotent_and_refuses_new_work():
    scorer = RewardScorer(["one"], [lambda batch: [1.0] * len(batch)], [1.0])
    assert scorer.submit(RewardInput(rows=[{}], payload={})).result(timeout=10).scores.tolist() == [[1.0]]
    scorer.close()
    scorer.close()
    with pytest.raises(RewardError, match="submit called after close"):
        scorer.submit(RewardInput(rows=[{}], payload={}))
    assert scorer.score(RewardInput(rows=[{}], payload={})).scores.tolist() == [[1.0]]  # sync still works
    with pytest.raises(RewardError, match="num_workers must be >= 1"):
        RewardScorer(["one"], [lambda batch: [1.0]], [1.0], num_workers=0)


def test_async_config_fields():
    config = load_config({**BASE, "rewards": {"functions": [{"name": "jpeg_compressibility"}],
                                             "async_scoring": True, "num_workers": 4}})
    assert config.rewards.async_scoring is True and config.rewards.num_workers == 4
    scorer = RewardScorer.from_config(config.rewards)
    assert scorer.num_workers == 4
    defaults = from_dict(RewardsConfig, {"functions": [{"name": "exact_match"}]}, "rewards")
    assert defaults.async_scoring is False and defaults.num_workers == 2
    with pytest.raises(ConfigError, match=r"rewards\.num_workers.*>= 1"):
        load_config({**BASE, "rewards": {"functions": [{"name": "exact_match"}], "num_workers": 0}})
    with pytest.raises(ConfigError, match=r"rewards\.async_scoring.*true or false"):
        load_config({**BASE, "rewards": {"functions": [{"name": "exact_match"}], "async_scoring": "maybe"}})
