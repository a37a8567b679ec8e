"""Floor of the flow plugin: a diffusers rectified-flow transformer (SD3, FLUX) with its LoRA adapter.

- generation: per rollout call, the transformer at every denoising step on the call's latents (in the plugin's
  ``transformer_batch_size`` pieces; with CFG one call on the doubled batch and the guidance combination, as the
  plugin runs it), an Euler update between steps, and the VAE decode of the final latents;
- forward and backward: per backward pass, the transformer at each trained step's stored inputs of the pass's
  samples (only the actions the plugin recomputes: mask > 0), reduced to a scalar, then one backward;
- extras: ``reference``, the reference transformer (LoRA disabled, or the frozen copy) at the same inputs without
  gradients, when ``kl_coef > 0``; ``old_logp``, the learner's no-grad pass when ``recompute_old_logp`` needs one;
  ``logprob_math``, the plugin's SDE step (mean, std, noise draws and log-density; :func:`~mmrl.plugins.flow.sde.
  sde_step` through ``FlowPlugin._step``) at every sampling step of the rollout and, with gradients and their
  backward, at every recomputed action of the training passes.

Covers the credit strategies whose rollout is one chain per sample (``step``, ``chunk``); the branching ones share
trajectory prefixes and are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mmrl.trainer.learn import needs_old_logp

from . import Floor, scalar

CHAIN_STRATEGIES = ("step", "chunk")


class FlowFloor(Floor):
    """Floor of the ``flow`` plugin (module docstring)."""

    def __init__(self, trainer: Any, capture: Any):
        strategy = trainer.plugin.config.credit.strategy
        if strategy not in CHAIN_STRATEGIES:
            raise SystemExit(f"benchmarks/step_floors.py: the flow floor covers credit strategies "
                             f"{', '.join(CHAIN_STRATEGIES)}, not {strategy!r} (its rollout shares prefixes)")
        super().__init__(trainer, capture)
        plugin = self.plugin
        self.adapter = plugin.adapter
        self.dtype = plugin.input_dtype
        config = plugin.config
        self.sigmas, self.timesteps = plugin.sampler.training_schedule()  # [S+1], [S]
        self.piece = config.transformer_batch_size
        self.negative = None
        if plugin.cfg:
            self.negative = {key: value.to(self.dtype) for key, value in plugin.sampler.negative_conditioning().items()}
        generator = torch.Generator().manual_seed(0)
        # Per rollout call: (initial latents [n, *latent], conditioning {key: [n, ...]}).
        self.calls = []
        for call in capture.rollouts:
            latents = call.replay["latents"]  # [n, A, *latent]
            shape = (latents.shape[0], *latents.shape[2:])
            noise = torch.randn(shape, generator=generator).to(self.device, self.dtype)
            self.calls.append((noise, self._cast(call.replay["conditioning"])))

    # ------------------------------------------------------------------ model calls
    def velocity(self, module: torch.nn.Module, latents: torch.Tensor, timesteps: torch.Tensor,
                 conditioning: dict[str, torch.Tensor]) -> torch.Tensor:
        """The transformer on ``latents [n, *latent]`` in the plugin's pieces, CFG as the plugin runs it."""
        n = latents.shape[0]
        size = self.piece or n
        parts = []
        for start in range(0, n, size):
            rows = slice(start, start + size)
            parts.append(self.adapter.velocity(module, latents[rows], timesteps[rows],
                                               {key: value[rows] for key, value in conditioning.items()},
                                               guidance_scale=self.plugin.guidance_scale, negative=self.negative))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def generation(self) -> None:
        for noise, conditioning in self.calls:
            latents = noise
            n = latents.shape[0]
            for s in range(self.timesteps.shape[0]):
                velocity = self.velocity(self.policy, latents, self.timesteps[s].expand(n), conditioning)
                latents = (latents.float() + (self.sigmas[s + 1] - self.sigmas[s]) * velocity).to(self.dtype)
            self.adapter.decode(latents)

    def unit_inputs(self, epoch: int, indices: list[int], columns: torch.Tensor | None) -> Any:
        index = torch.tensor(indices, dtype=torch.long, device=self.device)
        replay = self.rollout.replay
        active = self.rollout.mask.index_select(0, index) > 0  # [n, A]
        if self.rollout.action_weights is not None:
            active = active & (self.rollout.action_weights.index_select(0, index) != 0)
        conditioning = {key: value.index_select(0, index) for key, value in replay["conditioning"].items()}
        width = replay["latents"].shape[1]
        steps = []
        for column in (range(width) if columns is None else columns.tolist()):
            rows = active[:, column].nonzero().flatten()
            if rows.numel() == 0:
                continue
            picked = index.index_select(0, rows)
            steps.append((replay["latents"][:, column].index_select(0, picked).to(self.dtype),
                          replay["timesteps"][:, column].index_select(0, picked),
                          self._cast({key: value.index_select(0, rows) for key, value in conditioning.items()}),
                          replay["next_latents"][:, column].index_select(0, picked),
                          replay["sigmas"][:, column].index_select(0, picked),
                          replay["sigmas_next"][:, column].index_select(0, picked)))
        return steps

    def loss(self, inputs: Any) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for latents, timesteps, conditioning, *_ in inputs:
            total = total + scalar(self.velocity(self.policy, latents, timesteps, conditioning))
        return total

    # ------------------------------------------------------------------ extras
    def extras(self) -> dict[str, Callable[[], None]]:
        plugin, runtime = self.plugin, self.plugin.runtime
        units = [unit.inputs for minibatch in self.schedule for unit in minibatch]
        extras: dict[str, Callable[[], None]] = {}
        algorithm = self.trainer.config.algorithm
        if algorithm.kl_coef > 0:
            def reference() -> None:
                with torch.no_grad(), plugin._reference_module(self.policy) as module, runtime.autocast():
                    for steps in units:
                        for latents, timesteps, conditioning, *_ in steps:
                            self.velocity(module, latents, timesteps, conditioning)

            extras["reference"] = reference
        if needs_old_logp(self.trainer.config) and (algorithm.recompute_old_logp or self.rollout.old_logp is None):
            everything = list(range(len(self.rollout)))
            passes = [self.unit_inputs(0, everything[start:start + self.trainer.geometry.micro_batch_size], None)
                      for start in range(0, len(everything), self.trainer.geometry.micro_batch_size)]

            def old_logp() -> None:
                with torch.no_grad(), runtime.autocast():
                    for steps in passes:
                        self.loss(steps)

            extras["old_logp"] = old_logp
        extras["logprob_math"] = self._logprob_math()
        return extras

    def _logprob_math(self) -> Callable[[], None]:
        """The SDE steps of the rollout and the log-densities of the training passes, on stand-in velocities."""
        plugin = self.plugin
        trained = {int(s) for call in self.capture.rollouts for s in call.replay["step_index"].flatten().tolist()}
        rollout_calls = [(noise.float(), batch) for (noise, _), batch in zip(self.calls, self.capture.batches,
                                                                               strict=True)]
        units = [unit.inputs for minibatch in self.schedule for unit in minibatch]

        def logprob_math() -> None:
            with torch.no_grad():
                for latents, batch in rollout_calls:
                    generators = batch.sample_generators()
                    for s in range(self.timesteps.shape[0]):
                        stochastic = s in trained
                        out = plugin.sampler.step(latents, latents, self.sigmas[s], self.sigmas[s + 1],
                                                  stochastic=stochastic, generators=generators if stochastic else None)
                        latents = out.prev_sample
            for steps in units:
                for latents, _, _, stored, sigma, sigma_next in steps:
                    velocity = latents.float().detach().requires_grad_(True)
                    out = plugin.sampler.step(velocity, latents.float(), sigma, sigma_next, stochastic=True,
                                              prev_sample=stored)
                    out.log_prob.sum().backward()

        return logprob_math

    def describe(self) -> dict[str, Any]:
        calls = [noise.shape[0] for noise, _ in self.calls]
        return {"generation": f"{len(calls)} rollout call(s) of {calls} samples x {self.timesteps.shape[0]} steps"
                              f"{' (CFG: doubled batch)' if self.negative is not None else ''} + VAE decode",
                "forward_backward": f"{self.backward_passes()} backward passes over "
                                    f"{sum(len(u.inputs) for m in self.schedule for u in m)} transformer calls"}

    def _cast(self, conditioning: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {key: value.to(self.dtype) for key, value in conditioning.items()}
