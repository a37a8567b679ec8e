"""Perception rewards: iou, giou, detection (greedy / Hungarian, f1 / mean_iou / map50) and count."""

from __future__ import annotations

import functools
import itertools
import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmrl.config import RewardsConfig, from_dict
from mmrl.config.schema import bind_options
from mmrl.reward import Reward, RewardError, RewardInput, RewardScorer, build_reward
from mmrl.rewards import reward_functions
from mmrl.rewards.boxes import Detection
from mmrl.rewards.perception import (
    average_precision,
    count,
    detection,
    detection_score,
    giou,
    greedy_matching,
    iou,
    linear_assignment,
    parse_count,
)

from .test_boxes import box_like_text

FUZZ = settings(max_examples=200, deadline=None)


def make_batch(completions, solutions, **fields):
    """One row per completion; ``fields`` values are repeated on every row."""
    rows = [{"solution": solution, **fields} for solution in solutions]
    return RewardInput(rows=rows, payload={"completions": list(completions)})


def boxes_json(*boxes, **extra):
    return json.dumps([{"bbox_2d": list(box), **extra} for box in boxes])


ABS = {"convention": "absolute"}
QWEN25 = {"convention": "qwen2_5_vl"}


def test_registered_with_documented_options():
    for name in ("iou", "giou", "detection", "count"):
        entry = reward_functions.get(name)
        for option in reward_functions.options(name):
            assert option.help, f"{name}.{option.name} is undocumented"
        assert callable(entry)
    bound = bind_options(reward_functions.get("detection"),
                         {"matching": "greedy", "metric": "map50", "convention": "qwen2_vl", "max_pixels": 401408},
                         "rewards.functions[0].args", "reward 'detection'")
    assert bound["metric"] == "map50"
    with pytest.raises(Exception, match="matching"):
        bind_options(reward_functions.get("detection"), {"matching": "optimal"}, "args", "reward 'detection'")
    reward = build_reward("iou", {"convention": "absolute"})
    assert reward(make_batch(["[0, 0, 10, 10]"], [[0, 0, 10, 10]])) == [1.0]


# ---------------------------------------------------------------------------------------------------- iou / giou


def test_iou_hand_computed():
    # [5,5,15,15] vs GT [0,0,10,10]: intersection 25, union 175 → 1/7.
    batch = make_batch(["<think>…</think><answer>[5, 5, 15, 15]</answer>"], [[0, 0, 10, 10]])
    assert iou(batch, **ABS) == [pytest.approx(1 / 7)]
    # Qwen2-VL 0–1000 on a 200x100 image: [25, 50, 75, 150] → [5, 5, 15, 15] in pixels → the same 1/7.
    batch = make_batch(["<answer>(25,50),(75,150)</answer>"], [[0, 0, 10, 10]], image_size=(200, 100))
    assert iou(batch, convention="qwen2_vl") == [pytest.approx(1 / 7)]
    # Only the first predicted box counts.
    batch = make_batch(["[0, 0, 10, 10] [5, 5, 15, 15]", "[5, 5, 15, 15] [0, 0, 10, 10]"], [[0, 0, 10, 10]] * 2)
    assert iou(batch, **ABS) == [1.0, pytest.approx(1 / 7)]


def test_iou_qwen2_5_vl_frames():
    # 4000x3000 image resized to 1148x840: the model writes [287, 210, 861, 630] for [1000, 750, 3000, 2250].
    completion = '<answer>{"bbox_2d": [287, 210, 861, 630], "label": "car"}</answer>'
    gt = [1000, 750, 3000, 2250]
    with_field = make_batch([completion], [gt], image_size=(4000, 3000), resized_size=(1148, 840))
    assert iou(with_field, **QWEN25) == [pytest.approx(1.0)]
    computed = make_batch([completion], [gt], image_size=[4000, 3000])
    assert iou(computed, max_pixels=1280 * 28 * 28, **QWEN25) == [pytest.approx(1.0)]
    with pytest.raises(RewardError, match="resized_size"):
        iou(computed, **QWEN25)
    with pytest.raises(RewardError, match="image_size"):
        iou(make_batch([completion], [gt]), **QWEN25)
    # With the default max_pixels the 12 MP image is only rounded (to 4004x2996), so the same text is a far smaller box.
    assert iou(computed, max_pixels=12845056, **QWEN25)[0] < 0.2


