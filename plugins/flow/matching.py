r"""Advantage Weighted Matching (AWM): the flow-matching loss of the final sample as the action's log-likelihood.

Xue, Ge, Zhang, Li, Ma 2025, "Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion Models",
arXiv:2509.25050; released code scxue/advantage_weighted_matching@be51372 (read at that commit;
``advantage_weighted_matching/scripts/train_sd3_awm.py``, below "train_sd3_awm.py:L").

``plugin.likelihood: matching`` replaces the SDE transition log-probs of Flow-GRPO with a surrogate of the sample's
log-likelihood. For the clean latent x₀ a training rollout ends at (the latent its reward was computed on), K
training times t_k and fresh noise ε_k ~ N(0, I):

    x_t = (1 − t)·x₀ + t·ε,        target u = ε − x₀,
    mse_k = mean over latent elements of (v_θ(x_{t_k}, t_k) − u_k)²          (float64),
    log p_k = −w(mse_k, t_k)                                                (one action column per k),

with the weightings of ``compute_log_prob_awm`` (train_sd3_awm.py:L236-251): ``uniform`` w = mse, ``t`` w = t·mse,
``t2`` w = t²·mse, ``huber`` w = t·(√(mse + 1e-10) − 1e-5), ``ghuber`` w = t·((mse + 1e-10)^p − (1e-10)^p)/p.
The core's PPO clip then acts on exp(log p_k − log p_k^old) per column (upstream ``loss_type: exp_first``,
``ratio_level: token``) or on exp(mean_k log p_k − mean_k log p_k^old) per sample (``sum_first``: the core's
sequence ratio, ``ratio_level: sequence``; train_sd3_awm.py:L1301-1329). The KL to the reference is on the
velocities, per column, mean over latent elements of (v_θ − v_ref)² (``kl_weight: uniform``) or that divided by
2·s(t)² with s(t) = 0.7·√(t / (1 − min(t, 0.99))), Flow-GRPO's SDE scale at σ = t with its noise level 0.7
hard-coded upstream (``elbo``; train_sd3_awm.py:L236, L1334-1340).

**Draws.** The times and the noise are drawn per sample from its seed (:func:`draw_times`, :func:`column_noise`),
one set per inner epoch (``matching.redraw_per_epoch``, with ``algorithm.inner_epochs`` > 1), and the rollout's
replay carries the times ``[N, E, K]`` and one seed per sample from which every ε_k is regenerated exactly. The old
policy pass, the training forward and the reference therefore see the same x_t, and the ratio is exactly 1 before
the first update. Upstream draws them once per epoch for each training micro-batch (train_sd3_awm.py:L1138-1225),
keeps them for the old and the new pass (``sample["timesteps"]``, ``sample["train_random_noise"]``) and shares the
t vector across the micro-batch for ``logit_normal`` and the ``discrete`` kinds (``repeat_interleave(..., B)``); mmrl
draws a vector per sample so that nothing depends on how samples are laid out in micro-batches or over processes:
each sample's marginal law is upstream's, only the correlation between samples differs.

**Time samplers** (:func:`draw_times`), each one draw per stratum k = 0..K−1 with u_k = (k + U_k)/K:
``logit_normal`` t = shift(sigmoid(Φ⁻¹(u_k))) clamped to ≥ 0.01 (L1138-1160), ``uniform`` t = shift(0.2 + 0.8·u_k)
(L1162-1170), shift(t) = s·t/(1 + (s − 1)·t); ``discrete`` picks a step index per stratum of
``linspace(0, M, K + 1)`` floored, M = ⌊S·timestep_fraction⌋ (L1172-1180), ``discrete_wo_init`` the same on
``linspace(1, M, K + 1)`` (L1197-1205), ``discrete_with_init`` index 0 then K − 1 strata of ``linspace(1, M, K)``
(L1181-1196); t is σ of the rollout's own grid at that index and the model timestep the grid's (upstream divides the
scheduler's timestep by 1000: σ for SD3). Upstream shuffles the logit-normal vector over the K positions (L1151);
the columns are exchangeable in every loss, so mmrl keeps stratum order (column k holds stratum k).

**Rollouts** need no log-probs: :meth:`MatchingLikelihood.rollout` runs the sampler's chain rollout with no trained
step, the ODE (Euler) by default or ``plugin.sde`` at the steps whose σ lies in ``matching.sde_sigma_range``.
Upstream samples with SA-Solver (``use_sa_solver: True``, predictor and corrector order 2, PEC mode, noise
``noise_level`` where 0.3 ≤ t ≤ 0.9: ``flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py:271-297``), with noise
level 0 in its PickScore recipe (a deterministic multistep ODE solver) and 0.4 in its GenEval and OCR recipes; mmrl
has no SA-Solver and uses Euler steps (and its own SDE kinds) on the pipeline's grid instead.

**The EMA KL** (``matching.ema_kl_coef``, upstream's ``ema_beta``): ema_kl_coef · mean over (sample, time) of
mean((v_θ − v_ema)²) (``ema_kl_weight``, as ``kl_weight``), v_ema the velocity of an exponential moving average of
the trained weights, returned as ``PolicyOutput.aux_loss`` (the core averages it over the optimizer step's backward
passes, as upstream's gradient accumulation averages its micro-batch means; L1276-1280, L1341-1352: the mean over
(sample, time) only for equal micro-batches and action chunks that divide K, docs/flow.md section 16). Upstream adds
it inside its ``beta > 0`` branch (L1330), where mmrl adds it whatever ``algorithm.kl_coef``. Upstream keeps
the EMA as a second LoRA adapter, initialised to the trained one (L649-658) and moved after every epoch by
ema ← d·ema + (1 − d)·θ with d = min(kl_ema_decay, 0.001·global_step) (L1409-1419); mmrl keeps a copy of the trained
parameters and makes the same update before each training step's first rollout, with the training steps done in
place of upstream's optimizer steps (equal in the released recipes, one optimizer step per epoch). The copy travels
with checkpoints (``FlowPlugin.save_trainable``; a checkpoint of step 0, written before the first rollout, holds an
empty file and the resumed run copies at its first rollout); it is a per-process copy of the local parameters, so
it needs unsharded (data-parallel) training: ``FlowPlugin`` refuses FSDP and ZeRO-3 launches at start-up and
:func:`trained_copy` a sharded parameter. ``FlowPlugin.check_config`` refuses an ``algorithm.action_chunk_size``
that does not divide K (a short last chunk would weigh its times more in the backward passes' mean); a smaller last
micro-batch (``micro_batch_size`` not dividing the per-process minibatch) still weighs its rows more.

**Not done here.** Upstream's off-policy mode (``off_policy``: sample and score the old policy with the EMA adapter,
L883-904, L1233-1240) would make the EMA the behaviour policy; the released recipes set ``off_policy: False``, and
mmrl's old policy is always the sampling weights (upstream's on-policy branch, L1227-1229, L1282-1284).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor, nn

from mmrl.config import ConfigError, config_field
from mmrl.seeding import derive_seed

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager

    from mmrl.plugin import PromptBatch, Runtime
    from mmrl.plugins.flow.sampler import FlowSampler
    from mmrl.rollout import Rollout

TIME_SAMPLERS = ("logit_normal", "uniform", "discrete", "discrete_with_init", "discrete_wo_init")
WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")
ELBO_NOISE_LEVEL = 0.7  # upstream's std_dev_t = sqrt(σ/(1 − clamp(σ, 0, 0.99)))·0.7, train_sd3_awm.py:L236
UNIFORM_RANGE = (0.2, 1.0)  # upstream's global_lower, global_upper, train_sd3_awm.py:L1163
LOGIT_NORMAL_MIN = 0.01  # upstream's clamp after the shift, train_sd3_awm.py:L1159

_TIMES_TAG = 0xA3E1  # separate the time draw and the noise draw from the sample's rollout noise stream
_NOISE_TAG = 0xA3E2


@dataclass
class MatchingConfig:
    """``plugin.matching``: Advantage Weighted Matching's likelihood surrogate (``plugin.likelihood: matching``)."""

    num_times: int = config_field(
        6, minimum=1, help="K, training times per sample: the action columns of a rollout (one velocity forward "
        "each).", ref="AWM train_timesteps: 6 (dgx_awm.py)",
    )
    time_sampler: Literal["logit_normal", "uniform", "discrete", "discrete_with_init", "discrete_wo_init"] = \
        config_field(
            "discrete", help="How the K times are drawn, one per stratum: 'logit_normal' (shifted, >= 0.01), "
            "'uniform' on [0.2, 1] (shifted), or a step of the rollout's own grid: 'discrete' (strata of steps "
            "0..M-1, M = int(num_steps*timestep_fraction)), 'discrete_wo_init' (steps 1..M-1), "
            "'discrete_with_init' (step 0, then K-1 strata of steps 1..M-1).",
            ref="AWM time_type: discrete (PickScore), discrete_wo_init (GenEval, OCR); train_sd3_awm.py L1138-1207",
        )
    time_shift: float = config_field(
        3.0, minimum=0.0, exclusive_minimum=True,
        help="s of t -> s*t/(1 + (s-1)*t) for the logit_normal and uniform samplers (the discrete ones read the "
        "grid, already shifted).", ref="AWM time_shift: 3.0",
    )
    weighting: Literal["uniform", "t", "t2", "huber", "ghuber"] = config_field(
        "uniform", help="log p = -w: 'uniform' mse, 't' t*mse, 't2' t^2*mse, 'huber' t*(sqrt(mse+1e-10)-1e-5), "
        "'ghuber' t*((mse+1e-10)^p - 1e-10^p)/p with p = ghuber_power (mse: the velocity's mean squared error).",
        ref="AWM weighting: ghuber (dgx_awm.py; upstream spells them Uniform, t, t**2, huber, ghuber)",
    )
    ghuber_power: float = config_field(0.25, minimum=0.0, exclusive_minimum=True,
                                       help="p of the ghuber weighting.", ref="AWM ghuber_power: 0.25")
    kl_weight: Literal["uniform", "elbo"] = config_field(
        "uniform", help="The per-column KL: mean((v - v_ref)^2) ('uniform') or that / (2 s(t)^2) with s(t) = "
        "0.7*sqrt(t/(1 - min(t, 0.99))) ('elbo').", ref="AWM kl_weight: Uniform (dgx_awm.py)",
    )
    sde_sigma_range: list[float] | None = config_field(
        None, help="[lo, hi]: rollout steps whose sigma lies in it take plugin.sde with plugin.noise_level, the "
        "others Euler ODE steps. Null: the ODE everywhere.",
        ref="AWM: SA-Solver noise 0 (PickScore), 0.4 where 0.3 <= t <= 0.9 (GenEval, OCR)",
    )
    advantage_scale: float = config_field(
        1.0, minimum=0.0, exclusive_minimum=True,
        help="Multiplies the policy term (not the KL): upstream's advantage_max / adv_clip_max rescaling of the "
        "clipped advantages.", ref="AWM: advantage_max 1, adv_clip_max 5, so 0.2 (dgx_awm.py, base_awm.py)",
    )
    ema_kl_coef: float = config_field(
        0.0, minimum=0.0, help="Weight of the KL to an EMA of the trained weights, mean((v - v_ema)^2) "
        "(ema_kl_weight), added to the loss as PolicyOutput.aux_loss (independent of algorithm.kl_coef). 0: off.",
        ref="AWM ema_beta: 1 (dgx_awm.py); train_sd3_awm.py L1276-1280, L1341-1352",
    )
    ema_kl_weight: Literal["uniform", "elbo"] = config_field(
        "uniform", help="The EMA KL's weighting, as kl_weight.", ref="AWM kl_ema_weight: Uniform",
    )
    ema_decay: float = config_field(
        0.3, minimum=0.0, maximum=1.0,
        help="d of the EMA update ema <- d*ema + (1-d)*theta, made once per training step before its rollout.",
        ref="AWM kl_ema_decay: 0.3; train_sd3_awm.py L1409-1419",
    )
    ema_decay_schedule: Literal["linear", "constant"] = config_field(
        "linear", help="'linear': d = min(ema_decay, 0.001*step) with step the training steps done (upstream's "
        "optimizer steps: one per step in its recipes); 'constant': d = ema_decay.",
        ref="AWM kl_ema_decay_type: linear",
    )
    redraw_per_epoch: bool = config_field(
        True, help="With algorithm.inner_epochs > 1, draw new times and noise for every inner epoch (one old-policy "
        "pass each); false: one draw serves every epoch.",
    )

    def validate(self, path: str) -> None:
        if self.sde_sigma_range is not None and (len(self.sde_sigma_range) != 2
                                                 or not 0 <= self.sde_sigma_range[0] <= self.sde_sigma_range[1] <= 1):
            raise ConfigError(f"{path}.sde_sigma_range", self.sde_sigma_range, "null or [lo, hi] with 0 <= lo <= hi "
                              "<= 1")

    def check_grid(self, path: str, num_steps: int, timestep_fraction: float) -> None:
        """A discrete sampler needs a step in each of its K strata (``M = ⌊S·timestep_fraction⌋`` steps)."""
        if not self.time_sampler.startswith("discrete"):
            return
        steps = int(num_steps * timestep_fraction)
        need = self.num_times + 1 if self.time_sampler == "discrete_wo_init" else self.num_times
        if steps < need:
            raise ConfigError("plugin.timestep_fraction", timestep_fraction, f"a fraction with int(num_steps * "
                              f"fraction) >= {need} for matching.time_sampler {self.time_sampler!r} with "
                              f"{self.num_times} times (one grid step per stratum); got {steps} of {num_steps}")


