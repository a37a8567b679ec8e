"""Rule-based perception rewards for vision-language models: grounding, detection and counting.

Registered rewards (all return one float in [0, 1] per sample and never raise on malformed model output):

- ``iou``: IoU of the first predicted box with the ground-truth box, as in VLM-R1's REC reward (arXiv:2504.07615).
- ``giou``: generalised IoU mapped to [0, 1] by (GIoU + 1) / 2 (Visual-RFT's LISA reward, arXiv:2503.01785, uses
  GIoU + 1 ∈ [0, 2]; halving keeps every reward on one scale).
- ``detection``: multi-object score after greedy or Hungarian matching of predictions to ground truth (Hungarian
  bipartite matching as in Perception-R1, arXiv:2504.07954), scored as F1, mean matched IoU or AP.
- ``count``: exact or graded match of a predicted count.

Predicted boxes are parsed by :func:`mmrl.rewards.boxes.parse_detections` from the completion's ``<answer>`` block
(or the whole text without one) and mapped to original-image pixels according to ``convention``; ground truth is
read in original-image pixels. A blank answer (no text at all) always scores 0 so that the policy cannot collect
reward with empty answers (Visual-RFT issue #176); to claim "no objects" a model writes e.g. ``[]``.

**The box convention** of ``iou``, ``giou`` and ``detection`` is the model family's: built for a training run, they
read ``box_convention`` from the plugin's reward context (:meth:`mmrl.plugin.Plugin.reward_context`; the vlm plugin
declares its adapter's) when ``convention`` is not set, and refuse a ``convention`` that differs from it unless
``allow_convention_mismatch`` is true (a model fine-tuned to write another frame). With neither a context nor the
option (a reward built or called outside a run), they raise instead of guessing: reading Qwen2-VL's 0–1000 grid as
Qwen2.5-VL pixels scores a perfect answer about 0.18 (issue 19). See :func:`resolve_box_convention`.

**Ground-truth boxes** (``row[field]``) may be ``[x1, y1, x2, y2]``, a list of such lists, a dict or list of dicts
with a ``bbox_2d`` (or ``bbox``/``box``/``bounding_box``/``position``) entry and optional ``label``, a JSON string
of any of these, or text in which the box parser finds at least one box (read with the ``"absolute"`` convention).
Only an empty list (``[]``, or the JSON text ``"[]"``) means "no objects". Anything else that does not read as
boxes (``None``, ``""``, ``"10 20 110 220"``, a number, an object without a box) and any box with a non-finite
coordinate or zero width or height is a data error: :class:`~mmrl.reward.RewardError` names the row and the field.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from mmrl.registry import Range
from mmrl.reward import RewardError, RewardInput
from mmrl.rewards.boxes import (
    CONVENTIONS,
    IMAGE_FACTOR,
    MAX_ANSWER_CHARS,
    MIN_PIXELS,
    Convention,
    Detection,
    _raw_detections,
    answer_region,
    box_giou,
    box_iou,
    check_max_chars,
    completion_texts,
    parse_detections,
    qwen_resized_size,
)

# smart_resize's bounds on the processor's pixel options (boxes.py): an area is not negative, and the largest area
# holds at least one IMAGE_FACTOR × IMAGE_FACTOR patch. It also needs min_pixels <= max_pixels, which it checks.
MIN_PIXELS_RANGE = Range(0)
MAX_PIXELS_RANGE = Range(IMAGE_FACTOR * IMAGE_FACTOR)

# ---------------------------------------------------------------------------------------------------- assignment


def linear_assignment(cost: Sequence[Sequence[float]], maximize: bool = False) -> list[tuple[int, int]]:
    """Optimal assignment of rows to columns of a rectangular matrix (Hungarian method, O(n²·m)).

    Every row of the smaller side is assigned to a distinct column of the larger side so that the total cost is
    minimal (or maximal with ``maximize=True``). This is the shortest-augmenting-path form of the Hungarian
    algorithm with row and column potentials: rows are added one at a time, and each addition runs a Dijkstra-like
    search over reduced costs for the cheapest augmenting path.

    Args:
        cost: ``n × m`` matrix of finite numbers (a list of rows).
        maximize: Maximise the total instead of minimising it.

    Returns:
        ``min(n, m)`` pairs ``(row, column)``, sorted by row.
    """
    n = len(cost)
    m = len(cost[0]) if n else 0
    if n == 0 or m == 0:
        return []
    sign = -1.0 if maximize else 1.0
    transposed = n > m
    if transposed:
        matrix = [[sign * float(cost[i][j]) for i in range(n)] for j in range(m)]
        n, m = m, n
    else:
        matrix = [[sign * float(value) for value in row] for row in cost]
    inf = math.inf
    row_potential = [0.0] * (n + 1)  # index 0 is a virtual row/column used to start each search
    col_potential = [0.0] * (m + 1)
    owner = [0] * (m + 1)  # owner[j]: 1-based row assigned to column j (0 = free)
    for row in range(1, n + 1):
        owner[0] = row
        column = 0
        slack = [inf] * (m + 1)
        previous = [0] * (m + 1)
        visited = [False] * (m + 1)
        while owner[column] != 0:
            visited[column] = True
            current_row = owner[column]
            delta, next_column = inf, 0
            costs = matrix[current_row - 1]
            base = row_potential[current_row]
            for j in range(1, m + 1):
                if visited[j]:
                    continue
                reduced = costs[j - 1] - base - col_potential[j]
                if reduced < slack[j]:
                    slack[j] = reduced
                    previous[j] = column
                if slack[j] < delta:
                    delta, next_column = slack[j], j
            for j in range(m + 1):
                if visited[j]:
                    row_potential[owner[j]] += delta
                    col_potential[j] -= delta
                else:
                    slack[j] -= delta
            column = next_column
        while column != 0:  # flip the augmenting path
            before = previous[column]
            owner[column] = owner[before]
            column = before
    pairs = [(owner[j] - 1, j - 1) for j in range(1, m + 1) if owner[j] != 0]
    if transposed:
        pairs = [(j, i) for i, j in pairs]
    return sorted(pairs)


def greedy_matching(weights: Sequence[Sequence[float]], order: Sequence[int]) -> list[tuple[int, int]]:
    """Match predictions (rows) in ``order``: each takes the free target (column) of highest positive weight.

    Ties go to the lower column index. Rows whose best free weight is 0 stay unmatched.
    """
    taken: set[int] = set()
    pairs = []
    for row in order:
        best, best_weight = -1, 0.0
        for column, weight in enumerate(weights[row]):
            if column not in taken and weight > best_weight:
                best, best_weight = column, weight
        if best >= 0:
            taken.add(best)
            pairs.append((row, best))
    return sorted(pairs)


# ---------------------------------------------------------------------------------------------------- scoring


def _label(label: str | None) -> str | None:
    return None if label is None else " ".join(label.lower().split()) or None


def _confidence_order(predictions: Sequence[Detection]) -> list[int]:
    """Prediction indices by decreasing confidence (missing confidence counts as 1.0; ties keep output order)."""
    return sorted(range(len(predictions)), key=lambda i: -(1.0 if predictions[i].score is None
                                                           else predictions[i].score))


def _match_weights(predictions: Sequence[Detection], targets: Sequence[Detection], iou_threshold: float,
                   use_labels: bool) -> list[list[float]]:
    weights = []
    for prediction in predictions:
        row = []
        for target in targets:
            same = True
            if use_labels:
                a, b = _label(prediction.label), _label(target.label)
                same = a is None or b is None or a == b
            iou = box_iou(prediction.box, target.box) if same else 0.0
            row.append(iou if iou > 0 and iou >= iou_threshold else 0.0)
        weights.append(row)
    return weights


def average_precision(predictions: Sequence[Detection], targets: Sequence[Detection],
                      iou_threshold: float = 0.5) -> float:
    """Average precision of one class with all-point interpolation (PASCAL VOC 2010+ style).

    Predictions are ranked by confidence (missing = 1.0, ties in output order); each, in turn, is a true positive
    if it overlaps a not yet matched target with IoU ≥ ``iou_threshold`` (it takes the one of highest IoU, as in
    COCO), else a false positive. AP = Σ_k (r_k − r_{k−1}) · max_{j ≥ k} p_j over the ranked list, i.e. the area
    under the precision-recall curve made monotone from the right. Labels are ignored here.
    """
    if not targets:
        return 1.0 if not predictions else 0.0
    if not predictions:
        return 0.0
    matched = [False] * len(targets)
    true_positives = 0
    recalls, precisions = [], []
    for rank, index in enumerate(_confidence_order(predictions), start=1):
        best, best_iou = -1, 0.0
        for t, target in enumerate(targets):
            if matched[t]:
                continue
            iou = box_iou(predictions[index].box, target.box)
            if iou > best_iou and iou >= iou_threshold:
                best, best_iou = t, iou
        if best >= 0:
            matched[best] = True
            true_positives += 1
        recalls.append(true_positives / len(targets))
        precisions.append(true_positives / rank)
    for k in range(len(precisions) - 2, -1, -1):
        precisions[k] = max(precisions[k], precisions[k + 1])
    ap, previous_recall = 0.0, 0.0
    for recall, precision in zip(recalls, precisions, strict=True):
        ap += (recall - previous_recall) * precision
        previous_recall = recall
    return min(1.0, max(0.0, ap))


def detection_score(
    predictions: Sequence[Detection],
    targets: Sequence[Detection],
    *,
    matching: str = "hungarian",
    metric: str = "mean_iou",
    iou_threshold: float = 0.5,
    use_labels: bool = True,
) -> float:
    """Score predicted detections against targets (both in the same pixel frame); see :func:`detection`.

    Returns:
        A float in [0, 1]: 1.0 when both sides are empty, 0.0 when exactly one is.
    """
    if not targets or not predictions:
        return 1.0 if not targets and not predictions else 0.0
    if metric == "map50":
        labelled = use_labels and all(_label(d.label) is not None for d in [*predictions, *targets])
        if not labelled:
            return average_precision(predictions, targets, iou_threshold)
        classes = sorted({_label(d.label) for d in [*predictions, *targets]})  # type: ignore[type-var]
        scores = [
            average_precision([p for p in predictions if _label(p.label) == c],
                              [t for t in targets if _label(t.label) == c], iou_threshold)
            for c in classes
        ]
        return sum(scores) / len(scores)
    weights = _match_weights(predictions, targets, iou_threshold, use_labels)
    if matching == "greedy":
        pairs = greedy_matching(weights, _confidence_order(predictions))
    elif matching == "hungarian":
        pairs = linear_assignment(weights, maximize=True)
    else:
        raise ValueError(f"unknown matching {matching!r}; expected 'greedy' or 'hungarian'")
    matched = [weights[p][t] for p, t in pairs if weights[p][t] > 0]
    if metric == "f1":
        return 2.0 * len(matched) / (len(predictions) + len(targets))
    if metric == "mean_iou":
        return min(1.0, sum(matched) / max(len(predictions), len(targets)))
    raise ValueError(f"unknown detection metric {metric!r}; expected 'f1', 'mean_iou' or 'map50'")


# ---------------------------------------------------------------------------------------------------- row fields


def _row_size(value: Any, where: str) -> tuple[float, float]:
    if isinstance(value, dict) and "width" in value and "height" in value:
        value = (value["width"], value["height"])
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(_finite(v) and v > 0 for v in value):
        return float(value[0]), float(value[1])
    raise RewardError(f"{where} must be (width, height) with two positive numbers, got {value!r}")


def _row_name(row: dict[str, Any], index: int) -> str:
    """``dataset row {index}`` plus the row's id, first image or prompt, so that a bad row can be found in the data."""
    for key in ("id", "image", "prompt"):
        value = row.get(key)
        if isinstance(value, (list, tuple)) and value:
            value = value[0]
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return f"dataset row {index} ({key} {_short(value, 60)})"
    return f"dataset row {index}"


