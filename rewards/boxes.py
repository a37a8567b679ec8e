"""Bounding-box parsing, coordinate conventions and box geometry for VLM perception rewards.

Vision-language models write boxes in different coordinate frames, and mixing them up is the most common bug in VLM
RL code (VLM-R1, arXiv:2504.07615, fixed its Qwen2.5-VL rescaling only in mid-2025). Every parser here returns boxes
``[x1, y1, x2, y2]`` as floats in **pixels of the original image**, whatever the convention of the model's text:

=================  ===========================================================================================
``"qwen2_vl"``     Qwen2-VL: numbers in [0, 1000) relative to the image, x_abs = x / 1000 · W.
``"qwen2_5_vl"``   Qwen2.5-VL: absolute pixels of the *resized* model input (W', H') chosen by :func:`smart_resize`;
                   x_abs = x · W / W', y_abs = y · H / H'. Needs ``resized_size``.
``"qwen3_vl"``     Qwen3-VL: relative 0–1000 again, like Qwen2-VL (check the checkpoint's own documentation).
``"glm4v"``        GLM-4.1V / GLM-4.5V: relative 0–1000, x = round(x_pixel / W · 1000) (zai-org/GLM-V README).
``"absolute"``     Already pixels of the original image.
``"relative"``     Fractions in [0, 1] of the image: x_abs = x · W.
=================  ===========================================================================================

Which one applies is a property of the model family (each VLM adapter's ``box_convention``); the box rewards of
:mod:`mmrl.rewards.perception` take it from the training run and refuse a different one unless told otherwise.

Sizes are always ``(width, height)`` tuples, except in :func:`smart_resize`, which keeps the ``(height, width)``
argument and result order of ``qwen-vl-utils`` so that it can be swapped in for it.

Accepted box syntaxes (anywhere in the text, in order of appearance): JSON-like objects with a ``bbox_2d`` (or
``bbox``, ``box``, ``position``) list and optional ``label`` and ``confidence``/``score`` (single or double quotes,
as written by Qwen2.5-VL and Visual-RFT, arXiv:2503.01785), plain lists ``[x1, y1, x2, y2]`` or ``(x1, y1, x2, y2)``,
corner pairs ``(x1, y1), (x2, y2)``, and Qwen2-VL box tokens
``<|object_ref_start|>label<|object_ref_end|><|box_start|>(x1,y1),(x2,y2)<|box_end|>`` (the format Perception-R1,
arXiv:2504.07954, trains), and GLM-4.1V/4.5V box tokens ``<|begin_of_box|>[[x1,y1,x2,y2]]<|end_of_box|>`` (any bracket
style, one or several boxes), and InternVL's ``<ref>label</ref><box>[[x1, y1, x2, y2]]</box>`` (one box or several in
one ``<box>``, each taking the ``<ref>`` label; OpenGVLab/InternVL@0355722 ``internvl_chat/eval/refcoco/
evaluate_grounding.py`` reads the list inside ``<box>``). Integers and floats (including exponents) are accepted.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from mmrl.reward import RewardError

Convention = Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v", "absolute", "relative"]
CONVENTIONS: tuple[str, ...] = get_args(Convention)

IMAGE_FACTOR = 28
"""Qwen2/2.5-VL: 14-pixel patches merged 2×2, so resized sides are multiples of 28."""
MIN_PIXELS = 4 * 28 * 28
"""Default lower bound on the resized image area (3,136 pixels)."""
MAX_PIXELS = 16384 * 28 * 28
"""Default upper bound on the resized image area (12,845,056 pixels)."""
MAX_ASPECT_RATIO = 200

# ---------------------------------------------------------------------------------------------------- text helpers

_ANSWER_OPEN = "<answer>"
_ANSWER_CLOSE = "</answer>"

MAX_ANSWER_CHARS = 20_000
"""Default cap of the rewards that read an answer: they read the last this many characters of a completion (the
answer comes at the end; a longer text is read as its tail), so that their work per sample is bounded."""
MAX_WHOLE_CHARS = 200_000
"""Default cap of the rewards that judge the whole completion (``format``, ``exact_match``, ``token_accuracy``): a
longer completion scores 0 (about 50,000 tokens, longer than the generation budgets these rewards are used with)."""


def check_max_chars(max_chars: Any) -> int:
    """``max_chars`` if it is a positive integer.

    Raises:
        RewardError: Otherwise, naming the value.
    """
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 1:
        raise RewardError(f"max_chars must be a positive integer (characters read per completion), got {max_chars!r}")
    return max_chars


def completion_text(value: Any) -> str:
    """The text of one completion; anything that is not text becomes ``""``.

    Accepts a string, or a conversational completion (a list of ``{"role", "content"}`` messages, TRL style) whose
    last message's content is a string or a list of ``{"type": "text", "text": ...}`` parts.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and isinstance(value[-1], dict):
        content = value[-1].get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, (list, tuple)):
            return "".join(
                part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
    return ""


def completion_texts(batch: Any, output: str, *, last_chars: int | None = None) -> list[str]:
    """The text of every completion in ``batch.payload[output]`` (see :func:`completion_text`).

    Args:
        batch: The :class:`~mmrl.reward.RewardInput`.
        output: Payload entry holding the completions.
        last_chars: Keep only the last this many characters of each text (the cap of answer-reading rewards);
            ``None`` keeps whole texts.

    Raises:
        RewardError: If the payload entry is missing or does not hold one completion per row, or ``last_chars``
            is not a positive integer.
    """
    if last_chars is not None:
        check_max_chars(last_chars)
    completions = batch.output(output)
    if isinstance(completions, (str, bytes)) or not hasattr(completions, "__len__") or len(completions) != len(batch):
        size = len(completions) if hasattr(completions, "__len__") else type(completions).__name__
        raise RewardError(f"payload[{output!r}] must hold one completion per sample ({len(batch)}), got {size}")
    texts = [completion_text(c) for c in completions]
    return texts if last_chars is None else [text[-last_chars:] for text in texts]


def extract_answer(text: Any) -> str | None:
    """Content of the last ``<answer>…</answer>`` block of ``text``; ``None`` if there is no answer tag.

    The last closed block is used because a model may quote the tags while thinking before giving its final
    answer. A completion cut off after ``<answer>`` (no closing tag anywhere after it) yields everything after the
    last ``<answer>``.
    """
    if not isinstance(text, str) or _ANSWER_OPEN not in text:
        return None
    end = text.rfind(_ANSWER_CLOSE)
    start = text.rfind(_ANSWER_OPEN, 0, max(end, 0))
    if end >= 0 and start >= 0:
        return text[start + len(_ANSWER_OPEN):end]
    return text[text.rfind(_ANSWER_OPEN) + len(_ANSWER_OPEN):]


def answer_region(text: Any) -> str:
    """The part of ``text`` that answers are read from: the ``<answer>`` content if present, else all of it."""
    text = text if isinstance(text, str) else ""
    answer = extract_answer(text)
    return text if answer is None else answer


# ---------------------------------------------------------------------------------------------------- smart_resize


def smart_resize(
    height: float,
    width: float,
    factor: int = IMAGE_FACTOR,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> tuple[int, int]:
    """The ``(height, width)`` a Qwen2/2.5-VL processor resizes an image to.

    Both sides are rounded to the nearest multiple of ``factor`` (at least ``factor``). If the rounded area exceeds
    ``max_pixels``, both sides are scaled down by √(H·W / max_pixels) and floored to multiples of ``factor``; if it
    is below ``min_pixels``, they are scaled up by √(min_pixels / (H·W)) and ceiled. Qwen2.5-VL boxes are written in
    pixels of this resized frame. Unlike ``qwen-vl-utils`` 0.0.14, a side scaled down is never floored below
    ``factor`` (there it can become 0 for extreme aspect ratios with a small ``max_pixels``); otherwise the results
    agree.

    Args:
        height: Original image height in pixels.
        width: Original image width in pixels.
        factor: Side lengths are multiples of this (28 = 14-pixel patches merged 2×2).
        min_pixels: Lower bound on the resized area.
        max_pixels: Upper bound on the resized area.

    Returns:
        ``(resized_height, resized_width)``, note the height-first order (as in ``qwen-vl-utils``).

    Raises:
        ValueError: For non-positive sizes or an aspect ratio above 200.
    """
    if not (_positive(height) and _positive(width)):
        raise ValueError(f"smart_resize needs positive finite height and width, got {height!r} x {width!r}")
    if factor < 1 or min_pixels < 0 or max_pixels < factor * factor or min_pixels > max_pixels:
        raise ValueError(f"invalid smart_resize bounds: factor={factor}, min_pixels={min_pixels}, "
                         f"max_pixels={max_pixels}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio of {width}x{height} exceeds {MAX_ASPECT_RATIO}")
    new_h = max(factor, round(height / factor) * factor)
    new_w = max(factor, round(width / factor) * factor)
    if new_h * new_w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        new_h = max(factor, math.floor(height / shrink / factor) * factor)
        new_w = max(factor, math.floor(width / shrink / factor) * factor)
    elif new_h * new_w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        new_h = math.ceil(height * grow / factor) * factor
        new_w = math.ceil(width * grow / factor) * factor
    return int(new_h), int(new_w)


def qwen_resized_size(
    original_size: Sequence[float],
    *,
    factor: int = IMAGE_FACTOR,
    min_pixels: int = MIN_PIXELS,
    max_pixels: int = MAX_PIXELS,
) -> tuple[int, int]:
    """:func:`smart_resize` in this module's ``(width, height)`` order: original size → resized model input size.

    Equivalently, for a processed image, ``(image_grid_thw[2] * 14, image_grid_thw[1] * 14)``.
    """
    width, height = checked_size(original_size, "original_size")
    resized_h, resized_w = smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return resized_w, resized_h


# ---------------------------------------------------------------------------------------------------- conventions


def _positive(value: Any) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value)) and value > 0
    except OverflowError:  # an int too large for a float
        return False


