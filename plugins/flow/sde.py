r"""One denoising step of a rectified-flow sampler as a Gaussian policy: x_σ → x_σ_next, with its log-density.

Convention (SD3, FLUX, Wan, Qwen-Image, diffusers' ``FlowMatchEulerDiscreteScheduler``):

    x_σ = (1 − σ)·x0 + σ·ε,   ε ~ N(0, I),   the model predicts the velocity v ≈ ε − x0,

and sampling runs σ from 1 (pure noise) down to 0 (data). One step goes from ``sigma`` to ``sigma_next < sigma``;
Δ = σ − σ_next > 0 (the schedulers' ``dt = σ_next − σ`` is −Δ). From the current sample x and the velocity v,

    x̂0 = x − σ·v           (predicted data),
    ε̂  = x + (1 − σ)·v     (predicted noise; the score of the marginal is ∇log p_σ(x) = −ε̂/σ).

Every step is a Gaussian transition ``x_next ~ N(mean, std²·I)`` with one ``std`` per sample; the "action" of the
policy is the realised ``x_next`` and :func:`sde_step` returns its log-density under the current velocity.

Kinds (:data:`SDE_KINDS`; each is a small :class:`SDEKind` class in :data:`sde_kind_registry` that holds its
mean and std, diffusion coefficient, log-prob and KL):

``"flow_grpo"``
    Flow-GRPO (Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL", arXiv:2505.05470).
    The reverse-time SDE with the same marginals as the flow ODE dx/dσ = v is, in σ,

        dx = [v + (s_σ²/(2σ))·ε̂]·dσ + s_σ·dW̄,

    (drift = v − ½·s²·score; σ decreases, so dσ = −Δ). Its Euler–Maruyama step is

        mean = x − Δ·v − Δ·(s²/(2σ))·ε̂,   std = s·√Δ,

    with diffusion coefficient s = a·√(σ/(1 − σ)), a = ``noise_level`` (0.7 in Flow-GRPO's SD3.5 configs). At
    σ = 1 the denominator would vanish; as in Flow-GRPO's code the denominator then uses the next grid point,
    s = a·√(σ/(1 − σ_next)) (only when σ == 1 exactly). Checked against yifan123/flow_grpo ac4c86e,
    ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py:47-68``.

``"dance_grpo"``
    DanceGRPO (Xue et al. 2025, "DanceGRPO: Unleashing GRPO on Visual Generation", arXiv:2505.07818): the same
    SDE family with a constant diffusion coefficient s ≡ η = ``noise_level`` (0.3 in DanceGRPO):

        mean = x − Δ·v − ½·η²·Δ·ε̂/σ,   std = η·√Δ.

    Checked against XueZeyue/DanceGRPO 15cc71d, ``fastvideo/train_grpo_flux.py:131-168`` (``flux_step`` with
    ``sde_solver``, whose score −(x − x̂0·(1 − σ))/σ² is −ε̂/σ).

``"cps"``
    Coefficients-Preserving Sampling (Wang & Yu 2025, "Coefficients-Preserving Sampling for Reinforcement
    Learning with Flow Matching", arXiv:2509.05952), a DDIM-style step that re-noises x̂0 so that the noise
    coefficient of x_next is exactly σ_next:

        std = σ_next·sin(a·π/2),   mean = (1 − σ_next)·x̂0 + √(σ_next² − std²)·ε̂ = (1 − σ_next)·x̂0 + σ_next·cos(a·π/2)·ε̂,

    with a = ``noise_level`` ∈ [0, 1] (a = 0 is the Euler/DDIM step, a = 1 is diffusers' ``stochastic_sampling``).
    Note the per-step noise of CPS does not shrink with Δ: CPS is designed for the few-step rollouts used in RL and,
    unlike the two SDE kinds, does not converge to the flow's marginals as the number of steps grows (except for a
    point-mass data distribution, where x̂0 and ε̂ are exact and every step preserves the marginal exactly).

    What CPS's ``log_prob`` is depends on ``cps_log_prob`` (:data:`CPS_LOG_PROBS`):

    - ``"flow_grpo"`` (default): Flow-GRPO's CPS objective, −mean((x_next − mean)²), the Gaussian log-density with
      the factor 1/(2·std²) and the normalising constants dropped (yifan123/flow_grpo 54809b5,
      ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py:70-86``; also X-GenGroup/Flow-Factory a0b2bc5,
      ``src/flow_factory/scheduler/flow_match_euler_discrete.py:418-420``). It is not a log-density: its ratio
      exp(Δ) is the likelihood ratio raised to the power 2·std², so every step's log-ratio is on the scale of
      the latent's squared error whatever the step's noise. Flow-GRPO pairs it with ``clip_range = 1e-5``
      (``config/grpo.py``, the ``*_fast_nocfg`` configs).
    - ``"gaussian"``: the exact log N(x_next; mean, std²). Its scale 1/(2·std²) follows std = σ_next·sin(a·π/2),
      which vanishes at the end of sampling: on SD3.5's 10-step grid (shift 3, a = 0.8) it runs from 0.60 at step 0
      to 6934 at step 8 (std 0.0085), so |∂log p/∂v| at step 8 is about 740 times that at step 0 (0.06 times with
      Flow-GRPO's objective), the last trained steps dominate the gradient and no single clip range fits every step.

    The KL to the reference (:func:`gaussian_kl_between_means`) is the exact Gaussian KL either way, as in
    Flow-GRPO's training scripts, which divide by 2·std² with the CPS transition std.

``"ode"``
    The deterministic Euler step of the flow ODE, mean = x − Δ·v, std = 0 (what diffusers'
    ``FlowMatchEulerDiscreteScheduler.step`` does, diffusers 0.42.1
    ``schedulers/scheduling_flow_match_euler_discrete.py:513-520``, and what Flow-GRPO/Fast/MixGRPO use outside the
    SDE window).

docs/flow.md §2 has the fidelity table of these kinds and of GRPO-Guard's ratio, with every known deviation.

Deterministic transitions (std = 0: the ``"ode"`` kind, ``"cps"`` at σ_next = 0, or ``noise_level = 0``) carry no
stochastic action and have no density. mmrl reports ``log_prob = 0`` for every such sample, so the ratio of such a
step is exactly 1 and its policy gradient is exactly 0: **never train a deterministic step** (Flow-GRPO also drops
the last, near-deterministic step). The stored action is not checked against the mean for these samples.

Everything is computed in float32 (float64 if the sample or velocity is float64): half-precision inputs are
upcast first (the mean overflows in bf16). ``prev_sample``, ``mean`` and ``std`` come back in that dtype; store
the returned ``prev_sample`` as the action at that precision, since rounding it to bf16 before storing changes
the action that was scored and breaks ratio == 1 on policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from mmrl.registry import Registry

SDE_KINDS: tuple[str, ...] = ("flow_grpo", "dance_grpo", "cps", "ode")
"""The built-in step kinds, in a fixed order (classes in :data:`sde_kind_registry`)."""

CPS_LOG_PROBS: tuple[str, ...] = ("flow_grpo", "gaussian")
"""What :func:`sde_step` reports as the log-prob of a ``"cps"`` step (see the module docstring)."""

KL_VARIANCES: tuple[str, ...] = ("transition", "flow_grpo", "none")
"""The denominators :func:`gaussian_kl_between_means` accepts."""

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)

SigmaLike = float | Tensor
GeneratorLike = torch.Generator | Sequence[torch.Generator] | None


class SDEStepOutput(NamedTuple):
    """What :func:`sde_step` returns (a NamedTuple, so it also unpacks as four values).

    Attributes:
        prev_sample: ``[B, ...]`` the next sample x_σ_next (the sampled one, or the given ``prev_sample``).
        log_prob: ``[B]`` log N(prev_sample; mean, std²) averaged over all non-batch elements (0 where std = 0).
        mean: ``[B, ...]`` the transition mean.
        std: ``[B, 1, ..., 1]`` the transition standard deviation (not the diffusion coefficient).
    """

    prev_sample: Tensor
    log_prob: Tensor
    mean: Tensor
    std: Tensor


sde_kind_registry: Registry[type[SDEKind]] = Registry("flow SDE kind", entry_point_group="mmrl.flow_sde")
"""The step kinds by name, each an :class:`SDEKind` subclass (``mmrl list`` shows them as ``flow.sde_kinds``); a
package adds one through the entry-point group ``mmrl.flow_sde``."""


def sde_kinds() -> tuple[str, ...]:
    """The step kinds :func:`sde_step` accepts: the built-in ones in a fixed order, ``("flow_grpo", "dance_grpo",
    "cps", "ode")``, then any that another package registered, sorted."""
    return SDE_KINDS + tuple(name for name in sde_kind_registry.names() if name not in SDE_KINDS)


def get_sde_kind(kind: str) -> SDEKind:
    """The :class:`SDEKind` registered as ``kind``, or a ValueError naming the kinds there are."""
    if not isinstance(kind, str) or kind not in sde_kind_registry:
        raise ValueError(f"unknown SDE kind {kind!r}; expected one of {', '.join(sde_kinds())}")
    return sde_kind_registry.get(kind)()


def _check_noise_level(step_kind: SDEKind, noise_level: float) -> float:
    if isinstance(noise_level, Tensor):
        if noise_level.numel() != 1:
            raise ValueError("noise_level must be a scalar")
        noise_level = noise_level.item()
    noise_level = float(noise_level)
    if not math.isfinite(noise_level) or noise_level < 0:
        raise ValueError(f"noise_level must be a finite number >= 0; got {noise_level}")
    step_kind.check_noise_level(noise_level)
    return noise_level


def _compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _per_sample(value: SigmaLike, name: str, batch: int, ndim: int, dtype: torch.dtype, device) -> Tensor:
    """A float, a 0-d tensor, a ``[B]`` (or ``[1]``) tensor, or a ``[B, 1, ..., 1]`` tensor → ``[B, 1, ..., 1]``."""
    t = torch.as_tensor(value, dtype=dtype, device=device)
    if t.ndim > 1:
        if any(d != 1 for d in t.shape[1:]):
            raise ValueError(f"{name} must hold one value per sample; got shape {tuple(t.shape)}")
        t = t.reshape(t.shape[0])
    if t.ndim == 0:
        t = t.expand(batch)
    elif t.shape[0] == 1:
        t = t.expand(batch)
    elif t.shape[0] != batch:
        raise ValueError(f"{name} has {t.shape[0]} values for a batch of {batch}")
    return t.reshape(batch, *([1] * (ndim - 1)))


def _check_sigmas(sigma: Tensor, sigma_next: Tensor) -> None:
    # One host sync per call; negligible next to the model forward that produced the velocity.
    if not bool(torch.all(sigma > sigma_next)):
        raise ValueError(
            f"sigma must be > sigma_next (σ runs from 1 down to 0); got {sigma.flatten().tolist()} "
            f"→ {sigma_next.flatten().tolist()}"
        )
    if not bool(torch.all((sigma <= 1) & (sigma_next >= 0))):
        raise ValueError(f"sigmas must lie in [0, 1]; got {sigma.flatten().tolist()} → {sigma_next.flatten().tolist()}")


def _standard_normal(shape: torch.Size, generator: GeneratorLike, device, dtype: torch.dtype) -> Tensor:
    """z ~ N(0, I) of ``shape``, drawn the way diffusers' ``randn_tensor`` draws it (one generator per sample if a
    list is given), on the generator's device and then moved to ``device``."""
    if isinstance(generator, Sequence):
        if len(generator) != shape[0]:
            raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}")
        parts = [torch.randn((1, *shape[1:]), generator=g, device=g.device, dtype=dtype) for g in generator]
        return torch.cat([p.to(device) for p in parts])
    if generator is None:
        return torch.randn(shape, device=device, dtype=dtype)
    return torch.randn(shape, generator=generator, device=generator.device, dtype=dtype).to(device)


