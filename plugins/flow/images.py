"""Image grids with captions, written at every evaluation (the prompt and the reward under each image), and the
WAV files of samples that carry audio (LTX-2)."""

from __future__ import annotations

import math
import textwrap
import wave
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont
from torch import Tensor

MIN_CELL = 192
"""Images narrower than this are enlarged (nearest neighbour) so that captions stay legible."""
CAPTION_LINES = 3
LINE_HEIGHT = 14
PAD = 4


def to_pil(images: Tensor) -> list[Image.Image]:
    """``[N, 3, H, W]`` floats in [0, 1] → N RGB images."""
    array = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(item) for item in array]


def caption_grid(images: Tensor, captions: Sequence[str], columns: int | None = None) -> Image.Image:
    """One picture of ``images`` ``[N, 3, H, W]`` laid out in ``columns`` (default ≈ √N), each cell with its
    caption (wrapped to three lines, truncated with '...') on a white strip under the image."""
    if len(captions) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(captions)} captions")
    pictures = to_pil(images)
    count = len(pictures)
    columns = columns or max(1, math.ceil(math.sqrt(count)))
    rows = max(1, math.ceil(count / columns))
    height, width = images.shape[2], images.shape[3]
    scale = max(1, math.ceil(MIN_CELL / width))
    cell_w, cell_h = width * scale, height * scale
    strip = CAPTION_LINES * LINE_HEIGHT + 2 * PAD
    grid = Image.new("RGB", (columns * (cell_w + PAD) + PAD, rows * (cell_h + strip + PAD) + PAD), "white")
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    chars_per_line = max(8, cell_w // 6)
    for k, (picture, caption) in enumerate(zip(pictures, captions, strict=True)):
        row, column = divmod(k, columns)
        x = PAD + column * (cell_w + PAD)
        y = PAD + row * (cell_h + strip + PAD)
        grid.paste(picture.resize((cell_w, cell_h), Image.NEAREST), (x, y))
        lines = textwrap.wrap(caption, chars_per_line) or [""]
        if len(lines) > CAPTION_LINES:
            lines = lines[:CAPTION_LINES]
            lines[-1] = lines[-1][: max(0, chars_per_line - 1)] + "..."
        for i, line in enumerate(lines):
            draw.text((x, y + cell_h + PAD + i * LINE_HEIGHT), line, fill="black", font=font)
    return grid


def save_caption_grid(images: Tensor, captions: Sequence[str], path: str | Path, columns: int | None = None) -> Path:
    """Write :func:`caption_grid` as a PNG at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    caption_grid(images, captions, columns).save(path)
    return path


def filmstrips(videos: Tensor, max_frames: int = 8) -> Tensor:
    """``[N, 3, F, H, W]`` videos → ``[N, 3, H, k·W]`` images: k ≤ ``max_frames`` frames taken at an even stride
    from the first (the last frame included when F - 1 is a multiple of the stride) laid side by side, for grids."""
    if videos.dim() != 5:
        raise ValueError(f"videos of shape {list(videos.shape)}; expected [N, 3, F, H, W]")
    count = videos.shape[2]
    stride = max(1, math.ceil((count - 1) / max(1, max_frames - 1))) if count > 1 else 1
    frames = videos[:, :, ::stride]  # [N, 3, k, H, W]
    return frames.permute(0, 1, 3, 2, 4).flatten(3)  # [N, 3, H, k·W]


def save_wav(waveform: Tensor, sample_rate: int, path: str | Path) -> Path:
    """Write one waveform ``[channels, samples]`` (floats, nominally in [-1, 1]) at ``path`` as a 16-bit PCM WAV file
    of ``sample_rate`` Hz: clamped to [-1, 1], scaled by 32767 and rounded, the channels interleaved."""
    if waveform.dim() != 2:
        raise ValueError(f"a waveform of shape {list(waveform.shape)}; expected [channels, samples]")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pcm = (waveform.detach().float().clamp(-1, 1) * 32767).round().to(torch.int16)  # [channels, samples]
    frames = pcm.t().contiguous().cpu().numpy().astype("<i2").tobytes()  # interleaved, little-endian
    with wave.open(str(path), "wb") as handle:
        handle.setnchannels(waveform.shape[0])
        handle.setsampwidth(2)
        handle.setframerate(int(sample_rate))
        handle.writeframes(frames)
    return path
