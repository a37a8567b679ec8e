"""``shapes``: a rule-based, GenEval-like checker of the shapes world's images (docs/shapes.md).

It reads pixels only, with no model: every pixel is classified against the world's palette, the coloured pixels
are grouped into objects, each object gets a shape, and the objects are checked against the requirements that the
dataset row carries as structured metadata (``row["objects"]``, ``row["relation"]``, see
:mod:`mmrl.plugins.flow.shapes.world`); the prompt text is never parsed.

Detection (per image of side H × W; the thresholds scale with the image area, quoted here for 32 × 32)
    1. Pixel colours: a pixel belongs to palette colour k when k is its nearest palette colour (RGB, Euclidean) and
       the distance is at most ``max_color_distance`` (80: half the distance between the two closest palette
       colours, red and yellow, so the assignment is unique). Background pixels and blends (anti-aliased or blurry
       edges, mixtures of two colours) are left out.
    2. Objects: 4-connected components of the pixels of one colour, kept when their area is at least
       ``min_area_fraction`` · H · W (16 px), their bounding box at most 0.6 · side on each axis (19 px) and their
       aspect ratio (long / short side of the box) at most 1.6.
    3. Shape: the component is compared with three templates drawn in its own bounding box (pixel centres inside
       the inscribed ellipse, the full box, the inscribed apex-up isosceles triangle), by IoU. It is a *square*
       when IoU(square) ≥ 0.92 (it fills 92% of its box), otherwise a *circle* or a *triangle*, whichever IoU is
       higher, when that IoU is at least 0.6; otherwise it has no shape and is ignored. Every rendering of the world
       is classified correctly (tested over thousands of random layouts).
    4. Position: the object's centroid (mean pixel centre), its box width w and height h.

Score (GenEval's partial credit as Flow-GRPO trains on it, made exact for this world)
    For each object requirement i (shape s_i, colour c_i, count n_i) with m_i detected objects of shape s_i (any
    colour) and k_i of them of colour c_i:

    - count:  q = max(0, 1 − |n_i − m_i| / n_i)     (present in the right number: extra objects of the shape cost);
    - colour: q = min(k_i, n_i) / n_i                 (that many of them have the right colour).

    With a relation (``objects[0]`` *rel* ``objects[1]``), one more requirement:

    - position: q = 1 if some detected object matching objects[0] (shape and colour) and some matching objects[1]
      satisfy the relation, else 0. With centroids (x right, y down), A is *above* B when
      y_B − y_A ≥ (h_A + h_B) / 4 (half their mean height), *below* when y_A − y_B ≥ (h_A + h_B) / 4, *left of*
      when x_B − x_A ≥ (w_A + w_B) / 4 and *right of* when x_A − x_B ≥ (w_A + w_B) / 4; the other axis is free, as
      in GenEval.

    The score is the mean of the requirement scores, in [0, 1]: a single object has 2 requirements, two objects 4,
    a position prompt 5. With ``strict: true`` it is GenEval's accuracy instead: 1 when every requirement scores 1,
    else 0. Objects of shapes that the row does not mention are not penalised (GenEval does not either).

    Examples: "a red circle" drawn as a blue circle scores (1 + 0) / 2 = 0.5; as two red circles (0 + 1) / 2 = 0.5;
    "a red circle above a blue square" with both objects right but side by side scores 4 / 5 = 0.8.

Malformed images are scored, never raised on: a blank, grey, noisy or any-size image simply has no (or few) objects.
Images with non-finite pixels score NaN, the convention of every image reward (``rewards.on_nonfinite`` decides, see
:mod:`mmrl.rewards.images`). A dataset row without ``objects`` is a configuration error and raises a
:class:`~mmrl.reward.RewardError` naming the rows.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import torch
from torch import Tensor

from mmrl.plugins.flow.shapes.world import BACKGROUND, PALETTE, RELATIONS, SHAPES
from mmrl.registry import Range
from mmrl.reward import Reward, RewardError, RewardInput
from mmrl.rewards.images import read_images

COLOR_NAMES = tuple(PALETTE)
SQUARE_IOU = 0.92
MIN_SHAPE_IOU = 0.6
MAX_SIDE_FRACTION = 0.6
MAX_ASPECT = 1.6
MIN_AREA_FRACTION = 16 / 1024


@dataclass(frozen=True)
class Detected:
    """One object found in an image: its shape and colour names, centroid (x right, y down) and box size."""

    shape: str
    color: str
    cx: float
    cy: float
    width: int
    height: int
    area: int


# ---------------------------------------------------------------------------------------------------------- detection
def classify_pixels(image: np.ndarray, max_color_distance: float = 80.0) -> np.ndarray:
    """``[..., H, W]`` int: the index in ``COLOR_NAMES`` of each pixel of ``[..., H, W, 3]`` uint8 images, or −1 for
    the background, blends and anything farther than ``max_color_distance`` from its nearest palette colour.

    Squared distances are exact integers; the nearest colour is their argmin (the square root is monotone and keeps
    distinct integers below 3·255² apart) and only the nearest one's distance is rooted for the threshold."""
    colors = np.array([BACKGROUND, *(PALETTE[name] for name in COLOR_NAMES)], dtype=np.int32)  # [1 + K, 3]
    pixels = image.astype(np.int32)
    squared = sum((pixels[..., channel, None] - colors[:, channel]) ** 2 for channel in range(3))  # [..., H, W, 1 + K]
    nearest = squared.argmin(-1)
    close = np.sqrt(np.take_along_axis(squared, nearest[..., None], -1)[..., 0]) <= max_color_distance
    return np.where(close & (nearest > 0), nearest - 1, -1)


