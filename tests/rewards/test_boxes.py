"""Box parsing, coordinate conventions, smart_resize and box geometry (mmrl.rewards.boxes)."""

from __future__ import annotations

import math
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmrl.reward import RewardError, RewardInput
from mmrl.rewards import boxes
from mmrl.rewards.boxes import (
    CONVENTIONS,
    box_giou,
    box_iou,
    check_max_chars,
    clean_box,
    completion_texts,
    convert_box,
    extract_answer,
    from_original,
    parse_boxes,
    parse_detections,
    qwen_resized_size,
    smart_resize,
    to_original,
)

FUZZ = settings(max_examples=200, deadline=None)

# ---------------------------------------------------------------------------------------------------- geometry


def test_iou_hand_computed():
    # [0,0,10,10] vs [5,5,15,15]: intersection 5·5 = 25, union 100 + 100 − 25 = 175 → 25/175 = 1/7.
    assert box_iou([0, 0, 10, 10], [5, 5, 15, 15]) == pytest.approx(1 / 7)
    # [0,0,4,4] vs [2,0,6,4]: intersection 2·4 = 8, union 16 + 16 − 8 = 24 → 1/3.
    assert box_iou([0, 0, 4, 4], [2, 0, 6, 4]) == pytest.approx(1 / 3)
    # Containment: [0,0,10,10] ⊃ [0,0,5,10]: 50 / 100.
    assert box_iou([0, 0, 10, 10], [0, 0, 5, 10]) == pytest.approx(0.5)
    assert box_iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    assert box_iou([0, 0, 10, 10], [10, 0, 20, 10]) == 0.0  # touching edges do not overlap
    assert box_iou([0, 0, 0, 0], [0, 0, 0, 0]) == 0.0  # empty union


def test_giou_hand_computed():
    # [0,0,10,10] vs [5,5,15,15]: IoU 1/7, enclosing box [0,0,15,15] has area 225, union 175
    # → GIoU = 1/7 − (225 − 175)/225 = 1/7 − 2/9 = −5/63.
    assert box_giou([0, 0, 10, 10], [5, 5, 15, 15]) == pytest.approx(-5 / 63)
    # Disjoint [0,0,10,10] vs [20,0,30,10]: IoU 0, enclosing [0,0,30,10] area 300, union 200 → −100/300 = −1/3.
    assert box_giou([0, 0, 10, 10], [20, 0, 30, 10]) == pytest.approx(-1 / 3)
    assert box_giou([1, 2, 3, 4], [1, 2, 3, 4]) == pytest.approx(1.0)
    # Far apart: GIoU tends to −1.
    assert box_giou([0, 0, 1, 1], [1000, 1000, 1001, 1001]) < -0.99


def test_clean_box_normalises_clamps_and_drops():
    assert clean_box([30, 40, 10, 20], (100, 100)) == [10, 20, 30, 40]  # swapped corners
    assert clean_box([-5, -5, 150, 60], (100, 50)) == [0, 0, 100, 50]  # clamped to the image
    assert clean_box([10, 10, 10, 20], (100, 100)) is None  # zero width
    assert clean_box([200, 10, 300, 20], (100, 100)) is None  # entirely outside → degenerate after clamping
    assert clean_box([0, 0, math.nan, 5], (100, 100)) is None
    assert clean_box([0, 0, math.inf, 5], None) is None
    assert clean_box([0, 0, 1e9, 5], None) == [0, 0, 1e9, 5]  # no size: only clamped at 0


# ---------------------------------------------------------------------------------------------------- smart_resize


