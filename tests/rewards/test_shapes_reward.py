"""The ``shapes`` reward on hand-made images with known scores, its detector on every kind of rendering, malformed
images and rows, and its registration."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.config import load_config
from mmrl.plugins.flow.shapes import world
from mmrl.plugins.flow.shapes.world import Placed, make_row, render
from mmrl.reward import RewardError, RewardInput, build_reward
from mmrl.rewards.shapes import ShapesReward, connected_components, detect, requirement_scores, score_row

RED_CIRCLE = make_row("single_object", [("red", "circle", 1)])
TWO_RED_CIRCLES = make_row("counting", [("red", "circle", 2)])
CIRCLE_AND_SQUARE = make_row("two_object", [("red", "circle", 1), ("blue", "square", 1)])
CIRCLE_ABOVE_SQUARE = make_row("position", [("red", "circle", 1), ("blue", "square", 1)], "above")


def obj(shape: str, color: str, cx: float, cy: float, size: float = 10.0) -> Placed:
    return Placed(shape, color, cx, cy, size)


def scores(rows, images, **options) -> list[float]:
    """The reward through its public interface on uint8 ``[H, W, 3]`` arrays."""
    batch = torch.stack([torch.from_numpy(np.array(image)).permute(2, 0, 1) for image in images])
    return ShapesReward(**options)(RewardInput(rows=list(rows), payload={"images": batch})).tolist()


# ------------------------------------------------------------------------------------------------ hand-made images
@pytest.mark.parametrize(("row", "objects", "expected"), [
    # a red circle: 2 requirements (count of circles, colour of the circle)
    (RED_CIRCLE, [obj("circle", "red", 16, 16)], 1.0),
    (RED_CIRCLE, [obj("circle", "blue", 16, 16)], 0.5),  # right count, wrong colour
    (RED_CIRCLE, [obj("square", "red", 16, 16)], 0.0),  # no circle at all
    (RED_CIRCLE, [obj("circle", "red", 8, 8), obj("circle", "red", 24, 24)], 0.5),  # |1 - 2| / 1 → count 0
    (RED_CIRCLE, [obj("circle", "red", 8, 8), obj("triangle", "green", 24, 24)], 1.0),  # other shapes are free
    (RED_CIRCLE, [], 0.0),  # blank
    # two red circles: count 1 - |2 - m| / 2, colour min(k, 2) / 2
    (TWO_RED_CIRCLES, [obj("circle", "red", 8, 8), obj("circle", "red", 24, 24)], 1.0),
    (TWO_RED_CIRCLES, [obj("circle", "red", 8, 8)], 0.5),  # (0.5 + 0.5) / 2
    (TWO_RED_CIRCLES, [obj("circle", "red", 7, 7), obj("circle", "red", 24, 7), obj("circle", "red", 16, 24)],
     0.75),  # (0.5 + 1) / 2
    (TWO_RED_CIRCLES, [obj("circle", "red", 8, 8), obj("circle", "green", 24, 24)], 0.75),  # (1 + 0.5) / 2
    # a red circle and a blue square: 4 requirements
    (CIRCLE_AND_SQUARE, [obj("circle", "red", 8, 16), obj("square", "blue", 24, 16)], 1.0),
    (CIRCLE_AND_SQUARE, [obj("circle", "blue", 8, 16), obj("square", "red", 24, 16)], 0.5),  # colours swapped
    (CIRCLE_AND_SQUARE, [obj("circle", "red", 8, 16)], 0.5),  # the square is missing
    # a red circle above a blue square: 5 requirements
    (CIRCLE_ABOVE_SQUARE, [obj("circle", "red", 16, 8), obj("square", "blue", 16, 24)], 1.0),
    (CIRCLE_ABOVE_SQUARE, [obj("circle", "red", 16, 24), obj("square", "blue", 16, 8)], 0.8),  # below
    (CIRCLE_ABOVE_SQUARE, [obj("circle", "red", 8, 16), obj("square", "blue", 24, 16)], 0.8),  # side by side
    (CIRCLE_ABOVE_SQUARE, [obj("circle", "red", 7, 7), obj("square", "blue", 25, 24)], 1.0),  # diagonal: above
    (CIRCLE_ABOVE_SQUARE, [obj("circle", "blue", 16, 8), obj("square", "red", 16, 24)], 0.4),  # colours swapped
])
def test_hand_made_images_score_as_the_formula_says(row, objects, expected):
    assert scores([row], [render(objects)]) == [pytest.approx(expected)]


def test_position_margin_is_half_the_mean_height():
    # Two 10 px objects: "above" needs the centres at least (10 + ~8.5) / 4 ≈ 4.6 px apart vertically.
    row = CIRCLE_ABOVE_SQUARE
    near = render([obj("circle", "red", 6, 14), obj("square", "blue", 24, 16)])  # 2 px apart
    far = render([obj("circle", "red", 6, 10), obj("square", "blue", 24, 18)])  # 8 px apart
    assert dict(requirement_scores(row, detect(near)))["position"] == 0.0
    assert dict(requirement_scores(row, detect(far)))["position"] == 1.0


def test_strict_mode_is_geneval_accuracy():
    right = render([obj("circle", "red", 16, 8), obj("square", "blue", 16, 24)])
    wrong_place = render([obj("circle", "red", 16, 24), obj("square", "blue", 16, 8)])
    assert scores([CIRCLE_ABOVE_SQUARE] * 2, [right, wrong_place], strict=True) == [1.0, 0.0]


def test_detector_finds_shape_colour_and_centroid():
    image = render([obj("triangle", "yellow", 10.3, 20.7, 11), obj("square", "green", 24, 8, 9.5)])
    found = sorted(detect(image), key=lambda item: item.shape)
    assert [(item.shape, item.color) for item in found] == [("square", "green"), ("triangle", "yellow")]
    assert found[0].cx == pytest.approx(24, abs=0.6) and found[0].cy == pytest.approx(8, abs=0.6)
    # A triangle's centroid lies a third of the way up from its base.
    assert found[1].cx == pytest.approx(10.3, abs=0.6) and found[1].cy == pytest.approx(20.7 + 11 / 6, abs=0.8)


def test_every_rendering_of_every_prompt_scores_one():
    rng = np.random.default_rng(0)
    rows = world.training_rows() + world.split()["test"]
    for _ in range(2):
        images = world.sample_images(rows, rng)
        for row, image in zip(rows, images, strict=True):
            assert score_row(row, detect(image)) == 1.0, row["prompt"]


def test_soft_edges_and_other_sizes_are_still_read():
    # Anti-aliased: rendered at 4x and box-filtered down, so edge pixels are blends with the background.
    big = render([Placed("circle", "red", 64, 32, 40), Placed("square", "blue", 64, 96, 36)], resolution=128)
    soft = np.asarray(Image.fromarray(big).resize((32, 32), Image.BOX))
    assert scores([CIRCLE_ABOVE_SQUARE], [soft]) == [1.0]
    # A 48 x 48 image: thresholds scale with the image.
    large = render([Placed("circle", "red", 24, 12, 15), Placed("square", "blue", 24, 36, 15)], resolution=48)
    assert scores([CIRCLE_ABOVE_SQUARE], [large]) == [1.0]


def test_touching_objects_of_one_colour_merge_and_blends_are_ignored():
    merged = render([obj("circle", "red", 11, 16), obj("circle", "red", 20, 16)])  # overlapping discs
    assert scores([TWO_RED_CIRCLES], [merged]) == [0.0]  # one wide blob: no circle at all
    purple = render([obj("circle", "red", 16, 16)])
    purple[purple[:, :, 0] == 220] = (130, 60, 130)  # half red, half blue: no palette colour
    assert scores([RED_CIRCLE], [purple]) == [0.0]


def test_connected_components_are_four_connected():
    labels = np.array([[0, 0, -1, 1],
                       [-1, 0, -1, 1],
                       [0, -1, 0, 0],
                       [0, -1, -1, 0]])
    ids = connected_components(labels)
    assert ids[0, 0] == ids[0, 1] == ids[1, 1]
    assert ids[2, 0] == ids[3, 0] != ids[1, 1]  # diagonal neighbours are separate
    assert ids[2, 2] == ids[2, 3] == ids[3, 3] != ids[1, 1]
    assert ids[0, 3] == ids[1, 3] and ids[0, 3] != ids[2, 3]  # label 1 vs label 0
    assert (ids[labels < 0] == 0).all()
    assert len(np.unique(ids[labels >= 0])) == 4


def _flood_fill_components(image: np.ndarray, min_area_fraction: float, max_color_distance: float = 80.0
                           ) -> list[tuple]:
    """An independent reference for the detector's steps 1-2: nearest palette colour by a per-pixel loop, regions
    by breadth-first flood fill, filtered by area, side and aspect; each as (colour, cx, cy, area, box)."""
    from collections import deque

    from mmrl.rewards.shapes import COLOR_NAMES, MAX_ASPECT, MAX_SIDE_FRACTION

    height, width = image.shape[:2]
    palette = [world.BACKGROUND] + [world.PALETTE[name] for name in COLOR_NAMES]
    labels = np.full((height, width), -1)
    for y in range(height):
        for x in range(width):
            distances = [math.dist(image[y, x].tolist(), color) for color in palette]
            k = distances.index(min(distances))
            if k > 0 and distances[k] <= max_color_distance:
                labels[y, x] = k - 1
    seen = np.zeros((height, width), dtype=bool)
    regions = []
    for y in range(height):
        for x in range(width):
            if labels[y, x] < 0 or seen[y, x]:
                continue
            pixels, queue = [], deque([(y, x)])
            seen[y, x] = True
            while queue:
                py, px = queue.popleft()
                pixels.append((py, px))
                for ny, nx in ((py + 1, px), (py - 1, px), (py, px + 1), (py, px - 1)):
                    if 0 <= ny < height and 0 <= nx < width and not seen[ny, nx] and labels[ny, nx] == labels[y, x]:
                        seen[ny, nx] = True
                        queue.append((ny, nx))
            ys, xs = zip(*pixels, strict=True)
            box_h, box_w = max(ys) - min(ys) + 1, max(xs) - min(xs) + 1
            if (len(pixels) >= max(1.0, min_area_fraction * height * width) and box_h <= MAX_SIDE_FRACTION * height
                    and box_w <= MAX_SIDE_FRACTION * width and max(box_h, box_w) <= MAX_ASPECT * min(box_h, box_w)):
                regions.append((COLOR_NAMES[labels[y, x]], sum(xs) / len(xs) + 0.5, sum(ys) / len(ys) + 0.5,
                                len(pixels), (min(ys), min(xs), box_h, box_w)))
    return sorted(regions)


@pytest.mark.parametrize("min_area_fraction", [0.0, 16 / 1024])
def test_batched_detector_equals_a_per_pixel_flood_fill(min_area_fraction):
    """`batch_components` over a batch (renderings, noisy renderings, noise, a one-pixel serpentine whose ids need
    many propagation rounds) finds, for every image, the regions a plain flood fill finds: colour, centroid, area,
    box size."""
    from mmrl.rewards.shapes import batch_components

    rng = np.random.default_rng(3)
    rows = world.split()["train"][:6]
    clean = world.sample_images(rows, rng)
    noisy = np.clip(clean.astype(np.int16) + rng.integers(-45, 45, clean.shape), 0, 255).astype(np.uint8)
    noise = rng.integers(0, 256, (2, 32, 32, 3)).astype(np.uint8)
    serpentine = np.full((32, 32, 3), world.BACKGROUND, dtype=np.uint8)
    for row in range(2, 19, 2):  # rows 2, 4, ..., 18 from x = 2 to 17, joined at alternate ends
        serpentine[row, 2:18] = world.PALETTE["red"]
        if row < 18:
            serpentine[row + 1, 17 if row % 4 == 2 else 2] = world.PALETTE["red"]
    images = np.concatenate([clean, noisy, noise, serpentine[None]])
    found = batch_components(images, min_area_fraction=min_area_fraction)
    for image, items in zip(images, found, strict=True):
        ours = sorted((item.color, item.cx, item.cy, item.area, item.mask.shape) for item in items)
        reference = [(color, cx, cy, area, box[2:]) for color, cx, cy, area, box in
                     _flood_fill_components(image, min_area_fraction)]
        assert len(ours) == len(reference)
        for a, b in zip(ours, reference, strict=True):
            assert (a[0], a[3], a[4]) == (b[0], b[3], b[4])
            assert a[1] == pytest.approx(b[1]) and a[2] == pytest.approx(b[2])
    assert all(found[:6])  # every rendering has its objects
    assert [(item.color, item.area) for item in found[-1]] == [("red", 9 * 16 + 8)]  # the serpentine, whole


# ------------------------------------------------------------------------------------------------ malformed inputs
def test_malformed_images_are_scored_not_raised():
    rng = np.random.default_rng(1)
    noise = rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
    grey = np.full((32, 32, 3), 128, dtype=np.uint8)
    black = np.zeros((32, 32, 3), dtype=np.uint8)
    tiny = render([obj("circle", "red", 16, 16)])[:3, :5]
    flood = np.empty((32, 32, 3), dtype=np.uint8)
    flood[:] = world.PALETTE["red"]  # one red field covering the image: too big to be an object
    got = scores([RED_CIRCLE] * 4 + [RED_CIRCLE], [noise, grey, black, flood, render([])])
    assert all(0.0 <= value <= 1.0 for value in got)
    assert got[1:] == [0.0] * 4
    # Other sizes and payload forms: a list of PIL images of different sizes, a [N, C, H, W] float tensor.
    pil = [Image.fromarray(tiny), Image.fromarray(render([obj("circle", "red", 16, 16)]))]
    reward = ShapesReward()
    assert reward(RewardInput(rows=[RED_CIRCLE] * 2, payload={"images": pil})).tolist() == [0.0, 1.0]


def test_non_finite_pixels_score_nan_as_every_image_reward():
    images = torch.from_numpy(render([obj("circle", "red", 16, 16)])).permute(2, 0, 1).float().div(255)
    images = torch.stack([images, images.clone()])
    images[1, 0, 3, 3] = math.nan
    got = ShapesReward()(RewardInput(rows=[RED_CIRCLE] * 2, payload={"images": images}))
    assert got[0] == 1.0 and math.isnan(float(got[1]))


def test_rows_without_requirements_fail_with_one_line_naming_the_row():
    images = torch.zeros(1, 3, 32, 32)
    with pytest.raises(RewardError, match=r"row 0 \('a red circle'\) has no 'objects'"):
        ShapesReward()(RewardInput(rows=[{"prompt": "a red circle"}], payload={"images": images}))
    bad = {**RED_CIRCLE, "objects": [{"shape": "hexagon", "color": "red", "count": 1}]}
    with pytest.raises(RewardError, match="hexagon"):
        ShapesReward()(RewardInput(rows=[bad], payload={"images": images}))
    with pytest.raises(RewardError, match="relation"):
        ShapesReward()(RewardInput(rows=[{**RED_CIRCLE, "relation": "near"}], payload={"images": images}))


# ------------------------------------------------------------------------------------------------ registration
def test_registered_and_configurable():
    image = render([obj("circle", "blue", 16, 16)])
    batch = RewardInput(rows=[RED_CIRCLE], payload={"images": torch.from_numpy(image).permute(2, 0, 1)[None]})
    assert build_reward("shapes", {})(batch).tolist() == [0.5]
    assert build_reward("shapes", {"strict": True})(batch).tolist() == [0.0]
    config = load_config({"plugin": {"name": "toy"}, "rewards": {"functions": [
        {"name": "shapes", "args": {"strict": True, "max_color_distance": 60}}]}})
    assert config.rewards.functions[0].args["max_color_distance"] == 60
    with pytest.raises(RewardError, match="max_color_distance"):
        ShapesReward(max_color_distance=0)


# ------------------------------------------------------------------------------------------------ shape_fidelity
def fidelity(rows, images) -> list[float]:
    from mmrl.rewards.shapes import ShapeFidelityReward

    batch = torch.stack([torch.from_numpy(np.array(image)).permute(2, 0, 1) for image in images])
    return ShapeFidelityReward()(RewardInput(rows=list(rows), payload={"images": batch})).tolist()


def box_fill(image: np.ndarray) -> float:
    """Coloured pixels over the pixels of their bounding box: a region's IoU with the square template of its box,
    counted directly."""
    coloured = (image != 255).any(-1)
    ys, xs = np.nonzero(coloured)
    return coloured.sum() / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))


def test_shape_fidelity_by_hand():
    red_square = make_row("single_object", [("red", "square", 1)])
    square = render([obj("square", "red", 16, 16)])
    disc = render([obj("circle", "red", 16, 16)])
    wrong_colour = render([obj("square", "blue", 16, 16)])
    assert fidelity([red_square] * 3, [square, disc, wrong_colour]) == pytest.approx([1.0, box_fill(disc), 0.0])
    assert box_fill(disc) == pytest.approx(math.pi / 4, abs=0.05)  # a disc fills about π/4 of its box
    assert scores([red_square], [disc]) == [0.0]  # where `shapes` gives nothing, fidelity still ranks the blob
    # a red circle and a blue square with the square missing: (IoU of the circle + 0) / 2; the circle is exact
    one = render([obj("circle", "red", 8, 16)])
    assert fidelity([CIRCLE_AND_SQUARE], [one]) == pytest.approx([0.5], abs=0.03)
    # two red circles with one drawn: the best IoU over the count
    assert fidelity([TWO_RED_CIRCLES], [one]) == pytest.approx([0.5], abs=0.03)
    assert fidelity([TWO_RED_CIRCLES], [render([obj("circle", "red", 8, 8), obj("circle", "red", 24, 24)])]) \
        == pytest.approx([1.0], abs=0.05)


def test_shape_fidelity_is_one_for_every_rendering_of_squares_and_high_for_the_rest():
    rng = np.random.default_rng(3)
    rows = world.split()["train"]
    values = fidelity(rows, world.sample_images(rows, rng))
    assert min(values) > 0.85
    square_rows = [row for row in rows if all(spec["shape"] == "square" for spec in row["objects"])]
    assert fidelity(square_rows, world.sample_images(square_rows, rng)) == pytest.approx([1.0] * len(square_rows))


def test_shape_fidelity_malformed_input():
    from mmrl.rewards.shapes import ShapeFidelityReward

    images = torch.full((2, 3, 32, 32), float("nan"))
    images[1] = 0.5
    out = ShapeFidelityReward()(RewardInput(rows=[RED_CIRCLE, RED_CIRCLE], payload={"images": images}))
    assert math.isnan(out[0]) and out[1] == 0.0
    with pytest.raises(RewardError, match="reward 'shape_fidelity': dataset row 0"):
        ShapeFidelityReward()(RewardInput(rows=[{"prompt": "x"}], payload={"images": images[:1]}))
    with pytest.raises(RewardError, match="max_color_distance"):
        ShapeFidelityReward(max_color_distance=0)
    assert isinstance(build_reward("shape_fidelity", {}), ShapeFidelityReward)