def test_giou_hand_computed():
    gt = [[0, 0, 10, 10]]
    # GIoU([5,5,15,15], GT) = −5/63 (see test_boxes) → (1 − 5/63)/2 = 29/63.
    assert giou(make_batch(["[5, 5, 15, 15]"], gt), **ABS) == [pytest.approx(29 / 63)]
    # Disjoint [20,0,30,10]: GIoU = −1/3 → 1/3; perfect → 1.
    assert giou(make_batch(["[20, 0, 30, 10]"], gt), **ABS) == [pytest.approx(1 / 3)]
    assert giou(make_batch(["[0, 0, 10, 10]"], gt), **ABS) == [pytest.approx(1.0)]
    # A missing box scores below any box.
    assert giou(make_batch(["no box"], gt), **ABS) == [0.0]


MALFORMED = ["", "   ", "<answer></answer>", "<answer> </answer>", "no box here", "[1, 2, 3]", "[1, 2, 3, 4, 5]",
             "[10, 10, 10, 20]", "[nan, 1, 2, 3]", "<answer>[1e999, 0, 5, 5]</answer>", None, 42, {"x": 1}, ["?"]]


@pytest.mark.parametrize("reward", [iou, giou, detection])
def test_malformed_outputs_score_zero(reward):
    batch = make_batch(MALFORMED, [[0, 0, 10, 10]] * len(MALFORMED), image_size=(100, 100))
    assert reward(batch, **ABS) == [0.0] * len(MALFORMED)


def test_empty_ground_truth():
    batch = make_batch(["<answer>[]</answer>", "<answer>[1, 1, 5, 5]</answer>", "<answer></answer>", ""], [[]] * 4)
    for reward in (iou, giou, detection):
        assert reward(batch, **ABS) == [1.0, 0.0, 0.0, 0.0]


def test_ground_truth_formats():
    completion = ["[0, 0, 10, 10]"]
    for gt in ([0, 0, 10, 10], [[0, 0, 10, 10]], {"bbox_2d": [0, 0, 10, 10]}, [{"bbox": [10, 10, 0, 0]}],
               "[0, 0, 10, 10]", '{"bbox_2d": [0, 0, 10, 10], "label": "x"}', "<answer>[0, 0, 10, 10]</answer>",
               (0, 0, 10, 10)):
        assert iou(make_batch(completion, [gt]), **ABS) == [1.0], gt
    with pytest.raises(RewardError, match="solution"):
        iou(make_batch(completion, [[0, 0, "a", 10]]), **ABS)
    with pytest.raises(RewardError, match="solution"):
        iou(make_batch(["x"], [{"label": "no box"}]), **ABS)
    with pytest.raises(RewardError, match="solution"):
        iou(make_batch(["x"], [[0, 0, 10**400, 10]]), **ABS)
    with pytest.raises(RewardError, match="image_size"):
        iou(make_batch(["x"], [[0, 0, 1, 1]], image_size=(10**400, 5)), convention="qwen2_vl")


def test_payload_length_mismatch_is_a_clear_error():
    batch = RewardInput(rows=[{"solution": [0, 0, 1, 1]}] * 2, payload={"completions": ["[0,0,1,1]"]})
    with pytest.raises(RewardError, match="one completion per sample"):
        iou(batch, **ABS)


# ---------------------------------------------------------------------------------------------------- conventions

# Issue 19: a 640x480 image, the object at [64, 48, 320, 240] in original pixels. On the 0–1000 grid of Qwen2-VL and
# Qwen3-VL that is x/640·1000, y/480·1000 = (100, 100, 500, 500).
ISSUE_IMAGE = {"image_size": (640, 480), "resized_size": (644, 476)}
ISSUE_GT = [64, 48, 320, 240]
QWEN2_VL_ANSWER = "<|object_ref_start|>the dog<|object_ref_end|><|box_start|>(100,100),(500,500)<|box_end|>"
QWEN3_VL_ANSWER = '<answer>[{"bbox_2d": [100, 100, 500, 500], "label": "dog"}]</answer>'


def issue_batch(answer):
    return make_batch([answer], [ISSUE_GT], **ISSUE_IMAGE)


