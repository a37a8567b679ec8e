r"""DiffusionNFT: online diffusion reinforcement on the forward process (``plugin.likelihood: nft``).

Zheng, Chen, Jiang, Zhu, Lan, Liu, Ermon, Li, Mao, Wu, Lu, Zhu, Liu, Luo, Ba, Xu, Xie, Vahdat, Yang, Wu 2025,
"DiffusionNFT: Online Diffusion Reinforcement with Forward Process", arXiv:2509.16117; released code
NVlabs/DiffusionNFT@24af555 (read at that commit; ``scripts/train_nft_sd3.py``, below "L"; ``config/nft.py``;
``flow_grpo/diffusers_patch/solver.py``).

**The loss** (L862-980). For the clean latent x₀ a rollout ends at, a trained time t (σ of a grid step) and fresh
noise ε, x_t = (1 − t)·x₀ + t·ε; with v_θ the trained velocity, v_old that of the slow "old" policy (no gradient)
and β (``nft.beta``):

    v⁺ = β·v_θ + (1 − β)·v_old,            v⁻ = (1 + β)·v_old − β·v_θ          (L934-937)
    x₀⁺ = x_t − t·v⁺,                       x₀⁻ = x_t − t·v⁻                   (L940, L948)
    w± = max(mean |x₀± − x₀|, 1e-5)        (no gradient, float64; L941-954)
    e± = mean((x₀± − x₀)² / w±)            (means over the latent elements; L947, L955)
    r = clamp(clamp(A, ±A_max)/(2·A_max) + ½, 0, 1)                          (L910-929)
    L = A_max·(r·e⁺ + (1 − r)·e⁻)/β + β_KL·mean((v_θ − v_ref)²)             (L959-970)

averaged over the micro-batch's samples, and the per-time losses divided by ``gradient_accumulation_steps × K``
before their backward (``effective_grad_accum_steps``, L801, L983): one optimizer step takes the mean of L over
its (sample, time) pairs. mmrl splits the work between the plugin and a registered policy loss, as the dLLM
plugin's SPG does (:mod:`mmrl.plugins.dllm.objectives`): :meth:`NFTLikelihood.score` returns, for training time k
of a sample, the action columns ``2k`` = e⁺/β and ``2k + 1`` = e⁻/β (A = 2K columns), and the KL to the reference on
both columns of the time; :func:`nft_policy_loss` (``algorithm.policy_loss: nft``, an entry point) forms r from the
advantage and puts 2·A_max·r on column ``2k`` and 2·A_max·(1 − r) on ``2k + 1``. With ``aggregation: token_mean``
(the mean over the step's 2K·N columns) the factor 2 and the KL's two copies give exactly upstream's mean over
(sample, time) of A_max·(r·e⁺ + (1 − r)·e⁻)/β + β_KL·kl, value and gradient; ``FlowPlugin.check_config`` refuses
the settings that would break that.

**Times and noise.** Upstream permutes each sample's S grid timesteps (``torch.randperm`` per sample, L810-816) and
trains the first K = ⌊S·timestep_fraction⌋ of the permutation in that order, t = timestep/1000 (= σ for SD3's
scheduler) with the grid timestep as the model's, and a fresh ``randn_like(x₀)`` for every time (L868). mmrl draws
the permutation and each ε from the sample's seed (one draw per inner epoch, as upstream permutes and draws anew
every inner epoch), so the training forward regenerates them without storing noise: K distinct grid steps per
sample in a uniformly random order, upstream's law.

**The old policy** (L438-445, L576-579, L640-659, L1034-1039) is a second LoRA adapter, a copy of the trained one
at the start, that samples every rollout and gives v_old; after each epoch's training it moves to
old ← d·old + (1 − d)·θ with d = ``return_decay(global_step, decay_type)`` (L169-189: type 0 d = 0, type 1
d = min(0.001·s, 0.5), type 2 d = 0 for s < 75 then min(0.0075·(s − 75), 0.999)), global_step being the optimizer
steps made so far (L1021). mmrl keeps a copy of the trained parameters (:attr:`NFTLikelihood.old`, saved with
checkpoints), swaps it in for the rollout and for v_old, and updates it before the rollout of training step s ≥ 1
with d = return_decay(s·``nft.optimizer_steps_per_step``): the optimizer steps made before that rollout, upstream's
counter (``check_config`` holds ``optimizer_steps_per_step`` = minibatches × inner_epochs). The copy is saved with
checkpoints (an empty file at step 0, before the first rollout made it: the resumed run copies then, as one never
stopped); it holds this process's parameters, so FSDP and ZeRO-3 launches are refused. Upstream restarts the old
adapter from the trained LoRA on resume (L540-541, L576-579); mmrl continues the saved one. The loss has no term
that the learner averages per backward pass (unlike AWM's EMA KL): its columns and KL take the step-wide
``token_mean`` denominator, so uneven micro-batches and action chunks change nothing.

**The sampler.** Upstream's rollouts use ``solver: dpm2``, deterministic (config/nft.py:65-66; solver.py:27-75,
207-260): a DDIM step (the Euler step of the flow ODE), DPM-Solver++(2M) multistep updates in the data
prediction x̂₀ = x − σ·v, and a first-order last step to σ = 0 (x̂₀). mmrl takes the chain rollout's Euler step
from σ₀ = 1, then :func:`~.credit.solvers.ode_tail` with ``dpm2m`` from grid point 1 on: that is the same solver (a
fresh ode_tail's first step is first order, as upstream's second step from σ₀ = 1, where the previous
λ = log(0/1) = −∞ zeroes its correction; on a grid starting below σ = 1 upstream's second step would be second
order and mmrl's first order; SD3's grid starts at 1). ``nft.solver: euler`` is the Euler ODE. Upstream casts the
sampler's model timesteps to integers (``dtype=torch.long``, pipeline_with_logprob.py:213) while training passes
the float grid timesteps; mmrl passes the float grid timesteps in both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, Literal

import torch
from torch import Tensor, nn

from mmrl.algos.policy_losses import broadcast_advantages, masked_mean
from mmrl.config import config_field
from mmrl.plugins.flow.matching import column_noise, noised, trained_copy, velocity_kl
from mmrl.registry import Range
from mmrl.seeding import derive_seed

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager

    from mmrl.plugin import PromptBatch, Runtime
    from mmrl.plugins.flow.sampler import FlowSampler
    from mmrl.rollout import Rollout

ADV_MODES = ("all", "positive_only", "negative_only", "one_only", "binary")
DECAY_TYPES = (0, 1, 2)
WEIGHT_FLOOR = 1e-5  # upstream's .clip(min=0.00001) of the adaptive weights (L945, L953)

_TIMES_TAG = 0x4E46  # the permutation draw and the noise draw, apart from the sample's rollout noise stream
_NOISE_TAG = 0x4E47


@dataclass
class NFTConfig:
    """``plugin.nft``: DiffusionNFT's forward-process objective (``plugin.likelihood: nft``)."""

    beta: float = config_field(
        1.0, minimum=0.0, exclusive_minimum=True,
        help="beta of the implicit policies v+ = beta*v + (1-beta)*v_old, v- = (1+beta)*v_old - beta*v; the "
        "errors are divided by it.", ref="DiffusionNFT config.beta: 1.0 (GenEval, PickScore), 0.1 (OCR, "
        "multi-reward); config/nft.py L61, L77, L137",
    )
    decay_type: int = config_field(
        1, minimum=0, maximum=2,
        help="The old policy's EMA decay d(s), s the optimizer steps so far: 0: d = 0 (old = the trained weights of "
        "the last step); 1: min(0.001*s, 0.5); 2: 0 for s < 75, then min(0.0075*(s-75), 0.999).",
        ref="DiffusionNFT decay_type: 1 (GenEval, PickScore, multi-reward), 2 (OCR); train_nft_sd3.py L169-189",
    )
    optimizer_steps_per_step: int = config_field(
        1, minimum=1,
        help="Optimizer steps one training step makes (algorithm.minibatches x inner_epochs; checked): the "
        "decay's step counter s advances by this much per training step, as upstream's global_step per epoch.",
        ref="DiffusionNFT gradient_step_per_epoch: 1 (GenEval, PickScore), 2 (OCR); config/nft.py",
    )
    solver: Literal["dpm2m", "euler"] = config_field(
        "dpm2m", help="The rollout's deterministic sampler on the training grid: 'dpm2m' DPM-Solver++(2M) "
        "(upstream's dpm2) or 'euler'.", ref="DiffusionNFT sample.solver: dpm2, deterministic: True",
    )


