"""The grounding world: images of one to four coloured shapes with three kinds of questions and exact answers.

Everything here is deterministic in its seed and needs numpy and Pillow only.

Images
    Width and height multiples of :data:`GRID` (28) pixels in [:data:`MIN_SIDE`, :data:`MAX_SIDE`] with an area of
    at most :data:`MAX_AREA` (aspect ratios from 1:3 to 3:1), so that the Qwen processors at the recipe's pixel
    bounds (16 to 64 image tokens) keep them at their size and a box in pixels of the resized image is a box in the
    image's own pixels. A plain or a textured background (:data:`BACKGROUNDS`: flat, noise, stripes, checks on a
    neutral grey) and one to four objects, all under a faint **coordinate ramp** (:data:`RAMP`, :func:`ramp`): red
    rises from left to right and blue from top to bottom, by the same number of levels per pixel in every image.
    Objects: 4 colours (:data:`PALETTE`) × 3 shapes (:data:`SHAPES`), each in a square box whose side is 18–34% of
    the image's shorter side, at least :data:`GAP` pixels from the others (boxes may touch the image border). An
    object covers the pixels whose centres lie inside it (no anti-aliasing): a circle inscribed in its box, a square
    filling it, a triangle with its apex at the top middle and its base along the bottom. Boxes are integer pixels
    ``[x1, y1, x2, y2]`` of the original image (x2, y2 exclusive).

Questions (:data:`KINDS`), each a dataset row with its ground truth in original-image pixels
    - ``locate``: "Locate the red circle." Exactly one object of that colour and shape; the other objects share its
      colour or its shape more often than chance, so both words matter. Solution: its box; scored by ``iou``.
    - ``find``: "Find every circle." One to three objects of that shape (any colours) among others. Solution: their
      boxes in reading order; scored by ``detection``.
    - ``count``: "How many red shapes are there?" One to three objects of that colour among others. Solution: the
      number; scored by ``count``.

Held-out compositions (:func:`held_out_region`)
    The image is cut into 3 × 3 places (:data:`PLACES`; an object is where its centre is). Each of the 12 object
    types (colour, shape) has one held-out place, chosen so that every place is held out for one or two types. **No
    training image holds an object of a type at its held-out place**, as target or as distractor. Every evaluation
    question asks about such an object: the object to locate, one of the objects to find, one of the shapes to count
    is a (colour, shape, place) combination never seen in training.

Answers (:func:`answer_text`)
    The completion the pretraining teaches, in the model family's own box convention (``qwen2_5_vl``: JSON
    ``bbox_2d`` in pixels of the resized image; ``qwen2_vl``: box tokens on the 0–1000 grid), with a short thinking
    part: the object asked for (``locate``; see :func:`think_text` for why not its place), how many objects there
    are (``find``) or the shapes of that colour (``count``)::

        <think>the red circle</think><answer>{"bbox_2d": [12, 30, 61, 79]}</answer>
        <think>2 circles</think><answer>[{"bbox_2d": [12, 30, 61, 79]}, {"bbox_2d": [140, 8, 182, 50]}]</answer>
        <think>circle, triangle</think><answer>2</answer>

Files (:func:`write_split`): PNGs and a JSONL in the VLM plugin's format (``image``, ``problem``, ``solution``,
``task``, and ``image_size``, ``objects``, ``kind`` kept in the rows), which ``plugin.data`` reads as it reads any
dataset. ``python -m mmrl.plugins.vlm.grounding.world DIR`` writes the recipe's training and evaluation splits.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

COLORS = ("red", "green", "blue", "yellow")
PALETTE = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30)}
SHAPES = ("circle", "square", "triangle")
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles"}
KINDS = ("locate", "find", "count")
ROWS, COLUMNS = ("top", "middle", "bottom"), ("left", "centre", "right")
PLACES = ("top left", "top", "top right", "left", "centre", "right", "bottom left", "bottom", "bottom right")
"""The 3 × 3 places of an image, row by row (index = 3 · row + column)."""
BACKGROUNDS = ("flat", "noise", "stripes", "checks")
SPLITS = ("train", "test")

MIN_SIDE, MAX_SIDE = 112, 336
"""Image width and height in pixels."""
GRID = 28
"""Image sides are multiples of this (a Qwen2-VL/Qwen2.5-VL image token covers 28 × 28 pixels)."""
MAX_AREA = 64 * GRID * GRID
"""Largest image area in pixels (64 image tokens), the recipe's ``max_pixels``."""
SIDES = tuple(range(MIN_SIDE, MAX_SIDE + 1, GRID))
"""The possible widths and heights."""
RAMP = 40.0
"""Half the range, in 8-bit levels, of the background's coordinate ramp over :data:`MAX_SIDE` pixels."""
OBJECT_SIDE = (0.18, 0.34)
"""An object's box side as a fraction of the image's shorter side (uniform)."""
GAP = 4
"""Minimum gap in pixels between two objects' boxes."""
MAX_OBJECTS = 4

