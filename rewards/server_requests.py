"""What a ``POST /score`` request may hold, checked before each expensive step, and its decoding.

:func:`check_json_shape` runs on the raw body before ``json`` parses it (nesting depth and value count),
:func:`decode_batch` checks the parsed request and reads the size of every PNG image from its header before any
image is decoded (the per-request pixel budget), :func:`decode_context` checks the run's reward context that a
request carries. Every refusal is a :class:`BadRequest` with an HTTP status and a
one-line message naming the ``mmrl serve-rewards`` flag that sets the limit. The request format is described in
:mod:`mmrl.rewards.remote`; a new top-level field is one more ``request.get`` in :func:`decode_batch`.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
import struct
from typing import Any

import numpy as np
import torch

from mmrl.reward import RewardError, RewardInput
from mmrl.rewards.images import decode_png

_INT64 = (-(1 << 63), (1 << 63) - 1)
# A reward context is a few facts about the model being trained (``{"box_convention": "qwen2_vl"}``); these bounds
# are far above that and keep the canonical JSON that keys a server's per-context instances short.
MAX_CONTEXT_DEPTH = 4
MAX_CONTEXT_CHARS = 4096
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class BadRequest(Exception):
    """A request the server cannot accept; answered with ``status`` and a one-line JSON error."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# A JSON string, escapes included; an unterminated one runs to the end of the text, so that every quote is consumed
# in one left-to-right pass (retrying at each later quote would be quadratic on '"\"\"\"...').
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_JSON_WHITESPACE = b" \t\n\r"
_NOT_BRACKETS = bytes(range(256)).translate(None, b"[]{}")


def check_json_shape(body: bytes, max_depth: int, max_values: int) -> None:
    """Refuse a JSON text with more than ``max_values`` values or nested deeper than ``max_depth``, before parsing.

    Strings are emptied first (brackets and commas inside them are text), whitespace dropped; in what remains each
    comma separates two values of an array or object, so a document holds ``1 + commas + non-empty containers``
    values (array elements and object members, plus the document itself), and its depth is the highest running
    count of open minus closed brackets. Up to the first error that ``json`` would report, both agree with the
    parse, so the parser never recurses deeper than ``max_depth``. Linear time, in C apart from one numpy pass.

    Raises:
        BadRequest: 413 for too many values, 400 for too deep a nesting.
    """
    skeleton = _JSON_STRING.sub(b'""', body).translate(None, _JSON_WHITESPACE)
    containers = skeleton.count(b"[") + skeleton.count(b"{")
    empty = skeleton.count(b"[]") + skeleton.count(b"{}")
    values = 1 + skeleton.count(b",") + containers - empty
    if values > max_values:
        raise BadRequest(413, f"the request holds {values} JSON values; at most {max_values} are accepted "
                              "(--max-json-values)")
    brackets = np.frombuffer(skeleton.translate(None, _NOT_BRACKETS), dtype=np.uint8)  # b"[{}]..." only
    depth = peak = 0
    for start in range(0, len(brackets), 1 << 20):  # bounded memory on a body of nothing but brackets
        chunk = brackets[start:start + (1 << 20)]
        steps = np.where((chunk == ord("[")) | (chunk == ord("{")), 1, -1).astype(np.int64)
        running = np.cumsum(steps) + depth
        peak, depth = max(peak, int(running.max())), int(running[-1])
        if peak > max_depth:
            raise BadRequest(400, f"the request nests JSON arrays and objects deeper than {max_depth} levels "
                                  "(--max-json-depth)")