def qwen2_5_vl_reading_of_the_issue_answer():
    """IoU of (100,100),(500,500) read as pixels of the 644x476 resized input (what the old default did).

    x_abs = x·640/644, y_abs = y·480/476: [16000/161, 12000/119, 80000/161, 120000/119], clamped at y = 480.
    Intersection with [64, 48, 320, 240]: (320 − 16000/161)·(240 − 12000/119); IoU ≈ 0.181 (the issue's number).
    """
    x1, y1, x2, y2 = 16000 / 161, 12000 / 119, 80000 / 161, 480.0
    inter = (320 - x1) * (240 - y1)
    return inter / ((x2 - x1) * (y2 - y1) + 256 * 192 - inter)


@pytest.mark.parametrize("name", ["iou", "giou", "detection"])
@pytest.mark.parametrize(("family", "answer"), [("qwen2_vl", QWEN2_VL_ANSWER), ("qwen3_vl", QWEN3_VL_ANSWER)])
def test_convention_comes_from_the_run(name, family, answer):
    # The run's context (the VLM plugin declares its family's box convention) sets the default: a perfect answer
    # scores 1, where the old qwen2_5_vl default gave 0.181.
    reward = build_reward(name, {}, context={"box_convention": family})
    assert reward(issue_batch(answer)) == [pytest.approx(1.0)]
    named = build_reward(name, {"convention": family}, context={"box_convention": family})  # agreeing is fine
    assert named(issue_batch(answer)) == [pytest.approx(1.0)]


def test_qwen2_5_vl_context_reads_resized_pixels():
    # Qwen2.5-VL writes the same box in pixels of the 644x476 input: 64·644/640 = 64.4, 48·476/480 = 47.6, ...
    reward = build_reward("iou", {}, context={"box_convention": "qwen2_5_vl"})
    answer = '<answer>{"bbox_2d": [64.4, 47.6, 322, 238]}</answer>'
    assert reward(issue_batch(answer)) == [pytest.approx(1.0)]
    assert qwen2_5_vl_reading_of_the_issue_answer() == pytest.approx(0.1815, abs=5e-4)
    assert reward(issue_batch(QWEN2_VL_ANSWER)) == [pytest.approx(qwen2_5_vl_reading_of_the_issue_answer())]


@pytest.mark.parametrize("name", ["iou", "giou", "detection"])
def test_convention_mismatch_is_refused_at_build_time(name):
    with pytest.raises(RewardError) as caught:
        build_reward(name, {"convention": "qwen2_5_vl"}, context={"box_convention": "qwen2_vl"})
    message = str(caught.value)
    assert "\n" not in message
    for part in (repr(name), "'qwen2_5_vl'", "'qwen2_vl'", "allow_convention_mismatch"):
        assert part in message, message


def test_explicit_override_keeps_the_named_convention():
    args = {"convention": "qwen2_5_vl", "allow_convention_mismatch": True}
    reward = build_reward("iou", args, context={"box_convention": "qwen2_vl"})
    assert reward(issue_batch(QWEN2_VL_ANSWER)) == [pytest.approx(qwen2_5_vl_reading_of_the_issue_answer())]
    # The override is a validated option of the config (a bool), like every reward option.
    bound = bind_options(reward_functions.get("iou"), args, "rewards.functions[0].args", "reward 'iou'")
    assert bound == args
    with pytest.raises(Exception, match="allow_convention_mismatch"):
        bind_options(reward_functions.get("iou"), {"allow_convention_mismatch": "yes"}, "args", "reward 'iou'")


@pytest.mark.parametrize("name", ["iou", "giou", "detection"])
def test_no_convention_anywhere_is_an_error(name):
    # Outside a run that declares one, nothing is guessed: the convention must be named.
    for context in (None, {}, {"other_fact": 1}):
        with pytest.raises(RewardError, match="convention"):
            build_reward(name, {}, context=context)
    config = from_dict(RewardsConfig, {"functions": [{"name": name}]}, "rewards")
    with pytest.raises(RewardError, match=f"reward {name!r}.*convention"):
        RewardScorer.from_config(config)
    with pytest.raises(RewardError, match="convention"):
        reward_functions.get(name)(issue_batch(QWEN2_VL_ANSWER))  # a direct call without the option
    scorer = RewardScorer.from_config(config, context={"box_convention": "qwen2_vl"})
    assert scorer.score(issue_batch(QWEN2_VL_ANSWER)).scores.tolist() == [[pytest.approx(1.0)]]