QUESTIONS = {
    "locate": "Locate the {color} {shape}.",
    "find": "Find every {shape}.",
    "count": "How many {color} shapes are there?",
}


# ---------------------------------------------------------------------------------------------------------- objects
@dataclass(frozen=True)
class Thing:
    """One object: colour, shape and its box ``(x1, y1, x2, y2)`` in integer pixels (x2, y2 exclusive)."""

    color: str
    shape: str
    box: tuple[int, int, int, int]

    @property
    def kind(self) -> tuple[str, str]:
        return self.color, self.shape

    def place(self, width: int, height: int) -> str:
        """The 3 × 3 place of the object's centre."""
        x1, y1, x2, y2 = self.box
        column = min(2, int(3 * (x1 + x2) / 2 / width))
        row = min(2, int(3 * (y1 + y2) / 2 / height))
        return PLACES[3 * row + column]

    def to_dict(self) -> dict[str, Any]:
        return {"color": self.color, "shape": self.shape, "box": list(self.box)}


def held_out_region(color: str, shape: str) -> str:
    """The place where objects of this type never appear in training (and where the evaluation asks about them).

    Type (c, s) is held out at place (3c + 4s) mod 9: the 12 types cover all 9 places, three places twice.
    """
    return PLACES[(3 * COLORS.index(color) + 4 * SHAPES.index(shape)) % 9]


def is_held_out(thing: Thing, width: int, height: int) -> bool:
    return thing.place(width, height) == held_out_region(thing.color, thing.shape)


def shape_mask(shape: str, box: Sequence[int], width: int, height: int) -> np.ndarray:
    """``[H, W]`` bool: the pixels whose centres lie inside the shape drawn in ``box``."""
    x1, y1, x2, y2 = (float(v) for v in box)
    xs = np.arange(width, dtype=np.float64)[None, :] + 0.5  # [1, W]
    ys = np.arange(height, dtype=np.float64)[:, None] + 0.5  # [H, 1]
    inside = (xs >= x1) & (xs <= x2) & (ys >= y1) & (ys <= y2)  # [H, W]
    if shape == "square":
        return inside
    cx, cy, half_w, half_h = (x1 + x2) / 2, (y1 + y2) / 2, (x2 - x1) / 2, (y2 - y1) / 2
    if shape == "circle":
        return ((xs - cx) / half_w) ** 2 + ((ys - cy) / half_h) ** 2 <= 1.0
    if shape == "triangle":
        depth = (ys - y1) / (y2 - y1)  # 0 at the apex, 1 at the base
        return inside & (np.abs(xs - cx) <= depth * half_w)
    raise ValueError(f"unknown shape {shape!r}; the world has {', '.join(SHAPES)}")