def _short(value: Any, limit: int = 100) -> str:
    """``repr(value)``, cut to ``limit`` characters, so that error messages stay one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _frames(batch: RewardInput, names: Sequence[str], convention: str, size_field: str, resized_size_field: str,
            min_pixels: int, max_pixels: int | None
            ) -> list[tuple[tuple[float, float] | None, tuple[float, float] | None]]:
    """(original_size, resized_size) of every row, as the convention needs them."""
    frames = []
    for name, row in zip(names, batch.rows, strict=True):
        original = None
        if row.get(size_field) is not None:
            original = _row_size(row[size_field], f"{name} field {size_field!r}")
        elif convention != "absolute":
            raise RewardError(
                f"{name} has no {size_field!r} field (the original image's (width, height)), which box "
                f"convention {convention!r} needs"
            )
        resized = None
        if convention == "qwen2_5_vl":
            if row.get(resized_size_field) is not None:
                resized = _row_size(row[resized_size_field], f"{name} field {resized_size_field!r}")
            elif max_pixels is not None:
                try:
                    resized = qwen_resized_size(original, min_pixels=min_pixels, max_pixels=max_pixels)  # type: ignore[arg-type]
                except ValueError as error:
                    raise RewardError(f"{name}: {error}") from None
            else:
                raise RewardError(
                    f"{name} has no {resized_size_field!r} field (the (width, height) the processor resized "
                    "the image to), which box convention 'qwen2_5_vl' needs; add it to the rows, or set the reward "
                    "options max_pixels (and min_pixels) to the processor's values to compute it with smart_resize"
                )
        frames.append((original, resized))
    return frames


_BOX_KEYS = ("bbox_2d", "bbox", "box", "bounding_box", "position")


def _finite(value: Any) -> bool:
    """A real number (not a bool) that converts to a finite float."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _is_box(value: Any) -> bool:
    """A list or tuple of four real numbers (finite or not): one box rather than a list of boxes."""
    return (isinstance(value, (list, tuple)) and len(value) == 4
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value))


