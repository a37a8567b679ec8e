"""The adapter interface between the VLM plugin and one family of transformers vision-language models.

The base class implements the Qwen-VL way of feeding images and videos, shared by Qwen2-VL, Qwen2.5-VL and
Qwen3-VL:

======================  ==========================================================================================
:meth:`load_images`     paths / PIL images → RGB images resized by smart_resize within [min_pixels, max_pixels]
                        (``qwen_vl_utils.process_vision_info`` when it imports, an equivalent built-in otherwise)
:meth:`load_videos`     videos given as their frames → RGB frames, every frame of a video resized to one
                        smart_resize size within [video_min_pixels, video_max_pixels]
:meth:`encode`          chat texts + images (+ videos) → one :data:`PromptInputs` per prompt, from one batched
                        processor call whose ``pixel_values`` (``pixel_values_videos``) rows are split per prompt by
                        ``image_grid_thw`` (``video_grid_thw``) (:func:`split_images`)
:meth:`image_features`  a frozen vision tower's output per prompt (images and videos), computed once and reused by
                        every pass
:meth:`collate`         prompts (+ completions) of any samples → model inputs: prompts left-padded, completions
                        right-padded, pixel rows concatenated in sample order, ``image_grid_thw`` stacked (and the
                        video counterparts)
:meth:`generate`        sampling over the collated prompts (the plugin's decode loop or HF generate), each
                        distinct prompt prefilled once for its samples
:meth:`completion_logits` logits of the positions that predict the completion tokens only (``logits_to_keep``)
:meth:`completion_hidden` the same positions' hidden states and the LM head, for the fused head
:meth:`vision_tower`    the vision encoder module, wherever this transformers version keeps it
======================  ==========================================================================================

Because every sample carries its own pixel rows and grid, G copies of a prompt are G references to the same
per-prompt tensors and a micro-batch of any composition collates correctly: the "flat repeat of pixel rows" bug of
batch sizes > 1 (R1-V#4) cannot happen.

A family adapter (one file) sets the class attributes and overrides what its model does differently.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

PromptInputs = dict[str, Tensor]
"""One prompt, unpadded: ``input_ids [P]``, ``mm_token_type_ids [P]`` (transformers 5.x), ``image_grid_thw
[images, 3]`` and either ``pixel_values [rows, D]`` (the patch rows of its images, in order) or ``image_embeds
[image tokens, hidden]`` (the frozen vision tower's output for them, see :meth:`VLMAdapter.image_features`).
Prompts encoded in a batch that holds a video also carry ``video_grid_thw [videos, 3]`` (``[0, 3]`` without one),
``pixel_values_videos [rows, D]`` or ``video_embeds [video tokens, hidden]``, and for Qwen2.5-VL
``second_per_grid_ts [videos]`` (seconds per temporal patch, which spaces the video's temporal M-RoPE positions).
With cached features, Qwen3-VL's prompts also carry ``image_deepstack`` / ``video_deepstack`` ``[layers, tokens,
hidden]`` (:data:`DEEPSTACK_KEYS`)."""

VISION_INPUTS = (("image", "pixel_values", "image_grid_thw", "image_embeds", "get_image_features"),
                 ("video", "pixel_values_videos", "video_grid_thw", "video_embeds", "get_video_features"))
"""Per modality: its ``mm_encoder_outputs`` key, a prompt's pixel-row, grid and cached-feature keys, and the model
method that turns pixel rows into features."""
DEEPSTACK_KEYS = {"image_embeds": "image_deepstack", "video_embeds": "video_deepstack"}
"""Per cached-feature key, the key of the prompt's cached deepstack features (Qwen3-VL: the vision tower's
intermediate features that its language model adds to the vision tokens' states in its first layers), ``[layers,
tokens, hidden]``."""

IMAGE_POSITIONS = ("before", "after")
VIDEO_SEQ_LEN_TOKENS = 128_000  # qwen-vl-utils 0.0.14 MODEL_SEQ_LEN: the default budget of a video's total pixels
"""Where a prompt's images sit in its user turn, relative to the question (:meth:`VLMAdapter.messages`)."""
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class VLMAdapter:
    """One family of vision-language models (see the module docstring).

    Args:
        model: A local folder or a hub id (``from_pretrained``).
        min_pixels: Lower bound on each image's resized area.
        max_pixels: Upper bound on each image's resized area.
    """

    #: Registry name (``plugin.family``).
    name: ClassVar[str]
    #: ``config.json`` ``model_type`` values this adapter handles (``family: auto``).
    model_types: ClassVar[tuple[str, ...]]
    #: The transformers class, looked up on the ``transformers`` package.
    model_class: ClassVar[str]
    #: The coordinate convention of the boxes this family writes (a :data:`mmrl.rewards.boxes.CONVENTIONS` name).
    box_convention: ClassVar[str]
    #: Default LoRA target module names (suffix match), all in the language model.
    lora_target_modules: ClassVar[tuple[str, ...]] = DEFAULT_LORA_TARGETS
    #: Attribute paths of the vision tower, tried in order (transformers moved it from ``visual`` to
    #: ``model.visual`` in 4.52).
    vision_attributes: ClassVar[tuple[str, ...]] = ("model.visual", "visual")
    #: Module names matching this regular expression belong to the vision tower (excluded from LoRA by default).
    vision_module_pattern: ClassVar[str] = r".*(^|\.)visual(\.|$).*"
    #: Whether the model takes precomputed image features (transformers' ``mm_encoder_outputs``) as the only output
    #: of its vision tower, so that a frozen tower can run once per prompt (:meth:`image_features`).
    supports_feature_cache: ClassVar[bool] = True
    #: Whether :meth:`generate` may prefill each distinct prompt once and copy its KV cache (and M-RoPE offsets,
    #: ``model.model.rope_deltas``) to the prompt's samples.
    supports_shared_prefill: ClassVar[bool] = True
    #: Whether a KV cache built with gradients carries them into a pass that continues it (the shared prompt forward,
    #: :mod:`mmrl.plugins.vlm.prefix`): true for attention caches, which the continuation only reads; false where the
    #: continuation updates cached states in place (Qwen3.5's Gated DeltaNet conv and recurrent states), which
    #: autograd refuses: the training pass then runs the plain per-sample pass (its no-grad passes still share).
    cache_keeps_gradients: ClassVar[bool] = True
    #: Whether one forward may hold images and videos (several prompts, or one prompt with both); the plugin refuses
    #: a dataset split that mixes image and video rows for a family that cannot (GLM-4.1V/4.5V).
    batches_images_with_videos: ClassVar[bool] = True
    #: Whether the family takes videos. A family that cannot (InternVL, whose processor writes a video as frames of
    #: image tokens the plugin's video bookkeeping does not describe) is refused a dataset with video rows when the
    #: plugin starts, and its :meth:`encode` refuses videos.
    supports_videos: ClassVar[bool] = True
    #: Why a family without videos cannot take them (the end of :meth:`refuse_videos`' message).
    video_refusal: ClassVar[str] = ""
    #: Whether the language model's rotary positions are M-RoPE (``[3, n, L]`` position ids from the model's own
    #: ``get_rope_index``, which the model also computes itself when none are passed) or plain 1-D text positions
    #: (``[n, L]``, InternVL's Qwen2/Qwen3 language model), which a left-padded call must be given explicitly.
    mrope: ClassVar[bool] = True
    #: Whether the language model has routed mixture-of-experts layers whose forward can return router outputs
    #: (``output_router_logits=True``) from which :meth:`router_load_balancing_loss` computes the load-balancing loss
    #: (plugin.router_aux_loss_coef). A family with dense and MoE checkpoints (Gemma 4) sets it per checkpoint.
    moe: bool = False
    #: The pixel bounds (``"min_pixels"``, ``"max_pixels"``) the family's processor cannot honour (Gemma 3 resizes
    #: every image to its tower's square; Mistral 3 never enlarges one): the plugin refuses a non-default value of
    #: each at start-up, with :meth:`pixel_bounds_refusal` saying why, instead of ignoring it.
    unused_pixel_bounds: ClassVar[tuple[str, ...]] = ()
    #: Vision placeholder and delimiter tokens (see :meth:`suppressed_token_ids`).
    vision_tokens: ClassVar[tuple[str, ...]] = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                "<|vision_end|>", "<|vision_pad|>")

    def __init__(self, model: str, *, min_pixels: int, max_pixels: int, video_min_pixels: int | None = None,
                 video_max_pixels: int | None = None, video_total_pixels: float | None = None):
        if min_pixels > max_pixels:
            raise ValueError(f"min_pixels ({min_pixels}) must not exceed max_pixels ({max_pixels})")
        self.model_path = str(model)
        self.min_pixels, self.max_pixels = int(min_pixels), int(max_pixels)
        self.video_min_pixels = int(video_min_pixels if video_min_pixels is not None else min_pixels)
        self.video_max_pixels = int(video_max_pixels if video_max_pixels is not None else max_pixels)
        if self.video_min_pixels > self.video_max_pixels:
            raise ValueError(f"video_min_pixels ({self.video_min_pixels}) must not exceed video_max_pixels "
                             f"({self.video_max_pixels})")
        if video_total_pixels is not None and not video_total_pixels > 0:
            raise ValueError(f"video_total_pixels must be positive, got {video_total_pixels}")
        self.processor = self.load_processor()
        self.tokenizer = self.processor.tokenizer
        self.patch_size, self.merge_size = self.patch_geometry()
        # qwen-vl-utils 0.0.14 fetch_video: total_pixels = MODEL_SEQ_LEN (128,000) × image_factor² × 0.9 by default.
        self.video_total_pixels = float(video_total_pixels if video_total_pixels is not None
                                        else VIDEO_SEQ_LEN_TOKENS * self.image_factor ** 2 * 0.9)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.tokenizer.eos_token_id)

    #: Whether the model reads cached features from ``mm_encoder_outputs["image"].pooler_output`` as a tuple of
    #: tensors it concatenates (Gemma 4, Mistral 3) rather than as one tensor (Gemma 3, InternVL):
    #: :meth:`put_cached_image_features`.
    pooled_features_as_tuple: ClassVar[bool] = False

    def put_cached_image_features(self, prompts: Sequence[PromptInputs], inputs: dict[str, Any]) -> bool:
        """For families that take the frozen tower's features through ``mm_encoder_outputs`` (Gemma 3 and 4,
        InternVL, Mistral 3): when the prompts carry cached ``image_embeds``, put their concatenation,
        ``[Σ image tokens, hidden]`` in the prompts' order (the order in which the model scatters features into image
        tokens), into ``inputs`` and return True; return False when they carry pixels.

        Raises:
            ValueError: a batch that mixes prompts with cached features and prompts with pixels.
        """
        cached = [p for p in prompts if "image_embeds" in p]
        if cached and len(cached) != len(prompts):
            raise ValueError(f"{self.name}: a batch mixes prompts with cached image features and prompts with pixels; "
                             "encode every prompt of a pass the same way")
        if not cached:
            return False
        device = inputs["input_ids"].device
        embeds = [p["image_embeds"].to(device) for p in cached if p["image_embeds"].numel()]
        if embeds:
            from transformers.modeling_outputs import BaseModelOutputWithPooling

            pooled = torch.cat(embeds)  # [Σ image tokens, hidden]
            inputs["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(
                pooler_output=(pooled,) if self.pooled_features_as_tuple else pooled)}
        return True

    def patch_geometry(self) -> tuple[int, int]:
        """The vision tower's patch side and the merger's side in patches, read once the processor is loaded: the
        image processor's ``patch_size`` and ``merge_size`` (Qwen's; 14 and 2 where it has none)."""
        image_processor = self.processor.image_processor
        return int(getattr(image_processor, "patch_size", 14)), int(getattr(image_processor, "merge_size", 2))

    @property
    def uses_video_seconds(self) -> bool:
        """Whether the family's processor writes ``second_per_grid_ts`` for videos (Qwen2.5-VL), read from its
        ``model_input_names`` (see :meth:`encode`'s ``video_entries``)."""
        return "second_per_grid_ts" in getattr(self.processor, "model_input_names", ())

    # ------------------------------------------------------------------ loading
    def pixel_bounds_refusal(self) -> str:
        """Why :attr:`unused_pixel_bounds` cannot be honoured (the end of the plugin's one-line refusal). A family
        that declares unused bounds overrides it."""
        raise NotImplementedError(f"the {self.name} adapter declares unused_pixel_bounds "
                                  f"{self.unused_pixel_bounds} but no pixel_bounds_refusal saying why")

    def image_sizes(self, input_ids: Tensor) -> Tensor | None:
        """``[images, 2]`` (height, width) in pixels of each image of a prompt as the processor resized it, read from
        the prompt's ids, for a family whose prompts state their images' sizes in their tokens and have no
        ``image_grid_thw`` (Mistral 3's rows of ``[IMG]``, SmolVLM's tile markers); the plugin checks them against the
        row's ``resized_size``. None (the default): the ids do not say."""
        return None

    @classmethod
    def transformers_class(cls) -> type[nn.Module]:
        """The model class; a clear error when the installed transformers lacks it."""
        import transformers

        model_class = getattr(transformers, cls.model_class, None)
        if model_class is None:
            raise ImportError(f"vlm family {cls.name!r} needs transformers.{cls.model_class}, which transformers "
                              f"{transformers.__version__} does not have; upgrade transformers")
        return model_class

    def load_model(self, *, dtype: torch.dtype, attn_implementation: str) -> nn.Module:
        """The model through ``from_pretrained`` (weights in ``dtype``), without transformers' hub kernels.

        transformers 5.24 (with the ``kernels`` package it requires; 5.18 did not by default) swaps layers such as
        RMSNorm, the rotary embedding and the activations for kernels fetched from the Hub, and picks them by the
        model's mode: some (SiLU, GELU on CUDA) only in eval mode. mmrl samples in eval mode and trains in train
        mode, so the rollout and the training forward would run different kernels (a ratio off 1 on-policy by their
        rounding) and every train/eval switch would re-kernelize the model. ``use_kernels=False`` keeps the plain
        torch layers in sampling, scoring and training alike, the path the plugin's tests check. (transformers
        5.24.0: ``integrations/hub_kernels.py`` maps the activations for ``Mode.INFERENCE`` only, and
        ``PreTrainedModel.train`` sets a new ``kernels_mode`` on every switch.)"""
        return self.transformers_class().from_pretrained(
            self.model_path, dtype=dtype, attn_implementation=attn_implementation, use_kernels=False
        )

    def checkpoint_text_config(self) -> Any:
        """The checkpoint's language-model config (``AutoConfig`` of :attr:`model_path`, ``get_text_config()``), for
        families whose one ``model_type`` covers dense and MoE checkpoints (Gemma 4, InternVL3.5)."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.model_path).get_text_config()

    def load_processor(self) -> Any:
        """``AutoProcessor.from_pretrained`` with the image bounds set to [min_pixels, max_pixels]."""
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(self.model_path)
        image_processor = processor.image_processor
        image_processor.size = {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}
        for key, value in (("min_pixels", self.min_pixels), ("max_pixels", self.max_pixels)):
            if hasattr(image_processor, key):  # transformers 4.x reads these attributes
                setattr(image_processor, key, value)
        return processor

    # ------------------------------------------------------------------ images
    @property
    def image_factor(self) -> int:
        """Resized image sides are multiples of this (patch size × spatial merge)."""
        return self.patch_size * self.merge_size

    def resized_size(self, image_size: Sequence[float]) -> tuple[int, int]:
        """``(width, height)`` the processor resizes an image of ``image_size`` ``(width, height)`` to."""
        from mmrl.rewards.boxes import qwen_resized_size

        return qwen_resized_size(image_size, factor=self.image_factor, min_pixels=self.min_pixels,
                                 max_pixels=self.max_pixels)

    def load_images(self, images: Sequence[Any], *, use_qwen_vl_utils: bool | None = None) -> list[Any]:
        """Open (paths) and resize (smart_resize within the pixel bounds) the images of one prompt.

        Args:
            images: Paths (``str`` / ``Path``, ``file://`` URLs) or PIL images.
            use_qwen_vl_utils: Route through ``qwen_vl_utils.process_vision_info`` (True), the built-in equivalent
                (False), or the former when it imports (None). Both give the same images.
        """
        if not images:
            return []
        if use_qwen_vl_utils is None:
            use_qwen_vl_utils = _qwen_vl_utils() is not None
        if use_qwen_vl_utils:
            process_vision_info = _qwen_vl_utils()
            if process_vision_info is None:
                raise ImportError("qwen_vl_utils is not importable (it also needs torchvision); pip install "
                                  "qwen-vl-utils or let the plugin use its built-in loader")
            content = [{"type": "image", "image": _image_reference(image), "min_pixels": self.min_pixels,
                        "max_pixels": self.max_pixels} for image in images]
            loaded, _ = process_vision_info([{"role": "user", "content": content}], image_patch_size=self.patch_size)
            return list(loaded)
        return [self._load_image(image) for image in images]

    def _load_image(self, image: Any) -> Any:
        from PIL import Image

        opened = image if isinstance(image, Image.Image) else Image.open(_local_path(image))
        rgb = _to_rgb(opened)
        width, height = self.resized_size(rgb.size)
        return rgb.resize((width, height), resample=Image.Resampling.BICUBIC)

    def refuse_videos(self, has_videos: bool) -> None:
        """A family without videos (:attr:`supports_videos` false) refuses them in one line naming why."""
        if has_videos and not self.supports_videos:
            raise ValueError(f"{self.name}: videos are not supported for this family ({self.video_refusal}); give "
                             "image rows only")

    def load_videos(self, videos: Sequence[Sequence[Any]]) -> list[list[Any]]:
        """Open and resize the frames of each video of one prompt (a family without videos refuses any, and an empty
        list gives an empty list).

        A video is given as its frames (paths or PIL images, in time order, already sampled at the rate the row
        declares). Every frame of a video is resized to the one size :meth:`video_frame_size` gives its first frame
        (smart_resize within [video_min_pixels, :meth:`video_frame_max_pixels`], a multiple of patch size × merge in
        each side: qwen-vl-utils resizes a video's frames to one size the same way); the processor then keeps that
        size.

        Raises:
            ValueError: a video without frames, or frames of different sizes within one video.
        """
        from PIL import Image

        self.refuse_videos(bool(videos))
        loaded = []
        for number, frames in enumerate(videos):
            if not frames:
                raise ValueError(f"video {number} of the prompt has no frames; give a video as a list of its frames")
            opened = [_to_rgb(frame if isinstance(frame, Image.Image) else Image.open(_local_path(frame)))
                      for frame in frames]
            sizes = {frame.size for frame in opened}
            if len(sizes) > 1:
                raise ValueError(f"video {number} of the prompt has frames of different sizes {sorted(sizes)}; "
                                 "every frame of a video must have one size")
            width, height = self.video_frame_size(opened[0].size, len(opened))
            loaded.append([frame.resize((width, height), resample=Image.Resampling.BICUBIC) for frame in opened])
        return loaded

    def video_frame_size(self, frame_size: Sequence[float], num_frames: int) -> tuple[int, int]:
        """``(width, height)`` every frame of a ``num_frames``-frame video of ``frame_size`` is resized to: smart_resize
        within [video_min_pixels, :meth:`video_frame_max_pixels`]."""
        from mmrl.rewards.boxes import qwen_resized_size

        return qwen_resized_size(frame_size, factor=self.image_factor, min_pixels=self.video_min_pixels,
                                 max_pixels=self.video_frame_max_pixels(num_frames))

    def video_frame_max_pixels(self, num_frames: int) -> float:
        """The largest area a frame of a ``num_frames``-frame video may keep: ``video_max_pixels``, lowered so that
        all the frames together hold about ``video_total_pixels`` (two frames make one temporal patch), never below
        1.05 × ``video_min_pixels``. qwen-vl-utils 0.0.14 ``fetch_video``: ``max(min(VIDEO_FRAME_MAX_PIXELS,
        total_pixels / nframes × FRAME_FACTOR), int(min_pixels × 1.05))`` with ``nframes`` the frame count rounded
        up to even (it repeats the last frame of an odd count)."""
        frames = num_frames + num_frames % 2
        return max(min(self.video_max_pixels, self.video_total_pixels / frames * 2),
                   int(self.video_min_pixels * 1.05))

    # ------------------------------------------------------------------ prompts
    def messages(self, question: str, num_images: int, system_prompt: str | None = None, *,
                 image_position: str = "before", num_videos: int = 0) -> list[dict[str, Any]]:
        """The chat of one prompt: an optional system message, then the user turn.

        Args:
            question: The user text.
            num_images: How many image parts the user turn holds.
            system_prompt: An optional system message.
            image_position: ``"before"`` (the images and videos, then the question: Qwen's documented order, R1-V,
                VLM-R1, Video-R1) or ``"after"`` (the question, then the images and videos). Under causal attention
                only the second lets the vision tokens attend to the question.
            num_videos: How many video parts follow the image parts.
        """
        if image_position not in IMAGE_POSITIONS:
            raise ValueError(f"image_position must be one of {', '.join(IMAGE_POSITIONS)}, got {image_position!r}")
        images: list[dict[str, Any]] = [{"type": "image"} for _ in range(num_images)]
        images += [{"type": "video"} for _ in range(num_videos)]
        text = [{"type": "text", "text": question}]
        content = images + text if image_position == "before" else text + images
        chat: list[dict[str, Any]] = []
        if system_prompt:
            chat.append({"role": "system", "content": [{"type": "text", "text": system_prompt}]})
        chat.append({"role": "user", "content": content})
        return chat

    def chat_text(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> str:
        """The prompt text: the processor's chat template with the assistant turn opened; ``template_kwargs`` (the
        plugin's ``chat_template_kwargs``, e.g. ``enable_thinking``) reach the template."""
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **template_kwargs)

    def adds_special_tokens(self, texts: Sequence[str]) -> bool:
        """The processor's ``add_special_tokens`` for rendered chats (:meth:`chat_text`): false when they start with the
        tokenizer's BOS, which the chat template then wrote (Gemma's ``<bos>``) and which a tokenizer that adds BOS to
        every text it encodes (Gemma 3's released tokenizer, ``add_bos_token: true``) would write a second time.

        transformers' own rule: ``ProcessorMixin.apply_chat_template(..., tokenize=True)`` tokenizes a rendered prompt
        that starts with the BOS token with ``add_special_tokens=False`` (transformers 5.25 ``processing_utils.py``
        lines 2515-2517), so every family's :meth:`encode` gives the prompt ids transformers builds from the same
        messages, whether or not the checkpoint's tokenizer adds BOS. transformers looks at a batch's first prompt
        only; the adapter asks all of them to agree.

        Raises:
            ValueError: some texts start with the BOS token and others do not.
        """
        bos = self.tokenizer.bos_token
        if bos is None:
            return True
        written = [text.startswith(bos) for text in texts]
        if any(written) and not all(written):
            raise ValueError(f"{self.name}: {sum(written)} of {len(written)} prompts start with the BOS token {bos!r} "
                             "and the others do not; render every prompt of a batch with the same chat template")
        return not any(written)

    def encode(self, texts: Sequence[str], images: Sequence[Sequence[Any]],
               videos: Sequence[Sequence[Sequence[Any]]] | None = None,
               video_fps: Sequence[Sequence[float]] | None = None, *, video_entries: bool = False
               ) -> list[PromptInputs]:
        """Run the processor once on a batch of prompts and split its output per prompt.

        Args:
            texts: Chat texts (:meth:`chat_text`), one per prompt.
            images: The loaded images of each prompt (:meth:`load_images`), in the order they appear in its text.
            videos: The loaded videos of each prompt (:meth:`load_videos`: each a list of frames), in the order
                they appear in its text (after its images), or None.
            video_fps: Per prompt, the frame rate of each of its videos' frames (frames per second of the video's
                time): Qwen2.5-VL spaces a video's temporal M-RoPE positions by it (``second_per_grid_ts``) and
                Qwen3-VL writes each frame's timestamp from it. Required with ``videos``.
            video_entries: Give every prompt the video entries even when none of the batch has a video (empty
                tensors): in a dataset that mixes video and image rows, every rollout's replay then has the same
                keys, whichever rows it drew.

        Returns:
            One :data:`PromptInputs` per prompt (unpadded token ids and that prompt's own pixel rows and grids).
        """
        if len(texts) != len(images):
            raise ValueError(f"encode: {len(texts)} texts but {len(images)} image lists")
        videos = [[] for _ in texts] if videos is None else videos
        video_fps = [[] for _ in texts] if video_fps is None else video_fps
        if len(videos) != len(texts) or len(video_fps) != len(texts):
            raise ValueError(f"encode: {len(texts)} texts but {len(videos)} video lists and {len(video_fps)} fps lists")
        flat = [image for group in images for image in group]
        clips = [clip for group in videos for clip in group]
        rates = [float(rate) for group in video_fps for rate in group]
        if len(rates) != len(clips):
            raise ValueError(f"encode: {len(clips)} videos but {len(rates)} frame rates")
        extra: dict[str, Any] = {}
        if clips:
            # The frames are the sampled frames, already resized (load_videos): no resampling, no resizing.
            extra = dict(videos=clips, do_sample_frames=False, do_resize=False,
                         video_metadata=[{"fps": rate, "total_num_frames": len(clip),
                                          "frames_indices": list(range(len(clip)))}
                                         for clip, rate in zip(clips, rates, strict=True)])
        batch = self.processor(text=list(texts), images=flat or None, padding=True, padding_side="left",
                               return_tensors="pt", add_special_tokens=self.adds_special_tokens(texts), **extra)
        attention = batch["attention_mask"].bool()  # [B, P]
        counts = [len(group) for group in images]
        if flat:
            vision = split_images(batch["pixel_values"], batch["image_grid_thw"], counts)
        else:
            vision = [(torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long)) for _ in counts]
        video_counts = [len(group) for group in videos]
        per_video = (split_images(batch["pixel_values_videos"], batch["video_grid_thw"], video_counts) if clips
                     else None)
        seconds = batch.get("second_per_grid_ts") if clips else None
        if seconds is not None:
            seconds = torch.as_tensor(seconds, dtype=torch.float32).reshape(-1)  # [videos]
        if per_video is None and video_entries:
            per_video = [(torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long)) for _ in video_counts]
            if self.uses_video_seconds:
                seconds = torch.zeros(0)
        prompts = []
        start = 0
        for i, (pixels, grid) in enumerate(vision):
            keep = attention[i]
            prompt: PromptInputs = {"input_ids": batch["input_ids"][i][keep]}
            if "mm_token_type_ids" in batch:
                prompt["mm_token_type_ids"] = batch["mm_token_type_ids"][i][keep]
            prompt["pixel_values"] = pixels
            prompt["image_grid_thw"] = grid
            if per_video is not None:
                prompt["pixel_values_videos"], prompt["video_grid_thw"] = per_video[i]
                if seconds is not None:
                    prompt["second_per_grid_ts"] = seconds[start:start + video_counts[i]]
                start += video_counts[i]
            prompts.append(prompt)
        return prompts

    def image_features(self, model: nn.Module, prompts: Sequence[PromptInputs]) -> list[PromptInputs]:
        """The prompts with ``pixel_values`` replaced by ``image_embeds`` (and ``pixel_values_videos`` by
        ``video_embeds``), the vision tower's output (one batched call per modality; no gradients). Valid for every
        pass of a step while the tower is frozen: the same features then feed generation, the old and reference
        log-probs and the training forward, so the tower runs once per prompt rather than once per sample and
        pass. A tower that also returns deepstack features (Qwen3-VL) has them kept per prompt too
        (``image_deepstack`` / ``video_deepstack``, ``[layers, tokens, hidden]``), and :meth:`collate` hands them
        back with the pooled features."""
        result = [dict(prompt) for prompt in prompts]
        hf_model = _base_model(model)
        device = next(hf_model.parameters()).device
        for _, pixels_key, grid_key, embeds_key, method in VISION_INPUTS:
            if not any(grid_key in prompt for prompt in prompts):
                continue
            holding = [p for p in prompts if p[grid_key].numel()]
            per_item: list[Tensor] = []
            deepstack: list[list[Tensor]] | None = None  # per layer, one [tokens_k, hidden] per image / video
            if holding:
                pixels = torch.cat([p[pixels_key] for p in holding]).to(device)  # [Σ rows, D]
                grids = torch.cat([p[grid_key] for p in holding]).to(device)  # [Σ items, 3]
                with torch.no_grad():
                    output = getattr(hf_model, method)(pixels, grids, return_dict=True)
                per_item = list(output.pooler_output)  # one [tokens_k, hidden] per image / video
                if getattr(output, "deepstack_features", None) is not None:
                    deepstack = [list(layer) for layer in output.deepstack_features]
            for prompt, updated in zip(prompts, result, strict=True):
                updated.pop(pixels_key, None)
                count = int(prompt[grid_key].shape[0])
                taken, per_item = per_item[:count], per_item[count:]
                updated[embeds_key] = torch.cat(taken) if taken else torch.zeros(0, 0)
                if deepstack is not None:
                    layers = [torch.cat(layer[:count]) if count else torch.zeros(0, 0) for layer in deepstack]
                    deepstack = [layer[count:] for layer in deepstack]
                    updated[DEEPSTACK_KEYS[embeds_key]] = torch.stack(layers)  # [layers, tokens, hidden]
        return result

    # ------------------------------------------------------------------ batching
    def collate(self, prompts: Sequence[PromptInputs], completions: Sequence[Tensor] | None = None,
                device: torch.device | str | None = None) -> tuple[dict[str, Tensor], int]:
        """Model inputs for samples given as per-sample prompts and (optionally) completion token ids.

        Prompts are left-padded to the longest prompt P and completions right-padded to the longest completion C,
        so ``input_ids[:, P:]`` are the completion tokens of every sample. Pixel rows are concatenated in sample
        order and grids stacked, which is the order the model assigns image features to image tokens.

        Returns:
            ``(inputs, P)``: ``inputs`` holds ``input_ids [n, P + C]``, ``attention_mask``, ``mm_token_type_ids``
            (when the prompts carry it; 0 over completions) and, when any sample has an image, ``image_grid_thw``
            with ``pixel_values`` or, for prompts carrying ``image_embeds``, transformers' ``mm_encoder_outputs``;
            when any sample has a video, ``video_grid_thw`` (and ``second_per_grid_ts`` where the prompts carry it)
            with ``pixel_values_videos`` or the ``"video"`` entry of ``mm_encoder_outputs``.
        """
        if not prompts:
            raise ValueError("collate needs at least one sample")
        if completions is not None and len(completions) != len(prompts):
            raise ValueError(f"collate: {len(prompts)} prompts but {len(completions)} completions")
        device = torch.device(device) if device is not None else prompts[0]["input_ids"].device
        pad = nn.utils.rnn.pad_sequence
        ids = [p["input_ids"].to(device) for p in prompts]
        ones = [torch.ones_like(t) for t in ids]
        input_ids = pad(ids, batch_first=True, padding_value=self.pad_token_id, padding_side="left")  # [n, P]
        attention = pad(ones, batch_first=True, padding_value=0, padding_side="left")  # [n, P]
        width = int(input_ids.shape[1])
        has_types = all("mm_token_type_ids" in p for p in prompts)
        token_types = None
        if has_types:
            token_types = pad([p["mm_token_type_ids"].to(device) for p in prompts], batch_first=True,
                              padding_value=0, padding_side="left")  # [n, P]
        if completions is not None:
            tokens = [c.to(device=device, dtype=input_ids.dtype) for c in completions]
            completion_ids = pad(tokens, batch_first=True, padding_value=self.pad_token_id)  # [n, C]
            completion_mask = pad([torch.ones_like(t) for t in tokens], batch_first=True, padding_value=0)
            input_ids = torch.cat([input_ids, completion_ids], dim=1)
            attention = torch.cat([attention, completion_mask.to(attention.dtype)], dim=1)
            if token_types is not None:
                token_types = torch.cat([token_types, torch.zeros_like(completion_ids, dtype=token_types.dtype)],
                                        dim=1)
        inputs: dict[str, Tensor] = {"input_ids": input_ids, "attention_mask": attention}
        if token_types is not None:
            inputs["mm_token_type_ids"] = token_types
        encoder_outputs: dict[str, Any] = {}
        for modality, pixels_key, grid_key, embeds_key, _ in VISION_INPUTS:
            holding = [p for p in prompts if grid_key in p and p[grid_key].numel()]
            if not holding:
                continue
            inputs[grid_key] = torch.cat([p[grid_key].to(device) for p in holding])  # [Σ items, 3]
            if modality == "video" and all("second_per_grid_ts" in p for p in holding):
                inputs["second_per_grid_ts"] = torch.cat([p["second_per_grid_ts"].to(device) for p in holding])
            if all(embeds_key in p for p in holding):
                embeds = torch.cat([p[embeds_key].to(device) for p in holding])  # [Σ vision tokens, hidden]
                deepstack_key = DEEPSTACK_KEYS[embeds_key]
                if all(deepstack_key in p for p in holding):
                    # Qwen3-VL's own output class (transformers 5.25 modeling_qwen3_vl), as get_image_features returns
                    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

                    stacked = torch.cat([p[deepstack_key].to(device) for p in holding], dim=1)  # [layers, Σ, hidden]
                    encoder_outputs[modality] = BaseModelOutputWithDeepstackFeatures(
                        pooler_output=(embeds,), deepstack_features=[(layer,) for layer in stacked])
                else:
                    from transformers.modeling_outputs import BaseModelOutputWithPooling

                    encoder_outputs[modality] = BaseModelOutputWithPooling(pooler_output=(embeds,))
            else:
                inputs[pixels_key] = torch.cat([p[pixels_key].to(device) for p in holding])  # [Σ rows, D]
        if encoder_outputs:
            inputs["mm_encoder_outputs"] = encoder_outputs
        return inputs, width

    def generate(self, model: nn.Module, prompts: Sequence[PromptInputs], generation_config: Any, *,
                 share_prefill: bool = True, device: torch.device | str | None = None, decoder: str = "mmrl",
                 output_scores: bool = False) -> tuple[Any, int]:
        """Sample completions of the collated prompts: ``(sequences [n, P + C'], P)``.

        Samples that share a prompt (the same :data:`PromptInputs` object, as the G copies of a group do) share its
        prefill: with ``share_prefill`` each distinct prompt runs through the model once and its KV cache (and
        M-RoPE offsets) are copied to its samples, so the prompt (image tokens included) is computed once per group
        instead of G times. The sampling distribution is the same up to float rounding; log-probs are recomputed by
        teacher forcing anyway.

        Args:
            model: The model (possibly inside a peft wrapper).
            prompts: One :data:`PromptInputs` per sample.
            generation_config: The ``GenerationConfig`` to sample under (the plugin's
                :meth:`~mmrl.plugins.vlm.plugin.VLMPlugin.generation_config`).
            share_prefill: Prefill each distinct prompt once (see above).
            device: Where to collate (default: the prompts' device).
            decoder: ``"mmrl"``, the plugin's own loop (:func:`mmrl.plugins.vlm.decode.decode`), or ``"hf"``,
                transformers' ``model.generate`` (which returns whatever ``generation_config`` asks for, e.g. a
                ``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate``).
            output_scores: ``"mmrl"`` only: return ``(DecodeOutput, P)`` (its tokens and per-step scores) instead.
        """
        from mmrl.plugins.vlm.decode import check_decoder

        if check_decoder(decoder) == "mmrl":
            return self._decode(model, prompts, generation_config, share_prefill=share_prefill, device=device,
                                output_scores=output_scores)
        inputs, width = self.collate(prompts, device=device)
        if "video_grid_thw" in inputs and "mm_token_type_ids" in inputs:
            rope = self.rope_positions(model, inputs)  # [3, n, P]
            largest = rope.masked_fill(inputs["attention_mask"].unsqueeze(0) == 0, -1).amax(dim=(0, 2))  # [n]
            if bool((largest != rope[:, :, -1].amax(dim=0)).any()):
                raise ValueError("plugin.decoder 'hf': a prompt's video holds M-RoPE positions past its last token, "
                                 "where transformers' generate continues (rope_deltas) but the teacher-forced pass "
                                 "does not (mmrl.plugins.vlm.decode); use decoder 'mmrl'")
        positions: dict[int, int] = {}
        for prompt in prompts:
            positions.setdefault(id(prompt), len(positions))
        unique = list({id(p): p for p in prompts}.values())
        text_last = "mm_token_type_ids" not in inputs or not bool(inputs["mm_token_type_ids"][:, -1].any())
        if not (share_prefill and self.supports_shared_prefill and len(unique) < len(prompts) and text_last):
            return model.generate(**inputs, generation_config=generation_config), width
        hf_model = _base_model(model)
        unique_inputs, _ = self.collate(unique, device=inputs["input_ids"].device)
        per_token = ("input_ids", "attention_mask", "mm_token_type_ids")
        prefix = {key: value[:, :-1] if key in per_token else value for key, value in unique_inputs.items()}
        # M-RoPE families compute their positions (and rope_deltas, which generate continues) from the inputs;
        # plain-RoPE families get them from the padding mask, as generate computes them for the rest.
        prefill_positions = {} if self.mrope else {"position_ids": self.rope_positions(model, prefix)}  # [u, P - 1]
        output = model(**prefix, **prefill_positions, use_cache=True, logits_to_keep=1)  # only the cache is used
        cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
        index = torch.tensor([positions[id(p)] for p in prompts], device=inputs["input_ids"].device)  # [n]
        select_cache_rows(cache, index)
        backbone = getattr(hf_model, "model", None)
        if getattr(backbone, "rope_deltas", None) is not None:
            backbone.rope_deltas = backbone.rope_deltas[index]
        name = cache_argument(hf_model)
        rest = {key: value for key, value in inputs.items()  # the vision inputs are in the cache already
                if key not in ("pixel_values", "image_position_ids", "pixel_values_videos", "mm_encoder_outputs")}
        return model.generate(**rest, **{name: cache}, generation_config=generation_config), width

    def _decode(self, model: nn.Module, prompts: Sequence[PromptInputs], generation_config: Any, *,
                share_prefill: bool, device: torch.device | str | None, output_scores: bool) -> tuple[Any, int]:
        """:meth:`generate` through :func:`mmrl.plugins.vlm.decode.decode`: the distinct prompts (or every sample's
        prompt) collated and prefilled with their M-RoPE positions, then the plugin's decode loop."""
        from mmrl.plugins.vlm.decode import SamplingSettings, decode

        settings = SamplingSettings.from_generation_config(generation_config)
        index: list[int] = []
        slots: dict[int, int] = {}
        for prompt in prompts:
            index.append(slots.setdefault(id(prompt), len(slots)))
        unique = list({id(p): p for p in prompts}.values())
        shared = share_prefill and self.supports_shared_prefill and len(unique) < len(prompts)
        inputs, width = self.collate(unique if shared else prompts, device=device)
        if ("image_grid_thw" in inputs or "video_grid_thw" in inputs) and "mm_token_type_ids" not in inputs:
            raise ValueError("plugin.decoder 'mmrl' needs the processor's mm_token_type_ids to place vision tokens "
                             "(transformers >= 5); use decoder 'hf'")
        select = torch.tensor(index, device=inputs["input_ids"].device) if shared else None  # [n]
        output = decode(model, inputs, self.rope_positions(model, inputs), settings, select=select,
                        output_scores=output_scores)
        if output_scores:
            return output, width
        prompt_ids = inputs["input_ids"] if select is None else inputs["input_ids"][select]  # [n, P]
        return torch.cat([prompt_ids, output.tokens], dim=1), width

    def completion_logits(self, model: nn.Module, inputs: dict[str, Tensor], num_completion: int) -> Tensor:
        """Logits ``[n, C, V]`` of the positions that predict the last ``num_completion`` tokens of ``inputs``.

        Only the last C + 1 hidden states go through the LM head (``logits_to_keep``); the last one predicts past
        the sequence and is dropped.
        """
        if num_completion < 1:
            raise ValueError("completion_logits needs at least one completion token")
        output = model(**self._positioned(inputs), logits_to_keep=num_completion + 1, use_cache=False)
        logits = output.logits  # [n, C + 1, V]
        if logits.shape[1] != num_completion + 1:  # a model that ignores logits_to_keep returns every position
            logits = logits[:, -(num_completion + 1):]
        return logits[:, :-1]

    def completion_hidden(self, model: nn.Module, inputs: dict[str, Tensor], num_completion: int
                          ) -> tuple[Tensor, nn.Module]:
        """Final hidden states ``[n, C, H]`` of the positions that predict the last ``num_completion`` tokens, and
        the LM head module, for :func:`~mmrl.plugins.vlm.logprobs.fused_head_log_softmax`.

        The call goes through ``model`` itself (so DDP sees it) with the LM head swapped for an identity for its
        duration: the model's "logits" are then its hidden states, and no ``[n, C, V]`` tensor is built.
        """
        if num_completion < 1:
            raise ValueError("completion_hidden needs at least one completion token")
        with identity_head(model) as head:
            output = model(**self._positioned(inputs), logits_to_keep=num_completion + 1, use_cache=False)
        hidden = output.logits  # [n, C + 1, H]: the identity head returned the hidden states
        if hidden.shape[1] != num_completion + 1:
            hidden = hidden[:, -(num_completion + 1):]
        check_head(head, hidden.shape[-1])
        return hidden[:, :-1], head

    def _positioned(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """``inputs`` for a teacher-forced call: a plain-RoPE family (:attr:`mrope` false) gets explicit position ids
        from the padding mask, which its language model would otherwise number from the first (padding) column, so
        that each left-padded row sees the positions it has alone; M-RoPE families compute theirs from the inputs."""
        if self.mrope or "position_ids" in inputs:
            return inputs
        return {**inputs, "position_ids": text_positions(inputs["attention_mask"])}  # [n, P + C]

    def rope_positions(self, model: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
        """The M-RoPE position ids ``[3, n, L]`` the model would compute itself for collated ``inputs`` (prompts
        without completions), so that a caller can pass them explicitly and continue them past the prompt. A family
        with plain rotary positions (:attr:`mrope` false) returns ``[n, L]`` instead (see
        :func:`text_positions`)."""
        attention = inputs["attention_mask"]  # [n, L]
        if not self.mrope:
            return text_positions(attention)  # [n, L]
        if "image_grid_thw" not in inputs and "video_grid_thw" not in inputs:
            # text only: the three components are the plain text positions
            return text_positions(attention).unsqueeze(0).expand(3, -1, -1)
        backbone = _base_model(model).model
        extra = {"second_per_grid_ts": inputs["second_per_grid_ts"]} if "second_per_grid_ts" in inputs else {}
        positions, _ = backbone.get_rope_index(inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                                              image_grid_thw=inputs.get("image_grid_thw"),
                                              video_grid_thw=inputs.get("video_grid_thw"), attention_mask=attention,
                                              **extra)
        return positions

    def router_load_balancing_loss(self, output: Any, attention_mask: Tensor | None) -> Tensor | None:
        """The routers' load-balancing loss of one forward of an MoE model called with ``output_router_logits=True``
        (0-dim, with gradients), or None when the output carries none: transformers' own ``output.aux_loss``
        (``load_balancing_loss_func`` over the real tokens of ``attention_mask [n, L]``)."""
        return getattr(output, "aux_loss", None)

    def image_token_count(self, prompt: PromptInputs) -> float:
        """How many image tokens ``prompt`` holds (the ``image_tokens`` rollout metric): its grids' patches over the
        spatial merge."""
        return float(prompt["image_grid_thw"].prod(-1).sum()) / self.merge_size ** 2

    # ------------------------------------------------------------------ modules
    def vision_tower(self, model: nn.Module) -> nn.Module:
        """The vision encoder of ``model`` (a transformers model, possibly inside a peft wrapper)."""
        return find_submodule(_base_model(model), self.vision_attributes, what=f"{self.name} vision tower")

    def vision_modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules ``freeze_vision`` freezes under full fine-tuning: the vision tower, whose output (Qwen-VL: the
        merger's) is what the feature cache keeps. A family whose projector sits outside the tower adds it."""
        return [self.vision_tower(model)]

    def suppressed_token_ids(self) -> list[int]:
        """Token ids a completion must never contain: the image/video placeholders and vision delimiters. A sampled
        ``<|image_pad|>`` would be taken for an image slot when the completion is fed back ("Image features and
        image tokens do not match"). The plugin removes them from sampling and from the scored distribution alike."""
        vocab = self.tokenizer.get_vocab()
        ids = {int(vocab[token]) for token in self.vision_tokens if token in vocab}
        for name in ("image_token_id", "video_token_id"):
            value = getattr(self.processor, name, None)
            if isinstance(value, int):
                ids.add(value)
        return sorted(ids)

    def generation_eos_ids(self, model: nn.Module) -> list[int]:
        """Token ids that end a completion: the tokenizer's EOS and the checkpoint's generation EOS ids."""
        ids: list[int] = []
        config = getattr(_base_model(model), "generation_config", None)
        configured = getattr(config, "eos_token_id", None)
        for value in ([configured] if isinstance(configured, int) else list(configured or [])):
            ids.append(int(value))
        if self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        return sorted(set(ids))


# ---------------------------------------------------------------------------------------------------- helpers


def split_images(pixel_values: Tensor, image_grid_thw: Tensor, images_per_sample: Sequence[int]
                 ) -> list[tuple[Tensor, Tensor]]:
    """Split a processor's concatenated ``pixel_values`` per sample.

    Image k owns ``prod(image_grid_thw[k])`` consecutive patch rows, and sample i owns the next
    ``images_per_sample[i]`` images.

    Returns:
        ``[(pixel_values_i [rows_i, D], image_grid_thw_i [images_i, 3])]``, one pair per sample.
    """
    if sum(images_per_sample) != image_grid_thw.shape[0]:
        raise ValueError(f"split_images: {image_grid_thw.shape[0]} image grids for {sum(images_per_sample)} images")
    rows_per_image = image_grid_thw.prod(-1).tolist()  # [images]
    if sum(rows_per_image) != pixel_values.shape[0]:
        raise ValueError(f"split_images: grids describe {sum(rows_per_image)} patch rows, pixel_values has "
                         f"{pixel_values.shape[0]}")
    result = []
    image, row = 0, 0
    for count in images_per_sample:
        rows = int(sum(rows_per_image[image:image + count]))
        result.append((pixel_values[row:row + rows], image_grid_thw[image:image + count]))
        image += count
        row += rows
    return result


def text_positions(attention_mask: Tensor) -> Tensor:
    """Plain rotary position ids ``[n, L]`` of left-padded rows: each row's real tokens at 0, 1, 2, ..., its padding
    at 0 — what transformers' ``generate`` computes from the mask (``_prepare_position_ids_for_generation``, 5.25),
    and what a row gets alone without padding, so a batched pass sees each row at its own positions."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


def open_unresized(images: Sequence[Any], *, use_qwen_vl_utils: bool | None, resized_by: str) -> list[Any]:
    """Open the images of one prompt as RGB at their own size, for a family whose processor resizes them itself
    (GLM-4.1V's, InternVL's tiling); ``resized_by`` says which, in the refusal of ``use_qwen_vl_utils=True``."""
    if use_qwen_vl_utils:
        raise ValueError(f"{resized_by}, not by qwen-vl-utils")
    from PIL import Image

    return [_to_rgb(image if isinstance(image, Image.Image) else Image.open(_local_path(image))) for image in images]


def find_submodule(module: nn.Module, paths: Sequence[str], *, what: str) -> nn.Module:
    """The first ``module.<path>`` of ``paths`` that exists and is a module; a clear error otherwise."""
    for path in paths:
        found: Any = module
        for part in path.split("."):
            found = getattr(found, part, None)
            if found is None:
                break
        if isinstance(found, nn.Module):
            return found
    raise AttributeError(f"cannot find the {what} on {type(module).__name__}: tried {', '.join(paths)}")


@contextmanager
def identity_head(model: nn.Module) -> Iterator[nn.Module]:
    """Swap the LM head of ``model`` for an identity for the duration (its "logits" are then the final hidden
    states) and yield the head module.

    A model that soft-caps its logits after the head (Gemma 2/3/4: ``logits = c · tanh(logits / c)`` with
    ``c = config.get_text_config().final_logit_softcapping``, read at every forward; transformers'
    ``modeling_gemma4.py`` ``Gemma4ForConditionalGeneration.forward``) would cap the hidden states instead, so the cap
    is switched off for the duration too: the caller applies it to the head's output (:func:`logit_softcap`,
    :func:`~mmrl.plugins.vlm.logprobs.fused_head_log_softmax`'s ``softcap``)."""
    hf_model = _base_model(model)
    head = hf_model.get_output_embeddings()
    name = next((child for child, module in hf_model.named_children() if module is head), None)
    if head is None or name is None:
        raise AttributeError(f"{type(hf_model).__name__} has no LM head child module to fuse; set "
                             "plugin.fused_lm_head: false")
    text_config = _text_config(hf_model)
    cap = logit_softcap(hf_model)
    setattr(hf_model, name, nn.Identity())
    if cap is not None:
        text_config.final_logit_softcapping = None
    try:
        yield head
    finally:
        setattr(hf_model, name, head)
        if cap is not None:
            text_config.final_logit_softcapping = cap


def logit_softcap(model: nn.Module) -> float | None:
    """The final logit soft-capping ``c`` the model applies after its LM head (``logits = c · tanh(logits / c)``:
    Gemma 2/3/4's ``final_logit_softcapping``), or None for a model without one. Whoever applies the head to hidden
    states itself (the fused log-softmax, the decode loop's steps) must apply it too: log-probs of the uncapped logits
    are those of another distribution, and the ratio of two such log-probs is still 1, so nothing else would show it."""
    value = getattr(_text_config(_base_model(model)), "final_logit_softcapping", None)
    return None if value is None else float(value)


def _text_config(hf_model: nn.Module) -> Any:
    """The language model's config of a transformers model (``get_text_config()`` where the config has one)."""
    config = getattr(hf_model, "config", None)
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def switch_load_balancing(router_probabilities: Sequence[Tensor], attention_mask: Tensor | None, top_k: int
                          ) -> Tensor:
    """Switch Transformer's load-balancing loss (eqs. 4-6) from router *probabilities*, as transformers'
    ``load_balancing_loss_func`` (e.g. ``models/qwen3_vl_moe/modeling_qwen3_vl_moe.py``) computes it from router
    logits: over every MoE layer's real tokens together, the fraction f_e of top-k assignments that go to expert e
    and its mean router probability P_e; ``E · Σ_e f_e · P_e`` (f sums to k; k at a uniform router).

    For routers whose forward records probabilities (Gemma 4's ``Gemma4TextRouter`` returns the softmax first, which
    ``output_router_logits`` collects): softmaxing them again, as the logits function would, flattens them.

    Args:
        router_probabilities: One ``[n·L, E]`` per MoE layer, rows in ``attention_mask``'s row-major order.
        attention_mask: ``[n, L]``, 1 on real tokens; None: every token.
        top_k: Experts per token (the router's top-k over the same probabilities).

    Returns:
        The 0-dim float32 loss, with gradients through the probabilities (not through the top-k choice).
    """
    probabilities = torch.cat([p.float() for p in router_probabilities])  # [layers·n·L, E]
    num_experts = probabilities.shape[-1]
    rows = router_probabilities[0].shape[0]
    real = (torch.ones(rows, device=probabilities.device) if attention_mask is None
            else attention_mask.reshape(-1).to(probabilities.device, torch.float32))  # [n·L]
    if real.shape[0] != rows:
        raise ValueError(f"router outputs hold {rows} tokens per layer, the attention mask {real.shape[0]}")
    real = real.repeat(len(router_probabilities)).unsqueeze(-1)  # [layers·n·L, 1]
    chosen = probabilities.topk(top_k, dim=-1).indices  # [layers·n·L, k]
    assigned = nn.functional.one_hot(chosen, num_experts).sum(1).float()  # [layers·n·L, E]: 1 where routed
    tokens = real.sum()
    fraction = (assigned * real).sum(0) / tokens  # [E]: f_e
    mean_probability = (probabilities * real).sum(0) / tokens  # [E]: P_e
    return num_experts * (fraction * mean_probability).sum()


class RouterAuxLoss:
    """Context manager that records the router load-balancing loss of every forward of a transformers MoE model
    made inside it (a forward hook on the transformers model inside DDP and peft wrappers): ``loss(output,
    attention_mask)`` (:meth:`VLMAdapter.router_load_balancing_loss`), by default the output's ``aux_loss``.

    Attributes:
        values: The recorded losses, one 0-dim tensor per forward, with gradients.
    """

    def __init__(self, model: nn.Module, loss: Callable[[Any, Tensor | None], Tensor | None] | None = None):
        self.model = _base_model(model)
        self.loss = loss or (lambda output, _mask: getattr(output, "aux_loss", None))
        self.values: list[Tensor] = []
        self._handle: Any = None

    def __enter__(self) -> RouterAuxLoss:
        def record(_module: nn.Module, _args: Any, kwargs: dict[str, Any], output: Any) -> None:
            value = self.loss(output, kwargs.get("attention_mask"))
            if value is None:
                raise RuntimeError(f"{type(self.model).__name__} returned no router loss with "
                                   "output_router_logits=True; set plugin.router_aux_loss_coef: 0")
            self.values.append(value)

        self._handle = self.model.register_forward_hook(record, with_kwargs=True)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._handle.remove()


def check_head(head: nn.Module, hidden_size: int) -> None:
    """The head's weight must be whole outside the model call (not sharded by FSDP or ZeRO-3)."""
    weight = head.weight
    if weight.dim() != 2 or weight.shape[1] != hidden_size or weight.numel() == 0:
        raise RuntimeError(f"the LM head's weight has shape {tuple(weight.shape)} outside the model call (sharded "
                           "by FSDP or ZeRO-3?); set plugin.fused_lm_head: false")


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP and peft wrappers."""
    model = getattr(model, "module", model)
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


@contextmanager
def lifted_router_logits(model: nn.Module, *, what: str) -> Iterator[None]:
    """For the duration, a forward of ``model`` (a wrapper whose ``model.language_model`` is a MoE text model that
    records its router logits) returns them as its output's ``router_logits`` (one ``[n·L, E]`` per sparse layer, in
    layer order), for wrappers whose own output class cannot carry them (InternVL, GLM-4.6V: their adapters' module
    docstrings).

    One forward hook on the language model takes the logits out of its output before the wrapper builds its own;
    another on the outer model, put before any other hook there (:class:`RouterAuxLoss` reads the output in its own),
    sets them on the wrapper's output. The hooks are removed on exit, so a backward that recomputes checkpointed layers
    outside the call records nothing.

    Args:
        what: the family's name for the language model, for the one-line error when it is not found.
    """
    hf_model = _base_model(model)
    language_model = find_submodule(hf_model, ("model.language_model",), what=what)
    taken: list[tuple[Tensor, ...]] = []

    def take(_module: nn.Module, _args: Any, output: Any) -> Any:
        logits = getattr(output, "router_logits", None)
        if logits is None:
            return None
        taken.append(tuple(logits))
        return type(output)(**{key: value for key, value in output.items() if key != "router_logits"})

    def give(_module: nn.Module, _args: Any, output: Any) -> Any:
        if taken:
            output.router_logits = taken.pop()
        return output

    handles = [language_model.register_forward_hook(take), hf_model.register_forward_hook(give, prepend=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()

def select_cache_rows(cache: Any, index: Tensor) -> None:
    """Index a KV cache's batch rows in place: row i becomes row ``index[i]`` (``index`` may repeat rows and be
    longer than the batch: a distinct prompt's cache copied to its G samples). Differentiable.

    transformers' ``Cache.batch_select_indices`` does this for attention layers; the conv and recurrent states of
    linear-attention layers (Qwen3.5's Gated DeltaNet: ``LinearAttentionLayer``, transformers 5.25) have no
    ``batch_select_indices`` but a ``reorder_cache`` that applies ``index_select`` to every state along the batch,
    the same operation, so each layer uses the one it has."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        cache.batch_select_indices(index)
        return
    for layer in layers:
        select = getattr(layer, "batch_select_indices", None)
        if select is not None:
            select(index)
        else:
            layer.reorder_cache(index)


def cache_argument(module: nn.Module) -> str:
    """The name under which a transformers module's forward takes the KV cache: ``cache`` where its signature has
    it (newer transformers), else ``past_key_values``. Read once per class (``inspect.signature`` cost ~50 µs a call,
    and every decode and shared-prompt pass asks)."""
    return _cache_argument_of(type(module))


@functools.cache
def _cache_argument_of(module_class: type) -> str:
    return "cache" if "cache" in inspect.signature(module_class.forward).parameters else "past_key_values"


_QWEN_VL_UTILS: list[Any] = []


def _qwen_vl_utils() -> Any:
    """``qwen_vl_utils.process_vision_info``, or None when it does not import (it needs torchvision)."""
    if not _QWEN_VL_UTILS:
        try:
            from qwen_vl_utils import process_vision_info
        except Exception:  # noqa: BLE001 — a broken torchvision raises arbitrary errors at import
            process_vision_info = None
        _QWEN_VL_UTILS.append(process_vision_info)
    return _QWEN_VL_UTILS[0]


def _image_reference(image: Any) -> Any:
    if isinstance(image, Path):
        return str(image)
    return image


def _local_path(image: Any) -> str:
    text = str(image)
    return text[len("file://"):] if text.startswith("file://") else text


def _to_rgb(image: Any) -> Any:
    """RGB; transparent images are composited on white (as qwen-vl-utils does)."""
    from PIL import Image

    if image.mode == "RGBA":
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image, mask=image.split()[3])
        return background
    return image.convert("RGB")


__all__ = ["DEFAULT_LORA_TARGETS", "PromptInputs", "VLMAdapter", "find_submodule", "logit_softcap", "open_unresized",
           "select_cache_rows", "split_images", "text_positions"]