def test_smart_resize_hand_computed():
    # 3000 (h) x 4000 (w) with max_pixels 1280·28² = 1,003,520: rounded 2996 x 4004 is too large, so both sides are
    # divided by √(12,000,000 / 1,003,520) ≈ 3.458 → 867.5 and 1156.7, floored to multiples of 28: 840 x 1148.
    assert smart_resize(3000, 4000, max_pixels=1280 * 28 * 28) == (840, 1148)
    # Default max_pixels 12,845,056: 4000 x 5000 = 20 MP is shrunk by √(20e6/12,845,056) ≈ 1.2478 → 3192 x 4004.
    assert smart_resize(4000, 5000) == (3192, 4004)
    # Small image: 10 x 10 rounds to 28 x 28 = 784 < 3136 and is scaled up by √(3136/100) = 5.6 → 56 x 56.
    assert smart_resize(10, 10) == (56, 56)
    # Already a multiple of 28 and within bounds: unchanged.
    assert smart_resize(280, 560) == (280, 560)
    assert qwen_resized_size((4000, 3000), max_pixels=1280 * 28 * 28) == (1148, 840)


@given(st.integers(1, 20000), st.integers(1, 20000),
       st.sampled_from([(3136, 12845056), (3136, 401408), (256 * 784, 1280 * 784)]))
@FUZZ
def test_smart_resize_properties(height, width, bounds):
    min_pixels, max_pixels = bounds
    if max(height, width) / min(height, width) > 200:
        with pytest.raises(ValueError):
            smart_resize(height, width, min_pixels=min_pixels, max_pixels=max_pixels)
        return
    new_h, new_w = smart_resize(height, width, min_pixels=min_pixels, max_pixels=max_pixels)
    assert new_h % 28 == 0 and new_w % 28 == 0 and new_h >= 28 and new_w >= 28
    if min(new_h, new_w) > 28:  # not pinned at the minimum side
        assert new_h * new_w <= max_pixels
    assert new_h * new_w >= min(min_pixels, 28 * 28)
    # The aspect ratio is kept up to the rounding of each side to a multiple of 28 (once sides are not tiny).
    if min(new_h, new_w) >= 112:
        assert abs(math.log((new_w / new_h) / (width / height))) <= 2 * 28 / (min(new_h, new_w) - 28)


def test_smart_resize_rejects_bad_input():
    with pytest.raises(ValueError):
        smart_resize(0, 10)
    with pytest.raises(ValueError):
        smart_resize(10, 10 * 201)
    with pytest.raises(ValueError):
        smart_resize(10, 10, min_pixels=10_000, max_pixels=1_000)


# (height, width, min_pixels, max_pixels, expected) as returned by qwen-vl-utils 0.0.14's
# smart_resize(height, width, 28, min_pixels, max_pixels); recorded once so the test does not import torchvision.
QWEN_VL_UTILS_CASES = [
    (3000, 4000, 3136, 1003520, (840, 1148)),
    (4000, 5000, 3136, 12845056, (3192, 4004)),
    (10, 10, 3136, 12845056, (56, 56)),
    (1080, 1920, 3136, 401408, (448, 840)),
    (1080, 1920, 3136, 12845056, (1092, 1932)),
    (480, 640, 3136, 501760, (476, 644)),
    (2448, 3264, 200704, 1003520, (840, 1148)),
    (14, 2800, 3136, 12845056, (28, 2800)),
    (6000, 80, 3136, 401408, (5460, 56)),
    (1, 1, 3136, 12845056, (56, 56)),
    (999, 1001, 3136, 401408, (616, 616)),
    (42, 70, 3136, 12845056, (56, 56)),
    (4032, 3024, 3136, 1003520, (1148, 840)),
    (7999, 8000, 3136, 12845056, (3556, 3584)),
    (2221, 1053, 200704, 401408, (896, 420)),
    (8137, 7384, 200704, 12845056, (3752, 3388)),
    (6239, 3459, 3136, 1003520, (1344, 728)),
    (484, 6406, 200704, 12845056, (476, 6412)),
    (54, 7317, 200704, 12845056, (56, 7308)),
    (3768, 1694, 200704, 401408, (924, 420)),
    (385, 436, 3136, 1003520, (392, 448)),
    (3568, 6935, 3136, 12845056, (2548, 4984)),
    (3604, 7550, 200704, 401408, (420, 896)),
    (6838, 1658, 3136, 12845056, (6832, 1652)),
]


