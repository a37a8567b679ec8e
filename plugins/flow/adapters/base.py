"""The adapter interface between the flow plugin and one family of diffusers flow-matching pipelines.

An adapter wraps a loaded diffusers pipeline and answers five questions the plugin asks:

=====================  ===================================================================================
:meth:`encode_prompts`  text → per-prompt conditioning tensors (``{"prompt_embeds": [n, L, D], ...}``)
:meth:`noise_shape`     the shape of one sample's initial noise, drawn exactly as the pipeline draws it
:meth:`schedule`        the σ grid and the model timesteps of ``num_steps`` steps, from the pipeline's scheduler
:meth:`call_transformer` one velocity prediction of the transformer for a batch (the model's own call signature)
:meth:`decode`          final latents → images ``[N, 3, H, W]`` (videos ``[N, 3, F, H, W]``) in [0, 1]
=====================  ===================================================================================

A model that generates more than pixels (LTX-2's audio) adds payload entries with :meth:`FlowAdapter.decode_extra`;
one whose pipeline encodes the CFG negative prompt otherwise than a prompt (Sana) overrides
:meth:`FlowAdapter.encode_negative_prompt`.

The sample size is adapter state, set once by the plugin: :attr:`FlowAdapter.height` and :attr:`FlowAdapter.width`
in pixels (``plugin.height``/``plugin.width``, else ``plugin.resolution``), read by every operation that depends on
it (noise shapes, packed-latent position ids, resolution-dependent σ shifts, decode), so height and width reach the
transformer call too. Video models (Wan) declare it once here: :attr:`FlowAdapter.output` is ``"videos"``,
:attr:`num_frames` (set by the plugin from ``plugin.num_frames`` after :meth:`FlowAdapter.frames_requirement`
accepted it) gives the frame axis of :meth:`noise_shape` and :meth:`decode`, and :attr:`temporal_scale_factor` is
the VAE's frames per latent frame.
The SDE, the log-probs and every credit strategy treat a latent as one tensor per sample whatever its rank.

Everything else (SDE steps and their log-probs, classifier-free guidance, the KL, LoRA, checkpoints) is shared and
lives in :mod:`mmrl.plugins.flow.plugin`. :meth:`FlowAdapter.velocity` is the one function both the rollout and
the training forward call for every velocity, so the two compute the same numbers.
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

Conditioning = dict[str, Tensor]
"""Per-sample text conditioning: each tensor has the sample axis first (``[n, ...]``)."""

GuidanceScale = float | tuple[float, float]
"""A guidance scale, or a ``(high-noise, low-noise)`` pair for a pipeline whose experts each have their own (Wan 2.2
A14B: ``guidance_scale`` and ``guidance_scale_2``); :meth:`FlowAdapter.guidance_for` resolves it per row."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")


