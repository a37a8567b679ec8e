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
  ``[N, 3, F, H, W]``) and ``payload["prompts"]`` for rewards;
- all randomness comes from the per-sample seeds (or, with ``share_initial_noise``, from the group id), so a
  rollout does not depend on how samples are laid out over processes or rollout batches;
- the KL is Flow-GRPO's KL between the Gaussian means of the policy and the reference, the reference being the
  same transformer with its LoRA adapter disabled (full fine-tuning: a frozen copy, kept when ``kl_coef > 0``).
"""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from mmrl.config import ConfigError, config_field
from mmrl.extras import require_extra
from mmrl.plugin import Plugin, PolicyOutput, PromptBatch, Runtime, load_adapter_state
from mmrl.plugins.flow.credit import CreditConfig, credit_strategies
from mmrl.plugins.flow.schedule import StepPlan, default_window_range, trained_step_count
from mmrl.plugins.flow.sde import SDEStepOutput, diffusion_coefficient, gaussian_kl_between_means, sde_step
from mmrl.rollout import Rollout, RolloutError
from mmrl.seeding import derive_seed

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' LoRA file: `pipe.load_lora_weights(folder)` reads it
_SHARED_NOISE_TAG = 0x5A4E


@dataclass
class FlowLoraConfig:
    """LoRA on the transformer (peft). ``plugin.lora: null`` trains the whole transformer instead."""

    rank: int = config_field(32, minimum=1, help="LoRA rank r.",
                             ref="Flow-GRPO: 32 (SD3.5), 64 (FLUX); DanceGRPO: 128")
    alpha: float = config_field(64.0, minimum=0.0, exclusive_minimum=True, help="LoRA alpha (scale alpha/r).",
                                ref="Flow-GRPO: 64 (SD3.5), 128 (FLUX); DanceGRPO: 256")
    target_modules: list[str] | None = config_field(
        None, help="Module-name suffixes to adapt (peft matching). Null: the adapter's defaults (SD3: attention "
        "q/k/v/out of both streams; FLUX: also the feed-forward layers)."
    )
    init: Literal["gaussian", "default"] = config_field(
        "gaussian", help="peft init_lora_weights: A random, B zero either way, so the policy starts at the base "
        "model and the KL starts at 0.", ref="Flow-GRPO: gaussian",
    )


@dataclass
class FlowPluginConfig:
    """The ``plugin:`` section of the flow plugin (``name: flow``)."""

    model: str = config_field(help="A diffusers pipeline folder or hub id, e.g. stabilityai/stable-diffusion-3.5-"
                              "medium or black-forest-labs/FLUX.1-dev.")
    adapter: str = config_field(
        "auto", help="Model adapter: 'sd3', 'flux', 'qwen_image', 'flux2', 'wan' or another registered one "
        "(`mmrl list`); 'auto' reads model_index.json."
    )
    lora: FlowLoraConfig | None = config_field(
        default_factory=FlowLoraConfig, help="LoRA options; null for full fine-tuning of the transformer."
    )
    gradient_checkpointing: bool = config_field(False, help="Recompute transformer activations in the backward.")
    resolution: int = config_field(512, minimum=1, help="Image side in pixels (square images).",
                                   ref="Flow-GRPO and DanceGRPO image runs: 512 (DanceGRPO FLUX: 720)")
    num_frames: int | None = config_field(
        None, minimum=1, help="Frames per video for video adapters (wan), 1 + a multiple of the VAE's temporal "
        "factor (Wan: 4). Null: the adapter's default (Wan 33); image adapters take null only.",
        ref="DanceGRPO HunyuanVideo: 53 frames at 480x480; WanPipeline default: 81",
    )
    num_steps: int = config_field(10, minimum=1, help="Denoising steps of a training rollout.",
                                  ref="Flow-GRPO denoising reduction: 10 (SD3.5), 6 (FLUX)")
    eval_num_steps: int = config_field(40, minimum=1, help="Denoising steps of an evaluation (plain ODE).",
                                       ref="Flow-GRPO eval: 40 (SD3.5), 28 (FLUX)")
    guidance_scale: float | None = config_field(
        None, minimum=0.0, help="Guidance of training rollouts (true CFG scale, or FLUX's guidance embedding). "
        "Null: the adapter's default (SD3 4.5, or 1.0 with cfg false; FLUX 3.5).", ref="Flow-GRPO: 4.5 (SD3.5)",
    )
    eval_guidance_scale: float | None = config_field(None, minimum=0.0, help="Guidance at evaluation (null: "
                                                     "guidance_scale).")
    cfg: bool | None = config_field(
        None, help="True classifier-free guidance (an unconditional pass with negative_prompt) in rollouts and in "
        "the training forward. Null: on for SD3, off for FLUX (guidance-distilled, no CFG pass).",
        ref="Flow-GRPO train.cfg",
    )
    negative_prompt: str = config_field("", help="Negative prompt of the unconditional pass.",
                                        ref="Flow-GRPO eval protocol: ''")
    sde: Literal["flow_grpo", "dance_grpo", "cps"] = config_field(
        "flow_grpo", help="SDE of the stochastic steps (docs of mmrl.plugins.flow.sde).",
        ref="Flow-GRPO arXiv:2505.05470; DanceGRPO arXiv:2505.07818; CPS arXiv:2509.05952",
    )
    noise_level: float = config_field(
        0.7, minimum=0.0, exclusive_minimum=True,
        help="a of the flow_grpo SDE, η of dance_grpo (0.3), the angle fraction of cps (0.8). Above 0: with 0 every "
        "step is deterministic, with nothing to train and an undefined KL.",
        ref="Flow-GRPO: 0.7 (SD3.5), 0.9 (FLUX); DanceGRPO: 0.3",
    )
    cps_log_prob: Literal["flow_grpo", "gaussian"] = config_field(
        "flow_grpo", help="The log-prob of a cps step: Flow-GRPO's CPS objective -mean((x' - mu)^2) (its clip range "
        "1e-5), or 'gaussian', the exact log-density. Warning: the exact density scales as 1/(2 std^2) with std = "
        "sigma_next*sin(a*pi/2): 0.6 at step 0 and 6934 at step 8 of SD3.5's 10-step grid, so the last trained steps "
        "dominate the gradient and no single clip range fits every step. Ignored by the other sde kinds.",
        ref="Flow-GRPO code: sd3_sde_with_logprob.py, cps 'remove all constants'",
    )
    train_steps: Literal["fraction", "random", "window"] = config_field(
        "fraction", help="Which steps are trained: the first timestep_fraction of them (Flow-GRPO), a random "
        "timestep_fraction per sample (DanceGRPO), or an SDE window with ODE outside it (Flow-GRPO-Fast).",
    )
    timestep_fraction: float = config_field(
        0.99, minimum=0.0, exclusive_minimum=True, maximum=1.0,
        help="Fraction of steps trained in the fraction and random modes.", ref="Flow-GRPO: 0.99; DanceGRPO: 0.6",
    )
    window_size: int = config_field(3, minimum=1, help="SDE steps of the window mode (all trained).",
                                    ref="Flow-GRPO-Fast sde_window_size")
    window_range: list[int] | None = config_field(
        None, help="[lo, hi): the window lies within steps lo..hi-1. Null: [0, num_steps/2), the high-noise half.",
        ref="Flow-GRPO-Fast sde_window_range",
    )
    share_initial_noise: bool = config_field(
        False, help="All samples of a prompt start from the same noise (drawn from the group id), so they differ "
        "only through SDE noise.", ref="DanceGRPO --init_same_noise",
    )
    kl_variance: Literal["flow_grpo", "transition"] = config_field(
        "flow_grpo", help="Denominator of the KL between means: Flow-GRPO's 2·s² (its β values assume it) or the "
        "exact transition variance 2·s²·Δ.", ref="Flow-GRPO code; flow_grpo#22",
    )
    dataset: str | None = config_field(
        None, help="Training prompts: a .txt file (one per line), a .jsonl file (objects with 'prompt' and any "
        "metadata rewards read), or a folder with train/test files (train.txt or train_metadata.jsonl, ...).",
    )
    eval_dataset: str | None = config_field(None, help="Evaluation prompts file (default: the test file of a "
                                            "dataset folder).")
    prompts: list[str] | None = config_field(None, help="Training prompts given inline (instead of dataset).")
    eval_prompts: list[str] | None = config_field(None, help="Evaluation prompts given inline.")
    max_sequence_length: int | None = config_field(
        None, minimum=1, help="T5 tokens per prompt (null: the pipeline's default, SD3 256, FLUX 512)."
    )
    embedding_cache_size: int = config_field(
        1024, minimum=1, help="Prompts whose text embeddings are kept on the device (least recently used first out)."
    )
    transformer_batch_size: int | None = config_field(
        None, minimum=1,
        help="Run the transformer on fixed batches of this many samples, padding the last one, in rollouts and in "
        "the training forward alike, so kernels see the same shapes whatever the micro-batch and batch-size-"
        "dependent numerics cannot break ratio == 1 (on CPU the velocities become bit-identical). Set it to "
        "algorithm.micro_batch_size. Null: the batch as it comes.",
        ref="flow_grpo#104, DanceGRPO#57 (batch-dependent kernels break ratio == 1)",
    )
    credit: CreditConfig = field(default_factory=CreditConfig)

    def validate(self, path: str) -> None:
        from mmrl.plugins.flow.adapters import flow_adapters

        if self.adapter != "auto" and self.adapter not in flow_adapters:
            raise ConfigError(f"{path}.adapter", self.adapter, f"'auto' or one of {', '.join(flow_adapters.names())}")
        if self.sde == "cps" and self.noise_level > 1:
            raise ConfigError(f"{path}.noise_level", self.noise_level, "a number in (0, 1] for sde 'cps'")
        strategy = credit_strategies.get(self.credit.strategy)
        if strategy.uses_step_selection:
            if self.train_steps == "random" and self.num_steps < 2:
                raise ConfigError(f"{path}.num_steps", self.num_steps, "at least 2 with train_steps 'random'")
            if self.step_selection_count() < 1:
                raise ConfigError(f"{path}.timestep_fraction", self.timestep_fraction,
                                  f"a fraction that trains at least one of the {self.num_steps} steps")
            if self.train_steps == "window":
                if self.window_size > self.num_steps:
                    raise ConfigError(f"{path}.window_size", self.window_size,
                                      f"at most num_steps ({self.num_steps})")
                lo, hi = self.resolved_window_range()
                if not 0 <= lo < hi <= self.num_steps or hi - lo < self.window_size:
                    raise ConfigError(f"{path}.window_range", self.window_range,
                                      f"[lo, hi] with 0 <= lo < hi <= {self.num_steps} and hi - lo >= window_size")
            self._refuse_the_last_cps_step(path)
        strategy(self).validate(self, f"{path}.credit")
        if (self.dataset is None) == (self.prompts is None):
            raise ConfigError(f"{path}.dataset", self.dataset, "exactly one of dataset (a file or folder) and prompts")
        if self.prompts is not None and not self.prompts:
            raise ConfigError(f"{path}.prompts", self.prompts, "a non-empty list of prompts")

    def _refuse_the_last_cps_step(self, path: str) -> None:
        """With ``sde: cps`` the last step is deterministic (std = σ_next·sin(a·π/2) = 0 at σ_next = 0): it has no
        log-prob to train (0, no gradient) and its KL to the reference is infinite (means that differ) or NaN
        (equal means), so a step selection that can train it is refused. Flow-GRPO never trains that step either
        (``num_train_timesteps = num_steps - 1``; its CPS configs keep the SDE window within the first half). The
        credit strategies that choose their own steps refuse it in their own checks (branch points, tree splits,
        the sliding window's range)."""
        if self.sde != "cps":
            return
        last = self.num_steps - 1
        if self.train_steps == "fraction" and self.step_selection_count() > last:
            raise ConfigError(f"{path}.timestep_fraction", self.timestep_fraction,
                              f"a fraction that leaves out the last of the {self.num_steps} steps with sde 'cps' "
                              "(its last step is deterministic: no log-prob, infinite KL), e.g. 0.99")
        if self.train_steps == "window" and self.resolved_window_range()[1] > last:
            raise ConfigError(f"{path}.window_range", self.window_range,
                              f"[lo, hi] with hi <= {last} with sde 'cps' (the window must not reach the "
                              "deterministic last step: no log-prob, infinite KL)")

    def num_actions(self) -> int:
        """A, the width of the action axis (trained steps per sample for 'step'; see the credit strategy)."""
        return credit_strategies.get(self.credit.strategy)(self).num_actions(self)

    def step_selection_count(self) -> int:
        """Steps per sample that plugin.train_steps trains (the action budget of 'step' and 'chunk')."""
        return trained_step_count(self.train_steps, self.num_steps, timestep_fraction=self.timestep_fraction,
                                  window_size=self.window_size)

    def resolved_window_range(self) -> tuple[int, int]:
        if self.window_range is None:
            return default_window_range(self.num_steps, self.window_size)
        if len(self.window_range) != 2:
            raise ConfigError("plugin.window_range", self.window_range, "two integers [lo, hi]")
        return int(self.window_range[0]), int(self.window_range[1])

    def resolved_guidance_scales(self, adapter_default: float, *, guided_by_cfg: bool = False) -> tuple[float, float]:
        """(rollout, evaluation) guidance scales: ``guidance_scale`` (null: ``adapter_default``, the adapter's) and
        ``eval_guidance_scale`` (null: the rollout's). For a model guided only by the CFG pass (``guided_by_cfg``:
        SD3) with ``cfg: false`` the default is 1.0, and any other value is refused: it would be silently ignored."""
        if guided_by_cfg and self.cfg is False:
            for key in ("guidance_scale", "eval_guidance_scale"):
                value = getattr(self, key)
                if value is not None and value != 1.0:
                    raise ConfigError(f"plugin.{key}", value, "null or 1.0 with plugin.cfg false: the model is guided "
                                      "only through the unconditional pass that cfg: false turns off")
            adapter_default = 1.0
        rollout = adapter_default if self.guidance_scale is None else self.guidance_scale
        return rollout, rollout if self.eval_guidance_scale is None else self.eval_guidance_scale


class FlowPlugin(Plugin):
    """Group-relative RL for diffusers flow-matching text-to-image models (Flow-GRPO, DanceGRPO, Flow-GRPO-Fast, and
    the credit strategies of :mod:`.credit`)."""

    name = "flow"
    config_class = FlowPluginConfig
    # Each action is its own transformer call: the trainer can back-propagate one denoising step at a time.
    supports_action_chunks = True

    def __init__(self, config: FlowPluginConfig, runtime: Runtime):
        require_extra("flow", "plugin 'flow'")  # one line naming mmrl[flow] instead of an import traceback
        super().__init__(config, runtime)
        self.adapter = _adapter_class(config).from_pretrained(config.model, dtype=runtime.dtype,
                                                              device=runtime.device)
        adapter = self.adapter
        pipeline = adapter.pipeline
        pipeline.to(runtime.device)
        for component in pipeline.components.values():
            if isinstance(component, nn.Module):
                component.requires_grad_(False).eval()
        multiple = adapter.resolution_multiple()
        if config.resolution % multiple:
            raise ConfigError("plugin.resolution", config.resolution,
                              f"a multiple of {multiple} for {config.model} (VAE downsampling x patch size)")
        frames_problem = adapter.frames_requirement(config.num_frames)
        if frames_problem is not None:
            raise ConfigError("plugin.num_frames", config.num_frames, frames_problem)
        adapter.num_frames = config.num_frames or adapter.default_num_frames or 1
        self.cfg = adapter.supports_cfg if config.cfg is None else config.cfg
        if self.cfg and not adapter.supports_cfg:
            raise ConfigError("plugin.cfg", config.cfg, f"false or null: the {adapter.name} adapter takes guidance "
                              "through the model's guidance embedding, without an unconditional pass")
        self.guidance_scale, self.eval_guidance_scale = config.resolved_guidance_scales(
            adapter.default_guidance_scale, guided_by_cfg=adapter.supports_cfg)
        self.max_sequence_length = config.max_sequence_length or adapter.default_max_sequence_length

        transformer = adapter.transformer
        self.reference: nn.Module | None = None
        if config.lora is None:
            # Full fine-tuning: float32 master weights (autocast runs the forward in mixed precision).
            transformer.to(torch.float32).requires_grad_(True)
            self.input_dtype = torch.float32
            if runtime.needs_reference:  # the KL needs the initial weights; LoRA disables the adapter instead
                self.reference = copy.deepcopy(transformer).requires_grad_(False).eval()
        else:
            self.input_dtype = runtime.dtype  # the frozen base weights' dtype
            self._add_lora(transformer, config.lora)
        if config.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        self._embeddings: OrderedDict[str, dict[str, Tensor]] = OrderedDict()
        self._negative: dict[str, Tensor] | None = None
        self._rows = {split: _load_rows(config, split) for split in ("train", "eval")}
        self.credit = credit_strategies.get(config.credit.strategy)(config)
        #: Transformer rows evaluated (one row = one sample's velocity; a CFG pass counts once), by phase.
        self.model_evaluations: dict[str, int] = {"rollout": 0, "forward": 0, "evaluation": 0}
        self._phase = "rollout"

    # ------------------------------------------------------------------ contract
    def policy(self) -> nn.Module:
        return self.adapter.transformer

    def dataset(self, split: str) -> list[dict[str, Any]]:
        if split not in self._rows:
            raise KeyError(f"flow plugin has splits {sorted(self._rows)}, not {split!r}")
        return self._rows[split]

    def max_actions(self) -> int:
        return self.config.num_actions()

    @torch.no_grad()
    def rollout(self, policy: nn.Module, batch: PromptBatch) -> Rollout:
        if not batch.training:
            return self._evaluation_rollout(policy, batch)
        self._phase = "rollout"
        return self.credit.rollout(self, policy, batch)

    def action_rewards(self, rollout: Rollout, rewards: Tensor) -> Tensor | None:
        """Per-action rewards of the credit strategy ('branch': the sample's reward at its branch point; 'tree': the
        mean reward of the leaves below each edge), None for one advantage per sample."""
        return self.credit.action_rewards(rollout, rewards)

    def sigma_grid(self) -> Tensor:
        """σ of the training schedule, ``[S+1]`` from about 1 down to 0."""
        return self.adapter.schedule(self.config.num_steps, self.config.resolution)[0]

    @torch.no_grad()
    def chain_rollout(self, policy: nn.Module, batch: PromptBatch, plan: StepPlan, *, tail: list[int] | None = None,
                      solver: str = "euler") -> Rollout:
        """Every sample on its own trajectory (its own noise), SDE where ``plan.stochastic`` says so, the trained
        steps stored. With ``tail`` (grid indices from :func:`~mmrl.plugins.flow.credit.solvers.tail_grid`) the steps
        from ``tail[0]`` on are replaced by ``solver`` on that sub-grid (no trained step may lie there)."""
        from mmrl.plugins.flow.credit.solvers import ode_tail

        config = self.config
        n = len(batch)
        counted = self.model_evaluations["rollout"]
        sigmas, timesteps = self.adapter.schedule(config.num_steps, config.resolution)  # [S+1], [S]
        prompts = [str(row["prompt"]) for row in batch.rows]
        conditioning = self.conditioning(prompts)  # each [n, ...]
        generators = batch.sample_generators()
        latents = self.initial_noise(batch, generators)  # [n, *latent] float32
        last = config.num_steps if tail is None else tail[0]
        if tail is not None and (bool(plan.stochastic[:, last:].any()) or int(plan.step_index.max()) >= last):
            raise ValueError(f"the ODE tail from step {last} would cover stochastic or trained steps")
        keep_means = config.credit.ratio_norm
        device = latents.device
        before = latents.new_zeros(n, plan.num_actions, *latents.shape[1:])  # [n, A, *latent]
        after = torch.zeros_like(before)
        means = torch.zeros_like(before) if keep_means else None
        old_logp = latents.new_zeros(n, plan.num_actions)  # [n, A]
        for s in range(last):
            velocity = self._velocity(policy, latents, timesteps[s].expand(n), conditioning, self.guidance_scale)
            sde_rows = plan.stochastic[:, s]  # [n] bool, on the CPU
            if bool(sde_rows.all()):  # Flow-GRPO, DanceGRPO: every sample takes an SDE step
                out = self._step(velocity, latents, sigmas[s], sigmas[s + 1], stochastic=True, generators=generators)
                next_latents, step_logp, step_mean = out.prev_sample, out.log_prob, out.mean
            else:  # windows: SDE inside a sample's window, ODE elsewhere
                next_latents = torch.empty_like(latents)
                step_mean = torch.empty_like(latents)
                step_logp = latents.new_zeros(n)
                for is_sde in (True, False):
                    rows = (sde_rows == is_sde).nonzero().flatten()
                    if rows.numel() == 0:
                        continue
                    index = rows.to(device)
                    out = self._step(velocity[index], latents[index], sigmas[s], sigmas[s + 1], stochastic=is_sde,
                                     generators=[generators[i] for i in rows.tolist()])
                    next_latents[index] = out.prev_sample
                    step_mean[index] = out.mean
                    step_logp[index] = out.log_prob
            for column, rows in plan.columns_at(s):  # store the samples whose column `column` is step s
                index = slice(None) if rows is None else rows.to(device)
                before[index, column] = latents[index]
                after[index, column] = next_latents[index]
                old_logp[index, column] = step_logp[index]
                if means is not None:
                    means[index, column] = step_mean[index]
            latents = next_latents
        if tail is not None and len(tail) > 1:
            def tail_velocity(x: Tensor, i: int) -> Tensor:
                return self._velocity(policy, x, timesteps[i].expand(n), conditioning, self.guidance_scale)

            latents = ode_tail(tail_velocity, latents, sigmas, tail, solver)

        step_index = plan.step_index.to(device)  # [n, A]
        return self._training_rollout(
            batch, prompts, conditioning, latents, before, after, old_logp, means, step_index,
            mask=torch.ones_like(old_logp), evaluations=self.model_evaluations["rollout"] - counted,
        )

    @torch.no_grad()
    def shared_rollout(self, policy: nn.Module, batch: PromptBatch, template: Any) -> Rollout:
        """The G samples of every group share trajectory prefixes as ``template``
        (:class:`~mmrl.plugins.flow.credit.sharing.SharedTemplate`) says; every group of ``batch`` must be whole."""
        from mmrl.plugins.flow.credit.base import grouped_rows
        from mmrl.plugins.flow.credit.sharing import shared_rollout

        config = self.config
        n = len(batch)
        counted = self.model_evaluations["rollout"]
        sigmas, timesteps = self.adapter.schedule(config.num_steps, config.resolution)
        prompts = [str(row["prompt"]) for row in batch.rows]
        conditioning = self.conditioning(prompts)
        groups, rows = grouped_rows(batch.group_ids)  # [R, G] batch rows of each group's members
        if rows.shape[1] != template.group_size:
            raise RolloutError(f"groups of {rows.shape[1]} samples for a template of {template.group_size}")
        initial = torch.cat([self._group_noise(group) for group in groups])  # [R, *latent]
        first = rows[:, 0]
        per_group = {key: value.index_select(0, first.to(value.device)) for key, value in conditioning.items()}

        def velocity(x: Tensor, s: int, group_index: Tensor) -> Tensor:
            picked = {key: value.index_select(0, group_index.to(value.device)) for key, value in per_group.items()}
            return self._velocity(policy, x, timesteps[s].expand(x.shape[0]), picked, self.guidance_scale)

        def step(v: Tensor, x: Tensor, s: int, stochastic: bool, generators: Any) -> SDEStepOutput:
            return self._step(v, x, sigmas[s], sigmas[s + 1], stochastic=stochastic, generators=generators)

        result = shared_rollout(template, initial, batch.seeds[rows], velocity, step,
                                keep_means=config.credit.ratio_norm)
        order = rows.flatten().to(initial.device)

        def to_batch(value: Tensor) -> Tensor:  # [R, G, ...] in group order → [n, ...] in batch order
            out = value.new_empty(n, *value.shape[2:])
            out[order] = value.reshape(-1, *value.shape[2:])
            return out

        num_groups = rows.shape[0]
        expand = (num_groups, *template.step_index.shape)
        return self._training_rollout(
            batch, prompts, conditioning, to_batch(result.final), to_batch(result.before), to_batch(result.after),
            to_batch(result.old_logp), None if result.means is None else to_batch(result.means),
            to_batch(template.step_index.expand(expand).to(initial.device)),
            mask=to_batch(template.mask.expand(expand).to(initial)),
            evaluations=self.model_evaluations["rollout"] - counted,
        )

    def _training_rollout(self, batch: PromptBatch, prompts: list[str], conditioning: dict[str, Tensor],
                          final: Tensor, before: Tensor, after: Tensor, old_logp: Tensor, means: Tensor | None,
                          step_index: Tensor, *, mask: Tensor, evaluations: int) -> Rollout:
        config = self.config
        sigmas, timesteps = self.adapter.schedule(config.num_steps, config.resolution)
        replay = {
            "latents": before,  # x before each trained step, float32
            "next_latents": after,  # the sampled x_next: the action, float32
            "step_index": step_index,  # [n, A] denoising step of each column
            "sigmas": sigmas[step_index],  # [n, A]
            "sigmas_next": sigmas[step_index + 1],  # [n, A]
            "timesteps": timesteps[step_index],  # [n, A]
            "conditioning": conditioning,  # prompt embeddings, each [n, ...]
        }
        if means is not None:
            replay["means"] = means  # the old transition means, for GRPO-Guard's RatioNorm
        active = mask > 0
        if config.sde == "cps" and bool((active & (replay["sigmas_next"] == 0)).any()):
            # The configs refuse this for the built-in strategies; a registered one may still choose the step.
            raise RolloutError(f"credit strategy {config.credit.strategy!r} trained the last step with sde 'cps', "
                               "which is deterministic (no log-prob, infinite KL); train steps 0..num_steps-2 only")
        trained_sigma = sigmas[step_index][active].mean() if bool(active.any()) else sigmas.new_zeros(())
        return Rollout(
            group_ids=batch.group_ids,
            old_logp=old_logp,
            mask=mask,
            payload={self.adapter.output: self.adapter.decode(final, config.resolution), "prompts": prompts},
            replay=replay,
            shared={"guidance_scale": self.guidance_scale, "cfg": self.cfg, "num_steps": config.num_steps,
                    "credit": config.credit.strategy},
            metrics={"trained_sigma_mean": float(trained_sigma),
                     "model_evals_per_sample": evaluations / max(len(batch), 1)},
        )

    def _evaluation_rollout(self, policy: nn.Module, batch: PromptBatch) -> Rollout:
        """The plain ODE (Euler) with the evaluation steps and guidance, as the diffusers pipeline samples; A = 0."""
        config = self.config
        self._phase = "evaluation"
        n = len(batch)
        sigmas, timesteps = self.adapter.schedule(config.eval_num_steps, config.resolution)
        prompts = [str(row["prompt"]) for row in batch.rows]
        conditioning = self.conditioning(prompts)
        latents = self.initial_noise(batch, batch.sample_generators())
        for s in range(config.eval_num_steps):
            velocity = self._velocity(policy, latents, timesteps[s].expand(n), conditioning, self.eval_guidance_scale)
            latents = sde_step("ode", velocity, latents, sigmas[s], sigmas[s + 1], noise_level=0.0).prev_sample
        empty = latents.new_zeros(n, 0)
        return Rollout(group_ids=batch.group_ids, old_logp=empty, mask=empty.clone(),
                       payload={self.adapter.output: self.adapter.decode(latents, config.resolution),
                                "prompts": prompts})

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
        self._phase = "forward"
        replay = rollout.replay
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
        conditioning = replay["conditioning"]
        means = replay["means"].detach().clone() if ratio_norm else None  # [n, width, *latent], refreshed below
        logps, kls = [], []
        for k, column in enumerate(columns):
            if rollout.old_logp is None:  # no old policy apart from the current weights (see the docstring)
                old = rollout.mask.new_zeros(rollout.mask.shape[0], dtype=torch.float32)  # [n]
            else:
                old = rollout.old_logp[:, k].detach().float()  # [n]
            rows = active[:, k]
            if not bool(rows.any()):
                logps.append(old)
                if need_reference:
                    kls.append(torch.zeros_like(old))
                continue
            index = None if bool(rows.all()) else rows.nonzero().flatten()
            latents = _rows(replay["latents"][:, column], index)  # [m, *latent]
            sigma = _rows(replay["sigmas"][:, column], index)  # [m]
            sigma_next = _rows(replay["sigmas_next"][:, column], index)
            timesteps = _rows(replay["timesteps"][:, column], index)
            stored = _rows(replay["next_latents"][:, column], index)
            picked = conditioning if index is None else {key: value.index_select(0, index.to(value.device))
                                                         for key, value in conditioning.items()}
            velocity = self._velocity(policy, latents, timesteps, picked, self.guidance_scale)
            out = self._step(velocity, latents, sigma, sigma_next, stochastic=True, prev_sample=stored)
            logp = out.log_prob  # [m]
            if means is not None:
                from mmrl.plugins.flow.credit.guard import ratio_norm_log_ratio

                old_mean = (out.mean.detach() if rollout.old_logp is None
                            else _rows(replay["means"][:, column], index))  # [m, *latent]
                logp = _rows(old, index) + ratio_norm_log_ratio(stored, out.mean, old_mean, out.std)
                if index is None:
                    means[:, column] = out.mean.detach()
                else:
                    means[index.to(means.device), column] = out.mean.detach()
            kl = None
            if need_reference:
                with torch.no_grad(), self._reference_module(policy) as reference:
                    ref_velocity = self._velocity(reference, latents, timesteps, picked, self.guidance_scale)
                ref_mean = self._step(ref_velocity, latents, sigma, sigma_next, stochastic=True,
                                      prev_sample=stored).mean
                coefficient = diffusion_coefficient(self.config.sde, sigma, sigma_next,
                                                    noise_level=self.config.noise_level)
                kl = gaussian_kl_between_means(out.mean, ref_mean, out.std, variance=self.config.kl_variance,
                                               diffusion_coeff=coefficient)
                if forced:
                    kl = kl * 0
            if index is not None:  # back to all n rows; gradients flow into the computed ones
                logp = old.index_put((index.to(old.device),), logp.float())
                if kl is not None:
                    kl = torch.zeros_like(old).index_put((index.to(old.device),), kl.float())
            logps.append(logp)
            if need_reference:
                kls.append(kl)
        logp = torch.stack(logps, dim=1)  # [n, len(columns)]
        return PolicyOutput(logp=logp, kl=torch.stack(kls, dim=1) if need_reference else None,
                            replay=None if means is None else {"means": means})

    # ------------------------------------------------------------------ samples, checkpoints
    def save_samples(self, rollout: Rollout, rewards: Tensor, directory: str | Path, *, tag: str) -> list[Path]:
        """An image grid ``{tag}.png`` captioned with each prompt and reward (videos: a filmstrip of frames per
        sample), and ``{tag}.jsonl``."""
        from mmrl.plugins.flow.images import filmstrips, save_caption_grid

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        prompts = rollout.payload["prompts"]
        captions = [f"{prompt} [{float(reward):.3f}]" for prompt, reward in zip(prompts, rewards.tolist(),
                                                                                  strict=True)]
        images = rollout.payload["images"] if "images" in rollout.payload else filmstrips(rollout.payload["videos"])
        grid = save_caption_grid(images, captions, directory / f"{tag}.png")
        records = directory / f"{tag}.jsonl"
        with records.open("w") as handle:
            for prompt, reward in zip(prompts, rewards.tolist(), strict=True):
                handle.write(json.dumps({"prompt": prompt, "reward": float(reward)}) + "\n")
        return [grid, records]

    def save_trainable(self, policy: nn.Module, directory: str | Path) -> None:
        """LoRA: the adapter in diffusers' LoRA format (``pipe.load_lora_weights(directory)`` loads it into a
        pipeline). Full fine-tuning: the transformer's weights in ``trainable.safetensors`` (the base class).

        Called on every process: the weights are gathered through ``Runtime.full_state_dict`` (a collective under
        FSDP and ZeRO-3) and only the main process writes."""
        if self.config.lora is None:
            super().save_trainable(policy, directory)
            return
        from peft.utils import get_peft_model_state_dict

        trainable = self.gathered_trainable_state(policy)
        if trainable is None:  # not the main process: it only took part in gathering
            return
        module = self.runtime.unwrap(policy)
        state = get_peft_model_state_dict(module, state_dict=trainable)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        type(self.adapter.pipeline).save_lora_weights(
            str(directory), transformer_lora_layers={k: v.detach().cpu().contiguous() for k, v in state.items()},
            weight_name=LORA_WEIGHTS, transformer_lora_adapter_metadata=module.peft_config["default"].to_dict(),
        )

    def load_trainable(self, policy: nn.Module, directory: str | Path) -> None:
        if self.config.lora is None:
            super().load_trainable(policy, directory)
            return
        from safetensors import safe_open
        from safetensors.torch import load_file

        path = Path(directory) / LORA_WEIGHTS
        if not path.is_file():
            raise FileNotFoundError(f"no LoRA weights at {path}")
        module = self.runtime.unwrap(policy)
        with safe_open(str(path), framework="pt") as handle:
            metadata = json.loads((handle.metadata() or {}).get("lora_adapter_metadata", "{}"))
        lora = self.config.lora
        saved = (metadata.get("transformer.r"), metadata.get("transformer.lora_alpha"))
        if saved != (None, None) and (saved[0] != lora.rank or float(saved[1]) != float(lora.alpha)):
            raise ValueError(f"{path} holds a LoRA of rank {saved[0]} and alpha {saved[1]}; this run has rank "
                             f"{lora.rank} and alpha {lora.alpha}")
        prefix = "transformer."
        state = {name[len(prefix):]: tensor for name, tensor in load_file(str(path)).items()
                 if name.startswith(prefix)}
        load_adapter_state(module, state, path)

    # ------------------------------------------------------------------ building blocks
    def conditioning(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        """Prompt embeddings of ``prompts`` (each tensor ``[n, ...]``), encoded once per prompt and cached."""
        cache = self._embeddings
        missing = [prompt for prompt in dict.fromkeys(prompts) if prompt not in cache]
        if missing:
            with torch.no_grad():
                encoded = self.adapter.encode_prompts(missing, self.max_sequence_length)
            for i, prompt in enumerate(missing):
                cache[prompt] = {key: value[i:i + 1].clone() for key, value in encoded.items()}
        rows = []
        for prompt in prompts:
            cache.move_to_end(prompt)
            rows.append(cache[prompt])
        while len(cache) > self.config.embedding_cache_size:
            cache.popitem(last=False)
        return {key: torch.cat([row[key] for row in rows]) for key in rows[0]}

    def negative_conditioning(self) -> dict[str, Tensor]:
        """Embeddings of the negative prompt (one row), for the unconditional pass of CFG."""
        if self._negative is None:
            with torch.no_grad():
                self._negative = self.adapter.encode_prompts([self.config.negative_prompt], self.max_sequence_length)
        return self._negative

    def initial_noise(self, batch: PromptBatch, generators: list[torch.Generator]) -> Tensor:
        """x at σ = 1, ``[n, *latent]`` float32: one draw per sample from its own generator, as diffusers'
        ``randn_tensor`` draws with a list of generators; with ``share_initial_noise`` one draw per group, seeded
        from (run seed, group id), so the G samples of a prompt share it on every process."""
        if self.config.share_initial_noise and batch.training:
            per_group: dict[int, Tensor] = {}
            for group in batch.group_ids.tolist():
                if group not in per_group:
                    per_group[group] = self._group_noise(group)
            return torch.cat([per_group[group] for group in batch.group_ids.tolist()])
        shape = (1, *self.adapter.noise_shape(self.config.resolution))
        noise = torch.cat([torch.randn(shape, generator=generator) for generator in generators])
        return self.adapter.pack(noise.to(self.runtime.device))

    def _group_noise(self, group: int) -> Tensor:
        """x at σ = 1 shared by a group, ``[1, *latent]``, drawn from (run seed, group id) only."""
        shape = (1, *self.adapter.noise_shape(self.config.resolution))
        generator = torch.Generator().manual_seed(derive_seed(self.runtime.seed, int(group), _SHARED_NOISE_TAG))
        return self.adapter.pack(torch.randn(shape, generator=generator).to(self.runtime.device))

    def _velocity(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: dict[str, Tensor],
                  guidance_scale: float) -> Tensor:
        """float32 velocity ``[n, *latent]``: the one function rollouts and training forwards share."""
        self.model_evaluations[self._phase] += int(latents.shape[0])
        negative = None
        if self.cfg:
            negative = {key: value.to(self.input_dtype) for key, value in self.negative_conditioning().items()}
        n = latents.shape[0]
        size = self.config.transformer_batch_size or n
        parts = []
        for start in range(0, n, size):
            real = min(size, n - start)
            index = None  # the whole batch as it is
            if real != n or size != n:
                index = torch.arange(start, start + real, device=latents.device)
                if self.config.transformer_batch_size and real < size:  # pad with copies of the last sample
                    index = torch.cat([index, index[-1:].expand(size - real)])
            with self.runtime.autocast():
                velocity = self.adapter.velocity(
                    module, _rows(latents, index).to(self.input_dtype), _rows(timesteps, index),
                    {key: _rows(value, index).to(self.input_dtype) for key, value in conditioning.items()},
                    guidance_scale=guidance_scale, negative=negative,
                )
            parts.append(velocity[:real])
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _step(self, velocity: Tensor, latents: Tensor, sigma: Tensor, sigma_next: Tensor, *, stochastic: bool,
              prev_sample: Tensor | None = None, generators: list[torch.Generator] | None = None) -> SDEStepOutput:
        kind = self.config.sde if stochastic else "ode"
        return sde_step(kind, velocity, latents, sigma, sigma_next, noise_level=self.config.noise_level,
                        prev_sample=prev_sample, generator=generators if stochastic else None,
                        cps_log_prob=self.config.cps_log_prob)

    @contextmanager
    def _reference_module(self, policy: nn.Module) -> Iterator[nn.Module]:
        """The reference policy: the transformer with its LoRA adapter disabled, or the frozen copy."""
        if self.config.lora is None:
            if self.reference is None:
                raise RuntimeError("flow plugin: a reference was requested but Runtime.needs_reference was False "
                                   "(full fine-tuning keeps a frozen copy only when algorithm.kl_coef > 0)")
            yield self.reference
            return
        module = self.runtime.unwrap(policy)
        module.disable_adapters()
        try:
            yield module
        finally:
            module.enable_adapters()

    def _add_lora(self, transformer: nn.Module, options: FlowLoraConfig) -> None:
        from peft import LoraConfig

        targets = list(options.target_modules or self.adapter.lora_target_modules)
        transformer.requires_grad_(False)
        try:
            transformer.add_adapter(LoraConfig(r=options.rank, lora_alpha=options.alpha, lora_dropout=0.0,
                                               init_lora_weights=options.init, target_modules=targets))
        except ValueError as error:  # peft: no module matched
            raise ConfigError("plugin.lora.target_modules", targets, f"module-name suffixes present in the "
                              f"{self.adapter.name} transformer ({error})") from None
        for parameter in transformer.parameters():
            if parameter.requires_grad:  # float32 adapter weights on a half-precision base
                parameter.data = parameter.data.float()


# ---------------------------------------------------------------------------------------------------------- helpers
def _rows(value: Tensor, index: Tensor | None) -> Tensor:
    return value if index is None else value.index_select(0, index)


def _adapter_class(config: FlowPluginConfig) -> Any:
    from mmrl.plugins.flow.adapters import adapter_for_pipeline, flow_adapters
    from mmrl.plugins.flow.adapters.base import read_model_index

    if config.adapter != "auto":
        return flow_adapters.get(config.adapter)
    index = read_model_index(config.model)
    return adapter_for_pipeline(str(index.get("_class_name")), config.model)


def _load_rows(config: FlowPluginConfig, split: str) -> list[dict[str, Any]]:
    """Prompt rows ``{"prompt": ..., **metadata}`` of ``split`` from the inline lists or the files."""
    inline = config.prompts if split == "train" else config.eval_prompts
    if inline is not None:
        return [{"prompt": prompt} for prompt in inline]
    source = config.dataset if split == "train" else config.eval_dataset
    if split == "eval" and source is None and config.dataset is not None and Path(config.dataset).is_dir():
        source = config.dataset
    if source is None:
        return []
    path = Path(source).expanduser()
    if path.is_dir():
        stem = "train" if split == "train" else "test"
        candidates = [path / f"{stem}.txt", path / f"{stem}_metadata.jsonl", path / f"{stem}.jsonl"]
        found = [candidate for candidate in candidates if candidate.is_file()]
        if not found:
            raise FileNotFoundError(f"prompt folder {path} has none of {', '.join(c.name for c in candidates)}")
        path = found[0]
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file at {path}")
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path} line {number}: expected a JSON object with a 'prompt' string")
            rows.append(row)
    else:
        rows = [{"prompt": line.strip()} for line in path.read_text().splitlines() if line.strip()]
    if not rows and split == "train":
        raise ValueError(f"{path} holds no prompts")
    return rows