@pytest.mark.parametrize(("height", "width", "min_pixels", "max_pixels", "expected"), QWEN_VL_UTILS_CASES)
def test_smart_resize_matches_qwen_vl_utils(height, width, min_pixels, max_pixels, expected):
    assert smart_resize(height, width, 28, min_pixels, max_pixels) == expected


# ---------------------------------------------------------------------------------------------------- conventions

ORIGINAL = (640, 480)


def test_qwen2_vl_hand_computed():
    # 0–1000 relative: x = 100/1000 · 640 = 64, y = 50/1000 · 480 = 24, 300 → 192, 150 → 72.
    assert parse_boxes('{"bbox_2d": [100, 50, 300, 150]}', "qwen2_vl", ORIGINAL) == [[64, 24, 192, 72]]
    assert parse_boxes("[100, 50, 300, 150]", "qwen3_vl", ORIGINAL) == [[64, 24, 192, 72]]
    assert parse_boxes("[0.1, 0.05, 0.3, 0.15]", "relative", (1000, 1000)) == [[100, 50, 300, 150]]
    assert parse_boxes("[64, 24, 192, 72]", "absolute", ORIGINAL) == [[64, 24, 192, 72]]


def test_qwen2_5_vl_rescales_from_resized_frame():
    # A 4000x3000 photo with max_pixels 1,003,520 is fed to the model at 1148x840 (see the smart_resize test), so a
    # box [1000, 750, 3000, 2250] in the original is written by Qwen2.5-VL as
    # [1000·1148/4000, 750·840/3000, 3000·1148/4000, 2250·840/3000] = [287, 210, 861, 630].
    original = (4000, 3000)
    resized = qwen_resized_size(original, max_pixels=1280 * 28 * 28)
    assert resized == (1148, 840)
    written = from_original([1000, 750, 3000, 2250], "qwen2_5_vl", original, resized)
    assert written == pytest.approx([287, 210, 861, 630])
    (box,) = parse_boxes('<answer>[{"bbox_2d": [287, 210, 861, 630], "label": "car"}]</answer>', "qwen2_5_vl",
                         original, resized)
    assert box == pytest.approx([1000, 750, 3000, 2250])
    # Reading the same text as if it were original pixels (VLM-R1 before its fix) gives a box with IoU ≈ 0.02.
    naive = parse_boxes("[287, 210, 861, 630]", "absolute", original)[0]
    assert box_iou(naive, box) < 0.05


def test_qwen2_5_vl_needs_resized_size():
    with pytest.raises(ValueError, match="resized_size"):
        parse_boxes("[1, 2, 3, 4]", "qwen2_5_vl", ORIGINAL)
    with pytest.raises(ValueError, match="original image size"):
        parse_boxes("[1, 2, 3, 4]", "qwen2_vl", None)
    with pytest.raises(ValueError, match="unknown box convention"):
        parse_boxes("[1, 2, 3, 4]", "pixels", ORIGINAL)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        parse_boxes("[1, 2, 3, 4]", "absolute", (0, 480))


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("original", [(640, 480), (4000, 3000), (333, 1999)])
def test_round_trip_every_convention(convention, original):
    resized = qwen_resized_size(original, max_pixels=1003520)
    if convention == "qwen2_5_vl" and original == (4000, 3000):
        assert resized != original  # the resize really changes the frame here
    box = [original[0] * 0.1, original[1] * 0.2, original[0] * 0.7, original[1] * 0.9]
    written = from_original(box, convention, original, resized)
    assert to_original(written, convention, original, resized) == pytest.approx(box)
    text = "<answer>[" + ", ".join(repr(v) for v in written) + "]</answer>"
    assert parse_boxes(text, convention, original, resized) == [pytest.approx(box)]
    for other in CONVENTIONS:
        there = convert_box(box, "absolute", other, original, resized)
        assert convert_box(there, other, "absolute", original, resized) == pytest.approx(box)


