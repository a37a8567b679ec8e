"""Aspect-ratio buckets (``plugin.buckets``): every prompt row generated at one of a few output sizes, the one whose
aspect ratio is nearest the row's own.

The diffusers editing pipelines size their output by the input image: ``FluxKontextPipeline`` picks the entry of
``PREFERRED_KONTEXT_RESOLUTIONS`` nearest the image's aspect ratio (diffusers 0.42 ``pipeline_flux_kontext.py``,
``_auto_resize``), ``QwenImageEditPipeline`` and ``QwenImageEditPlusPipeline`` generate about 1024² pixels at the
aspect ratio of the first (Plus: the last) image (``calculate_dimensions(1024 * 1024, ratio)``), the FLUX.2
pipelines at the first reference image's size, and Flow-Factory trains them so, one prompt per batch
(X-GenGroup/Flow-Factory@a0b2bc5, ``models/qwen_image/qwen_image_edit_plus.py`` ``_inference``, ``auto_resize``).
Rows of different sizes cannot share a batch, so mmrl snaps each row to the nearest of a list of sizes, and the core
draws every training step's prompts from one bucket (:meth:`mmrl.plugin.Plugin.row_buckets`).

Nearest is measured on the logarithm of the aspect ratio (width / height), so that 2:1 and 1:2 are as far from 1:1;
Kontext's pipeline compares the ratios themselves, which picks the same entry except near the midpoint between two
entries. A tie goes to the earlier bucket of the list. A row's aspect ratio is:

- for an image-conditioned adapter, its input image's (:attr:`FlowAdapter.aspect_image`: the first, or with
  Qwen-Image-Edit-Plus the last of several), read from the file's header;
- for a text-to-image row, its ``"aspect_ratio"`` (width / height as a number, or ``"W:H"``), else the run's
  ``height`` × ``width``.

The input images of an editing row are brought to its bucket's size, or with ``plugin.condition_size`` to that
size's area at the bucket's aspect ratio (:func:`condition_size_for`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

Size = tuple[int, int]

BUCKET_KEY = "output_size"
"""The row key the plugin sets to the row's bucket, ``[height, width]`` (rewards can read it)."""


def bucket_name(size: Size) -> str:
    """A bucket's key for the core and file names: ``"{height}x{width}"``."""
    return f"{size[0]}x{size[1]}"


def nearest_bucket(aspect: float, buckets: Sequence[Size]) -> Size:
    """The bucket whose aspect ratio (width / height) is nearest ``aspect`` on a log scale; the earlier on a tie."""
    target = math.log(aspect)
    return min(buckets, key=lambda size: abs(math.log(size[1] / size[0]) - target))


def parse_aspect_ratio(value: Any, where: str) -> float:
    """A row's ``"aspect_ratio"``: a positive number (width / height) or a ``"W:H"`` string, as a float.

    Raises:
        ValueError: naming ``where`` and the value.
    """
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    if isinstance(value, str):
        parts = value.split(":")
        try:
            numbers = [float(part) for part in parts]
        except ValueError:
            numbers = []
        if len(numbers) == 2 and all(math.isfinite(number) and number > 0 for number in numbers):
            return numbers[0] / numbers[1]
    raise ValueError(f"{where}: 'aspect_ratio' must be width / height as a positive number or a \"W:H\" string such "
                     f"as \"16:9\", got {value!r}")


def image_aspect(path: str, where: str) -> float:
    """Width / height of the image at ``path`` (its header only)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as opened:
            width, height = opened.size
    except (OSError, UnidentifiedImageError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"{where}: input image {path} is not a readable image ({reason})") from None
    return width / height


def assign_buckets(rows: list[dict[str, Any]], buckets: Sequence[Size], *, default: Size, aspect_image: str | None,
                   source: str) -> None:
    """Set every row's :data:`BUCKET_KEY` to its bucket, in place.

    Args:
        rows: Prompt rows as :func:`~mmrl.plugins.flow.config.load_rows` returns them (image paths resolved).
        buckets: The ``(height, width)`` sizes to choose from.
        default: The run's ``(height, width)``, whose aspect ratio a text-to-image row without ``"aspect_ratio"``
            takes.
        aspect_image: For an image-conditioned adapter, which of a row's input images sets its aspect ratio
            ('first' or 'last'); None for text-to-image.
        source: The split's file (or option), for messages.

    Raises:
        ValueError: a row already has the key, an ``"aspect_ratio"`` is malformed or given to an image-conditioned
            row, or an input image cannot be read.
    """
    for number, row in enumerate(rows, start=1):
        where = f"{source} row {number}"
        if BUCKET_KEY in row:
            raise ValueError(f"{where} has an {BUCKET_KEY!r} key, which the flow plugin sets to the row's bucket with "
                             "plugin.buckets: rename it")
        if aspect_image is not None:
            if "aspect_ratio" in row:
                raise ValueError(f"{where}: 'aspect_ratio' is for text-to-image rows; an editing or image-to-video "
                                 "row takes its input image's")
            image = row["image"]
            paths = image if isinstance(image, list) else [image]
            aspect = image_aspect(str(paths[0] if aspect_image == "first" else paths[-1]), where)
        elif "aspect_ratio" in row:
            aspect = parse_aspect_ratio(row["aspect_ratio"], where)
        else:
            aspect = default[1] / default[0]
        row[BUCKET_KEY] = list(nearest_bucket(aspect, buckets))


def row_size(row: dict[str, Any]) -> Size:
    """The bucket :func:`assign_buckets` gave ``row``."""
    height, width = row[BUCKET_KEY]
    return int(height), int(width)


def condition_size_for(size: Size, condition_size: Size | None, multiple: int) -> Size | None:
    """The input images' size of a row generated at ``size``: None (the generated size) without
    ``plugin.condition_size``, else ``condition_size``'s area at ``size``'s aspect ratio, each side rounded to a
    multiple of ``multiple`` (at least one), as the Qwen-Image-Edit pipelines' ``calculate_dimensions`` sizes an
    input at a fixed area with its own aspect ratio."""
    if condition_size is None:
        return None
    area = condition_size[0] * condition_size[1]
    height = math.sqrt(area * size[0] / size[1])
    width = height * size[1] / size[0]
    return max(multiple, round(height / multiple) * multiple), max(multiple, round(width / multiple) * multiple)
