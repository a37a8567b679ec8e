"""``grounding_world``: the grounding world's answer reward, scoring each question by its kind.

The VLM rewards score every row of a run with the same function; the world mixes three kinds of questions, so this
reward reads the row's ``kind`` and scores the sample with the reward of that kind:

========  =========================================================================================================
``locate``  ``iou`` (VLM-R1's REC reward): IoU of the first predicted box with the object's box (or ``giou``)
``find``    ``detection``: Hungarian matching of the predicted boxes to the objects' boxes, Σ matched IoU /
            max(predicted, true) (``find_metric``), pairs matching at IoU ≥ 0.5
``count``   ``count``: the last number of the answer against the true count (``count_mode`` exact or graded)
========  =========================================================================================================

Boxes are read in the model family's convention, which a training run declares (the VLM plugin's reward context),
exactly as ``iou`` and ``detection`` read them. Malformed model output scores 0; a row without a known ``kind`` is a
data error (:class:`~mmrl.reward.RewardError`).
"""

from __future__ import annotations

from typing import Any, Literal

from mmrl.reward import RewardError, RewardInput
from mmrl.rewards.boxes import Convention
from mmrl.rewards.perception import count, detection, giou, iou, resolve_box_convention

KINDS = ("locate", "find", "count")


def grounding_world(
    batch: RewardInput,
    *,
    kind_field: str = "kind",
    field: str = "solution",
    output: str = "completions",
    convention: Convention | None = None,
    allow_convention_mismatch: bool = False,
    find_metric: Literal["f1", "mean_iou", "map50"] = "mean_iou",
    count_mode: Literal["exact", "graded"] = "exact",
    locate_metric: Literal["iou", "giou"] = "iou",
) -> list[float]:
    """Score each sample by the reward of its question's kind (see the module docstring), in [0, 1].

    Args:
        kind_field: Row field naming the question kind: ``locate``, ``find`` or ``count``.
        field: Row field with the ground truth (a box, a list of boxes, or a count; original-image pixels).
        output: Payload entry holding the model's text outputs.
        convention: Box convention of the model's answers; null: the model family's, from the run.
        allow_convention_mismatch: Accept a convention other than the family's (see ``iou``).
        find_metric: ``detection``'s metric for find questions (matching threshold IoU 0.5).
        count_mode: ``count``'s mode for count questions.
        locate_metric: The reward of locate questions: ``iou``, or ``giou`` ((GIoU + 1) / 2, which also ranks boxes
            that miss the object by how far they are from it).

    Raises:
        RewardError: A row without ``kind_field`` or with a kind outside locate, find, count.
    """
    kinds = batch.column(kind_field)
    unknown = sorted({str(kind) for kind in kinds if kind not in KINDS})
    if unknown:
        raise RewardError(f"grounding_world: rows with {kind_field} {unknown}; allowed: {', '.join(KINDS)}")
    # The VLM plugin gives every row its resized_size, which the qwen2_5_vl convention reads.
    boxes: dict[str, Any] = dict(field=field, output=output, convention=convention)
    scorers = {
        "locate": lambda part: (giou if locate_metric == "giou" else iou)(part, **boxes),
        "find": lambda part: detection(part, **boxes, metric=find_metric),
        "count": lambda part: count(part, field=field, output=output, mode=count_mode),
    }
    scores = [0.0] * len(batch)
    for kind, scorer in scorers.items():
        members = [i for i, value in enumerate(kinds) if value == kind]
        if members:
            for index, score in zip(members, scorer(batch.select(members)), strict=True):
                scores[index] = float(score)
    return scores


grounding_world.resolve_args = resolve_box_convention  # type: ignore[attr-defined]