@given(
    st.lists(st.floats(0, 1), min_size=4, max_size=4),
    st.tuples(st.integers(28, 8000), st.integers(28, 8000)),
    st.sampled_from(CONVENTIONS),
)
@FUZZ
def test_round_trip_fuzz(fractions, original, convention):
    if max(original) / min(original) > 200:
        return
    resized = qwen_resized_size(original, max_pixels=1003520)
    box = [fractions[0] * original[0], fractions[1] * original[1], fractions[2] * original[0],
           fractions[3] * original[1]]
    back = to_original(from_original(box, convention, original, resized), convention, original, resized)
    assert back == pytest.approx(box, abs=1e-6)


# ---------------------------------------------------------------------------------------------------- parsing


def test_parse_syntaxes():
    size = (1000, 1000)
    assert parse_boxes("[1, 2, 3, 4]", "absolute", size) == [[1, 2, 3, 4]]
    assert parse_boxes("(1.5, 2.5, 3.5, 4.5)", "absolute", size) == [[1.5, 2.5, 3.5, 4.5]]
    assert parse_boxes("from (10,20) to ... no; (10, 20), (30, 40)", "absolute", size) == [[10, 20, 30, 40]]
    assert parse_boxes("[1e1, 2E1, 3.0e1, 4.e1]", "absolute", size) == [[10, 20, 30, 40]]
    tokens = "<|object_ref_start|>the dog<|object_ref_end|><|box_start|>(100,200),(300,400)<|box_end|>"
    (dog,) = parse_detections(tokens, "qwen2_vl", (500, 1000))
    assert dog.box == (50, 200, 150, 400) and dog.label == "the dog"
    visual_rft = ("[{'Position': [10, 20, 30, 40], 'Confidence': 0.8}, "
                  "{'Position': [50, 60, 70, 80], 'Confidence': 0.3}]")
    detections = parse_detections(visual_rft, "absolute", size)
    assert [d.box for d in detections] == [(10, 20, 30, 40), (50, 60, 70, 80)]
    assert [d.score for d in detections] == [0.8, 0.3]
    qwen = ('```json\n[\n  {"bbox_2d": [10, 20, 30, 40], "label": "cat"},\n'
            '  {"bbox_2d": [5, 5, 9, 9], "label": "dog"}\n]\n```')
    assert [(d.box, d.label) for d in parse_detections(qwen, "absolute", size)] == [
        ((10, 20, 30, 40), "cat"), ((5, 5, 9, 9), "dog")]
    assert parse_boxes("[[1,2,3,4],[5,6,7,8]]", "absolute", size) == [[1, 2, 3, 4], [5, 6, 7, 8]]


def test_glm_box_tokens_hand_computed():
    """GLM-4.1V/4.5V: boxes on the 0–1000 grid between <|begin_of_box|> and <|end_of_box|>, in any bracket style and
    several to a pair (zai-org/GLM-V README, "Grounding"); x = 100/1000 · 640 = 64, y = 50/1000 · 480 = 24."""
    expected = [[64, 24, 192, 72]]
    for body in ("[[100,50,300,150]]", "[100, 50, 300, 150]", "(100,50,300,150)", "<100,50,300,150>"):
        text = f"<think>the dog is left</think><answer><|begin_of_box|>{body}<|end_of_box|></answer>"
        assert parse_boxes(text, "glm4v", ORIGINAL) == expected, body
    two = "<answer><|begin_of_box|>[[100,50,300,150],[500,500,1000,1000]]<|end_of_box|></answer>"
    assert parse_boxes(two, "glm4v", ORIGINAL) == [[64, 24, 192, 72], [320, 240, 640, 480]]
    assert parse_boxes("<|begin_of_box|>[100,50,300]<|end_of_box|>", "glm4v", ORIGINAL) == []  # not 4k numbers
    assert parse_boxes("<|begin_of_box|>42<|end_of_box|>", "glm4v", ORIGINAL) == []  # GLM boxes answers too