# ------------------------------------------------------------------------------------------------- pure functions
def return_decay(step: int, decay_type: int) -> float:
    """The old policy's EMA decay after ``step`` optimizer steps (train_nft_sd3.py:L169-189)."""
    if decay_type == 0:
        flat, rate, cap = 0, 0.0, 0.0
    elif decay_type == 1:
        flat, rate, cap = 0, 0.001, 0.5
    elif decay_type == 2:
        flat, rate, cap = 75, 0.0075, 0.999
    else:
        raise ValueError(f"nft decay_type must be one of {DECAY_TYPES}, got {decay_type!r}")
    if step < flat:
        return 0.0
    return min((step - flat) * rate, cap)


def implicit_errors(velocity: Tensor, old_velocity: Tensor, x_t: Tensor, clean: Tensor, t: Tensor, beta: float
                    ) -> tuple[Tensor, Tensor]:
    """``(e⁺/β, e⁻/β)`` ``[n]`` float64: the adaptively weighted x₀ errors of the implicit positive and negative
    policies (train_nft_sd3.py:L934-959; the division by β moved here from L959).

    Args:
        velocity: v_θ(x_t, t) ``[n, *latent]`` (with gradients).
        old_velocity: v_old(x_t, t) ``[n, *latent]`` (treated as a constant).
        x_t: The noised latents ``[n, *latent]``.
        clean: x₀ ``[n, *latent]``.
        t: ``[n]`` the times.
        beta: β.
    """
    v, v_old = velocity.double(), old_velocity.detach().double()
    x_t, clean = x_t.double(), clean.double()
    tt = t.to(v).reshape(-1, *([1] * (v.dim() - 1)))
    positive = beta * v + (1 - beta) * v_old
    negative = (1 + beta) * v_old - beta * v
    errors = []
    for prediction in (positive, negative):
        x0 = x_t - tt * prediction  # [n, *latent]
        with torch.no_grad():  # the adaptive weight is a constant of the step (L941, L949)
            weight = (x0 - clean).abs().flatten(1).mean(dim=1).clamp(min=WEIGHT_FLOOR)  # [n]
        errors.append((x0 - clean).pow(2).flatten(1).mean(dim=1) / weight / beta)  # [n]
    return errors[0], errors[1]


