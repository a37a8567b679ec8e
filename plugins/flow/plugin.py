"""The flow-matching plugin: GRPO on text-to-image rectified-flow models (SD3/SD3.5, FLUX.1) through diffusers.

How it maps onto the rollout contract (docs/flow.md has the long version):

- an action is one trained SDE step x_t → x_next of one sample; A = the number of trained steps per sample
  (:mod:`.schedule`: Flow-GRPO's timestep fraction, DanceGRPO's random subset or Flow-GRPO-Fast's window), and
  ``replay["step_index"]`` says which denoising step each column is. Untrained steps are sampled but not stored,
  so the mask is all ones. ``plugin.credit`` (:mod:`.credit`, docs/credit.md) chooses how the reward is credited
  to the steps: Flow-GRPO's uniform credit (the default, as above), Chunk-GRPO's chunks, TempFlow-GRPO's branching,
  MixGRPO's sliding window or BranchGRPO's tree; those set the mask, chunk ids, action weights and per-action
  rewards of the contract;
- ``old_logp[n, j]`` is the Gaussian log-density of the sampled x_next (:func:`~.sde.sde_step`, float32);
- ``replay`` holds, per sample and column, x before the step and the sampled x_next (float32), σ, σ_next and the
  model timestep, plus the sample's prompt embeddings; :meth:`FlowPlugin.forward` recomputes a column's velocity
  through the very function the rollout used (:meth:`~.adapters.base.FlowAdapter.velocity`, CFG included) and
  scores the stored x_next with :func:`~.sde.sde_step`, so the first inner step has ratio 1;
- ``payload["images"]`` ``[N, 3, H, W]`` in [0, 1] (decoded by the VAE; video adapters: ``payload["videos"]``
  ``[N, 3, F, H, W]``) and ``payload["prompts"]`` for rewards; image-editing adapters (FLUX.1 Kontext) add
  ``payload["condition_images"]``, each row's (first) input image as the model saw it, and the encoded image(s) to
  the replay; rows naming several input images (Qwen-Image-Edit-Plus, FLUX.2) add ``more_condition_images`` and
  ``condition_image_counts`` (:meth:`~.sampler.FlowSampler.row_conditioning`); Wan video-to-video adds
  ``condition_videos`` ``[N, 3, F, H, W]``, and LTX-2 its waveforms ``audios`` ``[N, channels, samples]`` with
  ``audio_sample_rate`` ``[N]`` (:meth:`~.adapters.base.FlowAdapter.decode_extra`);
- with ``plugin.buckets`` (:mod:`.buckets`) each row has its own output size, the nearest bucket by aspect ratio;
  :meth:`FlowPlugin.row_buckets` tells the core, which never mixes buckets in a batch, and a training rollout
  carries its size in ``replay["output_size"]`` ``[N, 2]`` for the forward;
- all randomness comes from the per-sample seeds (or, with ``share_initial_noise``, from the group id), so a
  rollout does not depend on how samples are laid out over processes or rollout batches;
- the KL is Flow-GRPO's KL between the Gaussian means of the policy and the reference, the reference being the
  same transformer with its LoRA adapter disabled (full fine-tuning: a frozen copy, kept when ``kl_coef > 0``);
- with ``plugin.likelihood: matching`` (Advantage Weighted Matching, :mod:`.matching`) the rollout trains no SDE step:
  its K columns are training times of the final sample, ``old_logp`` is None, and :meth:`FlowPlugin.forward` returns
  the negated weighted flow-matching loss at each time and the velocity KL to the reference;
- with ``plugin.likelihood: nft`` (DiffusionNFT, :mod:`.nft`) the rollout is sampled by the old (EMA) policy and
  trains no SDE step: its 2K columns are the implicit positive and negative policies' x₀ errors at K training times
  of the final sample, for ``algorithm.policy_loss: nft``; the old policy travels with checkpoints;
- with ``plugin.likelihood: dgpo`` (DGPO, :mod:`.dgpo`) the ODE rollout trains no SDE step: its M columns are the
  negated flow-matching errors of the final sample at grid times shared by the step, with noise shared within each
  group, and the forward returns the reference's as ``ref_logp``, for ``algorithm.policy_loss: dgpo``; its optional
  fast EMA scores the rollout's ``old_logp`` and travels with checkpoints.

This module holds the contract only. The config is :mod:`.config` (re-exported here), the sampling engine that
rollouts, forwards and the credit strategies share is :class:`~.sampler.FlowSampler`, and the SDE kinds are the
classes of :data:`~.sde.sde_kind_registry`.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mmrl.config import ConfigError
from mmrl.extras import require_extra
from mmrl.plugin import Plugin, PolicyOutput, PromptBatch, Runtime
from mmrl.plugins.flow.buckets import BUCKET_KEY, assign_buckets, bucket_name, condition_size_for, row_size
from mmrl.plugins.flow.config import FlowLoraConfig, FlowPluginConfig, adapter_class, load_rows, row_image_paths
from mmrl.plugins.flow.credit import credit_strategies
from mmrl.plugins.flow.dgpo import DGPOLikelihood
from mmrl.plugins.flow.matching import MatchingLikelihood
from mmrl.plugins.flow.nft import NFTLikelihood
from mmrl.plugins.flow.sampler import FlowSampler
from mmrl.policy import (
    DIFFUSERS_LORA_WEIGHTS,
    attach_lora,
    check_reference_sync,
    has_lora,
    load_policy,
    reference_policy,
    save_policy,
)
from mmrl.rollout import Rollout, RolloutError

LORA_WEIGHTS = DIFFUSERS_LORA_WEIGHTS  # diffusers' LoRA file: `pipe.load_lora_weights(folder)` reads it
MATCHING_EMA_FILE = "matching_ema.safetensors"  # plugin.matching.ema_kl_coef's EMA weights, in checkpoints
NFT_OLD_FILE = "nft_old.safetensors"  # plugin.likelihood nft's old (EMA) policy, in checkpoints
DGPO_EMA_FILE = "dgpo_ema.safetensors"  # plugin.dgpo.ema_ref's fast EMA, in checkpoints
DGPO_AGGREGATIONS = ("token_mean", "seq_mean_token_mean")  # equal with dgpo's full masks: the mean over (sample, time)
NFT_AGGREGATIONS = ("token_mean", "seq_mean_token_mean")  # equal with nft's full masks: the mean over (sample, time)

__all__ = ["LORA_WEIGHTS", "FlowLoraConfig", "FlowPlugin", "FlowPluginConfig"]


def _check_sizes(config: FlowPluginConfig, adapter: Any) -> None:
    """Every size option a multiple of the adapter's VAE factor × patch size, each refusal naming the option the user
    wrote; ``condition_size`` / ``eval_condition_size`` only for adapters that size input images on their own."""
    multiple = adapter.resolution_multiple()
    why = f"{config.model} (the {adapter.name} pipeline's VAE downsampling x patch size)"
    sides = [*config.size_options(), ("eval_height", config.eval_height), ("eval_width", config.eval_width)]
    for key, pixels in sides:  # (height, width), each named by the option that set it
        if pixels is not None and pixels % multiple:
            raise ConfigError(f"plugin.{key}", pixels, f"a multiple of {multiple} for {why}")
    for key in ("buckets", "eval_buckets"):
        for size in getattr(config, key) or []:
            if any(side % multiple for side in size):
                raise ConfigError(f"plugin.{key}", getattr(config, key), f"[height, width] sizes of multiples of "
                                  f"{multiple} for {why}; {size} is not")
    for key in ("condition_size", "eval_condition_size"):
        size = getattr(config, key)
        if size is not None and not adapter.condition_size_free:
            raise ConfigError(f"plugin.{key}", size, f"null: the {adapter.name} adapter's input images are brought "
                              "to the generated size (condition_size is for the image-editing adapters "
                              "flux_kontext, qwen_image_edit, qwen_image21_edit, flux2_edit, flux2_klein_edit)")
        if size is not None and any(side % multiple for side in size):
            raise ConfigError(f"plugin.{key}", size, f"two multiples of {multiple} for {why}")


def _sharded_launch() -> str | None:
    """``"FSDP"`` or ``"DeepSpeed ZeRO-3"`` when this process was launched to train sharded parameters, else None.

    Read where Accelerate reads it when the trainer builds its Accelerator (before the plugin): ``accelerate launch``
    sets ``ACCELERATE_USE_FSDP`` / ``ACCELERATE_USE_DEEPSPEED`` and ``ACCELERATE_DEEPSPEED_ZERO_STAGE`` or
    ``ACCELERATE_DEEPSPEED_CONFIG_FILE`` (accelerate ``utils/launch.py``; ``DeepSpeedPlugin.__post_init__`` reads
    the stage from them), as :func:`mmrl.trainer.trainer._import_group_default_modules` reads the FSDP flag."""
    import os

    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return "FSDP"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    config_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if config_file != "none" and Path(config_file).is_file():
        stage = str(json.loads(Path(config_file).read_text()).get("zero_optimization", {}).get("stage", stage))
    return "DeepSpeed ZeRO-3" if stage == "3" else None


def _row_source(config: FlowPluginConfig, split: str) -> tuple[Path | None, str]:
    """(the folder relative paths of ``split``'s rows are read from, None for an inline prompt list; its name for
    errors), as :func:`~.config.load_rows` picks the split's source."""
    inline = config.prompts if split == "train" else config.eval_prompts
    if inline is not None:
        return None, f"plugin.{'prompts' if split == 'train' else 'eval_prompts'}"
    source = config.dataset if split == "train" else config.eval_dataset
    if split == "eval" and source is None and config.dataset is not None and Path(config.dataset).is_dir():
        source = config.dataset
    if source is None:
        return None, f"plugin.{'dataset' if split == 'train' else 'eval_dataset'}"
    path = Path(source).expanduser()
    return (path if path.is_dir() else path.parent), str(source)