def _target_box(item: Any, where: str, label: str | None = None) -> Detection:
    """One ground-truth box (``[x1, y1, x2, y2]`` or a dict with a box entry); anything else raises RewardError."""
    box = item
    if isinstance(item, dict):
        lowered = {str(k).lower(): v for k, v in item.items()}
        key = next((k for k in _BOX_KEYS if k in lowered), None)
        if key is None:
            raise RewardError(f"{where} holds {_short(item)}, which has none of the box keys {', '.join(_BOX_KEYS)}")
        box = lowered[key]
        label = str(lowered["label"]) if lowered.get("label") is not None else None
    if not _is_box(box):
        raise RewardError(f"{where} holds {_short(box)}, which is not a box [x1, y1, x2, y2] of four numbers")
    if not all(_finite(v) for v in box):
        raise RewardError(f"{where} holds the box {_short(box)} with a non-finite coordinate")
    values = [float(v) for v in box]
    x1, x2 = sorted((values[0], values[2]))
    y1, y2 = sorted((values[1], values[3]))
    if not (x2 > x1 and y2 > y1):
        raise RewardError(f"{where} holds the box {_short(box)} of zero width or height")
    return Detection((x1, y1, x2, y2), label)


def _targets(value: Any, where: str) -> list[Detection]:
    """Ground-truth detections (original pixels) of a row field, see the module docstring.

    ``[]`` (or the JSON text ``"[]"``) is the only way to say "no objects"; whatever else does not read as boxes is a
    data error, never "no objects": reading it as such would reward answers that find nothing (issue 19).

    Raises:
        RewardError: Naming ``where`` (the row and field) and the offending value.
    """
    if isinstance(value, str):
        try:
            decoded = json.loads(value)
        except ValueError:
            # Not JSON: text such as "<answer>[0, 0, 10, 10]</answer>" or Qwen2-VL box tokens, in original pixels.
            found = _raw_detections(answer_region(value))
            if not found:
                raise RewardError(f"{where} is the text {_short(value)}, in which no box [x1, y1, x2, y2] was found "
                                  "(write [] for an image with no objects)") from None
            return [_target_box(raw, where, label) for _, raw, label, _ in found]
        if not isinstance(decoded, (list, dict)):
            raise RewardError(f"{where} is the JSON text {_short(value)}, which is not a box, a list of boxes or [] "
                              "(no objects)")
        return _targets(decoded, where)
    if isinstance(value, dict) or _is_box(value):
        return [_target_box(value, where)]
    if isinstance(value, (list, tuple)):
        return [_target_box(item, where) for item in value]
    raise RewardError(f"{where} is {_short(value)}, not a box [x1, y1, x2, y2], a list of boxes, [] (no objects) or "
                      "a JSON string of them")


