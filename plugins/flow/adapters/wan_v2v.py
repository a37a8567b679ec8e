"""Wan video-to-video (``WanVideoToVideoPipeline``, SDEdit form): every sample starts from an input video's latents
noised to a σ part-way down the grid and is denoised from there over the rest of it. The model is Wan text-to-video
itself (Wan: Open and Advanced Large-Scale Video Generative Models, arXiv:2503.20314): a V2V checkpoint is a plain
Wan T2V checkpoint (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, Wan2.1-T2V-14B-Diffusers), so the adapter is used by name
(``plugin.adapter: wan_v2v``), or found by ``adapter: auto`` in a folder saved from a ``WanVideoToVideoPipeline``.

What the adapter reproduces from ``WanVideoToVideoPipeline.__call__`` (diffusers 0.42,
``pipelines/wan/pipeline_wan_video2video.py``) besides Wan's prompts, guidance and decode
(:class:`~mmrl.plugins.flow.adapters.wan.WanAdapter`):

- the grid (``retrieve_timesteps`` then ``get_timesteps``): the scheduler's grid of N = ``num_inference_steps`` steps,
  of which the last ``int(N · strength)`` are run (``t_start = N − int(N · strength)``; strength 1 runs them all). In
  mmrl ``plugin.num_steps`` (and ``eval_num_steps``) counts the steps **run**, R: the σ grid is the tail of the
  pipeline's grid of the smallest N with ``int(N · strength) = R`` (R = 8 with strength 0.8: N = 10, the pipeline's
  ``num_inference_steps=10, strength=0.8``), :meth:`WanVideoToVideoAdapter.full_steps`. So everything that indexes
  steps (``timestep_fraction``, the random and window selections, ``window_range``, every credit strategy's steps)
  indexes the R steps actually run, and its ``sigmas [R+1]``, ``timesteps [R]`` are what :meth:`schedule` returns.
- the start (``prepare_latents``): the input video resized to the run's size by the pipeline's video processor
  (``preprocess_video``), encoded by the VAE one video at a time with the posterior's mode (``sample_mode="argmax"``:
  deterministic), normalised (x − mean)/std in float32; noise ε ``[C, F_lat, h, w]`` per sample, drawn from the
  sample's generator as the pipeline draws it; x = σ₀·ε + (1 − σ₀)·x₀ with σ₀ the first σ of the tail
  (``FlowMatchEulerDiscreteScheduler.scale_noise`` at the first kept timestep). The noise is the initial state, not
  an action: the SDE runs and the log-probs count the R denoising steps after it (:meth:`initial_latents`, a hook of
  every adapter that returns the noise itself elsewhere).
- the transformer and the steps: Wan text-to-video's call on the noisy latents alone (the input video enters only
  through the start, unlike image-to-video's concatenated condition), the raw timestep, the flow-shifted Euler grid
  in place of the UniPC solver Wan ships (as the ``wan`` adapter; the equality test swaps it the same way).
- ``strength`` is ``plugin.adapter_options: {strength: s}``, s in (0, 1], default 0.8 (the pipeline's).

Rows: ``{"prompt": ..., "video": "clips/0001.mp4"}`` (a video file, read with PyAV) or ``"video": ["clips/0001/
00.png", ...]`` (its frames as image files, in order); relative paths are read from the prompt file's folder. The
first ``plugin.num_frames`` frames are used (the pipeline uses every frame it is given and sets the frame count from
them; a batch of rows needs one count), each resized to ``height`` × ``width``; a row without a video, or with fewer
frames, is refused in one line. The payload carries each row's input video as the model saw it,
``payload["condition_videos"]`` ``[n, 3, F, H, W]`` in [0, 1], for rewards that compare with it.

Flow-Factory trains Wan video-to-video the same SDEdit way (X-GenGroup/Flow-Factory@a0b2bc5,
``src/flow_factory/models/wan/wan2_v2v.py``: the pipeline's ``get_timesteps`` and ``prepare_latents``, the trajectory
and its log-probs over the steps run; dataset rows ``{"prompt", "video"}``, README "Video-to-Video"). Where mmrl
differs: Flow-Factory's step counts (``num_inference_steps``, and its ``sde_steps`` indices, which index the full
grid) are the pipeline's N, mmrl's are the steps run; Flow-Factory casts the input video to the transformer's dtype
before the VAE, mmrl encodes it as the pipeline does (float32 pixels, the VAE's dtype); Flow-Factory's forward runs
``transformer`` only, while a Wan 2.2 A14B checkpoint here routes the steps between its two experts as ``WanPipeline``
does (diffusers' V2V pipeline has no ``transformer_2``; mmrl samples that model as it was trained to denoise).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning, GuidanceScale, encoded_latents, refuse_other_pipelines
from mmrl.plugins.flow.adapters.wan import WanAdapter
from mmrl.rollout import RolloutError

VIDEO_LATENTS = "input_video_latents"
"""The conditioning key of the rows' encoded input videos x₀ ``[n, C, F_lat, h, w]`` (float32, normalised): read by
:meth:`WanVideoToVideoAdapter.initial_latents`, never shown to the transformer."""

DEFAULT_STRENGTH = 0.8  # WanVideoToVideoPipeline.__call__'s strength


class WanVideoToVideoAdapter(WanAdapter):
    """Adapter for Wan video-to-video (``WanVideoToVideoPipeline``) on a Wan text-to-video checkpoint (Wan 2.1 T2V
    1.3B / 14B; Wan 2.2 T2V-A14B's experts and TI2V-5B's per-token timesteps as the ``wan`` adapter samples them):
    every sample starts from its row's input video noised to the grid's first σ (module docstring)."""

    name = "wan_v2v"
    pipeline_classes = ("WanVideoToVideoPipeline",)
    #: Input videos kept encoded (latents on the device, 8-bit pixels on the CPU), least recently used dropped.
    video_cache_size = 32

    def __init__(self, pipeline: Any, device: torch.device):
        super().__init__(pipeline, device)
        #: The share of the grid the input video is noised to and denoised from (``adapter_options.strength``).
        self.strength = DEFAULT_STRENGTH
        # (video, frames, H, W) → {"latents": [1, C, F_lat, h, w] float32, "pixels": [1, 3, F, H, W] uint8 (CPU)}
        self._videos: OrderedDict[tuple[Any, ...], dict[str, Tensor]] = OrderedDict()

    @classmethod
    def check_pipeline_class(cls, pipeline: Any) -> None:
        """A ``WanVideoToVideoPipeline`` or a ``WanPipeline``: the released V2V checkpoints are Wan text-to-video ones
        (module docstring), whose ``model_index.json`` names ``WanPipeline``. That class is not declared in
        :attr:`pipeline_classes`, where ``adapter: auto`` would read it (it gives such a folder to ``wan``); any other
        class is refused as every adapter refuses it, naming both classes and the adapter that drives the class found
        (a Wan image-to-video checkpoint: ``wan_i2v``)."""
        refuse_other_pipelines(cls, pipeline, accepted=(*cls.pipeline_classes, "WanPipeline"))

    def configure(self, options: dict[str, Any], *, cfg: bool) -> None:
        """``plugin.adapter_options``: ``strength`` only, a number in (0, 1]."""
        unknown = [key for key in options if key != "strength"]
        if unknown:
            raise ValueError(f"keys of strength (the {self.name} adapter's); {unknown[0]!r} is not one")
        if "strength" in options:
            value = options["strength"]
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or not 0 < value <= 1:
                raise ValueError(f"strength: a number in (0, 1], the share of the sigma grid the input video is noised "
                                 f"to and denoised from (WanVideoToVideoPipeline's strength, default "
                                 f"{DEFAULT_STRENGTH}); got {value!r}")
            self.strength = float(value)

    # ------------------------------------------------------------------ the shortened grid
    def full_steps(self, num_steps: int) -> int:
        """N, the pipeline's ``num_inference_steps`` whose ``get_timesteps`` runs ``num_steps`` steps at
        :attr:`strength`: the smallest N with ``min(int(N · strength), N) = num_steps`` (it exists for any strength in
        (0, 1]: ``int(N · strength)`` grows by at most one per N)."""
        full = max(num_steps, math.floor(num_steps / self.strength) - 2)  # int(full · strength) < num_steps here
        while min(int(full * self.strength), full) < num_steps:
            full += 1
        return full

    def schedule(self, num_steps: int, static_shift: float | None = None) -> tuple[Tensor, Tensor]:
        """``(sigmas [R+1], timesteps [R])`` of the R = ``num_steps`` steps run: the tail of the grid of
        :meth:`full_steps` steps (the pipeline's, or DanceGRPO's statically shifted one), from its step
        ``N − R`` on."""
        full = self.full_steps(num_steps)
        sigmas, timesteps = super().schedule(full, static_shift)  # [N+1], [N]
        start = full - num_steps
        return sigmas[start:], timesteps[start:]

    def initial_latents(self, noise: Tensor, conditioning: Conditioning, sigma: Tensor) -> Tensor:
        """x = σ₀·ε + (1 − σ₀)·x₀ ``[n, C, F_lat, h, w]`` float32: the rows' encoded input videos x₀ noised to the
        first σ of the grid with the samples' noise ε (``scale_noise``'s order of operations)."""
        clean = conditioning[VIDEO_LATENTS].to(noise)  # [n, C, F_lat, h, w]
        sigma = sigma.to(noise)
        return sigma * noise + (1.0 - sigma) * clean

    def velocity(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning, *,
                 guidance_scale: GuidanceScale, negative: Conditioning | None = None) -> Tensor:
        """Wan's velocity; the input video's latents are the start only, so they stay out of the CFG batch."""
        rows = {key: value for key, value in conditioning.items() if key != VIDEO_LATENTS}
        return super().velocity(module, latents, timesteps, rows, guidance_scale=guidance_scale, negative=negative)

    # ------------------------------------------------------------------ rows and their videos
    def prepare_rows(self, rows: list[dict[str, Any]], folder: Path | None, source: str) -> list[dict[str, Any]]:
        """Every row must name its input video: ``"video"``, a video file's path or a list of at least
        ``num_frames`` frame image paths, relative to the prompt file's folder (or absolute), each an existing file;
        rows come back with absolute paths. Inline prompt lists hold no videos and are refused."""
        if rows and folder is None:
            raise ValueError(f"{source}: null: the {self.name} adapter starts every sample from an input video, so "
                             "its rows come from a JSONL file (plugin.dataset / eval_dataset) whose rows have a "
                             "'prompt' and a 'video'")
        resolved = []
        for number, row in enumerate(rows, start=1):
            video = row.get("video")
            names = video if isinstance(video, list) else [video]
            if not names or any(not isinstance(name, str) or not name.strip() for name in names):
                raise ValueError(f"{source} row {number} has no 'video' (the path of a video file, or a list of its "
                                 f"frames' image paths in order), which the {self.name} adapter needs in every row; "
                                 f"got {video!r}")
            if isinstance(video, list) and len(video) < self.num_frames:
                raise ValueError(f"{source} row {number}: 'video' lists {len(video)} frames; plugin.num_frames is "
                                 f"{self.num_frames} (the first num_frames frames of each input video are used)")
            paths = []
            for name in names:
                path = Path(name).expanduser()
                path = path if path.is_absolute() else folder / path
                if not path.is_file():
                    raise FileNotFoundError(f"{source} row {number}: video {name!r} is not a file (at {path}; "
                                            "relative paths are read from the prompt file's folder)")
                paths.append(str(path))
            if not isinstance(video, list):
                _require_pyav(f"{source} row {number} names the video file {video!r}")
            resolved.append({**row, "video": paths if isinstance(video, list) else paths[0]})
        return resolved

    def row_conditioning(self, rows: list[dict[str, Any]]) -> tuple[Conditioning, dict[str, Tensor]]:
        """``{"input_video_latents": [n, C, F_lat, h, w]}`` and ``{"condition_videos": [n, 3, F, H, W]}`` in [0, 1],
        each input video read and encoded once (:attr:`video_cache_size` kept)."""
        height, width = self.size
        keys = []
        for index, row in enumerate(rows):
            video = row.get("video")
            if not video:
                raise RolloutError(f"prompt row {index} ({str(row.get('prompt', ''))[:40]!r}) has no 'video'; the "
                                   f"{self.name} adapter needs an input video in every row")
            keys.append((tuple(video) if isinstance(video, list) else str(video), self.num_frames, height, width))
        for key in dict.fromkeys(keys):
            if key not in self._videos:
                with torch.no_grad():
                    self._videos[key] = self._encode(read_video(key[0], self.num_frames))
        entries = []
        for key in keys:
            self._videos.move_to_end(key)
            entries.append(self._videos[key])
        latents = torch.cat([entry["latents"] for entry in entries])  # [n, C, F_lat, h, w]
        pixels = torch.cat([entry["pixels"] for entry in entries]).to(self.device).float() / 255  # [n, 3, F, H, W]
        while len(self._videos) > self.video_cache_size:
            self._videos.popitem(last=False)
        return {VIDEO_LATENTS: latents}, {"condition_videos": pixels}

    def _encode(self, frames: list[Any]) -> dict[str, Tensor]:
        """One video's frames (PIL images) → its normalised latents ``[1, C, F_lat, h, w]`` float32 and its frames as
        the model saw them, ``[1, 3, F, H, W]`` 8-bit on the CPU (``prepare_latents``' steps)."""
        height, width = self.size
        vae = self.vae
        pixels = self.pipeline.video_processor.preprocess_video(frames, height=height, width=width)
        pixels = pixels.to(self.device, torch.float32)  # [1, 3, F, H, W] in [-1, 1]
        latents = encoded_latents(vae.encode(pixels.to(vae.dtype)), vae).float()  # [1, C, F_lat, h, w]
        mean, inverse_std = self.latent_statistics(latents.device, torch.float32)
        seen = ((pixels / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).cpu()
        return {"latents": (latents - mean) * inverse_std, "pixels": seen}


def read_video(video: str | tuple[str, ...], count: int) -> list[Any]:
    """The first ``count`` frames of ``video`` as RGB PIL images: a video file (decoded with PyAV) or a sequence of
    frame image paths. A video that cannot be read, or has fewer frames, is a one-line RolloutError naming it."""
    from PIL import Image, UnidentifiedImageError

    frames: list[Any] = []
    if isinstance(video, tuple):
        for path in video[:count]:
            try:
                with Image.open(path) as opened:
                    frames.append(opened.convert("RGB"))
            except (OSError, UnidentifiedImageError) as error:
                reason = str(error).splitlines()[0] if str(error) else type(error).__name__
                raise RolloutError(f"input video frame {path} is not a readable image ({reason})") from None
        name = f"input video of {len(video)} frames starting {video[0]}"
    else:
        av = _require_pyav(f"input video {video}")
        try:
            with av.open(video) as container:
                for frame in container.decode(video=0):
                    frames.append(frame.to_image().convert("RGB"))
                    if len(frames) == count:
                        break
        except (OSError, ValueError, av.FFmpegError) as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise RolloutError(f"input video {video} is not a readable video ({reason})") from None
        name = f"input video {video}"
    if len(frames) < count:
        raise RolloutError(f"{name} has {len(frames)} frames; plugin.num_frames is {count} (the first num_frames "
                           "frames are used)")
    return frames


def _require_pyav(what: str) -> Any:
    """The ``av`` module, or a one-line ValueError: ``what`` needs PyAV to read a video file."""
    try:
        import av
    except ImportError:
        raise ValueError(f"{what}, which needs PyAV to read (pip install av), or give 'video' as a list of its "
                         "frames' image paths") from None
    return av