def connected_components(labels: np.ndarray) -> np.ndarray:
    """``[..., H, W]`` int component ids (0 where ``labels`` is −1) of the 4-connected regions of equal label, in
    each ``[H, W]`` image of a batch separately: every pixel takes the largest id of its region (ids are the
    flat positions in the whole array, plus one, so the images' ids never collide).

    Each round a pixel takes the largest id among itself and its joined neighbours, then the id that the pixel its
    id names holds now (pointer jumping: ids always name pixels of the same region, so the jump stays inside it and
    long regions converge in a logarithmic number of rounds); it stops when nothing changes. The fixed point is the
    region's largest position (that pixel's id can only be itself), as plain propagation would give."""
    active = labels >= 0
    ids = np.where(active, np.arange(1, labels.size + 1).reshape(labels.shape), 0)
    same_down = active[..., 1:, :] & (labels[..., 1:, :] == labels[..., :-1, :])  # pixel (i+1, j) and (i, j) joined
    same_right = active[..., :, 1:] & (labels[..., :, 1:] == labels[..., :, :-1])
    while True:
        new = ids.copy()
        new[..., 1:, :] = np.where(same_down, np.maximum(new[..., 1:, :], ids[..., :-1, :]), new[..., 1:, :])
        new[..., :-1, :] = np.where(same_down, np.maximum(new[..., :-1, :], ids[..., 1:, :]), new[..., :-1, :])
        new[..., :, 1:] = np.where(same_right, np.maximum(new[..., :, 1:], ids[..., :, :-1]), new[..., :, 1:])
        new[..., :, :-1] = np.where(same_right, np.maximum(new[..., :, :-1], ids[..., :, 1:]), new[..., :, :-1])
        new = np.concatenate([[0], new.ravel()])[new]  # the jump: entry k holds pixel k - 1's id, entry 0 stays 0
        if np.array_equal(new, ids):
            return ids
        ids = new


@functools.lru_cache(maxsize=4096)
def _templates(height: int, width: int) -> dict[str, np.ndarray]:
    """The three shape templates drawn in an ``[height, width]`` box (cached: the same box sizes recur; read-only)."""
    y = (np.arange(height) + 0.5)[:, None]
    x = (np.arange(width) + 0.5)[None, :]
    templates = {
        "circle": ((x - width / 2) / (width / 2)) ** 2 + ((y - height / 2) / (height / 2)) ** 2 <= 1,
        "square": np.ones((height, width), dtype=bool),
        "triangle": np.abs(x - width / 2) <= (y / height) * (width / 2),
    }
    for template in templates.values():
        template.flags.writeable = False
    return templates


def template_ious(mask: np.ndarray) -> dict[str, float]:
    """IoU of a region, given as its bounding-box crop ``[h, w]`` bool, with each shape's template drawn in its box."""
    return {name: float(np.count_nonzero(mask & template) / max(np.count_nonzero(mask | template), 1))
            for name, template in _templates(*mask.shape).items()}


