"""Datasets of the VLM plugin: the JSONL format, converters, and a synthetic coloured-shapes generator.

**The JSONL format** (one JSON object per line)::

    {"image": "images/0001.jpg", "problem": "Where is the red car?", "solution": [31, 40, 152, 118],
     "task": "grounding"}
    {"image": ["a.png", "b.png"], "problem": "How many dogs are there?", "solution": 3, "task": "counting"}

- ``image``: a path or a list of paths (relative paths are resolved against ``image_root``, by default the JSONL
  file's folder). Box answers refer to the first image.
- ``video`` (instead of or beside ``image``): one video as the list of its frame paths, in time order and already
  sampled, or several videos as a list of such lists (resolved like images); ``video_fps`` (optional): the frames'
  rate in frames per second of video time, one number or one per video (default: the plugin's ``video_fps``).
  In the user turn the images come first, then the videos, in order::

    {"video": ["clip7/000.jpg", "clip7/001.jpg", "clip7/002.jpg", "clip7/003.jpg"], "video_fps": 2,
     "problem": "Which way does the ball roll? (A) left (B) right", "solution": "B", "task": "video-choice"}
- ``problem``: the question text (the plugin's ``prompt_template`` wraps it).
- ``solution``: what the rewards compare against: a box ``[x1, y1, x2, y2]`` in pixels of the original image, a list
  of boxes or ``{"bbox_2d": ..., "label": ...}`` objects, a count, an option letter, a number...
- ``task``: a free-form tag (``grounding``, ``counting``, ``detection``, ``math``...), kept in the rows and in the
  saved samples. Rewards do not dispatch on it: one run scores every row with the same reward functions.
- Any other key is kept in the row (rewards may read it, e.g. ``options`` for ``choice``).

:func:`load_jsonl` turns lines into plugin rows ``{"prompt", "problem", "image": [paths], "solution", "task",
"image_size": [w, h], ...}``; :func:`attach_sizes` adds ``resized_size``, the size the processor resizes the first
image to, which the ``qwen2_5_vl`` box convention needs.

**Converters** turn RefCOCO-style grounding records (:func:`convert_refcoco`) and counting records
(:func:`convert_counting`) into that format. **The shapes generator** (:func:`make_shapes`,
:func:`write_shapes_dataset`) draws images of coloured circles, squares and triangles of mixed sizes with
questions such as "Where is the red circle?" (one box) and "How many squares are there?"; it is deterministic in its
seed and needs nothing but Pillow.

Command line::

    python -m mmrl.plugins.vlm.data shapes data/shapes --train 512 --eval 64 --seed 0
    python -m mmrl.plugins.vlm.data frames videos.jsonl data/videos/train.jsonl --frames-dir data/videos/frames
    python -m mmrl.plugins.vlm.data refcoco refcoco_train.json data/refcoco/train.jsonl --image-root coco/train2014
    python -m mmrl.plugins.vlm.data counting clevr_counts.jsonl data/counting/train.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mmrl.prompts import iter_jsonl

REQUIRED_KEYS = ("image", "problem", "solution", "task")
"""The keys every record needs; ``video`` may stand in for ``image``."""

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 80, 220), "yellow": (235, 200, 40),
}
SHAPES = ("circle", "square", "triangle")
TASKS = ("grounding", "counting", "motion")
IMAGE_TASKS = ("grounding", "counting")
"""The tasks drawn by default (``motion`` rows are videos)."""
DIRECTIONS = ("left", "right", "up", "down")
MOTION_FRAMES = 4
"""Frames of a ``motion`` clip (two temporal patches), shown at 2 frames per second."""

REFCOCO_TEMPLATE = "Please provide the bounding box coordinate of the region this sentence describes: {expression}."
COUNTING_TEMPLATE = "How many {object} are there in the image?"


class DataError(ValueError):
    """A dataset file or record that does not follow the format; the message names the file, line and key."""


# ---------------------------------------------------------------------------------------------------- JSONL


def load_jsonl(path: str | Path, *, image_root: str | Path | None = None, check_images: bool = True
               ) -> list[dict[str, Any]]:
    """Read a JSONL dataset into plugin rows (see the module docstring).

    Args:
        path: The JSONL file.
        image_root: Folder that relative image paths are resolved against (default: the file's folder).
        check_images: Open each row's first image header to record ``image_size`` (unless the row has one) and
            fail early on missing images.

    Raises:
        DataError: naming the file, line and problem, for unreadable JSON, missing or mistyped keys, and missing
            images.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"VLM dataset {path} does not exist; expected a JSONL file with keys "
                        f"{', '.join(REQUIRED_KEYS)}")
    root = Path(image_root) if image_root is not None else path.parent
    rows = [record_to_row(record, where=where, image_root=root, check_images=check_images)
            for where, record in iter_jsonl(path, error=DataError)]
    if not rows:
        raise DataError(f"VLM dataset {path} holds no rows")
    return rows


