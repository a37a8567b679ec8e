"""The shapes world: 32×32 RGB images of one to three flat shapes on a white background, each with its prompt.

Everything here is exact and deterministic (numpy only, no diffusers): the palette, the shape geometry, the prompt
grammar, the layouts drawn for a prompt, and the split of compositions into training and held-out prompts.

Objects
    4 colours (:data:`COLORS`, RGB values in :data:`PALETTE`) × 3 shapes (:data:`SHAPES`) = 12 object types. An
    object of size ``s`` (9 to 11.5 px) centred at (cx, cy) covers the pixels whose centre ``(j + 0.5, i + 0.5)``
    lies inside it (hard edges, no anti-aliasing, so every pixel is exactly a palette colour or the background):

    - circle: radius s/2;
    - square: axis-aligned, side 0.85·s;
    - triangle: isosceles, apex up, base 1.15·s, height s.

Positions (:func:`layout`, :func:`slots`)
    The layout of a prompt is fixed up to a small jitter (:data:`JITTER` pixels on each axis) and the sizes: one
    object sits in the middle, two side by side (the first on the left), three in a triangle; "A above B" puts A
    over B in the middle column, "A to the left of B" A left of B in the middle row. With positions drawn anywhere,
    or in random quadrants, the pretrained model of this size scattered patch-sized fragments of each object over
    the image after 3,000 steps (docs/shapes.md): choosing *where* is what a 4-block pixel transformer learns last,
    and a demo that runs on a CPU cannot wait for it. What remains to learn is what GenEval scores: the right
    shapes, colours bound to the right shapes, the right number, and the relation word mapped to the right place.

Prompts (:func:`prompt_text`), as GenEval's tasks (Ghosh et al. 2023, arXiv:2310.11513)
    ``single_object`` "a red circle"; ``two_object`` "a red circle and a blue square" (two different shapes, so a
    colour must be bound to the right shape); ``counting`` "two red circles" / "three blue triangles";
    ``position`` "a red circle above a blue square" (``above``, ``below``, ``to the left of``, ``to the right of``).

Rows
    Every prompt is a dataset row carrying its requirements as structured metadata, which the ``shapes`` reward
    (:mod:`mmrl.rewards.shapes`) reads instead of parsing the text::

        {"prompt": "a red circle above a blue square", "task": "position",
         "objects": [{"shape": "circle", "color": "red", "count": 1},
                     {"shape": "square", "color": "blue", "count": 1}],
         "relation": "above"}

    ``relation`` (or null) relates ``objects[0]`` to ``objects[1]``.

Held-out compositions (:func:`split`)
    The pairs of object types (different shapes, any colours: 3 shape pairs × 16 colour pairs = 48) are split 36 / 12:
    for shape pair k, the 4 colour pairs (c, (c + k + 1) mod 4) are held out, so every colour and every shape pair
    still occurs in training, but a held-out pair never appears together in any training prompt (neither with "and"
    nor in any relation or order). Likewise 6 of the 24 (colour, shape, count) combinations and 3 of the 12 single
    objects are held out; every held-out object type is still seen in training in other prompts.

Wrong captions (:func:`corrupt_row`)
    For pretraining, a row can be copied with exactly one attribute changed (an object's colour or shape, a count off
    by one, the relation reversed) and that copy drawn under the original caption: the pretraining script's
    ``--caption-noise`` share of images, which makes the model draw a prompt right only part of the time.

Files (:func:`write_dataset`, committed in ``assets/data``): ``train_metadata.jsonl`` (135 rows: 9 single, 18
counting, 36 two-object, 72 position: two relations per training pair) is the RL training set, and
``test_metadata.jsonl`` (45 rows: 3, 6, 12, 24 of the held-out prompts) the evaluation set: both with the same task
proportions. :func:`training_rows` lists every training composition (the 288 position prompts included); the
pretraining script draws from all of them, task first.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

RESOLUTION = 32
"""Image side in pixels."""
BACKGROUND = (255, 255, 255)
COLORS = ("red", "green", "blue", "yellow")
PALETTE = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30)}
SHAPES = ("circle", "square", "triangle")
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles"}
NUMBERS = {1: "a", 2: "two", 3: "three"}
RELATIONS = ("above", "below", "left of", "right of")
RELATION_TEXT = {"above": "above", "below": "below", "left of": "to the left of", "right of": "to the right of"}
TASKS = ("single_object", "two_object", "counting", "position")
WORDS = ("a", "and", "above", "below", "to", "the", "left", "right", "of", "two", "three", *COLORS, *SHAPES,
         *PLURALS.values())
"""Every word of the prompt grammar (the tokenizers of the world's model know each as one token)."""

SIZE_RANGE = (9.0, 11.5)
"""Object size s in pixels (uniform)."""
JITTER = 1.0
"""An object's centre lies within this many pixels (uniform, each axis) of its slot."""
GAP = 2.0
"""Minimum gap in pixels between the bounding boxes of two objects of a layout."""
SQUARE_SIDE = 0.85
TRIANGLE_BASE = 1.15


# ---------------------------------------------------------------------------------------------------------- objects
@dataclass(frozen=True)
class Placed:
    """One object of a layout: its shape, colour, centre (x right, y down, in pixels) and size."""

    shape: str
    color: str
    cx: float
    cy: float
    size: float

    def half_extent(self) -> tuple[float, float]:
        """Half width and half height of the object's bounding box."""
        return half_extent(self.shape, self.size)


def half_extent(shape: str, size: float) -> tuple[float, float]:
    if shape == "circle":
        return size / 2, size / 2
    if shape == "square":
        return SQUARE_SIDE * size / 2, SQUARE_SIDE * size / 2
    if shape == "triangle":
        return TRIANGLE_BASE * size / 2, size / 2
    raise ValueError(f"unknown shape {shape!r}; the world has {', '.join(SHAPES)}")


def shape_mask(shape: str, cx: float, cy: float, size: float, resolution: int = RESOLUTION) -> np.ndarray:
    """``[R, R]`` bool: the pixels whose centres lie inside the shape (see the module docstring)."""
    centres = np.arange(resolution, dtype=np.float64) + 0.5
    x = centres[None, :] - cx  # [1, R]
    y = centres[:, None] - cy  # [R, 1]
    if shape == "circle":
        return x * x + y * y <= (size / 2) ** 2
    if shape == "square":
        half = SQUARE_SIDE * size / 2
        return (np.abs(x) <= half) & (np.abs(y) <= half)
    if shape == "triangle":
        top, height, half_base = -size / 2, size, TRIANGLE_BASE * size / 2
        depth = y - top  # 0 at the apex, `height` at the base
        return (depth >= 0) & (depth <= height) & (np.abs(x) <= depth / height * half_base)
    raise ValueError(f"unknown shape {shape!r}; the world has {', '.join(SHAPES)}")


def render(objects: Sequence[Placed], resolution: int = RESOLUTION) -> np.ndarray:
    """``[R, R, 3]`` uint8: the objects drawn in order on the background."""
    image = np.empty((resolution, resolution, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    for item in objects:
        if item.color not in PALETTE:
            raise ValueError(f"unknown colour {item.color!r}; the world has {', '.join(COLORS)}")
        image[shape_mask(item.shape, item.cx, item.cy, item.size, resolution)] = PALETTE[item.color]
    return image


# ---------------------------------------------------------------------------------------------------------- prompts
def _article(count: int) -> str:
    return NUMBERS[count]


def object_phrase(spec: dict[str, Any]) -> str:
    """``{"shape": "circle", "color": "red", "count": 2}`` → "two red circles"."""
    count = int(spec.get("count", 1))
    noun = spec["shape"] if count == 1 else PLURALS[spec["shape"]]
    return f"{_article(count)} {spec['color']} {noun}"


def prompt_text(row: dict[str, Any]) -> str:
    """The prompt of a row from its structured fields (the inverse of nothing: rewards read the fields)."""
    objects, relation = row["objects"], row.get("relation")
    if relation is not None:
        return f"{object_phrase(objects[0])} {RELATION_TEXT[relation]} {object_phrase(objects[1])}"
    return " and ".join(object_phrase(spec) for spec in objects)


def make_row(task: str, objects: Sequence[tuple[str, str, int]], relation: str | None = None) -> dict[str, Any]:
    """A dataset row from ``(colour, shape, count)`` triples."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; one of {', '.join(TASKS)}")
    if relation is not None and relation not in RELATIONS:
        raise ValueError(f"unknown relation {relation!r}; one of {', '.join(RELATIONS)}")
    row: dict[str, Any] = {
        "prompt": "",
        "task": task,
        "objects": [{"shape": shape, "color": color, "count": int(count)} for color, shape, count in objects],
        "relation": relation,
    }
    row["prompt"] = prompt_text(row)
    return row


# ---------------------------------------------------------------------------------------------------------- layouts
def _boxes_apart(a: Placed, b: Placed, gap: float = GAP) -> bool:
    (aw, ah), (bw, bh) = a.half_extent(), b.half_extent()
    return abs(a.cx - b.cx) >= aw + bw + gap or abs(a.cy - b.cy) >= ah + bh + gap


def slots(count: int, relation: str | None = None, resolution: int = RESOLUTION) -> list[tuple[float, float]]:
    """The centres (x right, y down) of a layout of ``count`` objects, in the row's object order: one object in the
    middle; two side by side (the first on the left; for a relation, the first where the relation puts it); three in
    a triangle (two on top, one below)."""
    quarter, middle = resolution / 4, resolution / 2
    left, right, top, bottom = quarter, 3 * quarter, quarter, 3 * quarter
    if count == 1:
        return [(middle, middle)]
    if count == 2:
        arrangements = {None: [(left, middle), (right, middle)], "left of": [(left, middle), (right, middle)],
                        "right of": [(right, middle), (left, middle)], "above": [(middle, top), (middle, bottom)],
                        "below": [(middle, bottom), (middle, top)]}
        return arrangements[relation]
    if count == 3:
        return [(left, top), (right, top), (middle, bottom)]
    raise ValueError(f"the world lays out 1 to 3 objects, not {count}")


def relation_holds(relation: str, a: Placed, b: Placed) -> bool:
    """The layout rule of the renderer: ``a`` is clearly ``relation`` ``b`` (boxes separated by GAP along the
    relation's axis, centres at most half the larger box apart across it)."""
    (aw, ah), (bw, bh) = a.half_extent(), b.half_extent()
    dx, dy = b.cx - a.cx, b.cy - a.cy  # from a to b
    if relation in ("above", "below"):
        along = dy if relation == "above" else -dy
        return along >= ah + bh + GAP and abs(dx) <= max(aw, bw)
    along = dx if relation == "left of" else -dx
    return along >= aw + bw + GAP and abs(dy) <= max(ah, bh)


def layout(row: dict[str, Any], rng: np.random.Generator, resolution: int = RESOLUTION,
           max_tries: int = 1_000) -> list[Placed]:
    """Object placements for ``row`` drawn from ``rng``: the :func:`slots` of its objects, each moved by up to
    :data:`JITTER` pixels on each axis, with random sizes (redrawn until no two boxes come closer than GAP and the
    relation holds)."""
    wanted = [(spec["shape"], spec["color"]) for spec in row["objects"] for _ in range(int(spec.get("count", 1)))]
    relation = row.get("relation")
    centres = slots(len(wanted), relation, resolution)
    for _ in range(max_tries):
        placed = [Placed(shape, color, cx + float(rng.uniform(-JITTER, JITTER)),
                         cy + float(rng.uniform(-JITTER, JITTER)), float(rng.uniform(*SIZE_RANGE)))
                  for (shape, color), (cx, cy) in zip(wanted, centres, strict=True)]
        if not all(_boxes_apart(a, b) for a, b in itertools.combinations(placed, 2)):
            continue
        if relation is not None and not relation_holds(relation, placed[0], placed[1]):
            continue
        return placed
    raise RuntimeError(f"no layout found for {row['prompt']!r} in {max_tries} tries")


def sample_images(rows: Sequence[dict[str, Any]], rng: np.random.Generator,
                  resolution: int = RESOLUTION) -> np.ndarray:
    """``[N, R, R, 3]`` uint8: one random rendering of each row."""
    return np.stack([render(layout(row, rng, resolution), resolution) for row in rows])


# ---------------------------------------------------------------------------------------------------------- captions
CORRUPTIONS = ("color", "shape", "count", "relation")
"""The ways a pretraining caption can be wrong about its image (:func:`corrupt_row`)."""
OPPOSITE = {"above": "below", "below": "above", "left of": "right of", "right of": "left of"}


def corrupt_row(row: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """A copy of ``row`` with exactly one attribute changed, to draw an image that its caption gets wrong.

    Pretraining captions are imperfect as alt-text is (Betker et al. 2023, "Improving Image Generation with Better
    Captions"): drawing some images from a corrupted row leaves the pretrained model able to draw each prompt right
    but doing so only part of the time, which is what GenEval measures and what RL improves. One kind of error is
    drawn uniformly among those that apply to the row (:data:`CORRUPTIONS`):

    - ``color``: one object (all instances of a counted one) gets another colour;
    - ``shape``: one object gets another shape;
    - ``count``: a counted object is drawn once more or once less (1 to 3), a single object twice;
    - ``relation``: the relation is reversed (above ↔ below, left of ↔ right of).
    """
    objects = [dict(spec) for spec in row["objects"]]
    relation = row.get("relation")
    kinds = ["color", "shape"]
    if len(objects) == 1:
        kinds.append("count")
    if relation is not None:
        kinds.append("relation")
    kind = kinds[int(rng.integers(len(kinds)))]
    target = objects[int(rng.integers(len(objects)))]
    if kind == "color":
        target["color"] = [c for c in COLORS if c != target["color"]][int(rng.integers(len(COLORS) - 1))]
    elif kind == "shape":
        target["shape"] = [s for s in SHAPES if s != target["shape"]][int(rng.integers(len(SHAPES) - 1))]
    elif kind == "count":
        count = int(target.get("count", 1))
        options = [n for n in (count - 1, count + 1) if 1 <= n <= 3]
        target["count"] = options[int(rng.integers(len(options)))]
    else:
        relation = OPPOSITE[relation]
    return {**row, "objects": objects, "relation": relation, "corruption": kind}


def with_caption_noise(rows: Sequence[dict[str, Any]], caption_noise: float,
                       rng: np.random.Generator) -> list[dict[str, Any]]:
    """The rows to draw for ``rows``: each replaced, with probability ``caption_noise``, by its :func:`corrupt_row`
    (the caption, ``row["prompt"]``, is the original's either way)."""
    if not caption_noise:
        return list(rows)
    return [corrupt_row(row, rng) if rng.random() < caption_noise else row for row in rows]


# ---------------------------------------------------------------------------------------------------------- split
def object_types() -> list[tuple[str, str]]:
    """The 12 (colour, shape) object types."""
    return [(color, shape) for color in COLORS for shape in SHAPES]


def _pairs() -> list[tuple[tuple[str, str], tuple[str, str], bool]]:
    """The 48 unordered pairs of object types with different shapes, as ((c1, s1), (c2, s2), held_out) with
    s1 before s2 in SHAPES."""
    pairs = []
    for k, (s1, s2) in enumerate(itertools.combinations(SHAPES, 2)):
        for i, c1 in enumerate(COLORS):
            for j, c2 in enumerate(COLORS):
                pairs.append(((c1, s1), (c2, s2), j == (i + k + 1) % len(COLORS)))
    return pairs


def _count_held_out(color_index: int, shape_index: int, count: int) -> bool:
    residue = (color_index + shape_index) % len(COLORS)
    return residue == (0 if count == 2 else 2)


def _single_held_out(color_index: int, shape_index: int) -> bool:
    return color_index == (shape_index + 1) % len(COLORS)


def all_rows() -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every prompt of the world, ``{"train" | "held_out": {task: rows}}``, in a fixed order."""
    out: dict[str, dict[str, list[dict[str, Any]]]] = {side: {task: [] for task in TASKS}
                                                        for side in ("train", "held_out")}
    for i, color in enumerate(COLORS):
        for k, shape in enumerate(SHAPES):
            side = "held_out" if _single_held_out(i, k) else "train"
            out[side]["single_object"].append(make_row("single_object", [(color, shape, 1)]))
    for count in (2, 3):
        for i, color in enumerate(COLORS):
            for k, shape in enumerate(SHAPES):
                side = "held_out" if _count_held_out(i, k, count) else "train"
                out[side]["counting"].append(make_row("counting", [(color, shape, count)]))
    for (c1, s1), (c2, s2), held in _pairs():
        side = "held_out" if held else "train"
        out[side]["two_object"].append(make_row("two_object", [(c1, s1, 1), (c2, s2, 1)]))
        for (ca, sa), (cb, sb) in (((c1, s1), (c2, s2)), ((c2, s2), (c1, s1))):
            for relation in RELATIONS:
                out[side]["position"].append(make_row("position", [(ca, sa, 1), (cb, sb, 1)], relation))
    return out


def training_rows() -> list[dict[str, Any]]:
    """Every training composition (288 position prompts included); pretraining draws from these."""
    return [row for rows in all_rows()["train"].values() for row in rows]


def _two_relations_per_pair(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows 8k..8k+7 are the 2 orders × 4 relations of one pair: keep one vertical and one horizontal relation, in
    the first and second order respectively, rotating the choice from pair to pair."""
    kept = []
    for k in range(0, len(rows), 2 * len(RELATIONS)):
        block = rows[k:k + 2 * len(RELATIONS)]
        pair = k // (2 * len(RELATIONS))
        kept.append(block[pair % 2])  # above or below, first order
        kept.append(block[len(RELATIONS) + 2 + (pair // 2) % 2])  # left of or right of, second order
    return kept


def split() -> dict[str, list[dict[str, Any]]]:
    """The dataset files: ``{"train": 135 rows, "test": 45 rows}`` (see the module docstring)."""
    rows = all_rows()
    out = {}
    for side, name in (("train", "train"), ("held_out", "test")):
        tasks = rows[side]
        out[name] = [*tasks["single_object"], *tasks["counting"], *tasks["two_object"],
                     *_two_relations_per_pair(tasks["position"])]
    return out


def write_dataset(folder: str | Path) -> Path:
    """Write ``train_metadata.jsonl`` and ``test_metadata.jsonl`` (the flow plugin's dataset-folder layout)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in split().items():
        text = "".join(json.dumps(row) + "\n" for row in rows)
        (folder / f"{name}_metadata.jsonl").write_text(text)
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mmrl.plugins.flow.shapes.world FOLDER``: write the dataset files; ``--preview PNG`` also draws
    one rendering of every row of the held-out file."""
    import argparse

    parser = argparse.ArgumentParser(description="Write the shapes world's prompt files.")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--preview", type=Path, help="Also write a captioned grid of held-out renderings here.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    folder = write_dataset(args.folder)
    print(folder)
    if args.preview is not None:
        import torch

        from mmrl.plugins.flow.images import save_caption_grid

        rows = split()["test"]
        images = torch.from_numpy(sample_images(rows, np.random.default_rng(args.seed))).permute(0, 3, 1, 2)
        print(save_caption_grid(images.float() / 255, [row["prompt"] for row in rows], args.preview))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