def test_internvl_box_tokens_hand_computed():
    """InternVL: <ref>label</ref><box>[[x1, y1, x2, y2], ...]</box> on the 0–1000 grid (InternVL's RefCOCO evaluation);
    every box of a <box> takes its label; x = 100/1000 · 640 = 64, y = 50/1000 · 480 = 24."""
    text = "<answer><ref>the dog</ref><box>[[100, 50, 300, 150]]</box> and <ref>cats</ref><box>[[500,500,1000,1000]," \
           " [0, 0, 100, 100]]</box></answer>"
    found = [(d.box, d.label) for d in parse_detections(text, "qwen2_vl", ORIGINAL)]
    assert found == [((64, 24, 192, 72), "the dog"), ((320, 240, 640, 480), "cats"), ((0, 0, 64, 48), "cats")]
    assert parse_boxes("<box>[[100,50,300,150]]</box>", "qwen2_vl", ORIGINAL) == [[64, 24, 192, 72]]  # no <ref>
    assert parse_detections("<ref> </ref><box>[[100,50,300,150]]</box>", "qwen2_vl", ORIGINAL)[0].label is None
    assert parse_boxes("<box>[100,50,300]</box>", "qwen2_vl", ORIGINAL) == []  # not 4k numbers


def test_parse_prefers_answer_block():
    text = "<think>maybe [0, 0, 5, 5]?</think><answer>[10, 10, 20, 20]</answer>"
    assert parse_boxes(text, "absolute", (100, 100)) == [[10, 10, 20, 20]]
    # An answer tag with no box means no box, even if the reasoning mentions one.
    assert parse_boxes("<think>[0, 0, 5, 5]</think><answer>none</answer>", "absolute", (100, 100)) == []
    # Without an answer tag the whole text is searched.
    assert parse_boxes("the box is [10, 10, 20, 20].", "absolute", (100, 100)) == [[10, 10, 20, 20]]
    # Truncated answer: everything after the last <answer>.
    assert parse_boxes("<answer>[1, 1, 2, 2], [3, 3, 4", "absolute", (100, 100)) == [[1, 1, 2, 2]]


def test_extract_answer():
    assert extract_answer("no tags") is None
    assert extract_answer("<answer>a</answer>") == "a"
    assert extract_answer("<think>use <answer>x</answer></think><answer>y</answer>") == "y"
    assert extract_answer("<answer>cut off") == "cut off"
    assert extract_answer(None) is None


def test_parse_cleans_boxes():
    size = (100, 100)
    assert parse_boxes("[30, 40, 10, 20]", "absolute", size) == [[10, 20, 30, 40]]
    assert parse_boxes("[-10, -10, 500, 50]", "absolute", size) == [[0, 0, 100, 50]]
    assert parse_boxes("[10, 10, 10, 50]", "absolute", size) == []
    assert parse_boxes("[1e999, 0, 5, 5]", "absolute", size) == []
    assert parse_boxes("[1, 2, 3]", "absolute", size) == []
    assert parse_boxes("[1, 2, 3, 4, 5]", "absolute", size) == []
    assert parse_boxes("", "absolute", size) == []
    assert parse_boxes(None, "absolute", size) == []


_NUMBERS = ["0", "1", "-3", "12", "999", "1000", "4096", "1e999", "-0", ".5", "1.", "0.25", "nan", "inf", "9" * 60,
            "", "1,000", "0x10", "½", "-1e-300", "3.14159", "1e5"]
_TEMPLATES = [
    "[{}, {}, {}, {}]",
    "({},{}),({},{})",
    '{{"bbox_2d": [{}, {}, {}, {}], "label": "x", "confidence": {}}}',
    "{{'Position': [{}, {}, {}, {}], 'Confidence': {}}}",
    "<|box_start|>({},{}),({},{})<|box_end|>",
    "<|object_ref_start|>{}<|object_ref_end|><|box_start|>({},{}),({},{})<|box_end|>",
    "[[{}, {}], [{}, {}]]",
    "<|begin_of_box|>[[{}, {}, {}, {}]]<|end_of_box|>",
    "<|begin_of_box|><{},{},{},{}><|end_of_box|>",
    "<|begin_of_box|>[[{}, {}, {}, {}], [{}, {}, {}, {}]]<|end_of_box|>",
    "<|begin_of_box|>[{}, {}, {}]<|end_of_box|>",
]
_WRAPS = ["{}", "<answer>{}</answer>", "<think>{}</think><answer>{}</answer>", "<answer>{}", "<answer></answer>{}"]


