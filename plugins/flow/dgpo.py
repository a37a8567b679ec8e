r"""DGPO: Direct Group Preference Optimization on the forward process (``plugin.likelihood: dgpo``).

Luo, Hu, Tang 2025, "Reinforcing Diffusion Models by Direct Group Preference Optimization", arXiv:2510.08425
(ICLR 2026); released code Luo-Yihong/DGPO@01ceb4b (read at that commit; ``scripts/train_sd3_dgpo.py``, below "L";
``config/base.py``, ``config/dgpo.py``, ``config/dgpo_wocfg*.py``).

**The columns.** For the clean latent x₀ a rollout ends at (``latents_list[-1]``, L867), a trained grid step j with
σ_j and model timestep t_j (``t = sample["timesteps"][:, j]``, σ = t/1000: L1099-1100) and noise ε shared by the
samples of a group (L1102-1103)::

    x_t = (1 − σ)·x₀ + σ·ε,      dsm = mean over latent elements of (ε − x₀ − v_θ(x_t, t))²        (L1106-1132)
    log p_j = −dsm                                               (one action column per trained time)

:meth:`DGPOLikelihood.score` returns these columns, the reference's −dsm (the transformer with its LoRA off,
L1111-1115; with ``dgpo.kl_cfg`` > 1 its classifier-free-guided velocity at that scale) as ``ref_logp``, and the
velocity KL mean((v_θ − v_ref)²) (L1150-1156) as ``PolicyOutput.kl``; the registered core loss
:func:`mmrl.algos.policy_losses.dgpo_policy_loss` (``algorithm.policy_loss: dgpo``) forms the group weights σ(S_g)
and the loss (L162-193). The trained velocity is the conditional one, without guidance (``predict_v(...,
cfg=False)``, L1120, L312-321), whatever guidance the rollouts use.

**Times.** M = ``dgpo.num_times`` distinct grid steps among the first ``trunc_steps + 1`` (``random.sample``,
L1062-1064), drawn once per inner epoch and shared by every sample of the step on every process (upstream
broadcasts them from rank 0, L52-74). mmrl draws them from (run seed, step, inner epoch), so every process and every
rollout batch of a step draws the same. **Noise.** Upstream draws one ε per group for every (micro-batch, time)
call and broadcasts it (L76-108, L1102-1103): shared by a group's members, independent between groups, times and
calls. mmrl regenerates ε from (the group's seed, inner epoch, time), the group's seed a function of the run seed
and the group id alone: the same law, and the old-policy, training and reference forwards see the same x_t.

**The fast EMA** (``dgpo.ema_ref``; upstream ``ema_ref``, an ``EMAModuleWrapper`` of the trained parameters, L629):
initialised to the trained weights, and after every optimizer step k (0-based) moved to
ema ← d·ema + (1 − d)·θ with d = min(0.3, 0.001·k) (L1175-1177; ``flow_grpo/ema.py`` L32-43). Its −dsm at the
step's times and noise is the old log-prob of the loss's PPO-style clip (``clip_dsm``, L1116-1119, L1133-1144) and,
with the loss's ``reference: old``, the DGPO baseline (``use_ema_ref``, L1122-1124). With more than
``dgpo.switch_ema_ref`` optimizer steps done the rollouts sample with it (L799-800, L878-879). mmrl keeps a copy of
the trained parameters (:attr:`DGPOLikelihood.ema`, saved with checkpoints), updates it before each training step's
rollout (one optimizer step per training step, which ``FlowPlugin.check_config`` requires with ``ema_ref``: the
released recipes set ``gradient_accumulation_steps = num_batches_per_epoch``, one optimizer step per epoch), and
scores its −dsm in the rollout as ``rollout.old_logp``: the EMA does not move during the step, so that is the value
upstream computes in each training forward.

**Rollouts.** Upstream samples with diffusers' ``DPMSolverMultistepScheduler`` (Sana's config, ``flow_shift`` 3,
noise level 0: a deterministic multistep ODE solver, L557-559, L832-845), 10 steps, CFG 4.5 (``config/dgpo.py``) or
1.0 (``dgpo_wocfg*.py``); mmrl takes the Euler ODE on the adapter's grid (``plugin.num_steps``, its shift), and the
times are that grid's steps. Each sample starts from its own initial noise (``share_initial_noise`` is refused).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from mmrl.config import config_field
from mmrl.plugins.flow.matching import column_noise, matching_log_prob, noised, trained_copy, velocity_kl
from mmrl.plugins.flow.nft import swapped_parameters
from mmrl.seeding import derive_seed

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager

    from mmrl.plugin import PromptBatch, Runtime
    from mmrl.plugins.flow.sampler import FlowSampler
    from mmrl.rollout import Rollout

EMA_RATE = 0.001  # d = min(ema_decay, 0.001·k) after optimizer step k (train_sd3_dgpo.py L1176)

_TIMES_TAG = 0xD690  # the step's time draw, apart from every sample's rollout noise stream
_NOISE_TAG = 0xD691  # a group's noise seed


@dataclass
class DGPOConfig:
    """``plugin.dgpo``: DGPO's forward-process columns (``plugin.likelihood: dgpo``, ``policy_loss: dgpo``)."""

    num_times: int = config_field(
        4, minimum=1, help="M, trained grid times per step (one action column and one velocity forward each), "
        "distinct, shared by every sample of the step.", ref="DGPO num_train_timesteps: 4 (config/dgpo.py)",
    )
    trunc_steps: int = config_field(
        6, minimum=0, help="The times are drawn among grid steps 0..trunc_steps (the noisiest trunc_steps + 1 of "
        "plugin.num_steps).", ref="DGPO trunc_steps: 4 (GenEval), 6 (OCR, PickScore); train_sd3_dgpo.py L1063",
    )
    ema_ref: bool = config_field(
        False, help="Keep upstream's fast EMA of the trained weights (d = min(ema_decay, 0.001*k) after optimizer "
        "step k) and score its -dsm as the rollout's old_logp: the old side of the dgpo loss's clip_range and its "
        "reference: old. Needs one optimizer step per training step.",
        ref="DGPO ema_ref (always kept upstream; read when clip_dsm or use_ema_ref); train_sd3_dgpo.py L629, L1176",
    )
    ema_decay: float = config_field(
        0.3, minimum=0.0, maximum=1.0, help="The cap of the fast EMA's decay d = min(ema_decay, 0.001*k).",
        ref="DGPO: 0.3 (train_sd3_dgpo.py L1176)",
    )
    switch_ema_ref: int | None = config_field(
        None, minimum=0, help="Sample the rollouts with the fast EMA once more than this many optimizer steps are "
        "done (needs ema_ref). Null: always with the trained weights.",
        ref="DGPO switch_ema_ref: 500 (GenEval), 200 (config/dgpo.py base); train_sd3_dgpo.py L799",
    )
    kl_cfg: float = config_field(
        1.0, minimum=1.0, help="Guidance scale of the reference velocity (the DGPO reference and the KL): 1 the "
        "conditional velocity; > 1 classifier-free guidance at this scale (needs plugin.cfg).",
        ref="DGPO kl_cfg: 1.0 (config/base.py), 4.5 (dgpo_wocfg.py); train_sd3_dgpo.py L1112-1115",
    )