def record_to_row(record: Any, *, where: str, image_root: str | Path | None = None, check_images: bool = True
                  ) -> dict[str, Any]:
    """Validate one JSONL record and turn it into a plugin row (``prompt`` = ``problem``, ``image`` a list)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with keys {', '.join(REQUIRED_KEYS)}, got "
                        f"{type(record).__name__}")
    missing = [key for key in REQUIRED_KEYS if key not in record and not (key == "image" and "video" in record)]
    if missing:
        raise DataError(f"{where}: missing key {missing[0]!r}; each record needs {', '.join(REQUIRED_KEYS)} "
                        "('video' may stand in for 'image')")
    images = record.get("image", [])
    images = [images] if isinstance(images, str) else images
    if not isinstance(images, list) or ("image" in record and not images) or not all(
            isinstance(i, str) and i.strip() for i in images):
        raise DataError(f"{where}: 'image' must be a path or a non-empty list of paths, got {record['image']!r}")
    videos = _videos(record, where)
    problem = record["problem"]
    if not isinstance(problem, str) or not problem.strip():
        raise DataError(f"{where}: 'problem' must be a non-empty string, got {problem!r}")
    if record["solution"] is None:
        raise DataError(f"{where}: 'solution' must not be null")
    if not isinstance(record["task"], str) or not record["task"]:
        raise DataError(f"{where}: 'task' must be a non-empty string such as 'grounding' or 'counting', got "
                        f"{record['task']!r}")
    root = Path(image_root) if image_root is not None else None
    resolved = [_resolve(image, root) for image in images]
    row = {key: value for key, value in record.items() if key not in ("image", "problem", "video")}
    row.update(prompt=problem, problem=problem, image=resolved)
    if videos:
        row["video"] = [[_resolve(frame, root) for frame in clip] for clip in videos]
        if check_images:
            for clip in row["video"]:
                missing_frames = [frame for frame in clip if not Path(frame).is_file()]
                if missing_frames:
                    raise DataError(f"{where}: video frame {missing_frames[0]} does not exist")
    if "image_size" in record:
        row["image_size"] = _checked_size(record["image_size"], f"{where}: 'image_size'")
    elif check_images and resolved:
        first = resolved[0]
        if not Path(first).is_file():
            raise DataError(f"{where}: image {first} does not exist")
        row["image_size"] = list(image_size(first))
    return row


def _videos(record: dict[str, Any], where: str) -> list[list[str]]:
    """A record's ``video`` as a list of videos, each a non-empty list of frame paths; its ``video_fps`` checked."""
    if "video" not in record:
        if "video_fps" in record:
            raise DataError(f"{where}: 'video_fps' without 'video'")
        return []
    value = record["video"]
    if isinstance(value, list) and value and all(isinstance(frame, str) for frame in value):
        videos = [value]
    elif isinstance(value, list) and value and all(isinstance(clip, list) for clip in value):
        videos = value
    else:
        raise DataError(f"{where}: 'video' must be a list of frame paths or a list of such lists, got {value!r}")
    for clip in videos:
        if not clip or not all(isinstance(frame, str) and frame.strip() for frame in clip):
            raise DataError(f"{where}: each video must be a non-empty list of frame paths, got {clip!r}")
    rate = record.get("video_fps")
    rates = rate if isinstance(rate, list) else [rate] * len(videos)
    if rate is not None and (len(rates) != len(videos) or not all(
            isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0 for r in rates)):
        raise DataError(f"{where}: 'video_fps' must be a positive number or one per video ({len(videos)}), got "
                        f"{rate!r}")
    return videos


