"""Mask plans: the random masks, timesteps and importance weights of a masked-diffusion likelihood estimate.

A :class:`MaskPlan` is drawn once from an explicit ``torch.Generator`` and can then be evaluated with any number of
models. Scoring the current, old and reference policies with the *same* plan is the antithetic sampling of VRPO
(LLaDA 1.5, Zhu et al. 2025, arXiv:2505.19223): the Monte Carlo noise is shared, the difference
``est_θ − est_old`` has a much smaller variance than either estimate, and the ratio ``exp(est_θ − est_old)`` is
exactly 1 at ``θ = θ_old``. Every plan uses one mask per sampled timestep (VRPO's optimal allocation
``n_t = n, n_mask = 1``).

Every estimator except the SPG upper bound is *linear* in the per-token log-probabilities:

    est_b = (1/N) Σ_n Σ_i w[n, b, i] · log p_θ(x_b^i | c_b, x̃_{n,b}),

where ``x̃_{n,b}`` is copy ``n`` of sample ``b`` with the planned positions replaced by the mask token and
``w[n, b, i]`` is a per-token importance weight, zero for positions that are not scored (unmasked tokens, padding).
For all unbiased plans below, ``(1/N) Σ_n E[w[n, b, i]] = 1`` for every real completion token ``i``.

Conventions:
    - ``completion_mask`` marks the real completion tokens (1: up to and including the first EOS) and the tail after
      them (0). **The tail is masked in every draw** and never scored or counted: the model is scored on the
      completion with everything after its end unseen, as the sampler produced it (d1 masks every completion
      position, ``diffu_grpo_trainer.py`` L252 at dllm-reasoning/d1@837888f; SPG masks the positions after the first
      EOS in every forward type, ``spg_trainer.py`` L302/L377 at facebookresearch/SPG@a1c7120). What the tail holds
      therefore never changes an estimate; the estimate is the ELBO of the real tokens with the tail marginalised.
      ``L_b`` is the number of real tokens of sample ``b``.
    - Random numbers are drawn in float64 on ``generator.device`` (CPU generators give the same plan on every
      accelerator and rank) and moved to the device of ``completion_ids``; the draw order is fixed, so one seed
      gives one plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

REDUCTIONS = ("elbo", "eubo")


@dataclass(frozen=True, eq=False)
class MaskPlan:
    """The masks and weights of ``N`` Monte Carlo draws for a batch of ``B`` completions of width ``L``.

    Args:
        completion_masked: ``bool [N, B, L]``. Completion positions replaced by the mask token in draw ``n``.
        weights: ``float32 [N, B, L]``. Per-draw importance weight of each token's log-probability; zero where the
            token is not scored. Only positions with a non-zero weight are evaluated.
        num_tokens: ``float32 [B]``. ``L_b``, the number of real completion tokens (scales the EUBO).
        prompt_masked: ``bool [N, B, P]`` or ``None``. Prompt positions replaced by the mask token (d1-style prompt
            masking); ``None`` leaves the prompt intact.
        reduction: ``"elbo"`` for the linear estimate ``(1/N) Σ_n Σ_i w·log p`` or ``"eubo"`` for SPG's Rényi-type
            upper bound ``L_b · mean_i (1/β) log((1/N) Σ_n w·p^β)`` (see :meth:`reduce`).
        beta: The Rényi order ``β ≥ 1`` of the ``"eubo"`` reduction (ignored by ``"elbo"``).
        name: The plan kind, for messages.
    """

    completion_masked: Tensor
    weights: Tensor
    num_tokens: Tensor
    prompt_masked: Tensor | None = None
    reduction: str = "elbo"
    beta: float = 1.0
    name: str = ""

    def __post_init__(self) -> None:
        if self.completion_masked.dim() != 3 or self.completion_masked.dtype != torch.bool:
            raise ValueError(f"completion_masked must be bool [N, B, L], got {tuple(self.completion_masked.shape)}")
        if self.weights.shape != self.completion_masked.shape:
            raise ValueError(
                f"weights {tuple(self.weights.shape)} must match completion_masked "
                f"{tuple(self.completion_masked.shape)}"
            )
        n, b, _ = self.completion_masked.shape
        if self.num_tokens.shape != (b,):
            raise ValueError(f"num_tokens must be [B={b}], got {tuple(self.num_tokens.shape)}")
        if self.prompt_masked is not None and (
            self.prompt_masked.dim() != 3 or self.prompt_masked.shape[:2] != (n, b)
        ):
            raise ValueError(f"prompt_masked must be bool [N={n}, B={b}, P], got {tuple(self.prompt_masked.shape)}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.reduction == "eubo" and not self.beta >= 1.0:
            raise ValueError(f"the EUBO needs beta >= 1 (Rényi order), got {self.beta}")
        if self.reduction == "eubo" and bool((self.weights < 0).any()):
            raise ValueError(f"the EUBO needs nonnegative weights (densities over the draws); plan {self.name!r} has "
                             "negative ones")

    # ------------------------------------------------------------------ shape helpers
    @property
    def num_samples(self) -> int:
        """``N``, the number of masked copies (forward rows) per completion."""
        return self.completion_masked.shape[0]

    @property
    def batch_size(self) -> int:
        return self.completion_masked.shape[1]

    @property
    def completion_length(self) -> int:
        return self.completion_masked.shape[2]

    @property
    def scored(self) -> Tensor:
        """``bool [N, B, L]``: positions whose log-probability the estimate uses."""
        return self.weights != 0

    def to(self, device: torch.device | str) -> MaskPlan:
        """The same plan on ``device``."""
        return MaskPlan(
            completion_masked=self.completion_masked.to(device),
            weights=self.weights.to(device),
            num_tokens=self.num_tokens.to(device),
            prompt_masked=None if self.prompt_masked is None else self.prompt_masked.to(device),
            reduction=self.reduction,
            beta=self.beta,
            name=self.name,
        )

    def check_compatible(self, prompt_ids: Tensor, completion_ids: Tensor) -> None:
        """Raise ``ValueError`` unless the plan was drawn for ids of these shapes."""
        _, b, length = self.completion_masked.shape
        if tuple(completion_ids.shape) != (b, length):
            raise ValueError(
                f"plan {self.name!r} was drawn for completions [B={b}, L={length}], got {tuple(completion_ids.shape)}"
            )
        if prompt_ids.dim() != 2 or prompt_ids.shape[0] != b:
            raise ValueError(f"prompt_ids must be [B={b}, P], got {tuple(prompt_ids.shape)}")
        if self.prompt_masked is not None and self.prompt_masked.shape[2] != prompt_ids.shape[1]:
            raise ValueError(
                f"plan {self.name!r} masks a prompt of length {self.prompt_masked.shape[2]}, "
                f"got prompts of length {prompt_ids.shape[1]}"
            )

    def model_inputs(self, prompt_ids: Tensor, completion_ids: Tensor, mask_id: int) -> Tensor:
        """The ``N·B`` masked copies, draw-major (row ``n·B + b``).

        Shapes:
            prompt_ids ``[B, P]``, completion_ids ``[B, L]`` → ``[N·B, P + L]``.
        """
        self.check_compatible(prompt_ids, completion_ids)
        n = self.num_samples
        completion = torch.where(self.completion_masked, mask_id, completion_ids.unsqueeze(0))  # [N, B, L]
        prompt = prompt_ids.unsqueeze(0).expand(n, -1, -1)  # [N, B, P]
        if self.prompt_masked is not None:
            prompt = torch.where(self.prompt_masked, mask_id, prompt)
        return torch.cat([prompt, completion], dim=-1).reshape(n * self.batch_size, -1)

    # ------------------------------------------------------------------ reduction
    def reduce(self, token_logp: Tensor) -> Tensor:
        """Combine per-token log-probabilities into one sequence score per sample.

        ``"elbo"``: ``est_b = (1/N) Σ_n Σ_i w[n,b,i] · ℓ[n,b,i]``.

        ``"eubo"`` (SPG, Wang et al. 2025, arXiv:2510.09541): for every token observed (``w > 0``) in at least one
        draw, ``a_i = (1/N) Σ_n w[n,b,i] · exp(β·ℓ[n,b,i])``, computed in log space, and
        ``est_b = L_b · mean_{observed i} (1/β)·log a_i``. Tokens masked in no draw are left out of the mean, as
        in SPG's code; multiplying the mean by ``L_b`` puts the bound on the sequence scale of the other estimators
        (SPG reports the mean and re-weights its loss by the completion length, which is the same thing).

        Shapes:
            token_logp ``[N, B, L]`` (zero where not scored) → ``[B]`` float32.
        """
        if token_logp.shape != self.weights.shape:
            raise ValueError(f"token_logp {tuple(token_logp.shape)} must match the plan {tuple(self.weights.shape)}")
        weights = self.weights.to(token_logp.dtype)
        if self.reduction == "elbo":
            return (weights * token_logp).sum(dim=-1).mean(dim=0)
        observed = weights > 0  # [N, B, L]
        valid = observed.any(dim=0)  # [B, L]
        # Columns that are never observed get finite dummies so logsumexp has no all −∞ column (NaN gradients).
        filler = torch.where(valid, float("-inf"), 0.0).unsqueeze(0).expand_as(weights)
        log_terms = torch.where(observed, weights.clamp_min(1e-30).log() + self.beta * token_logp, filler)
        log_mean = torch.logsumexp(log_terms, dim=0) - math.log(self.num_samples)  # [B, L]
        per_token = torch.where(valid, log_mean / self.beta, 0.0)
        count = valid.sum(dim=-1).clamp(min=1).to(token_logp.dtype)
        return self.num_tokens.to(token_logp.dtype) * per_token.sum(dim=-1) / count


# ---------------------------------------------------------------------- random primitives
class SampleStreams:
    """One random stream per sample of a batch, so that a plan drawn for the whole batch at once is, sample by
    sample, the plan each sample would draw alone from its own generator.

    A plan function draws its uniforms through :func:`uniform` in a fixed order whose shapes depend on the batch
    size only along the batch axis. Drawn alone (batch size 1), sample ``b`` takes each call's values from its
    generator in row-major order; the batched draw gives sample ``b``, for every call, the next values of its own
    stream in the same order, and places them at index ``b`` of the call's batch axis. CPU ``torch.rand`` consumes a
    generator sequentially (``rand(a)`` then ``rand(b)`` equals ``rand(a + b)``), so the streams are read in blocks,
    one ``rand`` per sample per block, instead of one per call.

    Args:
        generators: One CPU generator per sample, in batch order.
    """

    def __init__(self, generators: list[torch.Generator]):
        if not generators or any(g.device.type != "cpu" for g in generators):
            raise ValueError("SampleStreams needs at least one generator, all on the CPU")
        self.generators = generators
        self.device = torch.device("cpu")
        self._buffer = torch.empty(len(generators), 0, dtype=torch.float64)  # [B, drawn]
        self._position = 0  # values of every stream used so far

    def __len__(self) -> int:
        return len(self.generators)

    def reserve(self, count: int) -> None:
        """Read ahead so that the next ``count`` values of every stream are buffered, in one ``rand`` per sample
        (exactly what is missing: the generators then end where reading the values one draw at a time would leave
        them)."""
        missing = self._position + count - self._buffer.shape[1]
        if missing > 0:
            fresh = torch.stack([torch.rand(missing, generator=g, dtype=torch.float64) for g in self.generators])
            self._buffer = torch.cat([self._buffer, fresh], dim=1)

    def take(self, shape: tuple[int, ...], batch_axis: int) -> Tensor:
        """The next uniforms of every stream for a draw of ``shape`` whose axis ``batch_axis`` is the batch.

        Shapes:
            → float64 ``shape`` (``shape[batch_axis]`` must be the number of streams).
        """
        batch = len(self.generators)
        if shape[batch_axis] != batch:
            raise ValueError(f"a draw of shape {tuple(shape)} has {shape[batch_axis]} samples along axis {batch_axis}, "
                             f"but there are {batch} streams")
        per_sample = [size for axis, size in enumerate(shape) if axis != batch_axis]
        count = math.prod(per_sample)
        missing = self._position + count - self._buffer.shape[1]
        if missing > 0:  # read a block: at least what is missing, at least as much as already read (doubling)
            block = max(missing, self._buffer.shape[1], 64)
            fresh = torch.stack([torch.rand(block, generator=g, dtype=torch.float64) for g in self.generators])
            self._buffer = torch.cat([self._buffer, fresh], dim=1)
        values = self._buffer[:, self._position:self._position + count]  # [B, count]
        self._position += count
        return values.reshape(batch, *per_sample).movedim(0, batch_axis)


def uniform(shape: tuple[int, ...], generator: torch.Generator | SampleStreams | None, device: torch.device,
            batch_axis: int = 0) -> Tensor:
    """``U[0, 1)`` in float64 drawn on the generator's device (CPU when ``generator`` is None), moved to ``device``.

    With :class:`SampleStreams`, each sample's values along ``batch_axis`` come from its own stream."""
    if isinstance(generator, SampleStreams):
        return generator.take(tuple(shape), batch_axis).to(device)
    source = generator.device if generator is not None else torch.device("cpu")
    return torch.rand(shape, generator=generator, device=source, dtype=torch.float64).to(device)