def test_bad_context_is_refused():
    with pytest.raises(RewardError, match="box_convention 'qwen9_vl'"):
        build_reward("iou", {}, context={"box_convention": "qwen9_vl"})
    with pytest.raises(RewardError, match="JSON"):
        build_reward("iou", {}, context={"box_convention": object()})
    with pytest.raises(RewardError, match="dict"):
        build_reward("iou", {}, context=["qwen2_vl"])


def test_rewards_without_resolve_args_ignore_the_context():
    reward = build_reward("count", {}, context={"box_convention": "qwen2_vl"})
    assert reward(make_batch(["<answer>3</answer>"], [3])) == [1.0]


def test_resolve_args_hook_for_functions_and_classes():
    seen = []

    def resolve(args, context):
        seen.append(context)
        return {**args, "offset": context.get("offset", 0.0)}

    def shifted(batch, *, offset: float = 0.0):
        return [offset] * len(batch)

    shifted.resolve_args = resolve

    class Shifted(Reward):
        def __init__(self, offset: float = 0.0):
            self.offset = offset

        resolve_args = staticmethod(resolve)

        def __call__(self, batch):
            return [self.offset] * len(batch)

    reward_functions.register("test_shifted_function", shifted)
    reward_functions.register("test_shifted_class", Shifted)
    batch = make_batch(["x"], [0])
    for name in ("test_shifted_function", "test_shifted_class"):
        assert build_reward(name, {}, context={"offset": 2.5})(batch) == [2.5]
        assert build_reward(name, {})(batch) == [0.0]
    context = {"offset": 1.0}
    build_reward("test_shifted_function", {}, context=context)
    seen[-1]["offset"] = 9.0  # a reward gets its own copy: it cannot change the plugin's facts
    assert context == {"offset": 1.0}


# ---------------------------------------------------------------------------------------------------- ground truth


@pytest.mark.parametrize("reward", [iou, giou, detection])
def test_unparsable_ground_truth_names_the_row(reward):
    # Issue 19: "10 20 110 220" used to read as "no objects", so "I see nothing" scored 1 and the right box 0.
    rows = [{"solution": [10, 20, 110, 220], "image": ["a.jpg"]}, {"solution": "10 20 110 220", "image": ["b.jpg"]}]
    batch = RewardInput(rows=rows, payload={"completions": ["I see nothing", "<answer>[10, 20, 110, 220]</answer>"]})
    with pytest.raises(RewardError) as caught:
        reward(batch, **ABS)
    message = str(caught.value)
    assert "dataset row 1 (image 'b.jpg') field 'solution'" in message and "'10 20 110 220'" in message, message
    assert "\n" not in message


@pytest.mark.parametrize("solution", [
    None, "", "   ", "no objects", "I see nothing", "null", "5", '"[0, 0, 10, 10]"', 5, True,
    [10, 20, 10, 50],  # zero width
    [[0, 0, 10, 10], [5, 5, 5, 5]],  # one degenerate box among good ones
    "[0, 0, 10, 10] [7, 3, 7, 9]",  # the same in text
    "<answer>[1e999, 0, 5, 5]</answer>",
    [[]], [{}], [{"label": "cat"}], {"bbox_2d": []}, [0, 0, 10],
])
def test_malformed_ground_truth_raises(solution):
    batch = make_batch(["<answer>[0, 0, 10, 10]</answer>"], [solution])
    for reward in (iou, giou, detection):
        with pytest.raises(RewardError, match="dataset row 0 field 'solution'"):
            reward(batch, **ABS)