def optimality(advantages: Tensor, adv_clip_max: float, adv_mode: str) -> Tensor:
    """r = clamp(Â/(2·A_max) + ½, 0, 1), Â the advantage clipped to ±A_max and transformed by ``adv_mode``
    (train_nft_sd3.py:L910-929)."""
    clipped = advantages.clamp(-adv_clip_max, adv_clip_max)
    if adv_mode == "positive_only":
        clipped = clipped.clamp(0, adv_clip_max)
    elif adv_mode == "negative_only":
        clipped = clipped.clamp(-adv_clip_max, 0)
    elif adv_mode == "one_only":
        clipped = torch.where(clipped > 0, torch.ones_like(clipped), torch.zeros_like(clipped))
    elif adv_mode == "binary":
        clipped = torch.sign(clipped)
    elif adv_mode != "all":
        raise ValueError(f"nft adv_mode must be one of {', '.join(ADV_MODES)}, got {adv_mode!r}")
    return (clipped / adv_clip_max / 2.0 + 0.5).clamp(0, 1)


def nft_policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                    adv_clip_max: Annotated[float, Range(0, low_open=True)] = 5.0,
                    adv_mode: Literal["all", "positive_only", "negative_only", "one_only", "binary"] = "all",
                    ) -> tuple[Tensor, dict]:
    """DiffusionNFT's policy loss on the columns of ``plugin.likelihood: nft`` (arXiv:2509.16117).

    Column ``2k`` of ``logp`` holds e⁺/β and column ``2k + 1`` e⁻/β of a sample's k-th training time
    (:func:`implicit_errors`); the loss is 2·A_max·r·e⁺/β on the first and 2·A_max·(1 − r)·e⁻/β on the second, so that
    the mean over a step's 2K columns per sample (``aggregation: token_mean``) is upstream's mean over times of
    A_max·(r·e⁺ + (1 − r)·e⁻)/β (train_nft_sd3.py:L959-960, L983). No ratio: ``old_logp`` feeds no term.

    Args:
        adv_clip_max: A_max > 0 (upstream ``train.adv_clip_max``: 5): the advantages are clipped to ±A_max and
            r divides by it.
        adv_mode: Upstream's ``train.adv_mode``: ``all`` (the recipes), ``positive_only``, ``negative_only``,
            ``one_only`` (1 where A > 0, else 0), ``binary`` (sign).

    Shapes:
        logp, old_logp, mask ``[N, 2K]``; advantages ``[N]`` or ``[N, 2K]`` → loss ``[N, 2K]``.
    """
    if logp.dim() != 2 or logp.shape[1] % 2:
        raise ValueError(f"policy_loss nft needs an even number of action columns (a positive and a negative error "
                         f"per training time), got logp {tuple(logp.shape)}; set plugin.likelihood: nft")
    if adv_clip_max <= 0:
        raise ValueError(f"nft adv_clip_max must be > 0, got {adv_clip_max}")
    adv = broadcast_advantages(advantages, logp).to(logp.dtype)  # [N, 2K]
    r = optimality(adv, adv_clip_max, adv_mode)  # [N, 2K]
    positive = torch.zeros_like(logp, dtype=torch.bool)
    positive[:, 0::2] = True  # [N, 2K] the e⁺ columns
    share = torch.where(positive, r, 1 - r)
    # 2: a time's two columns share the per-time mean weight of the aggregation (each column counts once)
    loss = 2.0 * adv_clip_max * share * logp
    metrics = {
        "optimality_mean": masked_mean(r[:, 0::2], mask[:, 0::2]),
        "positive_error": masked_mean(logp[:, 0::2], mask[:, 0::2]),
        "negative_error": masked_mean(logp[:, 1::2], mask[:, 1::2]),
    }
    return loss, metrics