class FlowAdapter(ABC):
    """One family of diffusers flow pipelines (SD3, FLUX, ...). Subclasses set the class attributes and implement
    :meth:`encode_prompts`, :meth:`noise_shape` and :meth:`call_transformer`; the defaults of the other methods
    follow the SD3 pipeline and are overridden where a model differs (FLUX packs its latents).

    Args:
        pipeline: A loaded diffusers pipeline with ``transformer``, ``vae`` and ``scheduler`` components.
        device: Where the plugin runs the models.
    """

    #: Registry name (``plugin.adapter``).
    name: ClassVar[str]
    #: ``model_index.json`` ``_class_name`` values this adapter handles (auto-detection). Every built-in adapter
    #: refuses a pipeline of another class when it is built, before reading its components
    #: (:func:`refuse_other_pipelines`); one with none declared (chosen by name only) checks the class itself.
    pipeline_classes: ClassVar[tuple[str, ...]]
    #: Default LoRA target modules (peft suffix match on module names).
    lora_target_modules: ClassVar[tuple[str, ...]]
    #: Guidance scale when the config leaves it null.
    default_guidance_scale: ClassVar[float]
    #: Whether the model takes true classifier-free guidance (an unconditional pass with a negative prompt).
    supports_cfg: ClassVar[bool]
    #: Whether a null ``plugin.cfg`` turns the unconditional pass on, for an adapter that :attr:`supports_cfg`: False
    #: where the pipeline samples without guidance by default (Qwen-Image 2.1's ``true_cfg_scale`` 1.0).
    cfg_by_default: ClassVar[bool] = True
    #: Whether the guidance scale reaches the model through a guidance embedding (FLUX.1, FLUX.2 [dev]) rather than
    #: the CFG pass alone. A model guided only by the pass is unguided without it: with the pass off the plugin
    #: resolves a null scale to :attr:`unguided_scale` and refuses any other.
    guidance_embedded: ClassVar[bool] = False
    #: Why ``plugin.cfg: true`` is refused for an adapter without the pass (the end of the one-line ConfigError).
    cfg_refusal: ClassVar[str] = "takes guidance through the model's guidance embedding, without an unconditional pass"
    #: The CFG scale at which :meth:`combine_guidance` gives the conditional velocity alone: 1 for the standard
    #: v_u + w·(v_c − v_u), 0 where the pipeline writes guidance as v_c + w·(v_c − v_u) (Z-Image). With
    #: ``plugin.cfg: false`` the plugin resolves a null scale to it and refuses any other.
    unguided_scale: ClassVar[float] = 1.0
    #: Text length when the config leaves ``max_sequence_length`` null (the pipeline's default).
    default_max_sequence_length: ClassVar[int]
    #: The payload key of :meth:`decode`'s output: ``"images"`` ``[N, 3, H, W]`` or ``"videos"`` ``[N, 3, F, H, W]``.
    output: ClassVar[str] = "images"
    #: Frames per video when ``plugin.num_frames`` is null (video adapters; images have no frame axis).
    default_num_frames: ClassVar[int | None] = None
    #: Whether every sample is conditioned on an input image besides its prompt (image editing: FLUX.1 Kontext).
    #: Such an adapter implements :meth:`encode_condition_images`; the plugin reads each row's ``"image"`` and
    #: passes the result to :meth:`call_transformer` with the prompt's conditioning.
    image_conditioned: ClassVar[bool] = False
    #: Whether the prompt's encoding itself sees the condition image (Qwen-Image-Edit: its Qwen2.5-VL text encoder
    #: reads the image with the instruction). Such an adapter also implements :meth:`encode_prompts_with_images`;
    #: the plugin then encodes each (prompt, image) pair, and for CFG each image with the negative prompt, instead
    #: of the prompts alone.
    prompt_sees_image: ClassVar[bool] = False
    #: Whether the adapter applies ZImagePipeline's optional guidance rules (``plugin.cfg_normalization``,
    #: ``plugin.cfg_truncation``), which the plugin sets on it; other adapters refuse them.
    guidance_rules: ClassVar[bool] = False
    #: How many input images a prompt row may name (``"image"``: a path, or a list of paths): 1 for most editing
    #: pipelines; None (any number) where the pipeline takes several (Qwen-Image-Edit-Plus, FLUX.2). A row's images
    #: are joined by :meth:`join_condition_images`, and such an adapter's :meth:`call_transformer` reads
    #: ``condition_image_mask`` (see :func:`by_image_count`).
    max_condition_images: int | None = 1
    #: Whether a prompt row may also name a ``"last_image"``, the video's last frame (Wan first-and-last-frame): such
    #: an adapter's :meth:`encode_condition_images` takes ``last_images`` and it implements ``last_image_problem``.
    takes_last_image: ClassVar[bool] = False
    #: Whether an input image may have another size than the generated image (``plugin.condition_size``): the
    #: editing pipelines that size it independently (FLUX.1 Kontext, Qwen-Image-Edit, FLUX.2); not image-to-video,
    #: whose input is the first frame.
    condition_size_free: ClassVar[bool] = False
    #: Which of a row's input images sets its aspect ratio under ``plugin.buckets`` ('first' or 'last'): the image
    #: the pipeline sizes its output by when no height and width are given (Qwen-Image-Edit-Plus: the last).
    aspect_image: str = "first"

    def __init__(self, pipeline: Any, device: torch.device):
        self.pipeline = pipeline
        self.device = torch.device(device)
        # A private copy: set_timesteps mutates the scheduler, and the pipeline's own scheduler stays untouched.
        self.scheduler = copy.deepcopy(pipeline.scheduler)
        # (steps, height, width, static shift or None) → (sigmas, timesteps)
        self._schedules: dict[tuple[int, int, int, float | None], tuple[Tensor, Tensor]] = {}
        #: Frames per sample: 1 for images; the plugin sets it for video adapters (:meth:`frames_requirement`).
        self.num_frames = 1
        #: Image (frame) size in pixels; the plugin sets both from its config (:meth:`set_size`).
        self.height: int | None = None
        self.width: int | None = None
        #: Input images' size in pixels for image-conditioned adapters (``plugin.condition_size``); None: the
        #: generated images' size (:attr:`condition_size`).
        self.condition_height: int | None = None
        self.condition_width: int | None = None

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, model: str, *, dtype: torch.dtype, device: torch.device) -> FlowAdapter:
        """Load the pipeline at ``model`` (a local folder or a hub id) through diffusers' ``from_pretrained``."""
        return cls(load_pipeline(model, dtype), device)

    # ------------------------------------------------------------------ components
    @property
    def transformer(self) -> nn.Module:
        return self.pipeline.transformer

    @transformer.setter
    def transformer(self, module: nn.Module) -> None:
        self.pipeline.transformer = module

    @property
    def vae(self) -> nn.Module:
        return self.pipeline.vae

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    def configure(self, options: dict[str, Any], *, cfg: bool) -> None:
        """Apply ``plugin.adapter_options`` (settings only this family has), once, after the plugin resolved
        ``plugin.cfg`` to ``cfg``. A problem is a one-line ValueError naming the key and what is allowed (the plugin
        reports it as the option's ConfigError). The base adapter takes no options."""
        if options:
            raise ValueError(f"an empty mapping: the {self.name} adapter takes no options "
                             f"({', '.join(map(repr, options))} given)")

    def experts(self) -> dict[str, nn.Module]:
        """The trainable denoisers by pipeline component name (``plugin.train_experts`` picks among them): the one
        ``{"transformer": ...}``, or Wan 2.2's ``transformer`` and ``transformer_2``, which :attr:`transformer` (the
        policy) then holds together."""
        return {"transformer": self.pipeline.transformer}

    def reference_copy(self) -> nn.Module:
        """Full fine-tuning's frozen reference policy: a frozen copy of :attr:`transformer`."""
        from mmrl.policy import frozen_copy

        return frozen_copy(self.transformer)

    def guidance_for(self, timesteps: Tensor, guidance_scale: GuidanceScale) -> float | Tensor:
        """The CFG scale that :meth:`velocity` combines each row with (a float, or a tensor broadcasting against the
        velocity ``[n, ...]``): ``guidance_scale`` itself; an adapter with per-expert scales maps a ``(high, low)``
        pair to rows by their ``timesteps [n]``."""
        return guidance_scale[0] if isinstance(guidance_scale, tuple) else guidance_scale

    def text_encoders(self) -> list[nn.Module]:
        """The pipeline's text encoders (frozen by the plugin)."""
        return [module for name, module in self.pipeline.components.items()
                if name.startswith("text_encoder") and isinstance(module, nn.Module)]

    @property
    def temporal_scale_factor(self) -> int:
        """Frames per latent frame after the first (the VAE's temporal downsampling; 1 without a frame axis)."""
        return 1

    def latent_frames(self, num_frames: int) -> int:
        """Latent frames of a ``num_frames`` video: the first frame alone, then one per ``temporal_scale_factor``
        frames (the causal video VAEs of Wan and Qwen-Image)."""
        return (num_frames - 1) // self.temporal_scale_factor + 1

    def frames_requirement(self, num_frames: int | None) -> str | None:
        """None if ``plugin.num_frames`` = ``num_frames`` suits this adapter, else what is allowed (for the plugin's
        one-line ConfigError): image adapters take null only; video adapters null (their default) or a count whose
        ``num_frames - 1`` is a multiple of the VAE's temporal factor."""
        if self.output != "videos":
            return None if num_frames is None else f"null: the {self.name} adapter generates images"
        factor = self.temporal_scale_factor
        if num_frames is not None and (num_frames - 1) % factor:
            return f"1 + a multiple of {factor} (the {self.name} VAE's temporal compression), e.g. {4 * factor + 1}"
        return None

    def resolution_multiple(self) -> int:
        """Image height and width must each be a multiple of this (VAE downsampling × transformer patch, as the
        pipeline's ``check_inputs`` requires)."""
        return self.vae_scale_factor * int(getattr(self.transformer.config, "patch_size", 1) or 1)

    def set_size(self, height: int, width: int) -> None:
        """Generate ``height × width`` pixel images (frames) from now on. The plugin has checked both against
        :meth:`resolution_multiple` and names the option in its error; here a bad size is a ValueError."""
        multiple = self.resolution_multiple()
        if height < 1 or width < 1 or height % multiple or width % multiple:
            raise ValueError(f"{self.name} adapter: height {height} and width {width} must be positive multiples of "
                             f"{multiple}")
        self.height, self.width = int(height), int(width)

    def set_condition_size(self, size: tuple[int, int] | None) -> None:
        """Bring input images to ``(height, width)`` pixels from now on (None: the generated images' size), for
        adapters whose pipeline sizes an input image independently of the output (:attr:`condition_size_free`)."""
        if size is not None:
            multiple = self.resolution_multiple()
            if size[0] < 1 or size[1] < 1 or size[0] % multiple or size[1] % multiple:
                raise ValueError(f"{self.name} adapter: input size {size[0]} x {size[1]} must be positive multiples "
                                 f"of {multiple}")
        self.condition_height, self.condition_width = (None, None) if size is None else (int(size[0]), int(size[1]))

    @contextmanager
    def sized(self, height: int, width: int, condition: tuple[int, int] | None = None) -> Iterator[None]:
        """Generate ``height × width`` pixel images, from input images of ``condition`` pixels (None: the same size),
        inside the block (an evaluation at ``plugin.eval_height`` × ``eval_width``), the previous sizes restored
        after it, also when the block raises. Everything that depends on the sizes reads :attr:`size` and
        :attr:`condition_size` or caches by them (σ grids, position ids, encoded input images), so nothing computed
        at one size is reused at the other."""
        previous = self.size
        previous_condition = None if self.condition_height is None else (self.condition_height, self.condition_width)
        self.set_size(height, width)
        self.set_condition_size(condition)
        try:
            yield
        finally:
            self.set_size(*previous)
            self.set_condition_size(previous_condition)

    @property
    def size(self) -> tuple[int, int]:
        """``(height, width)`` in pixels, as :meth:`set_size` set them."""
        if self.height is None or self.width is None:
            raise RuntimeError(f"{self.name} adapter: no image size; call set_size(height, width) before sampling")
        return self.height, self.width

    @property
    def condition_size(self) -> tuple[int, int]:
        """``(height, width)`` in pixels that image-conditioned adapters bring each input image to: ``plugin.
        condition_size``, else :attr:`size`."""
        if self.condition_height is None or self.condition_width is None:
            return self.size
        return self.condition_height, self.condition_width

    def condition_grid(self, multiple: int = 1) -> tuple[int, int]:
        """``(rows, columns)`` of an input image's latent grid at :attr:`condition_size`, over ``multiple`` (the
        packing's patch side: 2 for FLUX-style 2×2 tokens)."""
        height, width = self.condition_size
        return height // self.vae_scale_factor // multiple, width // self.vae_scale_factor // multiple

    def latent_size(self) -> tuple[int, int]:
        """``(h, w)`` of the VAE latents of one image (frame): the pixel size over the VAE's spatial factor."""
        height, width = self.size
        return height // self.vae_scale_factor, width // self.vae_scale_factor

    # ------------------------------------------------------------------ the five operations
    @abstractmethod
    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> Conditioning:
        """Encode ``prompts`` with the pipeline's text encoders → tensors with ``len(prompts)`` rows."""

    def encode_negative_prompt(self, prompt: str, max_sequence_length: int) -> Conditioning:
        """The negative prompt of true CFG, encoded as the pipeline encodes its ``negative_prompt`` → tensors with one
        row and :meth:`encode_prompts`' keys, which the unconditional half of :meth:`velocity` reads. The default is
        :meth:`encode_prompts` of ``[prompt]``: most pipelines encode both the same way. A pipeline that encodes its
        negative prompt differently (Sana: no instruction prefix, no token selection) overrides this. Adapters whose
        prompts see the image (:attr:`prompt_sees_image`) encode the negative prompt with each row's images through
        :meth:`encode_prompts_with_images` instead, and do not come here."""
        return self.encode_prompts([prompt], max_sequence_length)

    def encode_condition_images(self, images: list[Any]) -> tuple[Conditioning, Tensor]:
        """Image-conditioned adapters (:attr:`image_conditioned`): PIL images → (per-sample conditioning tensors,
        ``[n, ...]`` each, merged with the prompt's; the images as the model saw them, ``[n, 3, H, W]`` in [0, 1],
        which the plugin hands the rewards as ``payload["condition_images"]``)."""
        raise NotImplementedError(f"the {self.name} adapter takes no condition images")

    def encode_prompts_with_images(self, prompts: list[str], images: list[list[Any]], max_sequence_length: int
                                   ) -> Conditioning:
        """Adapters whose prompt encoding sees the image (:attr:`prompt_sees_image`): ``prompts[i]`` read with its
        row's input images ``images[i]`` (a list of one or, where :attr:`max_condition_images` allows, more PIL images)
        → the tensors :meth:`encode_prompts` would give, one row per prompt."""
        raise NotImplementedError(f"the {self.name} adapter encodes prompts without images")

    def join_condition_images(self, entries: list[Conditioning], slots: int) -> Conditioning:
        """One row's conditioning from the :meth:`encode_condition_images` entries of its input images (one row each,
        in the row's order), when the run's rows name up to ``slots`` > 1 images (only adapters whose
        :attr:`max_condition_images` allows several get here): their ``image_latents`` tokens one after the other
        (:func:`joined_image_tokens`), as the Qwen-Image-Edit-Plus and FLUX.2 pipelines lay them out. An adapter whose
        input images condition it otherwise overrides this."""
        return joined_image_tokens(entries, slots)

    @abstractmethod
    def noise_shape(self) -> tuple[int, ...]:
        """Shape of one sample's initial noise at :attr:`size` as the pipeline's ``prepare_latents`` draws it
        (before packing)."""

    def pack(self, noise: Tensor) -> Tensor:
        """Initial noise ``[N, *noise_shape]`` → the transformer's latent layout (identity unless packed)."""
        return noise

    def unpack(self, latents: Tensor) -> Tensor:
        """Transformer layout → VAE latents ``[N, C, h, w]`` (identity unless packed)."""
        return latents

    def image_seq_len(self) -> int:
        """Image tokens the transformer sees at :attr:`size`, for schedulers with resolution-dependent (dynamic)
        shifting."""
        height, width = self.size
        multiple = self.resolution_multiple()
        return (height // multiple) * (width // multiple)

    def default_sigmas(self, num_steps: int) -> list[float] | None:
        """Custom σ grid the pipeline passes to ``set_timesteps`` (None: the scheduler's own spacing)."""
        return None

    def dynamic_shift_mu(self, num_steps: int) -> float:
        """μ of a dynamically shifting scheduler (``use_dynamic_shifting``): FLUX's ``calculate_shift`` of the image
        tokens with the scheduler config's base/max shift. Overridden where the pipeline computes μ otherwise
        (FLUX.2: from the image tokens and the number of steps)."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.scheduler.config
        return calculate_shift(
            self.image_seq_len(), config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5), config.get("max_shift", 1.15),
        )

    def schedule(self, num_steps: int, static_shift: float | None = None) -> tuple[Tensor, Tensor]:
        """``(sigmas [S+1], timesteps [S])`` float32 on the device: σ from ~1 down to 0 (the last entry) and the
        timestep value the transformer is given at each step, computed by the pipeline's scheduler exactly as its
        ``__call__`` does (including FLUX's shift, which depends on the image tokens of :attr:`size`).

        With ``static_shift`` s, instead the grid of DanceGRPO's trainers (and MixGRPO's, BranchGRPO's, GCPO's):
        σ_i = s·t_i / (1 + (s − 1)·t_i) on t_i = 1 − i/S, i = 0..S (their ``sd3_time_shift`` of
        ``torch.linspace(1, 0, S + 1)``: XueZeyue/DanceGRPO@15cc71d ``fastvideo/train_grpo_flux.py:127-128, 311-313``),
        whatever the resolution, and the timesteps σ_i·``num_train_timesteps`` as the scheduler scales them.
        """
        key = (num_steps, *self.size, static_shift)
        if key in self._schedules:
            return self._schedules[key]
        if static_shift is not None:
            t = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)
            grid = static_shift * t / (1 + (static_shift - 1) * t)  # [S+1], exactly 1 and 0 at the ends
            scale = float(self.scheduler.config.get("num_train_timesteps", 1000))
            timesteps = (grid[:-1] * scale).to(torch.float32)
            self._schedules[key] = (grid.to(torch.float32).to(self.device), timesteps.to(self.device))
        else:
            config = self.scheduler.config
            kwargs: dict[str, Any] = {}
            if config.get("use_dynamic_shifting", False):
                kwargs["mu"] = self.dynamic_shift_mu(num_steps)
            sigmas = None if config.get("use_flow_sigmas", False) else self.default_sigmas(num_steps)
            if sigmas is None:
                self.scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
            else:
                self.scheduler.set_timesteps(sigmas=sigmas, device="cpu", **kwargs)
            grid = self.scheduler.sigmas.to(torch.float32)
            timesteps = self.scheduler.timesteps.to(torch.float32)
            if grid.shape[0] != num_steps + 1 or timesteps.shape[0] != num_steps:
                raise ValueError(
                    f"{type(self.scheduler).__name__} gave {timesteps.shape[0]} timesteps for {num_steps} steps; the "
                    "flow plugin needs a first-order flow-matching scheduler (FlowMatchEulerDiscreteScheduler)"
                )
            self._schedules[key] = (grid.to(self.device), timesteps.to(self.device))
        return self._schedules[key]

    @abstractmethod
    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        """One transformer call on a batch: ``latents`` in the transformer's layout (already cast to its dtype),
        ``timesteps [n]`` float32 scheduler timesteps, ``conditioning`` with n rows. Returns the raw velocity.
        ``guidance_scale`` is for guidance-distilled models (FLUX's guidance embedding); true CFG is done by
        :meth:`velocity`."""

    def velocity(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning, *,
                 guidance_scale: GuidanceScale, negative: Conditioning | None = None) -> Tensor:
        """The velocity the sampler steps with, float32 ``[n, ...]``.

        With ``negative`` (one row, the negative prompt) this is true classifier-free guidance as in the diffusers
        pipelines and Flow-GRPO: one transformer call on ``[uncond; cond]`` and v = v_u + w·(v_c − v_u), the
        combination done in float32, w from :meth:`guidance_for` (per row for Wan 2.2's experts). Rollout and
        training both come through here. The unconditional half of each conditioning key is the row's own
        ``negative_<key>`` where ``conditioning`` has one (a negative prompt read with the row's image:
        Qwen-Image-Edit), else ``negative[key]``, else the conditional value itself (a condition image's latents).
        """
        scale = self.guidance_for(timesteps, guidance_scale)
        # call_transformer's scale is a guidance-distilled model's embedding (FLUX); per-expert pairs are CFG scales
        embedded = guidance_scale[0] if isinstance(guidance_scale, tuple) else guidance_scale
        rows = {key: value for key, value in conditioning.items() if not key.startswith("negative_")}
        if negative is None:
            return self.call_transformer(module, latents, timesteps, rows, embedded).float()
        n = latents.shape[0]

        def unconditional(key: str, value: Tensor) -> Tensor:
            if f"negative_{key}" in conditioning:
                return conditioning[f"negative_{key}"]
            return negative[key].expand(n, *negative[key].shape[1:]) if key in negative else value

        both = {key: torch.cat([unconditional(key, value), value]) for key, value in rows.items()}
        output = self.call_transformer(module, torch.cat([latents, latents]), torch.cat([timesteps, timesteps]),
                                       both, embedded)
        uncond, cond = output.float().chunk(2)  # [n, ...] each
        return self.combine_guidance(uncond, cond, scale)

    def combine_guidance(self, uncond: Tensor, cond: Tensor, guidance_scale: float | Tensor) -> Tensor:
        """The guided velocity from the float32 unconditional and conditional ones (``[n, ...]`` each): the standard
        v_u + w·(v_c − v_u), w a float or per row (``[n, 1, ...]``). A model whose pipeline post-processes the
        combination (Qwen-Image's norm rescale) overrides this, not :meth:`velocity`."""
        return uncond + guidance_scale * (cond - uncond)

    # ------------------------------------------------------------------ rows with their own inputs, given starts
    def prepare_rows(self, rows: list[dict[str, Any]], folder: Path | None, source: str) -> list[dict[str, Any]]:
        """A split's prompt rows, checked and completed once when the plugin starts, for an adapter whose rows carry
        inputs of their own besides prompt and image (Wan video-to-video: ``"video"``); ``folder`` is the prompt
        file's folder, which relative paths are read from (None: an inline prompt list), ``source`` names it in
        errors. A bad row is a one-line ValueError naming the row and what is allowed. The base returns them as
        they are."""
        return rows

    def row_conditioning(self, rows: list[dict[str, Any]]) -> tuple[Conditioning, dict[str, Tensor]]:
        """The conditioning of ``rows`` that the adapter reads from them itself (each tensor ``[n, ...]``, merged with
        the prompts'), and payload entries for the rewards (the rows' inputs as the model saw them). The base has
        none."""
        return {}, {}

    def initial_latents(self, noise: Tensor, conditioning: Conditioning, sigma: Tensor) -> Tensor:
        """The latents the first step of the grid starts from, given the initial noise ``[n, *latent]`` drawn as the
        pipeline draws it, the rows' conditioning and σ at that step (``sigmas[0]`` of :meth:`schedule`): the noise
        itself (text-to-image: σ₀ = 1), except where the pipeline starts from given content noised to σ₀
        (video-to-video, SDEdit). The noise is part of the initial state, not an action: the SDE steps and their
        log-probs start after it."""
        return noise

    def finalize(self, latents: Tensor, conditioning: Conditioning) -> Tensor:
        """The sampled latents ``[n, ...]`` as the pipeline hands them to the VAE, given the rows' conditioning: the
        identity, except where the pipeline puts given content back after sampling (Wan 2.2 TI2V image-to-video:
        the first latent frame becomes the input image's again)."""
        return latents

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Final latents (transformer layout) → images ``[N, 3, H, W]`` float32 in [0, 1], as the pipeline's
        ``output_type="pt"``."""
        vae = self.vae
        latents = self.unpack(latents)
        latents = latents / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        images = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def decode_extra(self, latents: Tensor) -> dict[str, Tensor]:
        """Payload entries the model decodes besides :meth:`decode`'s output, from the same final latents (after
        :meth:`finalize`), each tensor ``[N, ...]``: the rewards read them with ``batch.output(key)``. Keys must not
        collide with the plugin's own (:attr:`output`, ``"prompts"``, ``"condition_images"``, ...). Empty in the base;
        LTX-2 returns its audio (``"audios"`` ``[N, channels, samples]`` and ``"audio_sample_rate"`` ``[N]``)."""
        return {}


# ---------------------------------------------------------------------------------------- several input images
IMAGE_MASK = "condition_image_mask"
"""The conditioning key ``[n, slots]`` (1.0 where the row has that input image, 0.0 after its last) of runs whose rows
name up to ``slots`` > 1 input images (:func:`joined_image_tokens`); runs with one image per row have none."""


def joined_image_tokens(entries: list[Conditioning], slots: int, key: str = "image_latents") -> Conditioning:
    """One row's ``key`` tokens ``[1, slots·T, D]``: its input images' ``[1, T, D]`` tokens one after the other in
    the row's order (the Qwen-Image-Edit-Plus and FLUX.2 pipelines concatenate the images' tokens so), zero after the
    last image, with :data:`IMAGE_MASK` ``[1, slots]`` saying how many are real. Zero-padding lets the rows of a batch
    stack whatever their counts; :func:`by_image_count` never shows the padding to the model."""
    if not 1 <= len(entries) <= slots:
        raise ValueError(f"a row with {len(entries)} input images where the run's rows hold 1 to {slots}")
    tokens = torch.cat([entry[key] for entry in entries], dim=1)  # [1, k·T, D]
    per_image = entries[0][key].shape[1]
    padded = tokens.new_zeros(1, slots * per_image, tokens.shape[-1])  # [1, slots·T, D]
    padded[:, :tokens.shape[1]] = tokens
    mask = torch.zeros(1, slots)
    mask[0, :len(entries)] = 1
    return {key: padded, IMAGE_MASK: mask.to(tokens.device)}


def call_per_group(keys: Tensor, call: Any) -> Tensor:
    """``call(rows, key)`` once per distinct value ``key`` of ``keys`` ``[n]`` (ascending), where ``rows`` are the batch
    rows holding it (None when every row does, so that ``call`` can take the batch as it is), the outputs
    ``[m, ...]`` put back in the batch's row order: ``[n, ...]``. For rows that cannot share one transformer call
    (other input-image counts, text layouts or text windows)."""
    present = keys.unique().tolist()
    if len(present) == 1:
        return call(None, present[0])
    groups = [(keys == key).nonzero().flatten() for key in present]
    parts = [call(rows, key) for rows, key in zip(groups, present, strict=True)]
    order = torch.cat(groups)  # the batch's rows in the order of the parts
    return torch.cat(parts).index_select(0, torch.argsort(order))


def by_image_count(call: Any, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                   key: str = "image_latents") -> Tensor:
    """``call(latents, timesteps, conditioning, count)`` on the rows that have ``count`` input images, once per count
    present in the batch, the outputs put back in the rows' order. ``conditioning[key]`` holds each row's images'
    tokens (:func:`joined_image_tokens`), cut here to the ``count`` real images (``[m, count·T, D]``, T an input
    image's tokens: every input image is brought to one size); without :data:`IMAGE_MASK` every row has one image
    and ``call`` gets the batch as it is. Rows of different counts cannot share a call (their token sequences
    differ in length), so a batch that mixes counts costs one transformer call per count."""
    mask = conditioning.get(IMAGE_MASK)
    if mask is None:
        return call(latents, timesteps, conditioning, 1)
    rest = {name: value for name, value in conditioning.items() if name != IMAGE_MASK}
    counts = mask.float().sum(dim=1).round().long()  # [n]
    per_image = rest[key].shape[1] // mask.shape[1]  # an input image's tokens: slots·T_in in all

    def cut(rows: Tensor | None, count: int) -> Conditioning:
        picked = rest if rows is None else {name: value.index_select(0, rows) for name, value in rest.items()}
        return {**picked, key: picked[key][:, :count * per_image]}

    def part(rows: Tensor | None, count: int) -> Tensor:
        if rows is None:
            return call(latents, timesteps, cut(None, count), count)
        return call(latents.index_select(0, rows), timesteps.index_select(0, rows), cut(rows, count), count)

    return call_per_group(counts, part)


# ---------------------------------------------------------------------------------------------------------- loading
def encoded_latents(output: Any, vae: nn.Module) -> Tensor:
    """The deterministic latents of a VAE's ``encode`` output, as diffusers' ``retrieve_latents`` with
    ``sample_mode="argmax"`` reads them: the posterior's mode (``AutoencoderKL`` and the video VAEs' ``latent_dist``)
    or the encoder's own latents (``AutoencoderTiny``, TAESD, returns ``latents``)."""
    if hasattr(output, "latent_dist"):
        return output.latent_dist.mode()
    if hasattr(output, "latents"):
        return output.latents
    raise TypeError(f"{type(vae).__name__}.encode returned {type(output).__name__}, which has neither 'latent_dist' "
                    "nor 'latents'; the image-conditioned adapters need a diffusers VAE")


def read_model_index(model: str) -> dict[str, Any]:
    """The pipeline's ``model_index.json`` from a local folder or the hub; one-line FileNotFoundError otherwise."""
    path = Path(model).expanduser()
    if path.is_dir():
        index = path / "model_index.json"
        if not index.is_file():
            raise FileNotFoundError(f"flow model folder {path} has no model_index.json (not a diffusers pipeline)")
        return json.loads(index.read_text())
    if path.exists() or not _HUB_ID.match(model):
        raise FileNotFoundError(f"flow model {model}: no such pipeline folder (and not a hub id like 'owner/name')")
    from diffusers import DiffusionPipeline

    try:
        return dict(DiffusionPipeline.load_config(model))
    except Exception as error:  # offline, unknown repo, gated repo: all say the same thing to the user
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise FileNotFoundError(f"flow model {model}: not a local folder and not loadable from the hub ({reason})")\
            from None


def check_pipeline_folder(path: Path, index: dict[str, Any]) -> None:
    """Every model component listed in ``model_index.json`` must have a folder with weights in it."""
    for component, spec in index.items():
        if component.startswith("_") or not isinstance(spec, list) or spec[0] is None:
            continue
        folder = path / component
        if not folder.is_dir():
            raise FileNotFoundError(f"flow model folder {path}: model_index.json lists {component!r} but "
                                    f"{component}/ is missing")
        if (folder / "config.json").is_file() and not any(
            f.name.endswith(_WEIGHT_SUFFIXES) for f in folder.iterdir() if f.is_file()
        ):
            raise FileNotFoundError(f"flow model folder {path}: {component}/ has a config.json but no weights "
                                    "(*.safetensors or *.bin)")


def load_pipeline(model: str, dtype: torch.dtype) -> Any:
    """``DiffusionPipeline.from_pretrained(model)`` in ``dtype`` after checking a local folder is complete."""
    from diffusers import DiffusionPipeline

    index = read_model_index(model)
    path = Path(model).expanduser()
    if path.is_dir():
        check_pipeline_folder(path, index)
        model = str(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # `torch_dtype` is renamed `dtype` in recent diffusers
        pipeline = DiffusionPipeline.from_pretrained(model, torch_dtype=dtype)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def adapter_driving(class_name: str) -> str | None:
    """The registered flow adapter that declares pipeline class ``class_name`` (the one ``plugin.adapter: auto``
    picks for a ``model_index.json`` naming it), or None."""
    from mmrl.plugins.flow.adapters import flow_adapters

    drivers = [name for name in flow_adapters.names() if class_name in flow_adapters.get(name).pipeline_classes]
    return drivers[0] if drivers else None


def refuse_other_pipelines(adapter: type[FlowAdapter], pipeline: Any, accepted: tuple[str, ...] | None = None) -> None:
    """Raise a one-line ValueError unless ``pipeline``'s class is one of ``adapter.pipeline_classes`` (or of
    ``accepted``, for an adapter that also takes classes ``auto`` gives to another adapter, e.g. ``wan_v2v`` a
    ``WanPipeline``), naming the class found, the classes the adapter takes and the registered adapter that drives
    the class found (the one ``plugin.adapter: auto`` would pick from the checkpoint's ``model_index.json``), or
    saying that none does.

    Classes are compared by name, as ``auto`` compares ``model_index.json``'s ``_class_name``. An adapter that
    declares no pipeline class (one chosen by name only, e.g. ``flux2_edit``) checks its pipeline itself."""
    kind = type(pipeline).__name__
    accepted = adapter.pipeline_classes if accepted is None else accepted
    if not accepted or kind in accepted:
        return
    driver = adapter_driving(kind)
    instead = (f"set plugin.adapter: {driver} (or auto)" if driver else
               "no registered flow adapter drives it (docs/flow.md section 12 adds one)")
    raise ValueError(f"the {adapter.name} adapter drives {' or '.join(accepted)}, not {kind}: {instead}")
