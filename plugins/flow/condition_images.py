"""Condition images of image-conditioned flow adapters (image editing: FLUX.1 Kontext): each prompt row names the
image to edit (``row["image"]``, a path that :func:`~mmrl.plugins.flow.config.load_rows` resolved and checked), and
the sampler merges its encoding with the prompt's conditioning.

An image is read and encoded once (:meth:`FlowAdapter.encode_condition_images`: resize to the run's size, VAE,
packing) and kept in an LRU cache of ``plugin.embedding_cache_size`` entries, like the prompt embeddings: a group's
G samples and later epochs over the same rows reuse it. The encoding is deterministic (the VAE's mode, as the
diffusers pipelines encode a condition image), so the cache changes nothing but the time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmrl.rollout import RolloutError


class ConditionImageCache:
    """Per-row condition-image conditioning, encoded once per image.

    Args:
        adapter: The image-conditioned :class:`~mmrl.plugins.flow.adapters.base.FlowAdapter`.
        capacity: Most images kept (``plugin.embedding_cache_size``).
    """

    def __init__(self, adapter: Any, capacity: int):
        self.adapter = adapter
        self.capacity = capacity
        # (path, height, width) → (conditioning rows [1, ...] each, pixels [1, 3, H, W] in [0, 1])
        self._cache: OrderedDict[tuple[str, int, int], tuple[dict[str, Tensor], Tensor]] = OrderedDict()

    def __call__(self, rows: Sequence[dict[str, Any]]) -> tuple[dict[str, Tensor], Tensor]:
        """(conditioning of ``rows``' images, each tensor ``[n, ...]``; the images as the model saw them,
        ``[n, 3, H, W]`` in [0, 1])."""
        keys = [(_image_path(row, index), *self.adapter.size) for index, row in enumerate(rows)]
        missing = [key for key in dict.fromkeys(keys) if key not in self._cache]
        if missing:
            from PIL import Image

            images = []
            for path, _, _ in missing:
                with Image.open(path) as image:
                    images.append(image.convert("RGB"))
            with torch.no_grad():
                encoded, pixels = self.adapter.encode_condition_images(images)
            for i, key in enumerate(missing):
                self._cache[key] = ({name: value[i:i + 1].clone() for name, value in encoded.items()},
                                    pixels[i:i + 1].clone())
        picked = []
        for key in keys:
            self._cache.move_to_end(key)
            picked.append(self._cache[key])
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        conditioning = {name: torch.cat([entry[0][name] for entry in picked]) for name in picked[0][0]}
        return conditioning, torch.cat([entry[1] for entry in picked])


def _image_path(row: dict[str, Any], index: int) -> str:
    image = row.get("image")
    if not isinstance(image, str | Path) or not str(image):
        raise RolloutError(f"prompt row {index} ({str(row.get('prompt', ''))[:40]!r}) has no 'image' to edit; an "
                           "image-conditioned adapter needs one in every row")
    return str(image)