def _gaussian_log_prob(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """log N(x; mean, std²) averaged over non-batch elements; 0 where std == 0.

    Shapes: x, mean ``[B, ...]``; std ``[B, 1, ..., 1]`` → ``[B]``.
    """
    stochastic = std > 0  # [B, 1, ..., 1]
    safe_std = torch.where(stochastic, std, torch.ones_like(std))  # keeps gradients finite where std == 0
    elementwise = -((x.detach() - mean) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - _LOG_SQRT_2PI
    log_prob = elementwise.reshape(x.shape[0], -1).mean(dim=1)  # [B]
    return torch.where(stochastic.reshape(-1), log_prob, torch.zeros_like(log_prob))


def _cps_objective(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Flow-GRPO's CPS "log-prob" −mean((x − mean)²) over non-batch elements; 0 where std == 0 (a deterministic step
    has no action: Flow-GRPO's formula would still regress the mean onto x there, a step it never trains).

    Shapes: x, mean ``[B, ...]``; std ``[B, 1, ..., 1]`` → ``[B]``.
    """
    objective = -((x.detach() - mean) ** 2).reshape(x.shape[0], -1).mean(dim=1)  # [B]
    return torch.where(std.reshape(-1) > 0, objective, torch.zeros_like(objective))


# ---------------------------------------------------------------------------------------------------- the kinds
class SDEKind:
    """One kind of sampler step x_σ → x_σ_next, a Gaussian transition N(mean, std²·I) (the base class).

    A kind is stateless: its mean and std (:meth:`transition`), diffusion coefficient, log-prob and KL each live in
    one method. :func:`sde_step`, :func:`diffusion_coefficient`, :func:`transition_std` and the plugin's KL validate
    their inputs and call these; the tensors they pass are already float32/float64 and shaped for broadcasting
    (``sigma`` and ``sigma_next`` ``[B, 1, ..., 1]`` in a step, ``[S]`` or ``[B]`` elsewhere).
    """

    name: ClassVar[str]
    #: Whether a sampled step draws noise (``"ode"``: no draw, the next sample is the mean).
    stochastic: ClassVar[bool] = True
    #: The largest noise level the kind takes (None: any finite number >= 0). The plugin's config refuses a larger
    #: ``plugin.noise_level`` up front; :meth:`check_noise_level` refuses it in a step.
    max_noise_level: ClassVar[float | None] = None
    #: Whether the last denoising step (σ_next = 0) is deterministic, std = 0: it then has no log-prob to train (0,
    #: no gradient) and an infinite (means that differ) or NaN (equal means) KL, so the config and the credit
    #: strategies refuse any step selection, branch point or split that trains it.
    deterministic_last_step: ClassVar[bool] = False

    def check_noise_level(self, noise_level: float) -> None:
        """Raise a ValueError for a noise level the kind cannot take: every kind takes a finite number >= 0 (checked
        by the caller), at most :attr:`max_noise_level`."""
        if self.max_noise_level is not None and noise_level > self.max_noise_level:
            raise ValueError(f"noise_level for {self.name!r} is at most {self.max_noise_level}; got {noise_level}")

    def diffusion_coefficient(self, sigma: Tensor, sigma_next: Tensor, noise_level: float) -> Tensor:
        """The diffusion coefficient s of the step (:func:`diffusion_coefficient`), shaped as ``sigma``."""
        raise NotImplementedError

    def transition(self, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor,
                   noise_level: float) -> tuple[Tensor, Tensor]:
        """(mean ``[B, ...]``, std ``[B, 1, ..., 1]``) of x_next given the sample x and the velocity v."""
        raise NotImplementedError

    def transition_std(self, sigma: Tensor, sigma_next: Tensor, noise_level: float) -> Tensor:
        """The std of the step, which depends on the σ grid only (:func:`transition_std`)."""
        raise NotImplementedError

    def log_prob(self, action: Tensor, mean: Tensor, std: Tensor, *, cps_log_prob: str) -> Tensor:
        """``[B]`` the log-prob of the action x_next: the exact Gaussian log-density per element (0 where std = 0)."""
        return _gaussian_log_prob(action, mean, std)

    def kl(self, mean: Tensor, ref_mean: Tensor, std: Tensor, sigma: SigmaLike, sigma_next: SigmaLike, *,
           noise_level: float, variance: str) -> Tensor:
        """``[B]`` the KL between the policy's and the reference's transitions from one x
        (:func:`gaussian_kl_between_means` with this kind's diffusion coefficient for ``variance="flow_grpo"``)."""
        coefficient = diffusion_coefficient(self.name, sigma, sigma_next, noise_level=noise_level)
        return gaussian_kl_between_means(mean, ref_mean, std, variance=variance, diffusion_coeff=coefficient)


class _ReverseSDE(SDEKind):
    """The Euler–Maruyama step of the reverse-time SDE with the flow's marginals; subclasses give s."""

    def transition(self, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor,
                   noise_level: float) -> tuple[Tensor, Tensor]:
        delta = sigma - sigma_next  # > 0
        s = self.diffusion_coefficient(sigma, sigma_next, noise_level)  # [B, 1, ..., 1]
        eps_hat = x + (1 - sigma) * v  # [B, ...]
        mean = x - delta * v - delta * (s**2 / (2 * sigma)) * eps_hat
        return mean, s * torch.sqrt(delta)

    def transition_std(self, sigma: Tensor, sigma_next: Tensor, noise_level: float) -> Tensor:
        return self.diffusion_coefficient(sigma, sigma_next, noise_level) * torch.sqrt(sigma - sigma_next)


@sde_kind_registry.register("flow_grpo")
class FlowGRPOSDE(_ReverseSDE):
    """Flow-GRPO's SDE, s = a·√(σ/(1 − σ)) (arXiv:2505.05470)."""

    name = "flow_grpo"

    def diffusion_coefficient(self, sigma: Tensor, sigma_next: Tensor, noise_level: float) -> Tensor:
        # Flow-GRPO: at σ == 1 the denominator uses the next grid point so s stays finite.
        denominator_sigma = torch.where(sigma == 1, sigma_next, sigma)
        return noise_level * torch.sqrt(sigma / (1 - denominator_sigma))


@sde_kind_registry.register("dance_grpo")
class DanceGRPOSDE(_ReverseSDE):
    """DanceGRPO's SDE, a constant s = η (arXiv:2505.07818)."""

    name = "dance_grpo"

    def diffusion_coefficient(self, sigma: Tensor, sigma_next: Tensor, noise_level: float) -> Tensor:
        return torch.full_like(sigma, noise_level)


@sde_kind_registry.register("cps")
class CoefficientsPreservingStep(SDEKind):
    """Coefficients-Preserving Sampling, std = σ_next·sin(a·π/2) (arXiv:2509.05952)."""

    name = "cps"
    max_noise_level = 1.0  # an angle fraction: a·π/2 in [0, π/2]
    deterministic_last_step = True  # std = σ_next·sin(a·π/2) = 0 at σ_next = 0

    def check_noise_level(self, noise_level: float) -> None:
        if noise_level > self.max_noise_level:
            raise ValueError(f"noise_level for 'cps' is an angle fraction in [0, 1]; got {noise_level}")

    def diffusion_coefficient(self, sigma: Tensor, sigma_next: Tensor, noise_level: float) -> Tensor:
        # Not an Euler–Maruyama step: its "s" is the transition std itself (Flow-GRPO's CPS std_dev_t).
        return sigma_next * math.sin(noise_level * math.pi / 2)

    def transition(self, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor,
                   noise_level: float) -> tuple[Tensor, Tensor]:
        angle = noise_level * math.pi / 2
        std = self.diffusion_coefficient(sigma, sigma_next, noise_level)  # [B, 1, ..., 1]
        x0_hat = x - sigma * v
        eps_hat = x + (1 - sigma) * v
        # √(σ_next² − std²) = σ_next·cos(angle) for angle ∈ [0, π/2]; the product form cannot go negative.
        mean = (1 - sigma_next) * x0_hat + (sigma_next * math.cos(angle)) * eps_hat
        return mean, std

    def transition_std(self, sigma: Tensor, sigma_next: Tensor, noise_level: float) -> Tensor:
        return self.diffusion_coefficient(sigma, sigma_next, noise_level)

    def log_prob(self, action: Tensor, mean: Tensor, std: Tensor, *, cps_log_prob: str) -> Tensor:
        if cps_log_prob == "flow_grpo":
            return _cps_objective(action, mean, std)
        return _gaussian_log_prob(action, mean, std)


@sde_kind_registry.register("ode")
class EulerODEStep(SDEKind):
    """The deterministic Euler step of the flow ODE, std = 0 (no density: log-prob 0, never trained)."""

    name = "ode"
    stochastic = False

    def diffusion_coefficient(self, sigma: Tensor, sigma_next: Tensor, noise_level: float) -> Tensor:
        return torch.zeros_like(sigma)

    def transition(self, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor,
                   noise_level: float) -> tuple[Tensor, Tensor]:
        return x - (sigma - sigma_next) * v, torch.zeros_like(sigma)

    def transition_std(self, sigma: Tensor, sigma_next: Tensor, noise_level: float) -> Tensor:
        return torch.zeros_like(sigma)

    def log_prob(self, action: Tensor, mean: Tensor, std: Tensor, *, cps_log_prob: str) -> Tensor:
        return torch.zeros(action.shape[0], dtype=mean.dtype, device=mean.device)

    def kl(self, mean: Tensor, ref_mean: Tensor, std: Tensor, sigma: SigmaLike, sigma_next: SigmaLike, *,
           noise_level: float, variance: str) -> Tensor:
        raise ValueError("the KL of an 'ode' step is undefined (a deterministic transition has no density)")



def sde_step(
    kind: str,
    velocity: Tensor,
    sample: Tensor,
    sigma: SigmaLike,
    sigma_next: SigmaLike,
    *,
    noise_level: float,
    prev_sample: Tensor | None = None,
    generator: GeneratorLike = None,
    cps_log_prob: str = "flow_grpo",
) -> SDEStepOutput:
    r"""Take (or score) one step x_σ → x_σ_next of a flow-matching sampler and return its Gaussian log-density.

    See the module docstring for the formulas of each kind. With ``prev_sample=None`` the next sample is drawn,
    ``prev_sample = mean + std·z`` with z ~ N(0, I) from ``generator``; with ``prev_sample`` given (recomputing the
    log-probability of a stored action under new weights) nothing is drawn and the given sample is scored. The
    log-density treats the action as data (it is detached); gradients flow through ``mean``. A drawn
    ``prev_sample`` keeps its graph through ``mean`` (reparameterised), which rollouts under ``no_grad`` ignore.

    Args:
        kind (`str`):
            One of :data:`SDE_KINDS`: ``"flow_grpo"``, ``"dance_grpo"``, ``"cps"`` or ``"ode"``.
        velocity (`torch.Tensor`):
            The model output v ≈ ε − x0, same shape as ``sample``.  # [B, C, H, W] or [B, L, D] (packed tokens)
        sample (`torch.Tensor`):
            The current sample x_σ.  # [B, C, H, W]
        sigma (`float` or `torch.Tensor`):
            The current noise level σ ∈ (0, 1]; a float or one value per sample.  # [] or [B]
        sigma_next (`float` or `torch.Tensor`):
            The next noise level, 0 <= σ_next < σ.  # [] or [B]
        noise_level (`float`):
            a for ``"flow_grpo"`` (s = a·√(σ/(1−σ))), η for ``"dance_grpo"`` (s = η), the angle fraction a ∈ [0, 1]
            for ``"cps"``; validated (>= 0) but unused for ``"ode"``. 0 gives the deterministic Euler step.
        prev_sample (`torch.Tensor`, *optional*):
            A stored next sample to score instead of drawing one.  # [B, C, H, W]
        generator (`torch.Generator` or list of `torch.Generator`, *optional*):
            Source of z: one generator, or one per sample (as in diffusers' ``randn_tensor``). The stochastic kinds
            always draw z when sampling, even where std = 0, so the random stream does not depend on
            ``noise_level``; ``"ode"`` never draws.
        cps_log_prob (`str`, *optional*, defaults to ``"flow_grpo"``):
            What ``log_prob`` is for ``"cps"`` (:data:`CPS_LOG_PROBS`): Flow-GRPO's −mean((x_next − mean)²), or
            ``"gaussian"``, the exact log-density (see the module docstring for why it is not the default). Ignored
            by the other kinds, which always report the exact log-density.

    Returns:
        :class:`SDEStepOutput` ``(prev_sample, log_prob, mean, std)``: prev_sample and mean ``[B, ...]``, log_prob
        ``[B]`` (the per-element Gaussian log-density averaged over all non-batch dims, as in Flow-GRPO and
        DanceGRPO, or Flow-GRPO's CPS objective; 0 for samples whose std is 0), std ``[B, 1, ..., 1]`` (the
        transition std, s·√Δ for the SDE kinds). All in float32 (float64 for float64 inputs).

    Raises:
        ValueError: an unknown ``kind`` or ``cps_log_prob``; ``noise_level < 0`` (or > 1 for ``"cps"``);
            ``sigma <= sigma_next`` or sigmas outside [0, 1]; mismatched shapes or generator count.
    """
    step_kind = get_sde_kind(kind)
    if cps_log_prob not in CPS_LOG_PROBS:
        raise ValueError(f"unknown cps_log_prob {cps_log_prob!r}; expected one of {', '.join(CPS_LOG_PROBS)}")
    noise_level = _check_noise_level(step_kind, noise_level)
    if velocity.shape != sample.shape:
        raise ValueError(f"velocity {tuple(velocity.shape)} and sample {tuple(sample.shape)} must share one shape")
    if prev_sample is not None and prev_sample.shape != sample.shape:
        raise ValueError(
            f"prev_sample {tuple(prev_sample.shape)} and sample {tuple(sample.shape)} must share one shape"
        )
    if sample.ndim < 1 or sample.shape[0] == 0:
        raise ValueError("sample must have a non-empty batch dimension")

    dtype = _compute_dtype(velocity, sample)
    device = sample.device
    x = sample.to(dtype)  # [B, ...]
    v = velocity.to(dtype)  # [B, ...]
    batch, ndim = x.shape[0], x.ndim
    sigma_t = _per_sample(sigma, "sigma", batch, ndim, dtype, device)  # [B, 1, ..., 1]
    sigma_n = _per_sample(sigma_next, "sigma_next", batch, ndim, dtype, device)  # [B, 1, ..., 1]
    _check_sigmas(sigma_t, sigma_n)
    mean, std = step_kind.transition(x, v, sigma_t, sigma_n, noise_level)  # [B, ...], [B, 1, ..., 1]
    if prev_sample is None:
        if step_kind.stochastic:
            z = _standard_normal(x.shape, generator, device, dtype)  # [B, ...]
            prev_sample = mean + std * z
        else:
            prev_sample = mean
    else:
        prev_sample = prev_sample.to(device=device, dtype=dtype)
    log_prob = step_kind.log_prob(prev_sample, mean, std, cps_log_prob=cps_log_prob)  # [B]
    return SDEStepOutput(prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std)


def diffusion_coefficient(kind: str, sigma: SigmaLike, sigma_next: SigmaLike, *, noise_level: float) -> Tensor:
    r"""The diffusion coefficient s of a step, i.e. the transition std without the √Δ factor.

    ``"flow_grpo"``: s = a·√(σ/(1−σ)) (σ_next in the denominator at σ == 1); ``"dance_grpo"``: s = η. ``"cps"``
    is not an Euler–Maruyama step and has no s: its transition std σ_next·sin(a·π/2) is returned, which is the
    ``std_dev_t`` Flow-GRPO's CPS code returns and divides its KL by. ``"ode"``: 0. Used for Flow-GRPO's KL
    (:func:`gaussian_kl_between_means` with ``variance="flow_grpo"``) and noise-aware step weights.

    Args:
        kind (`str`): One of :data:`SDE_KINDS`.
        sigma (`float` or `torch.Tensor`): The current noise level.  # [] or [B]
        sigma_next (`float` or `torch.Tensor`): The next noise level.  # [] or [B]
        noise_level (`float`): As in :func:`sde_step`.

    Returns:
        `torch.Tensor`: s with the broadcast shape of ``sigma`` and ``sigma_next`` (float32, or float64 for float64
        sigmas).  # [] or [B]
    """
    step_kind = get_sde_kind(kind)
    sigma_t, sigma_n, noise_level = _checked_sigmas(step_kind, sigma, sigma_next, noise_level)
    return step_kind.diffusion_coefficient(sigma_t, sigma_n, noise_level)


def transition_std(kind: str, sigma: SigmaLike, sigma_next: SigmaLike, *, noise_level: float) -> Tensor:
    r"""The transition std of a step, a function of the σ grid only: s·√Δ for the SDE kinds, σ_next·sin(a·π/2) for
    ``"cps"``, 0 for ``"ode"`` (what :func:`sde_step` returns as ``std``, without the trailing dims).

    Args:
        kind (`str`): One of :func:`sde_kinds`.
        sigma (`float` or `torch.Tensor`): The current noise level.  # [] or [S]
        sigma_next (`float` or `torch.Tensor`): The next noise level.  # [] or [S]
        noise_level (`float`): As in :func:`sde_step`.

    Returns:
        `torch.Tensor`: the std with the broadcast shape of the sigmas (float32, or float64 for float64 sigmas).
    """
    step_kind = get_sde_kind(kind)
    sigma_t, sigma_n, noise_level = _checked_sigmas(step_kind, sigma, sigma_next, noise_level)
    return step_kind.transition_std(sigma_t, sigma_n, noise_level)


def _checked_sigmas(step_kind: SDEKind, sigma: SigmaLike, sigma_next: SigmaLike,
                    noise_level: float) -> tuple[Tensor, Tensor, float]:
    """Both sigmas as tensors of one dtype (float64 if either is) and broadcast shape, and the checked noise level."""
    noise_level = _check_noise_level(step_kind, noise_level)
    dtypes = [t.dtype for t in (sigma, sigma_next) if isinstance(t, Tensor)]
    dtype = torch.float64 if torch.float64 in dtypes else torch.float32
    device = next((t.device for t in (sigma, sigma_next) if isinstance(t, Tensor)), None)
    sigma_t, sigma_n = torch.broadcast_tensors(
        torch.as_tensor(sigma, dtype=dtype, device=device), torch.as_tensor(sigma_next, dtype=dtype, device=device)
    )
    _check_sigmas(sigma_t, sigma_n)
    return sigma_t, sigma_n, noise_level


def gaussian_kl_between_means(
    mean: Tensor,
    ref_mean: Tensor,
    std: SigmaLike,
    *,
    variance: str = "transition",
    diffusion_coeff: SigmaLike | None = None,
) -> Tensor:
    r"""Per-sample KL between the policy's and the reference's transition Gaussians, averaged over elements.

    Both transitions share the std (it depends only on σ and the noise level), so the KL is closed-form:

        KL(N(μ_θ, std²·I) ‖ N(μ_ref, std²·I)) / D = mean_dims((μ_θ − μ_ref)²) / (2·std²),

    divided by the number D of non-batch elements, i.e. the same per-element normalisation as ``log_prob`` in
    :func:`sde_step`, so β has the same scale as in Flow-GRPO.

    ``variance="transition"`` (default) is this exact KL, with ``std`` the transition std returned by
    :func:`sde_step` (s·√Δ for the SDE kinds). ``variance="flow_grpo"`` reproduces Flow-GRPO's loss
    (arXiv:2505.05470, code): the denominator is 2·s² with s the *diffusion coefficient* (pass
    ``diffusion_coeff``, see :func:`diffusion_coefficient`), not the transition variance s²·Δ. For the SDE kinds
    that is Δ × the exact KL; Flow-GRPO dropped Δ on purpose to weight late (small-Δ) steps more, and its β values
    (0.04 GenEval/OCR, 0.01 PickScore) are tuned for that form. For ``"cps"`` both forms coincide when
    ``diffusion_coeff`` comes from :func:`diffusion_coefficient`. ``variance="none"`` divides by nothing:
    mean((μ_θ − μ_ref)²), the KL term of the CPS authors' trainer (IamCreateAI/FlowCPS@814c359
    ``scripts/train_sd3.py:900``, β = 0.04 in its OCR config), which no constant β turns into the others (their
    factor 1/(2·std²) changes from step to step).

    The reference is never trained: ``ref_mean`` is detached. Computed in float32 (float64 for float64 inputs).
    The KL is undefined for a deterministic step (std = 0 gives inf or nan): do not regularise those steps.

    Args:
        mean (`torch.Tensor`): μ_θ from :func:`sde_step` under the trained weights.  # [B, C, H, W]
        ref_mean (`torch.Tensor`): μ_ref under the reference weights (same x, σ, σ_next).  # [B, C, H, W]
        std (`float` or `torch.Tensor`): The transition std from :func:`sde_step`.  # [B, 1, 1, 1], [B] or []
        variance (`str`): ``"transition"`` (exact KL), ``"flow_grpo"`` (denominator 2·s²) or ``"none"`` (no
            denominator: the mean squared distance of the means).
        diffusion_coeff (`float` or `torch.Tensor`, *optional*): s, required for ``variance="flow_grpo"``.
            # [B] or []

    Returns:
        `torch.Tensor`: the per-sample KL per element.  # [B]
    """
    if variance not in KL_VARIANCES:
        raise ValueError(f"unknown KL variance {variance!r}; expected one of {', '.join(KL_VARIANCES)}")
    if mean.shape != ref_mean.shape:
        raise ValueError(f"mean {tuple(mean.shape)} and ref_mean {tuple(ref_mean.shape)} must share one shape")
    if variance == "flow_grpo":
        if diffusion_coeff is None:
            raise ValueError("variance='flow_grpo' needs diffusion_coeff (see diffusion_coefficient())")
        scale, scale_name = diffusion_coeff, "diffusion_coeff"
    else:
        scale, scale_name = std, "std"
    dtype = _compute_dtype(mean, ref_mean)
    batch = mean.shape[0]
    diff = mean.to(dtype) - ref_mean.detach().to(dtype)  # [B, ...]
    squared = (diff**2).reshape(batch, -1).mean(dim=1)  # [B]
    if variance == "none":
        return squared
    scale_t = _per_sample(scale, scale_name, batch, 1, dtype, mean.device)  # [B]
    return squared / (2 * scale_t**2)
