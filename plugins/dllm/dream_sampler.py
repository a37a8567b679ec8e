"""Dream's sampler (``plugin.sampler: dream``): the ``diffusion_generate`` of Dream-7B and DiffuCoder.

Dream (Ye et al. 2025, arXiv:2508.15487) and DiffuCoder (Gong et al. 2025, arXiv:2506.20639) decode with the
``_sample`` loop of the checkpoints' ``generation_utils.py`` (Dream-v0-Instruct-7B; DiffuCoder's coupled-GRPO rollouts
call it as ``diffusion_generate(..., steps, temperature, top_p=0.95, alg="entropy", alg_temp=0.0)``,
apple/ml-diffucoder@f735e01 ``src/open_r1/coupled_grpo.py`` L409-431), not LLaDA's blocks. The whole completion
starts as mask tokens and is decoded in ``steps`` steps on the time grid ``t_i = linspace(1, eps, steps + 1)``. At
step i, for every masked position, with ``s = t_{i+1}``, ``t = t_i``:

1. logits (the adapter's scorer already aligns Dream's shifted logits with their tokens) are divided by the
   temperature (when > 0), filtered by ``top_p`` (nucleus: the most probable tokens whose cumulative probability
   reaches it, the first always kept) and ``top_k``, and turned into probabilities p;
2. a candidate ``x̂ ~ Categorical(p)`` (argmax at temperature 0) with a confidence by ``alg``: ``maskgit_plus``
   ``p[x̂]``, ``topk_margin`` ``p₁ − p₂`` (the two largest), ``entropy`` ``Σ p log(p + 1e-10)`` (the negative
   entropy);
3. ``origin``: each masked position is committed with probability ``1 − s/t`` (1 at the last step), its token drawn
   as in 1-2. The others: ``k = int(n·(1 − s/t))`` of the row's ``n`` masked positions (all at the last step) are
   committed, the ``k`` most confident (``alg_temp`` 0 or null), or drawn without replacement from
   ``softmax(confidence / alg_temp)`` over the row.

What mmrl does differently, and why: every random number of sample b comes from its own generator (Dream draws the
whole batch from the global RNG), so a sample does not depend on its batch; with a batch of one and the global RNG
seeded as the generator, the draws are Dream's (``tests/dllm/test_dream_sampler.py`` checks it against the loop as
Dream writes it). ``k`` counts the row's own masked positions, where Dream divides the batch's by the batch size: the
same number, since every row of a rollout has as many masked positions at every step. The mask token is never a
candidate (its logit is −∞ before step 1): Dream's sampler may commit it, which would leave a mask in a "clean"
completion that the likelihood estimators then score; a trained model gives it no mass, so the distributions are
Dream's. Logits are float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from mmrl.config import ConfigError, config_field
from mmrl.plugins.dllm.generation import GenerationOutput, masked_completions

DREAM_ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")
_ENTROPY_EPS = 1e-10  # Dream's epsilon inside log(p + eps)


@dataclass
class DreamSamplerConfig:
    """``plugin.dream_sampler``: Dream's ``diffusion_generate`` options (``plugin.sampler: dream``); its temperatures
    are ``plugin.temperature`` (rollouts) and ``plugin.eval_temperature``."""

    alg: Literal["origin", "maskgit_plus", "topk_margin", "entropy"] = config_field(
        "entropy", help="Which masked positions are committed each step: origin (each with probability 1 - s/t), or "
        "the most confident by maskgit_plus (the sampled token's probability), topk_margin (top-1 minus top-2 "
        "probability), entropy (negative entropy).",
        ref="Dream README and DiffuCoder coupled-GRPO rollouts: entropy")
    alg_temp: float | None = config_field(
        0.0, minimum=0.0, help="0 or null: commit the k most confident positions; > 0: draw them from "
        "softmax(confidence / alg_temp).", ref="DiffuCoder coupled-GRPO: 0.0")
    top_p: float | None = config_field(
        None, minimum=0.0, exclusive_minimum=True, maximum=1.0,
        help="Nucleus filter of training rollouts (null or 1: off).", ref="DiffuCoder coupled-GRPO: 0.95")
    eval_top_p: float | None = config_field(
        None, minimum=0.0, exclusive_minimum=True, maximum=1.0, eval_only=True,
        help="Nucleus filter of evaluation (null: top_p).")
    top_k: int | None = config_field(None, minimum=1, help="Keep the k most probable tokens (null: off).")
    eps: float = config_field(1e-3, minimum=0.0, exclusive_minimum=True, maximum=1.0,
                              help="Last time of the grid linspace(1, eps, steps + 1), below 1.", ref="Dream: 1e-3")

    def validate(self, path: str) -> None:
        if self.eps >= 1:
            raise ConfigError(f"{path}.eps", self.eps, "a time in (0, 1)")
        if self.alg == "origin" and self.alg_temp:
            raise ConfigError(f"{path}.alg_temp", self.alg_temp, "0 or null with alg origin (it commits positions at "
                              "random, not by confidence)")


def filter_logits(logits: Tensor, top_p: float | None, top_k: int | None) -> Tensor:
    """Dream's nucleus and top-k filters: filtered-out logits become the dtype's lowest value.

    Shapes:
        logits ``[M, V]`` → ``[M, V]``.
    """
    lowest = torch.finfo(logits.dtype).min
    if top_p is not None and top_p < 1:
        ordered, order = torch.sort(logits, descending=True)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)  # [M, V]
        drop = cumulative > top_p
        drop[..., 1:] = drop[..., :-1].clone()  # keep the token that crosses top_p ...
        drop[..., 0] = False  # ... and always the most probable one
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), lowest)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]  # [M, 1]
        logits = logits.masked_fill(logits < kth, lowest)
    return logits


def candidates(logits: Tensor, *, temperature: float, top_p: float | None, top_k: int | None, alg: str,
               generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """One row's candidate tokens and their confidences (steps 1-2 of the module docstring).

    Shapes:
        logits ``[M, V]`` float32 → (confidence ``[M]``, tokens ``[M]`` long).
    """
    if temperature > 0:
        logits = logits / temperature
    probs = filter_logits(logits, top_p, top_k).softmax(dim=-1)  # [M, V]
    if temperature > 0:  # Categorical(probs).sample(): one multinomial draw per row of the renormalised probs
        tokens = torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, replacement=True,
                                   generator=generator).squeeze(-1)
        confidence = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    else:
        confidence, tokens = probs.max(dim=-1)
    if alg == "topk_margin":
        top2 = torch.topk(probs, 2, dim=-1).values  # [M, 2]
        confidence = top2[:, 0] - top2[:, 1]
    elif alg == "entropy":
        confidence = (probs * torch.log(probs + _ENTROPY_EPS)).sum(dim=-1)
    return confidence, tokens


@torch.no_grad()
def dream_generate(
    model: Callable[[Tensor], Tensor],
    prompt_ids: Tensor,
    *,
    mask_id: int,
    gen_length: int,
    steps: int,
    temperature: float = 0.0,
    alg: str = "entropy",
    alg_temp: float | None = 0.0,
    top_p: float | None = None,
    top_k: int | None = None,
    eps: float = 1e-3,
    generators: Sequence[torch.Generator] | None = None,
) -> GenerationOutput:
    """Decode ``gen_length`` tokens after each prompt with Dream's sampler (module docstring).

    Args:
        model: ``model(input_ids[B, T]) -> logits[B, T, V]`` with ``logits[:, i]`` scoring token ``i`` (an adapter's
            scorer: Dream's shift undone, attention masks built).
        prompt_ids: ``[B, P]`` prompts, left-padded.
        mask_id: The mask token id.
        gen_length: Completion length G.
        steps: Decoding steps.
        temperature: Sampling temperature (0: the most probable token).
        alg: One of :data:`DREAM_ALGORITHMS`.
        alg_temp: Temperature of drawing the committed positions by confidence (0 or None: the most confident).
        top_p: Nucleus filter (None or 1: off).
        top_k: Top-k filter (None: off).
        eps: Last time of the grid.
        generators: One generator per sample (None: the global RNG).

    Returns:
        A :class:`~mmrl.plugins.dllm.generation.GenerationOutput` (one block of ``steps`` steps).
    """
    if alg not in DREAM_ALGORITHMS:
        raise ValueError(f"alg must be one of {DREAM_ALGORITHMS}, got {alg!r}")
    if steps < 1 or not 0 < eps < 1 or not temperature >= 0:
        raise ValueError(f"need steps >= 1, 0 < eps < 1 and temperature >= 0; got {steps}, {eps}, {temperature}")
    batch, prompt_length = prompt_ids.shape
    x, step_map = masked_completions(prompt_ids, gen_length, mask_id, generators)
    device = prompt_ids.device
    times = torch.linspace(1, eps, steps + 1, device=device)  # float32, as Dream's
    for i in range(steps):
        masked = x == mask_id  # [B, T]
        logits = model(x).float()  # [B, T, V]
        logits[..., mask_id] = float("-inf")  # the mask token is no candidate (module docstring)
        last = i == steps - 1
        keep = 1 - times[i + 1] / times[i]  # 1 − s/t, float32
        for b in range(batch):
            positions = masked[b].nonzero().flatten()  # [M]
            if positions.numel() == 0:
                continue
            generator = None if generators is None else generators[b]
            row_logits = logits[b, positions]  # [M, V]
            options = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "alg": alg, "generator": generator}
            if alg == "origin":  # the uniforms are drawn at the last step too (p = 1), as Dream draws them
                chosen = torch.rand(positions.numel(), generator=generator, device=device) < (1.0 if last else keep)
                if not bool(chosen.any()):
                    continue
                _, tokens = candidates(row_logits[chosen], **options)
                committed = positions[chosen]
            else:
                confidence, tokens = candidates(row_logits, **options)
                count = positions.new_tensor(positions.numel()).float()  # n, as Dream's float count
                number = int(count) if last else int(count * keep)
                if number == 0:
                    continue
                full = torch.full((x.shape[1],), float("-inf"), device=device)  # the row's confidences, [T]
                full[positions] = confidence
                if not alg_temp:
                    picked = torch.topk(full, number).indices
                else:
                    picked = torch.multinomial((full / alg_temp).softmax(dim=-1), number, generator=generator)
                lookup = torch.full((x.shape[1],), -1, dtype=torch.long, device=device)
                lookup[positions] = torch.arange(positions.numel(), device=device)
                committed, tokens = picked, tokens[lookup[picked]]
            x[b, committed] = tokens
            step_map[b, committed - prompt_length] = i
    return GenerationOutput(completion_ids=x[:, prompt_length:], step_map=step_map, steps_per_block=steps)