def uniform_count(u: Tensor, high: Tensor) -> Tensor:
    """Map ``u ~ U[0,1)`` to a uniform integer in ``{1, ..., high}`` (0 where ``high == 0``).

    Shapes:
        u and high broadcastable → long tensor of the broadcast shape.
    """
    high = high.long()
    return torch.minimum(torch.floor(u * high.to(torch.float64)).long() + 1, high)


def stratified_counts(u: Tensor, high: Tensor, num: int) -> Tensor:
    """LLaDA's stratified mask counts: one random offset per sample, ``num`` evenly spread counts.

    ``k_b ~ U{1..H_b}`` and ``l_{n,b} = ((k_b − 1 + ⌊n·H_b/num⌉) mod H_b) + 1`` for ``n = 0..num−1`` (``⌊·⌉`` rounds
    half up), as in LLaDA's ``get_log_likelihood.py`` (Nie et al. 2025, arXiv:2502.09992). Each ``l_{n,b}`` is
    marginally uniform on ``{1..H_b}`` (a shift of a uniform variable modulo ``H_b``), so any estimate that is
    unbiased for one uniform count stays unbiased; the counts of one sample are spread over the whole range,
    which removes most of the between-draw variance of the count. With ``num = H_b`` they are a permutation of
    ``1..H_b``.

    Shapes:
        u ``[B]``, high ``[B]`` → ``[num, B]`` long (0 where ``high == 0``).
    """
    high = high.long()
    k = uniform_count(u, high)  # [B]
    n = torch.arange(num, device=high.device).unsqueeze(1)  # [num, 1]
    offset = torch.div(2 * n * high + num, 2 * num, rounding_mode="floor")  # round(n·H/num), half up
    counts = torch.remainder(k - 1 + offset, high.clamp(min=1)) + 1
    return torch.where(high > 0, counts, 0)