def shape_from_ious(ious: dict[str, float]) -> str | None:
    """The shape of a region from its :func:`template_ious` (step 3 of the module docstring), or None."""
    if ious["square"] >= SQUARE_IOU:
        return "square"
    best = max(("circle", "triangle"), key=lambda name: ious[name])
    return best if ious[best] >= MIN_SHAPE_IOU else None


def shape_of(mask: np.ndarray) -> str | None:
    """The shape of a component given as its bounding-box crop ``[h, w]`` bool (see the module docstring)."""
    return shape_from_ious(template_ious(mask))


@dataclass(frozen=True)
class Component:
    """A candidate object: one colour's connected region that passes the size and aspect filters, cropped to its
    box (``mask [h, w]`` bool), with its colour name, centroid, area and :func:`template_ious`."""

    mask: np.ndarray
    color: str
    cx: float
    cy: float
    area: int
    ious: dict[str, float]


def components(image: np.ndarray, max_color_distance: float = 80.0,
               min_area_fraction: float = MIN_AREA_FRACTION) -> list[Component]:
    """The candidate objects of a ``[H, W, 3]`` uint8 image (steps 1 and 2 of the module docstring)."""
    return batch_components(image[None], max_color_distance, min_area_fraction)[0]


def batch_components(images: np.ndarray, max_color_distance: float = 80.0,
                     min_area_fraction: float = MIN_AREA_FRACTION) -> list[list[Component]]:
    """The candidate objects of each of ``[N, H, W, 3]`` uint8 images of one size (steps 1 and 2 of the module
    docstring), found for the whole batch at once: pixel classes and components in array operations over every
    image, then each component's area, box and centroid from its pixels sorted by component (``np.*.reduceat``),
    so only the components that pass the size and aspect filters are visited one by one (to crop their masks).
    Each image's list is in increasing component id (the order a per-image search finds them in)."""
    count, height, width = images.shape[:3]
    labels = classify_pixels(images, max_color_distance)  # [N, H, W]
    ids = connected_components(labels)  # [N, H, W]
    found: list[list[Component]] = [[] for _ in range(count)]
    flat = ids.ravel()
    pixels = np.flatnonzero(flat)  # [P] flat positions of the classified pixels
    if not len(pixels):
        return found
    order = np.argsort(flat[pixels], kind="stable")  # row-major within each component
    pixels = pixels[order]
    component = flat[pixels]  # [P], non-decreasing
    starts = np.flatnonzero(np.r_[True, component[1:] != component[:-1]])  # [C] first pixel of each component
    areas = np.diff(np.r_[starts, len(pixels)])  # [C]
    image_index, ys, xs = np.unravel_index(pixels, ids.shape)
    y0, y1 = np.minimum.reduceat(ys, starts), np.maximum.reduceat(ys, starts)  # [C]
    x0, x1 = np.minimum.reduceat(xs, starts), np.maximum.reduceat(xs, starts)
    box_h, box_w = y1 - y0 + 1, x1 - x0 + 1
    keep = ((areas >= max(1.0, min_area_fraction * height * width))
            & (box_h <= MAX_SIDE_FRACTION * height) & (box_w <= MAX_SIDE_FRACTION * width)
            & (np.maximum(box_h, box_w) <= MAX_ASPECT * np.minimum(box_h, box_w)))
    cx = np.add.reduceat(xs, starts) / areas + 0.5  # [C] mean pixel centre: integer sums, exact
    cy = np.add.reduceat(ys, starts) / areas + 0.5
    first = labels.ravel()[pixels[starts]]  # [C] the component's palette index
    for c in np.flatnonzero(keep):
        n = int(image_index[starts[c]])
        mask = ids[n, y0[c]:y1[c] + 1, x0[c]:x1[c] + 1] == component[starts[c]]
        found[n].append(Component(mask, COLOR_NAMES[int(first[c])], float(cx[c]), float(cy[c]), int(areas[c]),
                                  template_ious(mask)))
    return found


def detect(image: np.ndarray, max_color_distance: float = 80.0,
           min_area_fraction: float = MIN_AREA_FRACTION) -> list[Detected]:
    """The objects of a ``[H, W, 3]`` uint8 image."""
    return objects_of(components(image, max_color_distance, min_area_fraction))


def objects_of(items: Sequence[Component]) -> list[Detected]:
    """The objects among candidate :class:`Component` s: those with a shape (step 3 of the module docstring)."""
    found = []
    for item in items:
        shape = shape_from_ious(item.ious)
        if shape is not None:
            box_h, box_w = item.mask.shape
            found.append(Detected(shape, item.color, item.cx, item.cy, box_w, box_h, item.area))
    return found


