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

A row may name several input images (``"image"``: a list of paths) where the adapter takes several
(:attr:`FlowAdapter.max_condition_images`: Qwen-Image-Edit-Plus, FLUX.2). Each image is encoded and cached alone; a
row's conditioning joins its images' (:meth:`FlowAdapter.join_condition_images`) in ``slots`` places, the most
images any row of the run names, so that rows of any count stack; a prompt encoding that sees the images is cached
per (prompt, images). A row of a first-and-last-frame video (Wan: ``"last_image"``) is encoded and cached per
(first, last) pair, since its condition video holds both. Input images are brought to the adapter's
:attr:`~FlowAdapter.condition_size` (``plugin.condition_size``, else the generated size), which the keys carry.
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
        slots: The most input images a row of the run names (1: one image per row, laid out as before).
        last_images: Whether the run's rows name a ``"last_image"`` (Wan first-and-last-frame video): each row's
            (first, last) pair is then encoded together, as the condition video holds both.
    """

    def __init__(self, adapter: Any, capacity: int, max_sequence_length: int, negative_prompt: str | None,
                 slots: int = 1, last_images: bool = False):
        self.adapter = adapter
        self.capacity = capacity
        self.max_sequence_length = max_sequence_length
        self.negative_prompt = negative_prompt
        self.slots = slots
        self.last_images = last_images
        # (path, H, W), or with last images (first, last or None, H, W) → latents [1, ...], pixels
        self._images: OrderedDict[Hashable, Entry] = OrderedDict()
        self._prompts: OrderedDict[Hashable, Entry] = OrderedDict()  # (prompt, paths, H, W) → prompt encoding
        self._negatives: OrderedDict[Hashable, Entry] = OrderedDict()  # (paths, H, W) → negative_* encoding

    def __call__(self, rows: Sequence[dict[str, Any]]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """(conditioning of ``rows``' images, each tensor ``[n, ...]``; the payload entries of the images as the
        model saw them, in [0, 1]: ``condition_images`` ``[n, 3, H, W]``, each row's first image, with ``slots`` > 1
        ``more_condition_images`` ``[n, slots − 1, 3, H, W]`` and ``condition_image_counts`` ``[n]``, and with
        ``last_images`` ``condition_last_images`` ``[n, 3, H, W]``)."""
        size = self.adapter.condition_size  # the input images' size: the cache keys carry it
        paths = [_image_paths(row, index, self.slots) for index, row in enumerate(rows)]  # a tuple per row
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

        def encode_pairs(keys: list[Hashable]) -> list[Entry]:  # (first, last or None, H, W): one condition video
            encoded, pixels = self.adapter.encode_condition_images(
                [image(key[0]) for key in keys], [None if key[1] is None else image(key[1]) for key in keys])
            pixels = (pixels.float() * 255).round().clamp(0, 255).to(torch.uint8).cpu()  # [n, 2, 3, H, W]
            return [{**_row(encoded, i), "pixels": pixels[i:i + 1, 0].clone(), "last_pixels": pixels[i:i + 1, 1]
                     .clone()} for i in range(len(keys))]

        if self.last_images:
            pairs = [(row_paths[0], None if row.get("last_image") is None else str(row["last_image"]), *size)
                     for row, row_paths in zip(rows, paths, strict=True)]
            per_row = [[entry] for entry in self._lookup(self._images, pairs, encode_pairs)]
        else:
            flat = [(path, *size) for row_paths in paths for path in row_paths]
            encoded = iter(self._lookup(self._images, flat, encode_images))
            per_row = [[next(encoded) for _ in row_paths] for row_paths in paths]  # each row's images' entries
        if self.slots == 1:
            entries = [[row[0] for row in per_row]]
        else:
            entries = [[{**self.adapter.join_condition_images([{name: value for name, value in entry.items()
                                                                if name != "pixels"} for entry in row], self.slots),
                         **_pixel_slots(row, self.slots)} for row in per_row]]
        if self.adapter.prompt_sees_image:
            def encode_prompts(keys: list[Hashable]) -> list[Entry]:
                encoded = self.adapter.encode_prompts_with_images([key[0] for key in keys],
                                                                   [[image(path) for path in key[1]] for key in keys],
                                                                   self.max_sequence_length)
                return [_row(encoded, i) for i in range(len(keys))]

            prompts = [str(row["prompt"]) for row in rows]
            entries.append(self._lookup(self._prompts, [(prompt, row_paths, *size) for prompt, row_paths
                                                        in zip(prompts, paths, strict=True)], encode_prompts))
            if self.negative_prompt is not None:
                def encode_negatives(keys: list[Hashable]) -> list[Entry]:
                    encoded = self.adapter.encode_prompts_with_images([self.negative_prompt] * len(keys),
                                                                       [[image(path) for path in key[0]]
                                                                        for key in keys],
                                                                       self.max_sequence_length)
                    return [{f"negative_{name}": value for name, value in _row(encoded, i).items()}
                            for i in range(len(keys))]

                entries.append(self._lookup(self._negatives, [(row_paths, *size) for row_paths in paths],
                                            encode_negatives))
        merged = {name: torch.cat([entry[name] for entry in picked]) for picked in entries for name in picked[0]}
        device = self.adapter.device
        payload = {"condition_images": merged.pop("pixels").to(device).float() / 255}  # [n, 3, H, W] in [0, 1]
        if self.last_images:  # [n, 3, H, W], zero where a row has no last frame
            payload["condition_last_images"] = merged.pop("last_pixels").to(device).float() / 255
        if self.slots > 1:
            payload["more_condition_images"] = merged.pop("more_pixels").to(device).float() / 255  # [n, K−1, 3, H, W]
            payload["condition_image_counts"] = merged.pop("image_count").to(device)  # [n]
        return merged, payload

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


def _pixel_slots(entries: list[Entry], slots: int) -> Entry:
    """One row's 8-bit input images for the payload: ``pixels`` ``[1, 3, H, W]`` (its first), ``more_pixels``
    ``[1, slots − 1, 3, H, W]`` (the others, zero after its last) and ``image_count`` ``[1]``."""
    first = entries[0]["pixels"]  # [1, 3, H, W]
    more = first.new_zeros(1, slots - 1, *first.shape[1:])
    for slot, entry in enumerate(entries[1:]):
        more[0, slot] = entry["pixels"][0]
    return {"pixels": first, "more_pixels": more, "image_count": torch.tensor([len(entries)])}


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


def _image_paths(row: dict[str, Any], index: int, slots: int) -> tuple[str, ...]:
    """The input image paths of prompt row ``index`` (``"image"``: a path or a list of 1 to ``slots`` paths)."""
    image = row.get("image")
    names = image if isinstance(image, list) else [image]
    if not names or any(not isinstance(name, str | Path) or not str(name) for name in names):
        raise RolloutError(f"prompt row {index} ({str(row.get('prompt', ''))[:40]!r}) has no 'image' (its input "
                           "image, or a list of them); an image-conditioned adapter needs one in every row")
    if len(names) > slots:
        raise RolloutError(f"prompt row {index} ({str(row.get('prompt', ''))[:40]!r}) names {len(names)} input "
                           f"images, more than the {slots} the run's datasets were laid out for")
    return tuple(str(name) for name in names)