def random_subset(eligible: Tensor, size: Tensor, u: Tensor) -> Tensor:
    """A uniformly random subset of exactly ``size`` eligible positions along the last dimension.

    The eligible positions are ranked by their iid uniform keys ``u`` (a uniform random order) and the ``size``
    first are taken. Requires ``size <= eligible.sum(-1)``.

    Shapes:
        eligible ``bool [..., L]``, size ``[...]``, u ``[..., L]`` → ``bool [..., L]``.
    """
    keys = torch.where(eligible, u, 2.0)  # ineligible positions rank last
    rank = keys.argsort(dim=-1).argsort(dim=-1)
    return (rank < size.unsqueeze(-1)) & eligible


def _prompt_masks(num: int, prompt_ids: Tensor, p_mask_prompt: float, generator, device) -> Tensor | None:
    if not 0.0 <= p_mask_prompt <= 1.0:
        raise ValueError(f"p_mask_prompt must be in [0, 1], got {p_mask_prompt}")
    if p_mask_prompt == 0.0 or prompt_ids.shape[1] == 0:
        return None
    return uniform((num, *prompt_ids.shape), generator, device, batch_axis=1) < p_mask_prompt


def _check(prompt_ids: Tensor, completion_ids: Tensor, completion_mask: Tensor, num_samples: int) -> Tensor:
    if prompt_ids.dim() != 2 or completion_ids.dim() != 2 or prompt_ids.shape[0] != completion_ids.shape[0]:
        raise ValueError(
            f"expected prompt_ids [B, P] and completion_ids [B, L]; got {tuple(prompt_ids.shape)} and "
            f"{tuple(completion_ids.shape)}"
        )
    if completion_mask.shape != completion_ids.shape:
        raise ValueError(
            f"completion_mask {tuple(completion_mask.shape)} must match completion_ids {tuple(completion_ids.shape)}"
        )
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    return completion_mask.to(device=completion_ids.device).bool()


def _num_tokens(real: Tensor) -> Tensor:
    return real.sum(dim=-1).to(torch.float32)


def _with_tail(masked: Tensor, real: Tensor) -> Tensor:
    """``masked`` with every tail position (``completion_mask`` 0, after the first EOS) masked as well.

    Shapes:
        masked ``bool [N, B, L]``, real ``bool [B, L]`` → ``bool [N, B, L]``.
    """
    return masked | ~real.unsqueeze(0)


# ---------------------------------------------------------------------- plans
def one_step_plan(
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    num_samples: int = 1,
    generator: torch.Generator | None = None,
    p_mask_prompt: float = 0.0,
) -> MaskPlan:
    """d1's mean-field plan: every completion position masked (the tail too), every real token scored with weight 1.

    With ``p_mask_prompt > 0`` each prompt position is masked independently in each of the ``num_samples`` draws
    and the estimate averages them; with ``p_mask_prompt == 0`` all draws would be identical, so one is made.
    """
    real = _check(prompt_ids, completion_ids, completion_mask, num_samples)
    device = completion_ids.device
    num = num_samples if p_mask_prompt > 0 else 1
    prompt_masked = _prompt_masks(num, prompt_ids, p_mask_prompt, generator, device)
    scored = real.unsqueeze(0).expand(num, -1, -1)
    masked = torch.ones_like(scored)  # every completion position, the tail included (d1)
    return MaskPlan(masked, scored.to(torch.float32), _num_tokens(real), prompt_masked, name="one_step")