# ------------------------------------------------------------------------------------------------- pure functions
def shift_times(t: Tensor, shift: float) -> Tensor:
    """SD3's time shift s·t / (1 + (s − 1)·t) (train_sd3_awm.py:L1156, L1169)."""
    return shift * t / (1 + (shift - 1) * t)


def discrete_strata(time_sampler: str, num_times: int, grid_steps: int) -> tuple[Tensor, Tensor]:
    """``(lower, upper)`` ``[K]`` long: stratum k draws a grid step in [lower_k, upper_k) (lower_k when empty), the
    floored ``linspace`` boundaries of upstream (train_sd3_awm.py:L1173-1177, L1185-1190, L1198-1202); M =
    ``grid_steps``. ``discrete_with_init``'s first stratum is step 0 alone."""
    if time_sampler == "discrete":
        bounds = torch.linspace(0, grid_steps, num_times + 1).long()
    elif time_sampler == "discrete_wo_init":
        bounds = torch.linspace(1, grid_steps, num_times + 1).long()
    elif time_sampler == "discrete_with_init":
        rest = torch.linspace(1, grid_steps, num_times).long()  # K − 1 strata after step 0
        return torch.cat([torch.zeros(1, dtype=torch.long), rest[:-1]]), torch.cat([torch.ones(1, dtype=torch.long),
                                                                                     rest[1:]])
    else:
        raise ValueError(f"{time_sampler!r} is not a discrete time sampler")
    return bounds[:-1], bounds[1:]


