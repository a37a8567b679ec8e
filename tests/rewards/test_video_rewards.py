"""Video rewards: ``per_frame`` (an image reward on strided frames, mean or min) and ``temporal_consistency``
(1 − mean absolute change between consecutive chosen frames) against hand-computed values, their refusals, and the
remote reward carrying videos as per-frame PNGs through the reward server."""

from __future__ import annotations

import pytest
import torch

from mmrl.reward import RewardError, RewardInput, RewardScorer, build_reward, reward_functions
from mmrl.rewards.images import read_images
from mmrl.rewards.remote import RemoteReward
from mmrl.rewards.server import RewardServer, build_rewards

FAST = {"timeout": 5.0, "retries": 2, "backoff": 0.01}


def frame_brightness(batch: RewardInput, offset: float = 0.0) -> torch.Tensor:
    """Test image reward: mean 8-bit pixel / 255 of each image, plus ``offset`` for prompts with 'dog'."""
    images = read_images(batch, "images", "test_frame_brightness")
    return torch.tensor([float(image.double().mean()) / 255 + (offset if "dog" in prompt else 0.0)
                         for image, prompt in zip(images.images, batch.prompts, strict=True)], dtype=torch.float64)


reward_functions.register("test_frame_brightness", frame_brightness)


def video_batch() -> RewardInput:
    """Two 5-frame 2×2 videos whose frames are flat grey levels (exact in 8 bits: multiples of 51/255 = 0.2).

    Video 0: levels 0, 0.2, 1.0, 0.6, 0.6; video 1: 0.4 throughout except one pixel of frame 2 at 1.0.
    """
    videos = torch.zeros(2, 3, 5, 2, 2)  # [N, 3, F, H, W]
    for frame, level in enumerate((0.0, 0.2, 1.0, 0.6, 0.6)):
        videos[0, :, frame] = level
    videos[1] = 0.4
    videos[1, :, 2, 0, 0] = 1.0
    return RewardInput(rows=[{"prompt": "a cat"}, {"prompt": "a dog"}], payload={"videos": videos},
                       group_ids=torch.tensor([0, 0]))


def test_temporal_consistency_by_hand():
    batch = video_batch()
    # Video 0: changes 0.2, 0.8, 0.4, 0 → mean 0.35. Video 1: one pixel of four changes by 0.6 into frame 2 and
    # back: per pair 0, 0.15, 0.15, 0 → mean 0.075.
    scores = reward_functions.get("temporal_consistency")(batch)
    torch.testing.assert_close(scores, torch.tensor([0.65, 0.925], dtype=torch.float64), rtol=0, atol=1e-12)
    # Stride 2: frames 0, 2, 4 → video 0 changes 1.0, 0.4 → 0.3; video 1: 0.15, 0.15 → 0.85.
    strided = reward_functions.get("temporal_consistency")(batch, stride=2)
    torch.testing.assert_close(strided, torch.tensor([0.3, 0.85], dtype=torch.float64), rtol=0, atol=1e-12)
    assert reward_functions.get("temporal_consistency")(batch, stride=5).tolist() == [1.0, 1.0]  # one frame each
    as_uint8 = RewardInput(rows=batch.rows, payload={"videos": (batch.payload["videos"] * 255).round().byte()})
    assert torch.equal(reward_functions.get("temporal_consistency")(as_uint8), scores)  # the same 8-bit frames


def test_per_frame_mean_and_min_by_hand():
    batch = video_batch()
    mean = build_reward("per_frame", {"reward": "test_frame_brightness", "options": {"offset": 1.0}})(batch)
    # Video 0: (0 + 0.2 + 1 + 0.6 + 0.6) / 5 = 0.48. Video 1 ('a dog': +1 per frame): 0.4 + 0.6/4/5 + 1 = 1.43.
    torch.testing.assert_close(mean, torch.tensor([0.48, 1.43], dtype=torch.float64), rtol=0, atol=1e-12)
    worst = build_reward("per_frame", {"reward": "test_frame_brightness", "aggregate": "min", "stride": 2})(batch)
    # Frames 0, 2, 4: video 0 min(0, 1, 0.6) = 0; video 1 min(0.4, 0.55, 0.4) = 0.4.
    torch.testing.assert_close(worst, torch.tensor([0.0, 0.4], dtype=torch.float64), rtol=0, atol=1e-12)
    strided = build_reward("per_frame", {"reward": "test_frame_brightness", "stride": 2})(batch)
    torch.testing.assert_close(strided, torch.tensor([1.6 / 3, 1.35 / 3], dtype=torch.float64), rtol=0, atol=1e-12)