def background(kind: str, width: int, height: int, rng: np.random.Generator) -> np.ndarray:
    """``[H, W, 3]`` float background levels: a neutral light grey, flat or with a low-contrast texture that changes
    the three channels alike (:func:`render` adds the coordinate ramp and rounds)."""
    if kind not in BACKGROUNDS:
        raise ValueError(f"unknown background {kind!r}; one of {', '.join(BACKGROUNDS)}")
    base = rng.uniform(175.0, 215.0)
    image = np.full((height, width, 3), base, dtype=np.float64)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float64)  # [H, W] each
    if kind == "noise":
        image = image + rng.normal(0.0, rng.uniform(6.0, 14.0), size=(height, width, 1))
    elif kind == "stripes":
        angle, period = rng.uniform(0.0, np.pi), rng.uniform(6.0, 18.0)
        phase = (xs * np.cos(angle) + ys * np.sin(angle)) * 2 * np.pi / period
        image = image + rng.uniform(10.0, 22.0) * np.sin(phase)[..., None]
    elif kind == "checks":
        cell = int(rng.integers(6, 17))
        parity = ((xs // cell + ys // cell) % 2) * 2 - 1  # [H, W] in {-1, 1}
        image = image + rng.uniform(8.0, 18.0) * parity[..., None]
    return image


def render(things: Sequence[Thing], width: int, height: int, background_kind: str, seed: int) -> np.ndarray:
    """``[H, W, 3]`` uint8: the background drawn from ``seed``, then the objects in order, all under the coordinate
    ramp (:func:`ramp`)."""
    image = background(background_kind, width, height, np.random.default_rng(seed))  # [H, W, 3] float64
    for thing in things:
        if thing.color not in PALETTE:
            raise ValueError(f"unknown colour {thing.color!r}; the world has {', '.join(COLORS)}")
        image[shape_mask(thing.shape, thing.box, width, height)] = PALETTE[thing.color]
    return np.clip(np.rint(image + ramp(width, height)), 0, 255).astype(np.uint8)


def ramp(width: int, height: int) -> np.ndarray:
    """``[H, W, 3]`` the coordinate ramp added to every pixel, background and objects alike: ``RAMP · (2 (x + ½) /
    MAX_SIDE − 1)`` levels of red and the same in y of blue, in absolute pixels (the same slope in every image), as if
    the scene were lit by a faint coloured gradient.

    Why: neither Qwen2.5-VL's vision tower nor its language model has an absolute position embedding (2-D rotary
    and M-RoPE positions are relative), so a model trained from scratch must learn to turn relative positions into
    pixel coordinates before it can write a box; real checkpoints learn that from web-scale data, and the world's
    1.6 M-parameter model had not after 30 minutes of pretraining on a CPU without the ramp (docs/vlm.md, "The
    grounding world"). The ramp plays the part of a vision transformer's absolute position embedding, added in pixel
    space: every pixel's red and blue, against its green and its colour, tell its column and row.
    """
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float64)  # [H, W] each
    shift = np.zeros((height, width, 3))
    shift[..., 0] = RAMP * (2.0 * (xs + 0.5) / MAX_SIDE - 1.0)
    shift[..., 2] = RAMP * (2.0 * (ys + 0.5) / MAX_SIDE - 1.0)
    return shift


# ---------------------------------------------------------------------------------------------------------- scenes
def _apart(a: Sequence[int], b: Sequence[int]) -> bool:
    return a[2] + GAP <= b[0] or b[2] + GAP <= a[0] or a[3] + GAP <= b[1] or b[3] + GAP <= a[1]


def _place_thing(kind: tuple[str, str], placed: list[Thing], width: int, height: int, rng: np.random.Generator,
                 split: str, at_held_out: bool) -> Thing | None:
    """A box for an object of ``kind`` clear of ``placed``: at its held-out place (``at_held_out``), anywhere but
    there (training), or anywhere (other evaluation objects); None when 200 tries found none."""
    short = min(width, height)
    for _ in range(200):
        side = int(round(rng.uniform(*OBJECT_SIDE) * short))
        x1, y1 = int(rng.integers(0, width - side + 1)), int(rng.integers(0, height - side + 1))
        thing = Thing(kind[0], kind[1], (x1, y1, x1 + side, y1 + side))
        held = is_held_out(thing, width, height)
        if at_held_out != held and (at_held_out or split == "train"):
            continue
        if all(_apart(thing.box, other.box) for other in placed):
            return thing
    return None


def _kinds(question: str, rng: np.random.Generator) -> tuple[tuple[str, str], list[tuple[str, str]], list[int]]:
    """The subject of a question (colour, shape; one of them unused by find/count) and the object types of a scene:
    ``(subject, kinds, asked)`` with ``asked`` the indices of the objects the question is about."""
    color, shape = COLORS[int(rng.integers(4))], SHAPES[int(rng.integers(3))]
    total = int(rng.integers(1, MAX_OBJECTS + 1))
    all_kinds = [(c, s) for c in COLORS for s in SHAPES]
    if question == "locate":
        others = [k for k in all_kinds if k != (color, shape)]
        confusable = [k for k in others if k[0] == color or k[1] == shape]
        kinds = [(color, shape)]
        for _ in range(total - 1):
            pool = confusable if rng.uniform() < 0.6 else others
            kinds.append(pool[int(rng.integers(len(pool)))])
        return (color, shape), kinds, [0]
    asked_count = int(rng.integers(1, min(3, total) + 1))
    if question == "find":
        kinds = [(COLORS[int(rng.integers(4))], shape) for _ in range(asked_count)]
        rest = [k for k in all_kinds if k[1] != shape]
    else:
        kinds = [(color, SHAPES[int(rng.integers(3))]) for _ in range(asked_count)]
        rest = [k for k in all_kinds if k[0] != color]
    kinds += [rest[int(rng.integers(len(rest)))] for _ in range(total - asked_count)]
    return (color, shape), kinds, list(range(asked_count))


def make_scene(question: str, split: str, rng: np.random.Generator) -> dict[str, Any]:
    """One question of kind ``question`` with its image description, drawn from ``rng``.

    Returns:
        ``{"kind", "subject": [colour, shape], "width", "height", "background", "background_seed", "things"}``
        with ``things`` the :class:`Thing` objects, those the question asks about first.
    """
    if question not in KINDS:
        raise ValueError(f"unknown question kind {question!r}; one of {', '.join(KINDS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; one of {', '.join(SPLITS)}")
    while True:
        width = SIDES[int(rng.integers(len(SIDES)))]
        heights = [side for side in SIDES if side * width <= MAX_AREA]
        height = heights[int(rng.integers(len(heights)))]
        subject, kinds, asked = _kinds(question, rng)
        # Evaluation: the first asked object sits at its held-out place; training: no object ever does.
        things: list[Thing] = []
        for index, kind in enumerate(kinds):
            thing = _place_thing(kind, things, width, height, rng, split, at_held_out=split == "test" and index == 0)
            if thing is None:
                break
            things.append(thing)
        if len(things) == len(kinds):
            return {"kind": question, "subject": list(subject), "width": width, "height": height,
                    "background": BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))],
                    "background_seed": int(rng.integers(2**31)), "things": things, "asked": asked}


