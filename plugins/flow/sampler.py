r"""The flow plugin's sampling engine: everything between a :class:`~mmrl.plugin.PromptBatch` and the transformer.

:class:`FlowSampler` owns the prompt-embedding cache, the initial noise, the one velocity function that rollouts
and training forwards share (CFG, fixed transformer batches, autocast), the SDE steps of ``plugin.sde``, and the
per-phase counters of transformer rows. Its two sampling engines are what the credit strategies (:mod:`.credit`)
build their rollouts with:

- :meth:`FlowSampler.chain_rollout`: every sample on its own trajectory with its own noise; a
  :class:`~mmrl.plugins.flow.schedule.StepPlan` says which steps are SDE and which are trained ("step", "chunk",
  "sliding_window");
- :meth:`FlowSampler.shared_rollout`: the G samples of a group share trajectory prefixes as a
  :class:`~mmrl.plugins.flow.credit.sharing.SharedTemplate` says ("branch", "tree").

:meth:`FlowSampler.evaluation_rollout` is the plain ODE of evaluations, and :meth:`FlowSampler.score` recomputes the
log-probs (and KL) of stored actions for ``FlowPlugin.forward``. The plugin builds one sampler and hands it to its
credit strategy, which never calls back into the plugin.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from mmrl.plugin import PromptBatch, Runtime
from mmrl.plugins.flow.condition_images import ConditionImageCache
from mmrl.plugins.flow.config import FlowPluginConfig
from mmrl.plugins.flow.schedule import StepPlan
from mmrl.plugins.flow.sde import SDEStepOutput, get_sde_kind, sde_step
from mmrl.rollout import Rollout, RolloutError
from mmrl.seeding import derive_seed

if TYPE_CHECKING:
    from mmrl.plugins.flow.adapters.base import FlowAdapter, GuidanceScale

_SHARED_NOISE_TAG = 0x5A4E


class FlowSampler:
    """Sampling and re-scoring of denoising trajectories for one flow model.

    Args:
        config: The plugin config.
        runtime: The run's device, dtype, seed and autocast.
        adapter: The loaded model adapter (pipeline, transformer, schedule, VAE).
        cfg: Whether the velocity includes the unconditional CFG pass.
        guidance_scale: Guidance of training rollouts and forwards (a ``(high-noise, low-noise)`` pair for Wan 2.2's
            two experts).
        eval_guidance_scale: Guidance of evaluation rollouts (the same).
        input_dtype: The dtype the transformer takes its inputs in (the frozen base weights', float32 for full
            fine-tuning).
        max_sequence_length: Text tokens per prompt.
    """

    def __init__(self, config: FlowPluginConfig, runtime: Runtime, adapter: FlowAdapter, *, cfg: bool,
                 guidance_scale: GuidanceScale, eval_guidance_scale: GuidanceScale, input_dtype: torch.dtype,
                 max_sequence_length: int, image_slots: int = 1, last_images: bool = False):
        self.config = config
        self.runtime = runtime
        self.adapter = adapter
        self.cfg = cfg
        self.guidance_scale = guidance_scale
        self.eval_guidance_scale = eval_guidance_scale
        self.input_dtype = input_dtype
        self.max_sequence_length = max_sequence_length
        self.sde = get_sde_kind(config.sde)
        self._embeddings: OrderedDict[str, dict[str, Tensor]] = OrderedDict()
        self._negative: dict[str, Tensor] | None = None
        self._images = None  # condition images of image-editing adapters, encoded once (.condition_images)
        if adapter.image_conditioned:
            self._images = ConditionImageCache(adapter, config.embedding_cache_size, max_sequence_length,
                                               config.negative_prompt if cfg else None, slots=image_slots,
                                               last_images=last_images)
        #: Transformer rows evaluated (one row = one sample's velocity; a CFG pass counts once), by phase.
        self.model_evaluations: dict[str, int] = {"rollout": 0, "forward": 0, "evaluation": 0}

    def training_schedule(self) -> tuple[Tensor, Tensor]:
        """``(sigmas [S+1], timesteps [S])`` of training rollouts and the training forward: the pipeline's grid, or
        DanceGRPO's statically shifted one with ``plugin.static_shift`` (:meth:`FlowAdapter.schedule`)."""
        return self.adapter.schedule(self.config.num_steps, static_shift=self.config.static_shift)

    def sigma_grid(self) -> Tensor:
        """σ of the training schedule, ``[S+1]`` from about 1 down to 0."""
        return self.training_schedule()[0]

    @torch.no_grad()
    def chain_rollout(self, policy: nn.Module, batch: PromptBatch, plan: StepPlan, *, tail: list[int] | None = None,
                      solver: str = "euler", keep_final: bool = False) -> Rollout:
        """Every sample on its own trajectory (its own noise), SDE where ``plan.stochastic`` says so, the trained
        steps stored. With ``tail`` (grid indices from :func:`~mmrl.plugins.flow.credit.solvers.tail_grid`) the steps
        from ``tail[0]`` on are replaced by ``solver`` on that sub-grid (no trained step may lie there). With
        ``keep_final`` the latent the rollout decodes is kept in ``replay["final_latents"]`` ``[n, *latent]``
        (float32; ``plugin.likelihood: matching`` trains on it, :mod:`.matching`)."""
        from mmrl.plugins.flow.credit.solvers import ode_tail

        config = self.config
        n = len(batch)
        counted = self.model_evaluations["rollout"]
        sigmas, timesteps = self.training_schedule()  # [S+1], [S]
        prompts, conditioning, extra = self.row_conditioning(batch.rows)  # each [n, ...]
        generators = batch.sample_generators()
        latents = self.adapter.initial_latents(self.initial_noise(batch, generators), conditioning,
                                               sigmas[0])  # [n, *latent] float32
        last = config.num_steps if tail is None else tail[0]
        if tail is not None and (bool(plan.stochastic[:, last:].any()) or int(plan.step_index.max()) >= last):
            raise ValueError(f"the ODE tail from step {last} would cover stochastic or trained steps")
        keep_means = config.credit.ratio_norm
        device = latents.device
        before = latents.new_zeros(n, plan.num_actions, *latents.shape[1:])  # [n, A, *latent]
        after = torch.zeros_like(before)
        means = torch.zeros_like(before) if keep_means else None
        old_logp = latents.new_zeros(n, plan.num_actions)  # [n, A]
        predicted = None  # the last step's x̂₀ with decode_latent: predicted_x0
        for s in range(last):
            velocity = self.velocity(policy, latents, timesteps[s].expand(n), conditioning, self.guidance_scale,
                                     phase="rollout")
            if s == config.num_steps - 1 and config.decode_latent == "predicted_x0":
                predicted = predict_x0(latents, velocity, sigmas[s])
            sde_rows = plan.stochastic[:, s]  # [n] bool, on the CPU
            if bool(sde_rows.all()):  # Flow-GRPO, DanceGRPO: every sample takes an SDE step
                out = self.step(velocity, latents, sigmas[s], sigmas[s + 1], stochastic=True, generators=generators)
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
                    out = self.step(velocity[index], latents[index], sigmas[s], sigmas[s + 1], stochastic=is_sde,
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
                return self.velocity(policy, x, timesteps[i].expand(n), conditioning, self.guidance_scale,
                                     phase="rollout")

            latents = ode_tail(tail_velocity, latents, sigmas, tail, solver)

        step_index = plan.step_index.to(device)  # [n, A]
        final = latents if predicted is None else predicted
        rollout = self._training_rollout(
            batch, prompts, conditioning, extra, final, before, after, old_logp, means, step_index,
            mask=torch.ones_like(old_logp), evaluations=self.model_evaluations["rollout"] - counted,
        )
        if keep_final:
            rollout.replay["final_latents"] = final
        return rollout

    @torch.no_grad()
    def shared_rollout(self, policy: nn.Module, batch: PromptBatch, template: Any) -> Rollout:
        """The G samples of every group share trajectory prefixes as ``template``
        (:class:`~mmrl.plugins.flow.credit.sharing.SharedTemplate`) says; every group of ``batch`` must be whole."""
        from mmrl.plugins.flow.credit.base import grouped_rows
        from mmrl.plugins.flow.credit.sharing import shared_rollout

        config = self.config
        n = len(batch)
        counted = self.model_evaluations["rollout"]
        sigmas, timesteps = self.training_schedule()
        prompts, conditioning, extra = self.row_conditioning(batch.rows)
        groups, rows = grouped_rows(batch.group_ids)  # [R, G] batch rows of each group's members
        if rows.shape[1] != template.group_size:
            raise RolloutError(f"groups of {rows.shape[1]} samples for a template of {template.group_size}")
        first = rows[:, 0]
        per_group = {key: value.index_select(0, first.to(value.device)) for key, value in conditioning.items()}
        initial = self.adapter.initial_latents(torch.cat([self.group_noise(group) for group in groups]), per_group,
                                               sigmas[0])  # [R, *latent]

        def velocity(x: Tensor, s: int, group_index: Tensor) -> Tensor:
            picked = {key: value.index_select(0, group_index.to(value.device)) for key, value in per_group.items()}
            return self.velocity(policy, x, timesteps[s].expand(x.shape[0]), picked, self.guidance_scale,
                                 phase="rollout")

        def step(v: Tensor, x: Tensor, s: int, stochastic: bool, generators: Any) -> SDEStepOutput:
            return self.step(v, x, sigmas[s], sigmas[s + 1], stochastic=stochastic, generators=generators)

        def final_prediction(x: Tensor, v: Tensor, s: int) -> Tensor:
            return predict_x0(x, v, sigmas[s])

        result = shared_rollout(template, initial, batch.seeds[rows], velocity, step,
                                keep_means=config.credit.ratio_norm,
                                predict=final_prediction if config.decode_latent == "predicted_x0" else None)
        order = rows.flatten().to(initial.device)

        def to_batch(value: Tensor) -> Tensor:  # [R, G, ...] in group order → [n, ...] in batch order
            out = value.new_empty(n, *value.shape[2:])
            out[order] = value.reshape(-1, *value.shape[2:])
            return out

        num_groups = rows.shape[0]
        expand = (num_groups, *template.step_index.shape)
        return self._training_rollout(
            batch, prompts, conditioning, extra, to_batch(result.final), to_batch(result.before),
            to_batch(result.after), to_batch(result.old_logp), None if result.means is None else to_batch(result.means),
            to_batch(template.step_index.expand(expand).to(initial.device)),
            mask=to_batch(template.mask.expand(expand).to(initial)),
            evaluations=self.model_evaluations["rollout"] - counted,
        )

    def _training_rollout(self, batch: PromptBatch, prompts: list[str], conditioning: dict[str, Tensor],
                          extra: dict[str, Tensor], final: Tensor, before: Tensor, after: Tensor, old_logp: Tensor,
                          means: Tensor | None, step_index: Tensor, *, mask: Tensor, evaluations: int) -> Rollout:
        config = self.config
        sigmas, timesteps = self.training_schedule()
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
        if config.sde_kind().deterministic_last_step and bool((active & (replay["sigmas_next"] == 0)).any()):
            # The configs refuse this for the built-in strategies; a registered one may still choose the step.
            raise RolloutError(f"credit strategy {config.credit.strategy!r} trained the last step with sde "
                               f"{config.sde!r}, which is deterministic (no log-prob, infinite KL); train steps "
                               "0..num_steps-2 only")
        trained_sigma = sigmas[step_index][active].mean() if bool(active.any()) else sigmas.new_zeros(())
        return Rollout(
            group_ids=batch.group_ids,
            old_logp=old_logp,
            mask=mask,
            payload={**self.decoded(final, conditioning), "prompts": prompts, **extra},
            replay=replay,
            shared={"guidance_scale": self.guidance_scale, "cfg": self.cfg, "num_steps": config.num_steps,
                    "credit": config.credit.strategy},
            metrics={"trained_sigma_mean": float(trained_sigma),
                     "model_evals_per_sample": evaluations / max(len(batch), 1)},
        )

    def evaluation_rollout(self, policy: nn.Module, batch: PromptBatch) -> Rollout:
        """The plain ODE (Euler) with the evaluation steps and guidance, as the diffusers pipeline samples; A = 0."""
        config = self.config
        n = len(batch)
        sigmas, timesteps = self.adapter.schedule(config.eval_num_steps)
        prompts, conditioning, extra = self.row_conditioning(batch.rows)
        latents = self.adapter.initial_latents(self.initial_noise(batch, batch.sample_generators()), conditioning,
                                               sigmas[0])
        for s in range(config.eval_num_steps):
            velocity = self.velocity(policy, latents, timesteps[s].expand(n), conditioning, self.eval_guidance_scale,
                                     phase="evaluation")
            latents = sde_step("ode", velocity, latents, sigmas[s], sigmas[s + 1], noise_level=0.0).prev_sample
        empty = latents.new_zeros(n, 0)
        return Rollout(group_ids=batch.group_ids, old_logp=empty, mask=empty.clone(),
                       payload={**self.decoded(latents, conditioning), "prompts": prompts, **extra})

    def decoded(self, latents: Tensor, conditioning: dict[str, Tensor]) -> dict[str, Tensor]:
        """The payload entries of the final ``latents`` ``[n, ...]``: the adapter's :meth:`~FlowAdapter.decode` under
        its :attr:`~FlowAdapter.output` key, and whatever else it decodes (:meth:`~FlowAdapter.decode_extra`: LTX-2's
        audio waveforms and their sample rate), each tensor ``[n, ...]``."""
        final = self.adapter.finalize(latents, conditioning)
        return {self.adapter.output: self.adapter.decode(final), **self.adapter.decode_extra(final)}

    def row_conditioning(self, rows: Sequence[dict[str, Any]]
                         ) -> tuple[list[str], dict[str, Tensor], dict[str, Tensor]]:
        """(the prompts of ``rows``, their conditioning: prompt embeddings and, for an image-conditioned adapter, the
        encoded ``row["image"]`` of each row (each tensor ``[n, ...]``), the payload entries this adds: for an
        image-conditioned adapter ``{"condition_images": [n, 3, H, W]}`` in [0, 1], each row's (first) input image,
        and where the run's rows name up to K > 1 images ``"more_condition_images"`` ``[n, K − 1, 3, H, W]`` (a row's
        second, third, ... image, zero after its last) and ``"condition_image_counts"`` ``[n]``, where they name last
        frames ``"condition_last_images"`` ``[n, 3, H, W]`` (zero for a row without); else nothing; and what the adapter
        reads from the rows itself, :meth:`FlowAdapter.row_conditioning`: Wan video-to-video's input videos)."""
        prompts = [str(row["prompt"]) for row in rows]
        given, inputs = self.adapter.row_conditioning(list(rows))  # what the adapter reads from rows itself
        if self._images is None:
            return prompts, {**self.conditioning(prompts), **given}, inputs
        images, pixels = self._images(rows)  # with the prompts' encodings when they see the image
        text = {} if self.adapter.prompt_sees_image else self.conditioning(prompts)
        return prompts, {**text, **images, **given}, {**pixels, **inputs}

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
        """Embeddings of the negative prompt (one row), for the unconditional pass of CFG, encoded once by the
        adapter's :meth:`~FlowAdapter.encode_negative_prompt` (the pipeline's own negative-prompt encoding) and kept.
        Every phase (chain and shared-group rollouts, training forwards, evaluations) reads it through
        :meth:`velocity`."""
        if self._negative is None:
            with torch.no_grad():
                self._negative = self.adapter.encode_negative_prompt(self.config.negative_prompt,
                                                                     self.max_sequence_length)
        return self._negative

    def initial_noise(self, batch: PromptBatch, generators: list[torch.Generator]) -> Tensor:
        """x at σ = 1, ``[n, *latent]`` float32: one draw per sample from its own generator, as diffusers'
        ``randn_tensor`` draws with a list of generators; with ``share_initial_noise`` one draw per group, seeded
        from (run seed, group id), so the G samples of a prompt share it on every process."""
        if self.config.share_initial_noise and batch.training:
            per_group: dict[int, Tensor] = {}
            for group in batch.group_ids.tolist():
                if group not in per_group:
                    per_group[group] = self.group_noise(group)
            return torch.cat([per_group[group] for group in batch.group_ids.tolist()])
        shape = (1, *self.adapter.noise_shape())
        noise = torch.cat([torch.randn(shape, generator=generator) for generator in generators])
        return self.adapter.pack(noise.to(self.runtime.device))

    def group_noise(self, group: int) -> Tensor:
        """x at σ = 1 shared by a group, ``[1, *latent]``, drawn from (run seed, group id) only."""
        shape = (1, *self.adapter.noise_shape())
        generator = torch.Generator().manual_seed(derive_seed(self.runtime.seed, int(group), _SHARED_NOISE_TAG))
        return self.adapter.pack(torch.randn(shape, generator=generator).to(self.runtime.device))

    def velocity(self, module: nn.Module, latents: Tensor, timesteps: Tensor, conditioning: dict[str, Tensor],
                 guidance_scale: GuidanceScale, *, phase: str) -> Tensor:
        """float32 velocity ``[n, *latent]``: the one function rollouts and training forwards share. ``phase``
        ('rollout', 'forward' or 'evaluation') is the counter of :attr:`model_evaluations` the rows go to."""
        self.model_evaluations[phase] += int(latents.shape[0])
        negative = None
        if self.cfg:  # an adapter whose prompts see the image has a negative per row in ``conditioning``
            negative = {} if self.adapter.prompt_sees_image else {
                key: value.to(self.input_dtype) for key, value in self.negative_conditioning().items()}
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

    def step(self, velocity: Tensor, latents: Tensor, sigma: Tensor, sigma_next: Tensor, *, stochastic: bool,
             prev_sample: Tensor | None = None, generators: list[torch.Generator] | None = None) -> SDEStepOutput:
        """One step of ``plugin.sde`` (``stochastic``) or of the ODE, sampled with ``generators`` or scoring
        ``prev_sample`` (:func:`~mmrl.plugins.flow.sde.sde_step`)."""
        kind = self.config.sde if stochastic else "ode"
        return sde_step(kind, velocity, latents, sigma, sigma_next, noise_level=self.config.noise_level,
                        prev_sample=prev_sample, generator=generators if stochastic else None,
                        cps_log_prob=self.config.cps_log_prob)

    def score(self, policy: nn.Module, rollout: Rollout, columns: list[int], active: Tensor, *, forced: bool,
              reference: Callable[[nn.Module], AbstractContextManager[nn.Module]] | None,
              ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Recompute the log-probs of the stored actions of ``columns`` where ``active`` (with gradients), and their KL
        to the reference when ``reference`` is given (a context manager that yields the reference module).

        Args:
            policy: The trained transformer.
            rollout: A training rollout of :meth:`chain_rollout` or :meth:`shared_rollout`.
            columns: The action columns to score.
            active: ``[n, len(columns)]`` bool, the actions to recompute; the others keep their old log-prob.
            forced: Whether the one active action is there only to give the output a graph (its KL is zeroed).
            reference: ``FlowPlugin``'s reference context, or None when no KL is needed.

        Returns:
            (logp ``[n, len(columns)]``, KL ``[n, len(columns)]`` or None, the refreshed transition means ``[n, A,
            *latent]`` with ``credit.ratio_norm``, else None).
        """
        replay = rollout.replay
        conditioning = replay["conditioning"]
        # [n, width, *latent], refreshed below
        means = replay["means"].detach().clone() if self.config.credit.ratio_norm else None
        logps, kls = [], []
        for k, column in enumerate(columns):
            if rollout.old_logp is None:  # no old policy apart from the current weights (see the docstring)
                old = rollout.mask.new_zeros(rollout.mask.shape[0], dtype=torch.float32)  # [n]
            else:
                old = rollout.old_logp[:, k].detach().float()  # [n]
            rows = active[:, k]
            if not bool(rows.any()):
                logps.append(old)
                if reference is not None:
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
            velocity = self.velocity(policy, latents, timesteps, picked, self.guidance_scale, phase="forward")
            out = self.step(velocity, latents, sigma, sigma_next, stochastic=True, prev_sample=stored)
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
            if reference is not None:
                with torch.no_grad(), reference(policy) as reference_module:
                    ref_velocity = self.velocity(reference_module, latents, timesteps, picked, self.guidance_scale,
                                                 phase="forward")
                ref_mean = self.step(ref_velocity, latents, sigma, sigma_next, stochastic=True,
                                      prev_sample=stored).mean
                kl = self.sde.kl(out.mean, ref_mean, out.std, sigma, sigma_next, noise_level=self.config.noise_level,
                                 variance=self.config.kl_variance)
                if forced:
                    kl = kl * 0
            if index is not None:  # back to all n rows; gradients flow into the computed ones
                logp = old.index_put((index.to(old.device),), logp.float())
                if kl is not None:
                    kl = torch.zeros_like(old).index_put((index.to(old.device),), kl.float())
            logps.append(logp)
            if reference is not None:
                kls.append(kl)
        logp = torch.stack(logps, dim=1)  # [n, len(columns)]
        return logp, torch.stack(kls, dim=1) if reference is not None else None, means


def predict_x0(latents: Tensor, velocity: Tensor, sigma: Tensor) -> Tensor:
    """The clean latent a flow-matching model predicts from x_σ: x̂₀ = x_σ − σ·v (x_σ = (1 − σ)·x₀ + σ·ε and
    v = ε − x₀), what DanceGRPO's ``flux_step`` returns as ``pred_original_sample`` and its trainers decode for the
    reward at the last step (XueZeyue/DanceGRPO@15cc71d ``fastvideo/train_grpo_flux.py:143, 254``).

    Args:
        latents (`torch.Tensor`): x_σ, the step's input.  # [n, *latent]
        velocity (`torch.Tensor`): v, the (guided) velocity at x_σ.  # [n, *latent]
        sigma (`torch.Tensor`): σ of the step, a scalar.
    """
    dtype = torch.promote_types(latents.dtype, torch.float32)  # the SDE step's rule: float32, float64 kept
    return latents.to(dtype) - sigma.to(device=latents.device, dtype=dtype) * velocity.to(dtype)


def _rows(value: Tensor, index: Tensor | None) -> Tensor:
    return value if index is None else value.index_select(0, index)