def draw_times(config: MatchingConfig, generator: torch.Generator, sigmas: Tensor, timesteps: Tensor,
               grid_steps: int) -> tuple[Tensor, Tensor]:
    """One sample's K training times: ``(t [K] float32, model timesteps [K] float32)``.

    Args:
        config: The matching options (sampler, K, shift).
        generator: The sample's own generator (CPU).
        sigmas: σ of the rollout grid ``[S+1]``; the discrete samplers take t = σ at the drawn step.
        timesteps: The model timesteps of the grid ``[S]``, given at the drawn step.
        grid_steps: M = ⌊S·timestep_fraction⌋, the steps the discrete samplers draw from.
    """
    k = config.num_times
    u = torch.rand(k, generator=generator, dtype=torch.float32)  # [K], one uniform per stratum
    if config.time_sampler in ("logit_normal", "uniform"):
        strata = (torch.arange(k, dtype=torch.float32) + u) / k  # [K] in (k/K, (k+1)/K)
        if config.time_sampler == "logit_normal":
            normal = torch.distributions.Normal(0.0, 1.0)
            t = shift_times(torch.sigmoid(normal.icdf(strata)), config.time_shift).clamp(min=LOGIT_NORMAL_MIN)
        else:
            lo, hi = UNIFORM_RANGE
            t = shift_times(lo + strata * (hi - lo), config.time_shift)
        scale = float(timesteps[0] / sigmas[0]) if float(sigmas[0]) > 0 else 1000.0  # the scheduler's σ → timestep
        return t, t * scale
    lower, upper = discrete_strata(config.time_sampler, k, grid_steps)
    index = lower + (u * (upper - lower)).long()  # [K] grid steps
    grid, steps = sigmas.detach().float().cpu(), timesteps.detach().float().cpu()
    return grid[index], steps[index]