def reading_order(things: Sequence[Thing]) -> list[Thing]:
    """Objects sorted top to bottom, then left to right, by their boxes' centres (the order of find answers)."""
    return sorted(things, key=lambda t: (t.box[1] + t.box[3], t.box[0] + t.box[2]))


def scene_row(scene: dict[str, Any]) -> dict[str, Any]:
    """The dataset record of a scene (without its image): question, solution and everything to redraw it."""
    color, shape = scene["subject"]
    things: list[Thing] = scene["things"]
    asked = [things[i] for i in scene["asked"]]
    kind = scene["kind"]
    if kind == "locate":
        solution: Any = list(asked[0].box)
        task = "grounding"
    elif kind == "find":
        solution = [list(t.box) for t in reading_order(asked)]
        task = "detection"
    else:
        solution = len(asked)
        task = "counting"
    return {
        "problem": QUESTIONS[kind].format(color=color, shape=shape),
        "solution": solution,
        "task": task,
        "kind": kind,
        "subject": {"color": color, "shape": shape},
        "image_size": [scene["width"], scene["height"]],
        "background": scene["background"],
        "background_seed": scene["background_seed"],
        "objects": [t.to_dict() for t in things],
    }


def scene_rows_every_object(scene: dict[str, Any]) -> list[dict[str, Any]]:
    """A locate scene's questions about each of its objects that is the only one of its kind (colour and shape) in
    the scene, the scene's own question first: the same image with as many answers as objects, which the image
    alone cannot tell apart (only the question does)."""
    if scene["kind"] != "locate":
        raise ValueError(f"only locate scenes ask about each object, not {scene['kind']!r}")
    things: list[Thing] = scene["things"]
    kinds = [t.kind for t in things]
    order = [scene["asked"][0], *(i for i in range(len(things)) if i != scene["asked"][0])]
    return [scene_row({**scene, "subject": list(things[i].kind), "asked": [i]})
            for i in order if kinds.count(things[i].kind) == 1]


