"""Video rewards: an image reward applied to frames and aggregated (``per_frame``) and the frame-to-frame similarity
of a video, of its pixels (``temporal_consistency``) or of their CLIP image embeddings
(``clip_temporal_consistency``).

``payload["videos"]`` (or the entry a reward's ``output`` option names) is a tensor ``[N, C, F, H, W]`` (channels
first, frames second, as the flow plugin's video adapters decode), floating point in [0, 1] or uint8 in [0, 255],
or a list of N per-sample tensors ``[C, F, H, W]`` (the samples may differ in size). Every frame is converted to
8-bit RGB exactly as image rewards convert images (:mod:`mmrl.rewards.images`), so a video scores the same locally
and through the remote reward, which sends each frame as a PNG.

A video with a non-finite pixel is malformed model output: it scores NaN (``rewards.on_nonfinite`` decides).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
from torch import Tensor

from mmrl.registry import Range
from mmrl.reward import Reward, RewardError, RewardInput, build_reward, reward_functions
from mmrl.rewards.images import to_image_batch

Stride = Annotated[int, Range(1)]
BatchSize = Annotated[int, Range(1)]
VIDEO_REWARDS = ("per_frame", "temporal_consistency", "clip_temporal_consistency")
"""The rewards of this module: they read videos, so ``per_frame`` cannot wrap them."""


@dataclass
class VideoBatch:
    """The videos of a batch as 8-bit RGB frames.

    Attributes:
        videos: One uint8 tensor ``[3, F, H, W]`` per sample (zeros where a frame was not finite).
        finite: ``[N]`` bool (CPU), False for videos with a non-finite pixel in any frame.
    """

    videos: list[Tensor]
    finite: Tensor

    def __len__(self) -> int:
        return len(self.videos)


def read_videos(batch: RewardInput, output: str = "videos", reward: str = "video reward") -> VideoBatch:
    """The videos ``batch.payload[output]`` as a :class:`VideoBatch`; a one-line RewardError if unusable."""
    where = f"reward {reward!r}: payload[{output!r}]"
    value = batch.output(output)
    if isinstance(value, Tensor):
        if value.dim() != 5:
            raise RewardError(f"{where} is a tensor of shape {list(value.shape)}; expected videos [N, C, F, H, W]")
        samples = list(value.unbind(0))
    elif isinstance(value, (list, tuple)) and all(isinstance(item, Tensor) and item.dim() == 4 for item in value):
        samples = list(value)
    else:
        raise RewardError(f"{where} is a {type(value).__name__}; expected a tensor [N, C, F, H, W] or a list of "
                          "tensors [C, F, H, W]")
    if len(samples) != len(batch):
        raise RewardError(f"{where} holds {len(samples)} videos for {len(batch)} samples")
    videos, finite = [], []
    for index, sample in enumerate(samples):
        if sample.shape[1] == 0:
            raise RewardError(f"{where} video {index} has no frames")
        frames = to_image_batch(sample.transpose(0, 1), where=f"{where} video {index}")  # F frames [C, H, W]
        videos.append(torch.stack(frames.images, dim=1))  # [3, F, H, W] uint8
        finite.append(bool(frames.finite.all()))
    return VideoBatch(videos=videos, finite=torch.tensor(finite, dtype=torch.bool))


def check_stride(reward: str, stride: int) -> None:
    """One-line RewardError unless ``stride`` is an integer >= 1 (``range`` would raise on 0 and choose no frame for a
    negative stride), for callers that build the reward in Python rather than from a checked config."""
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise RewardError(f"reward {reward!r}: stride must be an integer >= 1, got {stride!r}")


def frame_indices(count: int, stride: int) -> list[int]:
    """Frames 0, stride, 2·stride, ... of a ``count``-frame video."""
    return list(range(0, count, stride))


class PerFrameReward(Reward):
    """An image reward applied to frames of each video, the frame scores aggregated into one score per video."""

    def __init__(self, *, reward: str, options: dict[str, Any] | None = None, stride: Stride = 1,
                 aggregate: Literal["mean", "min"] = "mean", output: str = "videos"):
        """Options (the config's ``args``).

        Args:
            reward: The registered image reward scored on each chosen frame (e.g. pickscore, aesthetic); it reads
                the frames as ``payload["images"]`` (``[N, C, H, W]`` slices of the videos, in their dtype and
                range), with the other payload entries and the rows as they are.
            options: That reward's options (its ``args``).
            stride: Score frames 0, stride, 2·stride, ... (1: every frame).
            aggregate: How frame scores become the video's score: their mean, or their minimum (the worst frame).
            output: Payload entry holding the videos.
        """
        check_stride("per_frame", stride)
        if reward in VIDEO_REWARDS:
            raise RewardError(f"reward 'per_frame': reward {reward!r} scores videos; name an image reward")
        if reward not in reward_functions:
            raise RewardError(f"reward 'per_frame': unknown reward {reward!r}; registered: "
                              f"{', '.join(reward_functions.names())}")
        inner_options = dict(options or {})
        if inner_options.get("output", "images") != "images":
            raise RewardError("reward 'per_frame': the frames are given to the image reward as payload['images']; "
                              f"remove output: {inner_options['output']!r} from its options")
        self.name = reward
        self.inner = build_reward(reward, inner_options)
        self.groupwise = bool(getattr(self.inner, "groupwise", False))
        self.stride, self.aggregate, self.output = stride, aggregate, output

    @classmethod
    def bind_nested_options(cls, options: dict[str, Any], key: str) -> dict[str, Any]:
        """Check ``options`` against the named image reward's options when the config loads (called by
        ``bind_options``), so that a bad option stops the run before any model loads."""
        from mmrl.rewards.wrapped import bind_wrapped_options

        return bind_wrapped_options(options, key, excluded=VIDEO_REWARDS, kind="an image reward")

    def __call__(self, batch: RewardInput) -> Tensor:
        n = len(batch)
        if n == 0:
            return torch.zeros(0, dtype=torch.float64)
        videos = read_videos(batch, self.output, "per_frame")
        counts = {video.shape[1] for video in videos.videos}
        if len(counts) != 1:
            raise RewardError(f"reward 'per_frame': payload[{self.output!r}] holds videos of {sorted(counts)} frames; "
                              "per-frame scores need one frame count per batch")
        raw = batch.output(self.output)  # the frames go to the image reward as the plugin made them (float or uint8)
        columns = []
        for frame in frame_indices(counts.pop(), self.stride):
            images = raw[:, :, frame] if isinstance(raw, Tensor) else [video[:, frame] for video in raw]
            payload = {**batch.payload, "images": images}  # [N, C, H, W], or N tensors [C, H, W]
            scores = self.inner(RewardInput(rows=batch.rows, payload=payload, group_ids=batch.group_ids))
            scores = torch.as_tensor(scores, dtype=torch.float64).reshape(-1).cpu()
            if scores.shape[0] != n:
                raise RewardError(f"reward 'per_frame': {self.name!r} returned {scores.shape[0]} scores for {n} frames")
            columns.append(scores)
        table = torch.stack(columns, dim=1)  # [N, K] frame scores; NaN propagates through both aggregates
        scores = table.mean(dim=1) if self.aggregate == "mean" else table.amin(dim=1)
        return torch.where(videos.finite, scores, torch.full_like(scores, float("nan")))


def temporal_consistency(batch: RewardInput, stride: Stride = 1, output: str = "videos") -> Tensor:
    """Mean similarity of consecutive chosen frames: 1 − mean |x_k − x_{k+1}| over the 8-bit pixels (scaled to
    [0, 1]) of frames 0, stride, 2·stride, ...; 1 for a still video, 0 when every pixel flips between black and
    white. A one-frame video (or one frame chosen) scores 1.

    Args:
        stride: Compare frames stride apart (1: neighbouring frames).
        output: Payload entry holding the videos.
    """
    check_stride("temporal_consistency", stride)
    videos = read_videos(batch, output, "temporal_consistency")
    scores = torch.full((len(videos),), float("nan"), dtype=torch.float64)
    for index, video in enumerate(videos.videos):
        if not bool(videos.finite[index]):
            continue
        frames = video[:, frame_indices(video.shape[1], stride)].double() / 255  # [3, K, H, W]
        if frames.shape[1] < 2:
            scores[index] = 1.0
            continue
        change = (frames[:, 1:] - frames[:, :-1]).abs().mean(dim=(0, 2, 3))  # [K - 1] per consecutive pair
        scores[index] = 1.0 - float(change.mean())
    return scores


class ClipTemporalConsistency(Reward):
    """Mean cosine similarity of the CLIP image embeddings of consecutive chosen frames: near 1 when the content stays
    the same, lower when it changes; insensitive to small pixel shifts that move the pixel score."""

    name = "clip_temporal_consistency"

    def __init__(self, model: str = "ViT-B-32", pretrained: str | None = "openai", stride: Stride = 1,
                 output: str = "videos", batch_size: BatchSize = 32, device: str | None = None):
        """Options (the config's ``args``).

        Args:
            model: open_clip architecture of the image encoder, or a path to a model-config JSON.
            pretrained: open_clip pretrained tag (openai), a local checkpoint file or hf-hub:ORG/REPO/FILE.
            stride: Compare frames stride apart (1: neighbouring frames).
            output: Payload entry holding the videos.
            batch_size: Frames per forward pass.
            device: Where the model runs (null: cuda when available, else cpu).
        """
        from mmrl.rewards.image_models import OpenClip, _check_positive, pick_device

        check_stride(self.name, stride)  # both checked before a model is loaded
        _check_positive(self.name, batch_size=batch_size)
        self.clip = OpenClip(self.name, model, pretrained, pick_device(self.name, device))
        self.stride, self.output, self.batch_size = stride, output, batch_size

    @torch.no_grad()
    def __call__(self, batch: RewardInput) -> Tensor:
        videos = read_videos(batch, self.output, self.name)
        scores = torch.full((len(videos),), float("nan"), dtype=torch.float64)
        for index, video in enumerate(videos.videos):
            if not bool(videos.finite[index]):
                continue
            frames = [video[:, k] for k in frame_indices(video.shape[1], self.stride)]  # uint8 [3, H, W] each
            if len(frames) < 2:
                scores[index] = 1.0
                continue
            embeddings = torch.cat([self.clip.image_features(frames[start:start + self.batch_size])
                                    for start in range(0, len(frames), self.batch_size)])  # [K, D], unit norm
            scores[index] = float((embeddings[1:] * embeddings[:-1]).sum(dim=1).double().mean())
        return scores