def column_noise(seeds: Tensor, epoch: int, column: int, shape: tuple[int, ...]) -> Tensor:
    """ε of column ``column`` of inner epoch ``epoch`` for each sample ``[n, *shape]`` float32 (CPU): a draw from a
    generator seeded by (the sample's matching seed, epoch, column), so every pass regenerates the same noise."""
    rows = [torch.randn(shape, generator=torch.Generator().manual_seed(derive_seed(int(seed), _NOISE_TAG, epoch,
                                                                                   column)))
            for seed in seeds.tolist()]
    return torch.stack(rows)


def noised(clean: Tensor, noise: Tensor, t: Tensor) -> Tensor:
    """x_t = (1 − t)·x₀ + t·ε, ``[n, *latent]`` (train_sd3_awm.py:L1232, L1268); ``t`` ``[n]``."""
    tt = t.to(clean).reshape(-1, *([1] * (clean.dim() - 1)))
    return (1 - tt) * clean + tt * noise


def matching_log_prob(velocity: Tensor, noise: Tensor, clean: Tensor, t: Tensor, weighting: str,
                      ghuber_power: float = 0.25) -> Tensor:
    """AWM's log-likelihood surrogate ``[n]`` float64: −w(mean over latent elements of (v − (ε − x₀))², t)
    (train_sd3_awm.py:L237-251).

    Args:
        velocity: v_θ(x_t, t) ``[n, *latent]``.
        noise: ε ``[n, *latent]``.
        clean: x₀ ``[n, *latent]``.
        t: ``[n]`` the times.
        weighting: one of :data:`WEIGHTINGS`.
        ghuber_power: p of ``ghuber``.
    """
    error = velocity.double() - (noise.double() - clean.double())  # [n, *latent]
    mse = error.pow(2).flatten(1).mean(dim=1)  # [n]
    t = t.to(mse)
    if weighting == "uniform":
        return -mse
    if weighting == "t":
        return -mse * t
    if weighting == "t2":
        return -mse * t**2
    if weighting == "huber":
        return -(torch.sqrt(mse + 1e-10) - 1e-5) * t
    if weighting == "ghuber":
        floor = torch.tensor(1e-10, dtype=mse.dtype, device=mse.device).pow(ghuber_power)
        return -((mse + 1e-10).pow(ghuber_power) - floor) * t / ghuber_power
    raise ValueError(f"unknown matching weighting {weighting!r}; expected one of {', '.join(WEIGHTINGS)}")


