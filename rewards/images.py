"""Image inputs of image rewards: accepted formats, conversion to 8-bit RGB, and CLIP-style preprocessing.

``payload["images"]`` (or the payload entry a reward's ``output`` option names) may be

- a tensor ``[N, C, H, W]`` (channels first, the torchvision convention), floating point in [0, 1] or uint8 in
  [0, 255];
- a numpy array ``[N, H, W, C]`` (channels last, the PIL/numpy convention) with the same value ranges;
- a list or tuple of per-sample images: PIL images (any mode), tensors ``[C, H, W]`` or ``[H, W]``, or numpy arrays
  ``[H, W, C]`` or ``[H, W]``; the samples may differ in size.

``C`` is 1 (grayscale, repeated to RGB), 3 (RGB) or 4 (RGBA; the alpha channel is dropped, as PIL's
``convert("RGB")`` does). Integer arrays of another dtype than uint8 are accepted when their values lie in
[0, 255]. Float values within [-0.5, 1.5] are clipped to [0, 1]; values further out mean the images are in another
range (e.g. [0, 255] or [-1, 1] mapped wrongly) and are rejected with a :class:`~mmrl.reward.RewardError`, as are
other ranks, channel counts, empty images and bool or complex dtypes.

Every image is converted once to 8-bit RGB, exactly as ``(x * 255).round().clamp(0, 255)`` (Flow-GRPO's and DDPO's
conversion before their reward models). All image rewards therefore score the same 8-bit image, and a remote
reward, which sends PNG bytes, scores exactly what a local reward would.

An image with a NaN or infinite pixel is malformed model output, not a malformed payload: it is not rejected;
rewards score it NaN, so that ``rewards.on_nonfinite`` decides (stop the run naming the reward, or skip the sample).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from mmrl.reward import RewardError, RewardInput

FLOAT_TOLERANCE = 0.5  # float pixels in [-0.5, 1.5] are clipped to [0, 1]; further out is rejected
_CHANNELS = (1, 3, 4)


@dataclass
class ImageBatch:
    """The images of a batch as 8-bit RGB.

    Attributes:
        images: One uint8 tensor ``[3, H, W]`` per sample (on the device the payload was on). Samples with
            non-finite pixels hold zeros of the right size.
        finite: ``[N]`` bool (CPU), False for samples whose pixels were not all finite; rewards score those NaN.
    """

    images: list[Tensor]
    finite: Tensor

    def __len__(self) -> int:
        return len(self.images)

    def numpy(self, index: int) -> np.ndarray:
        """Sample ``index`` as a ``[H, W, 3]`` uint8 array (CPU)."""
        return self.images[index].permute(1, 2, 0).contiguous().cpu().numpy()

    def pil(self, index: int) -> Any:
        """Sample ``index`` as an RGB PIL image."""
        from PIL import Image

        return Image.fromarray(self.numpy(index))

    def nan_where_invalid(self, scores: Tensor) -> Tensor:
        """``scores`` ([N], any device) as float64 on CPU with NaN at the samples whose pixels were not finite."""
        scores = scores.detach().to("cpu", torch.float64)
        return torch.where(self.finite, scores, torch.full_like(scores, float("nan")))


def read_images(batch: RewardInput, output: str = "images", reward: str = "image reward") -> ImageBatch:
    """The images ``batch.payload[output]`` as an :class:`ImageBatch`; raise a one-line RewardError if unusable."""
    value = batch.output(output)
    images = to_image_batch(value, where=f"reward {reward!r}: payload[{output!r}]")
    if len(images) != len(batch):
        raise RewardError(f"reward {reward!r}: payload[{output!r}] holds {len(images)} images for {len(batch)} samples")
    return images


def to_image_batch(value: Any, where: str = "images") -> ImageBatch:
    """Convert any accepted image payload (see the module docstring) to 8-bit RGB."""
    if isinstance(value, Tensor):
        if value.dim() != 4:
            raise RewardError(
                f"{where} is a tensor of shape {list(value.shape)}; expected [N, C, H, W] with C in 1, 3, 4 "
                "(or a list of per-sample images)"
            )
        return _from_stack(value.detach(), where)
    if isinstance(value, np.ndarray):
        if value.ndim != 4:
            raise RewardError(
                f"{where} is an array of shape {list(value.shape)}; numpy batches are [N, H, W, C] with C in 1, 3, 4 "
                "(or a list of per-sample images)"
            )
        if value.dtype == object:
            raise RewardError(f"{where} is an object array; expected numbers")
        return _from_stack(torch.from_numpy(np.ascontiguousarray(value)).permute(0, 3, 1, 2), where, "[N, H, W, C]")
    if isinstance(value, (list, tuple)):
        return _from_samples(list(value), where, channels_last=None)
    raise RewardError(
        f"{where} is a {type(value).__name__}; expected a tensor [N, C, H, W], a numpy array [N, H, W, C], or a list "
        "of PIL images, tensors [C, H, W] or arrays [H, W, C]"
    )


def _from_stack(stack: Tensor, where: str, layout: str = "[N, C, H, W]") -> ImageBatch:
    """A whole ``[N, C, H, W]`` batch converted at once (the common case: a plugin's decoded images)."""
    n, channels = stack.shape[0], stack.shape[1]
    if channels not in _CHANNELS:
        raise RewardError(f"{where} has {channels} channels (shape {list(stack.shape)}); expected 1 (grayscale), "
                          f"3 (RGB) or 4 (RGBA) in layout {layout}")
    if n and (stack.shape[-1] == 0 or stack.shape[-2] == 0):
        raise RewardError(f"{where} is empty (shape {list(stack.shape)}); images need at least one pixel")
    if channels == 1:
        stack = stack.expand(-1, 3, -1, -1)
    elif channels == 4:
        stack = stack[:, :3]
    if n == 0:
        return ImageBatch([], torch.zeros(0, dtype=torch.bool))
    dtype = stack.dtype
    if dtype.is_floating_point:
        values = stack.float()
        finite = torch.isfinite(values).flatten(1).all(1)
        finite_cpu = finite.cpu()
        if not bool(finite_cpu.all()):
            values = torch.where(finite.view(-1, 1, 1, 1), values, torch.zeros((), device=values.device))
        if bool(finite_cpu.any()):
            low, high = float(values[finite].min()), float(values[finite].max())
            if low < -FLOAT_TOLERANCE or high > 1 + FLOAT_TOLERANCE:
                bad = (((values < -FLOAT_TOLERANCE) | (values > 1 + FLOAT_TOLERANCE)).flatten(1).any(1)
                       & finite).nonzero().flatten()[:5].tolist()
                raise RewardError(_range_message(f"{where}{bad}", low, high))
        uint8 = (values * 255).round().clamp(0, 255).to(torch.uint8)
        return ImageBatch(list(uint8.unbind(0)), finite_cpu)
    uint8, _ = _to_uint8(stack, where)
    return ImageBatch(list(uint8.unbind(0)), torch.ones(n, dtype=torch.bool))


def _range_message(where: str, low: float, high: float) -> str:
    return (f"{where} has float values in [{low:.4g}, {high:.4g}]; float images must lie in [0, 1] (values within "
            f"[{-FLOAT_TOLERANCE}, {1 + FLOAT_TOLERANCE}] are clipped): map [-1, 1] images with x / 2 + 0.5 and "
            "[0, 255] images with x / 255, or pass uint8")


def _from_samples(samples: list[Any], where: str, channels_last: bool | None) -> ImageBatch:
    images, finite = [], []
    for index, sample in enumerate(samples):
        image, ok = _one_image(sample, f"{where}[{index}]", channels_last)
        images.append(image)
        finite.append(ok)
    return ImageBatch(images, torch.tensor(finite, dtype=torch.bool))


def _one_image(sample: Any, where: str, channels_last: bool | None) -> tuple[Tensor, bool]:
    """One sample → (uint8 [3, H, W] tensor, all pixels finite)."""
    if _is_pil(sample):
        array = np.asarray(sample if sample.mode == "RGB" else sample.convert("RGB"))
        return _checked_size(torch.from_numpy(array.copy()).permute(2, 0, 1), where), True
    if isinstance(sample, np.ndarray):
        if sample.dtype == object:
            raise RewardError(f"{where} is an object array; expected numbers")
        tensor = torch.from_numpy(np.ascontiguousarray(sample))
        layout_last = True if channels_last is None else channels_last
    elif isinstance(sample, Tensor):
        tensor = sample.detach()
        layout_last = False if channels_last is None else channels_last
    else:
        raise RewardError(
            f"{where} is a {type(sample).__name__}; expected a PIL image, a tensor [C, H, W] or an array [H, W, C]"
        )
    if tensor.dim() == 2:
        tensor = tensor.unsqueeze(0)
    elif tensor.dim() == 3:
        if layout_last:
            tensor = tensor.permute(2, 0, 1)
    else:
        layout = "[H, W, C]" if layout_last else "[C, H, W]"
        raise RewardError(f"{where} has shape {list(tensor.shape)}; expected {layout} or [H, W] (grayscale)")
    channels = tensor.shape[0]
    if channels not in _CHANNELS:
        layout = "[H, W, C]" if layout_last else "[C, H, W]"
        raise RewardError(
            f"{where} has {channels} channels (shape {list(sample.shape)}); expected 1 (grayscale), 3 (RGB) or "
            f"4 (RGBA) in layout {layout}"
        )
    tensor = _checked_size(tensor, where)
    if channels == 1:
        tensor = tensor.expand(3, -1, -1)
    elif channels == 4:
        tensor = tensor[:3]
    return _to_uint8(tensor, where)


def _is_pil(value: Any) -> bool:
    module = type(value).__module__
    return module.startswith("PIL.") and hasattr(value, "convert") and hasattr(value, "mode")


def _checked_size(tensor: Tensor, where: str) -> Tensor:
    if tensor.shape[-1] == 0 or tensor.shape[-2] == 0:
        raise RewardError(f"{where} is empty (shape {list(tensor.shape)}); images need at least one pixel")
    return tensor


def _to_uint8(tensor: Tensor, where: str) -> tuple[Tensor, bool]:
    dtype = tensor.dtype
    if dtype == torch.uint8:
        return tensor.contiguous(), True
    if dtype == torch.bool or dtype.is_complex:
        raise RewardError(f"{where} has dtype {dtype}; expected uint8 in [0, 255] or floating point in [0, 1]")
    if dtype.is_floating_point:
        values = tensor.float()
        finite = torch.isfinite(values)
        if not bool(finite.all()):
            return torch.zeros(values.shape, dtype=torch.uint8, device=values.device), False
        low, high = float(values.min()), float(values.max())
        if low < -FLOAT_TOLERANCE or high > 1 + FLOAT_TOLERANCE:
            raise RewardError(_range_message(where, low, high))
        return (values * 255).round().clamp(0, 255).to(torch.uint8), True
    low, high = int(tensor.min()), int(tensor.max())
    if low < 0 or high > 255:
        raise RewardError(f"{where} has {dtype} values in [{low}, {high}]; integer images must lie in [0, 255]")
    return tensor.to(torch.uint8), True


# ------------------------------------------------------------------------------------------------ preprocessing


RESIZE_MODES = ("shortest", "longest", "squash")


def clip_pixels(
    images: Sequence[Tensor],
    size: int | tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    device: torch.device | str = "cpu",
    resize_mode: str = "shortest",
    interpolation: str = "bicubic",
) -> Tensor:
    """CLIP preprocessing of uint8 ``[3, H, W]`` images → normalised float32 ``[N, 3, S, S]`` on ``device``.

    ``resize_mode="shortest"`` resizes the shorter side to S (antialiased, ``interpolation``), then crops the centre
    square (open_clip's and CLIP's evaluation transform); ``"longest"`` resizes the longer side to S and pads the
    rest with black, left/top getting the smaller half (HPSv2's evaluation transform, ``ResizeMaxSize`` in
    ``hpsv2/src/open_clip/transform.py`` at tgxs002/HPSv2@866735e, which its ``score`` and the Flow-GRPO and
    DanceGRPO HPS rewards use); ``"squash"`` resizes straight to S × S. Values are clipped to [0, 1] after resizing
    (bicubic overshoots), then normalised with ``mean`` and ``std``.
    """
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    if resize_mode not in RESIZE_MODES:
        raise RewardError(f"image resize mode {resize_mode!r} is not supported; allowed: "
                          + ", ".join(repr(mode) for mode in RESIZE_MODES))
    if interpolation not in ("bicubic", "bilinear"):
        raise RewardError(f"image interpolation {interpolation!r} is not supported; allowed: 'bicubic', 'bilinear'")
    mean_t = torch.tensor(mean, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    outputs: list[Tensor | None] = [None] * len(images)
    # Images of one size are resized together.
    by_size: dict[tuple[int, int], list[int]] = {}
    for index, image in enumerate(images):
        by_size.setdefault((int(image.shape[-2]), int(image.shape[-1])), []).append(index)
    for (h, w), indices in by_size.items():
        pixels = torch.stack([images[i] for i in indices]).to(device=device, dtype=torch.float32) / 255.0
        if resize_mode == "squash":
            target = (height, width)
        elif resize_mode == "longest":
            scale = min(height / h, width / w)
            target = (min(height, round(h * scale)), min(width, round(w * scale)))
        else:
            scale = max(height / h, width / w)
            target = (max(height, round(h * scale)), max(width, round(w * scale)))
        if target != (h, w):
            pixels = F.interpolate(pixels, size=target, mode=interpolation, align_corners=False, antialias=True)
        if resize_mode == "longest":
            pad_h, pad_w = height - pixels.shape[-2], width - pixels.shape[-1]  # black, as HPSv2's fill=0
            pixels = F.pad(pixels, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0.0)
        top = (pixels.shape[-2] - height) // 2
        left = (pixels.shape[-1] - width) // 2
        pixels = pixels[..., top : top + height, left : left + width].clamp(0.0, 1.0)
        pixels = (pixels - mean_t) / std_t
        for position, i in enumerate(indices):
            outputs[i] = pixels[position]
    return torch.stack(outputs) if outputs else torch.zeros(0, 3, height, width, device=device)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ PNG codec


def encode_png(image: Tensor) -> bytes:
    """PNG bytes of one uint8 ``[3, H, W]`` image (lossless; fast zlib level 1, since model outputs are noisy)."""
    from PIL import Image

    buffer = io.BytesIO()
    array = image.permute(1, 2, 0).contiguous().cpu().numpy()
    Image.fromarray(array).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def decode_png(data: bytes, where: str = "image") -> Tensor:
    """A uint8 ``[3, H, W]`` tensor from PNG bytes; any other content raises a one-line RewardError.

    PIL's decompression-bomb limit applies (images above ~179M pixels are refused).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=["PNG"]) as image:
            image.load()
            array = np.asarray(image if image.mode == "RGB" else image.convert("RGB"))
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as error:
        raise RewardError(f"{where} is not a readable PNG image ({type(error).__name__})") from None
    return torch.from_numpy(array.copy()).permute(2, 0, 1)
