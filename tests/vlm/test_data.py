"""The JSONL format and loader, the RefCOCO-style and counting converters, and the synthetic shapes generator."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from mmrl.plugins.vlm.data import (
    DataError,
    attach_sizes,
    box_answer,
    convert_counting,
    convert_refcoco,
    load_jsonl,
    main,
    make_shapes,
    read_records,
    write_jsonl,
    write_shapes_dataset,
)
from mmrl.rewards.boxes import CONVENTIONS, box_iou, parse_boxes, qwen_resized_size


def _image(path, size=(40, 30)):
    Image.new("RGB", size, (10, 20, 30)).save(path)
    return path


def test_loader_reads_rows_and_resolves_images(tmp_path):
    _image(tmp_path / "a.png", (40, 30))
    _image(tmp_path / "b.png", (50, 60))
    path = write_jsonl([
        {"image": "a.png", "problem": "Where is the cat?", "solution": [1, 2, 10, 20], "task": "grounding"},
        {"image": ["b.png", "a.png"], "problem": "How many?", "solution": 3, "task": "counting", "extra": 7},
    ], tmp_path / "train.jsonl")
    rows = load_jsonl(path)
    assert rows[0]["prompt"] == "Where is the cat?" and rows[0]["image"] == [str(tmp_path / "a.png")]
    assert rows[0]["image_size"] == [40, 30] and rows[0]["task"] == "grounding"
    assert rows[1]["image"] == [str(tmp_path / "b.png"), str(tmp_path / "a.png")]
    assert rows[1]["image_size"] == [50, 60] and rows[1]["extra"] == 7 and rows[1]["solution"] == 3
    sized = attach_sizes(rows, lambda size: qwen_resized_size(size, max_pixels=16 * 28 * 28))
    # 40x30 is below min_pixels (3136): both sides scale by sqrt(3136 / 1200) and round up to multiples of 28.
    assert sized[0]["resized_size"] == [84, 56]


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", r"train.jsonl line 2: not valid JSON"),
    ('["a list"]', r"train.jsonl line 2: expected a JSON object"),
    ('{"image": "a.png", "solution": 1, "task": "counting"}', r"train.jsonl line 2: missing key 'problem'"),
    ('{"image": [], "problem": "q", "solution": 1, "task": "counting"}', r"'image' must be a path or a non-empty"),
    ('{"image": "a.png", "problem": "  ", "solution": 1, "task": "counting"}', r"'problem' must be a non-empty"),
    ('{"image": "a.png", "problem": "q", "solution": null, "task": "counting"}', r"'solution' must not be null"),
    ('{"image": "a.png", "problem": "q", "solution": 1, "task": 3}', r"'task' must be a non-empty string"),
    ('{"image": "missing.png", "problem": "q", "solution": 1, "task": "counting"}', r"image .*missing.png does not"),
    ('{"image": "a.png", "problem": "q", "solution": 1, "task": "c", "image_size": [0, 3]}', r"'image_size' must be"),
])
def test_loader_rejects_malformed_rows_naming_line_and_key(tmp_path, line, message):
    _image(tmp_path / "a.png")
    good = json.dumps({"image": "a.png", "problem": "q", "solution": 1, "task": "counting"})
    path = tmp_path / "train.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(DataError, match=message) as error:
        load_jsonl(path)
    assert "\n" not in str(error.value)


def test_loader_rejects_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_jsonl(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="holds no rows"):
        load_jsonl(tmp_path / "empty.jsonl")


def test_refcoco_converter_turns_xywh_into_corner_boxes():
    records = [
        {"file_name": "COCO_1.jpg", "bbox": [10, 20, 30, 40], "sentences": [{"sent": "man on left"}, {"sent": "guy"}],
         "width": 640, "height": 480},
        {"image": "2.jpg", "bbox": [1, 2, 3, 4], "expression": "red car"},
    ]
    rows = convert_refcoco(records, all_expressions=True)
    assert [r["expression"] for r in rows] == ["man on left", "guy", "red car"]
    assert rows[0]["solution"] == [10.0, 20.0, 40.0, 60.0] and rows[0]["image_size"] == [640, 480]
    assert rows[0]["task"] == "grounding" and "man on left" in rows[0]["problem"]
    assert len(convert_refcoco(records)) == 2  # first expression only
    assert convert_refcoco([records[1]], bbox_format="xyxy")[0]["solution"] == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(DataError, match="refcoco record 0: 'bbox' must be four numbers"):
        convert_refcoco([{"image": "x.jpg", "bbox": [1, 2], "expression": "a"}])
    with pytest.raises(DataError, match="needs an expression"):
        convert_refcoco([{"image": "x.jpg", "bbox": [1, 2, 3, 4]}])
    with pytest.raises(DataError, match="has no area"):
        convert_refcoco([{"image": "x.jpg", "bbox": [1, 2, 0, 4], "expression": "a"}])


def test_counting_converter_reads_questions_objects_and_counts():
    rows = convert_counting([
        {"image": "a.png", "question": "How many cubes?", "answer": "3"},
        {"file_name": "b.png", "object": "dogs", "count": 2},
        {"image": "c.png", "category": "cars", "objects": [{}, {}, {}, {}]},
    ])
    assert [r["solution"] for r in rows] == [3, 2, 4]
    assert rows[1]["problem"] == "How many dogs are there in the image?" and rows[0]["task"] == "counting"
    with pytest.raises(DataError, match="counting record 0: needs a numeric"):
        convert_counting([{"image": "a.png", "question": "q", "answer": "many"}])
    with pytest.raises(DataError, match="needs a 'question'"):
        convert_counting([{"image": "a.png", "count": 1}])


def test_read_records_accepts_json_lists_annotations_and_jsonl(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"annotations": [{"x": 1}]}))
    (tmp_path / "b.jsonl").write_text('{"x": 2}\n\n{"x": 3}\n')
    assert read_records(tmp_path / "a.json") == [{"x": 1}]
    assert read_records(tmp_path / "b.jsonl") == [{"x": 2}, {"x": 3}]
    (tmp_path / "c.json").write_text('{"x": 1}')
    with pytest.raises(DataError, match="expected a JSON list"):
        read_records(tmp_path / "c.json")


def test_shapes_are_deterministic_and_mix_image_sizes():
    first = make_shapes(8, seed=5, tasks=["grounding", "counting"])
    again = make_shapes(8, seed=5, tasks=["grounding", "counting"])
    assert [r["prompt"] for r in first] == [r["prompt"] for r in again]
    assert all(a["image"].tobytes() == b["image"].tobytes() for a, b in zip(first, again, strict=True))
    assert [r["task"] for r in first[:2]] == ["grounding", "counting"]
    assert len({tuple(r["image_size"]) for r in first}) > 1
    assert make_shapes(8, seed=6)[0]["prompt"] != first[0]["prompt"] or \
        make_shapes(8, seed=6)[0]["image"].tobytes() != first[0]["image"].tobytes()
    # the training rows come first and do not depend on how many evaluation rows follow them (which is why
    # data.synthetic.eval_size is an evaluation-only key)
    longer = make_shapes(12, seed=5, tasks=["grounding", "counting"])
    assert [r["solution"] for r in longer[:8]] == [r["solution"] for r in first]
    assert all(a["image"].tobytes() == b["image"].tobytes() for a, b in zip(longer[:8], first, strict=True))


def test_shapes_answers_match_the_drawn_pixels():
    for row in make_shapes(12, seed=1, tasks=["grounding", "counting"]):
        if row["task"] == "grounding":
            x1, y1, x2, y2 = (int(v) for v in row["solution"])
            color = row["label"].split()[0]
            crop = row["image"].crop((x1, y1, x2, y2))
            from mmrl.plugins.vlm.data import COLORS

            assert COLORS[color] in [c for _, c in crop.getcolors(4096)]
            assert row["prompt"] == f"Where is the {row['label']}?"
        else:
            shape = row["prompt"].split()[2][:-1]
            assert row["solution"] == sum(1 for o in row["objects"] if o["label"].endswith(shape))


def test_shapes_dataset_writes_valid_jsonl_and_images(tmp_path):
    paths = write_shapes_dataset(tmp_path / "shapes", train_size=5, eval_size=3, seed=2,
                                 tasks=["grounding", "counting"])
    train, evaluation = load_jsonl(paths["train"]), load_jsonl(paths["eval"])
    assert len(train) == 5 and len(evaluation) == 3
    for row in train + evaluation:
        with Image.open(row["image"][0]) as image:
            assert list(image.size) == row["image_size"]
        assert row["task"] in ("grounding", "counting")


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_grounding_answers_round_trip_through_parse_boxes(convention):
    """The answer a model of each family would write for a shapes box parses back to the box (up to rounding)."""
    for row in make_shapes(10, seed=4, tasks=["grounding"], min_side=40, max_side=400):
        size = row["image_size"]
        resized = qwen_resized_size(size, max_pixels=16 * 28 * 28)
        text = box_answer(row["solution"], convention, size, resized, label=row["label"])
        (parsed,) = parse_boxes(text, convention, size, resized)
        unit_x, unit_y = _unit(convention, size, resized)
        for got, want, unit in zip(parsed, row["solution"], (unit_x, unit_y) * 2, strict=True):
            assert abs(got - want) <= 0.5 * unit + 1e-6
        assert box_iou(parsed, row["solution"]) > 0.8


def _unit(convention, size, resized):
    """Original pixels per unit of the convention's (rounded) coordinates."""
    if convention in ("qwen2_vl", "qwen3_vl"):
        return size[0] / 1000, size[1] / 1000
    if convention == "qwen2_5_vl":
        return size[0] / resized[0], size[1] / resized[1]
    if convention == "relative":
        return size[0] * 1e-4, size[1] * 1e-4
    return 1.0, 1.0


def test_command_line_writes_shapes_and_converts(tmp_path, capsys):
    assert main(["shapes", str(tmp_path / "s"), "--train", "2", "--eval", "1", "--tasks", "counting"]) == 0
    assert len(load_jsonl(tmp_path / "s" / "train.jsonl")) == 2
    source = write_jsonl([{"file_name": "x.jpg", "bbox": [0, 0, 5, 5], "expression": "it"}], tmp_path / "r.jsonl")
    assert main(["refcoco", str(source), str(tmp_path / "out.jsonl"), "--image-root", "/data/coco"]) == 0
    (record,) = read_records(tmp_path / "out.jsonl")
    assert record["image"] == "/data/coco/x.jpg" and record["solution"] == [0.0, 0.0, 5.0, 5.0]