def _blank(text: str) -> bool:
    return not answer_region(text).strip()


def _predictions_and_targets(batch: RewardInput, field: str, output: str, convention: str | None, size_field: str,
                             resized_size_field: str, min_pixels: int, max_pixels: int | None):
    if convention is None:
        raise RewardError(
            f"no box convention: pass convention= (one of {', '.join(CONVENTIONS)}); only a reward built for a "
            "training run (build_reward with the plugin's reward context) defaults to the model family's"
        )
    texts = completion_texts(batch, output, last_chars=MAX_ANSWER_CHARS)  # the answer is at the end: bounded work
    references = batch.column(field)
    names = [_row_name(row, i) for i, row in enumerate(batch.rows)]
    frames = _frames(batch, names, convention, size_field, resized_size_field, min_pixels, max_pixels)
    for text, reference, name, (original, resized) in zip(texts, references, names, frames, strict=True):
        targets = _targets(reference, f"{name} field {field!r}")
        predictions = None if _blank(text) else parse_detections(text, convention, original, resized)  # type: ignore[arg-type]
        yield predictions, targets


def resolve_box_convention(args: dict[str, Any], context: Mapping[str, Any]) -> dict[str, Any]:
    """The ``resolve_args`` hook of ``iou``, ``giou`` and ``detection`` (see :func:`mmrl.reward.build_reward`).

    ``convention`` not set: it becomes the context's ``box_convention`` (the family of the model being trained);
    without one, nothing is guessed and this raises. ``convention`` set: kept if it equals the context's, or if the
    context declares none, or with ``allow_convention_mismatch: true``; otherwise refused.

    Args:
        args: The reward's options from the config.
        context: The run's reward context (:meth:`mmrl.plugin.Plugin.reward_context`); ``{}`` outside a run.

    Returns:
        ``args`` with ``convention`` set.

    Raises:
        RewardError: One line, for no convention at all, an unknown declared one, or a refused mismatch.
    """
    declared = context.get("box_convention")
    if declared is not None and declared not in CONVENTIONS:
        raise RewardError(f"the plugin declares box_convention {declared!r}, which is not one of "
                          f"{', '.join(CONVENTIONS)}")
    named = args.get("convention")
    if named is None:
        if declared is None:
            raise RewardError(
                f"no box convention: set the option convention (one of {', '.join(CONVENTIONS)}); it defaults to the "
                "model family's only in a run whose plugin declares one (the vlm plugin does)"
            )
        return {**args, "convention": declared}
    if declared is not None and named != declared and not args.get("allow_convention_mismatch", False):
        raise RewardError(
            f"option convention {named!r} differs from {declared!r}, the box convention of the model family being "
            f"trained; drop the option to read boxes as {declared!r}, or set allow_convention_mismatch: true if this "
            f"model writes {named!r} boxes"
        )
    return args