class FlowPlugin(Plugin):
    """Group-relative RL for diffusers flow-matching text-to-image models (Flow-GRPO, DanceGRPO, Flow-GRPO-Fast, and
    the credit strategies of :mod:`.credit`)."""

    name = "flow"
    config_class = FlowPluginConfig
    # Checkpoints and exports of a LoRA: diffusers' file, which `pipeline.load_lora_weights(folder)` loads. Full
    # fine-tuning exports the transformer's save_pretrained folder (docs/flow.md, "Saving and exporting").
    lora_format = "diffusers_lora"
    # Each action is its own transformer call: the trainer can back-propagate one denoising step at a time.
    supports_action_chunks = True

    @classmethod
    def check_config(cls, train_config: Any) -> None:
        """Refuse ``algorithm.ref_sync_every`` with LoRA (:func:`mmrl.policy.check_reference_sync`), and
        ``algorithm.mask_truncated`` (a denoising trajectory is never cut short: its rollouts set no ``truncated``) and
        ``algorithm.top_entropy_quantile``, ``algorithm.entropy_target`` and ``algorithm.entropy_coef`` (no per-step
        entropy) and ``algorithm.kl_importance_weighted`` (its KL is exact per step, not a sample estimate); with
        ``likelihood: matching`` a ratio level other than ``token`` (AWM's ``exp_first``) or ``sequence``
        (``sum_first``); with ``likelihood: nft`` what would make the loss differ from DiffusionNFT's
        (:meth:`_check_nft`), and ``policy_loss: nft`` without it; the same for ``likelihood: dgpo`` and DGPO
        (:meth:`_check_dgpo`)."""
        check_reference_sync(train_config)
        if train_config.algorithm.mask_truncated:
            raise ConfigError("algorithm.mask_truncated", True, "false with plugin flow (a denoising trajectory always "
                              "runs all its steps; nothing is truncated)")
        train_config.algorithm.refuse_entropy_readers("plugin flow (it reports no per-step entropy)")
        if train_config.algorithm.kl_importance_weighted:
            raise ConfigError("algorithm.kl_importance_weighted", True, "false with plugin flow (its KL is the closed "
                              "form between the two Gaussian steps at the sampled state, not an estimate from the "
                              "sampled action that a ratio could reweight)")
        if train_config.plugin.config.likelihood == "matching":
            from mmrl.trainer.learn import ratio_level

            level = ratio_level(train_config)
            if level not in ("token", "sequence"):
                raise ConfigError("algorithm.policy_loss.ratio_level", level, "'token' (AWM's exp_first) "
                                  "or 'sequence' (sum_first) with plugin.likelihood matching (its rollouts have no "
                                  "chunks)")
            matching, chunk = train_config.plugin.config.matching, train_config.algorithm.action_chunk_size
            if matching.ema_kl_coef > 0 and chunk is not None and matching.num_times % chunk:
                # The EMA KL is each backward pass's mean over its (sample, time) pairs, and the learner averages it
                # over the step's backward passes: a short last chunk would weigh its times more than the others.
                raise ConfigError("algorithm.action_chunk_size", chunk, f"null or a divisor of "
                                  f"plugin.matching.num_times ({matching.num_times}) with matching.ema_kl_coef "
                                  f"{matching.ema_kl_coef:g} > 0 (equal chunks weigh every time of the EMA KL alike)")
        # The objectives whose loss and likelihood come as a pair: each checks its settings, and its loss is refused
        # with any other likelihood (it reads what only its own columns hold).
        likelihood, loss = train_config.plugin.config.likelihood, train_config.algorithm.policy_loss.name
        pairs = (("dgpo", cls._check_dgpo, "the reference's log-likelihood, which plugin flow returns with"),
                 ("nft", cls._check_nft, "the columns of"))
        for name, check, reads in pairs:
            if likelihood == name:
                check(train_config)
            elif loss == name:
                raise ConfigError("algorithm.policy_loss.name", name, f"a loss other than {name} with "
                                  f"plugin.likelihood {likelihood!r}; {name} reads {reads} plugin.likelihood {name}")

    @staticmethod
    def _check_nft(train_config: Any) -> None:
        """The settings under which the learner's loss and gradient are DiffusionNFT's (:mod:`.nft`): the ``nft``
        policy loss, a mean over (sample, column) aggregation, action chunks of whole times, no advantage clip below
        the loss's A_max, and the old policy's step counter moving by the optimizer steps of a training step."""
        algorithm, nft = train_config.algorithm, train_config.plugin.config.nft
        if algorithm.policy_loss.name != "nft":
            raise ConfigError("algorithm.policy_loss.name", algorithm.policy_loss.name, "nft with plugin.likelihood "
                              "nft (its columns are x0 errors, not log-probs a ratio loss could read)")
        if algorithm.off_policy_mask_threshold is not None:
            # OPSM reads the mean of old_logp − logp as a log-ratio; nft's columns would make it a difference of x0
            # errors, and force the old-policy pass that the nft loss otherwise skips (reads_old_logp False).
            raise ConfigError("algorithm.off_policy_mask_threshold", algorithm.off_policy_mask_threshold, "null with "
                              "plugin.likelihood nft (its columns are x0 errors, not log-probs whose mean log-ratio "
                              "measures how far the policy moved)")
        if algorithm.aggregation not in NFT_AGGREGATIONS:
            raise ConfigError("algorithm.aggregation", algorithm.aggregation, f"one of {', '.join(NFT_AGGREGATIONS)} "
                              "with plugin.likelihood nft (upstream's mean over samples and times)")
        if algorithm.action_chunk_size is not None and algorithm.action_chunk_size % 2:
            raise ConfigError("algorithm.action_chunk_size", algorithm.action_chunk_size, "null or an even number "
                              "with plugin.likelihood nft (a time's two columns share its forwards; 2: one time per "
                              "backward, as upstream)")
        limit = float(algorithm.policy_loss.options.get("adv_clip_max", 5.0))
        if not limit > 0:
            raise ConfigError("algorithm.policy_loss.adv_clip_max", limit, "a number > 0 (A_max of nft's optimality "
                              "weight r = clamp(A/(2*A_max) + 1/2, 0, 1))")
        if algorithm.advantage_clip is not None and algorithm.advantage_clip < limit:
            raise ConfigError("algorithm.advantage_clip", algorithm.advantage_clip, f"null or >= the nft loss's "
                              f"adv_clip_max ({limit:g}) with plugin.likelihood nft (the loss clips at adv_clip_max "
                              "itself; a tighter clip changes its optimality weights)")
        steps = algorithm.minibatches * algorithm.inner_epochs
        if nft.optimizer_steps_per_step != steps:
            raise ConfigError("plugin.nft.optimizer_steps_per_step", nft.optimizer_steps_per_step, f"{steps} "
                              "(algorithm.minibatches x inner_epochs: the optimizer steps of a training step, which "
                              "the old policy's decay counts)")

    @staticmethod
    def _check_dgpo(train_config: Any) -> None:
        """The settings under which the learner's loss and gradient are DGPO's (:mod:`.dgpo`): the ``dgpo`` policy
        loss, a mean over (sample, time) aggregation (the reference it reads is kept whatever kl_coef: the loss
        declares ``ref_logp``), and with the fast EMA (``dgpo.ema_ref``, needed by the loss's ``clip_range`` and
        ``reference: old``) one optimizer step per training step, whose rollout scores the EMA's old log-probs."""
        algorithm, plugin = train_config.algorithm, train_config.plugin.config
        dgpo, options = plugin.dgpo, algorithm.policy_loss.options
        if algorithm.policy_loss.name != "dgpo":
            raise ConfigError("algorithm.policy_loss.name", algorithm.policy_loss.name, "dgpo with plugin.likelihood "
                              "dgpo (its group weights need the reference's errors, which only dgpo reads)")
        if algorithm.aggregation not in DGPO_AGGREGATIONS:
            raise ConfigError("algorithm.aggregation", algorithm.aggregation, f"one of {', '.join(DGPO_AGGREGATIONS)}"
                              " with plugin.likelihood dgpo (upstream's mean over samples and times)")
        for key, reads_ema in (("clip_range", options.get("clip_range") is not None),
                               ("reference", options.get("reference", "ref") == "old")):
            if reads_ema and not dgpo.ema_ref:
                raise ConfigError(f"algorithm.policy_loss.{key}", options.get(key), "its default with "
                                  "plugin.dgpo.ema_ref false: it reads the old log-probs, which are the fast EMA's "
                                  "only with plugin.dgpo.ema_ref true (set it)")
        if dgpo.ema_ref:
            if algorithm.minibatches * algorithm.inner_epochs != 1:
                key = "algorithm.minibatches" if algorithm.minibatches != 1 else "algorithm.inner_epochs"
                raise ConfigError(key, getattr(algorithm, key.split(".")[1]), "1 with plugin.dgpo.ema_ref (upstream "
                                  "moves the fast EMA after every optimizer step; the rollout scores it once per "
                                  "training step: one optimizer step per step, as the released recipes)")
            if algorithm.recompute_old_logp:
                raise ConfigError("algorithm.recompute_old_logp", True, "false with plugin.dgpo.ema_ref (the old "
                                  "log-probs are the fast EMA's, which the rollout scored)")

    def __init__(self, config: FlowPluginConfig, runtime: Runtime):
        require_extra("flow", "plugin 'flow'")  # one line naming mmrl[flow] instead of an import traceback
        super().__init__(config, runtime)
        self.adapter = adapter_class(config).from_pretrained(config.model, dtype=runtime.dtype,
                                                              device=runtime.device)
        adapter = self.adapter
        pipeline = adapter.pipeline
        pipeline.to(runtime.device)
        for component in pipeline.components.values():
            if isinstance(component, nn.Module):
                component.requires_grad_(False).eval()
        _check_sizes(config, adapter)
        if config.likelihood in ("matching", "nft", "dgpo"):
            self._refuse_unscorable_elements(config, adapter)
        adapter.set_size(*config.resolved_size())
        self.condition_sizes = config.resolved_condition_sizes()  # (training, evaluation); None: the output size
        adapter.set_condition_size(self.condition_sizes[0])
        frames_problem = adapter.frames_requirement(config.num_frames)
        if frames_problem is not None:
            raise ConfigError("plugin.num_frames", config.num_frames, frames_problem)
        adapter.num_frames = config.num_frames or adapter.default_num_frames or 1
        self.cfg = adapter.supports_cfg and adapter.cfg_by_default if config.cfg is None else config.cfg
        if self.cfg and not adapter.supports_cfg:
            raise ConfigError("plugin.cfg", config.cfg,
                              f"false or null: the {adapter.name} adapter {adapter.cfg_refusal}")
        try:  # family-specific settings (plugin.adapter_options), refused by adapters that take none
            adapter.configure(dict(config.adapter_options), cfg=self.cfg)
        except ValueError as error:
            raise ConfigError("plugin.adapter_options", config.adapter_options, str(error)) from None
        for key in ("cfg_normalization", "cfg_truncation"):  # Z-Image's optional guidance rules
            value = getattr(config, key)
            if value is not None and not (adapter.guidance_rules and self.cfg):
                why = "takes no such rule" if not adapter.guidance_rules else "guides without cfg (cfg is false)"
                raise ConfigError(f"plugin.{key}", value, f"null: the {adapter.name} adapter {why}; "
                                  "cfg_normalization and cfg_truncation are ZImagePipeline's, with cfg")
            if adapter.guidance_rules:
                setattr(adapter, key, value)
        self.guidance_scale, self.eval_guidance_scale = config.resolved_guidance_scales(
            adapter.default_guidance_scale, guided_by_cfg=not adapter.guidance_embedded,
            unguided=adapter.unguided_scale, cfg=self.cfg)
        experts = adapter.experts()
        if len(experts) > 1:  # Wan 2.2 A14B: each expert its own scale (a (high-noise, low-noise) pair)
            self.guidance_scale, self.eval_guidance_scale = config.resolved_expert_guidance_scales(
                self.guidance_scale, self.eval_guidance_scale)
        elif config.guidance_scale_2 is not None:
            raise ConfigError("plugin.guidance_scale_2", config.guidance_scale_2, f"null: {config.model} has one "
                              "transformer (guidance_scale_2 is the low-noise expert's scale of a two-expert Wan 2.2 "
                              "pipeline with boundary_ratio)")
        names = list(experts) if config.train_experts is None else list(config.train_experts)
        if any(name not in experts for name in names):
            raise ConfigError("plugin.train_experts", config.train_experts, f"null or a non-empty list of "
                              f"{', '.join(experts)} (the experts of {config.model})")
        #: The experts that train, by pipeline component name (every one unless plugin.train_experts says otherwise).
        self.trained_experts = {name: experts[name] for name in names}

        self.reference: nn.Module | None = None
        if config.lora is None:
            # Full fine-tuning: float32 master weights (autocast runs the forward in mixed precision). A frozen
            # expert keeps the loading dtype (WanExperts casts each expert's inputs to its own dtype).
            for expert in self.trained_experts.values():
                expert.to(torch.float32).requires_grad_(True)
            self.input_dtype = torch.float32
            if runtime.needs_reference:  # the KL needs the initial weights; LoRA disables the adapter instead
                self.reference = adapter.reference_copy()
        else:
            self.input_dtype = runtime.dtype  # the frozen base weights' dtype
            for name, expert in self.trained_experts.items():
                attach_lora(expert, config.lora, default_targets=adapter.lora_target_modules,
                            what=f"the {adapter.name} {name}", base_model=config.model)
        if config.gradient_checkpointing:
            for expert in self.trained_experts.values():
                expert.enable_gradient_checkpointing()
        images = adapter.name if adapter.image_conditioned else None  # every row names its input image(s)
        self._rows = {split: load_rows(config, split, images=images, max_images=adapter.max_condition_images,
                                       last_image=adapter.takes_last_image) for split in ("train", "eval")}
        for split, rows in self._rows.items():  # rows with inputs the adapter reads itself (Wan video-to-video)
            folder, source = _row_source(config, split)
            self._rows[split] = adapter.prepare_rows(rows, folder, source)
        last_images = False  # whether the run's rows name last frames (Wan first-and-last-frame video)
        if adapter.takes_last_image:
            rows = [row for split_rows in self._rows.values() for row in split_rows]
            with_last = sum(row.get("last_image") is not None for row in rows)
            problem = adapter.last_image_problem(with_last, len(rows))
            if problem is not None:
                raise ValueError(f"{config.dataset}: {problem}")
            last_images = with_last > 0
        self._buckets = {split: config.resolved_buckets(split) for split in ("train", "eval")}
        for split, buckets in self._buckets.items():  # each row's size: a bucket by its aspect ratio
            source = config.dataset if split == "train" else config.eval_dataset or config.dataset
            source = str(source or ("plugin.prompts" if split == "train" else "plugin.eval_prompts"))
            if buckets is not None:
                assign_buckets(self._rows[split], buckets, default=config.resolved_size(),
                               aspect_image=adapter.aspect_image if adapter.image_conditioned else None,
                               source=source)
            else:  # an aspect ratio no bucket reads would be ignored without a word
                asking = next((number for number, row in enumerate(self._rows[split], start=1)
                               if "aspect_ratio" in row), None)
                if asking is not None:
                    raise ValueError(f"{source} row {asking} names an 'aspect_ratio', which only plugin.buckets reads "
                                     "(every row is generated at height x width without them): set plugin.buckets")
        # the most input images a row names: every batch's rows are laid out for that many (one: no change at all)
        image_slots = max((len(row_image_paths(row)) for rows in self._rows.values() for row in rows), default=1) \
            if adapter.image_conditioned else 1
        #: The sampling engine (:mod:`.sampler`), which the credit strategy builds its rollouts with.
        self.sampler = FlowSampler(config, runtime, adapter, cfg=self.cfg, guidance_scale=self.guidance_scale,
                                   eval_guidance_scale=self.eval_guidance_scale, input_dtype=self.input_dtype,
                                   max_sequence_length=config.max_sequence_length
                                   or adapter.default_max_sequence_length, image_slots=image_slots,
                                   last_images=last_images)
        self.credit = credit_strategies.get(config.credit.strategy)(config)
        #: ``likelihood: matching``: AWM's rollouts and scoring (:mod:`.matching`); None for SDE log-probs.
        self.matching = MatchingLikelihood(config.matching, self.sampler, runtime) \
            if config.likelihood == "matching" else None
        #: ``likelihood: nft``: DiffusionNFT's rollouts (by the old policy) and scoring (:mod:`.nft`); None otherwise.
        self.nft = NFTLikelihood(config.nft, self.sampler, runtime, config.nft_num_times()) \
            if config.likelihood == "nft" else None
        #: ``likelihood: dgpo``: DGPO's rollouts and scoring (:mod:`.dgpo`); None otherwise.
        self.dgpo = DGPOLikelihood(config.dgpo, self.sampler, runtime) if config.likelihood == "dgpo" else None
        if self.dgpo is not None and config.dgpo.kl_cfg > 1 and not self.cfg:
            raise ConfigError("plugin.dgpo.kl_cfg", config.dgpo.kl_cfg, f"1 with plugin.cfg false on {config.model}: "
                              "a guided reference needs the unconditional pass (set plugin.cfg true and "
                              "guidance_scale 1.0 for unguided rollouts)")
        if self._held_copies():
            sharding = _sharded_launch()
            if sharding is not None:
                what = "plugin.likelihood nft" if self.nft is not None else "plugin.matching.ema_kl_coef > 0"
                if self.dgpo is not None:
                    what = "plugin.dgpo.ema_ref"
                raise ConfigError("plugin.likelihood", config.likelihood, f"a data-parallel (DDP) launch, not "
                                  f"{sharding}, with {what}: its copy of the trained parameters would hold this "
                                  "process's shard, and the main process alone saves it")

    @staticmethod
    def _refuse_unscorable_elements(config: FlowPluginConfig, adapter: Any) -> None:
        """``likelihood: matching | nft`` take their errors over every element of the adapter's latent, so each must
        be generated. Wan 2.2 TI2V-5B image-to-video (``wan_i2v`` on an ``expand_timesteps`` checkpoint) keeps the
        image's latent frame inside the latent: the transformer sees the image there at timestep 0 and the frame is
        replaced before decoding (:meth:`~.adapters.wan_i2v.WanImageToVideoAdapter.finalize`), so its elements would
        enter AWM's (v − (ε − x₀))² and DiffusionNFT's x₀ errors and adaptive weights as noise. The other
        image-conditioned adapters hold only generated elements: the editing ones cut the condition tokens from the
        transformer's output (flux_kontext, qwen_image_edit, flux2_edit, longcat_image_edit), LTX-2 drops the
        image's tokens from its latent (``ltx2_i2v``), and Wan 2.1/2.2 A14B and HunyuanVideo-1.5 image-to-video give
        the image through extra channels while every latent frame is generated."""
        if adapter.name == "wan_i2v" and getattr(adapter, "expand_timesteps", False):
            raise ConfigError("plugin.likelihood", config.likelihood, f"sde with {config.model} (adapter wan_i2v on "
                              "an expand_timesteps checkpoint, Wan 2.2 TI2V-5B): its first latent frame is the given "
                              "image, not generated, and the matching and nft errors would count it")

    @property
    def model_evaluations(self) -> dict[str, int]:
        """Transformer rows evaluated (one row = one sample's velocity; a CFG pass counts once), by phase."""
        return self.sampler.model_evaluations

    # ------------------------------------------------------------------ contract
    def policy(self) -> nn.Module:
        return self.adapter.transformer

    def dataset(self, split: str) -> list[dict[str, Any]]:
        if split not in self._rows:
            raise KeyError(f"flow plugin has splits {sorted(self._rows)}, not {split!r}")
        return self._rows[split]

    def row_buckets(self, split: str) -> list[str] | None:
        """With ``plugin.buckets``, each row's output size ``"{height}x{width}"``: the core draws every training step
        from one and evaluates each apart; None without buckets (every row at ``height`` x ``width``)."""
        if self._buckets[split] is None:
            return None
        return [bucket_name(row_size(row)) for row in self.dataset(split)]

    def max_actions(self) -> int:
        return self.config.num_actions()

    @torch.no_grad()
    def rollout(self, policy: nn.Module, batch: PromptBatch) -> Rollout:
        split = "train" if batch.training else "eval"
        if self._buckets[split] is not None:  # the rows' bucket, the adapter back at the run's size after
            size = self._batch_image_size(batch.rows)
            condition = condition_size_for(size, self.condition_sizes[0 if batch.training else 1],
                                           self.adapter.resolution_multiple())
            with self.adapter.sized(*size, condition=condition):
                if not batch.training:
                    return self.sampler.evaluation_rollout(policy, batch)
                rollout = self._training_rollout(policy, batch)
            # the training forward regenerates at this size: every sample carries it
            rollout.replay[BUCKET_KEY] = torch.tensor([size], dtype=torch.long).expand(len(batch), 2).clone()
            return rollout
        if not batch.training:  # at plugin.eval_height x eval_width, the adapter back at the training size after
            with self.adapter.sized(*self.config.resolved_eval_size(), condition=self.condition_sizes[1]):
                return self.sampler.evaluation_rollout(policy, batch)
        return self._training_rollout(policy, batch)

    def _training_rollout(self, policy: nn.Module, batch: PromptBatch) -> Rollout:
        """The credit strategy's rollout, or with ``likelihood: matching`` AWM's (:meth:`.MatchingLikelihood.rollout`:
        no SDE step is trained, the K training times are drawn)."""
        if self.matching is not None:
            return self.matching.rollout(policy, batch)
        if self.nft is not None:
            return self.nft.rollout(policy, batch)
        if self.dgpo is not None:
            return self.dgpo.rollout(policy, batch)
        return self.credit.rollout(self.sampler, policy, batch)

    @property
    def redraws_per_epoch(self) -> bool:
        """With ``likelihood: matching`` and ``matching.redraw_per_epoch`` each inner epoch has its own times and
        noise (:meth:`.MatchingLikelihood.num_draws` > 1): the core scores the old policy on each epoch's draw."""
        return any(holder is not None and holder.num_draws() > 1 for holder in (self.matching, self.nft, self.dgpo))

    def start_inner_epoch(self, epoch: int) -> None:
        """Select the matching draw of inner epoch ``epoch`` (SDE log-probs draw nothing per epoch)."""
        if self.matching is not None:
            self.matching.epoch = int(epoch)
        if self.nft is not None:
            self.nft.epoch = int(epoch)
        if self.dgpo is not None:
            self.dgpo.epoch = int(epoch)

    @staticmethod
    def _batch_image_size(rows: list[dict[str, Any]]) -> tuple[int, int]:
        """The one bucket of a batch's rows (the core never mixes them); a mixed batch is a RolloutError."""
        sizes = {row_size(row) for row in rows}
        if len(sizes) != 1:
            raise RolloutError(f"a batch mixes the output sizes {sorted(sizes)} of plugin.buckets; rows of different "
                               "buckets cannot share a batch (the trainer draws each step from one bucket)")
        return sizes.pop()

    def action_rewards(self, rollout: Rollout, rewards: Tensor) -> Tensor | None:
        """Per-action rewards of the credit strategy ('branch': the sample's reward at its branch point; 'tree': the
        mean reward of the leaves below each edge), None for one advantage per sample."""
        return self.credit.action_rewards(rollout, rewards)

    def forward(
        self, policy: nn.Module, rollout: Rollout, *, need_reference: bool, actions: Tensor | None = None
    ) -> PolicyOutput:
        """Recompute the log-densities of the stored actions (and the KL to the reference) with gradients.

        ``rollout.old_logp`` may be None: the trainer passes None when its training forward is itself the old policy
        (``algorithm.recompute_old_logp`` with one optimizer step per rollout); the actions that are not recomputed
        then report 0 (the learner takes the detached output as the old log-probs, so any constant gives ratio 1),
        and RatioNorm takes the current transition means as the old ones. With ``credit.ratio_norm`` the output
        carries the transition means of every recomputed action in ``PolicyOutput.replay["means"]`` (the stored
        ones elsewhere): the learner's recompute pass stores them as the old means, which RatioNorm's ratio depends
        on (:func:`~mmrl.plugins.flow.credit.guard.ratio_norm_log_ratio`).
        """
        self.credit.forward_check(actions)
        replay = rollout.replay
        if self.matching is not None:  # AWM: the columns are training times (every action is active)
            width = int(replay["matching_times"].shape[2])
            columns = list(range(width)) if actions is None else [int(c) for c in actions.tolist()]
            reference = self._reference_module if need_reference else None
            with self._rollout_size(rollout):
                logp, kl, aux = self.matching.score(policy, rollout, columns, reference=reference)
            return PolicyOutput(logp=logp, kl=kl, aux_loss=aux)
        if self.nft is not None:  # DiffusionNFT: columns (2k, 2k + 1) are time k's (e⁺/β, e⁻/β)
            width = int(replay["nft_times"].shape[2]) * 2
            columns = list(range(width)) if actions is None else [int(c) for c in actions.tolist()]
            reference = self._reference_module if need_reference else None
            with self._rollout_size(rollout):
                values, kl = self.nft.score(policy, rollout, columns, reference=reference)
            return PolicyOutput(logp=values, kl=kl)
        if self.dgpo is not None:  # DGPO: the columns are the step's shared times
            width = int(replay["dgpo_times"].shape[2])
            columns = list(range(width)) if actions is None else [int(c) for c in actions.tolist()]
            reference = self._reference_module if need_reference else None
            with self._rollout_size(rollout):
                logp, ref_logp, kl = self.dgpo.score(policy, rollout, columns, reference=reference)
            return PolicyOutput(logp=logp, ref_logp=ref_logp, kl=kl)
        width = int(replay["latents"].shape[1])
        columns = list(range(width)) if actions is None else [int(c) for c in actions.tolist()]
        if any(c >= width for c in columns):
            raise RolloutError(f"flow forward asked for action columns {columns} of a rollout with {width} steps")
        ratio_norm = self.config.credit.ratio_norm
        if ratio_norm and "means" not in replay:
            raise RolloutError("credit.ratio_norm needs the old transition means (replay['means']) of the rollout")
        # Actions that cannot contribute (mask 0: untrained chunks, shared tree edges, padding; weight 0: pruned
        # edges) keep their old log-prob (ratio 1, no gradient) and cost no transformer call.
        active = rollout.mask > 0  # [n, len(columns)]
        if rollout.action_weights is not None:
            active = active & (rollout.action_weights != 0)
        forced = torch.is_grad_enabled() and not bool(active.any())
        if forced:
            # Nothing here is trained (e.g. a micro-batch of tree members that share every edge of this column), but
            # the trainer back-propagates every forward: recompute one action so that the output has a graph through
            # the policy. Its policy term is masked or weighted to 0; its KL is zeroed below (the trainer does not
            # weight the KL), so the gradient is 0.
            active = active.clone()
            active[0, 0] = True
        reference = self._reference_module if need_reference else None
        with self._rollout_size(rollout):
            logp, kl, means = self.sampler.score(policy, rollout, columns, active, forced=forced, reference=reference)
        return PolicyOutput(logp=logp, kl=kl, replay=None if means is None else {"means": means})

    def _rollout_size(self, rollout: Rollout) -> AbstractContextManager[None]:
        """The adapter at the size a bucketed training rollout was generated at (``replay["output_size"]``); nothing
        to change without buckets."""
        sizes = rollout.replay.get(BUCKET_KEY)
        if sizes is None:
            return nullcontext()
        distinct = {tuple(size) for size in sizes.tolist()}
        if len(distinct) != 1:
            raise RolloutError(f"a training micro-batch mixes the output sizes {sorted(distinct)} of plugin.buckets")
        size = distinct.pop()
        condition = condition_size_for(size, self.condition_sizes[0], self.adapter.resolution_multiple())
        return self.adapter.sized(*size, condition=condition)

    # ------------------------------------------------------------------ samples, checkpoints
    def save_samples(self, rollout: Rollout, rewards: Tensor, directory: str | Path, *, tag: str) -> list[Path]:
        """An image grid ``{tag}.png`` captioned with each prompt and reward (videos: a filmstrip of frames per
        sample; edits: the input image(s) left of the result; video-to-video: the input video's filmstrip left of the
        result's), ``{tag}.jsonl``, and with ``payload["audios"]`` (LTX-2) sample k's waveform as the 16-bit PCM WAV
        file ``{tag}_{k:03d}.wav`` (k in the grid's order; its name in the record's ``"audio"``)."""
        from mmrl.plugins.flow.images import filmstrips, save_caption_grid, save_wav

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        prompts = rollout.payload["prompts"]
        captions = [f"{prompt} [{float(reward):.3f}]" for prompt, reward in zip(prompts, rewards.tolist(),
                                                                                  strict=True)]
        images = rollout.payload["images"] if "images" in rollout.payload else filmstrips(rollout.payload["videos"])
        if "condition_images" in rollout.payload:  # an edit: the input image(s) left of the result
            inputs = [rollout.payload["condition_images"]]  # [N, 3, H_in, W_in]
            if "more_condition_images" in rollout.payload:  # [N, K − 1, 3, H_in, W_in], black after a row's last
                inputs.extend(rollout.payload["more_condition_images"].unbind(1))
            (height, width), tall = inputs[0].shape[-2:], images.shape[-2]
            if height != tall:  # plugin.condition_size: shown at the result's height, their aspect ratio kept
                size = (tall, max(1, round(width * tall / height)))
                inputs = [torch.nn.functional.interpolate(image.float(), size=size, mode="bilinear", antialias=True)
                          for image in inputs]
            ending = [rollout.payload["condition_last_images"].to(images)] if "condition_last_images" in \
                rollout.payload else []  # a first-and-last-frame video: its last frame right of the filmstrip
            images = torch.cat([*(image.to(images) for image in inputs), images, *ending], dim=-1)
        if "condition_videos" in rollout.payload:  # video-to-video: the input video's filmstrip left of the result's
            strips = filmstrips(rollout.payload["condition_videos"]).float()  # [N, 3, H_in, k·W_in]
            (height, width), tall = strips.shape[-2:], images.shape[-2]
            if height != tall:  # shown at the result's height, its aspect ratio kept
                strips = torch.nn.functional.interpolate(strips, size=(tall, max(1, round(width * tall / height))),
                                                         mode="bilinear", antialias=True)
            images = torch.cat([strips.to(images), images], dim=-1)
        grid = save_caption_grid(images, captions, directory / f"{tag}.png")
        sounds: list[Path] = []
        if "audios" in rollout.payload:  # LTX-2: each sample's waveform [channels, samples] at its rate
            rates = rollout.payload["audio_sample_rate"].tolist()
            for k, (waveform, rate) in enumerate(zip(rollout.payload["audios"], rates, strict=True)):
                sounds.append(save_wav(waveform, rate, directory / f"{tag}_{k:03d}.wav"))
        records = directory / f"{tag}.jsonl"
        with records.open("w") as handle:
            for k, (prompt, reward) in enumerate(zip(prompts, rewards.tolist(), strict=True)):
                record = {"prompt": prompt, "reward": float(reward)}
                if sounds:
                    record["audio"] = sounds[k].name
                handle.write(json.dumps(record) + "\n")
        return [grid, records, *sounds]

    # ------------------------------------------------------------------ two experts: one folder each
    def expert_folders(self, directory: str | Path) -> list[tuple[str, nn.Module, Path]]:
        """Where each trained expert of a two-expert pipeline (Wan 2.2 A14B) is saved in a checkpoint's ``policy/``
        or an export: ``transformer`` (high-noise) where a one-transformer run writes its policy, ``directory``
        itself, and ``transformer_2`` (low-noise) in ``directory/transformer_2``; frozen experts are not written.
        Empty for a one-transformer pipeline."""
        if len(self.adapter.experts()) < 2:
            return []
        directory = Path(directory)
        return [(name, expert, directory if name == "transformer" else directory / name)
                for name, expert in self.trained_experts.items()]

    def save_trainable(self, policy: nn.Module, directory: str | Path) -> None:
        """:meth:`Plugin.save_trainable`; for two experts each trained expert in its :meth:`expert_folders` folder,
        in the format of a one-transformer run (diffusers' LoRA file or ``trainable.safetensors``). With
        ``matching.ema_kl_coef`` the EMA of the EMA KL goes next to it (:data:`MATCHING_EMA_FILE`), with
        ``likelihood: nft`` the old policy (:data:`NFT_OLD_FILE`)."""
        self._save_copies(directory)
        folders = self.expert_folders(directory)
        if not folders:
            return super().save_trainable(policy, directory)
        state = self.gathered_trainable_state(policy)  # names "transformer.…" / "transformer_2.…"
        if state is None:
            return None
        fmt = self.policy_format(policy, export=False)
        for name, expert, folder in folders:
            prefix = f"{name}."
            save_policy(expert, folder, fmt,
                        state={key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)})
        return None

    def load_trainable(self, policy: nn.Module, directory: str | Path) -> None:
        """What :meth:`save_trainable` wrote, each trained expert from its folder (a LoRA of another rank or alpha is
        refused in one line, as for one transformer), the EMA of the EMA KL and nft's old policy."""
        self._load_copies(policy, directory)
        folders = self.expert_folders(directory)
        if not folders:
            return super().load_trainable(policy, directory)
        fmt = self.policy_format(policy, export=False)
        for _, expert, folder in folders:
            load_policy(expert, folder, fmt, lora=self.config.lora)
        return None

    def export(self, policy: nn.Module, directory: str | Path) -> str:
        """:meth:`Plugin.export`; for two experts each trained expert in its :meth:`expert_folders` folder: diffusers'
        LoRA file (``pipe.load_lora_weights(directory)`` for ``transformer``, ``pipe.load_lora_weights(directory /
        "transformer_2", load_into_transformer_2=True)`` for the low-noise expert: diffusers'
        ``WanLoraLoaderMixin``) or, for full fine-tuning, the expert's ``save_pretrained`` folder
        (``WanTransformer3DModel.from_pretrained``)."""
        folders = self.expert_folders(directory)
        if not folders:
            return super().export(policy, directory)
        fmt = self.lora_format if has_lora(self.runtime.unwrap(policy)) else "pretrained"
        for _, expert, folder in folders:
            save_policy(expert, folder, fmt)
        return fmt

    def _held_copies(self) -> list[tuple[str, str, Any]]:
        """The plugin-held copies of the trained parameters this run keeps: ``(file, what, holder)`` with ``holder``
        the :class:`.MatchingLikelihood` (``ema``, ``ema_step``) or :class:`.NFTLikelihood` (``old``, ``old_step``)."""
        copies = []
        if self.matching is not None and self.matching.config.ema_kl_coef > 0:
            copies.append((MATCHING_EMA_FILE, "the EMA of plugin.matching.ema_kl_coef", self.matching))
        if self.nft is not None:
            copies.append((NFT_OLD_FILE, "the old policy of plugin.likelihood nft", self.nft))
        if self.dgpo is not None and self.dgpo.config.ema_ref:
            copies.append((DGPO_EMA_FILE, "the fast EMA of plugin.dgpo.ema_ref", self.dgpo))
        return copies

    @staticmethod
    def _copy_state(holder: Any) -> tuple[dict[str, Tensor] | None, int]:
        """(the copy, the training step of its last update; -1 and None before the first training rollout)."""
        if isinstance(holder, (MatchingLikelihood, DGPOLikelihood)):
            return holder.ema, holder.ema_step
        return holder.old, holder.old_step

    @staticmethod
    def _set_copy_state(holder: Any, copy: dict[str, Tensor] | None, step: int) -> None:
        """Set what :meth:`_copy_state` reads."""
        if isinstance(holder, (MatchingLikelihood, DGPOLikelihood)):
            holder.ema, holder.ema_step = copy, step
        else:
            holder.old, holder.old_step = copy, step

    def _save_copies(self, directory: str | Path) -> None:
        """Each plugin-held copy (:meth:`_held_copies`) and the step of its last update, on the main process. A
        checkpoint written before the first training rollout (step 0: a stop signal during the first evaluation)
        holds the file with no tensors and step -1: resumed, the first rollout copies the trained weights, as in a
        run that was never stopped."""
        if not self.runtime.is_main_process:
            return
        from safetensors.torch import save_file

        for file, _, holder in self._held_copies():
            copy, step = self._copy_state(holder)
            if copy is None and step != -1:
                raise RuntimeError(f"flow: {file} has no tensors but was last updated at step {step}")
            Path(directory).mkdir(parents=True, exist_ok=True)
            tensors = {} if copy is None else {name: value.detach().cpu().contiguous() for name, value in copy.items()}
            save_file(tensors, str(Path(directory) / file), metadata={"step": str(step)})

    def _load_copies(self, policy: nn.Module, directory: str | Path) -> None:
        """Restore each plugin-held copy from a checkpoint. Refused in one line: a missing file, and a file whose
        names or shapes are not the trained parameters' (another LoRA rank or target list, another model), naming
        the first mismatch."""
        copies = self._held_copies()
        if not copies:
            return
        from safetensors import safe_open

        trained = {name: p for name, p in self.runtime.unwrap(policy).named_parameters() if p.requires_grad}
        for file, what, holder in copies:
            path = Path(directory) / file
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: a run with {what} resumes it from the checkpoint (every "
                                        "checkpoint of such a run holds it)")
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                step = int((handle.metadata() or {}).get("step", "-2"))
                names = list(handle.keys())
                if step == -1 and not names:  # written before the first training rollout: nothing copied yet
                    self._set_copy_state(holder, None, -1)
                    continue
                if step < 0:
                    raise ValueError(f"{path}: step {step} with {len(names)} tensors; allowed: a step >= 0 with the "
                                     "copy's tensors, or step -1 with none (a checkpoint of step 0)")
                problem = self._copy_mismatch(handle, names, trained)
                if problem is not None:
                    raise ValueError(f"{path} does not hold {what} of this run's trained parameters: {problem}")
                copy = {name: handle.get_tensor(name).to(trained[name].device) for name in names}
            self._set_copy_state(holder, copy, step)

    @staticmethod
    def _copy_mismatch(handle: Any, names: list[str], trained: dict[str, nn.Parameter]) -> str | None:
        """The first difference between a copy file's tensors and the trained parameters (names, then shapes), None
        when they match."""
        missing = [name for name in trained if name not in set(names)]
        if missing:
            return f"it lacks {missing[0]!r} ({len(missing)} trained parameter(s) missing)"
        extra = [name for name in names if name not in trained]
        if extra:
            return f"{extra[0]!r} is not a trained parameter here ({len(extra)} such tensor(s))"
        for name in names:
            shape = tuple(handle.get_slice(name).get_shape())
            if shape != tuple(trained[name].shape):
                return f"{name!r} is {shape}, the trained parameter {tuple(trained[name].shape)}"
        return None

    # ------------------------------------------------------------------ building blocks
    def reference_module(self) -> nn.Module | None:
        """Full fine-tuning's frozen copy of the initial transformer (None with LoRA)."""
        return self.reference

    def _reference_module(self, policy: nn.Module) -> AbstractContextManager[nn.Module]:
        """The reference policy: the transformer with its LoRA adapter disabled, or the frozen copy."""
        return reference_policy(self.runtime.unwrap(policy), self.reference)
