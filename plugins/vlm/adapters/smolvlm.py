"""SmolVLM2 (HuggingFaceTB/SmolVLM2-2.2B-Instruct, -500M-Video-Instruct, -256M-Video-Instruct) through transformers'
``SmolVLMForConditionalGeneration`` and SmolVLM-Instruct v1 (HuggingFaceTB/SmolVLM-Instruct, ``model_type:
idefics3``) through ``Idefics3ForConditionalGeneration``: a SigLIP tower on square tiles, a connector that
pixel-shuffles each tile's patch features into a few tokens and projects them, and a SmolLM2 (Llama) language model
with plain 1-D rotary positions.

Registered when the installed transformers has ``transformers.models.smolvlm`` (``family: smolvlm``) and
``transformers.models.idefics3`` (``family: idefics3``; the same model and image processor, Idefics3's processor).
What differs from the Qwen-VL conventions of the base class, against transformers 5.25's
``models/smolvlm/modeling_smolvlm.py``, ``processing_smolvlm.py`` and ``image_processing_smolvlm.py`` (line numbers of
that release; ``models/idefics3``'s files repeat them for v1):

- **Images are tiles plus a global view.** The image processor first scales every image so that its longest side is
  ``size["longest_edge"]`` (enlarging small images too; the shorter side from the aspect ratio, rounded up to even:
  ``_resize_output_size_rescale_to_max_len``, ``image_processing_smolvlm.py:63-97``, capped at 4096 by ``:100-128``),
  then stretches it so that both sides are multiples of the tile side ``M = max_image_size["longest_edge"]``
  (``resize_for_vision_encoder``, ``:308-337``: the longer side rounded up, the other recomputed from the aspect ratio
  and rounded up) and, when a side exceeds ``M``, cuts that canvas into ``rows × cols`` tiles of ``M × M`` followed by
  the whole canvas squashed to ``M × M`` (``split_images``, ``:249-306``); otherwise the canvas, ``M × M``, is the
  image's only frame. With ``do_image_splitting`` off every image is one ``M × M`` frame. Since every image is first
  scaled to the same longest edge, whether images are split depends on the settings, not on the image: with
  ``longest_edge > M`` every image is split (its grid follows its aspect ratio), with ``longest_edge = M`` none is.
  :meth:`resized_size` repeats the arithmetic of the processing itself (``get_number_of_image_patches``,
  ``:498-541``, rounds the shorter side from the first resize's size instead of the recomputed one: the same grid
  whenever the longer side is already a tile multiple, as the adapter's ``longest_edge`` is, up to float rounding).
- **Pixel bounds become the longest edge.** The plugin's bounds are areas of the resized image, here the canvas.
  ``max_pixels`` sets ``longest_edge`` to the largest multiple of ``M`` whose square is at most ``max_pixels``, capped
  at the checkpoint's own ``longest_edge`` (SmolVLM2-2.2B: 1536 = 4 × 384; 256M/500M: 2048 = 4 × 512), so every
  canvas has at most ``max_pixels`` pixels (:meth:`longest_edge_for`); the global view (``M²``) comes on top, as
  InternVL's thumbnail does. ``max_pixels`` below one tile is refused. The smallest canvas the processor makes is
  ``longest_edge × M`` (``M²`` without splitting): a ``min_pixels`` above it cannot be met and is refused in one line;
  below it, it always holds. The plugin's default ``max_pixels`` (512·28² = 401,408) gives SmolVLM2-2.2B
  ``longest_edge`` 384, one 384 × 384 frame (81 tokens) per image; set ``plugin.max_pixels: 2359296`` (1536²) for the
  checkpoint's own 4 × 4 tiles plus the global view (1,377 tokens for a square image). The tile side ``M`` is the
  tower's ``image_size`` and stays the checkpoint's. Images reach the processor unresized.
- **The prompt writes the tiles.** The processor expands each ``<image>`` of the chat into, per tile in row-major
  order, ``<fake_token_around_image><row_r_col_c>`` + ``image_seq_len`` ``<image>`` (a newline after each row), then
  ``\\n<fake_token_around_image><global-img>`` + ``image_seq_len`` ``<image>`` + ``<fake_token_around_image>``
  (``_prompt_split_image``, ``processing_smolvlm.py:48-66``); an unsplit image is the global part alone (``:69-76``).
  ``image_seq_len`` = (tile patches) / scale² (SmolVLM2-2.2B: 27² / 3² = 81; 256M/500M: 32² / 4² = 64). The model
  fills the ``<image>`` tokens only, with the frames' features in order (``get_placeholder_mask``,
  ``modeling_smolvlm.py:592-613``, ``masked_scatter`` at ``:579``); the delimiter, position and global tokens are
  ordinary embeddings. A prompt's frame count is therefore its ``<image>`` count / ``image_seq_len``.
- **Pixels are frames with padding frames.** ``pixel_values`` is ``[prompts, max frames, 3, M, M]``, a prompt's real
  frames first and all-zero padding frames after them, and ``pixel_attention_mask [prompts, max frames, M, M]``
  (``_preprocess``, ``image_processing_smolvlm.py:450-478``). Every real frame is a whole ``M × M`` tile, so its mask
  is all ones; the model drops the all-zero frames (``get_image_features``, ``modeling_smolvlm.py:472-480``), runs
  the rest through the tower one frame each (no attention across frames) and concatenates their features in order
  (``:505-507``, ``torch.cat`` at ``:571-572``). So a prompt keeps its own real frames, ``[frames_i, 3, M, M]``
  (:meth:`encode` checks that the processor's mask is whole on them and zero elsewhere), and :meth:`collate` hands the
  model the samples' frames as one row, ``[1, Σ frames, 3, M, M]``, without padding frames or a mask: the model builds
  the all-ones mask itself (``:482-487``), which is the processor's mask on real frames, and scatters the same
  features into the same ``<image>`` tokens. A real frame whose normalised pixels were all exactly 0 would be dropped
  as padding by transformers alike; with the released mean and std (0.5, 0.5) no 8-bit image maps to 0.
- **Plain rotary positions.** The language model numbers positions from the first column when none are given, so the
  adapter (``mrope`` false) passes each left-padded row's positions from its padding mask, as ``generate`` does.
- **The feature cache** keeps ``get_image_features``'s ``pooler_output`` (tower, pixel shuffle and projection:
  ``image_seq_len`` rows per frame, kept per prompt as ``[frames_i·image_seq_len, hidden]``), which the model takes
  back through ``mm_encoder_outputs["image"].pooler_output`` (``:551-579``). The connector is inside what is cached,
  so ``freeze_vision`` freezes ``connector`` with the tower (:meth:`vision_modules`) and LoRA keeps off both (the
  tower's attention names its projections ``q_proj`` / ``k_proj`` / ``v_proj`` like the language model's).
- **The chat.** ``<|im_start|>User:<image>question<end_of_utterance>\\nAssistant:`` (``processing_smolvlm.py:45``,
  the released template): ``<|im_start|>`` once, a turn per ``Role: text<end_of_utterance>\\n`` (no space after the
  colon when the turn opens with an image), the generation prompt ``Assistant:``; a system message is a ``System:``
  turn. The template writes ``<|im_start|>``, the released tokenizers' BOS, so :meth:`encode` tokenizes a rendered chat
  without special tokens, as transformers' ``apply_chat_template`` does (the base class's
  :meth:`~mmrl.plugins.vlm.adapters.base.VLMAdapter.adds_special_tokens`): one ``<|im_start|>`` whether or not the
  tokenizer adds BOS. A completion ends at ``<end_of_utterance>``, which ends every turn (:meth:`generation_eos_ids`
  adds it should a generation config lack it).
- **No videos.** SmolVLM2's processor writes a video as a sentence with its frame count in words and its duration,
  then per frame ``\\nFrame from MM:SS:`` and a global view (``replace_video_token``,
  ``processing_smolvlm.py:167-190``), its frames among the image frames; the plugin's video bookkeeping
  (``video_grid_thw``, frame rates, T-GRPO's frame shuffle) does not describe that, so this family takes image rows
  only (:attr:`~VLMAdapter.supports_videos` false).
  transformers' ``SmolVLMProcessor`` needs the ``num2words`` package (for that sentence) even for images
  (``:126-129``); Idefics3's processor does not.
- **Boxes** in pixels of the image the model sees. SmolVLM documents no grounding output format, so the family
  declares the plugin's generic ``qwen2_5_vl`` convention (as Gemma 3 and Mistral 3 do): boxes in pixels of the
  resized model input, the tile canvas (a row's ``resized_size``, :meth:`resized_size`; ``M × M`` for an unsplit
  image), scaled back to the original image per axis by its width and height (the canvas is the image stretched, not
  padded); prompt the model for JSON ``bbox_2d`` in those pixels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from mmrl.plugins.vlm.adapters.base import (
    PromptInputs,
    VLMAdapter,
    _base_model,
    find_submodule,
    open_unresized,
)

MAX_IMAGE_SIDE = 4096
"""The image processor's absolute cap on a resized side (``MAX_IMAGE_SIZE``, ``image_processing_smolvlm.py:60``)."""
ROW_COL_TOKENS = tuple(f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7))
"""The tile position tokens of the SmolVLM vocabularies (``<row_{1..6}_col_{1..6}>``, which Idefics3's processor looks
up, ``processing_idefics3.py:60-62``); the processor writes ``<row_r_col_c>`` for larger grids too, as plain text."""