def elbo_t_plan(
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    num_samples: int,
    generator: torch.Generator | None = None,
    eps: float = 1e-3,
) -> MaskPlan:
    """t-sampling: ``t = (1−ε)u + ε``, each real token masked w.p. ``t``, masked tokens weighted ``1/t``."""
    real = _check(prompt_ids, completion_ids, completion_mask, num_samples)
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    device = completion_ids.device
    n, (b, length) = num_samples, completion_ids.shape
    t = (1.0 - eps) * uniform((n, b), generator, device, batch_axis=1) + eps  # [N, B]
    r = uniform((n, b, length), generator, device, batch_axis=1)  # [N, B, L]
    masked = (r < t.unsqueeze(-1)) & real
    # t == 0 (u == 0 with eps == 0) masks nothing, so its weight is never used.
    weights = torch.where(masked, 1.0 / t.clamp_min(1e-300).unsqueeze(-1), 0.0).to(torch.float32)
    return MaskPlan(_with_tail(masked, real), weights, _num_tokens(real), name="elbo_t")


def _counts(real_count: Tensor, num: int, stratified: bool, generator, device) -> Tensor:
    """``[num, B]`` mask counts uniform on ``{1..L_b}``, stratified or iid."""
    if stratified:
        return stratified_counts(uniform((real_count.shape[0],), generator, device), real_count, num)
    return uniform_count(uniform((num, real_count.shape[0]), generator, device, batch_axis=1),
                         real_count.unsqueeze(0))


def elbo_l_plan(
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    num_samples: int,
    generator: torch.Generator | None = None,
    stratified: bool = True,
) -> MaskPlan:
    """l-sampling: ``l ~ U{1..L_b}`` (stratified or iid), exactly ``l`` random real tokens masked, weight ``L_b/l``."""
    real = _check(prompt_ids, completion_ids, completion_mask, num_samples)
    device = completion_ids.device
    n, (b, length) = num_samples, completion_ids.shape
    real_count = real.sum(dim=-1)  # [B]
    counts = _counts(real_count, n, stratified, generator, device)  # [N, B]
    keys = uniform((n, b, length), generator, device, batch_axis=1)
    masked = random_subset(real.unsqueeze(0).expand(n, -1, -1), counts, keys)
    scale = real_count.unsqueeze(0).to(torch.float64) / counts.clamp(min=1).to(torch.float64)  # L_b / l
    weights = torch.where(masked, scale.unsqueeze(-1), 0.0).to(torch.float32)
    return MaskPlan(_with_tail(masked, real), weights, _num_tokens(real), name="elbo_l")


def coupled_plan(
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    num_samples: int,
    generator: torch.Generator | None = None,
    stratified: bool = True,
) -> MaskPlan:
    """Complementary pairs: a uniform ``m``-subset ``S`` and its complement ``S^c`` among the real tokens.

    ``num_samples`` counts forward rows and must be even (``num_samples // 2`` pairs). Rows ``0..N/2−1`` hold the
    sets ``S``, rows ``N/2..N−1`` their complements. Row weights (see :func:`~mmrl.plugins.dllm.estimators.coupled`
    for the derivation): ``L_b/|S|`` for ``S`` (``2`` when ``S`` is everything), ``L_b/|S^c|`` for ``S^c``.
    """
    real = _check(prompt_ids, completion_ids, completion_mask, num_samples)
    if num_samples % 2:
        raise ValueError(f"the coupled estimator needs an even num_samples (pairs of forwards), got {num_samples}")
    device = completion_ids.device
    pairs, (b, length) = num_samples // 2, completion_ids.shape
    real_count = real.sum(dim=-1)  # [B]
    counts = _counts(real_count, pairs, stratified, generator, device)  # [N/2, B], m in 1..L_b
    keys = uniform((pairs, b, length), generator, device, batch_axis=1)
    first = random_subset(real.unsqueeze(0).expand(pairs, -1, -1), counts, keys)  # S
    second = real.unsqueeze(0) & ~first  # S^c
    total = real_count.unsqueeze(0).to(torch.float64)  # [1, B]
    m = counts.to(torch.float64)
    w_first = torch.where(counts == real_count.unsqueeze(0), 2.0, total / m.clamp(min=1))  # [N/2, B]
    w_second = total / (total - m).clamp(min=1)  # unused when S^c is empty
    masked = torch.cat([first, second], dim=0)
    weights = torch.cat(
        [torch.where(first, w_first.unsqueeze(-1), 0.0), torch.where(second, w_second.unsqueeze(-1), 0.0)], dim=0
    ).to(torch.float32)
    return MaskPlan(_with_tail(masked, real), weights, _num_tokens(real), name="coupled")