# ---------------------------------------------------------------------------------------------------------- scoring
def relation_satisfied(relation: str, a: Detected, b: Detected) -> bool:
    """Whether ``a`` is ``relation`` ``b`` (centroids, the margins of the module docstring)."""
    if relation == "above":
        return b.cy - a.cy >= (a.height + b.height) / 4
    if relation == "below":
        return a.cy - b.cy >= (a.height + b.height) / 4
    if relation == "left of":
        return b.cx - a.cx >= (a.width + b.width) / 4
    if relation == "right of":
        return a.cx - b.cx >= (a.width + b.width) / 4
    raise RewardError(f"reward 'shapes': unknown relation {relation!r}; one of {', '.join(RELATIONS)}")


def requirement_scores(row: dict[str, Any], found: Sequence[Detected]) -> list[tuple[str, float]]:
    """``[(name, score in [0, 1]), ...]``: the requirements of ``row`` (module docstring) scored on ``found``."""
    scores = []
    objects = row["objects"]
    for i, spec in enumerate(objects):
        shape, color, count = spec["shape"], spec["color"], int(spec.get("count", 1))
        of_shape = [item for item in found if item.shape == shape]
        matching = sum(item.color == color for item in of_shape)
        scores.append((f"count[{i}]", max(0.0, 1.0 - abs(count - len(of_shape)) / count)))
        scores.append((f"color[{i}]", min(matching, count) / count))
    relation = row.get("relation")
    if relation is not None:
        a_spec, b_spec = objects[0], objects[1]
        a_found = [item for item in found if (item.shape, item.color) == (a_spec["shape"], a_spec["color"])]
        b_found = [item for item in found if (item.shape, item.color) == (b_spec["shape"], b_spec["color"])]
        holds = any(relation_satisfied(relation, a, b) for a in a_found for b in b_found if a is not b)
        scores.append(("position", 1.0 if holds else 0.0))
    return scores


def score_row(row: dict[str, Any], found: Sequence[Detected], strict: bool = False) -> float:
    """The partial-credit score (or, ``strict``, the 0/1 accuracy) of one image's objects for ``row``."""
    values = [value for _, value in requirement_scores(row, found)]
    if strict:
        return float(all(value == 1.0 for value in values))
    return float(sum(values) / len(values))


def check_row(row: dict[str, Any], index: int, reward: str = "shapes") -> None:
    """Raise a one-line RewardError (naming ``reward``) unless ``row`` carries the world's structured requirements."""
    objects = row.get("objects")
    where = f"reward {reward!r}: dataset row {index} ({row.get('prompt', '')!r})"
    if not isinstance(objects, list) or not objects:
        raise RewardError(f"{where} has no 'objects' list (the shapes world's rows carry their requirements; "
                          "write them with `python -m mmrl.plugins.flow.shapes.world FOLDER`)")
    for spec in objects:
        if not isinstance(spec, dict) or spec.get("shape") not in SHAPES or spec.get("color") not in PALETTE:
            raise RewardError(f"{where}: object {spec!r} needs a shape in {SHAPES} and a colour in {COLOR_NAMES}")
        if int(spec.get("count", 1)) < 1:
            raise RewardError(f"{where}: object {spec!r} needs a count >= 1")
    relation = row.get("relation")
    if relation is not None and (relation not in RELATIONS or len(objects) != 2):
        raise RewardError(f"{where}: relation {relation!r} needs one of {RELATIONS} and exactly two objects")


# The ranges _RowPixelReward checks again for direct calls: a positive colour distance, an area fraction below 1.
ColorDistance = Annotated[float, Range(0, low_open=True)]
AreaFraction = Annotated[float, Range(0, 1, high_open=True)]