def checked_size(size: Any, name: str) -> tuple[float, float]:
    """``(width, height)`` as floats; a ``ValueError`` naming ``name`` unless ``size`` holds two finite positive
    numbers."""
    if isinstance(size, (list, tuple)) and len(size) == 2 and all(_positive(v) for v in size):
        return float(size[0]), float(size[1])
    raise ValueError(f"{name} must be (width, height) with two positive numbers, got {size!r}")


def _scale(convention: str, original_size: Any, resized_size: Any) -> tuple[float, float]:
    """(sx, sy) with original_pixels = coordinate · (sx, sy) for ``convention``."""
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown box convention {convention!r}; expected one of {', '.join(CONVENTIONS)}")
    if convention == "absolute":
        return 1.0, 1.0
    if original_size is None:
        raise ValueError(f"box convention {convention!r} needs the original image size (width, height)")
    width, height = checked_size(original_size, "original_size")
    if convention in ("qwen2_vl", "qwen3_vl", "glm4v"):
        return width / 1000.0, height / 1000.0
    if convention == "relative":
        return width, height
    if resized_size is None:
        raise ValueError(
            "box convention 'qwen2_5_vl' needs resized_size, the (width, height) the processor resized the image to "
            "(see qwen_resized_size / smart_resize); coordinates are pixels of that resized image"
        )
    resized_w, resized_h = checked_size(resized_size, "resized_size")
    return width / resized_w, height / resized_h