# The learner runs no old-policy pass for it (mmrl.algos.policy_losses.reads_old_logp): NFT's old policy is the slow
# copy NFTLikelihood.old, whose velocity v_old enters each column (implicit_errors); no ratio of columns is taken.
nft_policy_loss.reads_old_logp = False


@contextmanager
def swapped_parameters(module: nn.Module, values: dict[str, Tensor]) -> Iterator[None]:
    """``values`` copied into ``module``'s parameters of those names (no grad), the originals restored on exit."""
    parameters = dict(module.named_parameters())
    with torch.no_grad():
        kept = {name: parameters[name].detach().clone() for name in values}
        for name, value in values.items():
            parameters[name].copy_(value)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in kept.items():
                parameters[name].copy_(value)


# ------------------------------------------------------------------------------------------------- the plugin side
class NFTLikelihood:
    """The rollout (sampled by the old policy) and the scoring of ``plugin.likelihood: nft``.

    Args:
        config: The ``plugin.nft`` section.
        sampler: The plugin's sampler: its chain rollout and its velocity function (CFG, transformer batches).
        runtime: The run's runtime (``inner_epochs``: how many time permutations and noise sets a rollout prepares).
        num_times: K = ⌊num_steps·timestep_fraction⌋, the trained times per sample.
    """

    def __init__(self, config: NFTConfig, sampler: FlowSampler, runtime: Runtime, num_times: int):
        self.config = config
        self.sampler = sampler
        self.runtime = runtime
        self.num_times = num_times
        self.epoch = 0  # the draw the forwards use, set by FlowPlugin.start_inner_epoch
        #: The old policy's parameters by (unwrapped) name and the training step whose rollout last updated them
        #: (-1: none yet). None until the first training rollout copies the trained weights.
        self.old: dict[str, Tensor] | None = None
        self.old_step = -1

    def decay(self, step: int) -> float:
        """d of the update made before the rollout of training step ``step``: return_decay of the optimizer steps
        made so far, ``step · optimizer_steps_per_step`` (upstream's global_step after the previous epoch)."""
        return return_decay(step * self.config.optimizer_steps_per_step, self.config.decay_type)

    @torch.no_grad()
    def update_old(self, policy: nn.Module, step: int) -> None:
        """Bring the old policy up to training step ``step`` (0-based; every training rollout calls it, it acts once
        per step): a copy of the trained weights the first time (L576-579), then old ← d·old + (1 − d)·θ (L1034-1039)
        once per step since the last update."""
        if step <= self.old_step:
            return
        module = self.runtime.unwrap(policy)
        trained = {name: p for name, p in module.named_parameters() if p.requires_grad}
        if self.old is None:
            self.old = trained_copy(module, "plugin.likelihood nft's old policy")
        else:
            decay = self.decay(step)
            for name, value in self.old.items():
                value.mul_(decay).add_(trained[name].detach(), alpha=1 - decay)
        self.old_step = step

    def old_weights(self, policy: nn.Module) -> AbstractContextManager[None]:
        """The old policy's weights in the trained parameters, the trained ones restored after."""
        if self.old is None:
            raise RuntimeError("flow nft: the old policy is set up by the first training rollout; score a rollout of "
                               "this plugin")
        return swapped_parameters(self.runtime.unwrap(policy), self.old)

    def num_draws(self) -> int:
        """Permutations and noise sets per sample: one per inner epoch (upstream draws both anew every epoch)."""
        return max(int(self.runtime.inner_epochs), 1)

    @torch.no_grad()
    def rollout(self, policy: nn.Module, batch: PromptBatch) -> Rollout:
        """The deterministic rollout with the old weights (``nft.solver`` on the training grid), its final
        latent kept as x₀, and each draw's K trained grid steps per sample; ``old_logp`` None."""
        from mmrl.plugins.flow.schedule import StepPlan

        sampler = self.sampler
        n = len(batch)
        self.update_old(policy, batch.step)
        sigmas, timesteps = sampler.training_schedule()  # [S+1], [S]
        steps = int(timesteps.shape[0])
        # Step 0 is the chain's ODE (Euler) step, stored as a placeholder column that the replay below drops (the
        # chain rollout needs one stored step before a solver tail); the solver then runs from grid point 1. From
        # σ₀ = 1 (every adapter's grid) upstream's dpm2 also takes an Euler (DDIM, η = 0) step first and a
        # first-order step second, as ode_tail does from a fresh start.
        plan = StepPlan(step_index=torch.zeros(n, 1, dtype=torch.long),
                        stochastic=torch.zeros(n, steps, dtype=torch.bool))
        with self.old_weights(policy):  # upstream samples with the "old" adapter (L640-659)
            rollout = sampler.chain_rollout(policy, batch, plan, tail=list(range(1, steps + 1)),
                                            solver=self.config.solver, keep_final=True)
        clean = rollout.replay["final_latents"]  # [n, *latent] float32: x₀, what the reward saw
        draws, k = self.num_draws(), self.num_times
        index = torch.zeros(n, draws, k, dtype=torch.long)  # [n, E, K] grid steps
        for i, seed in enumerate(batch.seeds.tolist()):
            generator = torch.Generator().manual_seed(derive_seed(int(seed), _TIMES_TAG))
            for e in range(draws):  # a permutation of the S steps per epoch, its first K trained (L810-816)
                index[i, e] = torch.randperm(steps, generator=generator)[:k]
        device = clean.device
        grid, model_grid = sigmas.detach().float().cpu(), timesteps.detach().float().cpu()
        replay = {
            "conditioning": rollout.replay["conditioning"],
            "clean_latents": clean,
            "nft_steps": index.to(device),  # [n, E, K] the grid step of each time
            "nft_times": grid[index].to(device),  # [n, E, K] t = σ of the step
            "nft_timesteps": model_grid[index].to(device),  # [n, E, K] the model timestep
            "nft_seeds": torch.tensor([derive_seed(int(s), _NOISE_TAG) for s in batch.seeds.tolist()],
                                      dtype=torch.long, device=device),  # [n], < 2**63
        }
        mask = torch.ones(n, 2 * k, device=device)  # [n, 2K]: (e⁺, e⁻) per time
        metrics = {**rollout.metrics, "nft_time_mean": float(grid[index[:, 0]].mean()),
                   "nft_old_decay": self.decay(batch.step) if batch.step > 0 else 0.0}
        metrics.pop("trained_sigma_mean", None)  # no SDE step is trained
        return replace(rollout, old_logp=None, mask=mask, replay=replay, action_weights=None, metrics=metrics)

    def score(self, policy: nn.Module, rollout: Rollout, columns: list[int], *,
              reference: Callable[[nn.Module], AbstractContextManager[nn.Module]] | None,
              ) -> tuple[Tensor, Tensor | None]:
        """The columns ``columns`` (``2k``: e⁺/β, ``2k + 1``: e⁻/β of time k; with gradients) and their velocity KL
        to the reference (the time's KL on both of its columns).

        Returns:
            (values ``[n, len(columns)]`` float32, KL ``[n, len(columns)]`` float32 or None without ``reference``).
        """
        replay = rollout.replay
        sampler, beta = self.sampler, self.config.beta
        clean = replay["clean_latents"]  # [n, *latent]
        drawn, width = int(replay["nft_times"].shape[1]), int(replay["nft_times"].shape[2])
        epoch = self.epoch if drawn > 1 else 0
        if not 0 <= epoch < drawn:
            raise RuntimeError(f"flow nft: inner epoch {epoch} but {drawn} draws were made per sample "
                               "(Runtime.inner_epochs and the learner disagree)")
        if any(not 0 <= c < 2 * width for c in columns):
            raise ValueError(f"flow nft forward asked for columns {columns} of a rollout with {2 * width} columns")
        times = sorted({c // 2 for c in columns})
        conditioning = replay["conditioning"]
        inputs = {}  # time -> (t [n], model timesteps [n], x_t [n, *latent])
        for k in times:
            t = replay["nft_times"][:, epoch, k]  # [n]
            noise = column_noise(replay["nft_seeds"], epoch, k, tuple(clean.shape[1:])).to(clean)
            inputs[k] = (t, replay["nft_timesteps"][:, epoch, k], noised(clean, noise, t))
        # v_old of every time first: the swap must not happen between a forward that back-propagates and its backward
        module = self.runtime.unwrap(policy)  # no-grad forwards: past a DDP wrapper, as matching's EMA velocities
        with self.old_weights(policy), torch.no_grad():
            old = {k: sampler.velocity(module, x_t, model_t, conditioning, sampler.guidance_scale, phase="forward")
                   for k, (_, model_t, x_t) in inputs.items()}
        values, kls = {}, {}
        for k, (t, model_t, x_t) in inputs.items():
            velocity = sampler.velocity(policy, x_t, model_t, conditioning, sampler.guidance_scale, phase="forward")
            values[2 * k], values[2 * k + 1] = implicit_errors(velocity, old[k], x_t, clean, t, beta)
            if reference is not None:
                with torch.no_grad(), reference(policy) as reference_module:
                    ref_velocity = sampler.velocity(reference_module, x_t, model_t, conditioning,
                                                    sampler.guidance_scale, phase="forward")
                kls[2 * k] = kls[2 * k + 1] = velocity_kl(velocity, ref_velocity, t, "uniform")  # L966-970
        out = torch.stack([values[c] for c in columns], dim=1).float()  # [n, len(columns)]
        kl = torch.stack([kls[c] for c in columns], dim=1).float() if reference is not None else None
        return out, kl


__all__ = ["NFTConfig", "NFTLikelihood", "implicit_errors", "nft_policy_loss", "optimality", "return_decay"]