# ---------------------------------------------------------------------------------------------------- rewards


def _single_box_rewards(batch: RewardInput, similarity, **kwargs: Any) -> list[float]:
    scores = []
    for predictions, targets in _predictions_and_targets(batch, **kwargs):
        if predictions is None:
            scores.append(0.0)
        elif not targets or not predictions:
            scores.append(1.0 if not targets and not predictions else 0.0)
        else:
            scores.append(float(similarity(predictions[0].box, targets[0].box)))
    return scores


def iou(
    batch: RewardInput,
    *,
    field: str = "solution",
    output: str = "completions",
    convention: Convention | None = None,
    allow_convention_mismatch: bool = False,
    size_field: str = "image_size",
    resized_size_field: str = "resized_size",
    min_pixels: Annotated[int, MIN_PIXELS_RANGE] = MIN_PIXELS,
    max_pixels: Annotated[int, MAX_PIXELS_RANGE] | None = None,
) -> list[float]:
    """IoU of the first predicted box with the ground-truth box, in [0, 1] (VLM-R1's REC reward, arXiv:2504.07615).

    Only the first box of the answer counts (and the first ground-truth box, if several are given). No parseable
    box, or a blank answer, scores 0; an empty ground truth (``[]``) scores 1 only for an answer with no box.

    Args:
        field: Dataset column with the ground-truth box in original-image pixels (see the module docstring).
        output: Payload entry holding the model's text outputs.
        convention: Coordinate convention of the model's boxes: qwen2_vl, qwen2_5_vl, qwen3_vl, glm4v, absolute,
            relative.
            Null: the model family's, from the run's reward context (an error when there is none).
        allow_convention_mismatch: Accept a convention that differs from the model family's (a model trained to
            write another frame). Read when the reward is built for a run (a direct call has no family to compare).
        size_field: Dataset column with the original image's (width, height); needed by every convention except
            absolute (where it only clamps boxes to the image).
        resized_size_field: Dataset column with the (width, height) of the resized model input; read for qwen2_5_vl.
        min_pixels: The processor's min_pixels, used with max_pixels when rows have no resized size.
        max_pixels: The processor's max_pixels; when set, a missing resized size is computed with smart_resize.
    """
    return _single_box_rewards(batch, box_iou, field=field, output=output, convention=convention,
                               size_field=size_field, resized_size_field=resized_size_field,
                               min_pixels=min_pixels, max_pixels=max_pixels)