def to_original(
    box: Sequence[float], convention: Convention, original_size: Sequence[float] | None,
    resized_size: Sequence[float] | None = None,
) -> list[float]:
    """Map a box from ``convention`` coordinates to original-image pixels (no clamping or cleaning).

    Args:
        box: ``[x1, y1, x2, y2]`` in ``convention`` coordinates.
        convention: One of :data:`CONVENTIONS`.
        original_size: ``(width, height)`` of the original image (may be ``None`` for ``"absolute"``).
        resized_size: ``(width, height)`` of the resized model input; required for ``"qwen2_5_vl"``.
    """
    sx, sy = _scale(convention, original_size, resized_size)
    x1, y1, x2, y2 = (float(v) for v in box)
    return [x1 * sx, y1 * sy, x2 * sx, y2 * sy]


def from_original(
    box: Sequence[float], convention: Convention, original_size: Sequence[float] | None,
    resized_size: Sequence[float] | None = None,
) -> list[float]:
    """Inverse of :func:`to_original`: original-image pixels → ``convention`` coordinates (what a model writes)."""
    sx, sy = _scale(convention, original_size, resized_size)
    x1, y1, x2, y2 = (float(v) for v in box)
    return [x1 / sx, y1 / sy, x2 / sx, y2 / sy]


def convert_box(
    box: Sequence[float], source: Convention, target: Convention, original_size: Sequence[float] | None,
    resized_size: Sequence[float] | None = None,
) -> list[float]:
    """Convert a box between two conventions of the same image (via original pixels)."""
    return from_original(to_original(box, source, original_size, resized_size), target, original_size, resized_size)