def elbo_std(t: Tensor) -> Tensor:
    """s(t) = 0.7·√(t / (1 − min(t, 0.99))), upstream's ``std_dev_t`` (train_sd3_awm.py:L236)."""
    return torch.sqrt(t / (1 - t.clamp(0, 0.99))) * ELBO_NOISE_LEVEL


def velocity_kl(velocity: Tensor, reference: Tensor, t: Tensor, kl_weight: str) -> Tensor:
    """The per-column KL ``[n]`` float64: mean over latent elements of (v − v_ref)², divided by 2·s(t)² for
    ``elbo`` (train_sd3_awm.py:L1334-1340)."""
    kl = (velocity.double() - reference.double()).pow(2).flatten(1).mean(dim=1)  # [n]
    if kl_weight == "elbo":
        return kl / (2 * elbo_std(t.double().to(kl.device)) ** 2)
    if kl_weight == "uniform":
        return kl
    raise ValueError(f"unknown matching kl_weight {kl_weight!r}; expected uniform or elbo")


def trained_copy(module: nn.Module, what: str) -> dict[str, Tensor]:
    """A copy of ``module``'s trained parameters by name, refusing parameters that are a shard of a larger tensor
    (DeepSpeed ZeRO-3's ``ds_id``, FSDP's flat parameters, FSDP2's DTensors): a plugin-held copy of local shards
    would be saved by the main process alone. The plugin refuses such launches at start-up; this catches the ones
    it cannot see (a wrapper set up without Accelerate's launch variables)."""
    copy = {}
    for name, parameter in module.named_parameters():
        if not parameter.requires_grad:
            continue
        if hasattr(parameter, "ds_id") or getattr(parameter, "_is_flat_param", False) \
                or type(parameter.data).__name__ == "DTensor":
            raise RuntimeError(f"flow: {what} copies the trained parameters of this process, and {name!r} is a shard "
                               "(FSDP or DeepSpeed ZeRO-3); train data-parallel (DDP) instead")
        copy[name] = parameter.detach().clone()
    return copy