class SmolVLMAdapter(VLMAdapter):
    """SmolVLM2 (``model_type: smolvlm``) through ``transformers.SmolVLMForConditionalGeneration`` (see the module
    docstring)."""

    name = "smolvlm"
    model_types = ("smolvlm",)
    model_class = "SmolVLMForConditionalGeneration"
    box_convention = "qwen2_5_vl"  # pixels of the tile canvas (module docstring)
    vision_attributes: ClassVar[tuple[str, ...]] = ("model.vision_model",)
    projector_attributes: ClassVar[tuple[str, ...]] = ("model.connector",)
    # The tower's attention names its projections like the language model's: the pattern keeps LoRA off the tower and
    # the connector whose output the feature cache keeps.
    vision_module_pattern: ClassVar[str] = r".*(^|\.)(vision_model|connector)(\.|$).*"
    # The placeholder the model fills with features (a sampled one would be taken for an image slot when fed back),
    # the frame delimiters, global-view and tile position tokens, which only the processor writes, and the video
    # placeholder.
    vision_tokens: ClassVar[tuple[str, ...]] = ("<image>", "<fake_token_around_image>", "<global-img>",
                                                "<video>") + ROW_COL_TOKENS
    end_of_utterance: ClassVar[str] = "<end_of_utterance>"
    supports_videos = False
    video_refusal = ("its processor writes a video as timestamped frames of image tokens the plugin's video "
                     "bookkeeping does not describe")
    mrope = False

    def __init__(self, model: str, **bounds: Any):
        # The base class's pixel bounds (videos are refused: the video bounds are only validated and kept)
        super().__init__(model, **bounds)
        self.image_token_id = int(self.tokenizer.convert_tokens_to_ids(self.processor.image_token))
        self.image_seq_len = int(self.processor.image_seq_len)
        vocab = self.tokenizer.get_vocab()
        self.global_token_id = int(vocab["<global-img>"])
        # The tile position tokens the vocabulary has, id -> (row, col)
        self.tile_positions = {int(vocab[token]): (row, col) for token, (row, col) in
                               zip(ROW_COL_TOKENS, ((r, c) for r in range(1, 7) for c in range(1, 7)), strict=True)
                               if token in vocab}
        smallest = self.smallest_canvas
        if self.min_pixels > smallest:
            raise ValueError(f"{self.name}: min_pixels {self.min_pixels} exceeds the smallest image the processor "
                             f"makes at longest_edge {self.longest_edge} ({smallest} pixels: every image is scaled to "
                             f"that longest edge); set plugin.min_pixels to at most {smallest}")

    # ------------------------------------------------------------------ loading, sizes and images
    def load_processor(self) -> Any:
        """``AutoProcessor.from_pretrained`` with the image processor's ``longest_edge`` set from ``max_pixels``
        (:meth:`longest_edge_for`).

        Raises:
            ValueError: a checkpoint whose image processor does not resize images to a longest edge, or
                ``max_pixels`` below one tile.
        """
        from transformers import AutoProcessor
        from transformers.image_utils import SizeDict

        processor = AutoProcessor.from_pretrained(self.model_path)
        image_processor = processor.image_processor
        checkpoint_edge = getattr(image_processor.size, "longest_edge", None)
        if not image_processor.do_resize or not checkpoint_edge:
            raise ValueError(f"{self.name}: {self.model_path}'s image processor does not resize images to a longest "
                             f"edge (do_resize {image_processor.do_resize}, size {image_processor.size}); the plugin's "
                             "pixel bounds need do_resize true and size {'longest_edge': ...}, as released")
        tile = int(image_processor.max_image_size["longest_edge"])
        edge = self.longest_edge_for(self.max_pixels, tile, int(checkpoint_edge), name=self.name)
        # A SizeDict, as the image processor keeps its size after __init__ (its resize reads .longest_edge)
        image_processor.size = SizeDict(longest_edge=edge)
        return processor

    @staticmethod
    def longest_edge_for(max_pixels: int, tile: int, checkpoint_edge: int, *, name: str = "smolvlm") -> int:
        """The ``longest_edge`` that bounds every tile canvas's area by ``max_pixels``: the largest multiple of
        ``tile`` whose square is at most ``max_pixels``, at most ``checkpoint_edge`` (the checkpoint's own). The
        canvas's longer side is ``longest_edge`` rounded up to a tile multiple (the edge itself, or for a checkpoint
        edge that is not a multiple, at most the bound's multiple), the shorter at most that, so its area is at most
        the bound's square.

        Raises:
            ValueError: ``max_pixels`` below ``tile²`` (no frame fits).
        """
        edge = math.isqrt(int(max_pixels)) // tile * tile
        if edge < tile:
            raise ValueError(f"{name}: max_pixels {max_pixels} is below one {tile} x {tile} tile; set "
                             f"plugin.max_pixels to at least {tile * tile}")
        return min(edge, checkpoint_edge)

    def patch_geometry(self) -> tuple[int, int]:
        """The tower's patch side and the connector's pixel-shuffle factor (``scale_factor``; one image token covers
        ``scale × scale`` patches), read from the checkpoint's config: SmolVLM's image processor knows neither."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.model_path)
        return int(config.vision_config.patch_size), int(config.scale_factor)

    @property
    def tile(self) -> int:
        """The tile side ``M`` (``max_image_size["longest_edge"]``, the tower's ``image_size``)."""
        return int(self.processor.image_processor.max_image_size["longest_edge"])

    @property
    def image_factor(self) -> int:
        """Canvas sides are multiples of this: the tile side."""
        return self.tile

    @property
    def longest_edge(self) -> int:
        """The image processor's ``longest_edge`` (:meth:`longest_edge_for`)."""
        return int(self.processor.image_processor.size.longest_edge)

    @property
    def splits_images(self) -> bool:
        """Whether the processor cuts images into tiles (``do_image_splitting``; released: true)."""
        return bool(self.processor.image_processor.do_image_splitting)

    @property
    def smallest_canvas(self) -> int:
        """The smallest canvas area the processor makes: ``longest_edge`` rounded up to a tile multiple, times ``M``
        when it splits (the longer side is that, the shorter at least one tile), else ``M²``."""
        tile = self.tile
        if not self.splits_images:
            return tile * tile
        return math.ceil(self.longest_edge / tile) * tile * tile

    def resized_size(self, image_size: Sequence[float]) -> tuple[int, int]:
        """``(width, height)`` of the canvas the processor stretches an image of ``image_size`` ``(width, height)`` to
        before cutting it into tiles: its longest side scaled to ``longest_edge`` (the shorter from the aspect ratio,
        rounded up to even, at least 1; sides capped at 4096), then the longer side rounded up to a multiple of ``M``
        and the shorter recomputed from the new aspect ratio and rounded up to one
        (``get_resize_output_image_size`` and ``resize_for_vision_encoder``, ``image_processing_smolvlm.py:63-152,
        308-337``, the same float operations in the same order); ``(M, M)`` without splitting."""
        from mmrl.rewards.boxes import checked_size

        width, height = (int(side) for side in checked_size(image_size, "image_size"))
        tile = self.tile
        if not self.splits_images:
            return tile, tile
        edge = self.longest_edge
        aspect = width / height
        if width >= height:
            width = edge
            height = int(width / aspect)
            height += height % 2
        else:
            height = edge
            width = int(height * aspect)
            width += width % 2
        height, width = max(height, 1), max(width, 1)
        aspect = width / height
        if width >= height and width > MAX_IMAGE_SIDE:
            width, height = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE / aspect)
        elif height > width and height > MAX_IMAGE_SIDE:
            height, width = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE * aspect)
        height, width = max(height, 1), max(width, 1)
        aspect = width / height
        if width >= height:
            width = math.ceil(width / tile) * tile
            height = math.ceil(int(width / aspect) / tile) * tile
        else:
            height = math.ceil(height / tile) * tile
            width = math.ceil(int(height * aspect) / tile) * tile
        return width, height

    def tile_grid(self, image_size: Sequence[float]) -> tuple[int, int]:
        """``(cols, rows)`` of tiles the processor cuts an image of ``image_size`` into; ``(0, 0)`` for an image that
        is one frame (``split_images``: a canvas of one tile, or no splitting)."""
        width, height = self.resized_size(image_size)
        tile = self.tile
        if not self.splits_images or (width <= tile and height <= tile):
            return 0, 0
        return width // tile, height // tile

    def frames_per_image(self, image_size: Sequence[float]) -> int:
        """How many frames (tiles and the global view) the processor makes of an image of ``image_size``."""
        cols, rows = self.tile_grid(image_size)
        return cols * rows + 1

    def load_images(self, images: Sequence[Any], *, use_qwen_vl_utils: bool | None = None) -> list[Any]:
        """Open the images of one prompt as RGB, unresized: SmolVLM's processor resizes and tiles them.

        Raises:
            ValueError: ``use_qwen_vl_utils=True`` (a Qwen helper; SmolVLM does not use it).
        """
        return open_unresized(images, use_qwen_vl_utils=use_qwen_vl_utils,
                              resized_by="SmolVLM images are resized and tiled by SmolVLM's processor")

    # ------------------------------------------------------------------ prompts
    def image_sizes(self, input_ids: Tensor) -> Tensor:
        """``[images, 2]`` (height, width) in pixels of each image's canvas in a prompt, read from its ids: an image is
        its tiles, each ``<row_r_col_c>`` + ``image_seq_len`` ``<image>`` in row-major order, then ``<global-img>`` +
        ``image_seq_len`` ``<image>`` (``_prompt_split_image``), so ``rows × cols`` tiles are ``(rows·M, cols·M)``
        pixels, and an image without tiles is one ``M × M`` frame. :meth:`encode` checks them against
        :meth:`resized_size` of each image.

        Raises:
            ValueError: ids that do not form whole images (tiles out of row-major order, a frame that is not
                ``image_seq_len`` ``<image>`` after a tile or global token, tiles without a global view).
        """
        tile, length = self.tile, self.image_seq_len
        ids = input_ids.tolist()
        sizes: list[tuple[int, int]] = []
        tiles: list[tuple[int, int]] = []
        index = 0
        while index < len(ids):
            token = ids[index]
            if token in self.tile_positions or token == self.global_token_id:
                run = ids[index + 1:index + 1 + length]
                if len(run) != length or any(t != self.image_token_id for t in run):
                    raise ValueError(f"{self.name}: a tile or global-view token not followed by {length} <image> "
                                     "tokens; the prompt was not written by SmolVLM's processor")
                if token == self.global_token_id:
                    rows, cols = (max(r for r, _ in tiles), max(c for _, c in tiles)) if tiles else (1, 1)
                    expected = [(r, c) for r in range(1, rows + 1) for c in range(1, cols + 1)] if tiles else []
                    if tiles != expected:
                        raise ValueError(f"{self.name}: an image's tiles {tiles} are not a row-major grid; the prompt "
                                         "was not written by SmolVLM's processor")
                    sizes.append((rows * tile, cols * tile))
                    tiles = []
                else:
                    tiles.append(self.tile_positions[token])
                index += 1 + length
                continue
            if token == self.image_token_id:
                raise ValueError(f"{self.name}: <image> tokens outside a tile or global view (a grid beyond the "
                                 "vocabulary's <row_r_col_c> tokens?); the prompt was not written by SmolVLM's "
                                 "processor")
            index += 1
        if tiles:
            raise ValueError(f"{self.name}: the prompt ends inside an image (tiles without a global view)")
        return torch.tensor(sizes, dtype=torch.long).reshape(-1, 2)

    def encode(self, texts: Sequence[str], images: Sequence[Sequence[Any]],
               videos: Sequence[Sequence[Sequence[Any]]] | None = None,
               video_fps: Sequence[Sequence[float]] | None = None, *, video_entries: bool = False
               ) -> list[PromptInputs]:
        """Run the processor once on a batch of prompts and give each prompt its own frames.

        Row i of the batch's ``pixel_values`` holds prompt i's frames (each image's tiles, then its global view, images
        in text order) and then padding frames; prompt i has ``<image>`` count / ``image_seq_len`` real frames.

        Returns:
            Per prompt ``{"input_ids": [P_i], "pixel_values": [frames_i, 3, M, M]}`` (tokens unpadded, no padding
            frames).

        Raises:
            ValueError: videos, image tokens that do not fill whole frames, or a processor output whose mask is not
                whole on the real frames and zero on the padding frames.
        """
        if len(texts) != len(images):
            raise ValueError(f"encode: {len(texts)} texts but {len(images)} image lists")
        self.refuse_videos(video_entries or any(group for group in videos or []))
        # The processor takes the images nested per text (make_nested_list_of_images) and checks each text's count
        nested = [list(group) for group in images] if any(images) else None
        # The chat template writes <|im_start|>, the tokenizer's BOS: transformers' own rule (adds_special_tokens)
        batch = self.processor(text=list(texts), images=nested, padding=True, padding_side="left",
                               return_tensors="pt", add_special_tokens=self.adds_special_tokens(texts))
        attention = batch["attention_mask"].bool()  # [B, P]
        tile = self.tile
        if nested is not None:
            pixels = batch["pixel_values"]  # [B, max frames, 3, M, M]
            masks = batch["pixel_attention_mask"].bool()  # [B, max frames, M, M]
        else:
            pixels, masks = torch.zeros(len(texts), 0, 3, tile, tile), torch.zeros(len(texts), 0, tile, tile).bool()
        prompts: list[PromptInputs] = []
        for i in range(len(texts)):
            ids = batch["input_ids"][i][attention[i]]  # [P_i]
            tokens = int((ids == self.image_token_id).sum())
            frames, rest = divmod(tokens, self.image_seq_len)
            if rest:
                raise ValueError(f"{self.name}: prompt {i} holds {tokens} image tokens, not a multiple of "
                                 f"image_seq_len {self.image_seq_len}")
            if not (bool(masks[i, :frames].all()) and not bool(masks[i, frames:].any())
                    and not bool(pixels[i, frames:].any())):
                raise ValueError(f"{self.name}: prompt {i}'s {frames} frames are not whole {tile} x {tile} tiles "
                                 "followed by empty padding frames in the processor's output")
            expected = [self.resized_size(image.size)[::-1] for image in images[i]]  # (height, width)
            if self.image_sizes(ids).tolist() != [list(size) for size in expected]:
                raise ValueError(f"{self.name}: prompt {i}'s image tokens make canvases of "
                                 f"{self.image_sizes(ids).tolist()} pixels (height, width), resized_size gives "
                                 f"{expected}")
            prompts.append({"input_ids": ids, "pixel_values": pixels[i, :frames]})
        return prompts

    def image_features(self, model: nn.Module, prompts: Sequence[PromptInputs]) -> list[PromptInputs]:
        """The prompts with ``pixel_values`` replaced by ``image_embeds [frames_i·image_seq_len, hidden]``:
        ``get_image_features`` (tower, pixel shuffle, projection) on all prompts' frames in one call, no gradients;
        valid for every pass of a step while the tower and the connector are frozen."""
        result = [dict(prompt) for prompt in prompts]
        hf_model = _base_model(model)
        device = next(hf_model.parameters()).device
        holding = [p["pixel_values"] for p in prompts if p["pixel_values"].shape[0]]
        features = torch.zeros(0, 0)
        if holding:
            with torch.no_grad():
                output = hf_model.get_image_features(pixel_values=torch.cat(holding).unsqueeze(0).to(device),
                                                     return_dict=True)
            features = torch.cat(list(output.pooler_output))  # [Σ frames·image_seq_len, hidden]
        start = 0
        for updated in result:
            rows = int(updated.pop("pixel_values").shape[0]) * self.image_seq_len
            updated["image_embeds"] = features[start:start + rows] if rows else torch.zeros(0, 0)
            start += rows
        return result

    # ------------------------------------------------------------------ batching
    def collate(self, prompts: Sequence[PromptInputs], completions: Sequence[Tensor] | None = None,
                device: torch.device | str | None = None) -> tuple[dict[str, Tensor], int]:
        """The base class's token collation (prompts left-padded, completions right-padded) with the samples' frames
        in sample order, the order in which the model fills the ``<image>`` tokens: ``pixel_values [1, Σ frames, 3,
        M, M]`` (one row without padding frames, no mask: module docstring) or, for prompts carrying cached features,
        ``mm_encoder_outputs`` whose ``"image"`` entry's ``pooler_output`` is ``[Σ image tokens, hidden]``.

        Raises:
            ValueError: a batch that mixes prompts with cached features and prompts with pixels.
        """
        inputs, width = super().collate(prompts, completions, device)
        device = inputs["input_ids"].device
        if self.put_cached_image_features(prompts, inputs):
            return inputs, width
        frames = [p["pixel_values"].to(device) for p in prompts if p["pixel_values"].shape[0]]
        if frames:
            inputs["pixel_values"] = torch.cat(frames).unsqueeze(0)  # [1, Σ frames, 3, M, M]
        return inputs, width

    def image_token_count(self, prompt: PromptInputs) -> float:
        """The prompt's ``<image>`` tokens (``image_seq_len`` per tile and global view)."""
        return float((prompt["input_ids"] == self.image_token_id).sum())

    # ------------------------------------------------------------------ modules and tokens
    def vision_modules(self, model: nn.Module) -> list[nn.Module]:
        """The SigLIP tower and the ``connector`` (pixel shuffle and projection into the language model): together
        they make the features the cache keeps."""
        projector = find_submodule(_base_model(model), self.projector_attributes, what=f"{self.name} connector")
        return [self.vision_tower(model), projector]

    def generation_eos_ids(self, model: nn.Module) -> list[int]:
        """The base class's EOS ids (the checkpoint's generation EOS ids, the tokenizer's EOS) and
        ``<end_of_utterance>``, which ends every turn of the chat template, should a generation config lack it."""
        ids = set(super().generation_eos_ids(model))
        end = self.tokenizer.get_vocab().get(self.end_of_utterance)
        if end is not None:
            ids.add(int(end))
        return sorted(ids)


class Idefics3Adapter(SmolVLMAdapter):
    """SmolVLM-Instruct v1 (``model_type: idefics3``) through ``transformers.Idefics3ForConditionalGeneration``: the
    same tower, connector, image processing and prompt layout as SmolVLM2 (transformers' ``models/idefics3``, of
    which ``models/smolvlm`` is a modular copy), with Idefics3's processor, which takes images only."""

    name = "idefics3"
    model_types = ("idefics3",)
    model_class = "Idefics3ForConditionalGeneration"
    video_refusal = "Idefics3's processor takes images only"


__all__ = ["MAX_IMAGE_SIDE", "ROW_COL_TOKENS", "Idefics3Adapter", "SmolVLMAdapter"]