def canonical_json(value: Any) -> str:
    """``value`` as compact JSON with sorted keys: equal JSON data gives equal text (a cache key)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def shown_json(value: Any, limit: int = 200) -> str:
    """``value`` as JSON for a one-line message (what is not JSON data by its repr), cut to ``limit`` characters."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, default=repr)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def context_problem(context: Any) -> str | None:
    """What makes ``context`` unfit to travel as a reward context, or None when it is fit.

    A reward context travels as a JSON object with string keys, its objects and arrays nested at most
    ``MAX_CONTEXT_DEPTH`` levels (the context itself is level 1), at most ``MAX_CONTEXT_CHARS`` characters of
    canonical JSON. The client checks this before sending (a clear error at start-up) and the server on every request.
    """
    if not isinstance(context, dict):
        return f"is a {type(context).__name__}, not a JSON object"
    pending: list[tuple[Any, int]] = [(context, 1)]  # iterative: a deep value cannot exhaust the stack
    while pending:
        value, depth = pending.pop()
        if depth > MAX_CONTEXT_DEPTH:
            return f"nests objects or arrays deeper than {MAX_CONTEXT_DEPTH} levels"
        if isinstance(value, dict):
            if not all(isinstance(key, str) for key in value):
                return "has a key that is not a string"
            children = value.values()
        else:
            children = value
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    try:
        size = len(canonical_json(context))
    except (TypeError, ValueError) as error:  # only from Python callers: parsed JSON always serialises
        return f"is not JSON data ({error})"
    if size > MAX_CONTEXT_CHARS:
        return f"has {size} characters as JSON, more than {MAX_CONTEXT_CHARS}"
    return None


def decode_context(request: dict[str, Any]) -> dict[str, Any] | None:
    """The reward context of a score request: its ``context`` field, or None when it has none (a client older than
    the field, or ``null``).

    Raises:
        BadRequest: 400 naming what is wrong with the field.
    """
    context = request.get("context")
    if context is None:
        return None
    problem = context_problem(context)
    if problem is not None:
        raise BadRequest(400, f"'context' (the run's reward context) {problem}; it must be a JSON object with string "
                              f"keys, at most {MAX_CONTEXT_DEPTH} levels deep and {MAX_CONTEXT_CHARS} characters")
    return context


def png_size(data: bytes, where: str) -> tuple[int, int]:
    """``(width, height)`` from the IHDR chunk that opens every PNG, without decoding anything.

    Raises:
        BadRequest: 400 when ``data`` does not start like a PNG image.
    """
    if len(data) < 24 or data[:8] != _PNG_SIGNATURE or data[8:16] != b"\x00\x00\x00\x0dIHDR":
        raise BadRequest(400, f"{where} is not a readable PNG image (no PNG header)")
    width, height = struct.unpack(">II", data[16:24])
    if width == 0 or height == 0:
        raise BadRequest(400, f"{where} is not a readable PNG image (size {width}x{height})")
    return width, height