def test_non_finite_videos_score_nan_and_bad_payloads_are_one_line_errors():
    batch = video_batch()
    batch.payload["videos"][1, 0, 3, 1, 1] = float("nan")
    consistency = reward_functions.get("temporal_consistency")(batch)
    per_frame = build_reward("per_frame", {"reward": "test_frame_brightness"})(batch)
    for scores in (consistency, per_frame):
        assert torch.isfinite(scores[0]) and torch.isnan(scores[1])
    images = RewardInput(rows=batch.rows, payload={"videos": torch.zeros(2, 3, 4, 4)})
    with pytest.raises(RewardError, match=r"^reward 'temporal_consistency': payload\['videos'\] is a tensor of shape "
                                          r"\[2, 3, 4, 4\]; expected videos \[N, C, F, H, W\]$"):
        reward_functions.get("temporal_consistency")(images)
    with pytest.raises(RewardError, match=r"^reward 'per_frame': reward 'temporal_consistency' scores videos; name an "
                                          r"image reward$"):
        build_reward("per_frame", {"reward": "temporal_consistency"})
    with pytest.raises(RewardError, match=r"^reward 'per_frame': unknown reward 'nope'; registered: [^\n]*$"):
        build_reward("per_frame", {"reward": "nope"})


@pytest.fixture(scope="module")
def video_server():
    rewards = build_rewards({"rewards": {"functions": [
        {"name": "temporal_consistency", "args": {"stride": 2}},
        {"name": "per_frame", "args": {"reward": "jpeg_incompressibility", "aggregate": "min"}},
    ]}})
    server = RewardServer(rewards, port=0).start()
    yield server, rewards
    server.close()


@pytest.mark.parametrize("name", ["temporal_consistency", "per_frame"])
def test_remote_videos_travel_as_png_frames_and_score_as_locally(video_server, name):
    server, rewards = video_server
    generator = torch.Generator().manual_seed(0)
    videos = torch.rand(3, 3, 5, 12, 12, generator=generator)  # [N, 3, F, H, W] noise: every frame differs
    videos[1, :, 4, 0, 0] = float("nan")  # not sent; NaN locally as well
    batch = RewardInput(rows=[{"prompt": p} for p in ("a cat", "a dog", "a car")], payload={"videos": videos},
                        group_ids=torch.tensor([0, 0, 1]))
    remote = RemoteReward(url=server.url, reward=name, images=None, videos="videos", **FAST)
    local = rewards[name].instance_for()
    got, expected = remote(batch), RewardScorer([name], [local], [1.0]).raw_scores(batch)[:, 0]
    assert torch.isnan(got[1]) and torch.isnan(expected[1])
    assert torch.equal(got[[0, 2]], expected[[0, 2]])  # bitwise: the server decodes the same 8-bit frames
    assert len(set(got[[0, 2]].tolist())) == 2


def test_per_frame_options_are_checked_when_the_config_loads():
    from mmrl.config import ConfigError
    from mmrl.config.schema import bind_options

    entry = reward_functions.get("per_frame")
    with pytest.raises(ConfigError, match=r"^config key 'r.options.offset': got 'x'; allowed: [^\n]*$"):
        bind_options(entry, {"reward": "test_frame_brightness", "options": {"offset": "x"}}, "r", "reward 'per_frame'")
    with pytest.raises(ConfigError, match=r"^config key 'r.reward': got 'temporal_consistency'; allowed: an image "
                                          r"reward, one of [^\n]*$"):
        bind_options(entry, {"reward": "temporal_consistency"}, "r", "reward 'per_frame'")
    with pytest.raises(ConfigError, match=r"^config key 'r.stride': got 0; allowed: [^\n]*$"):
        bind_options(entry, {"reward": "test_frame_brightness", "stride": 0}, "r", "reward 'per_frame'")


def test_clip_temporal_consistency_is_the_mean_cosine_of_consecutive_frame_embeddings(tiny_models):
    reward = build_reward("clip_temporal_consistency", {"model": tiny_models.clip_config,
                                                        "pretrained": tiny_models.clip_weights, "batch_size": 2})
    generator = torch.Generator().manual_seed(1)
    videos = torch.rand(3, 3, 4, 16, 16, generator=generator)  # [N, 3, F, H, W]
    videos[1] = videos[1, :, :1]  # a still video
    videos[2, 0, 1, 0, 0] = float("nan")
    batch = RewardInput(rows=[{"prompt": "a cat"}] * 3, payload={"videos": videos})
    scores = reward(batch)
    # Independently: un-normalised embeddings of the 8-bit frames, cosine of each consecutive pair, their mean.
    frames = [(videos[0, :, k] * 255).round().byte() for k in range(4)]
    features = reward.clip.model.encode_image(reward.clip.pixels(frames)).double()  # [4, D]
    expected = torch.nn.functional.cosine_similarity(features[1:], features[:-1], dim=1).mean()
    torch.testing.assert_close(scores[0], expected, rtol=0, atol=1e-5)
    assert float(scores[0]) < 1 - 1e-3  # noise frames differ
    torch.testing.assert_close(scores[1], torch.tensor(1.0, dtype=torch.float64), rtol=0, atol=1e-5)
    assert torch.isnan(scores[2])
    strided = build_reward("clip_temporal_consistency", {"model": tiny_models.clip_config,
                                                         "pretrained": tiny_models.clip_weights, "stride": 4})
    assert strided(batch)[0] == 1.0  # one frame chosen
