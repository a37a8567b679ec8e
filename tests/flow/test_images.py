"""Evaluation image grids (:mod:`mmrl.plugins.flow.images`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.plugins.flow.images import CAPTION_LINES, LINE_HEIGHT, MIN_CELL, PAD, caption_grid, save_caption_grid


def _images(n, side=16):
    return torch.linspace(0, 1, n).view(n, 1, 1, 1).expand(n, 3, side, side)


def test_grid_lays_out_enlarged_images_with_a_caption_strip_each():
    grid = caption_grid(_images(5), [f"prompt {k}" for k in range(5)])  # ≈ √5 → 3 columns, 2 rows
    cell = MIN_CELL  # 16 px images are enlarged 12× to 192 px
    strip = CAPTION_LINES * LINE_HEIGHT + 2 * PAD
    assert grid.size == (3 * (cell + PAD) + PAD, 2 * (cell + strip + PAD) + PAD)
    pixels = np.asarray(grid)
    # Image k sits at its cell with its own colour (the 5th image is white, like the background).
    for k in range(4):
        row, column = divmod(k, 3)
        x, y = PAD + column * (cell + PAD), PAD + row * (cell + strip + PAD)
        expected = round(255 * k / 4)
        assert (pixels[y:y + cell, x:x + cell] == expected).all()


def test_captions_are_drawn_under_their_image():
    images = _images(2)
    blank = np.asarray(caption_grid(images, ["", ""])).astype(int)
    captioned = np.asarray(caption_grid(images, ["a cat", ""])).astype(int)
    differs = np.argwhere((blank != captioned).any(axis=2))
    assert len(differs) > 20  # text pixels
    top, left = differs.min(axis=0)
    bottom, right = differs.max(axis=0)
    assert top >= PAD + MIN_CELL  # below the first image
    assert right < PAD + MIN_CELL + PAD  # within the first column


def test_long_captions_are_wrapped_and_cut_to_three_lines(tmp_path):
    path = save_caption_grid(_images(1), ["word " * 200], tmp_path / "grid.png")
    with Image.open(path) as grid:
        assert grid.size == (MIN_CELL + 2 * PAD, MIN_CELL + CAPTION_LINES * LINE_HEIGHT + 3 * PAD + PAD)


def test_one_caption_per_image():
    with pytest.raises(ValueError, match="2 images but 1 captions"):
        caption_grid(_images(2), ["only one"])