# ------------------------------------------------------------------------------------------------- the plugin side
class MatchingLikelihood:
    """The rollout and the scoring of ``plugin.likelihood: matching`` on a :class:`~.sampler.FlowSampler`.

    Args:
        config: The ``plugin.matching`` section.
        sampler: The plugin's sampler: its chain rollout, its velocity function (CFG, transformer batches, autocast).
        runtime: The run's runtime (``inner_epochs``: how many draws a rollout prepares).
    """

    def __init__(self, config: MatchingConfig, sampler: FlowSampler, runtime: Runtime):
        self.config = config
        self.sampler = sampler
        self.runtime = runtime
        self.epoch = 0  # the draw the forwards use, set by FlowPlugin.start_inner_epoch
        #: With ``ema_kl_coef``: the EMA of the trained parameters by (unwrapped) name, and the training step whose
        #: rollout last updated it (-1: copied from the weights, not updated yet). None until the first rollout.
        self.ema: dict[str, Tensor] | None = None
        self.ema_step = -1

    # ------------------------------------------------------------------ the EMA policy of the EMA KL
    def ema_decay(self, step: int) -> float:
        """d at the update made before training step ``step`` (``step`` steps done): upstream's
        ``min(kl_ema_decay, 0.001·global_step)`` for ``linear`` (train_sd3_awm.py:L1410-1413)."""
        if self.config.ema_decay_schedule == "linear":
            return min(self.config.ema_decay, 0.001 * step)
        return self.config.ema_decay

    @torch.no_grad()
    def update_ema(self, policy: nn.Module, step: int) -> None:
        """Bring the EMA up to training step ``step`` (0-based; called by every training rollout, acting once per
        step): a copy of the trained weights the first time, then ema ← d·ema + (1 − d)·θ, as upstream after every
        epoch (train_sd3_awm.py:L655-658, L1416-1419)."""
        if self.config.ema_kl_coef == 0 or step <= self.ema_step:
            return
        module = self.runtime.unwrap(policy)
        trained = {name: p for name, p in module.named_parameters() if p.requires_grad}
        if self.ema is None:
            self.ema = trained_copy(module, "plugin.matching.ema_kl_coef's EMA")
        else:
            decay = self.ema_decay(step)
            for name, value in self.ema.items():
                value.mul_(decay).add_(trained[name].detach(), alpha=1 - decay)
        self.ema_step = step

    def _ema_velocities(self, policy: nn.Module, inputs: list[tuple[Tensor, Tensor]],
                        conditioning: dict[str, Tensor]) -> list[Tensor]:
        """v_ema at each ``(x_t, model timesteps)`` of ``inputs``: the EMA weights copied into the trained parameters
        for no-grad forwards and the trained weights restored after, all before any forward that back-propagates
        (nothing saved for a backward sees the swap)."""
        if self.ema is None:
            raise RuntimeError("flow matching: the EMA KL needs the EMA weights, which a training rollout sets up; "
                               "score a rollout of this plugin")
        module = self.runtime.unwrap(policy)
        parameters = dict(module.named_parameters())
        sampler = self.sampler
        with torch.no_grad():
            kept = {name: parameters[name].detach().clone() for name in self.ema}
            try:
                for name, value in self.ema.items():
                    parameters[name].copy_(value)
                return [sampler.velocity(module, x_t, model_t, conditioning, sampler.guidance_scale, phase="forward")
                        for x_t, model_t in inputs]
            finally:
                for name, value in kept.items():
                    parameters[name].copy_(value)

    def num_draws(self) -> int:
        """Draws of times and noise per sample: one per inner epoch with ``redraw_per_epoch``, else one."""
        return max(int(self.runtime.inner_epochs), 1) if self.config.redraw_per_epoch else 1

    @torch.no_grad()
    def rollout(self, policy: nn.Module, batch: PromptBatch) -> Rollout:
        """The chain rollout with no trained step (ODE, or SDE in ``sde_sigma_range``), its final latent kept as x₀,
        and the K times of each draw; ``old_logp`` is None (the core scores the old policy when it needs one)."""
        from mmrl.plugins.flow.schedule import StepPlan

        sampler, config = self.sampler, self.config
        n = len(batch)
        self.update_ema(policy, batch.step)
        sigmas, timesteps = sampler.training_schedule()  # [S+1], [S]
        steps = int(timesteps.shape[0])
        stochastic = torch.zeros(n, steps, dtype=torch.bool)
        if config.sde_sigma_range is not None:
            lo, hi = config.sde_sigma_range
            grid = sigmas[:-1].detach().cpu()
            stochastic[:] = (grid >= lo) & (grid <= hi)
            if sampler.config.share_initial_noise and not bool(stochastic.any()):
                # The config allows shared initial noise only with SDE steps; a range between two grid points (the
                # grid is known only here, at the adapter's size) leaves ODE everywhere: every sample of a group the
                # same image, zero advantages, no update, and no error anywhere else.
                from mmrl.rollout import RolloutError

                raise RolloutError(f"plugin.matching.sde_sigma_range {[lo, hi]} holds no sigma of the {steps}-step "
                                   f"grid ({', '.join(f'{s:.4f}' for s in grid.tolist())}), so with "
                                   "plugin.share_initial_noise every sample of a group would be the same: widen the "
                                   "range or set share_initial_noise false")
        plan = StepPlan(step_index=torch.zeros(n, 0, dtype=torch.long), stochastic=stochastic)
        rollout = sampler.chain_rollout(policy, batch, plan, keep_final=True)
        clean = rollout.replay["final_latents"]  # [n, *latent] float32: x₀, what the reward saw
        grid_steps = int(sampler.config.num_steps * sampler.config.timestep_fraction)
        draws = self.num_draws()
        times = torch.zeros(n, draws, config.num_times)  # [n, E, K]
        model_times = torch.zeros_like(times)
        for i, seed in enumerate(batch.seeds.tolist()):
            generator = torch.Generator().manual_seed(derive_seed(int(seed), _TIMES_TAG))
            for e in range(draws):  # draw e is the e-th of the sample's stream: draw 0 whatever the count
                times[i, e], model_times[i, e] = draw_times(config, generator, sigmas, timesteps, grid_steps)
        device = clean.device
        replay = {
            "conditioning": rollout.replay["conditioning"],
            "clean_latents": clean,
            "matching_times": times.to(device),  # [n, E, K] t of each column
            "matching_timesteps": model_times.to(device),  # [n, E, K] the model timestep of each column
            "matching_seeds": torch.tensor([derive_seed(int(s), _NOISE_TAG) for s in batch.seeds.tolist()],
                                           dtype=torch.long, device=device),  # [n], < 2**63
        }
        mask = torch.ones(n, config.num_times, device=device)
        weights = None if config.advantage_scale == 1.0 else mask * config.advantage_scale
        metrics = {**rollout.metrics, "matching_time_mean": float(times[:, 0].mean())}
        metrics.pop("trained_sigma_mean", None)  # no SDE step is trained
        return replace(rollout, old_logp=None, mask=mask, replay=replay, action_weights=weights, metrics=metrics)

    def score(self, policy: nn.Module, rollout: Rollout, columns: list[int], *,
              reference: Callable[[nn.Module], AbstractContextManager[nn.Module]] | None,
              ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The surrogate log-probs of ``columns`` (with gradients), their velocity KL to the reference and, with
        ``ema_kl_coef`` in a forward that back-propagates, the EMA KL term.

        Returns:
            (logp ``[n, len(columns)]`` float32, KL ``[n, len(columns)]`` float32 or None without ``reference``,
            ``ema_kl_coef`` · the mean over rows and columns of the EMA KL, a 0-dim tensor, or None).
        """
        replay = rollout.replay
        config, sampler = self.config, self.sampler
        clean = replay["clean_latents"]  # [n, *latent]
        drawn = int(replay["matching_times"].shape[1])
        epoch = self.epoch if drawn > 1 else 0
        if not 0 <= epoch < drawn:
            raise RuntimeError(f"flow matching: inner epoch {epoch} but {drawn} draws were made per sample "
                               "(Runtime.inner_epochs and the learner disagree)")
        width = int(replay["matching_times"].shape[2])
        if any(not 0 <= c < width for c in columns):
            raise ValueError(f"flow matching forward asked for columns {columns} of a rollout with {width} times")
        conditioning = replay["conditioning"]
        inputs = []  # per column: (t [n], model timesteps [n], ε [n, *latent], x_t [n, *latent])
        for column in columns:
            t = replay["matching_times"][:, epoch, column]  # [n]
            model_t = replay["matching_timesteps"][:, epoch, column]  # [n]
            noise = column_noise(replay["matching_seeds"], epoch, column, tuple(clean.shape[1:])).to(clean)
            inputs.append((t, model_t, noise, noised(clean, noise, t)))
        # The old-policy pass (no grad) has no loss to add the EMA term to.
        with_ema = config.ema_kl_coef > 0 and torch.is_grad_enabled()
        ema_velocities = self._ema_velocities(policy, [(x_t, model_t) for _, model_t, _, x_t in inputs],
                                              conditioning) if with_ema else []
        logps, kls, ema_kls = [], [], []
        for k, (t, model_t, noise, x_t) in enumerate(inputs):
            velocity = sampler.velocity(policy, x_t, model_t, conditioning, sampler.guidance_scale, phase="forward")
            logps.append(matching_log_prob(velocity, noise, clean, t, config.weighting, config.ghuber_power))
            if reference is not None:
                with torch.no_grad(), reference(policy) as reference_module:
                    ref_velocity = sampler.velocity(reference_module, x_t, model_t, conditioning,
                                                    sampler.guidance_scale, phase="forward")
                kls.append(velocity_kl(velocity, ref_velocity, t, config.kl_weight))
            if with_ema:
                ema_kls.append(velocity_kl(velocity, ema_velocities[k], t, config.ema_kl_weight))
        logp = torch.stack(logps, dim=1).float()  # [n, len(columns)]
        # upstream: ema_beta · the micro-batch's mean over (time, sample), averaged over the accumulated micro-batches
        # (L1344-1350); the core averages aux_loss over an optimizer step's backward passes
        aux = config.ema_kl_coef * torch.stack(ema_kls, dim=1).mean().float() if with_ema else None
        return logp, (torch.stack(kls, dim=1).float() if reference is not None else None), aux