def _decode_sized(data: bytes, where: str, size: tuple[int, int]) -> torch.Tensor:
    """Decode a PNG whose header said ``size``, after checking that PIL reads the same size.

    PIL takes the size from the last IHDR chunk before the image data, so a PNG with a small IHDR followed by a
    large one would pass the pixel budget and still decode large; such files are refused before decoding.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=["PNG"]) as image:  # reads the chunks up to the image data only
            seen = image.size
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as error:
        raise BadRequest(400, f"{where} is not a readable PNG image ({type(error).__name__})") from None
    if seen != size:
        raise BadRequest(400, f"{where} is not a readable PNG image (it declares both {size[0]}x{size[1]} and "
                              f"{seen[0]}x{seen[1]})")
    try:
        return decode_png(data, where)
    except RewardError as error:
        raise BadRequest(400, str(error)) from None


def decode_batch(request: dict[str, Any], max_pixels: int | None = None) -> RewardInput:
    """The :class:`RewardInput` of a score request; malformed parts raise :class:`BadRequest` (400).

    Args:
        request: The decoded JSON request.
        max_pixels: Most pixels of all PNG images together (None: no limit); checked from the PNG headers before
            any image is decoded (413 when over).
    """
    rows = request.get("rows")
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise BadRequest(400, "'rows' must be a list of JSON objects")
    n = len(rows)
    group_ids = request.get("group_ids", [0] * n)
    if not isinstance(group_ids, list) or len(group_ids) != n or not all(
            isinstance(g, int) and not isinstance(g, bool) and _INT64[0] <= g <= _INT64[1] for g in group_ids):
        raise BadRequest(400, f"'group_ids' must be a list of {n} integers (each within the 64-bit range)")
    payload_in = request.get("payload", {})
    if not isinstance(payload_in, dict):
        raise BadRequest(400, "'payload' must be a JSON object")
    encoded: dict[str, list[tuple[bytes, tuple[int, int]]]] = {}  # PNG bytes and header size, before any decoding
    frame_counts: dict[str, list[int]] = {}  # images of each sample of a 'png_frames' or 'png_sets' entry
    image_sets: set[str] = set()  # the 'png_sets' entries: several images per sample, stacked on a leading axis
    for key, entry in payload_in.items():
        kind = next(iter(entry)) if isinstance(entry, dict) and len(entry) == 1 else None
        if kind not in ("png", "png_frames", "png_sets", "json"):
            raise BadRequest(400, f"payload[{key!r}] must be {{'png': [base64, ...]}}, {{'png_frames': [[base64, "
                                  "...], ...]}}, {'png_sets': [[base64, ...], ...]} or {'json': value}")
        if kind == "json":
            continue
        if kind in ("png_frames", "png_sets"):
            videos = entry[kind]
            if not isinstance(videos, list) or len(videos) != n or not all(
                    isinstance(frames, list) and frames and all(isinstance(item, str) for item in frames)
                    for frames in videos):
                raise BadRequest(400, f"payload[{key!r}][{kind!r}] must be a list of {n} non-empty lists of "
                                      "base64 strings")
            frame_counts[key] = [len(frames) for frames in videos]
            if kind == "png_sets":
                image_sets.add(key)
            items = [item for frames in videos for item in frames]
        else:
            items = entry["png"]
            if not isinstance(items, list) or len(items) != n or not all(isinstance(item, str) for item in items):
                raise BadRequest(400, f"payload[{key!r}]['png'] must be a list of {n} base64 strings")
        encoded[key] = []
        for index, item in enumerate(items):
            try:
                data = base64.b64decode(item, validate=True)
            except (binascii.Error, ValueError):
                raise BadRequest(400, f"payload[{key!r}][{index}] is not base64") from None
            encoded[key].append((data, png_size(data, f"payload[{key!r}][{index}]")))
    pixels = sum(width * height for images in encoded.values() for _, (width, height) in images)
    if max_pixels is not None and pixels > max_pixels:
        raise BadRequest(413, f"the request's images have {pixels} pixels in all; at most {max_pixels} are accepted "
                              "(--max-megapixels); send fewer or smaller images per request")
    payload: dict[str, Any] = {}
    for key, entry in payload_in.items():
        if key not in encoded:
            payload[key] = entry["json"]
            continue
        images = [_decode_sized(data, f"payload[{key!r}][{index}]", size)
                  for index, (data, size) in enumerate(encoded[key])]
        if key in frame_counts:
            payload[key] = _videos(images, frame_counts[key], key, axis=0 if key in image_sets else 1)
            continue
        same_size = len({tuple(image.shape) for image in images}) <= 1
        payload[key] = torch.stack(images) if images and same_size else images
    return RewardInput(rows=rows, payload=payload, group_ids=torch.tensor(group_ids, dtype=torch.long))


def _videos(frames: list[torch.Tensor], counts: list[int], key: str, axis: int = 1
            ) -> torch.Tensor | list[torch.Tensor]:
    """Decoded frames (uint8 ``[3, H, W]``, videos one after another) → ``[N, 3, F, H, W]``, or a list of
    ``[3, F, H, W]`` when the videos differ in size; the frames of one video must share a size. With ``axis`` 0,
    image sets (``png_sets``): ``[N, K, 3, H, W]`` (or a list of ``[K, 3, H, W]``)."""
    videos, start = [], 0
    for index, count in enumerate(counts):
        own = frames[start:start + count]
        start += count
        if len({tuple(frame.shape) for frame in own}) != 1:
            what = "image set {} has images" if axis == 0 else "video {} has frames"
            raise BadRequest(400, f"payload[{key!r}] {what.format(index)} of different sizes")
        videos.append(torch.stack(own, dim=axis))  # [3, F, H, W] or [K, 3, H, W]
    if len({tuple(video.shape) for video in videos}) == 1:
        return torch.stack(videos)
    return videos
