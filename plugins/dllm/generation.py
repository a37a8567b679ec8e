"""LLaDA-style semi-autoregressive block decoding for masked diffusion language models.

The completion starts as ``gen_length`` mask tokens after the prompt and is cut into ``gen_length / block_length``
blocks decoded left to right, each in ``steps / num_blocks`` steps (Nie et al. 2025, "Large Language Diffusion
Models", arXiv:2502.09992, semi-autoregressive remasking; the procedure of LLaDA's ``generate.py`` that d1, wd1 and
SPG use for rollouts). One step:

1. ``logits = model(x)`` for the whole sequence (optionally classifier-free guidance: a second pass with the prompt
   masked, ``logits = un + (s + 1)·(cond − un)``);
2. a candidate token for every position of the current block: ``x̂ = argmax(l + τ·g)`` with ``g ~ Gumbel(0, 1)``
   drawn in float64 — a sample from ``softmax(l/τ)``; ``τ = 0`` is greedy. LLaDA writes the same rule as
   ``argmax(exp(l) / (−log u)^τ)`` with ``u ~ U(0, 1)``: its log is ``l − τ·log(−log u) = l + τ·g`` for
   ``g = −log(−log u)``, and the log is increasing, so both pick the same token for the same ``u``. Float64 follows
   Zheng et al. 2024 (arXiv:2409.02908): lower-precision Gumbel-max lowers the effective temperature;
3. a confidence per position: ``low_confidence`` = ``softmax(l)[x̂]`` (temperature-free), ``random`` = ``U(0, 1)``;
   positions already committed and positions outside the current block get ``−∞``;
4. the ``k`` most confident masked positions of the block are committed (ties go to the leftmost position). With
   ``n`` masked positions in the block and ``S'`` steps per block, step ``j`` commits ``⌊n/S'⌋`` tokens, plus one for
   the first ``n mod S'`` steps (the linear schedule's constant expected number per step). Committed tokens are
   never remasked. The mask token itself is never a candidate (its logit is set to −∞), so a committed position
   always holds a real token.

Two options of LLaDA's ``generate`` (ML-GSAI/LLaDA@b7e6c35 ``generate.py`` L45, L91-98; its docstring points to
Appendix B.4 of the paper; LLaDA's ``EVAL.md`` turns them on per benchmark), reproduced as that code runs, not as its
docstring words them:

- ``logits_eos_inf``: the EOS logit is set to −∞ in step 2 (after guidance), so EOS is never a candidate, and the
  confidence softmax of step 3 is taken without it (LLaDA writes −∞ into ``logits`` in place, which both read).
- ``confidence_eos_eot_inf``: the docstring says "the confidence of EOS and EoT set to −∞"; the code is
  ``logits_with_noise[:, :, EOS] = logits[:, :, EoT] = -inf`` after the candidates are drawn, and the confidence is
  ``softmax(logits)[x̂]``. For ``τ > 0`` ``logits_with_noise`` is a new float64 tensor that is not read again, so
  only the EoT column of the confidence softmax becomes −∞: an EoT candidate's confidence is 0 and every other
  candidate's is renormalised without EoT (``p/(1 − p_EoT)``; an EOS candidate keeps a positive confidence). For
  ``τ = 0`` LLaDA's ``add_gumbel_noise`` returns ``logits`` itself, so both columns become −∞ there: EOS and EoT
  candidates both get confidence 0. A confidence of 0 (not −∞) still ranks above committed positions and positions
  outside the block, so those candidates are committed last within the block, when the step's quota leaves nothing
  else. With ``random`` remasking the option changes nothing. Reproducing the code, quirk included, keeps what
  LLaDA's reported evaluations ran (greedy: both tokens deferred; sampled: EoT only); a literal −∞ would tie those
  candidates with the committed positions (and, in LLaDA's ``topk``, those outside the block), so a step's quota
  could fall on positions that take no token.

Every random number of sample ``b`` comes from its own ``torch.Generator`` (drawn in float64 on the generator's
device), so a sample does not depend on the batch it is decoded in. :class:`GenerationOutput` records the step at
which each position was committed (``step_map``, as TraceRL records it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.plugins.dllm.masking import SampleStreams

REMASKING = ("low_confidence", "random")


@dataclass
class GenerationOutput:
    """Decoded completions.

    Attributes:
        completion_ids: ``[B, G]`` long, every position committed.
        step_map: ``[B, G]`` long, the global step (0-based, ``block·steps_per_block + j``) at which each position
            went from mask to token.
        steps_per_block: Steps spent on each block.
    """

    completion_ids: Tensor
    step_map: Tensor
    steps_per_block: int


def transfer_schedule(num_masked: Tensor, steps: int) -> Tensor:
    """Tokens committed at each of ``steps`` steps for blocks with ``num_masked`` masked positions.

    ``⌊n/S⌋`` per step and one more for the first ``n mod S`` steps, so the row sums to ``n``.

    Shapes:
        num_masked ``[B]`` → ``[B, steps]`` long.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    n = num_masked.long().unsqueeze(1)  # [B, 1]
    extra = torch.arange(steps, device=n.device).unsqueeze(0) < torch.remainder(n, steps)  # [B, S]
    return torch.div(n, steps, rounding_mode="floor") + extra.long()


