"""``shape_edit``: the edit world's reward (docs/shapes.md#the-edit-world): did the edit happen, and was the rest kept?

An edit row of the edit world (:mod:`mmrl.plugins.flow.shapes.edits`) carries the edited scene's requirements in
the shapes world's format (``objects``, ``relation``) and the edit itself (``edit``: its kind and the object it
changes). The detector and the requirement scores are the ``shapes`` reward's (:mod:`mmrl.rewards.shapes`:
pixel colours, connected components, template shapes; count, colour and position requirements with partial
credit); this reward splits the requirements in two:

- **edit**: the requirements the instruction changes: the edited object's colour (``recolor``); its count and
  colour, i.e. an object of the new shape, in its colour (``reshape``); the relation (``swap``);
- **kept**: every other requirement (the other object's count and colour, the relation of a recolour or reshape
  of a two-object scene; none for a single object, which then scores 1).

The score is edit × kept (the mean score of each part, multiplied), in [0, 1]: an image scores only when it does
what was asked *and* keeps what was not. Leaving the input as it was scores 0 for every edit (the partial credit of
``shapes`` gives such an image 0.5 to 0.8, which RL then drifts towards: docs/shapes.md#the-edit-world), and so
does an image that garbles the scene. Edit benchmarks judge the same two things, that the instruction was followed
and that the rest was not over-edited (GEdit-Bench, in Step1X-Edit, Liu et al. 2025, arXiv:2504.17761, asks a VLM
judge for both in its semantic-consistency score and combines that with perceptual quality by a geometric mean);
here both are exact checks on pixels, and a product makes either failure cost the whole score. With
``strict: true`` the score is the accuracy: 1 when every requirement of both parts is met, else 0.

Malformed images are scored, never raised on (as ``shapes``); non-finite images score NaN. A row without the
world's ``objects`` or without its ``edit`` raises a one-line :class:`~mmrl.reward.RewardError` naming the row.
"""

from __future__ import annotations

from typing import Any

from mmrl.reward import RewardError
from mmrl.rewards.shapes import (
    MIN_AREA_FRACTION,
    AreaFraction,
    ColorDistance,
    Component,
    _RowPixelReward,
    check_row,
    objects_of,
    requirement_scores,
)

EDIT_KINDS = ("recolor", "reshape", "swap")


def edited_requirements(row: dict[str, Any]) -> set[str]:
    """The names (as :func:`~mmrl.rewards.shapes.requirement_scores` gives them) of the requirements ``row``'s edit
    changes (module docstring)."""
    edit = row["edit"]
    if edit["kind"] == "recolor":
        return {f"color[{edit['object']}]"}
    if edit["kind"] == "reshape":
        return {f"count[{edit['object']}]", f"color[{edit['object']}]"}
    return {"position"}


def edit_scores(row: dict[str, Any], found: Any) -> tuple[float, float, bool]:
    """``(edit, kept, all met)``: the mean requirement score of each part for one image's objects ``found``."""
    changed = edited_requirements(row)
    edit, kept = [], []
    for name, value in requirement_scores(row, found):
        (edit if name in changed else kept).append(value)
    edit_mean = sum(edit) / len(edit)
    kept_mean = sum(kept) / len(kept) if kept else 1.0
    return edit_mean, kept_mean, all(value == 1.0 for value in edit + kept)


def check_edit_row(row: dict[str, Any], index: int) -> None:
    """Raise a one-line RewardError unless ``row`` is an edit-world row (its requirements and its edit)."""
    check_row(row, index, "shape_edit")
    edit = row.get("edit")
    where = f"reward 'shape_edit': dataset row {index} ({row.get('prompt', '')!r})"
    if not isinstance(edit, dict) or edit.get("kind") not in EDIT_KINDS:
        raise RewardError(f"{where} has no 'edit' with a kind in {EDIT_KINDS} (write the edit world's rows with "
                          "`python -m mmrl.plugins.flow.shapes.edits FOLDER`)")
    objects = row["objects"]
    if edit["kind"] == "swap":
        if row.get("relation") is None:
            raise RewardError(f"{where}: a swap needs the edited scene's 'relation'")
    elif not isinstance(edit.get("object"), int) or not 0 <= edit["object"] < len(objects):
        raise RewardError(f"{where}: edit {edit!r} needs an 'object' index into its {len(objects)} objects")


class ShapeEditReward(_RowPixelReward):
    """The edit world's reward (module docstring): the edit's requirements' score × the other requirements'."""

    name = "shape_edit"

    def __init__(self, strict: bool = False, max_color_distance: ColorDistance = 80.0,
                 min_area_fraction: AreaFraction = MIN_AREA_FRACTION, output: str = "images"):
        """Options (the config's ``args``).

        Args:
            strict: Score the accuracy (every requirement of the edit and of the rest met) instead of edit × kept.
            max_color_distance: As ``shapes``: a pixel farther than this from its nearest palette colour is ignored.
            min_area_fraction: As ``shapes``: components smaller than this fraction of the image are ignored.
            output: Payload entry holding the images.
        """
        super().__init__(max_color_distance, min_area_fraction, output)
        self.strict = bool(strict)

    def check_rows(self, rows: list[dict[str, Any]]) -> None:
        for index, row in enumerate(rows):
            check_edit_row(row, index)

    def score_found(self, row: dict[str, Any], items: list[Component]) -> float:
        edit, kept, met = edit_scores(row, objects_of(items))
        return float(met) if self.strict else edit * kept