def _giou01(a: Sequence[float], b: Sequence[float]) -> float:
    return (box_giou(a, b) + 1.0) / 2.0


def giou(
    batch: RewardInput,
    *,
    field: str = "solution",
    output: str = "completions",
    convention: Convention | None = None,
    allow_convention_mismatch: bool = False,
    size_field: str = "image_size",
    resized_size_field: str = "resized_size",
    min_pixels: Annotated[int, MIN_PIXELS_RANGE] = MIN_PIXELS,
    max_pixels: Annotated[int, MAX_PIXELS_RANGE] | None = None,
) -> list[float]:
    """Generalised IoU of the first predicted box with the ground truth, mapped to [0, 1] as (GIoU + 1) / 2.

    GIoU = IoU − |C \\ (A∪B)| / |C| ∈ [−1, 1], with C the smallest box enclosing both, still rewards moving a
    non-overlapping box towards the target. Visual-RFT (arXiv:2503.01785) uses GIoU + 1 ∈ [0, 2]; halving it keeps
    all rewards on [0, 1]. A perfect box scores 1, disjoint boxes score below 0.5, and a missing box (no parseable
    box or a blank answer) scores 0, lower than any box; an empty ground truth scores 1 only for no box.

    Args:
        field: Dataset column with the ground-truth box in original-image pixels (see the module docstring).
        output: Payload entry holding the model's text outputs.
        convention: Coordinate convention of the model's boxes: qwen2_vl, qwen2_5_vl, qwen3_vl, glm4v, absolute,
            relative.
            Null: the model family's, from the run's reward context (an error when there is none).
        allow_convention_mismatch: Accept a convention that differs from the model family's (a model trained to
            write another frame). Read when the reward is built for a run (a direct call has no family to compare).
        size_field: Dataset column with the original image's (width, height); needed by every convention except
            absolute (where it only clamps boxes to the image).
        resized_size_field: Dataset column with the (width, height) of the resized model input; read for qwen2_5_vl.
        min_pixels: The processor's min_pixels, used with max_pixels when rows have no resized size.
        max_pixels: The processor's max_pixels; when set, a missing resized size is computed with smart_resize.
    """
    return _single_box_rewards(batch, _giou01, field=field, output=output, convention=convention,
                               size_field=size_field, resized_size_field=resized_size_field,
                               min_pixels=min_pixels, max_pixels=max_pixels)