def espo_plan(
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    num_samples: int,
    generator: torch.Generator | None = None,
    coupled: bool = True,
    stratified: bool = False,
) -> MaskPlan:
    """ESPO's plan: a mask count ``x ~ U{0..L_b}`` (``L_b + 1`` values, ``0`` and ``L_b`` included), a uniform
    ``x``-subset ``S`` of the real tokens weighted ``(L_b+1)/x`` and, with ``coupled``, its complement ``S^c``
    weighted ``(L_b+1)/(L_b−x)``.

    ``coupled=True`` (ESPO's ``reduce_var``): ``num_samples`` counts forward rows and must be even; rows
    ``0..N/2−1`` hold the sets ``S``, rows ``N/2..N−1`` their complements, and :meth:`MaskPlan.reduce`'s mean over the
    ``N`` rows is ESPO's ``½·(pair)`` averaged over its ``num_mc = N/2`` draws. ``coupled=False``: ``N`` rows of sets
    ``S``. An empty row (``x = 0`` for ``S``, ``x = L_b`` for ``S^c``) scores nothing and is not forwarded (ESPO runs
    it and adds nothing). ``stratified`` spreads the ``x`` of a sample's draws evenly over ``0..L_b``
    (:func:`stratified_counts` on ``1..L_b+1``, minus one); ESPO draws each MC sample's offset from its own seed
    (iid, the default here). See :func:`~mmrl.plugins.dllm.estimators.espo` for the source and the derivation.
    """
    real = _check(prompt_ids, completion_ids, completion_mask, num_samples)
    if coupled and num_samples % 2:
        raise ValueError(f"the espo estimator with coupled: true needs an even num_samples (pairs of forwards), "
                         f"got {num_samples}")
    device = completion_ids.device
    draws, (b, length) = (num_samples // 2 if coupled else num_samples), completion_ids.shape
    real_count = real.sum(dim=-1)  # [B]
    outcomes = real_count + 1  # x takes L_b + 1 values
    if stratified:
        counts = stratified_counts(uniform((b,), generator, device), outcomes, draws) - 1  # [D, B] in 0..L_b
    else:
        u = uniform((draws, b), generator, device, batch_axis=1)  # [D, B]
        counts = torch.minimum(torch.floor(u * outcomes.to(torch.float64)).long(), real_count.unsqueeze(0))
    keys = uniform((draws, b, length), generator, device, batch_axis=1)
    first = random_subset(real.unsqueeze(0).expand(draws, -1, -1), counts, keys)  # S: [D, B, L]
    scale = outcomes.unsqueeze(0).to(torch.float64)  # [1, B]: L_b + 1
    w_first = scale / counts.clamp(min=1).to(torch.float64)  # (L+1)/x; unused when S is empty
    masked, weights = [first], [torch.where(first, w_first.unsqueeze(-1), 0.0)]
    if coupled:
        second = real.unsqueeze(0) & ~first  # S^c
        w_second = scale / (real_count.unsqueeze(0) - counts).clamp(min=1).to(torch.float64)  # (L+1)/(L−x)
        masked.append(second)
        weights.append(torch.where(second, w_second.unsqueeze(-1), 0.0))
    return MaskPlan(_with_tail(torch.cat(masked, dim=0), real), torch.cat(weights, dim=0).to(torch.float32),
                    _num_tokens(real), name="espo")


def coupled_cv_plan(
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    num_samples: int,
    generator: torch.Generator | None = None,
    stratified: bool = True,
    control: float = 1.0,
) -> MaskPlan:
    """A fully masked row (one_step's forward) plus complementary pairs over the counts ``1..L_b−1``, with the fully
    masked row's per-token log-probs as a control variate of weight ``control`` (β).

    Row 0 masks every real token. The ``R = N − 1`` other rows ("D rows") come in pairs ``(S, S^c)`` with
    ``|S| = m ∈ {1..L_b−1}`` (stratified across pairs like :func:`stratified_counts`, each ``m`` marginally
    uniform) and, when ``R`` is odd, one more row of uniform size in ``1..L_b−1``; every D row's set is uniform given
    its size. D row weight: ``(L_b−1)/(|S|·R)`` (``1/(l·Q(l))`` with ``Q(l) = R/(L_b−1)`` the expected number of D
    rows of size ``l``). Row 0 weight of token ``i``: ``1/L_b + β·(L_b−1)/L_b − β·W_i``, ``W_i`` the total D-row weight
    on token ``i``. Stored weights are ``N×`` these, since :meth:`MaskPlan.reduce` averages over the ``N`` rows.
    See :func:`~mmrl.plugins.dllm.estimators.coupled_cv` for the derivation. ``L_b = 1``: row 0 alone is exact.
    """
    real = _check(prompt_ids, completion_ids, completion_mask, num_samples)
    if num_samples < 2:
        raise ValueError(f"the coupled_cv estimator needs num_samples >= 2 (a fully masked row and at least one "
                         f"partly masked row), got {num_samples}")
    if not math.isfinite(control):
        raise ValueError(f"control must be a finite number, got {control}")
    device = completion_ids.device
    n, (b, length) = num_samples, completion_ids.shape
    rows = n - 1  # D rows
    pairs, odd = rows // 2, rows % 2
    real_count = real.sum(dim=-1)  # [B]
    high = (real_count - 1).clamp(min=0)  # sizes 1..L_b−1 (none when L_b = 1)
    eligible = real.unsqueeze(0)
    sets = []
    if pairs:
        counts = _counts(high, pairs, stratified, generator, device)  # [P, B], 0 where L_b = 1
        keys = uniform((pairs, b, length), generator, device, batch_axis=1)
        first = random_subset(eligible.expand(pairs, -1, -1), counts, keys)
        second = eligible & ~first & (counts > 0).unsqueeze(-1)  # S^c (nothing when L_b = 1)
        sets += [first, second]
    if odd:
        count = uniform_count(uniform((1, b), generator, device, batch_axis=1), high.unsqueeze(0))  # [1, B]
        sets.append(random_subset(eligible, count, uniform((1, b, length), generator, device, batch_axis=1)))
    d_masked = torch.cat(sets, dim=0)  # [R, B, L]
    sizes = d_masked.sum(dim=-1).to(torch.float64)  # [R, B]
    d_weight = torch.where(sizes > 0, high.to(torch.float64) / (sizes.clamp(min=1) * rows), 0.0)  # (L−1)/(l·R)
    d_weights = torch.where(d_masked, d_weight.unsqueeze(-1), 0.0)  # [R, B, L]
    total = real_count.to(torch.float64).clamp(min=1).unsqueeze(-1)  # [B, 1]
    covered = d_weights.sum(dim=0)  # [B, L]: W_i
    full_weight = torch.where(real, 1.0 / total + control * (total - 1.0) / total - control * covered, 0.0)
    masked = torch.cat([torch.ones_like(eligible), d_masked], dim=0)  # row 0: every position
    weights = (n * torch.cat([full_weight.unsqueeze(0), d_weights], dim=0)).to(torch.float32)
    return MaskPlan(_with_tail(masked, real), weights, _num_tokens(real), name="coupled_cv")


def block_plan(
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    num_samples: int,
    generator: torch.Generator | None = None,
    block_length: int = 32,
    p_mask_prompt: float = 0.0,
) -> MaskPlan:
    """SPG's block-wise masking (the semi-autoregressive decoding state).

    Completion position ``j`` belongs to block ``j // block_length``. Per sample, the ``K_b`` blocks that hold real
    tokens are visited in a random order (draw ``n`` takes the ``(n mod K_b)``-th, so each draw's block is
    marginally uniform); in the chosen block ``k`` with ``n_k`` real tokens, ``l ~ U{1..n_k}`` random real tokens are
    masked and scored with weight ``K_b · n_k / l``; real tokens of later blocks are masked (not scored), earlier
    blocks stay clean. Prompt positions are masked w.p. ``p_mask_prompt``.
    """
    real = _check(prompt_ids, completion_ids, completion_mask, num_samples)
    if isinstance(block_length, bool) or not isinstance(block_length, int) or block_length < 1:
        raise ValueError(f"block_length must be a positive int, got {block_length!r}")
    device = completion_ids.device
    n, (b, length) = num_samples, completion_ids.shape
    num_blocks = -(-length // block_length)
    block_of = torch.arange(length, device=device) // block_length  # [L]
    one_hot = block_of.unsqueeze(0) == torch.arange(num_blocks, device=device).unsqueeze(1)  # [K, L]
    per_block = (real.unsqueeze(1) & one_hot.unsqueeze(0)).sum(dim=-1)  # [B, K] real tokens per block
    has_tokens = per_block > 0
    num_valid = has_tokens.sum(dim=-1)  # [B]
    order = torch.where(has_tokens, uniform((b, num_blocks), generator, device), 2.0).argsort(dim=-1)  # [B, K]
    pick = torch.remainder(torch.arange(n, device=device).unsqueeze(1), num_valid.clamp(min=1))  # [N, B]
    chosen = order.gather(1, pick.t()).t()  # [N, B]
    in_block = (block_of.view(1, 1, -1) == chosen.unsqueeze(-1)) & real  # [N, B, L]
    later = (block_of.view(1, 1, -1) > chosen.unsqueeze(-1)) & real
    block_count = in_block.sum(dim=-1)  # [N, B]
    counts = uniform_count(uniform((n, b), generator, device, batch_axis=1), block_count)
    scored = random_subset(in_block, counts, uniform((n, b, length), generator, device, batch_axis=1))
    scale = (
        num_valid.unsqueeze(0).to(torch.float64)
        * block_count.to(torch.float64)
        / counts.clamp(min=1).to(torch.float64)
    )
    weights = torch.where(scored, scale.unsqueeze(-1), 0.0).to(torch.float32)
    prompt_masked = _prompt_masks(n, prompt_ids, p_mask_prompt, generator, device)
    return MaskPlan(_with_tail(scored | later, real), weights, _num_tokens(real), prompt_masked, name="block")


def spg_plan(
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    num_samples: int,
    generator: torch.Generator | None = None,
    bound: str = "lower",
    masking: str = "random",
    block_length: int = 32,
    p_mask_prompt: float = 0.0,
    stratified: bool = False,
    beta: float = 1.5,
) -> MaskPlan:
    """SPG's plans: ``masking="random"`` (l-sampling, as SPG's ``forward_type=random``) or ``"block"``
    (``block_random``); ``bound="lower"`` gives the linear ELBO reduction, ``"upper"`` the EUBO with order ``beta``.
    """
    if masking == "random":
        plan = elbo_l_plan(
            prompt_ids, completion_ids, completion_mask, num_samples=num_samples, generator=generator,
            stratified=stratified,
        )
        prompt_masked = _prompt_masks(num_samples, prompt_ids, p_mask_prompt, generator, completion_ids.device)
    elif masking == "block":
        plan = block_plan(
            prompt_ids, completion_ids, completion_mask, num_samples=num_samples, generator=generator,
            block_length=block_length, p_mask_prompt=p_mask_prompt,
        )
        prompt_masked = plan.prompt_masked
    else:
        raise ValueError(f"masking must be 'random' or 'block', got {masking!r}")
    if bound not in ("lower", "upper"):
        raise ValueError(f"bound must be 'lower' or 'upper', got {bound!r}")
    return MaskPlan(
        plan.completion_masked,
        plan.weights,
        plan.num_tokens,
        prompt_masked,
        reduction="elbo" if bound == "lower" else "eubo",
        beta=float(beta),
        name=f"spg_{bound}",
    )


# ---------------------------------------------------------------------- TraceRL: the decoding trajectory's plan
TRACE_TAILS = ("masked", "trajectory")


def trace_groups(step_map: Tensor, shrink: int) -> Tensor:
    """The step group of every completion position: TraceRL's merging of ``shrink`` consecutive distinct steps.

    Per sample, the distinct values of its step map (every completion position, the tail after the first stop token
    included, as TraceRL's ``collapse_k_unique`` sees the whole decoded response) are ranked in increasing order and
    rank ``r`` belongs to group ``r // shrink``. TraceRL (Gen-Verse/dLLM-RL@10b4fd1 ``train/rl_llada.py`` L203-215)
    maps each step to the last distinct step of its group and compares those representatives; comparing group
    indices is the same order.

    Shapes:
        step_map ``[B, L]`` integer → ``[B, L]`` long, 0-based group indices.
    """
    if step_map.dim() != 2 or step_map.dtype.is_floating_point or step_map.dtype == torch.bool:
        raise ValueError(f"step_map must be an integer tensor [B, L], got {step_map.dtype} {tuple(step_map.shape)}")
    if isinstance(shrink, bool) or not isinstance(shrink, int) or shrink < 1:
        raise ValueError(f"shrink must be a positive int (distinct decoding steps merged per group), got {shrink!r}")
    steps = step_map.long()
    ordered, order = steps.sort(dim=-1)  # [B, L]
    fresh = torch.ones_like(ordered, dtype=torch.bool)
    fresh[:, 1:] = ordered[:, 1:] != ordered[:, :-1]  # first occurrence of each distinct step
    rank_sorted = fresh.long().cumsum(dim=-1) - 1  # [B, L] rank of each sorted entry's step
    rank = torch.empty_like(rank_sorted).scatter_(1, order, rank_sorted)
    return torch.div(rank, shrink, rounding_mode="floor")


def trace_plan(
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    step_map: Tensor,
    shrink: int = 8,
    tail: str = "masked",
) -> MaskPlan:
    """TraceRL's trajectory plan: one row per step group holding real tokens, the tokens of that group scored in the
    context in which the sampler decoded them (up to the ``shrink`` merging).

    Wang et al. 2025, "Revolutionizing Reinforcement Learning Framework for Diffusion Large Language Models"
    (TraceRL), arXiv:2509.06949; Gen-Verse/dLLM-RL@10b4fd1 ``train/rl_llada.py`` L248-292: for every distinct group
    ``g`` of a response, the row masks every response position whose group is ``>= g`` (``mask_pos = order_full >=
    step_val``) and scores the positions of group ``g`` (``tgt_mask = order_full == step_val``); the prompt is never
    masked nor scored; rows that score nothing are dropped. With ``shrink = 1`` the row is exactly the sampler's state
    before the group's step (positions committed at earlier steps visible, every later one masked, later blocks
    included), so the semi-autoregressive blocks need no rule of their own: they are in the step map.

    Row ``n`` of sample ``b`` is its ``n``-th group (in decoding order) that holds a real token; samples with fewer
    groups have empty rows (weight 0: never forwarded). Scored tokens carry weight ``N`` (the plan's rows) so that
    :meth:`MaskPlan.reduce`, which averages over rows, returns ``Σ_i log p(x^i | context of its group)``.

    The tail after the first stop token (``completion_mask`` 0) is never scored. ``tail="masked"`` (the plugin's
    convention for every estimator, docs/dllm.md section 1.1) also masks it in every row; ``tail="trajectory"``
    keeps it as decoded, visible in the rows of later groups than its own, as TraceRL does (it never masks a decoded
    pad, and ``post_num: 0`` only keeps the pad id out of the scored set, L265-276).

    Args:
        step_map: ``[B, L]`` the decoding step at which each completion position was committed (the sampler's
            ``step_map``); every real position must have a step ``>= 0``.
        shrink: Distinct decoding steps merged into one group (TraceRL: 8).
        tail: ``"masked"`` or ``"trajectory"``.

    Shapes:
        prompt_ids ``[B, P]``, completion_ids, completion_mask and step_map ``[B, L]`` → a plan with ``N`` rows, the
        largest number of groups holding real tokens in one sample (at least 1).
    """
    real = _check(prompt_ids, completion_ids, completion_mask, 1)
    if tail not in TRACE_TAILS:
        raise ValueError(f"tail must be one of {TRACE_TAILS}, got {tail!r}")
    if not isinstance(step_map, Tensor) or tuple(step_map.shape) != tuple(completion_ids.shape):
        shape = tuple(step_map.shape) if isinstance(step_map, Tensor) else type(step_map).__name__
        raise ValueError(f"step_map must be [B, L] = {tuple(completion_ids.shape)} like completion_ids, got {shape}")
    step_map = step_map.to(completion_ids.device)
    group = trace_groups(step_map, shrink)  # [B, L]
    undecoded = real & (step_map < 0)
    if bool(undecoded.any()):
        b, i = undecoded.nonzero()[0].tolist()
        raise ValueError(f"step_map has no decoding step (got {int(step_map[b, i])}) at real completion position {i} "
                         f"of sample {b}; the trace estimator needs the step of every real token")
    b, length = completion_ids.shape
    top = int(group.max()) + 1 if group.numel() else 1  # groups 0..top-1 (an empty batch: one empty row)
    present = torch.zeros(b, top + 1, dtype=torch.bool, device=group.device)
    present.scatter_(1, torch.where(real, group, top), True)  # [B, top+1]: groups holding a real token
    present = present[:, :top]
    rows = max(int(present.sum(dim=-1).max()) if b else 0, 1)
    candidates = torch.arange(top, device=group.device).expand(b, -1)
    row_group = torch.where(present, candidates, top).sort(dim=-1).values[:, :rows]  # [B, N]; top: an empty row
    row_group = row_group.t().unsqueeze(-1)  # [N, B, 1]
    masked = group.unsqueeze(0) >= row_group  # [N, B, L]: this group and every later one
    scored = (group.unsqueeze(0) == row_group) & real.unsqueeze(0)
    if tail == "masked":
        masked = _with_tail(masked, real)
    weights = torch.where(scored, float(rows), 0.0).to(torch.float32)
    return MaskPlan(masked, weights, _num_tokens(real), name="trace")


# ---------------------------------------------------------------------- UniGRPO / dLLM-RL: random masking
def random_masking_plan(
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    num_samples: int,
    generator: torch.Generator | SampleStreams | None = None,
    t_low: float = 0.1,
    t_high: float = 0.9,
    coupled: bool = False,
) -> MaskPlan:
    """UniGRPO's random masking as released in dLLM-RL: per draw ``t ~ U(t_low, t_high)``, each real token masked
    w.p. ``t``, the masked tokens scored with no importance weight. A token's weight is ``N / c_i`` in each of the
    ``c_i`` rows that mask it, so that :meth:`MaskPlan.reduce`'s mean over the ``N`` rows gives every token the
    average of its log-probs over those rows; a token masked in no row is not scored.

    Gen-Verse/dLLM-RL@10b4fd1 ``train/rl_llada.py`` L301-345 (``method == "random_masking"``): per sample and each of
    ``mask_times_per_sample`` draws, ``t = (upper − lower)·rand + lower``, ``rand_mask = rand(L) < t`` with the
    prompt cleared (L321-325) and the pads after the first ``post_num`` left out and masked (L325, L332); a draw that
    masks nothing is dropped (L327-328). ``num_samples`` is ``mask_times_per_sample``. With ``coupled`` (its
    ``method == "coupled"``, L347-399): each draw is a pair of rows, the Bernoulli(t) set ``S`` and its complement
    ``S^c`` among the real tokens (rows ``0..N/2−1`` the sets, ``N/2..N−1`` their complements; ``N`` must be even,
    ``N/2`` is ``mask_times_per_sample``), so every real token is masked in exactly one row of each pair. See
    :func:`~mmrl.plugins.dllm.estimators.random_masking` for how the rows map onto token columns.

    Shapes:
        → a plan with ``N`` rows; ``weights[n, b, i] = N / c_{b,i}`` where row ``n`` masks real token ``i``.
    """
    real = _check(prompt_ids, completion_ids, completion_mask, num_samples)
    if not (0.0 < t_low <= 1.0 and 0.0 < t_high <= 1.0 and t_low <= t_high):
        raise ValueError(f"t_low and t_high must satisfy 0 < t_low <= t_high <= 1, got t_low={t_low}, "
                         f"t_high={t_high}")
    if coupled and num_samples % 2:
        raise ValueError(f"the random_masking estimator with coupled: true needs an even num_samples (pairs of "
                         f"complementary rows), got {num_samples}")
    device = completion_ids.device
    n, (b, length) = num_samples, completion_ids.shape
    draws = n // 2 if coupled else n
    t = (t_high - t_low) * uniform((draws, b), generator, device, batch_axis=1) + t_low  # [D, B]
    r = uniform((draws, b, length), generator, device, batch_axis=1)  # [D, B, L]
    masked = (r < t.unsqueeze(-1)) & real  # [D, B, L]
    if coupled:
        masked = torch.cat([masked, real.unsqueeze(0) & ~masked], dim=0)  # [N, B, L]: S, then S^c
    rows = masked.sum(dim=0, keepdim=True).to(torch.float64)  # [1, B, L]: c_i, the rows that mask token i
    weights = torch.where(masked, n / rows.clamp(min=1.0), 0.0).to(torch.float32)
    return MaskPlan(_with_tail(masked, real), weights, _num_tokens(real), name="random_masking")


# ---------------------------------------------------------------------- GDPO: semi-deterministic Monte Carlo
SDMC_QUADRATURES = ("gauss-1", "gauss-2", "gauss-3", "gauss-4", "gauss-5", "simpson")
SDMC_MASKINGS = ("count", "bernoulli")
# GDPO's Simpson rule on [0, 1] with its first node moved from 0 (where 1/t is singular) to 0.1.
_SIMPSON = ((0.1, 0.5, 1.0), (1 / 6, 4 / 6, 1 / 6))


def sdmc_quadrature(rule: str) -> tuple[Tensor, Tensor]:
    """The nodes ``t_j`` and weights ``w_j`` of a quadrature rule for ``∫_0^1 f(t) dt ≈ Σ_j w_j f(t_j)``.

    ``gauss-n``: the ``n``-point Gauss-Legendre rule, computed by the Golub-Welsch method (the nodes on [−1, 1] are
    the eigenvalues of the Jacobi matrix of the Legendre recurrence, off-diagonal ``k / sqrt(4k² − 1)``; the weights
    ``2·v_0²`` from the first components of its unit eigenvectors), then mapped onto [0, 1] by ``t = (x + 1)/2``,
    ``w = w_x / 2`` (GDPO's ``xi = point * .5 + .5`` and ``.5 * loss``). Exact for polynomials of degree
    ``<= 2n − 1``. ``simpson``: GDPO's ``(0.1, 0.5, 1.0)`` with weights ``(1, 4, 1)/6``, not exact even for a line.

    Shapes:
        → ``float64 [J]`` nodes (increasing) and ``float64 [J]`` weights (summing to 1).
    """
    if rule == "simpson":
        return torch.tensor(_SIMPSON[0], dtype=torch.float64), torch.tensor(_SIMPSON[1], dtype=torch.float64)
    if rule not in SDMC_QUADRATURES:
        raise ValueError(f"quadrature must be one of {', '.join(SDMC_QUADRATURES)}, got {rule!r}")
    points = int(rule.split("-")[1])
    k = torch.arange(1, points, dtype=torch.float64)
    off = k / torch.sqrt(4.0 * k * k - 1.0)  # [J−1]
    jacobi = torch.diag(off, 1) + torch.diag(off, -1)  # [J, J]
    nodes, vectors = torch.linalg.eigh(jacobi)  # ascending eigenvalues
    weights = 2.0 * vectors[0] ** 2
    return (nodes + 1.0) / 2.0, weights / 2.0


def sdmc_plan(
    prompt_ids: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    num_samples: int,
    generator: torch.Generator | SampleStreams | None = None,
    quadrature: str = "gauss-2",
    masking: str = "count",
) -> MaskPlan:
    """GDPO's semi-deterministic Monte Carlo: the ELBO's integral over ``t`` by a fixed quadrature rule, the masks at
    each node drawn at random, ``d = N / J`` draws at each of the ``J`` nodes.

    Rows ``j·d .. (j+1)·d − 1`` belong to node ``j`` (nodes in increasing order). ``masking="count"`` (GDPO's
    reference code, NVIDIA-NeMo/RL ``SdmcElboEstimator``): exactly ``k_j = min(L_b, max(1, ⌊t_j·L_b⌋))`` real tokens,
    a uniform ``k_j``-subset; ``masking="bernoulli"`` (the ELBO's own forward process): each real token w.p. ``t_j``.
    Masked real tokens carry the weight ``N·w_j / (d·t_j)``, so that :meth:`MaskPlan.reduce` (the mean over the N rows)
    is ``Σ_j (w_j / t_j)·(1/d)·Σ_{rows of j} g(S)``. See :func:`~mmrl.plugins.dllm.estimators.sdmc`.
    """
    real = _check(prompt_ids, completion_ids, completion_mask, num_samples)
    if masking not in SDMC_MASKINGS:
        raise ValueError(f"masking must be one of {', '.join(SDMC_MASKINGS)}, got {masking!r}")
    nodes, node_weights = sdmc_quadrature(quadrature)  # [J], [J]
    points = nodes.shape[0]
    if num_samples % points:
        raise ValueError(f"the sdmc estimator with quadrature {quadrature} needs num_samples a multiple of its "
                         f"{points} nodes (the same number of mask draws at every node), got {num_samples}")
    device = completion_ids.device
    n, (b, length), per_node = num_samples, completion_ids.shape, num_samples // points
    t = nodes.to(device).repeat_interleave(per_node).view(n, 1, 1)  # [N, 1, 1]: each row's node
    scale = (n * node_weights.to(device) / (per_node * nodes.to(device))).repeat_interleave(per_node)  # [N]
    keys = uniform((n, b, length), generator, device, batch_axis=1)  # [N, B, L]
    eligible = real.unsqueeze(0).expand(n, -1, -1)
    if masking == "bernoulli":
        masked = (keys < t) & eligible
    else:
        real_count = real.sum(dim=-1).unsqueeze(0)  # [1, B]
        counts = torch.floor(t.view(n, 1) * real_count.to(torch.float64)).long().clamp(min=1)  # [N, B]
        masked = random_subset(eligible, torch.minimum(counts, real_count), keys)
    weights = torch.where(masked, scale.view(n, 1, 1), 0.0).to(torch.float32)
    return MaskPlan(_with_tail(masked, real), weights, _num_tokens(real), name="sdmc")