# ------------------------------------------------------------------------------------------------- pure functions
def ema_decay(step: int, cap: float) -> float:
    """d of the fast EMA's update after optimizer step ``step`` (0-based): min(cap, 0.001·step) (L1176)."""
    return min(cap, EMA_RATE * step)


def draw_steps(seed: int, step: int, draws: int, num_times: int, trunc_steps: int) -> Tensor:
    """``[draws, M]`` long: each inner epoch's M distinct grid steps among 0..trunc_steps, from (run seed, training
    step) alone, so every process and rollout batch of a step draws the same (upstream: ``random.sample`` on rank 0,
    broadcast; L52-74)."""
    generator = torch.Generator().manual_seed(derive_seed(seed, step, _TIMES_TAG))
    return torch.stack([torch.randperm(trunc_steps + 1, generator=generator)[:num_times] for _ in range(draws)])


def group_noise_seeds(seed: int, group_ids: Tensor) -> Tensor:
    """``[n]`` long: the noise seed of each row's group, a function of (run seed, group id) alone: equal within a
    group, on any process, in any rollout batch."""
    return torch.tensor([derive_seed(seed, _NOISE_TAG, int(g)) for g in group_ids.tolist()], dtype=torch.long)


@contextmanager
def unguided(sampler: FlowSampler) -> Iterator[None]:
    """The sampler's velocity without classifier-free guidance (the conditional velocity upstream trains,
    ``predict_v(..., cfg=False)``, L312-321), its CFG setting restored after. The guidance scale passed in then only
    reaches a guidance-distilled model's embedding (FLUX), as in that model's rollouts."""
    cfg = sampler.cfg
    sampler.cfg = False
    try:
        yield
    finally:
        sampler.cfg = cfg