def detection(
    batch: RewardInput,
    *,
    field: str = "solution",
    output: str = "completions",
    convention: Convention | None = None,
    allow_convention_mismatch: bool = False,
    size_field: str = "image_size",
    resized_size_field: str = "resized_size",
    min_pixels: Annotated[int, MIN_PIXELS_RANGE] = MIN_PIXELS,
    max_pixels: Annotated[int, MAX_PIXELS_RANGE] | None = None,
    matching: Literal["greedy", "hungarian"] = "hungarian",
    metric: Literal["f1", "mean_iou", "map50"] = "mean_iou",
    iou_threshold: Annotated[float, Range(0, 1)] = 0.5,
    use_labels: bool = True,
) -> list[float]:
    """Multi-object detection reward in [0, 1]: match predicted boxes to ground-truth boxes, then score.

    A pair can match only if its IoU is at least ``iou_threshold`` (and positive) and, with ``use_labels``, the
    labels agree when both sides have one (case- and whitespace-insensitive). ``"greedy"`` matching visits
    predictions by decreasing confidence (missing confidence = 1.0, ties in output order), each taking the free
    ground-truth box of highest IoU (Visual-RFT, arXiv:2503.01785); ``"hungarian"`` finds the assignment that
    maximises the summed IoU of matching pairs (bipartite matching as in Perception-R1, arXiv:2504.07954).

    Metrics (N_pred predictions, N_gt ground-truth boxes; both empty → 1, exactly one empty → 0; a blank answer
    → 0):

    - ``"f1"``: 2·TP / (N_pred + N_gt), with TP the number of matched pairs.
    - ``"mean_iou"``: Σ IoU over matched pairs / max(N_gt, N_pred), so missed and extra boxes both cost.
    - ``"map50"``: average precision at IoU ≥ ``iou_threshold`` (0.5 by default, hence the name) with the
      model's confidences as ranking, all-point interpolated (VOC 2010+ area under the monotone precision-recall
      curve, COCO-style best-IoU matching); ``matching`` does not apply. With labels on every box (and
      ``use_labels``) it is the mean AP over the union of ground-truth and predicted classes, so a class that is
      only predicted counts as AP 0 (hallucinated labels cost); otherwise all boxes form one class.

    Args:
        field: Dataset column with the ground-truth boxes in original-image pixels (see the module docstring).
        output: Payload entry holding the model's text outputs.
        convention: Coordinate convention of the model's boxes: qwen2_vl, qwen2_5_vl, qwen3_vl, glm4v, absolute,
            relative.
            Null: the model family's, from the run's reward context (an error when there is none).
        allow_convention_mismatch: Accept a convention that differs from the model family's (a model trained to
            write another frame). Read when the reward is built for a run (a direct call has no family to compare).
        size_field: Dataset column with the original image's (width, height); needed by every convention except
            absolute (where it only clamps boxes to the image).
        resized_size_field: Dataset column with the (width, height) of the resized model input; read for qwen2_5_vl.
        min_pixels: The processor's min_pixels, used with max_pixels when rows have no resized size.
        max_pixels: The processor's max_pixels; when set, a missing resized size is computed with smart_resize.
        matching: How predictions are paired with ground truth: greedy (by confidence) or hungarian (optimal).
        metric: f1 (2·TP / (N_pred + N_gt)), mean_iou (Σ matched IoU / max(N_gt, N_pred)) or map50 (AP at
            iou_threshold, confidence-ranked, all-point interpolated).
        iou_threshold: Minimum IoU for a prediction to match a ground-truth box (0 accepts any overlap).
        use_labels: Forbid matches whose labels differ (when both have labels) and compute map50 per class.
    """
    if not 0.0 <= iou_threshold <= 1.0:
        raise RewardError(f"detection iou_threshold must lie in [0, 1], got {iou_threshold}")
    scores = []
    for predictions, targets in _predictions_and_targets(
        batch, field=field, output=output, convention=convention, size_field=size_field,
        resized_size_field=resized_size_field, min_pixels=min_pixels, max_pixels=max_pixels,
    ):
        if predictions is None:
            scores.append(0.0)
            continue
        scores.append(float(detection_score(predictions, targets, matching=matching, metric=metric,
                                            iou_threshold=iou_threshold, use_labels=use_labels)))
    return scores


for _box_reward in (iou, giou, detection):
    _box_reward.resolve_args = resolve_box_convention  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------------- counting

# A number with its sign and an ordinal suffix if any: "-3" is minus three and "3rd" is no count, neither is 3. A
# minus sign counts only when no letter or digit precedes it ("3-4 birds" is a range ending in 4, not -4).
_COUNT_NUMBER = re.compile(
    r"(?:(?<![0-9A-Za-z.])(?P<minus>[-−]))?(?<![0-9.])"
    r"(?P<number>(?:[0-9]{1,3}(?:,[0-9]{3}){1,10}(?![0-9])|[0-9]{1,40})(?:\.[0-9]{1,40})?)"
    r"(?P<ordinal>(?i:st|nd|rd|th)(?![A-Za-z]))?"
)
_NUMBER_WORDS = {
    word: value for value, word in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
        "seventeen eighteen nineteen twenty".split()
    )
}
_NUMBER_WORD = re.compile(r"\b(" + "|".join(_NUMBER_WORDS) + r")\b", re.IGNORECASE)


