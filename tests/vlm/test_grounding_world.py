"""The grounding world (docs/vlm.md, "The grounding world"): exact shapes, scenes that satisfy their questions, the
held-out compositions, answers in each family's box convention, the world's reward, and its tiny Qwen2.5-VL / Qwen2-VL
with the locally built tokenizer."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import numpy as np
import pytest

from mmrl.plugins.vlm.grounding import world
from mmrl.plugins.vlm.grounding.reward import grounding_world
from mmrl.plugins.vlm.grounding.world import Thing
from mmrl.reward import RewardError, RewardInput


# ------------------------------------------------------------------------------------------------ images
def test_shapes_cover_exactly_the_pixel_centres_inside_them():
    # Square [2, 3, 7, 9): columns 2..6, rows 3..8.
    square = world.shape_mask("square", (2, 3, 7, 9), 12, 12)
    assert square.sum() == 30 and square[3:9, 2:7].all()
    # Circle inscribed in [0, 10)²: the pixel centres within radius 5 of (5, 5), 80 of them (as a size-10 circle
    # centred on a pixel corner in the shapes world).
    circle = world.shape_mask("circle", (0, 0, 10, 10), 10, 10)
    assert circle.sum() == 80 and circle[0, 4] and not circle[0, 2] and circle.T.tolist() == circle.tolist()
    # Triangle, apex at the top middle: row j keeps the centres with |x - 5| <= (j + 0.5) / 2, so the row widths are
    # 0, 2, 2, 4, 4, 6, 6, 8, 8, 10 (half of the box).
    triangle = world.shape_mask("triangle", (0, 0, 10, 10), 10, 10)
    assert triangle.sum(axis=1).tolist() == [0, 2, 2, 4, 4, 6, 6, 8, 8, 10]
    with pytest.raises(ValueError, match="unknown shape 'star'; the world has circle, square, triangle"):
        world.shape_mask("star", (0, 0, 4, 4), 8, 8)


def test_render_draws_the_palette_colours_under_the_ramp_on_a_background_that_never_uses_them():
    things = [Thing("red", "square", (4, 4, 20, 20)), Thing("blue", "circle", (30, 10, 50, 30))]
    shift = world.ramp(64, 48)  # [H, W, 3]
    for kind in world.BACKGROUNDS:
        image = world.render(things, 64, 48, kind, seed=3)
        assert image.shape == (48, 64, 3) and image.dtype == np.uint8
        lit = lambda color, y, x: np.clip(np.rint(np.array(world.PALETTE[color]) + shift[y, x]), 0, 255)  # noqa: E731
        assert all((image[y, x] == lit("red", y, x)).all() for y in range(4, 20) for x in range(4, 20))
        assert (image[20, 40] == lit("blue", 20, 40)).all()  # the circle's centre
        free = np.ones((48, 64), dtype=bool)
        for thing in things:
            free &= ~world.shape_mask(thing.shape, thing.box, 64, 48)
        # Every background pixel is at least 60 levels (L1) from every lit palette colour at its place.
        for color in world.PALETTE:
            palette = np.clip(np.array(world.PALETTE[color]) + shift, 0, 255)  # [H, W, 3]
            assert np.abs(image.astype(np.int64) - palette)[free].sum(axis=-1).min() > 60
        assert np.array_equal(image, world.render(things, 64, 48, kind, seed=3))
    assert not np.array_equal(world.render(things, 64, 48, "noise", 3), world.render(things, 64, 48, "noise", 4))
    with pytest.raises(ValueError, match="unknown background 'wood'"):
        world.render(things, 64, 48, "wood", seed=0)


def test_background_ramp_encodes_the_pixel_position_in_red_and_blue_minus_green():
    # The ramp adds RAMP * (2 (x + 1/2) / MAX_SIDE - 1) to red and the same in y to blue; textures change the three
    # channels alike, so (red - green, blue - green) is the ramp up to rounding (away from clipped pixels).
    width, height = 336, 140
    ys, xs = np.mgrid[0:height, 0:width]
    expected_x = world.RAMP * (2 * (xs + 0.5) / world.MAX_SIDE - 1)  # [H, W]
    expected_y = world.RAMP * (2 * (ys + 0.5) / world.MAX_SIDE - 1)
    for kind in world.BACKGROUNDS:
        image = world.render([], width, height, kind, seed=5).astype(np.int64)
        unclipped = ((image > 0) & (image < 255)).all(axis=-1)  # [H, W]
        assert unclipped.mean() > 0.8
        assert np.abs(image[..., 0] - image[..., 1] - expected_x)[unclipped].max() <= 1.0
        assert np.abs(image[..., 2] - image[..., 1] - expected_y)[unclipped].max() <= 1.0
    # The same slope in every image: column 100 has the same red - green in a narrow and a wide image.
    narrow, wide = world.render([], 112, 112, "flat", 1), world.render([], 336, 112, "flat", 2)
    column = lambda image: int(image[50, 100, 0]) - int(image[50, 100, 1])  # noqa: E731
    assert abs(column(narrow) - column(wide)) <= 1


def test_image_sizes_stay_unresized_by_the_qwen_processor_at_the_recipe_pixel_bounds():
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    from mmrl.plugins.vlm.grounding import model as world_model

    sizes = {tuple(r["image_size"]) for r in world.make_records(300, "train", 4)}
    assert len(sizes) > 20 and max(w / h for w, h in sizes) == 3 and min(w / h for w, h in sizes) == 1 / 3
    for width, height in sizes:
        assert width % world.GRID == 0 and height % world.GRID == 0 and width * height <= world.MAX_AREA
        assert smart_resize(height, width, factor=28, min_pixels=world_model.MIN_PIXELS,
                            max_pixels=world_model.MAX_PIXELS) == (height, width)


# ------------------------------------------------------------------------------------------------ questions
def test_held_out_places_cover_the_grid():
    # Type (c, s) at place (3c + 4s) mod 9: red circle 0, green triangle 11 mod 9 = 2, blue square 10 mod 9 = 1,
    # yellow circle 9 mod 9 = 0; places 0, 4, 8 are held out for two types, the others for one.
    assert world.held_out_region("red", "circle") == "top left"
    assert world.held_out_region("green", "triangle") == "top right"
    assert world.held_out_region("blue", "square") == "top"
    assert world.held_out_region("yellow", "circle") == "top left"
    places = Counter(world.held_out_region(c, s) for c in world.COLORS for s in world.SHAPES)
    assert set(places) == set(world.PLACES)
    assert sorted(p for p, n in places.items() if n == 2) == sorted(["top left", "centre", "bottom right"])
    thing = Thing("red", "circle", (0, 0, 30, 30))  # centre (15, 15) of a 100 × 100 image: top left
    assert thing.place(100, 100) == "top left" and world.is_held_out(thing, 100, 100)
    assert Thing("red", "circle", (60, 60, 90, 90)).place(100, 100) == "bottom right"


def _check_scene(record, split):
    width, height = record["image_size"]
    assert width in world.SIDES and height in world.SIDES and width * height <= world.MAX_AREA
    things = world.things_of(record)
    assert 1 <= len(things) <= world.MAX_OBJECTS
    for thing in things:
        x1, y1, x2, y2 = thing.box
        side = x2 - x1
        assert y2 - y1 == side and 0 <= x1 and x2 <= width and 0 <= y1 and y2 <= height
        low, high = world.OBJECT_SIDE
        assert round(low * min(width, height)) <= side <= round(high * min(width, height))
    for a, b in itertools.combinations(things, 2):
        assert world._apart(a.box, b.box), (a, b)
    color, shape = record["subject"]["color"], record["subject"]["shape"]
    held = [t for t in things if world.is_held_out(t, width, height)]
    if record["kind"] == "locate":
        targets = [t for t in things if t.kind == (color, shape)]
        assert len(targets) == 1 and record["solution"] == list(targets[0].box)
        asked = targets
        assert record["problem"] == f"Locate the {color} {shape}." and record["task"] == "grounding"
    elif record["kind"] == "find":
        asked = [t for t in things if t.shape == shape]
        assert 1 <= len(asked) <= 3 and record["solution"] == [list(t.box) for t in world.reading_order(asked)]
        assert record["problem"] == f"Find every {shape}." and record["task"] == "detection"
    else:
        asked = [t for t in things if t.color == color]
        assert 1 <= len(asked) <= 3 and record["solution"] == len(asked)
        assert record["problem"] == f"How many {color} shapes are there?" and record["task"] == "counting"
    if split == "train":
        assert not held  # no training image holds any object at its type's held-out place
    else:
        assert any(world.is_held_out(t, width, height) for t in asked)  # the question is about a held-out combination


def test_records_satisfy_their_questions_and_hold_out_their_compositions():
    train = world.make_records(240, "train", seed=0)
    test = world.make_records(90, "test", seed=0)
    for split, records in (("train", train), ("test", test)):
        assert [r["kind"] for r in records[:6]] == ["locate", "find", "count"] * 2
        for record in records:
            _check_scene(record, split)
    # The compositions asked about in evaluation: (colour, shape, place) never present in a training image.
    seen = {(t.color, t.shape, t.place(*r["image_size"])) for r in train for t in world.things_of(r)}
    asked = {(t.color, t.shape, t.place(*r["image_size"])) for r in test for t in world.things_of(r)
             if world.is_held_out(t, *r["image_size"])}
    assert asked and not asked & seen
    # ... but every object type and every place occurs in training.
    assert {(c, s) for c, s, _ in seen} == {(c, s) for c in world.COLORS for s in world.SHAPES}
    assert {p for _, _, p in seen} == set(world.PLACES)
    # Both words of a locate question matter: distractors often share the colour or the shape.
    sharing = sum(any(t.kind != (r["subject"]["color"], r["subject"]["shape"]) and
                      (t.color == r["subject"]["color"] or t.shape == r["subject"]["shape"])
                      for t in world.things_of(r)) for r in train if r["kind"] == "locate")
    assert sharing >= 20
    assert world.make_records(12, "test", seed=0) == test[:12]
    assert world.make_records(12, "test", seed=1) != test[:12]
    assert world.make_records(12, "train", seed=0) != world.make_records(12, "test", seed=0)
    with pytest.raises(ValueError, match="question kinds must be a non-empty list of locate, find, count"):
        world.make_records(3, "train", seed=0, kinds=["where"])
    with pytest.raises(ValueError, match="unknown split 'valid'"):
        world.make_scene("locate", "valid", np.random.default_rng(0))


def test_dataset_files_load_in_the_plugin_loader_and_are_kept(tmp_path):
    from PIL import Image

    from mmrl.plugins.vlm.data import load_jsonl

    paths = world.write_dataset(tmp_path, train=6, test=3, seed=0)
    rows = load_jsonl(paths["test"])
    assert [row["kind"] for row in rows] == ["locate", "find", "count"]
    for row, record in zip(rows, world.make_records(3, "test", seed=0), strict=True):
        assert row["prompt"] == record["problem"] and row["solution"] == record["solution"]
        assert np.array_equal(np.asarray(Image.open(row["image"][0])), world.record_image(record))
    stamp = paths["train"].stat().st_mtime_ns
    assert world.write_dataset(tmp_path, train=6, test=3, seed=0) == paths
    assert paths["train"].stat().st_mtime_ns == stamp  # same options: nothing rewritten
    world.write_dataset(tmp_path, train=4, test=3, seed=0)
    assert len(load_jsonl(paths["train"])) == 4


def test_training_kinds_weight_the_training_split_only(tmp_path):
    """--train-kinds locate locate find count: half the training questions locate, the held-out split unchanged."""
    assert world.main([str(tmp_path), "--train", "8", "--test", "3", "--train-kinds", "locate", "locate", "find",
                       "count"]) == 0
    from mmrl.plugins.vlm.data import load_jsonl

    assert [row["kind"] for row in load_jsonl(tmp_path / "train.jsonl")] == ["locate", "locate", "find", "count"] * 2
    assert [row["kind"] for row in load_jsonl(tmp_path / "test.jsonl")] == ["locate", "find", "count"]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["train_kinds"] == ["locate", "locate", "find", "count"] and manifest["kinds"] == list(world.KINDS)


def test_every_object_asks_each_lone_object_of_a_training_locate_image(tmp_path):
    """--every-object: a training locate scene gives one question per object alone of its kind, on the same image
    (the scene's own question first, then the others); find and count scenes one each, the held-out split and a
    run without the option unchanged, the option in the manifest."""
    from mmrl.plugins.vlm.data import load_jsonl

    plain = world.make_records(40, "train", seed=3)
    records = world.make_records(40, "train", seed=3, every_object=True)
    assert len(records) == 40 and records[0] == plain[0]  # the first scene's own question comes first
    groups: list[list[dict]] = []
    for record in records:
        if groups and record["kind"] == "locate" and groups[-1][0]["kind"] == "locate" and \
                record["objects"] == groups[-1][0]["objects"] and record["image_size"] == groups[-1][0]["image_size"]:
            groups[-1].append(record)
        else:
            groups.append([record])
    assert [g[0]["kind"] for g in groups][:6] == ["locate", "find", "count"] * 2
    asked_more = 0
    for group in groups:
        if group[0]["kind"] != "locate":
            assert len(group) == 1
            continue
        kinds = [(o["color"], o["shape"]) for o in group[0]["objects"]]
        lone = [kind for kind in kinds if kinds.count(kind) == 1]
        asked = [(r["subject"]["color"], r["subject"]["shape"]) for r in group]
        assert len(set(asked)) == len(asked) and set(asked) <= set(lone)
        if group is not groups[-1]:  # the last scene may be cut at the count
            assert sorted(asked) == sorted(lone)
        for record in group:
            box = next(o["box"] for o in record["objects"] if (o["color"], o["shape"]) == asked[group.index(record)])
            assert record["solution"] == box
        asked_more += len(group) > 1
    assert asked_more > 0
    assert world.main([str(tmp_path), "--train", "9", "--test", "3", "--every-object"]) == 0
    assert [row["kind"] for row in load_jsonl(tmp_path / "test.jsonl")] == ["locate", "find", "count"]
    assert json.loads((tmp_path / "manifest.json").read_text())["every_object"] is True
    world.write_dataset(tmp_path / "plain", train=3, test=3)
    assert "every_object" not in json.loads((tmp_path / "plain" / "manifest.json").read_text())


# ------------------------------------------------------------------------------------------------ answers and reward
def _rows(records, resized):
    return [{**record, "resized_size": list(resized(record["image_size"]))} for record in records]


@pytest.mark.parametrize("convention", ["qwen2_5_vl", "qwen2_vl"])
def test_exact_answers_score_near_one_in_their_convention_and_low_in_the_other(convention):
    from mmrl.rewards.boxes import smart_resize

    def resized(size):
        height, width = smart_resize(size[1], size[0], min_pixels=16 * 28 * 28, max_pixels=64 * 28 * 28)
        return width, height

    rows = _rows(world.make_records(60, "test", seed=2), resized)
    texts = [world.answer_text(row, convention, row["resized_size"]) for row in rows]
    scores = grounding_world(RewardInput(rows=rows, payload={"completions": texts}), convention=convention)
    boxes = [s for s, row in zip(scores, rows, strict=True) if row["kind"] != "count"]
    # Integer coordinates round by at most half a unit per side: objects are >= 20 pixels, IoU >= (19/21)^2 > 0.8.
    assert min(boxes) > 0.8 and np.mean(boxes) > 0.95
    assert all(s == 1.0 for s, row in zip(scores, rows, strict=True) if row["kind"] == "count")
    other = "qwen2_vl" if convention == "qwen2_5_vl" else "qwen2_5_vl"
    mixed = grounding_world(RewardInput(rows=rows, payload={"completions": texts}), convention=other)
    mixed_boxes = [s for s, row in zip(mixed, rows, strict=True) if row["kind"] != "count"]
    assert np.mean(mixed_boxes) < 0.5  # a convention mix-up costs most of the reward


def test_answer_text_spells_the_thinking_and_the_boxes():
    locate = {"kind": "locate", "subject": {"color": "red", "shape": "circle"}, "image_size": [200, 100],
              "solution": [100, 50, 150, 100],
              "objects": [{"color": "red", "shape": "circle", "box": [100, 50, 150, 100]},
                          {"color": "red", "shape": "square", "box": [0, 0, 30, 30]}]}
    # The thinking names the object; resized to 400 × 50: x doubles, y halves.
    assert world.answer_text(locate, "qwen2_5_vl", (400, 50)) == \
        '<think>the red circle</think><answer>{"bbox_2d": [200, 25, 300, 50]}</answer>'
    assert world.answer_text(locate, "qwen2_vl", None) == \
        "<think>the red circle</think><answer><|box_start|>(500,500),(750,1000)<|box_end|></answer>"
    find = {**locate, "kind": "find", "solution": [[100, 50, 150, 100]]}
    assert world.answer_text(find, "qwen2_5_vl", (200, 100)) == \
        '<think>1 circle</think><answer>[{"bbox_2d": [100, 50, 150, 100]}]</answer>'
    count = {**locate, "kind": "count", "solution": 2}
    assert world.answer_text(count, "qwen2_5_vl", (200, 100)) == \
        "<think>square, circle</think><answer>2</answer>"  # reading order: the square is higher


def test_world_reward_scores_each_kind_with_its_reward():
    size = {"image_size": [100, 100], "resized_size": [100, 100]}
    rows = [
        {"kind": "locate", "solution": [0, 0, 20, 20], **size},
        {"kind": "locate", "solution": [0, 0, 20, 20], **size},
        {"kind": "find", "solution": [[0, 0, 20, 20], [50, 50, 70, 70]], **size},
        {"kind": "count", "solution": 3, **size},
        {"kind": "count", "solution": 3, **size},
        {"kind": "locate", "solution": [0, 0, 20, 20], **size},
    ]
    texts = [
        '<answer>{"bbox_2d": [0, 0, 20, 20]}</answer>',
        '<answer>{"bbox_2d": [10, 0, 30, 20]}</answer>',  # overlap 10 × 20 = 200, union 600
        '<answer>[{"bbox_2d": [50, 50, 70, 70]}]</answer>',  # one of two found exactly: 1 / max(1, 2)
        "<answer>3</answer>",
        "<answer>4</answer>",
        "no answer at all",  # malformed output scores 0
    ]
    scores = grounding_world(RewardInput(rows=rows, payload={"completions": texts}), convention="absolute")
    assert scores == pytest.approx([1.0, 1 / 3, 0.5, 1.0, 0.0, 0.0])
    with pytest.raises(RewardError, match=r"rows with kind \['where'\]; allowed: locate, find, count"):
        grounding_world(RewardInput(rows=[{**rows[0], "kind": "where"}], payload={"completions": ["x"]}),
                        convention="absolute")


def test_world_reward_scores_locate_by_giou_when_asked():
    size = {"image_size": [100, 100], "resized_size": [100, 100]}
    rows = [{"kind": "locate", "solution": [0, 0, 20, 20], **size}] * 4 + [{"kind": "count", "solution": 2, **size}]
    texts = [
        '<answer>{"bbox_2d": [10, 0, 30, 20]}</answer>',  # IoU 1/3, hull 30 × 20 = union: GIoU 1/3
        '<answer>{"bbox_2d": [40, 0, 60, 20]}</answer>',  # disjoint: hull 60 × 20, union 800, GIoU -1/3
        '<answer>{"bbox_2d": [80, 80, 100, 100]}</answer>',  # farther: hull 100², GIoU -(10000 - 800) / 10000
        "<answer>no box here</answer>",  # malformed: 0, below any box
        "<answer>2</answer>",
    ]
    batch = RewardInput(rows=rows, payload={"completions": texts})
    scores = grounding_world(batch, convention="absolute", locate_metric="giou")  # (GIoU + 1) / 2
    assert scores == pytest.approx([2 / 3, 1 / 3, (1 - 0.92) / 2, 0.0, 1.0])
    assert grounding_world(batch, convention="absolute") == pytest.approx([1 / 3, 0.0, 0.0, 0.0, 1.0])


def test_locate_by_objects_splits_locate_scores_and_is_empty_without_locate_questions():
    from mmrl.plugins.vlm.grounding.report import locate_by_objects

    size = {"image_size": [100, 100], "resized_size": [100, 100]}
    one = {"kind": "locate", "solution": [0, 0, 20, 20], "objects": [{"box": [0, 0, 20, 20]}], **size}
    two = {**one, "objects": [{"box": [0, 0, 20, 20]}, {"box": [50, 50, 70, 70]}]}
    count = {"kind": "count", "solution": 2, "objects": two["objects"], **size}
    texts = ['<answer>{"bbox_2d": [0, 0, 20, 20]}</answer>', '<answer>{"bbox_2d": [10, 0, 30, 20]}</answer>',
             '<answer>{"bbox_2d": [50, 50, 70, 70]}</answer>', "<answer>2</answer>"]
    split = locate_by_objects([one, two, two, count], texts, "absolute")  # the count row is left out
    assert list(split) == ["1", "2"] and split["1"][0] == 1 and split["2"][0] == 2
    # The second two-object answer boxes the distractor: IoU 0 with the asked object.
    assert split["1"][1] == pytest.approx(1.0) and split["2"][1] == pytest.approx((1 / 3 + 0.0) / 2)
    assert locate_by_objects([count], ["<answer>2</answer>"], "absolute") == {}


def test_world_reward_is_registered_and_takes_the_family_convention():
    from mmrl.reward import build_reward

    reward = build_reward("grounding_world", {}, context={"box_convention": "qwen2_vl"})
    row = {"kind": "locate", "solution": [0, 0, 50, 50], "image_size": [100, 100], "resized_size": [56, 56]}
    text = "<answer><|box_start|>(0,0),(500,500)<|box_end|></answer>"
    assert reward(RewardInput(rows=[row], payload={"completions": [text]}))[0] == pytest.approx(1.0)
    with pytest.raises(RewardError, match="differs from 'qwen2_vl'"):
        build_reward("grounding_world", {"convention": "qwen2_5_vl"}, context={"box_convention": "qwen2_vl"})


# ------------------------------------------------------------------------------------------------ model
def test_tokenizer_splits_digits_and_keeps_the_tags_whole():
    from mmrl.plugins.vlm.grounding import model

    tokenizer = model.build_tokenizer()
    for tag in (*model.REASONING_TOKENS, "<|im_start|>", "<|image_pad|>", "<|box_start|>"):
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1, tag
    pieces = tokenizer.convert_ids_to_tokens(tokenizer("[120, 34]", add_special_tokens=False)["input_ids"])
    assert [p for p in pieces if any(ch.isdigit() for ch in p)] == ["1", "2", "0", "3", "4"]
    record = world.make_records(3, "train", seed=5)[1]
    for convention in ("qwen2_5_vl", "qwen2_vl"):
        text = world.answer_text(record, convention, (224, 168))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert model.build_tokenizer().get_vocab() == tokenizer.get_vocab()  # deterministic


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_model_builds_from_config_classes_and_answers_through_the_adapter(family, tmp_path):
    import torch

    from mmrl.plugins.vlm.adapters import vlm_adapters
    from mmrl.plugins.vlm.grounding import model

    built, processor = model.build_model(family, seed=0)
    parameters = sum(p.numel() for p in built.parameters())
    assert 1_000_000 < parameters < 2_500_000  # < 10 MB in float32
    config = built.config
    assert config.model_type == family and config.vision_config.depth == 4
    if family == "qwen2_5_vl":
        assert config.vision_config.fullatt_block_indexes == [3]
    folder = model.save(built, processor, tmp_path / family)
    adapter = vlm_adapters.get(family)(str(folder), min_pixels=model.MIN_PIXELS, max_pixels=model.MAX_PIXELS)
    assert adapter.box_convention == family
    loaded = adapter.load_model(dtype=torch.float32, attn_implementation="sdpa")
    from PIL import Image

    record = world.make_records(1, "test", seed=0)[0]
    text = adapter.chat_text(adapter.messages(model.PROMPT_TEMPLATE.format(question=record["problem"]), 1))
    prompts = adapter.encode([text], [adapter.load_images([Image.fromarray(world.record_image(record))])])
    width, height = adapter.resized_size(record["image_size"])
    tokens = (width // 28) * (height // 28)
    assert model.MIN_PIXELS // 784 <= tokens <= model.MAX_PIXELS // 784
    image_id = built.config.image_token_id
    assert int((prompts[0]["input_ids"] == image_id).sum()) == tokens
    completion = torch.tensor(processor.tokenizer("<answer>1</answer>", add_special_tokens=False)["input_ids"])
    inputs, start = adapter.collate(prompts, [completion], device="cpu")
    logits = adapter.completion_logits(loaded, inputs, completion.numel())  # [1, C, V]
    assert logits.shape == (1, completion.numel(), len(processor.tokenizer)) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="builds qwen2_5_vl or qwen2_vl models, not 'qwen3_vl'"):
        model.model_config("qwen3_vl", processor.tokenizer)
    with pytest.raises(ValueError, match=r"M-RoPE sections \[8, 8, 8\] must sum to head_dim / 2 = 16"):
        model.model_config(family, processor.tokenizer, {"mrope": [8, 8, 8]})