def make_box_like_text(rng: random.Random) -> str:
    """Text made of box-shaped fragments with odd numbers, optionally in answer tags and truncated."""
    pieces = []
    for _ in range(rng.randint(0, 4)):
        template = rng.choice(_TEMPLATES)
        numbers = (rng.choice(_NUMBERS) if rng.random() < 0.5 else str(rng.uniform(-2000, 2000))
                   for _ in range(template.count("{}")))
        pieces.append(template.format(*numbers))
        pieces.append(rng.choice(["", ", ", "\n", " and ", "}", "]", "<answer>"]))
    text = rng.choice(_WRAPS).replace("{}", "".join(pieces))
    if rng.random() < 0.3:
        text = text[: rng.randint(0, len(text))]
    return text


#: Arbitrary text or box-like text (built from one random seed: fast to generate, shrinks poorly).
box_like_text = st.one_of(st.text(), st.randoms(use_true_random=False).map(make_box_like_text))


@given(box_like_text, st.sampled_from(CONVENTIONS))
@FUZZ
def test_parse_never_raises_and_returns_valid_boxes(text, convention):
    original = (640, 480)
    boxes = parse_boxes(text, convention, original, (644, 476))
    for x1, y1, x2, y2 in boxes:
        assert all(math.isfinite(v) for v in (x1, y1, x2, y2))
        assert 0 <= x1 < x2 <= original[0] and 0 <= y1 < y2 <= original[1]
    for detection in parse_detections(text, convention, original, (644, 476)):
        assert detection.score is None or not math.isnan(detection.score)


def test_adversarial_texts_parse_to_what_they_hold():
    """Bracket, number and \\boxed runs of tens of thousands of characters hold no box, and 3,000 repeated boxes are
    all found. (That parsing them takes linear time is checked without a clock below: the rewritten patterns agree
    with the old ones on random texts, and the overlap test with a brute-force one.)"""
    empty = ["[" * 20000, "1" * 50000, "[1," * 10000, "{" * 20000 + "}", "(1,2)," * 10000, "\\boxed{" * 5000]
    for text in empty:
        assert parse_boxes(text, "absolute", (100, 100)) == [], text[:12]
    assert parse_boxes("[1, 2, 3, 4]" * 3000, "absolute", (100, 100)) == [[1.0, 2.0, 3.0, 4.0]] * 3000


# ---------------------------------------------------------------------------------------------------- linear time
# Box parsing must be linear in the text (issue 19). Untimed checks: the rewritten corner-pair pattern and the
# merge-based overlap test agree with the old pattern and a brute-force overlap test on random box-like texts.

_OLD_PAIR = re.compile(
    rf"\({boxes._WS}({boxes._NUM}){boxes._SEP}({boxes._NUM}){boxes._WS}\){boxes._WS},?{boxes._WS}\({boxes._WS}"
    rf"({boxes._NUM}){boxes._SEP}({boxes._NUM}){boxes._WS}\)"
)
_pair_text = st.lists(st.sampled_from(["(1,2)", "(3, 4)", ",", " ", " " * 40, " " * 70, "\n", "(", ")", "5", "x"]),
                      max_size=12).map("".join)


@given(st.one_of(_pair_text, box_like_text))
@FUZZ
def test_pair_pattern_agrees_with_the_old_one(text):
    old = [(m.span(), m.groups()) for m in _OLD_PAIR.finditer(text)]
    assert [(m.span(), m.groups()) for m in boxes._PAIR.finditer(text)] == old