# ------------------------------------------------------------------------------------------------- the plugin side
class DGPOLikelihood:
    """The rollout and the scoring of ``plugin.likelihood: dgpo`` on a :class:`~.sampler.FlowSampler`.

    Args:
        config: The ``plugin.dgpo`` section.
        sampler: The plugin's sampler: its chain rollout and its velocity function.
        runtime: The run's runtime (``seed``: the time and noise draws; ``inner_epochs``: how many draws).
    """

    def __init__(self, config: DGPOConfig, sampler: FlowSampler, runtime: Runtime):
        self.config = config
        self.sampler = sampler
        self.runtime = runtime
        self.epoch = 0  # the draw the forwards use, set by FlowPlugin.start_inner_epoch
        #: With ``ema_ref``: the fast EMA of the trained parameters by (unwrapped) name and the training step whose
        #: rollout last updated it (-1: none yet). None until the first training rollout copies the trained weights.
        self.ema: dict[str, Tensor] | None = None
        self.ema_step = -1

    def num_draws(self) -> int:
        """Time and noise draws per rollout: one per inner epoch (upstream draws the times anew every inner epoch)."""
        return max(int(self.runtime.inner_epochs), 1)

    @torch.no_grad()
    def update_ema(self, policy: nn.Module, step: int) -> None:
        """Bring the fast EMA up to training step ``step`` (0-based; every training rollout calls it, it acts once per
        step): a copy of the trained weights the first time (L629), then, with ``step`` optimizer steps done, the
        update upstream makes after optimizer step ``step − 1``: ema ← d·ema + (1 − d)·θ, d = min(ema_decay,
        0.001·(step − 1)) (L1175-1177)."""
        if not self.config.ema_ref or step <= self.ema_step:
            return
        module = self.runtime.unwrap(policy)
        trained = {name: p for name, p in module.named_parameters() if p.requires_grad}
        if self.ema is None:
            self.ema = trained_copy(module, "plugin.dgpo.ema_ref's fast EMA")
        else:
            decay = ema_decay(step - 1, self.config.ema_decay)
            for name, value in self.ema.items():
                value.mul_(decay).add_(trained[name].detach(), alpha=1 - decay)
        self.ema_step = step

    def ema_weights(self, policy: nn.Module) -> AbstractContextManager[None]:
        """The fast EMA's weights in the trained parameters, the trained ones restored after."""
        if self.ema is None:
            raise RuntimeError("flow dgpo: the fast EMA is set up by the first training rollout; score a rollout of "
                               "this plugin")
        return swapped_parameters(self.runtime.unwrap(policy), self.ema)

    def samples_with_ema(self, step: int) -> bool:
        """Whether training step ``step`` (``step`` optimizer steps done) samples with the fast EMA (L799)."""
        switch = self.config.switch_ema_ref
        return switch is not None and step > switch

    @torch.no_grad()
    def rollout(self, policy: nn.Module, batch: PromptBatch) -> Rollout:
        """The ODE rollout (with the fast EMA after ``switch_ema_ref``), its final latent kept as x₀, the step's
        shared times and each group's noise seed; ``old_logp`` the fast EMA's −dsm with ``ema_ref``, else None."""
        from mmrl.plugins.flow.schedule import StepPlan

        sampler, config = self.sampler, self.config
        n = len(batch)
        self.update_ema(policy, batch.step)
        sigmas, timesteps = sampler.training_schedule()  # [S+1], [S]
        steps = int(timesteps.shape[0])
        plan = StepPlan(step_index=torch.zeros(n, 0, dtype=torch.long),
                        stochastic=torch.zeros(n, steps, dtype=torch.bool))
        if self.samples_with_ema(batch.step):
            with self.ema_weights(policy):
                rollout = sampler.chain_rollout(policy, batch, plan, keep_final=True)
        else:
            rollout = sampler.chain_rollout(policy, batch, plan, keep_final=True)
        clean = rollout.replay["final_latents"]  # [n, *latent] float32: x₀, what the reward saw
        index = draw_steps(self.runtime.seed, batch.step, self.num_draws(), config.num_times,
                           config.trunc_steps)  # [E, M]
        index = index.unsqueeze(0).expand(n, -1, -1)  # [n, E, M]: the same for every sample
        device = clean.device
        grid, model_grid = sigmas.detach().float().cpu(), timesteps.detach().float().cpu()
        replay = {
            "conditioning": rollout.replay["conditioning"],
            "clean_latents": clean,
            "dgpo_steps": index.to(device),  # [n, E, M] the grid step of each column
            "dgpo_times": grid[index].to(device),  # [n, E, M] σ of the step
            "dgpo_timesteps": model_grid[index].to(device),  # [n, E, M] the model timestep
            "dgpo_seeds": group_noise_seeds(self.runtime.seed, batch.group_ids).to(device),  # [n], < 2**63
        }
        mask = torch.ones(n, config.num_times, device=device)  # [n, M]
        rolled = replace(rollout, old_logp=None, mask=mask, replay=replay, action_weights=None)
        old_logp = None
        if config.ema_ref:  # the old side of the clip (and the reference: old baseline) is the fast EMA's −dsm
            with self.ema_weights(policy):  # no-grad forwards past a DDP wrapper, as NFT's v_old
                old_logp = self.score(self.runtime.unwrap(policy), rolled, list(range(config.num_times)),
                                      reference=None)[0]
        metrics = {**rollout.metrics, "dgpo_time_mean": float(grid[index[0, 0]].mean()),
                   "dgpo_samples_with_ema": float(self.samples_with_ema(batch.step))}
        metrics.pop("trained_sigma_mean", None)  # no SDE step is trained
        return replace(rolled, old_logp=old_logp, metrics=metrics)

    def score(self, policy: nn.Module, rollout: Rollout, columns: list[int], *,
              reference: Callable[[nn.Module], AbstractContextManager[nn.Module]] | None,
              ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The columns ``columns`` (−dsm of the conditional velocity, with gradients), and with ``reference`` the
        reference's −dsm and the velocity KL.

        Returns:
            (logp ``[n, len(columns)]`` float32, ref_logp ``[n, len(columns)]`` float32 or None, KL
            ``[n, len(columns)]`` float32 or None).
        """
        replay = rollout.replay
        sampler, config = self.sampler, self.config
        clean = replay["clean_latents"]  # [n, *latent]
        drawn, width = int(replay["dgpo_times"].shape[1]), int(replay["dgpo_times"].shape[2])
        epoch = self.epoch if drawn > 1 else 0
        if not 0 <= epoch < drawn:
            raise RuntimeError(f"flow dgpo: inner epoch {epoch} but {drawn} draws were made per sample "
                               "(Runtime.inner_epochs and the learner disagree)")
        if any(not 0 <= c < width for c in columns):
            raise ValueError(f"flow dgpo forward asked for columns {columns} of a rollout with {width} times")
        conditioning = replay["conditioning"]
        logps, refs, kls = [], [], []
        for column in columns:
            t = replay["dgpo_times"][:, epoch, column]  # [n]
            model_t = replay["dgpo_timesteps"][:, epoch, column]  # [n]
            noise = column_noise(replay["dgpo_seeds"], epoch, column, tuple(clean.shape[1:])).to(clean)
            x_t = noised(clean, noise, t)  # [n, *latent]
            with unguided(sampler):
                velocity = sampler.velocity(policy, x_t, model_t, conditioning, sampler.guidance_scale,
                                            phase="forward")
            logps.append(matching_log_prob(velocity, noise, clean, t, "uniform"))  # −mean((v − (ε − x₀))²)
            if reference is not None:
                with torch.no_grad(), reference(policy) as reference_module:
                    if config.kl_cfg > 1:  # upstream's CFG reference at kl_cfg (L1112-1113)
                        ref_velocity = sampler.velocity(reference_module, x_t, model_t, conditioning, config.kl_cfg,
                                                        phase="forward")
                    else:
                        with unguided(sampler):
                            ref_velocity = sampler.velocity(reference_module, x_t, model_t, conditioning,
                                                            sampler.guidance_scale, phase="forward")
                refs.append(matching_log_prob(ref_velocity, noise, clean, t, "uniform"))
                kls.append(velocity_kl(velocity, ref_velocity, t, "uniform"))  # L1151
        logp = torch.stack(logps, dim=1).float()  # [n, len(columns)]
        if reference is None:
            return logp, None, None
        return logp, torch.stack(refs, dim=1).float(), torch.stack(kls, dim=1).float()


__all__ = ["DGPOConfig", "DGPOLikelihood", "draw_steps", "ema_decay", "group_noise_seeds"]