@pytest.mark.parametrize("empty", [[], (), "[]", " [ ] "])
def test_explicitly_empty_ground_truth_means_no_objects(empty):
    # The answers: no box (right), a box (wrong), a blank answer (always 0).
    batch = make_batch(["<answer>[]</answer>", "<answer>[0, 0, 10, 10]</answer>", ""], [empty] * 3)
    assert detection(batch, **ABS) == [1.0, 0.0, 0.0]
    assert iou(batch, **ABS) == [1.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------------- matching


def brute_force_best(weights):
    """Exact maximum-weight assignment by dynamic programming over subsets of columns (the test oracle)."""
    if not weights or not weights[0]:
        return 0.0
    if len(weights) > len(weights[0]):
        weights = [list(col) for col in zip(*weights, strict=True)]
    n, m = len(weights), len(weights[0])

    @functools.cache
    def best(row, used):
        if row == n:
            return 0.0
        return max(weights[row][j] + best(row + 1, used | (1 << j)) for j in range(m) if not used >> j & 1)

    return best(0, 0)


@given(st.integers(1, 9), st.integers(1, 9), st.randoms(use_true_random=False))
@settings(max_examples=100, deadline=None)
def test_hungarian_is_optimal(n, m, rng):
    weights = [[rng.choice([0.0, rng.random(), round(rng.random(), 1)]) for _ in range(m)] for _ in range(n)]
    pairs = linear_assignment(weights, maximize=True)
    assert len(pairs) == min(n, m)
    assert len({r for r, _ in pairs}) == len(pairs) == len({c for _, c in pairs})
    assert sum(weights[r][c] for r, c in pairs) == pytest.approx(brute_force_best(weights))
    costs = [[-w for w in row] for row in weights]
    assert sum(costs[r][c] for r, c in linear_assignment(costs)) == pytest.approx(-brute_force_best(weights))


@pytest.mark.parametrize("shape", [(9, 9), (12, 9), (9, 15), (30, 30)])
def test_hungarian_recovers_planted_assignment(shape):
    # Planted pairs weigh 1, all others < 1/n: any other assignment misses a planted pair and loses > 0.
    n, m = shape
    rng = random.Random(n * 100 + m)
    k = min(n, m)
    rows, cols = rng.sample(range(n), k), rng.sample(range(m), k)
    weights = [[rng.random() / (2 * k) for _ in range(m)] for _ in range(n)]
    for r, c in zip(rows, cols, strict=True):
        weights[r][c] = 1.0
    assert linear_assignment(weights, maximize=True) == sorted(zip(rows, cols, strict=True))


def test_hungarian_beats_greedy_on_a_classic_case():
    # Greedy takes the 0.9 first and is left with 0.1; the optimum is 0.8 + 0.8.
    weights = [[0.9, 0.8], [0.8, 0.1]]
    assert greedy_matching(weights, [0, 1]) == [(0, 0), (1, 1)]
    assert linear_assignment(weights, maximize=True) == [(0, 1), (1, 0)]
    assert linear_assignment([]) == [] and linear_assignment([[]]) == []


# Ground truth g0 = [0,0,10,10], g1 = [10,0,20,10]; predictions p0 = [2,0,12,10] (confidence 0.9) and
# p1 = [0,0,10,10] (confidence 0.8).
#   IoU(p0, g0) = 8·10 / (100 + 100 − 80) = 2/3      IoU(p0, g1) = 2·10 / (100 + 100 − 20) = 1/9
#   IoU(p1, g0) = 1                                  IoU(p1, g1) = 0
GT_TWO = [[0, 0, 10, 10], [10, 0, 20, 10]]
PRED_TWO = json.dumps([{"bbox_2d": [2, 0, 12, 10], "confidence": 0.9}, {"bbox_2d": [0, 0, 10, 10], "confidence": 0.8}])


@pytest.mark.parametrize(("matching", "metric", "threshold", "expected"), [
    # τ = 0.5: p0–g1 (1/9) cannot match. Greedy: p0 → g0 (2/3), p1 finds g0 taken → Σ = 2/3, 1 match.
    # Hungarian: p1 → g0 (1) is better than p0 → g0 (2/3) → Σ = 1, 1 match.
    ("greedy", "mean_iou", 0.5, (2 / 3) / 2),
    ("hungarian", "mean_iou", 0.5, 1 / 2),
    ("greedy", "f1", 0.5, 2 * 1 / 4),
    ("hungarian", "f1", 0.5, 2 * 1 / 4),
    # τ = 0.1: Hungarian pairs p0 → g1 (1/9) and p1 → g0 (1): Σ = 10/9, 2 matches; greedy is unchanged.
    ("greedy", "mean_iou", 0.1, (2 / 3) / 2),
    ("hungarian", "mean_iou", 0.1, (10 / 9) / 2),
    ("greedy", "f1", 0.1, 2 * 1 / 4),
    ("hungarian", "f1", 0.1, 2 * 2 / 4),
])
def test_greedy_and_hungarian_differ(matching, metric, threshold, expected):
    batch = make_batch([f"<answer>{PRED_TWO}</answer>"], [GT_TWO])
    score = detection(batch, matching=matching, metric=metric, iou_threshold=threshold, **ABS)
    assert score == [pytest.approx(expected)]


def test_greedy_follows_confidence():
    # Swapping the confidences makes greedy visit p1 first: p1 → g0 (1), p0 → g1 (1/9 at τ = 0.1) — the optimum.
    swapped = json.dumps([{"bbox_2d": [2, 0, 12, 10], "confidence": 0.2}, {"bbox_2d": [0, 0, 10, 10], "score": 0.8}])
    batch = make_batch([swapped], [GT_TWO])
    assert detection(batch, matching="greedy", iou_threshold=0.1, **ABS) == [pytest.approx((10 / 9) / 2)]


def test_detection_labels():
    gt = [{"bbox_2d": [0, 0, 10, 10], "label": "cat"}]
    same = make_batch([boxes_json([0, 0, 10, 10], label="Cat ")], [gt])
    other = make_batch([boxes_json([0, 0, 10, 10], label="dog")], [gt])
    unlabeled = make_batch([boxes_json([0, 0, 10, 10])], [gt])
    assert detection(same, **ABS) == [1.0]
    assert detection(other, **ABS) == [0.0]
    assert detection(other, use_labels=False, **ABS) == [1.0]
    assert detection(unlabeled, **ABS) == [1.0]


def test_detection_counts_missing_and_extra_boxes():
    gt = [[0, 0, 10, 10], [20, 0, 30, 10], [40, 0, 50, 10], [60, 0, 70, 10]]
    two = make_batch([boxes_json([0, 0, 10, 10], [20, 0, 30, 10])], [gt])
    assert detection(two, **ABS) == [pytest.approx(2 / 4)]  # Σ IoU 2 / max(4, 2)
    assert detection(two, metric="f1", **ABS) == [pytest.approx(2 * 2 / 6)]
    spam = make_batch([boxes_json(*([[0, 0, 10, 10]] * 8))], [gt[:1]])
    assert detection(spam, **ABS) == [pytest.approx(1 / 8)]  # one match, 8 predictions


# ---------------------------------------------------------------------------------------------------- mAP


def test_average_precision_hand_worked():
    # Three ground-truth boxes; predictions ranked by confidence:
    #   0.9 exact g0 → TP   precision 1/1, recall 1/3
    #   0.8 nowhere  → FP   precision 1/2, recall 1/3
    #   0.7 exact g1 → TP   precision 2/3, recall 2/3
    #   0.6 g0 again → FP   (g0 already matched) precision 2/4, recall 2/3
    # Precision made monotone from the right: 1, 2/3, 2/3, 1/2.
    # AP = (1/3 − 0)·1 + (1/3 − 1/3)·2/3 + (2/3 − 1/3)·2/3 + (2/3 − 2/3)·1/2 = 1/3 + 2/9 = 5/9.
    g0, g1, g2 = [0, 0, 10, 10], [20, 0, 30, 10], [40, 0, 50, 10]
    text = json.dumps([  # written out of order: the confidences decide the ranking
        {"bbox_2d": g1, "confidence": 0.7},
        {"bbox_2d": g0, "confidence": 0.6},
        {"bbox_2d": g0, "confidence": 0.9},
        {"bbox_2d": [60, 60, 70, 70], "confidence": 0.8},
    ])
    batch = make_batch([f"<answer>{text}</answer>"], [[g0, g1, g2]])
    assert detection(batch, metric="map50", **ABS) == [pytest.approx(5 / 9)]
    targets = [Detection(tuple(b)) for b in (g0, g1, g2)]
    predictions = [Detection(tuple(g0), score=0.9), Detection((60, 60, 70, 70), score=0.8),
                   Detection(tuple(g1), score=0.7), Detection(tuple(g0), score=0.6)]
    assert average_precision(predictions, targets) == pytest.approx(5 / 9)
    # Without confidences the output order ranks: TP, TP, FP → precision 1, 1, 2/3 at recall 1/3, 2/3, 2/3 → 2/3.
    plain = make_batch([boxes_json(g0, g1, [60, 60, 70, 70])], [[g0, g1, g2]])
    assert detection(plain, metric="map50", **ABS) == [pytest.approx(2 / 3)]


def test_map50_per_class():
    # Classes {cat, dog} in the ground truth plus a hallucinated bird: AP(cat) = AP(dog) = 1, AP(bird) = 0 → 2/3.
    gt = [{"bbox_2d": [0, 0, 10, 10], "label": "cat"}, {"bbox_2d": [20, 0, 30, 10], "label": "dog"}]
    text = json.dumps([{"bbox_2d": [0, 0, 10, 10], "label": "cat"}, {"bbox_2d": [20, 0, 30, 10], "label": "dog"},
                       {"bbox_2d": [40, 0, 50, 10], "label": "bird"}])
    batch = make_batch([text], [gt])
    assert detection(batch, metric="map50", **ABS) == [pytest.approx(2 / 3)]
    # One class: TP, TP, FP in output order → AP 1 (full recall is reached at precision 1).
    assert detection(batch, metric="map50", use_labels=False, **ABS) == [pytest.approx(1.0)]
    # Wrong labels everywhere: AP 0 for every class.
    wrong = json.dumps([{"bbox_2d": [0, 0, 10, 10], "label": "dog"}, {"bbox_2d": [20, 0, 30, 10], "label": "cat"}])
    assert detection(make_batch([wrong], [gt]), metric="map50", **ABS) == [0.0]


@pytest.mark.parametrize("metric", ["f1", "mean_iou", "map50"])
@pytest.mark.parametrize("matching", ["greedy", "hungarian"])
def test_detection_empty_cases(metric, matching):
    options = {"metric": metric, "matching": matching, **ABS}
    assert detection(make_batch(["<answer>[]</answer>"], [[]]), **options) == [1.0]
    assert detection(make_batch(["<answer>[]</answer>"], [[[0, 0, 5, 5]]]), **options) == [0.0]
    assert detection(make_batch(["<answer>[0, 0, 5, 5]</answer>"], [[]]), **options) == [0.0]
    assert detection(make_batch(["<answer>[0, 0, 5, 5]</answer>"], [[[0, 0, 5, 5]]]), **options) == [1.0]
    assert detection_score([], [], metric=metric, matching=matching) == 1.0


# ---------------------------------------------------------------------------------------------------- count


def test_count_exact_and_graded():
    completions = ["<answer>4</answer>", "<answer>3</answer>", "<answer>There are 10 apples.</answer>",
                   "<answer>four</answer>", "<answer>1,024</answer>", "<answer>none</answer>", "", "<answer></answer>"]
    gts = [4, 4, 4, "4", 1024, 4, 0, 0]
    batch = make_batch(completions, gts)
    assert count(batch) == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    # graded: 1 − |pred − gt| / max(gt, 1): 3 vs 4 → 0.75; 10 vs 4 → max(0, −0.5) = 0.
    assert count(batch, mode="graded") == [1.0, 0.75, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    zero = make_batch(["<answer>0</answer>", "<answer>2</answer>"], [0, 0])
    assert count(zero, mode="graded") == [1.0, 0.0]  # 2 vs 0: 1 − 2/1 < 0


def test_count_from_boxes():
    three = "<answer>" + boxes_json([0, 0, 1, 1], [2, 2, 3, 3], [4, 4, 5, 5]) + "</answer>"
    batch = make_batch([three, "<answer>[]</answer>", "<answer>[1, 1, 1, 1]</answer>"], [3, [1, 2, 3], 0])
    assert count(batch, source="boxes") == [1.0, 0.0, 1.0]  # the degenerate box is not counted
    assert count(make_batch([three], [[[0, 0, 1, 1]] * 3]), source="boxes") == [1.0]


def test_parse_count_and_bad_targets():
    assert parse_count("<answer>I see 7 birds</answer>") == 7
    assert parse_count("I count 2 then 5") == 5
    assert parse_count("no number") is None
    assert parse_count(None) is None
    with pytest.raises(RewardError, match="count"):
        count(make_batch(["<answer>3</answer>"], ["many"]))
    for negative in (-3, "-3", "3rd"):  # a count is a number ≥ 0; an ordinal is none
        with pytest.raises(RewardError, match="is not a count"):
            count(make_batch(["<answer>3</answer>"], [negative]))


@pytest.mark.parametrize(("text", "value"), [
    ("-3", -3.0),
    ("<answer>−3</answer>", -3.0),  # U+2212 minus
    ("there are -3 birds", -3.0),
    ("3rd", None),  # an ordinal is no count
    ("the 1st, 2nd, 3rd and 4th", None),
    ("3 birds; the 3rd is red", 3.0),  # ordinals are skipped, the count before them is read
    ("<answer>11TH</answer>", None),
    ("3-4 birds", 4.0),  # a hyphen after a digit is a range, not a sign
    ("x-3", 3.0),
    ("3rds of them: 3", 3.0),
    ("3stars", 3.0),  # "st" followed by a letter is no ordinal suffix
    ("1,024 items", 1024.0),
])
def test_parse_count_signs_and_ordinals(text, value):
    assert parse_count(text) == value


def test_count_rejects_negative_numbers_and_ordinals():
    completions = ["<answer>3</answer>", "<answer>-3</answer>", "<answer>3rd</answer>", "<answer>the 3rd: 2</answer>"]
    batch = make_batch(completions, [3] * 4)
    assert count(batch) == [1.0, 0.0, 0.0, 0.0]
    # graded: -3 vs 3 → 1 − 6/3 < 0 → 0; 2 vs 3 → 1 − 1/3.
    assert count(batch, mode="graded") == [1.0, 0.0, 0.0, pytest.approx(2 / 3)]


def test_count_reads_only_the_last_max_chars():
    batch = make_batch(["<answer>3</answer>" + "." * 20, "<answer>3</answer>"], [3, 3])
    assert count(batch) == [1.0, 1.0]
    assert count(batch, max_chars=20) == [0.0, 1.0]
    assert parse_count("3 and then 12", max_chars=2) == 12
    assert parse_count("3 and then 12", max_chars=1) == 2
    boxes = make_batch(["<answer>[0, 0, 1, 1]</answer>" + " " * 20], [1])
    assert count(boxes, source="boxes") == [1.0]
    assert count(boxes, source="boxes", max_chars=20) == [0.0]  # blank once capped


def test_box_rewards_read_only_the_last_characters(monkeypatch):
    from mmrl.rewards import perception

    text = "<answer>[0, 0, 10, 10]</answer>" + " x" * 10  # 20 characters after the answer
    batch = make_batch([text], [[0, 0, 10, 10]])
    assert iou(batch, **ABS) == [1.0] and detection(batch, **ABS) == [1.0]
    monkeypatch.setattr(perception, "MAX_ANSWER_CHARS", 20)  # the cap of iou, giou and detection
    assert iou(batch, **ABS) == [0.0] and giou(batch, **ABS) == [0.0] and detection(batch, **ABS) == [0.0]
    monkeypatch.setattr(perception, "MAX_ANSWER_CHARS", 42)
    assert iou(batch, **ABS) == [0.0]  # "0, 0, 10, 10]</answer> x x …": no box
    monkeypatch.setattr(perception, "MAX_ANSWER_CHARS", 43)
    assert iou(batch, **ABS) == [1.0]  # "[0, 0, 10, 10]</answer> x x …": "<answer>" is cut, the box is whole


# ---------------------------------------------------------------------------------------------------- fuzzing

ROW = {"solution": [[10, 20, 200, 300], [300, 100, 400, 400]], "image_size": (640, 480), "resized_size": (644, 476)}
LABELED = {**ROW, "solution": [{"bbox_2d": [10, 20, 200, 300], "label": "x"}, [300, 100, 400, 400]]}
CONFIGS = [
    (iou, ROW, QWEN25),
    (iou, ROW, {"convention": "qwen2_vl"}),
    (giou, ROW, {"convention": "relative"}),
    (giou, ROW, {"convention": "absolute"}),
    *((detection, LABELED, {"matching": a, "metric": b, "convention": "qwen2_vl"})
      for a, b in itertools.product(["greedy", "hungarian"], ["f1", "mean_iou", "map50"])),
    (detection, LABELED, {"convention": "absolute"}),
    (detection, ROW, {"iou_threshold": 0.0, **QWEN25}),
    (count, {"solution": 3}, {}),
    (count, {"solution": 3}, {"mode": "graded", "source": "boxes"}),
]


@given(st.lists(box_like_text, min_size=1, max_size=3))
@FUZZ
def test_perception_rewards_never_raise(texts):
    for reward, row, options in CONFIGS:
        batch = RewardInput(rows=[dict(row) for _ in texts], payload={"completions": texts})
        scores = reward(batch, **options)
        assert len(scores) == len(texts)
        for score in scores:
            assert isinstance(score, float) and math.isfinite(score) and 0.0 <= score <= 1.0, (reward, options)