def attach_sizes(rows: Iterable[dict[str, Any]], resized: Any) -> list[dict[str, Any]]:
    """Add ``image_size`` (when missing) and ``resized_size`` (the processor's size of the first image) to rows.

    Args:
        rows: Plugin rows.
        resized: ``(width, height) → (width, height)``, e.g. the adapter's ``resized_size``.
    """
    result = []
    for row in rows:
        images = row.get("image")
        first = (images[0] if images else None) if isinstance(images, (list, tuple)) else images
        if row.get("image_size") is None and first is not None:
            row["image_size"] = list(image_size(first))
        if row.get("image_size") is not None:
            row["resized_size"] = list(resized(row["image_size"]))
        result.append(row)
    return result


def image_size(image: Any) -> tuple[int, int]:
    """``(width, height)`` of a PIL image or an image file (reads the header only)."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.size
    with Image.open(str(image)) as opened:
        return opened.size


def write_jsonl(records: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Write records as JSONL (creating the folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return path


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Records from a ``.jsonl`` file, or a ``.json`` file holding a list (or ``{"annotations": [...]}``)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path} does not exist")
    if path.suffix == ".jsonl":
        return [record for _, record in iter_jsonl(path, error=DataError)]
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise DataError(f"{path}: not valid JSON ({error.msg} at line {error.lineno})") from None
    if isinstance(data, dict) and isinstance(data.get("annotations"), list):
        data = data["annotations"]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of records (or an object with an 'annotations' list)")
    return data


# ---------------------------------------------------------------------------------------------------- converters


def convert_refcoco(records: Iterable[dict[str, Any]], *, bbox_format: str = "xywh",
                    template: str = REFCOCO_TEMPLATE, all_expressions: bool = False) -> list[dict[str, Any]]:
    """RefCOCO/RefCOCO+/RefCOCOg-style referring-expression records → JSONL grounding records.

    A record names its image (``image``, ``file_name`` or ``img_path``), its box (``bbox``; COCO ``[x, y, w, h]``
    with ``bbox_format="xywh"``, or ``[x1, y1, x2, y2]`` with ``"xyxy"``) and its expression(s): ``expression``,
    ``sentence``, ``caption``, ``sent``, or ``sentences`` (strings or ``{"sent": ...}`` objects, as in the refer
    toolkit's refs). The solution is the box ``[x1, y1, x2, y2]`` in original-image pixels.

    Args:
        records: The source records.
        bbox_format: ``"xywh"`` (COCO) or ``"xyxy"``.
        template: Question text with an ``{expression}`` field.
        all_expressions: One row per expression (True) or only the first expression of each record.
    """
    if bbox_format not in ("xywh", "xyxy"):
        raise DataError(f"refcoco bbox_format must be 'xywh' or 'xyxy', got {bbox_format!r}")
    rows = []
    for index, record in enumerate(records):
        where = f"refcoco record {index}"
        image = _first_key(record, ("image", "file_name", "img_path"), where)
        box = record.get("bbox")
        if not (isinstance(box, (list, tuple)) and len(box) == 4 and all(_finite(v) for v in box)):
            raise DataError(f"{where}: 'bbox' must be four numbers, got {box!r}")
        x, y, a, b = (float(v) for v in box)
        solution = [x, y, x + a, y + b] if bbox_format == "xywh" else [x, y, a, b]
        if not (solution[2] > solution[0] and solution[3] > solution[1]):
            raise DataError(f"{where}: 'bbox' {box!r} ({bbox_format}) has no area")
        expressions = _expressions(record, where)
        for expression in expressions if all_expressions else expressions[:1]:
            row = {"image": image, "problem": template.format(expression=expression), "solution": solution,
                   "task": "grounding", "expression": expression}
            if "width" in record and "height" in record:
                row["image_size"] = [record["width"], record["height"]]
            rows.append(row)
    return rows


def convert_counting(records: Iterable[dict[str, Any]], *, template: str = COUNTING_TEMPLATE
                     ) -> list[dict[str, Any]]:
    """Counting records → JSONL counting records.

    A record names its image (``image``, ``file_name`` or ``img_path``), its count (``count``, ``answer`` or
    ``solution``, a number or numeric string; or ``objects``, a list counted by length) and either a full
    ``question`` or the counted ``object``/``category`` (put into ``template``). CLEVR-counting style data
    (R1-V) has ``question`` and ``answer``.
    """
    rows = []
    for index, record in enumerate(records):
        where = f"counting record {index}"
        image = _first_key(record, ("image", "file_name", "img_path"), where)
        count = _count(record, where)
        question = record.get("question") or record.get("problem")
        if not question:
            target = record.get("object") or record.get("category")
            if not isinstance(target, str) or not target:
                raise DataError(f"{where}: needs a 'question' or the counted 'object'/'category'")
            question = template.format(object=target)
        rows.append({"image": image, "problem": str(question), "solution": count, "task": "counting"})
    return rows


# ---------------------------------------------------------------------------------------------------- shapes


def make_shapes(count: int, *, seed: int, tasks: Sequence[str] = IMAGE_TASKS, min_side: int = 56, max_side: int = 160,
                max_objects: int = 4) -> list[dict[str, Any]]:
    """``count`` synthetic rows with in-memory PIL images of coloured shapes on a grey background.

    Image widths and heights are drawn independently from [min_side, max_side], so a batch mixes sizes. Tasks
    alternate in the order given:

    - ``grounding``: "Where is the {color} {shape}?"; exactly one object of that colour and shape; the solution is
      its box ``[x1, y1, x2, y2]`` in image pixels (floats), ``label`` its name.
    - ``counting``: "How many {shape}s are there?"; 0..max_objects of that shape among other shapes; the solution
      is the count.
    - ``motion`` (a video): "Which way does the {color} {shape} move?" with the options A. left, B. right, C. up,
      D. down; a clip of :data:`MOTION_FRAMES` frames (``video``, at ``video_fps`` 2) in which that shape moves a
      fixed step per frame in one direction while up to max_objects − 1 other shapes stand still; the solution is
      the option letter (the ``choice`` reward). Only the order of the frames tells the direction (T-GRPO's
      ``temporal_contrast``: shuffled frames do not).

    Image rows also carry ``image_size`` and ``objects`` (every drawn object with its box). Deterministic in
    ``seed``.
    """
    from PIL import Image, ImageDraw

    unknown = [task for task in tasks if task not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"shapes tasks must be a non-empty list of {', '.join(TASKS)}, got {list(tasks)}")
    if not 28 <= min_side <= max_side:
        raise ValueError(f"shapes sides need 28 <= min_side <= max_side, got {min_side} and {max_side}")
    if max_objects < 1:
        raise ValueError(f"shapes max_objects must be >= 1, got {max_objects}")
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        task = tasks[index % len(tasks)]
        width, height = rng.randint(min_side, max_side), rng.randint(min_side, max_side)
        if task == "motion":
            rows.append(_motion_row(rng, width, height, max_objects))
            continue
        image = Image.new("RGB", (width, height), (128, 128, 128))
        draw = ImageDraw.Draw(image)
        if task == "grounding":
            target = (rng.choice(list(COLORS)), rng.choice(SHAPES))
            others = [(c, s) for c in COLORS for s in SHAPES if (c, s) != target]
            kinds = [target] + [rng.choice(others) for _ in range(rng.randint(0, max_objects - 1))]
        else:
            shape = rng.choice(SHAPES)
            number = rng.randint(0, max_objects)
            others = [s for s in SHAPES if s != shape]
            kinds = [(rng.choice(list(COLORS)), shape) for _ in range(number)]
            kinds += [(rng.choice(list(COLORS)), rng.choice(others)) for _ in range(rng.randint(0, 2))]
        objects = _place(rng, kinds, width, height)
        for obj in objects:
            _draw(draw, obj["shape"], obj["box"], COLORS[obj["color"]])
        row: dict[str, Any] = {"image": image, "image_size": [width, height], "task": task, "objects": [
            {"label": f"{o['color']} {o['shape']}", "bbox_2d": o["box"]} for o in objects]}
        if task == "grounding":
            box = objects[0]["box"]
            row.update(prompt=f"Where is the {target[0]} {target[1]}?", solution=box,
                       label=f"{target[0]} {target[1]}")
        else:
            found = sum(1 for o in objects if o["shape"] == shape)
            row.update(prompt=f"How many {shape}s are there?", solution=found)
        row["problem"] = row["prompt"]
        rows.append(row)
    return rows


def write_shapes_dataset(directory: str | Path, *, train_size: int, eval_size: int, seed: int = 0,
                         tasks: Sequence[str] = IMAGE_TASKS, min_side: int = 56, max_side: int = 160,
                         max_objects: int = 4) -> dict[str, Path]:
    """Write the shapes dataset as PNGs and ``train.jsonl`` / ``eval.jsonl`` in the JSONL format.

    Train and eval rows are drawn from one stream (seed ``seed``), the eval rows after the train rows.

    Returns:
        ``{"train": path, "eval": path}``.
    """
    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    rows = make_shapes(train_size + eval_size, seed=seed, tasks=tasks, min_side=min_side, max_side=max_side,
                       max_objects=max_objects)
    paths = {}
    for split, part in (("train", rows[:train_size]), ("eval", rows[train_size:])):
        records = []
        for offset, row in enumerate(part):
            if row["task"] == "motion":
                names = [f"images/{split}_{offset:06d}_{k}.png" for k in range(len(row["video"]))]
                for frame, name in zip(row["video"], names, strict=True):
                    frame.save(directory / name)
                records.append({"video": names, "video_fps": row["video_fps"], "problem": row["problem"],
                                "solution": row["solution"], "task": "motion", "direction": row["direction"],
                                "label": row["label"]})
                continue
            name = f"images/{split}_{offset:06d}.png"
            row["image"].save(directory / name)
            record = {"image": name, "problem": row["problem"], "solution": row["solution"], "task": row["task"],
                      "image_size": row["image_size"], "objects": row["objects"]}
            if "label" in row:
                record["label"] = row["label"]
            records.append(record)
        paths[split] = write_jsonl(records, directory / f"{split}.jsonl")
    return paths


def box_answer(box: Sequence[float], convention: str, image_size: Sequence[float],
               resized_size: Sequence[float] | None = None, *, label: str | None = None) -> str:
    """The text a model of ``convention`` writes for ``box`` (original-image pixels), inside ``<answer>`` tags.

    ``qwen2_vl``: box tokens with integer 0–1000 corners; ``qwen2_5_vl``: JSON ``bbox_2d`` in integer pixels of the
    resized image; ``qwen3_vl``: JSON on the 0–1000 grid; ``absolute``/``relative``: JSON in original pixels or
    fractions. Integer conventions round, so a round trip through ``parse_boxes`` is exact up to half a unit.
    """
    from mmrl.rewards.boxes import from_original

    coords = from_original(box, convention, image_size, resized_size)  # type: ignore[arg-type]
    if convention == "relative":
        values: list[Any] = [round(v, 4) for v in coords]
    else:
        values = [int(round(v)) for v in coords]
    if convention == "qwen2_vl":
        name = f"<|object_ref_start|>{label}<|object_ref_end|>" if label else ""
        body = f"{name}<|box_start|>({values[0]},{values[1]}),({values[2]},{values[3]})<|box_end|>"
    else:
        item: dict[str, Any] = {"bbox_2d": values}
        if label:
            item["label"] = label
        body = json.dumps(item)
    return f"<answer>{body}</answer>"


# ---------------------------------------------------------------------------------------------------- helpers


def _resolve(image: str, root: Path | None) -> str:
    text = image[len("file://"):] if image.startswith("file://") else image
    if "://" in text:
        return image  # a URL; qwen-vl-utils can fetch it
    path = Path(text).expanduser()
    if not path.is_absolute() and root is not None:
        path = root / path
    return str(path)


def _checked_size(value: Any, where: str) -> list[float]:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(_finite(v) and v > 0 for v in value):
        return [value[0], value[1]]
    raise DataError(f"{where} must be [width, height] with two positive numbers, got {value!r}")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _first_key(record: Any, keys: Sequence[str], where: str) -> Any:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in keys:
        if record.get(key):
            return record[key]
    raise DataError(f"{where}: needs one of the keys {', '.join(keys)}")


def _expressions(record: dict[str, Any], where: str) -> list[str]:
    for key in ("expression", "sentence", "caption", "sent"):
        if isinstance(record.get(key), str) and record[key].strip():
            return [record[key].strip()]
    sentences = record.get("sentences")
    if isinstance(sentences, list):
        found = []
        for item in sentences:
            text = item.get("sent") or item.get("raw") if isinstance(item, dict) else item
            if isinstance(text, str) and text.strip():
                found.append(text.strip())
        if found:
            return found
    raise DataError(f"{where}: needs an expression ('expression', 'sentence', 'caption', 'sent' or 'sentences')")


def _count(record: dict[str, Any], where: str) -> int | float:
    if isinstance(record.get("objects"), list):
        return len(record["objects"])
    for key in ("count", "answer", "solution"):
        value = record.get(key)
        if _finite(value):
            return value
        if isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                continue
            return int(number) if number.is_integer() else number
    raise DataError(f"{where}: needs a numeric 'count', 'answer' or 'solution', or an 'objects' list")


def _place(rng: random.Random, kinds: list[tuple[str, str]], width: int, height: int) -> list[dict[str, Any]]:
    """Non-overlapping boxes for the objects (the first one always placed; later ones dropped when they don't
    fit after a few tries)."""
    placed: list[dict[str, Any]] = []
    low = max(8, min(width, height) // 6)
    high = max(low, min(width, height) // 3)
    for number, (color, shape) in enumerate(kinds):
        for _ in range(50):
            side = rng.randint(low, high)
            x, y = rng.randint(0, width - side), rng.randint(0, height - side)
            box = [float(x), float(y), float(x + side), float(y + side)]
            if all(not _overlap(box, other["box"]) for other in placed):
                placed.append({"color": color, "shape": shape, "box": box})
                break
        else:
            if number == 0:
                raise RuntimeError("could not place the first shape")  # cannot happen on an empty canvas
    return placed


def _motion_row(rng: random.Random, width: int, height: int, max_objects: int) -> dict[str, Any]:
    """One ``motion`` row (see :func:`make_shapes`): the moving shape's box slides by ``step`` pixels per frame."""
    from PIL import Image, ImageDraw

    color, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
    direction = rng.choice(DIRECTIONS)
    side = max(8, min(width, height) // 5)
    horizontal = direction in ("left", "right")
    span = (width if horizontal else height) - side  # room along the motion
    step = max(2, span // (2 * (MOTION_FRAMES - 1)))
    travel = step * (MOTION_FRAMES - 1)
    start = rng.randint(0, span - travel)
    across = rng.randint(0, (height if horizontal else width) - side)
    positions = [start + k * step for k in range(MOTION_FRAMES)]
    if direction in ("left", "up"):
        positions.reverse()
    boxes = [[float(p), float(across), float(p + side), float(across + side)] if horizontal else
             [float(across), float(p), float(across + side), float(p + side)] for p in positions]
    sweep = [min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes), max(b[3] for b in boxes)]
    others = [(c, s) for c in COLORS for s in SHAPES if (c, s) != (color, shape)]
    still = [obj for obj in _place(rng, [(color, shape)] + [rng.choice(others) for _ in range(max_objects - 1)],
                                   width, height)[1:] if not _overlap(obj["box"], sweep)]
    frames = []
    for box in boxes:
        frame = Image.new("RGB", (width, height), (128, 128, 128))
        draw = ImageDraw.Draw(frame)
        for obj in still:
            _draw(draw, obj["shape"], obj["box"], COLORS[obj["color"]])
        _draw(draw, shape, box, COLORS[color])
        frames.append(frame)
    options = "\n".join(f"{letter}. {name}" for letter, name in zip("ABCD", DIRECTIONS, strict=True))
    prompt = f"Which way does the {color} {shape} move? Options:\n{options}"
    return {"video": frames, "video_fps": 2.0, "task": "motion", "prompt": prompt, "problem": prompt,
            "solution": "ABCD"[DIRECTIONS.index(direction)], "direction": direction, "label": f"{color} {shape}"}


def _overlap(a: Sequence[float], b: Sequence[float], margin: float = 2.0) -> bool:
    return not (a[2] + margin <= b[0] or b[2] + margin <= a[0] or a[3] + margin <= b[1] or b[3] + margin <= a[1])


def _draw(draw: Any, shape: str, box: Sequence[float], color: tuple[int, int, int]) -> None:
    x1, y1, x2, y2 = box
    # PIL's shape coordinates are inclusive; x2 - 1 keeps the drawn pixels inside [x1, x2).
    if shape == "circle":
        draw.ellipse([x1, y1, x2 - 1, y2 - 1], fill=color)
    elif shape == "square":
        draw.rectangle([x1, y1, x2 - 1, y2 - 1], fill=color)
    else:
        draw.polygon([((x1 + x2) / 2, y1), (x1, y2 - 1), (x2 - 1, y2 - 1)], fill=color)


# ---------------------------------------------------------------------------------------------------- video frames


def sample_frame_indices(total_frames: int, video_fps: float, *, fps: float = 2.0, min_frames: int = 4,
                         max_frames: int = 16) -> list[int]:
    """Which frames of a video to keep, as qwen-vl-utils' ``smart_nframes`` and its readers choose them: about
    ``fps`` frames per second of the video, between ``min_frames`` and ``max_frames`` (rounded to even counts: Qwen-VL
    pairs frames into temporal patches) and at most all of them, spread evenly (``linspace(0, total − 1, n)``,
    rounded). qwen-vl-utils 0.0.14 ``vision_process.py`` (``smart_nframes``, ``_read_video_torchvision``); its
    defaults are FPS 2, 4 to 768 frames; Video-R1's vendored copy caps at 16 (tulerfeng/Video-R1@59d65c3,
    ``src/qwen-vl-utils/src/qwen_vl_utils/vision_process.py``).

    Raises:
        ValueError: fewer than 2 frames to keep.
    """
    if total_frames < 2 or video_fps <= 0 or fps <= 0:
        raise ValueError(f"cannot sample frames from a video of {total_frames} frames at {video_fps} fps (fps {fps})")
    low = 2 * math.ceil(min_frames / 2)
    high = 2 * math.floor(min(max_frames, total_frames) / 2)
    wanted = min(min(max(total_frames / video_fps * fps, low), high), total_frames)
    count = 2 * math.floor(wanted / 2)
    if not 2 <= count <= total_frames:
        raise ValueError(f"cannot keep {count} of {total_frames} frames; keep between 2 and all of them")
    step = (total_frames - 1) / (count - 1)
    return [int(math.floor(k * step + 0.5)) for k in range(count)]


def extract_frames(video: str | Path, directory: str | Path, *, fps: float = 2.0, min_frames: int = 4,
                   max_frames: int = 16) -> tuple[list[str], float]:
    """Decode a video file (PyAV, which qwen-vl-utils installs), keep the frames :func:`sample_frame_indices` picks
    and write them as PNGs into ``directory``.

    Returns:
        ``(frame paths, sampled fps)``: the frames in time order and the rate they stand for, ``kept / total ×
        the video's fps`` (what qwen-vl-utils passes to the processor as ``fps``): the row's ``video_fps``.
    """
    try:
        import av
    except ImportError as error:
        raise ImportError("extracting video frames needs PyAV (pip install av; qwen-vl-utils installs it)") from error
    video = Path(video)
    if not video.is_file():
        raise DataError(f"video {video} does not exist")
    with av.open(str(video)) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.guessed_rate or 0)
        decoded = [frame.to_image() for frame in container.decode(stream)]
    indices = sample_frame_indices(len(decoded), rate, fps=fps, min_frames=min_frames, max_frames=max_frames)
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in indices:
        path = folder / f"{video.stem}_{index:05d}.png"
        decoded[index].convert("RGB").save(path)
        paths.append(str(path))
    return paths, len(indices) / len(decoded) * rate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmrl.plugins.vlm.data",
                                     description="Write VLM datasets in the plugin's JSONL format.")
    commands = parser.add_subparsers(dest="command", required=True)
    shapes = commands.add_parser("shapes", help="synthetic coloured-shapes images and questions")
    shapes.add_argument("directory")
    shapes.add_argument("--train", type=int, default=512)
    shapes.add_argument("--eval", type=int, default=64)
    shapes.add_argument("--seed", type=int, default=0)
    shapes.add_argument("--tasks", nargs="+", default=list(IMAGE_TASKS), choices=TASKS)
    refcoco = commands.add_parser("refcoco", help="RefCOCO-style referring expressions → grounding rows")
    refcoco.add_argument("source")
    refcoco.add_argument("output")
    refcoco.add_argument("--image-root", default=None, help="prefix for the records' image names")
    refcoco.add_argument("--bbox-format", choices=("xywh", "xyxy"), default="xywh")
    refcoco.add_argument("--all-expressions", action="store_true")
    counting = commands.add_parser("counting", help="counting records → counting rows")
    counting.add_argument("source")
    counting.add_argument("output")
    counting.add_argument("--image-root", default=None, help="prefix for the records' image names")
    frames = commands.add_parser("frames", help="records whose 'video' is a video file → rows with its frames as PNGs")
    frames.add_argument("source")
    frames.add_argument("output")
    frames.add_argument("--frames-dir", required=True, help="folder the frames are written into (one per video)")
    frames.add_argument("--video-root", default=None, help="prefix for the records' video paths")
    frames.add_argument("--fps", type=float, default=2.0, help="frames kept per second of video (qwen-vl-utils: 2)")
    frames.add_argument("--min-frames", type=int, default=4)
    frames.add_argument("--max-frames", type=int, default=16, help="Video-R1: 16; qwen-vl-utils: 768")
    args = parser.parse_args(argv)
    if args.command == "frames":
        rows = []
        for where, record in iter_jsonl(Path(args.source), error=DataError):
            if not isinstance(record, dict) or not isinstance(record.get("video"), str):
                raise DataError(f"{where}: expected a record whose 'video' is the path of a video file")
            source = Path(args.video_root) / record["video"] if args.video_root else Path(record["video"])
            folder = Path(args.frames_dir) / f"{len(rows):06d}"
            paths, rate = extract_frames(source, folder, fps=args.fps, min_frames=args.min_frames,
                                         max_frames=args.max_frames)
            rows.append({**record, "video": paths, "video_fps": rate})
        print(f"wrote {len(rows)} rows to {write_jsonl(rows, args.output)}")
        return 0
    if args.command == "shapes":
        paths = write_shapes_dataset(args.directory, train_size=args.train, eval_size=args.eval, seed=args.seed,
                                     tasks=args.tasks)
        print(f"wrote {paths['train']} and {paths['eval']}")
        return 0
    records = read_records(args.source)
    if args.command == "refcoco":
        rows = convert_refcoco(records, bbox_format=args.bbox_format, all_expressions=args.all_expressions)
    else:
        rows = convert_counting(records)
    if args.image_root:
        for row in rows:
            row["image"] = str(Path(args.image_root) / row["image"])
    print(f"wrote {len(rows)} rows to {write_jsonl(rows, args.output)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