def clean_box(box: Sequence[float], original_size: Sequence[float] | None = None) -> list[float] | None:
    """Normalise a box in original pixels: sort swapped corners, clamp to the image, reject bad boxes.

    Coordinates are clamped below at 0 and, when ``original_size`` is given, above at the width/height.

    Returns:
        ``[x1, y1, x2, y2]`` with ``x1 < x2`` and ``y1 < y2``, or ``None`` for non-finite values or a box of zero
        width or height after clamping.
    """
    if len(box) != 4:
        return None
    values = [float(v) for v in box]
    if not all(math.isfinite(v) for v in values):
        return None
    x1, x2 = sorted((values[0], values[2]))
    y1, y2 = sorted((values[1], values[3]))
    width, height = (math.inf, math.inf) if original_size is None else checked_size(original_size, "original_size")
    x1, x2 = min(max(x1, 0.0), width), min(max(x2, 0.0), width)
    y1, y2 = min(max(y1, 0.0), height), min(max(y2, 0.0), height)
    if not (x2 > x1 and y2 > y1):
        return None
    return [x1, y1, x2, y2]


# ---------------------------------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class Detection:
    """One parsed box with its optional label and confidence.

    Attributes:
        box: ``[x1, y1, x2, y2]`` in original-image pixels.
        label: Category name, if the model wrote one.
        score: Confidence, if the model wrote one (used to rank predictions).
    """

    box: tuple[float, float, float, float]
    label: str | None = None
    score: float | None = None


# Patterns are bounded (no nested unbounded repetition) so that adversarial text cannot make them backtrack
# catastrophically.
_NUM = r"(?<![0-9.])[-+]?(?:[0-9]{1,40}(?:\.[0-9]{0,40})?|\.[0-9]{1,40})(?:[eE][-+]?[0-9]{1,5})?"
_WS = r"\s{0,64}"
_SEP = rf"{_WS},{_WS}"
_LIST4 = re.compile(rf"[\[(]{_WS}({_NUM}){_SEP}({_NUM}){_SEP}({_NUM}){_SEP}({_NUM}){_WS}[\])]")
# Between the two corners: a comma with up to 64 spaces on each side, or up to 128 spaces. (Written as
# "\s{0,64},?\s{0,64}" this is the same language, but a run of spaces without a comma could be split between the two
# quantifiers in ~64² ways before failing.)
_PAIR = re.compile(
    rf"\({_WS}({_NUM}){_SEP}({_NUM}){_WS}\)(?:{_SEP}|\s{{0,128}})\({_WS}({_NUM}){_SEP}({_NUM}){_WS}\)"
)
_NUMBER = re.compile(_NUM)
_BOX_TOKENS = re.compile(
    r"(?:<\|object_ref_start\|>(?P<label>[^<]{0,200})<\|object_ref_end\|>\s*)?"
    r"<\|box_start\|>(?P<body>[^<]{0,400})<\|box_end\|>"
)
# GLM-4.1V / GLM-4.5V mark an answer's boxes with <|begin_of_box|> … <|end_of_box|>, in any bracket style ([], [[]],
# (), <>), one box or several ([[x1,y1,x2,y2], [x1,y1,x2,y2]]): zai-org/GLM-V@8fc9756 README "Grounding".
_GLM_BOX_TOKENS = re.compile(r"<\|begin_of_box\|>(?P<body>[^|]{0,2000})<\|end_of_box\|>")
# InternVL: an optional <ref>label</ref> and one or several boxes between <box> and </box>.
_INTERNVL_BOX_TOKENS = re.compile(r"(?:<ref>(?P<label>[^<]{0,200})</ref>\s*)?<box>(?P<body>[^<]{0,2000})</box>")
_OBJECT = re.compile(r"\{[^{}]{0,2000}\}")
_KEYED_LIST4 = re.compile(
    rf"""["']?(?:bbox_2d|bbox|box|bounding_box|position)["']?{_WS}:{_WS}{_LIST4.pattern}""", re.IGNORECASE
)
_LABEL = re.compile(rf"""["']?(?:label|category|class)["']?{_WS}:{_WS}(?:"([^"]{{0,200}})"|'([^']{{0,200}})')""",
                    re.IGNORECASE)
_SCORE = re.compile(rf"""["']?(?:confidence|score|conf)["']?{_WS}:{_WS}({_NUM})""", re.IGNORECASE)