class _RowPixelReward(Reward):
    """What ``shapes`` and ``shape_fidelity`` share: the detector's options, the row check and the detection over the
    batch (:func:`batch_components` once per image size; non-finite images score NaN); a subclass scores one finite
    image's candidate objects for its row (``score_found``)."""

    name = ""

    def __init__(self, max_color_distance: float, min_area_fraction: float, output: str):
        if not max_color_distance > 0:
            raise RewardError(f"reward {self.name!r}: max_color_distance must be > 0, got {max_color_distance!r}")
        if not 0 <= min_area_fraction < 1:
            raise RewardError(f"reward {self.name!r}: min_area_fraction must be in [0, 1), got "
                              f"{min_area_fraction!r}")
        self.max_color_distance = float(max_color_distance)
        self.min_area_fraction = float(min_area_fraction)
        self.output = output

    def score_found(self, row: dict[str, Any], items: list[Component]) -> float:
        raise NotImplementedError

    def check_rows(self, rows: list[dict[str, Any]]) -> None:
        """Raise a one-line RewardError for a row this reward cannot score (default: :func:`check_row`)."""
        for index, row in enumerate(rows):
            check_row(row, index, self.name)

    def __call__(self, batch: RewardInput) -> Tensor:
        self.check_rows(list(batch.rows))
        images = read_images(batch, self.output, self.name)
        scores = torch.zeros(len(batch), dtype=torch.float64)
        by_size: dict[tuple[int, ...], list[int]] = {}
        for i in range(len(batch)):
            if bool(images.finite[i]):  # the others score NaN below
                by_size.setdefault(tuple(images.images[i].shape), []).append(i)
        for indices in by_size.values():  # the detector runs once per image size, over all its images
            stack = torch.stack([images.images[i] for i in indices]).permute(0, 2, 3, 1).cpu().numpy()  # [n, H, W, 3]
            found = batch_components(stack, self.max_color_distance, self.min_area_fraction)
            for i, items in zip(indices, found, strict=True):
                scores[i] = self.score_found(batch.rows[i], items)
        return images.nan_where_invalid(scores)


class ShapesReward(_RowPixelReward):
    """GenEval-like partial credit of the shapes world (module docstring): presence and count, colour, position."""

    name = "shapes"

    def __init__(self, strict: bool = False, max_color_distance: ColorDistance = 80.0,
                 min_area_fraction: AreaFraction = MIN_AREA_FRACTION, output: str = "images"):
        """Options (the config's ``args``).

        Args:
            strict: Score GenEval's 0/1 accuracy (every requirement met) instead of the partial credit.
            max_color_distance: A pixel farther than this (RGB, 0–255 units) from its nearest palette colour is
                ignored.
            min_area_fraction: Components smaller than this fraction of the image are ignored (16 px at 32 × 32).
            output: Payload entry holding the images.
        """
        super().__init__(max_color_distance, min_area_fraction, output)
        self.strict = bool(strict)

    def score_found(self, row: dict[str, Any], items: list[Component]) -> float:
        return score_row(row, objects_of(items), self.strict)


# ---------------------------------------------------------------------------------------------------------- fidelity
def fidelity_row(row: dict[str, Any], items: Sequence[Component]) -> float:
    """The ``shape_fidelity`` score of one image's candidate objects for ``row`` (see :class:`ShapeFidelityReward`)."""
    values = []
    for spec in row["objects"]:
        shape, color, count = spec["shape"], spec["color"], int(spec.get("count", 1))
        ious = sorted((item.ious[shape] for item in items if item.color == color), reverse=True)[:count]
        values.append(sum(ious) / count)
    return float(sum(values) / len(values))


class ShapeFidelityReward(_RowPixelReward):
    """A dense companion of ``shapes`` for training: how closely the regions of each requested colour match the
    requested shape, so that a blob that is *almost* a square already earns more than a round one.

    For each object requirement (shape s, colour c, count n), the candidate objects of colour c (the regions that
    ``shapes`` considers, before its shape threshold) are ranked by their IoU with the s-template drawn in their own
    box; the requirement scores the sum of the n best IoUs divided by n (a missing region scores 0). The reward is the
    mean over the requirements, in [0, 1]. An exact rendering of a square scores 1; a disc of the same colour where a
    square is asked scores about π/4 ≈ 0.79, which ``shapes`` scores 0 (its square threshold is 0.92).

    ``shapes`` stays the measure (it is GenEval's kind of score: an object is there or it is not); this one only
    makes the training signal smoother, the way reward shaping adds a dense term to a sparse goal.
    """

    name = "shape_fidelity"

    def __init__(self, max_color_distance: ColorDistance = 80.0, min_area_fraction: AreaFraction = MIN_AREA_FRACTION,
                 output: str = "images"):
        """Options (the config's ``args``): as :class:`ShapesReward` (without ``strict``)."""
        super().__init__(max_color_distance, min_area_fraction, output)

    def score_found(self, row: dict[str, Any], items: list[Component]) -> float:
        return fidelity_row(row, items)
