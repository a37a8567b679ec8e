"""The edit world: the shapes world's scenes edited by an instruction, for image-editing RL on a laptop CPU.

A row is an input rendering, an instruction and the scene the edit should produce::

    {"prompt": "make the circle blue", "image": "images/test_000.png", "task": "recolor",
     "objects": [{"shape": "circle", "color": "blue", "count": 1}, {"shape": "square", "color": "red", "count": 1}],
     "relation": "above", "source": "a green circle above a red square"}

``objects`` and ``relation`` describe the *edited* scene in the shapes world's row format, so the ``shapes`` reward
(:mod:`mmrl.rewards.shapes`) scores an edit exactly as it scores a generated image: the right shapes, the right
colours bound to them and, for scenes with a relation, the right arrangement. An edit that leaves the image as it
was, edits the wrong object or gives the wrong value loses the requirement it broke.

Edits (:data:`EDITS`), on the shapes world's one- and two-object scenes (``single_object``, ``two_object``,
``position``; counted scenes are not edited, their plural nouns would need their own grammar):

- ``recolor`` "make the {shape} {colour}": one object takes another colour;
- ``reshape`` "make the {shape} a {shape}": one object takes another shape, one the scene's other object does not
  have (so each shape still names one object);
- ``swap`` "swap the {shape} and the {shape}": the two objects of a ``position`` scene exchange places, which
  reverses the relation.

The edited image keeps every object's place and size (a swap exchanges the two places), so an edit is an
image-to-image map: the model must copy what the instruction does not change. :func:`edited_layout` draws it.

Split (:func:`split`): an edit belongs to the training side when both its input scene and its result are training
compositions of the shapes world (:func:`world.all_rows`), and to the held-out side when its input scene is held
out; so no held-out input scene (a pair of object types never seen together in training, or a held-out single
object) is ever seen in pretraining or RL. The dataset files hold :data:`TRAIN_PER_EDIT` training and
:data:`TEST_PER_EDIT` held-out rows per kind of edit, each with one fixed input rendering (PNG, 32×32).

Wrong edits (:func:`wrong_edit`): pretraining draws some targets from an edit that went wrong, as imperfect
editing data does (the input left as it was, the other object edited, or another value), while the instruction
stays: the pretrained model then edits right only part of the time, which leaves group-relative RL something to
choose between (the shapes world's caption noise, :func:`world.corrupt_row`, for edits).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from mmrl.plugins.flow.shapes import world
from mmrl.plugins.flow.shapes.world import COLORS, OPPOSITE, SHAPES, Placed

EDITS = ("recolor", "reshape", "swap")
WORDS = (*world.WORDS, "make", "swap")
"""Every word of the instructions (the edit model's tokenizers know each as one token)."""
EDITED_TASKS = ("single_object", "two_object", "position")
"""The shapes world's tasks whose scenes are edited."""
TRAIN_PER_EDIT = 48
TEST_PER_EDIT = 16
WRONG_EDITS = ("unchanged", "other_object", "other_value")
"""The ways a pretraining target can get its instruction wrong (:func:`wrong_edit`)."""


# ---------------------------------------------------------------------------------------------------------- edits
def instruction(edit: dict[str, Any]) -> str:
    """The instruction of an edit ``{"kind", "shape", "value"}`` (``value``: the new colour or shape, or the other
    object's shape for a swap)."""
    kind, shape, value = edit["kind"], edit["shape"], edit["value"]
    if kind == "recolor":
        return f"make the {shape} {value}"
    if kind == "reshape":
        return f"make the {shape} a {value}"
    if kind == "swap":
        return f"swap the {shape} and the {value}"
    raise ValueError(f"unknown edit {kind!r}; one of {', '.join(EDITS)}")


def scene_edits(scene: dict[str, Any]) -> list[dict[str, Any]]:
    """Every edit of a shapes-world ``scene`` row (module docstring), in a fixed order."""
    if scene["task"] not in EDITED_TASKS:
        raise ValueError(f"the edit world edits {', '.join(EDITED_TASKS)} scenes, not {scene['task']!r}")
    objects = scene["objects"]
    shapes = [spec["shape"] for spec in objects]
    edits = []
    for index, spec in enumerate(objects):
        edits += [{"kind": "recolor", "object": index, "shape": spec["shape"], "value": color}
                  for color in COLORS if color != spec["color"]]
        edits += [{"kind": "reshape", "object": index, "shape": spec["shape"], "value": shape}
                  for shape in SHAPES if shape not in shapes]
    if scene.get("relation") is not None:
        edits.append({"kind": "swap", "object": 0, "shape": shapes[0], "value": shapes[1]})
    return edits


def apply_edit(scene: dict[str, Any], edit: dict[str, Any]) -> dict[str, Any]:
    """The row of the scene ``edit`` produces (the shapes world's row format, its own prompt)."""
    objects = [dict(spec) for spec in scene["objects"]]
    relation = scene.get("relation")
    kind, target = edit["kind"], objects[edit["object"]]
    if kind == "recolor":
        target["color"] = edit["value"]
    elif kind == "reshape":
        target["shape"] = edit["value"]
    elif kind == "swap":
        relation = OPPOSITE[relation]
    else:
        raise ValueError(f"unknown edit {kind!r}; one of {', '.join(EDITS)}")
    return world.make_row(scene["task"], [(spec["color"], spec["shape"], 1) for spec in objects], relation)


def edit_row(scene: dict[str, Any], edit: dict[str, Any]) -> dict[str, Any]:
    """The dataset row of ``edit`` on ``scene`` (no image yet): the instruction, the edited scene's requirements
    and the input scene's own row under ``source_row``."""
    result = apply_edit(scene, edit)
    return {"prompt": instruction(edit), "task": edit["kind"], "objects": result["objects"],
            "relation": result["relation"], "source": scene["prompt"], "edit": dict(edit),
            "source_row": {key: scene[key] for key in ("prompt", "task", "objects", "relation")}}


def edited_layout(placed: Sequence[Placed], edit: dict[str, Any]) -> list[Placed]:
    """The placements after ``edit``: the edited object changes colour or shape in its place; a swap exchanges the
    two objects' centres (sizes stay with their objects)."""
    out = list(placed)
    index = edit["object"]
    if edit["kind"] == "recolor":
        out[index] = replace(out[index], color=edit["value"])
    elif edit["kind"] == "reshape":
        out[index] = replace(out[index], shape=edit["value"])
    elif edit["kind"] == "swap":
        a, b = out
        out = [replace(a, cx=b.cx, cy=b.cy), replace(b, cx=a.cx, cy=a.cy)]
    else:
        raise ValueError(f"unknown edit {edit['kind']!r}; one of {', '.join(EDITS)}")
    return out


def wrong_edit(scene: dict[str, Any], edit: dict[str, Any], rng: np.random.Generator) -> dict[str, Any] | None:
    """An edit that gets ``edit`` wrong, drawn uniformly among the :data:`WRONG_EDITS` that apply; ``None`` stands
    for "unchanged" (the input image as the target). ``other_object`` edits the scene's other object the same way
    (a two-object recolour or reshape whose value the other object can take); ``other_value`` keeps the object and
    picks another colour or shape (recolour, or a reshape with a choice left). A swap can only be left undone."""
    same_kind = [e for e in scene_edits(scene) if e["kind"] == edit["kind"]]
    others = [e for e in same_kind if e["object"] != edit["object"] and e["value"] == edit["value"]]
    values = [e for e in same_kind if e["object"] == edit["object"] and e["value"] != edit["value"]]
    choices: list[list[dict[str, Any] | None]] = [[None]] + [group for group in (others, values) if group]
    group = choices[int(rng.integers(len(choices)))]
    return group[int(rng.integers(len(group)))]


def render_pair(scene: dict[str, Any], edit: dict[str, Any] | None,
                rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``([R, R, 3], [R, R, 3])`` uint8: a random rendering of ``scene`` and the same layout after ``edit`` (``None``:
    unchanged, one of :func:`wrong_edit`'s targets)."""
    placed = world.layout(scene, rng)
    target = placed if edit is None else edited_layout(placed, edit)
    return world.render(placed), world.render(target)


# ---------------------------------------------------------------------------------------------------------- split
def _scenes(side: str) -> list[dict[str, Any]]:
    rows = world.all_rows()[side]
    return [row for task in EDITED_TASKS for row in rows[task]]


def all_edits() -> dict[str, list[dict[str, Any]]]:
    """Every edit row of the world, ``{"train": [...], "held_out": [...]}`` (module docstring: training edits have a
    training input scene and result, held-out edits a held-out input scene)."""
    training = {row["prompt"] for row in world.training_rows()}
    out: dict[str, list[dict[str, Any]]] = {"train": [], "held_out": []}
    for side in ("train", "held_out"):
        for scene in _scenes(side):
            for edit in scene_edits(scene):
                row = edit_row(scene, edit)
                result = world.prompt_text(row)
                if side == "held_out" or result in training:
                    out[side].append(row)
    return out


def split(seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """The dataset rows: ``{"train": TRAIN_PER_EDIT per edit, "test": TEST_PER_EDIT per edit}``, drawn from
    :func:`all_edits` with ``seed`` (without replacement, in a fixed order), without images."""
    rng = np.random.default_rng(seed)
    rows = all_edits()
    out = {}
    for side, name, per_edit in (("train", "train", TRAIN_PER_EDIT), ("held_out", "test", TEST_PER_EDIT)):
        picked = []
        for kind in EDITS:
            candidates = [row for row in rows[side] if row["task"] == kind]
            if len(candidates) < per_edit:
                raise RuntimeError(f"only {len(candidates)} {side} {kind} edits for {per_edit} rows")
            order = rng.permutation(len(candidates))[:per_edit]
            picked += [candidates[int(k)] for k in sorted(order)]
        out[name] = picked
    return out


def write_dataset(folder: str | Path, seed: int = 0) -> Path:
    """Write ``train_metadata.jsonl`` and ``test_metadata.jsonl`` with one input rendering per row under
    ``images/`` (``{split}_{index:03d}.png``, the row's ``"image"``, relative to the folder); the layouts are drawn
    with ``seed``."""
    from PIL import Image

    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, rows in split(seed).items():
        lines = []
        for index, row in enumerate(rows):
            image = f"images/{name}_{index:03d}.png"
            source, _ = render_pair(row["source_row"], row["edit"], rng)
            Image.fromarray(source).save(folder / image)
            lines.append(json.dumps({"prompt": row["prompt"], "image": image,
                                     **{k: v for k, v in row.items() if k != "prompt"}}) + "\n")
        (folder / f"{name}_metadata.jsonl").write_text("".join(lines))
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mmrl.plugins.flow.shapes.edits FOLDER``: write the edit world's dataset (rows and input images);
    ``--preview PNG`` also draws each held-out input beside the edit it asks for."""
    import argparse

    parser = argparse.ArgumentParser(description="Write the edit world's dataset.")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--preview", type=Path, help="Also write a grid of held-out inputs and their edits here.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    folder = write_dataset(args.folder, args.seed)
    print(folder)
    if args.preview is not None:
        import torch

        from mmrl.plugins.flow.images import save_caption_grid

        rng = np.random.default_rng(args.seed)
        tiles, captions = [], []
        for row in split(args.seed)["test"]:
            source, target = render_pair(row["source_row"], row["edit"], rng)
            tiles += [source, target]
            captions += [row["source"], row["prompt"]]
        images = torch.from_numpy(np.stack(tiles)).permute(0, 3, 1, 2).float() / 255
        print(save_caption_grid(images, captions, args.preview))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