def _brute_force_detections(text):
    """_raw_detections with the old corner-pair pattern and a test of every span against every used span."""
    found, used = [], []

    def free(span):
        return all(span[1] <= start or span[0] >= end for start, end in used)

    for match in boxes._BOX_TOKENS.finditer(text):
        used.append(match.span())
        numbers = boxes._NUMBER.findall(match.group("body"))
        if len(numbers) == 4:
            label = match.group("label")
            found.append((match.start(), [float(n) for n in numbers], label.strip() if label else None, None))
    for match in boxes._GLM_BOX_TOKENS.finditer(text):
        used.append(match.span())
        numbers = [float(n) for n in boxes._NUMBER.findall(match.group("body"))]
        if numbers and len(numbers) % 4 == 0:
            found.extend((match.start(), numbers[i:i + 4], None, None) for i in range(0, len(numbers), 4))
    for match in boxes._OBJECT.finditer(text):
        box = boxes._KEYED_LIST4.search(match.group(0)) or boxes._LIST4.search(match.group(0))
        if free(match.span()) and box is not None:
            used.append(match.span())
            label = boxes._LABEL.search(match.group(0))
            label = None if label is None else (label.group(1) or label.group(2) or "").strip()
            score = boxes._SCORE.search(match.group(0))
            score = None if score is None or math.isnan(float(score.group(1))) else float(score.group(1))
            found.append((match.start(), [float(g) for g in box.groups()], label or None, score))
    for pattern in (boxes._LIST4, _OLD_PAIR):
        for match in pattern.finditer(text):
            if free(match.span()):
                used.append(match.span())
                found.append((match.start(), [float(g) for g in match.groups()], None, None))
    return sorted(found, key=lambda item: item[0])


@given(box_like_text)
@FUZZ
def test_raw_detections_agree_with_a_brute_force_overlap_test(text):
    assert repr(boxes._raw_detections(text)) == repr(_brute_force_detections(text))  # repr: NaN equals NaN


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 8)), max_size=12),
       st.lists(st.tuples(st.integers(0, 60), st.integers(1, 8)), max_size=12))
@FUZZ
def test_untaken_agrees_with_brute_force(spans, taken):
    def disjoint(pairs):  # sorted, non-overlapping spans from (start, length) pairs
        result = []
        for start, length in sorted(pairs):
            if not result or start >= result[-1][1]:
                result.append((start, start + length))
        return result

    spans, taken = disjoint(spans), disjoint(taken)
    expected = [all(end <= s or start >= e for s, e in taken) for start, end in spans]
    assert boxes._untaken(spans, taken) == expected


def test_parse_reads_the_last_max_chars():
    text = "[1, 1, 2, 2] then [3, 3, 4, 4]"
    assert parse_boxes(text, "absolute", None) == [[1, 1, 2, 2], [3, 3, 4, 4]]
    assert parse_boxes(text, "absolute", None, max_chars=12) == [[3, 3, 4, 4]]
    assert parse_boxes(text, "absolute", None, max_chars=11) == []  # "3, 3, 4, 4]"
    # The answer tag is looked for in the part read: here only the tail, without "<answer>".
    tagged = "<answer>[1, 1, 2, 2]</answer>"
    assert parse_boxes(tagged, "absolute", None, max_chars=len(tagged) - 1) == [[1, 1, 2, 2]]
    with pytest.raises(RewardError, match="max_chars"):
        parse_boxes(text, "absolute", None, max_chars=0)


def test_completion_texts_keeps_the_last_characters():
    batch = RewardInput(rows=[{}, {}], payload={"completions": ["abcdef", [{"role": "assistant", "content": "xyz"}]]})
    assert completion_texts(batch, "completions") == ["abcdef", "xyz"]
    assert completion_texts(batch, "completions", last_chars=2) == ["ef", "yz"]
    for bad in (0, -1, 1.5, True, "20"):
        with pytest.raises(RewardError, match="max_chars must be a positive integer"):
            check_max_chars(bad)
