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
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mmrl.config import ConfigError
from mmrl.extras import require_extra
from mmrl.plugin import Plugin, PolicyOutput, PromptBatch, Runtime, load_adapter_state
from mmrl.plugins.flow.config import FlowLoraConfig, FlowPluginConfig, adapter_class, load_rows
from mmrl.plugins.flow.credit import credit_strategies
from mmrl.plugins.flow.schedule import StepPlan
from mmrl.plugins.flow.sde import SDEStepOutput, get_sde_kind, sde_step
from mmrl.rollout import Rollout, RolloutError
from mmrl.seeding import derive_seed

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' LoRA file: `pipe.load_lora_weights(folder)` reads it
_SHARED_NOISE_TAG = 0x5A4E

__all__ = ["LORA_WEIGHTS", "FlowLoraConfig", "FlowPlugin", "FlowPluginConfig"]


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
        self.adapter = adapter_class(config).from_pretrained(config.model, dtype=runtime.dtype,
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
        self._rows = {split: load_rows(config, split) for split in ("train", "eval")}
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
                kl = get_sde_kind(self.config.sde).kl(out.mean, ref_mean, out.std, sigma, sigma_next,
                                                      noise_level=self.config.noise_level,
                                                      variance=self.config.kl_variance)
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