def check_schedule(gen_length: int, block_length: int, steps: int) -> int:
    """Validate the decoding geometry and return the steps per block."""
    for name, value in (("gen_length", gen_length), ("block_length", block_length), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if gen_length % block_length:
        raise ValueError(f"gen_length ({gen_length}) must be a multiple of block_length ({block_length})")
    num_blocks = gen_length // block_length
    if steps % num_blocks:
        raise ValueError(f"steps ({steps}) must be a multiple of the number of blocks ({num_blocks} = gen_length / "
                         f"block_length)")
    return steps // num_blocks


def _per_sample_uniform(shape: tuple[int, ...], generators: Sequence[torch.Generator] | SampleStreams | None,
                        batch: int, device: torch.device) -> Tensor:
    """``[B, *shape]`` float64 uniforms, row ``b`` from ``generators[b]`` (the global RNG when None; with
    :class:`SampleStreams`, the next values of stream ``b``: the same numbers, read ahead in blocks)."""
    if generators is None:
        return torch.rand((batch, *shape), dtype=torch.float64, device=device)
    if isinstance(generators, SampleStreams):
        return generators.take((batch, *shape), 0).to(device)
    rows = [torch.rand(shape, generator=g, dtype=torch.float64, device=g.device) for g in generators]
    return torch.stack(rows).to(device)


def gumbel_argmax(logits: Tensor, temperature: float, uniforms: Tensor | None) -> Tensor:
    """``argmax(l + τ·g)``, ``g = −log(−log u)``, in float64; ``τ = 0`` (or no noise) is ``argmax(l)``.

    Shapes:
        logits ``[..., V]``, uniforms ``[..., V]`` → ``[...]`` long.
    """
    scores = logits.to(torch.float64)
    if temperature > 0:
        if uniforms is None:
            raise ValueError("sampling with temperature > 0 needs uniforms")
        scores = scores - temperature * torch.log(-torch.log(uniforms))
    return scores.argmax(dim=-1)


@torch.no_grad()
def generate(
    model: Callable[[Tensor], Tensor],
    prompt_ids: Tensor,
    *,
    mask_id: int,
    gen_length: int,
    block_length: int,
    steps: int,
    temperature: float = 0.0,
    remasking: str = "low_confidence",
    generators: Sequence[torch.Generator] | None = None,
    cfg_scale: float = 0.0,
    prompt_mask: Tensor | None = None,
    logits_eos_inf: bool = False,
    confidence_eos_eot_inf: bool = False,
    eos_id: int | None = None,
    eot_id: int | None = None,
) -> GenerationOutput:
    """Decode ``gen_length`` tokens after each prompt, block by block (see the module docstring).

    Args:
        model: ``model(input_ids[B, T]) -> logits[B, T, V]`` with ``logits[:, i]`` scoring token ``i`` (an adapter's
            scorer: it hides logit shifts and builds attention masks).
        prompt_ids: ``[B, P]`` prompts, left-padded.
        mask_id: The mask token id.
        gen_length: Completion length G.
        block_length: Block length K; ``G % K == 0``.
        steps: Total decoding steps S; ``S % (G / K) == 0``.
        temperature: Gumbel-max temperature τ ≥ 0 (0: greedy).
        remasking: ``"low_confidence"`` or ``"random"``.
        generators: One generator per sample for the Gumbel noise and random confidences (None: the global RNG).
        cfg_scale: Classifier-free guidance scale s ≥ 0 (0: off). The unconditional pass masks the prompt.
        prompt_mask: ``bool [B, P]`` real prompt tokens, masked in the unconditional pass (default: all positions,
            as LLaDA does).
        logits_eos_inf: Never propose ``eos_id`` (its logit −∞ after guidance; see the module docstring).
        confidence_eos_eot_inf: LLaDA's confidence change, as its code runs: ``eot_id``'s probability is removed
            from the confidence softmax, and ``eos_id``'s too when ``temperature == 0`` (module docstring).
        eos_id: The EOS id these options act on (LLaDA: 126081).
        eot_id: The end-of-turn id ``confidence_eos_eot_inf`` acts on (LLaDA: 126348).

    Returns:
        A :class:`GenerationOutput`.
    """
    steps_per_block = check_schedule(gen_length, block_length, steps)
    if remasking not in REMASKING:
        raise ValueError(f"remasking must be one of {REMASKING}, got {remasking!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not cfg_scale >= 0:
        raise ValueError(f"cfg_scale must be >= 0, got {cfg_scale}")
    if prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids must be [B, P], got {tuple(prompt_ids.shape)}")
    if logits_eos_inf and eos_id is None:
        raise ValueError("logits_eos_inf needs eos_id")
    if confidence_eos_eot_inf and (eos_id is None or eot_id is None):
        raise ValueError("confidence_eos_eot_inf needs eos_id and eot_id")
    batch, prompt_length = prompt_ids.shape
    x, step_map = masked_completions(prompt_ids, gen_length, mask_id, generators)
    device = prompt_ids.device
    if cfg_scale > 0:
        uncond_prompt = prompt_mask if prompt_mask is not None else torch.ones_like(prompt_ids, dtype=torch.bool)
    order = torch.arange(block_length, device=device)
    # Logit columns set to −∞ before sampling: the mask token, and EOS with logits_eos_inf.
    banned = torch.tensor([mask_id, *([eos_id] if logits_eos_inf else [])], device=device)
    # Columns dropped from the confidence softmax with confidence_eos_eot_inf: EoT, and EOS when greedy (LLaDA's
    # logits_with_noise is its logits then; see the module docstring).
    hidden = torch.tensor([eot_id, *([eos_id] if temperature == 0 else [])] if confidence_eos_eot_inf else [],
                          dtype=torch.long, device=device)
    noise: Sequence[torch.Generator] | SampleStreams | None = generators
    draws = (temperature > 0) + (remasking == "random")  # uniforms drawn per step: Gumbel noise, confidences
    if generators is not None and draws and all(g.device.type == "cpu" for g in generators):
        # CPU generators are read sequentially (rand(a) then rand(b) is rand(a + b)): every step's uniforms of a
        # sample are read in one call (reserved at the first step, when the vocabulary size is known) instead of
        # one call per sample per step; the same numbers, and the generators end in the same state.
        noise = SampleStreams(list(generators))
    for block in range(gen_length // block_length):
        start = prompt_length + block * block_length
        end = start + block_length
        schedule = transfer_schedule((x[:, start:end] == mask_id).sum(dim=1), steps_per_block)  # [B, S']
        for j in range(steps_per_block):
            logits = model(x)
            if cfg_scale > 0:
                unconditional = x.clone()
                unconditional[:, :prompt_length] = torch.where(uncond_prompt, mask_id, prompt_ids)
                logits = apply_guidance(logits, model(unconditional), cfg_scale)
            block_logits = logits[:, start:end].to(torch.float64)  # [B, K, V]
            block_logits = block_logits.index_fill(-1, banned, float("-inf"))  # the mask token (EOS) is no output
            if isinstance(noise, SampleStreams) and block == 0 and j == 0:
                per_step = block_length * (logits.shape[-1] * (temperature > 0) + (remasking == "random"))
                noise.reserve(steps * per_step)
            uniforms = None
            if temperature > 0:
                uniforms = _per_sample_uniform(tuple(block_logits.shape[1:]), noise, batch, device)
            candidates = gumbel_argmax(block_logits, temperature, uniforms)  # [B, K]
            if remasking == "low_confidence":
                scored = block_logits.index_fill(-1, hidden, float("-inf")) if hidden.numel() else block_logits
                confidence = scored.softmax(dim=-1).gather(-1, candidates.unsqueeze(-1)).squeeze(-1)  # [B, K]
            else:
                confidence = _per_sample_uniform((block_length,), noise, batch, device)
            masked = x[:, start:end] == mask_id  # [B, K]
            confidence = torch.where(masked, confidence, float("-inf"))
            # The k most confident masked positions; a stable sort puts the leftmost first among ties.
            ranked = torch.sort(confidence, dim=1, descending=True, stable=True).indices  # [B, K]
            rank = torch.empty_like(ranked).scatter_(1, ranked, order.expand(batch, -1))  # rank of each position
            commit = (rank < schedule[:, j : j + 1]) & masked  # [B, K]
            x[:, start:end] = torch.where(commit, candidates, x[:, start:end])
            step_map[:, start - prompt_length : end - prompt_length] = torch.where(
                commit, block * steps_per_block + j, step_map[:, start - prompt_length : end - prompt_length]
            )
    return GenerationOutput(completion_ids=x[:, prompt_length:], step_map=step_map, steps_per_block=steps_per_block)


def masked_completions(prompt_ids: Tensor, gen_length: int, mask_id: int,
                       generators: Sequence[torch.Generator] | None) -> tuple[Tensor, Tensor]:
    """The decoders' start: each prompt followed by ``gen_length`` mask tokens, ``[B, P + G]``, and an empty step map
    ``[B, G]`` (−1: not committed yet); one generator per prompt when given."""
    batch = prompt_ids.shape[0]
    if generators is not None and len(generators) != batch:
        raise ValueError(f"got {len(generators)} generators for {batch} prompts")
    device = prompt_ids.device
    masks = torch.full((batch, gen_length), mask_id, dtype=torch.long, device=device)
    return torch.cat([prompt_ids, masks], dim=1), torch.full((batch, gen_length), -1, dtype=torch.long, device=device)


def apply_guidance(conditional: Tensor, unconditional: Tensor, scale: float) -> Tensor:
    """Classifier-free guidance as LLaDA and d1 write it: ``un + (s + 1)·(cond − un)``.

    Shapes:
        conditional, unconditional ``[B, T, V]`` → ``[B, T, V]``.
    """
    return unconditional + (scale + 1.0) * (conditional - unconditional)


def guided(model: Callable[[Tensor], Tensor], *, scale: float, mask_id: int, pad_id: int,
           prompt_length: int) -> Callable[[Tensor], Tensor]:
    """``model`` under classifier-free guidance, for scoring what a guided sampler produced.

    The unconditional pass replaces the real prompt tokens (the first ``prompt_length`` positions after the left
    padding, which is the leading run of ``pad_id``) by the mask token, as :func:`generate` does with the prompt mask
    the dLLM plugin passes it; completion positions are left as they are. d1 applies the same guidance in every
    scoring pass (``get_logits`` in ``diffu_grpo_trainer.py`` L269-283 at dllm-reasoning/d1@837888f), so the policy
    that is scored is the one that sampled. d1 masks the left padding too; here the padding stays padding, in
    decoding and in scoring alike.

    Shapes:
        the returned callable: input_ids ``[R, prompt_length + L]`` → logits ``[R, prompt_length + L, V]``.
    """
    if not scale > 0:
        raise ValueError(f"guidance needs a scale > 0, got {scale}")

    def scorer(input_ids: Tensor) -> Tensor:
        prompt = input_ids[:, :prompt_length]
        real = (prompt != pad_id).long().cumsum(dim=1) > 0  # [R, P]: after the left padding
        unconditional = input_ids.clone()
        unconditional[:, :prompt_length] = torch.where(real, mask_id, prompt)
        return apply_guidance(model(input_ids), model(unconditional), scale)

    return scorer


def completion_mask(completion_ids: Tensor, stop_ids: Sequence[int]) -> Tensor:
    """1 for the tokens up to and including the first stop token (EOS), 0 after it; all 1 without a stop token.

    Shapes:
        completion_ids ``[B, G]`` → ``[B, G]`` long.
    """
    if not stop_ids:
        return torch.ones_like(completion_ids)
    stops = torch.isin(completion_ids, torch.tensor(list(stop_ids), device=completion_ids.device))  # [B, G]
    before = stops.long().cumsum(dim=1) - stops.long()  # stop tokens strictly before each position
    return (before == 0).long()


__all__ = ["REMASKING", "GenerationOutput", "apply_guidance", "check_schedule", "completion_mask", "generate",
           "guided", "gumbel_argmax", "transfer_schedule"]