def parse_count(text: Any, *, max_chars: int = MAX_ANSWER_CHARS) -> float | None:
    """The count stated in a text: the last number of its answer region, else the last number word (zero–twenty).

    Only the last ``max_chars`` characters are read (the answer comes at the end). Thousands separators
    (``1,024``) are accepted; a minus sign is kept (``-3`` is −3, which no count equals); ordinals (``3rd``,
    ``21st``) are not counts and are skipped. Returns ``None`` when the text states no number.
    """
    check_max_chars(max_chars)
    region = answer_region(text[-max_chars:] if isinstance(text, str) else text)
    last = None
    for match in _COUNT_NUMBER.finditer(region):
        if match.group("ordinal") is None:
            last = match
    if last is not None:
        value = float(last.group("number").replace(",", ""))
        if not math.isfinite(value):
            return None
        return -value if last.group("minus") else value
    words = _NUMBER_WORD.findall(region)
    return float(_NUMBER_WORDS[words[-1].lower()]) if words else None


def _count_target(value: Any, where: str) -> float:
    count = None
    if _finite(value):
        count = float(value)
    elif isinstance(value, (list, tuple)):
        count = float(len(value))
    elif isinstance(value, str):
        count = parse_count(value, max_chars=max(len(value), 1))
    if count is None or count < 0:
        raise RewardError(f"{where} is not a count (a number ≥ 0, a numeric string or a list of objects): {value!r}")
    return count


def count(
    batch: RewardInput,
    *,
    field: str = "solution",
    output: str = "completions",
    mode: Literal["exact", "graded"] = "exact",
    source: Literal["answer", "boxes"] = "answer",
    max_chars: Annotated[int, Range(1)] = MAX_ANSWER_CHARS,
) -> list[float]:
    """Counting reward in [0, 1]: the predicted count against the ground-truth count.

    ``mode="exact"`` gives 1 when the prediction equals the ground truth (R1-V's CLEVR counting reward);
    ``mode="graded"`` gives max(0, 1 − |pred − gt| / max(gt, 1)), linear partial credit for near misses (0/1
    count rewards give sparse signal; CrowdVLM-R1 argues for such fuzzy count rewards). The prediction is the last
    number in the answer (``source="answer"``) or the number of boxes in it (``source="boxes"``, one box per object
    as in Perception-R1, arXiv:2504.07954; degenerate boxes are not counted). No number, or a blank answer,
    scores 0; a negative number (``-3``) is no count, and ordinals (``3rd``) are skipped (see :func:`parse_count`).

    Args:
        field: Dataset column with the ground-truth count (a number, numeric string, or a list counted by length).
        output: Payload entry holding the model's text outputs.
        mode: exact (0/1) or graded (linear partial credit).
        source: Read the count as the last number in the answer, or as the number of boxes written.
        max_chars: Characters read per completion: its last ``max_chars`` (the answer comes at the end), which
            bounds the work per sample.
    """
    texts = completion_texts(batch, output, last_chars=max_chars)
    references = batch.column(field)
    scores = []
    for i, (text, reference) in enumerate(zip(texts, references, strict=True)):
        target = _count_target(reference, f"dataset row {i} field {field!r}")
        if _blank(text):
            scores.append(0.0)
            continue
        if source == "boxes":
            predicted: float | None = float(len(parse_detections(text, "absolute", None, max_chars=max_chars)))
        else:
            predicted = parse_count(text, max_chars=max_chars)
        if predicted is None:
            scores.append(0.0)
        elif mode == "exact":
            scores.append(float(predicted == target))
        else:
            scores.append(max(0.0, 1.0 - abs(predicted - target) / max(target, 1.0)))
    return scores


__all__ = [
    "average_precision",
    "count",
    "detection",
    "detection_score",
    "giou",
    "greedy_matching",
    "iou",
    "linear_assignment",
    "parse_count",
    "resolve_box_convention",
]