def scene_rows(scene: dict[str, Any], every_object: bool = False) -> list[dict[str, Any]]:
    """A scene's records: its question, or with ``every_object`` a locate scene's question about each of its lone
    objects (:func:`scene_rows_every_object`)."""
    if every_object and scene["kind"] == "locate":
        return scene_rows_every_object(scene)
    return [scene_row(scene)]


def things_of(record: dict[str, Any]) -> list[Thing]:
    """The objects of a dataset record."""
    return [Thing(o["color"], o["shape"], tuple(int(v) for v in o["box"])) for o in record["objects"]]


def record_image(record: dict[str, Any]) -> np.ndarray:
    """``[H, W, 3]`` uint8: the image of a dataset record, redrawn from its description."""
    width, height = record["image_size"]
    return render(things_of(record), int(width), int(height), record["background"], int(record["background_seed"]))


def make_records(count: int, split: str, seed: int, kinds: Sequence[str] = KINDS, every_object: bool = False
                 ) -> list[dict[str, Any]]:
    """``count`` dataset records of ``split``, the scenes' kinds in turn; deterministic in ``seed`` and ``split``. A
    kind listed twice gets twice the scenes (``("locate", "locate", "find", "count")``: half of them locate). With
    ``every_object`` a locate scene gives a question about each of its objects alone of its kind
    (:func:`scene_rows_every_object`, one to four records of one image), so locate questions are about half of the
    records with the three kinds."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"question kinds must be a non-empty list of {', '.join(KINDS)}, got {list(kinds)}")
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    records: list[dict[str, Any]] = []
    scenes = 0
    while len(records) < count:
        scene = make_scene(kinds[scenes % len(kinds)], split, rng)
        records.extend(scene_rows(scene, every_object))
        scenes += 1
    return records[:count]


# ---------------------------------------------------------------------------------------------------------- answers
def think_text(record: dict[str, Any]) -> str:
    """The thinking part of the pretraining answer: the object asked for (locate), how many objects there are
    (find), or the shapes of that colour in reading order (count).

    A locate answer once thought the object's 3 × 3 place first ("top left"). Greedy answers hinge on their thinking,
    and the place (the object's centre against the image's width and height) was harder for the world's small model
    than the box itself: after 1,000 pretraining steps its greedy place was the same for every image and its boxes
    followed it (held-out IoU 0.02), while the same model given the true place wrote boxes of IoU 0.23 (docs/vlm.md,
    "The grounding world"). The thinking now names the object, which it can always get right.
    """
    things = things_of(record)
    color, shape = record["subject"]["color"], record["subject"]["shape"]
    if record["kind"] == "locate":
        return f"the {color} {shape}"
    if record["kind"] == "find":
        number = len(record["solution"])
        return f"{number} {shape if number == 1 else PLURALS[shape]}"
    return ", ".join(t.shape for t in reading_order([t for t in things if t.color == color]))


def box_text(box: Sequence[float], convention: str, image_size: Sequence[float],
             resized_size: Sequence[float] | None) -> str:
    """One box as the family writes it (the body of :func:`mmrl.plugins.vlm.data.box_answer`, without tags)."""
    from mmrl.plugins.vlm.data import box_answer

    return box_answer(box, convention, image_size, resized_size)[len("<answer>"):-len("</answer>")]


def answer_text(record: dict[str, Any], convention: str, resized_size: Sequence[float] | None) -> str:
    """The completion that answers ``record`` exactly, in the box ``convention`` of a model family.

    Args:
        record: A dataset record (:func:`scene_row`).
        convention: ``qwen2_5_vl`` (JSON, pixels of the resized image), ``qwen2_vl`` (box tokens, 0–1000 grid),
            ``qwen3_vl`` (JSON, 0–1000 grid), ``absolute`` or ``relative``.
        resized_size: ``(width, height)`` of the processor's resized image (needed by ``qwen2_5_vl``).
    """
    size = record["image_size"]
    kind = record["kind"]
    if kind == "count":
        body = str(record["solution"])
    elif kind == "locate":
        body = box_text(record["solution"], convention, size, resized_size)
    elif convention == "qwen2_vl":
        body = "".join(box_text(box, convention, size, resized_size) for box in record["solution"])
    else:
        body = "[" + ", ".join(box_text(box, convention, size, resized_size) for box in record["solution"]) + "]"
    return f"<think>{think_text(record)}</think><answer>{body}</answer>"


# ---------------------------------------------------------------------------------------------------------- files
def write_split(directory: str | Path, split: str, count: int, seed: int, kinds: Sequence[str] = KINDS,
                every_object: bool = False) -> Path:
    """Write ``count`` records of ``split`` as ``{split}.jsonl`` and ``{split}/NNNNNN.png`` under ``directory``.

    Returns:
        The JSONL path. The records carry their image's path (relative to the JSONL file) and description.
    """
    from PIL import Image

    directory = Path(directory)
    (directory / split).mkdir(parents=True, exist_ok=True)
    records = make_records(count, split, seed, kinds, every_object)
    path = directory / f"{split}.jsonl"
    with path.open("w") as handle:
        for index, record in enumerate(records):
            name = f"{split}/{index:06d}.png"
            Image.fromarray(record_image(record)).save(directory / name, optimize=False)
            handle.write(json.dumps({"image": name, **record}) + "\n")
    return path


def write_dataset(directory: str | Path, *, train: int, test: int, seed: int = 0,
                  kinds: Sequence[str] = KINDS, train_kinds: Sequence[str] | None = None,
                  every_object: bool = False) -> dict[str, Path]:
    """Both splits under ``directory`` (see :func:`write_split`), with ``manifest.json`` recording the options;
    a folder whose manifest matches is kept as it is (a second call costs nothing).

    Args:
        kinds: The question kinds of both splits, in turn.
        train_kinds: The training split's kinds instead, repeats weighting them (the held-out split keeps
            ``kinds``, so that its scores stay comparable across training mixes).
        every_object: The training split's locate scenes ask about each of their objects alone of its kind
            (:func:`make_records`); the held-out split keeps one question per image.
    """
    directory = Path(directory)
    train_kinds = list(kinds if train_kinds is None else train_kinds)
    manifest = {"train": train, "test": test, "seed": seed, "kinds": list(kinds), "train_kinds": train_kinds}
    if every_object:  # only when set, so that a folder written before the option still matches its manifest
        manifest["every_object"] = True
    marker = directory / "manifest.json"
    paths = {split: directory / f"{split}.jsonl" for split in SPLITS}
    if marker.is_file() and json.loads(marker.read_text()) == manifest and all(p.is_file() for p in paths.values()):
        return paths
    marker.unlink(missing_ok=True)
    write_split(directory, "train", train, seed, train_kinds, every_object)
    write_split(directory, "test", test, seed, kinds)
    marker.write_text(json.dumps(manifest) + "\n")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.plugins.vlm.grounding.world",
                                     description="Write the grounding world's training and held-out questions.")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--train", type=int, default=3000, help="training questions (default 3000)")
    parser.add_argument("--test", type=int, default=192, help="held-out questions (default 192)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS,
                        help="question kinds of both splits, in turn (default: all three)")
    parser.add_argument("--train-kinds", nargs="+", default=None, choices=KINDS,
                        help="the training split's kinds instead; a kind listed twice gets twice the questions "
                             "(default: --kinds)")
    parser.add_argument("--every-object", action="store_true",
                        help="training locate scenes ask about each of their objects alone of its kind (the same "
                             "image with several questions)")
    args = parser.parse_args(argv)
    paths = write_dataset(args.directory, train=args.train, test=args.test, seed=args.seed, kinds=args.kinds,
                          train_kinds=args.train_kinds, every_object=args.every_object)
    print(f"wrote {paths['train']} and {paths['test']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
