"""GLM-4.1V-Thinking and GLM-4.5V (zai-org): Qwen2-VL-style vision input with GLM's own resizing, prompt tokens and
video layout.

Both run through transformers' ``Glm4vForConditionalGeneration`` (GLM-4.1V-9B-Thinking, GLM-4.1V-9B-Base) and
``Glm4vMoeForConditionalGeneration`` (GLM-4.5V, 106B-A12B), registered when the installed transformers has
``transformers.models.glm4v`` (``glm4v_moe``). What the shared base class does (per-prompt pixel rows and grids,
M-RoPE positions from ``mm_token_type_ids``, the pooled feature cache, shared prefill, the decode loop) applies as it
is; what GLM does differently is here:

- **Image size.** GLM's image processor resizes with its own ``smart_resize`` (transformers 5.25
  ``models/glm4v/image_processing_glm4v.py``): sides rounded to multiples of 28 (14-pixel patches merged 2×2), an
  image counted as ``temporal_patch_size`` (2) frames against the processor's ``size`` bounds, floor/ceil when a
  bound is hit. ``plugin.min_pixels`` / ``max_pixels`` stay bounds on one image's area, as for every family: the
  adapter writes ``size = {shortest_edge: 2·min_pixels, longest_edge: 2·max_pixels}`` into the processor and
  :func:`glm_resized_size` reproduces the arithmetic (tested against the processor's grids). Images reach the
  processor unresized (GLM-V's ``inference/trans_infer_cli.py`` passes the raw image; there is no qwen-vl-utils
  step), so the processor's own resize is the only one.
- **Prompt tokens.** ``<|begin_of_image|><|image|>…<|end_of_image|>``; a video is
  ``<|begin_of_video|>`` then, per temporal patch (two frames), ``<|begin_of_image|><|image|>…<|end_of_image|>`` and
  the patch's first timestamp in whole seconds, then ``<|end_of_video|>`` (``Glm4vProcessor.replace_video_token``):
  video tokens are image tokens, told apart only by ``mm_token_type_ids``.
- **Video size.** GLM's video processor bounds the whole clip, ``frames·height·width``, with the same
  ``smart_resize``. The adapter resizes a clip's frames itself (as for every family, so that per-clip bounds are
  possible) with that arithmetic: ``frames·video_min_pixels`` ≤ frames·h·w ≤ ``min(frames·video_max_pixels,
  video_total_pixels)``; ``video_total_pixels`` defaults to the checkpoint's own clip bound (GLM's default
  28²·2·30000). Frames are resized with PIL's bicubic filter (GLM's processor uses torchvision's antialiased
  bicubic: the same size, pixels that differ by interpolation rounding).
- **No image and video in one forward.** transformers' ``Glm4vModel.get_placeholder_mask`` marks every ``<|image|>``
  token as an image slot *and* as a video slot, so a batch holding both fails its feature count; GLM-V's own CLI
  refuses the mix ("Chat with images and video is NOT allowed"). The plugin refuses a dataset split that mixes image
  and video rows at start-up (``batches_images_with_videos = False``); :meth:`Glm4vAdapter.encode` and
  :meth:`Glm4vAdapter.collate` refuse such a batch in one line.
- **Boxes** are ``[x1, y1, x2, y2]`` on a 0–1000 grid relative to the image, inside ``<|begin_of_box|>`` …
  ``<|end_of_box|>`` (zai-org/GLM-V@8fc9756 README "Grounding"): box convention ``glm4v``.
- **LoRA targets**: the attention projections and GLM-4.1V's fused ``gate_up_proj`` / ``down_proj``; for GLM-4.5V
  the attention only (peft 0.21 rewrites its MLP names onto the routed experts, peft 0.22 does not; see
  :class:`Glm4vMoeAdapter`); the vision tower's modules are excluded by the shared pattern.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from mmrl.plugins.vlm.adapters.base import PromptInputs, VLMAdapter, open_unresized

GLM_VIDEO_MAX_PIXELS = 28 * 28 * 2 * 30000
"""GLM's video processor's default upper bound on ``frames·height·width`` (``Glm4vVideoProcessor.size``)."""


def glm_resized_size(image_size: Sequence[float], *, factor: int, min_pixels: float, max_pixels: float,
                     num_frames: int = 2, temporal_factor: int = 2) -> tuple[int, int]:
    """``(width, height)`` GLM's processors resize an image (or every frame of a ``num_frames``-frame video) of
    ``image_size`` ``(width, height)`` to.

    The arithmetic of transformers' ``models/glm4v/image_processing_glm4v.py::smart_resize`` (5.25), which GLM-V's
    processors share: sides under ``factor`` are scaled up (truncated to int); sides round to multiples of
    ``factor`` (Python's ``round``, ties to even); the frame count rounds to a multiple of ``temporal_factor``; if
    ``frames·h·w`` exceeds ``max_pixels`` both sides shrink by ``sqrt(num_frames·H·W / max_pixels)`` and floor to a
    multiple (at least ``factor``), if it is under ``min_pixels`` they grow by ``sqrt(min_pixels / (num_frames·H·W))``
    and ceil. An image is ``temporal_factor`` frames (``num_frames=2``).

    Raises:
        ValueError: a size that is not two positive numbers, fewer frames than ``temporal_factor``, or an aspect
            ratio over 200.
    """
    from mmrl.rewards.boxes import checked_size

    width, height = checked_size(image_size, "image_size")
    if num_frames < temporal_factor:
        raise ValueError(f"glm_resized_size: {num_frames} frames is fewer than the temporal patch ({temporal_factor})")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"glm_resized_size: aspect ratio {max(height, width) / min(height, width):.1f} is over 200")
    resized_h = round(height / factor) * factor
    resized_w = round(width / factor) * factor
    frames = round(num_frames / temporal_factor) * temporal_factor
    if frames * resized_h * resized_w > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        resized_h = max(factor, math.floor(height / beta / factor) * factor)
        resized_w = max(factor, math.floor(width / beta / factor) * factor)
    elif frames * resized_h * resized_w < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        resized_h = math.ceil(height * beta / factor) * factor
        resized_w = math.ceil(width * beta / factor) * factor
    return int(resized_w), int(resized_h)


class Glm4vAdapter(VLMAdapter):
    """GLM-4.1V (dense) through ``transformers.Glm4vForConditionalGeneration`` (see the module docstring)."""

    name = "glm4v"
    model_types = ("glm4v",)
    model_class = "Glm4vForConditionalGeneration"
    box_convention = "glm4v"
    lora_target_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")
    vision_tokens: ClassVar[tuple[str, ...]] = ("<|image|>", "<|video|>", "<|begin_of_image|>", "<|end_of_image|>",
                                                "<|begin_of_video|>", "<|end_of_video|>")
    batches_images_with_videos = False

    def __init__(self, model: str, *, min_pixels: int, max_pixels: int, video_min_pixels: int | None = None,
                 video_max_pixels: int | None = None, video_total_pixels: float | None = None):
        super().__init__(model, min_pixels=min_pixels, max_pixels=max_pixels, video_min_pixels=video_min_pixels,
                         video_max_pixels=video_max_pixels, video_total_pixels=video_total_pixels)
        self.temporal_patch_size = int(getattr(self.processor.image_processor, "temporal_patch_size", 2))
        if video_total_pixels is None:  # GLM's own clip budget rather than qwen-vl-utils'
            size = getattr(getattr(self.processor, "video_processor", None), "size", None)
            self.video_total_pixels = float(_size_value(size, "longest_edge", GLM_VIDEO_MAX_PIXELS))

    def load_processor(self) -> Any:
        """``AutoProcessor.from_pretrained`` with the image processor's ``size`` bounds set to [min_pixels,
        max_pixels] per image (GLM counts an image as ``temporal_patch_size`` frames: the bounds written are that
        multiple)."""
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(self.model_path)
        image_processor = processor.image_processor
        frames = int(getattr(image_processor, "temporal_patch_size", 2))
        image_processor.size = {"shortest_edge": frames * self.min_pixels, "longest_edge": frames * self.max_pixels}
        return processor

    def resized_size(self, image_size: Sequence[float]) -> tuple[int, int]:
        """``(width, height)`` GLM's image processor resizes an image of ``image_size`` to (:func:`glm_resized_size`
        within [min_pixels, max_pixels] per image)."""
        frames = self.temporal_patch_size
        return glm_resized_size(image_size, factor=self.image_factor, min_pixels=frames * self.min_pixels,
                                max_pixels=frames * self.max_pixels, num_frames=frames, temporal_factor=frames)

    def load_images(self, images: Sequence[Any], *, use_qwen_vl_utils: bool | None = None) -> list[Any]:
        """Open the images of one prompt as RGB, unresized: GLM's processor resizes them (:meth:`resized_size`).

        Raises:
            ValueError: ``use_qwen_vl_utils=True`` (a Qwen helper; GLM does not use it).
        """
        return open_unresized(images, use_qwen_vl_utils=use_qwen_vl_utils,
                              resized_by="GLM-4.1V/4.5V/4.6V images are resized by GLM's processor")

    def video_frame_size(self, frame_size: Sequence[float], num_frames: int) -> tuple[int, int]:
        """``(width, height)`` every frame of a ``num_frames``-frame clip of ``frame_size`` is resized to (the base
        class's :meth:`~VLMAdapter.load_videos` resizes with it; the processor then keeps that size): GLM's
        ``smart_resize`` on the clip (:func:`glm_resized_size` with the clip's frame count) within
        ``frames·[video_min_pixels, video_max_pixels]`` and under ``video_total_pixels`` (GLM's video processor bounds
        ``frames·height·width``; ``frames`` is the count rounded up to even, as its frame sampler pads it)."""
        temporal = self.temporal_patch_size
        frames = max(num_frames + (-num_frames) % temporal, temporal)
        upper = min(frames * self.video_max_pixels, self.video_total_pixels)
        # GLM's frame sampler makes every clip's count even (repeating the last frame) before its processor resizes
        # it with that count (video_processing_glm4v.py sample_frames, resize).
        return glm_resized_size(frame_size, factor=self.image_factor, min_pixels=frames * self.video_min_pixels,
                                max_pixels=upper, num_frames=frames, temporal_factor=temporal)

    def video_frame_max_pixels(self, num_frames: int) -> float:
        """The largest area a frame of a ``num_frames``-frame clip may keep (see :meth:`video_frame_size`)."""
        temporal = self.temporal_patch_size
        frames = max(num_frames + (-num_frames) % temporal, temporal)
        return min(self.video_max_pixels, self.video_total_pixels / frames)

    def encode(self, texts: Sequence[str], images: Sequence[Sequence[Any]],
               videos: Sequence[Sequence[Sequence[Any]]] | None = None,
               video_fps: Sequence[Sequence[float]] | None = None, *, video_entries: bool = False
               ) -> list[PromptInputs]:
        """The base class's encoding, refusing a batch that holds both images and videos (see the module
        docstring)."""
        self._refuse_mix(any(images), bool(videos) and any(videos))
        return super().encode(texts, images, videos, video_fps, video_entries=video_entries)

    def collate(self, prompts: Sequence[PromptInputs], completions: Sequence[Tensor] | None = None,
                device: torch.device | str | None = None) -> tuple[dict[str, Tensor], int]:
        """The base class's collation, refusing a batch that holds both images and videos."""
        self._refuse_mix(any(p.get("image_grid_thw") is not None and p["image_grid_thw"].numel() for p in prompts),
                         any(p.get("video_grid_thw") is not None and p["video_grid_thw"].numel() for p in prompts))
        return super().collate(prompts, completions, device)

    def _refuse_mix(self, has_images: bool, has_videos: bool) -> None:
        if has_images and has_videos:
            raise ValueError(f"{self.name}: a batch holds both images and videos, which transformers' GLM-V "
                             "forward cannot take (video tokens are image tokens); train image rows and video rows "
                             "in separate runs")


class Glm4vMoeAdapter(Glm4vAdapter):
    """GLM-4.5V (mixture of experts) through ``transformers.Glm4vMoeForConditionalGeneration``: GLM-4.1V's vision
    input with routed experts (sigmoid router with a correction bias, a shared expert; the first layers dense). LoRA
    targets the attention projections; the routed experts' fused weights (``experts.gate_up_proj``,
    ``experts.down_proj``) take ``lora.target_parameters``. The router's correction bias (``e_score_correction_bias``,
    a buffer) is not trained; ``plugin.router_aux_loss_coef`` adds transformers' load-balancing loss over the router
    logits (computed with a softmax, as for every transformers MoE)."""

    name = "glm4v_moe"
    model_types = ("glm4v_moe",)
    model_class = "Glm4vMoeForConditionalGeneration"
    # The attention only: peft 0.21 maps gate_proj/up_proj/down_proj targets of a glm4v_moe model onto the routed
    # experts' fused parameters (its transformers-v4 compatibility mapping), taking them off the dense layer and the
    # shared experts, which attach_lora refuses; the experts take lora.target_parameters. peft 0.22 leaves those
    # names on the dense and shared-expert MLPs (a user may add them there); the default stays the attention so that
    # the same config trains the same modules under either peft (tests/vlm/test_glm4v.py runs the installed one).
    lora_target_modules = ("q_proj", "k_proj", "v_proj", "o_proj")
    moe = True


def _size_value(size: Any, key: str, default: float) -> float:
    """``size[key]`` of a processor's ``size`` (a dict or transformers' ``SizeDict``), or ``default``."""
    if size is None:
        return default
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    return default if value is None else value


__all__ = ["GLM_VIDEO_MAX_PIXELS", "Glm4vAdapter", "Glm4vMoeAdapter", "glm_resized_size"]
