"""Condition images of image-conditioned flow adapters (image editing: FLUX.1 Kontext, Qwen-Image-Edit): each prompt
row names the image to edit (``row["image"]``, a path that :func:`~mmrl.plugins.flow.config.load_rows` resolved and
checked), and the sampler merges its encoding with the prompt's conditioning.

An image is read and encoded once (:meth:`FlowAdapter.encode_condition_images`: resize to the run's size, VAE,
packing) and kept in an LRU cache of ``plugin.embedding_cache_size`` entries, like the prompt embeddings: a group's
G samples and later epochs over the same rows reuse it. The encoding is deterministic (the VAE's mode, as the
diffusers pipelines encode a condition image), so the cache changes nothing but the time. The encodings stay on the
device; the images as the model saw them (for the rewards) are kept as 8-bit RGB on the CPU, which is what the
pipelines' processors make of 8-bit image files.

Where the prompt's encoding itself sees the image (:attr:`FlowAdapter.prompt_sees_image`: Qwen-Image-Edit's text
encoder reads the image with the instruction), the cache also holds each (prompt, image) pair's encoding and, with
CFG, each image's encoding with the negative prompt, whose keys it prefixes with ``negative_``: the unconditional
half of a CFG call then uses the row's own negative (:meth:`FlowAdapter.velocity`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmrl.rollout import RolloutError

Entry = dict[str, Tensor]


class ConditionImageCache:
    """Per-row conditioning from each row's condition image, encoded once per image (and per prompt and image).

    Args:
        adapter: The image-conditioned :class:`~mmrl.plugins.flow.adapters.base.FlowAdapter`.
        capacity: Most entries kept in each of the caches (``plugin.embedding_cache_size``).
        max_sequence_length: Text length of prompt encodings that see the image.
        negative_prompt: The negative prompt of CFG (None without CFG), encoded with each image when the prompt
            encoding sees it.
    """

    def __init__(self, adapter: Any, capacity: int, max_sequence_length: int, negative_prompt: str | None):
        self.adapter = adapter
        self.capacity = capacity
        self.max_sequence_length = max_sequence_length
        self.negative_prompt = negative_prompt
        self._images: OrderedDict[Hashable, Entry] = OrderedDict()  # (path, H, W) → latents [1, ...], pixels
        self._prompts: OrderedDict[Hashable, Entry] = OrderedDict()  # (prompt, path, H, W) → prompt encoding
        self._negatives: OrderedDict[Hashable, Entry] = OrderedDict()  # (path, H, W) → negative_* encoding

    def __call__(self, rows: Sequence[dict[str, Any]]) -> tuple[dict[str, Tensor], Tensor]:
        """(conditioning of ``rows``' images, each tensor ``[n, ...]``; the images as the model saw them,
        ``[n, 3, H, W]`` in [0, 1])."""
        size = self.adapter.size
        paths = [_image_path(row, index) for index, row in enumerate(rows)]
        loaded: dict[str, Any] = {}

        def image(path: str) -> Any:
            if path not in loaded:
                loaded[path] = _read_image(path)
            return loaded[path]

        def encode_images(keys: list[Hashable]) -> list[Entry]:
            encoded, pixels = self.adapter.encode_condition_images([image(key[0]) for key in keys])
            # the images as 8-bit RGB on the CPU: what the processors made of 8-bit files, without the device memory
            # of a float copy per cached image (3 MB at 512 px); back to float [0, 1] on the device per batch
            pixels = (pixels.float() * 255).round().clamp(0, 255).to(torch.uint8).cpu()
            return [{**_row(encoded, i), "pixels": pixels[i:i + 1].clone()} for i in range(len(keys))]

        entries = [self._lookup(self._images, [(path, *size) for path in paths], encode_images)]
        if self.adapter.prompt_sees_image:
            def encode_prompts(keys: list[Hashable]) -> list[Entry]:
                encoded = self.adapter.encode_prompts_with_images([key[0] for key in keys],
                                                                   [image(key[1]) for key in keys],
                                                                   self.max_sequence_length)
                return [_row(encoded, i) for i in range(len(keys))]

            prompts = [str(row["prompt"]) for row in rows]
            entries.append(self._lookup(self._prompts, [(prompt, path, *size) for prompt, path
                                                        in zip(prompts, paths, strict=True)], encode_prompts))
            if self.negative_prompt is not None:
                def encode_negatives(keys: list[Hashable]) -> list[Entry]:
                    encoded = self.adapter.encode_prompts_with_images([self.negative_prompt] * len(keys),
                                                                       [image(key[0]) for key in keys],
                                                                       self.max_sequence_length)
                    return [{f"negative_{name}": value for name, value in _row(encoded, i).items()}
                            for i in range(len(keys))]

                entries.append(self._lookup(self._negatives, [(path, *size) for path in paths], encode_negatives))
        merged = {name: torch.cat([entry[name] for entry in picked]) for picked in entries for name in picked[0]}
        pixels = merged.pop("pixels").to(self.adapter.device).float() / 255  # [n, 3, H, W] in [0, 1]
        return merged, pixels

    def _lookup(self, cache: OrderedDict[Hashable, Entry], keys: list[Hashable],
                encode: Callable[[list[Hashable]], list[Entry]]) -> list[Entry]:
        """The entries of ``keys`` in order, encoding the missing ones in one call, least recently used evicted."""
        missing = [key for key in dict.fromkeys(keys) if key not in cache]
        if missing:
            with torch.no_grad():
                for key, entry in zip(missing, encode(missing), strict=True):
                    cache[key] = entry
        picked = []
        for key in keys:
            cache.move_to_end(key)
            picked.append(cache[key])
        while len(cache) > self.capacity:
            cache.popitem(last=False)
        return picked


def _row(encoded: dict[str, Tensor], index: int) -> Entry:
    return {name: value[index:index + 1].clone() for name, value in encoded.items()}


def _read_image(path: str) -> Any:
    """The RGB image at ``path``; a file that is not a readable image is a one-line RolloutError naming it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as opened:
            return opened.convert("RGB")
    except (OSError, UnidentifiedImageError) as error:  # truncated, corrupt or not an image at all
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise RolloutError(f"input image {path} is not a readable image ({reason})") from None


def _image_path(row: dict[str, Any], index: int) -> str:
    image = row.get("image")
    if not isinstance(image, str | Path) or not str(image):
        raise RolloutError(f"prompt row {index} ({str(row.get('prompt', ''))[:40]!r}) has no 'image' (its input "
                           "image); an image-conditioned adapter needs one in every row")
    return str(image)