def _numbers(groups: Sequence[str]) -> list[float]:
    return [float(g) for g in groups]


def _untaken(spans: list[tuple[int, int]], taken: list[tuple[int, int]]) -> list[bool]:
    """For each span (sorted, disjoint), whether it overlaps none of ``taken`` (sorted, disjoint): one merge pass."""
    free, index = [], 0
    for start, end in spans:
        while index < len(taken) and taken[index][1] <= start:  # taken spans ending before this one starts
            index += 1
        free.append(index == len(taken) or taken[index][0] >= end)
    return free


def _merge(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Two sorted lists of spans merged into one sorted list (linear: ``heapq.merge`` of sorted runs)."""
    return list(heapq.merge(a, b))


def _raw_detections(text: str) -> list[tuple[int, list[float], str | None, float | None]]:
    """(position, raw box, label, score) for every box-like span of ``text``, in order of appearance.

    Syntaxes are matched in order of priority (box tokens, JSON-like objects, plain lists, corner pairs); a span is
    used only if it overlaps no span of a higher priority. Each pattern does bounded work per starting position and
    the overlap test is a merge of sorted span lists, so the whole parse is linear in ``len(text)``.
    """
    found: list[tuple[int, list[float], str | None, float | None]] = []
    taken: list[tuple[int, int]] = []  # spans used so far, sorted and disjoint

    tokens = list(_BOX_TOKENS.finditer(text))
    for match in tokens:
        numbers = _NUMBER.findall(match.group("body"))
        if len(numbers) == 4:
            label = match.group("label")
            found.append((match.start(), _numbers(numbers), label.strip() if label else None, None))
    glm_tokens = list(_GLM_BOX_TOKENS.finditer(text))
    for match in glm_tokens:
        numbers = _NUMBER.findall(match.group("body"))
        if numbers and len(numbers) % 4 == 0:  # one box or several, four numbers each
            found.extend((match.start(), _numbers(numbers[i:i + 4]), None, None) for i in range(0, len(numbers), 4))
    internvl_tokens = list(_INTERNVL_BOX_TOKENS.finditer(text))
    for match in internvl_tokens:
        numbers = _NUMBER.findall(match.group("body"))
        if numbers and len(numbers) % 4 == 0:  # every box of a <box> takes its <ref> label
            label = (match.group("label") or "").strip() or None
            found.extend((match.start(), _numbers(numbers[i:i + 4]), label, None) for i in range(0, len(numbers), 4))
    taken = sorted([match.span() for match in (*tokens, *glm_tokens, *internvl_tokens)])

    objects = list(_OBJECT.finditer(text))
    used = []
    for match, free in zip(objects, _untaken([m.span() for m in objects], taken), strict=True):
        if not free:
            continue
        body = match.group(0)
        box_match = _KEYED_LIST4.search(body) or _LIST4.search(body)
        if box_match is None:
            continue
        used.append(match.span())
        label_match = _LABEL.search(body)
        label = None if label_match is None else (label_match.group(1) or label_match.group(2) or "").strip()
        score_match = _SCORE.search(body)
        score = None if score_match is None else float(score_match.group(1))
        if score is not None and math.isnan(score):
            score = None
        found.append((match.start(), _numbers(box_match.groups()), label or None, score))
    taken = _merge(taken, used)

    for pattern in (_LIST4, _PAIR):
        matches = list(pattern.finditer(text))
        used = []
        for match, free in zip(matches, _untaken([m.span() for m in matches], taken), strict=True):
            if free:
                used.append(match.span())
                found.append((match.start(), _numbers(match.groups()), None, None))
        taken = _merge(taken, used)
    found.sort(key=lambda item: item[0])
    return found


def parse_detections(
    text: Any,
    convention: Convention,
    original_size: Sequence[float] | None,
    resized_size: Sequence[float] | None = None,
    *,
    max_chars: int | None = None,
) -> list[Detection]:
    """Every box in a model's text, with label and confidence when written, in original-image pixels.

    With ``max_chars``, only the last ``max_chars`` characters of the text are read (the answer comes at the end);
    the work is linear in what is read. Boxes are read from the ``<answer>…</answer>`` content when the text read
    has an answer tag (the last block, see :func:`extract_answer`), else from all of it. Each box is converted from
    ``convention`` to original pixels, then cleaned by :func:`clean_box` (swapped corners sorted, clamped to the
    image, degenerate and non-finite boxes dropped). Never raises on any text; invalid ``convention`` or sizes raise
    ``ValueError``, a ``max_chars`` below 1 raises ``RewardError``.

    Args:
        text: The model output (non-strings yield no boxes).
        convention: Coordinate convention of the text, one of :data:`CONVENTIONS`.
        original_size: ``(width, height)`` of the original image; may be ``None`` only for ``"absolute"`` (then
            boxes are not clamped above).
        resized_size: ``(width, height)`` of the resized model input, required for ``"qwen2_5_vl"``.
        max_chars: How many characters, from the end of the text, are read (None: all; the rewards read
            :data:`MAX_ANSWER_CHARS`).
    """
    sx, sy = _scale(convention, original_size, resized_size)  # validates the arguments before looking at the text
    if original_size is not None:
        checked_size(original_size, "original_size")
    if max_chars is not None:
        check_max_chars(max_chars)
        text = text[-max_chars:] if isinstance(text, str) else text
    detections = []
    for _, raw, label, score in _raw_detections(answer_region(text)):
        x1, y1, x2, y2 = raw
        box = clean_box([x1 * sx, y1 * sy, x2 * sx, y2 * sy], original_size)
        if box is not None:
            detections.append(Detection(tuple(box), label, score))  # type: ignore[arg-type]
    return detections


def parse_boxes(
    text: Any,
    convention: Convention,
    original_size: Sequence[float] | None,
    resized_size: Sequence[float] | None = None,
    *,
    max_chars: int | None = None,
) -> list[list[float]]:
    """Every box in a model's text as ``[x1, y1, x2, y2]`` floats in original-image pixels.

    See :func:`parse_detections` (this drops labels and confidences). Returns ``[]`` when nothing parses.

    Args:
        text: The model output.
        convention: Coordinate convention of the text, one of :data:`CONVENTIONS`.
        original_size: ``(width, height)`` of the original image (may be ``None`` for ``"absolute"``).
        resized_size: ``(width, height)`` of the resized model input, required for ``"qwen2_5_vl"``.
        max_chars: How many characters, from the end of the text, are read (None: all).

    Example:
        >>> parse_boxes('<answer>{"bbox_2d": [100, 50, 300, 150], "label": "dog"}</answer>', "qwen2_vl", (640, 480))
        [[64.0, 24.0, 192.0, 72.0]]
    """
    return [list(d.box) for d in parse_detections(text, convention, original_size, resized_size, max_chars=max_chars)]


# ---------------------------------------------------------------------------------------------------- geometry


def box_area(box: Sequence[float]) -> float:
    """Area of ``[x1, y1, x2, y2]`` (0 for an empty or inverted box)."""
    return max(0.0, box[2] - box[0]) * max(0.0, box[3] - box[1])


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union |A∩B| / |A∪B| ∈ [0, 1] (0 when the union is empty)."""
    inter = max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = box_area(a) + box_area(b) - inter
    if not union > 0 or not math.isfinite(union):
        return 0.0
    return min(1.0, max(0.0, inter / union))


def box_giou(a: Sequence[float], b: Sequence[float]) -> float:
    """Generalised IoU = IoU − |C \\ (A∪B)| / |C| ∈ [−1, 1], with C the smallest box enclosing A and B."""
    inter = max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = box_area(a) + box_area(b) - inter
    hull = (max(a[2], b[2]) - min(a[0], b[0])) * (max(a[3], b[3]) - min(a[1], b[1]))
    if not (union > 0 and hull > 0 and math.isfinite(hull)):
        return 0.0
    giou = inter / union - (hull - union) / hull
    return min(1.0, max(-1.0, giou))


__all__ = [
    "CONVENTIONS",
    "Convention",
    "Detection",
    "IMAGE_FACTOR",
    "MAX_ANSWER_CHARS",
    "MAX_PIXELS",
    "MAX_WHOLE_CHARS",
    "MIN_PIXELS",
    "answer_region",
    "box_area",
    "box_giou",
    "box_iou",
    "check_max_chars",
    "checked_size",
    "clean_box",
    "completion_text",
    "completion_texts",
    "convert_box",
    "extract_answer",
    "from_original",
    "parse_boxes",
    "parse_detections",
    "qwen_resized_size",
    "smart_resize",
    "to_original",
]
