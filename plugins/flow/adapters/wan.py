"""Wan text-to-video (``WanPipeline``): Wan 2.1, Wan 2.2's two-expert A14B and Wan 2.2 TI2V-5B. A 3-D diffusion
transformer on 5-D latents ``[B, C, F, h, w]`` of a causal video VAE (Wan 2.1's: 8× spatial, 4× temporal
compression, 16 channels; Wan 2.2's: 16× spatial with a 2×2 patchify inside, 48 channels), text from a UMT5 encoder,
true classifier-free guidance and a fixed flow shift.

What the adapter reproduces from ``WanPipeline.__call__`` (diffusers 0.42):

- prompts: ``pipeline.encode_prompt`` (``prompt_clean``, UMT5 with the attention mask, the real tokens kept and
  zero-padded to ``max_sequence_length``; the transformer sees no mask, as in the pipeline). Every prompt is padded
  to the same length by the pipeline itself, so cached rows are the pipeline's rows.
- noise ``[C, (F − 1)/t + 1, h, w]`` per sample (``prepare_latents``: h = H / ``scale_factor_spatial``,
  t = ``scale_factor_temporal`` of the VAE config, C the transformer's ``in_channels``), float32, one draw per sample
  generator.
- schedule: the released Wan checkpoints ship ``UniPCMultistepScheduler`` (a second-order multistep solver with
  ``use_flow_sigmas`` and ``flow_shift``: 3.0 for Wan2.1-T2V-1.3B). The plugin's sampler is a first-order SDE/ODE,
  so the adapter builds ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)`` from it and takes σ and timesteps
  from that, as the pipeline does with this scheduler swapped in (the equality test swaps it the same way). A
  pipeline that already ships the Euler scheduler is used as is.
- the transformer gets the raw timestep t (in [0, 1000], not t / 1000) and the padded text embeddings; with
  ``expand_timesteps`` (TI2V-5B) one copy of t per token, ``[n, F_lat·⌈h/2⌉·⌈w/2⌉]``, as the pipeline builds it from
  its all-ones mask (:meth:`WanAdapter.model_timesteps`; image conditioning, which zeroes the first frame's tokens,
  is image-to-video and not covered).
- two experts (Wan 2.2 A14B: ``transformer_2`` and ``boundary_ratio`` in the pipeline config): the step with
  timestep t runs the high-noise expert ``transformer`` when t >= ``boundary_ratio`` · ``num_train_timesteps`` and
  the low-noise expert ``transformer_2`` below, each with its own CFG scale (``guidance_scale``, and
  ``guidance_scale_2`` = ``plugin.guidance_scale_2``, null meaning the same scale, as the pipeline). The policy is
  :class:`WanExperts`, both experts as one module that routes each row by its timestep; a training forward is
  given the timesteps its rollout stored, so every trained step is scored by the expert that sampled it (ratio 1
  on-policy). Routing as the reference implementation (Wan-Video/Wan2.2@42bf4cf ``wan/text2video.py:186`` and
  ``:343``, ``wan/configs/wan_t2v_A14B.py:34-37``: boundary 0.875, shift 12, guidance 4.0 high / 3.0 low).
- guidance: v = v_u + w·(v_c − v_u) (the base class's one ``[uncond; cond]`` call; the pipeline makes two calls).
  The pipeline guides when ``guidance_scale > 1``; the plugin when ``plugin.cfg`` is on (default: on, scale 5.0).
- decode: latents·std + mean per channel (``latents_mean``/``latents_std``), the VAE decode one sample at a time
  (a 33-frame 480×832 video's decoder activations dominate memory), ``[N, 3, F, H, W]`` in [0, 1] as
  ``output_type="pt"`` (which returns ``[N, F, 3, H, W]``: the plugin keeps the channel axis second). The Wan 2.2
  VAE decodes through the same code (its ``is_residual`` blocks and unpatchify are inside ``vae.decode``).

- size: frames of ``plugin.height`` × ``plugin.width`` pixels (Wan 2.1's native 480p is 480 × 832), each a multiple
  of 16 and of VAE factor × patch (32 for the Wan 2.2 VAE): ``WanPipeline.check_inputs`` refuses anything else, and
  ``__call__`` rounds down to ``h_multiple_of``/``w_multiple_of``.

Which experts train (``plugin.train_experts``, default both): a LoRA is attached to each trained expert (the
adapter's default targets in each), or each is fully fine-tuned in float32; the others stay frozen, their steps
sampled but giving no gradient. The KL reference is the same experts with their adapters off (LoRA) or a
:class:`WanExperts` of frozen copies of the trained experts beside the shared frozen ones (full fine-tuning). The
trainer's EMA averages every trainable weight, so both experts' when both train. Checkpoints and exports write the
high-noise expert where a one-transformer run writes its policy and the low-noise one in ``transformer_2/``
(:meth:`mmrl.plugins.flow.plugin.FlowPlugin.expert_folders`). Flow-Factory, the released RL code that trains Wan 2.2
(X-GenGroup/Flow-Factory@a0b2bc5), routes rollout and training steps the same way (``src/flow_factory/models/wan/
wan2_t2v.py:474-484``), attaches LoRA to the listed components (``apply_lora(components=['transformer',
'transformer_2'])``, ``wan2_t2v.py:64-71``; its Wan 2.2 LoRA recipe trains both: ``examples/grpo/lora/wan22/
t2v.yaml:27``, guidance 4.0/3.0) and takes the reference by disabling the adapters of each component
(``models/abc.py:557-578``). Differences: Flow-Factory's ``target_components`` defaults to ``transformer`` alone
(``hparams/model_args.py:57-60``), mmrl trains both by default, as that recipe does; it saves each component with
peft's ``save_pretrained``, mmrl writes diffusers' LoRA files, which ``pipe.load_lora_weights(...,
load_into_transformer_2=True)`` loads.

DanceGRPO's released Wan 2.1 trainer runs the same model with the same guidance combination and raw integer
timesteps (XueZeyue/DanceGRPO, fastvideo/train_grpo_wan_2_1.py, ``run_sample_step``, commit 15cc71d5).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from mmrl.plugins.flow.adapters.base import Conditioning, FlowAdapter, GuidanceScale, refuse_other_pipelines


class WanAdapter(FlowAdapter):
    """Adapter for ``WanPipeline``: Wan 2.1 text-to-video (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, Wan2.1-T2V-14B-Diffusers
    and fine-tunes), Wan 2.2's two-expert text-to-video (Wan-AI/Wan2.2-T2V-A14B-Diffusers: ``transformer_2`` with
    ``boundary_ratio``; the policy is a :class:`WanExperts` holding both) and Wan 2.2 TI2V-5B as text-to-video
    (Wan-AI/Wan2.2-TI2V-5B-Diffusers: ``expand_timesteps``, one timestep per token, the Wan 2.2 VAE)."""

    name = "wan"
    pipeline_classes = ("WanPipeline",)
    # Self- and cross-attention projections and both feed-forward linears of every block (diffusers' Wan LoRA
    # layout: blocks.N.attn1/attn2.to_q/k/v/out.0, blocks.N.ffn.net.0.proj/net.2).
    lora_target_modules = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                           "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
                           "ffn.net.0.proj", "ffn.net.2")
    default_guidance_scale = 5.0  # WanPipeline.__call__'s guidance_scale
    supports_cfg = True
    default_max_sequence_length = 512  # WanPipeline.__call__'s default
    output = "videos"
    default_num_frames = 33
    #: Videos per VAE decode call. One bounds memory (a 33-frame 480×832 video's decoder activations take GBs);
    #: for tiny videos, where the per-call overhead dominates, a larger value decodes as the pipeline does.
    decode_batch_size = 1

    def __init__(self, pipeline: Any, device: torch.device):
        self.check_pipeline_class(pipeline)  # before anything reads the pipeline's components
        super().__init__(pipeline, device)
        config = pipeline.config
        transformer_2 = getattr(pipeline, "transformer_2", None)
        boundary_ratio = config.get("boundary_ratio")
        if pipeline.transformer is None:
            raise ValueError("wan adapter: this WanPipeline has no transformer (the high-noise expert); the wan "
                             "adapter needs transformer, and transformer_2 with boundary_ratio for Wan 2.2's experts")
        if boundary_ratio is not None and transformer_2 is None:
            raise ValueError(f"wan adapter: this WanPipeline has boundary_ratio {boundary_ratio} but no transformer_2 "
                             "(the low-noise expert); load both experts, or a pipeline without boundary_ratio")
        #: True for TI2V-5B: the transformer takes one timestep per token (``WanPipeline.__call__``'s
        #: ``expand_timesteps`` branch).
        self.expand_timesteps = bool(config.get("expand_timesteps", False))
        patch = tuple(pipeline.transformer.config.patch_size)
        if self.expand_timesteps and patch[1:] != (2, 2):
            raise ValueError(f"wan adapter: expand_timesteps needs transformer patch_size (1, 2, 2) (WanPipeline "
                             f"builds one timestep per 2x2 latent patch); got {patch}")
        #: The two experts as one module (Wan 2.2 A14B), None for one transformer. A pipeline with transformer_2 but
        #: no boundary_ratio samples with ``transformer`` only (``WanPipeline.__call__`` never routes to the
        #: second), and so does the adapter.
        self.experts_module: WanExperts | None = None
        if boundary_ratio is not None:
            boundary = float(boundary_ratio) * float(pipeline.scheduler.config.num_train_timesteps)
            self.experts_module = WanExperts(pipeline.transformer, transformer_2, boundary)
        self.scheduler = euler_scheduler_for(pipeline.scheduler)

    @classmethod
    def check_pipeline_class(cls, pipeline: Any) -> None:
        """Refuse a pipeline of a class this adapter does not drive, in one line naming the adapter that drives it
        (:func:`~mmrl.plugins.flow.adapters.base.refuse_other_pipelines`); ``wan_v2v`` also takes a ``WanPipeline``."""
        refuse_other_pipelines(cls, pipeline)

    # ------------------------------------------------------------------ components
    @property
    def transformer(self) -> nn.Module:
        """The policy: the pipeline's transformer, or both experts as one :class:`WanExperts` (Wan 2.2 A14B)."""
        return self.pipeline.transformer if self.experts_module is None else self.experts_module

    @transformer.setter
    def transformer(self, module: nn.Module) -> None:
        if self.experts_module is not None:
            raise AttributeError("wan adapter: a two-expert pipeline's policy is its experts; set "
                                 "pipeline.transformer or pipeline.transformer_2 instead")
        self.pipeline.transformer = module

    def experts(self) -> dict[str, nn.Module]:
        """``{"transformer": high-noise expert, "transformer_2": low-noise expert}`` for Wan 2.2 A14B, else the one
        transformer."""
        if self.experts_module is None:
            return super().experts()
        return dict(self.experts_module.named_experts())

    def reference_copy(self) -> nn.Module:
        """Full fine-tuning's frozen reference: for two experts, a :class:`WanExperts` with frozen copies of the
        trained experts and the frozen ones shared (not copied: they never change)."""
        if self.experts_module is None:
            return super().reference_copy()
        return self.experts_module.frozen_reference()

    def guidance_for(self, timesteps: Tensor, guidance_scale: GuidanceScale) -> float | Tensor:
        """The CFG scale of each row: a ``(high-noise, low-noise)`` pair becomes ``[n, 1, ...]``, the first scale where
        the row's timestep t >= boundary_ratio · num_train_timesteps (the expert ``transformer`` runs) and the
        second below (``transformer_2``, ``WanPipeline.__call__``'s ``guidance_scale_2``); a float is every row's."""
        if not isinstance(guidance_scale, tuple):
            return guidance_scale
        if self.experts_module is None:
            return guidance_scale[0]
        high, low = guidance_scale
        rows = self.experts_module.high_noise_rows(timesteps)  # [n] bool
        scale = torch.where(rows, torch.tensor(float(high), device=rows.device),
                            torch.tensor(float(low), device=rows.device))
        return scale.view(-1, *([1] * 4))  # [n, 1, 1, 1, 1] against [n, C, F, h, w]

    # ------------------------------------------------------------------ geometry
    @property
    def vae_scale_factor(self) -> int:
        return int(self.vae.config.scale_factor_spatial)  # WanPipeline.vae_scale_factor_spatial

    @property
    def temporal_scale_factor(self) -> int:
        return int(self.vae.config.scale_factor_temporal)  # WanPipeline.vae_scale_factor_temporal

    def resolution_multiple(self) -> int:
        _, patch_h, patch_w = self.transformer.config.patch_size  # (frames, height, width)
        # WanPipeline.check_inputs refuses sides that are not multiples of 16 whatever the model, and __call__ rounds
        # each side down to a multiple of VAE factor × patch (h_multiple_of, w_multiple_of): both must hold.
        return math.lcm(16, self.vae_scale_factor * patch_h, self.vae_scale_factor * patch_w)

    def image_seq_len(self) -> int:
        _, patch_h, patch_w = self.transformer.config.patch_size
        h, w = self.latent_size()
        return self.latent_frames(self.num_frames) * (h // patch_h) * (w // patch_w)

    # ------------------------------------------------------------------ the five operations
    def encode_prompts(self, prompts: list[str], max_sequence_length: int) -> Conditioning:
        embeds, _ = self.pipeline.encode_prompt(
            prompt=prompts, do_classifier_free_guidance=False, num_videos_per_prompt=1,
            max_sequence_length=max_sequence_length, device=self.device,
        )
        return {"prompt_embeds": embeds}  # [n, max_sequence_length, D], zeros after each prompt's tokens

    def noise_shape(self) -> tuple[int, ...]:
        # [C, F_lat, H/s, W/s], as WanPipeline.prepare_latents (s: the VAE's scale_factor_spatial, 8 or Wan 2.2's 16)
        return (self.transformer.config.in_channels, self.latent_frames(self.num_frames), *self.latent_size())

    def model_timesteps(self, latents: Tensor, timesteps: Tensor) -> Tensor:
        """What the transformer's ``timestep`` gets: ``timesteps [n]`` itself, or with ``expand_timesteps`` (TI2V-5B)
        one value per token, ``[n, F_lat · ⌈h/2⌉ · ⌈w/2⌉]``, as ``WanPipeline.__call__`` builds it from its all-ones
        mask (``(mask[0][0][:, ::2, ::2] * t).flatten()``): every token of a text-to-video sample has the step's t."""
        if not self.expand_timesteps:
            return timesteps
        frames, height, width = latents.shape[2:]
        tokens = frames * ((height + 1) // 2) * ((width + 1) // 2)
        return timesteps.float()[:, None].expand(-1, tokens)

    def call_transformer(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: Conditioning,
                         guidance_scale: float) -> Tensor:
        return module(
            hidden_states=latents,  # [n, C, F_lat, h, w]
            # [n] raw t in [0, 1000], as WanPipeline passes t.expand(batch); [n, tokens] with expand_timesteps
            timestep=self.model_timesteps(latents, timesteps),
            encoder_hidden_states=conditioning["prompt_embeds"],
            return_dict=False,
        )[0]

    def latent_statistics(self, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The VAE's per-channel ``(mean, 1 / std)`` ``[1, C, 1, 1, 1]``: normalised latents are
        ``(z − mean) · inverse_std`` (encoding an input) and ``z = x / inverse_std + mean`` (decoding), in the
        pipelines' order of operations."""
        vae = self.vae
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(device, dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(device, dtype)
        return mean, inverse_std

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        vae = self.vae
        mean, inverse_std = self.latent_statistics(latents.device, vae.dtype)
        videos = []
        for part in latents.to(vae.dtype).split(self.decode_batch_size):  # [b, C, F_lat, h, w]
            part = part / inverse_std + mean  # the pipeline's order of operations
            videos.append(vae.decode(part, return_dict=False)[0].float())  # [b, 3, F, H, W] in about [-1, 1]
        return (torch.cat(videos) / 2 + 0.5).clamp(0, 1)  # [N, 3, F, H, W]


class WanExperts(nn.Module):
    """Wan 2.2 A14B's two experts as one policy module: ``transformer`` (the high-noise expert) runs the rows whose
    timestep t >= ``boundary_timestep`` (``boundary_ratio`` · ``num_train_timesteps``, 875 for Wan2.2-T2V-A14B) and
    ``transformer_2`` (the low-noise expert) the others, ``WanPipeline.__call__``'s rule (diffusers 0.42
    ``pipeline_wan.py``: ``if boundary_timestep is None or t >= boundary_timestep``; Wan-Video/Wan2.2@42bf4cf
    ``wan/text2video.py:186`` ``_prepare_model_for_timestep``).

    The route is a function of the timestep alone, and the training forward gives each action the timestep its
    rollout stored (``replay["timesteps"]``), so every trained step is scored by the expert that sampled it and the
    first inner step has ratio 1. The pipeline's batch shares one t; a training micro-batch may mix rows of both
    experts (random trained steps), which are split, run by their experts and put back in order. Flow-Factory routes
    the same way in rollout and training alike (X-GenGroup/Flow-Factory@a0b2bc5
    ``src/flow_factory/models/wan/wan2_t2v.py:474-484``, one function for both).

    The experts stay the pipeline's own modules (``pipeline.transformer`` / ``pipeline.transformer_2``): a LoRA
    injected into them is what the pipeline samples with. The module is the unit the optimizer, DDP, the EMA and
    the KL reference see. Under autograd an expert that gets no row of a call still takes part in the graph with a
    zero gradient (a zero multiple of the sum of its trainable weights): DDP then finds every trained parameter in
    every backward without ``find_unused_parameters``, and the output always has a graph when some expert trains.
    As with the plugin's forced action (``FlowPlugin.forward``), AdamW then applies weight decay and its moments to
    an expert none of whose steps was trained in that optimizer step.

    Args:
        transformer: The high-noise expert.
        transformer_2: The low-noise expert.
        boundary_timestep: The route's threshold on the raw timestep (0-1000).
    """

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module, boundary_timestep: float):
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_timestep = float(boundary_timestep)

    @property
    def config(self) -> Any:
        """The high-noise expert's config (both experts share the architecture: patch size, channels)."""
        return self.transformer.config

    def named_experts(self) -> list[tuple[str, nn.Module]]:
        return [("transformer", self.transformer), ("transformer_2", self.transformer_2)]

    def high_noise_rows(self, timestep: Tensor) -> Tensor:
        """``[n]`` bool: the rows the high-noise expert runs. ``timestep`` is ``[n]`` or per token ``[n, L]`` (the
        row's t is its largest token value, which every token of a text-to-video sample has)."""
        t = timestep.reshape(timestep.shape[0], -1).amax(dim=1) if timestep.ndim > 1 else timestep
        return t >= self.boundary_timestep

    def enable_gradient_checkpointing(self) -> None:
        for _, expert in self.named_experts():
            expert.enable_gradient_checkpointing()

    def frozen_reference(self) -> WanExperts:
        """A frozen :class:`WanExperts` of the current weights: trained experts (any parameter requiring gradients)
        copied, the others shared."""
        from mmrl.policy import frozen_copy

        parts = [frozen_copy(expert) if any(p.requires_grad for p in expert.parameters()) else expert
                 for _, expert in self.named_experts()]
        return WanExperts(*parts, self.boundary_timestep).requires_grad_(False).eval()

    def forward(self, hidden_states: Tensor, timestep: Tensor, encoder_hidden_states: Tensor, *,
                return_dict: bool = False, **kwargs: Any) -> tuple[Tensor]:
        """The velocity of each row from its expert, ``(output [n, C, F, h, w],)`` (the experts' ``return_dict=False``
        tuple; ``return_dict`` is accepted and ignored). Each expert gets its rows in their own dtype (full
        fine-tuning trains float32 experts beside a frozen half-precision one)."""
        high = self.high_noise_rows(timestep)
        outputs, rows, unused = [], [], []
        for (_, expert), mask in zip(self.named_experts(), (high, ~high), strict=True):
            count = int(mask.sum())
            if count == 0:
                unused.append(expert)
                continue
            index = None if count == mask.shape[0] else mask.nonzero().squeeze(1)
            dtype = expert.dtype

            def pick(value: Tensor, index: Tensor | None = index) -> Tensor:
                return value if index is None else value.index_select(0, index)

            output = expert(hidden_states=pick(hidden_states).to(dtype), timestep=pick(timestep),
                            encoder_hidden_states=pick(encoder_hidden_states).to(dtype), return_dict=False,
                            **kwargs)[0]
            outputs.append(output)
            rows.append(index)
        if len(outputs) == 1:
            result = outputs[0]
        else:
            dtype = torch.promote_types(outputs[0].dtype, outputs[1].dtype)
            order = torch.cat([index for index in rows if index is not None])
            result = torch.cat([output.to(dtype) for output in outputs]).index_select(0, torch.argsort(order))
        if torch.is_grad_enabled():
            for expert in unused:
                trainable = [p for p in expert.parameters() if p.requires_grad]
                if trainable:
                    anchor = torch.stack([p.sum() for p in trainable]).sum()
                    result = result + (anchor * 0).to(result.dtype)
        return (result,)


def euler_scheduler_for(scheduler: Any) -> Any:
    """A first-order ``FlowMatchEulerDiscreteScheduler`` with the flow shift of ``scheduler``: the scheduler itself
    if it is one, else a new one built from the ``flow_shift`` and ``num_train_timesteps`` of its config (Wan's
    ``UniPCMultistepScheduler``); a scheduler with neither is refused."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return scheduler.__class__.from_config(scheduler.config)
    config = scheduler.config
    if config.get("flow_shift") is None or config.get("prediction_type") != "flow_prediction":
        raise ValueError(f"wan adapter: {type(scheduler).__name__} has no flow_shift with prediction_type "
                         "'flow_prediction'; expected Wan's UniPCMultistepScheduler or FlowMatchEulerDiscreteScheduler")
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=config.num_train_timesteps,
                                           shift=float(config.flow_shift))
