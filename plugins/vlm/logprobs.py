"""Token log-probs and entropies without materialising a float32 ``[N, T, V]`` log-softmax.

The naive computation ``log_softmax(logits.float() / τ).gather(-1, tokens)`` builds a float32 copy of the whole
``[N, T, V]`` logit tensor, and autograd keeps it (and the softmax) alive until the backward. With a 152k-token
vocabulary, G = 8 and 1,024 completion tokens that is 5 GB per copy. Two chunked functions avoid it:

- :func:`selective_log_softmax` (from logits) computes ``logp = z[token] − logsumexp(z)`` with ``z = logits / τ`` in
  float32, one chunk of ``chunk_size`` sequence positions at a time, so the float32 temporaries never exceed
  ``[N, chunk_size, V]``; it saves for the backward only the logits it was given (any dtype), the tokens and the
  ``[N, T]`` log-normalisers and entropies, and recomputes the softmax chunk by chunk in the backward;
- :func:`fused_head_log_softmax` (from hidden states) also applies the LM head chunk by chunk, so not even the
  logits exist as a whole: it keeps the ``[N, T, H]`` hidden states and recomputes each chunk's logits in the
  backward (the head's weight gets its gradient when it trains).

The gradients: ∂logp/∂z = onehot(token) − p and ∂H/∂z = −p · (log p + H), divided by τ for the logits. Both
functions optionally return the per-token entropy ``H = −Σ p log p`` of the same tempered distribution, with
gradients (an entropy bonus can train through it), and can exclude token ids from the distribution (``suppress``:
their logits count as −∞, matching a sampler that never emits them). Results are float32 whatever the inputs' dtype
(bf16 is upcast per chunk, never as a whole).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def selective_log_softmax(
    logits: Tensor, tokens: Tensor, *, temperature: float = 1.0, chunk_size: int | None = 256,
    with_entropy: bool = False, suppress: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``tokens`` under ``softmax(logits / temperature)``, chunked along the sequence.

    Args:
        logits: ``[N, T, V]`` in any floating dtype (the model's output for the positions that predict ``tokens``).
        tokens: ``[N, T]`` int64 token ids in ``[0, V)``.
        temperature: τ > 0; sampling divided the logits by it, so the log-probs must too.
        chunk_size: Sequence positions per float32 chunk (``None``: all positions at once).
        with_entropy: Also return the entropy of each position's tempered distribution.
        suppress: Optional ``[K]`` token ids removed from the distribution (logit −∞), as a sampler's
            ``suppress_tokens`` does; a suppressed target token gets log-prob −∞.

    Returns:
        ``(logp [N, T], entropy [N, T] or None)``, float32 (float64 for float64 logits), differentiable with
        respect to ``logits``.
    """
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(f"selective_log_softmax: logits must be [N, T, V] and tokens [N, T], got "
                         f"{tuple(logits.shape)} and {tuple(tokens.shape)}")
    chunk, suppress = _checked("selective_log_softmax", logits.shape[1], logits.shape[-1], temperature, chunk_size,
                               suppress, logits.device)
    logp, entropy = _SelectiveLogSoftmax.apply(logits, tokens.long(), float(temperature), chunk, bool(with_entropy),
                                               suppress)
    return logp, (entropy if with_entropy else None)


def fused_head_log_softmax(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, *, temperature: float = 1.0,
    chunk_size: int | None = 256, with_entropy: bool = False, suppress: Tensor | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`selective_log_softmax` of ``hidden @ weight.T + bias``, computing the logits chunk by chunk.

    The head runs in the weight's dtype with autocast off (the same arithmetic in the forward and in the
    backward's recomputation), then each chunk is upcast to float32.

    Args:
        hidden: ``[N, T, H]`` final hidden states of the positions that predict ``tokens``.
        weight: ``[V, H]`` the LM head's weight (gets a gradient when it requires one).
        bias: ``[V]`` or None.
        tokens, temperature, chunk_size, with_entropy, suppress: as in :func:`selective_log_softmax`.
        softcap: The model's final logit soft-capping ``c`` (Gemma 2/3/4's ``final_logit_softcapping``), or None:
            the logits are ``c · tanh((hidden @ weight.T + bias) / c)``, computed in the weight's dtype as the
            model's forward computes them after its head (transformers' ``modeling_gemma4.py``
            ``Gemma4ForConditionalGeneration.forward``); the backward multiplies by ``1 − tanh²``.

    Returns:
        ``(logp [N, T], entropy [N, T] or None)``, float32, differentiable with respect to ``hidden``, ``weight``
        and ``bias``.
    """
    if hidden.dim() != 3 or tokens.shape != hidden.shape[:2] or weight.dim() != 2 or \
            weight.shape[1] != hidden.shape[2]:
        raise ValueError(f"fused_head_log_softmax: hidden must be [N, T, H], weight [V, H] and tokens [N, T], got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(tokens.shape)}")
    chunk, suppress = _checked("fused_head_log_softmax", hidden.shape[1], weight.shape[0], temperature, chunk_size,
                               suppress, hidden.device)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"fused_head_log_softmax: softcap must be > 0 or None, got {softcap}")
    logp, entropy = _FusedHeadLogSoftmax.apply(hidden, weight, bias, tokens.long(), float(temperature), chunk,
                                               bool(with_entropy), suppress,
                                               None if softcap is None else float(softcap))
    return logp, (entropy if with_entropy else None)


def naive_log_softmax(logits: Tensor, tokens: Tensor, *, temperature: float = 1.0,
                      suppress: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The reference computation (full float32 log-softmax, then gather): ``(logp [N, T], entropy [N, T])``.

    Only for tests and benchmarks: it builds ``[N, T, V]`` float32 tensors.
    """
    z = logits.to(_compute_dtype(logits)) / temperature  # [N, T, V]
    if suppress is not None:
        z = z.index_fill(-1, torch.as_tensor(suppress, dtype=torch.long, device=z.device), float("-inf"))
    log_probs = torch.log_softmax(z, dim=-1)  # [N, T, V]
    logp = log_probs.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)  # [N, T]
    entropy = -torch.special.xlogy(log_probs.exp(), log_probs.exp()).sum(-1)  # [N, T], 0·log 0 = 0
    return logp, entropy


# ---------------------------------------------------------------------------------------------------- internals


def _checked(name: str, length: int, vocab: int, temperature: float, chunk_size: int | None, suppress: Any,
             device: torch.device) -> tuple[int, Tensor | None]:
    if not temperature > 0:
        raise ValueError(f"{name}: temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"{name}: chunk_size must be a positive integer or None, got {chunk_size}")
    if suppress is not None:
        suppress = torch.as_tensor(suppress, dtype=torch.long, device=device).flatten()
        if suppress.numel() and not (0 <= int(suppress.min()) and int(suppress.max()) < vocab):
            raise ValueError(f"{name}: suppressed ids must lie in [0, {vocab})")
        suppress = suppress if suppress.numel() else None
    return max(length if chunk_size is None else int(chunk_size), 1), suppress


def _compute_dtype(tensor: Tensor) -> torch.dtype:
    """float32 for half-precision and float32 inputs; float64 stays float64 (gradient checks)."""
    return torch.promote_types(tensor.dtype, torch.float32)


def _spans(length: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk, length)) for start in range(0, length, chunk)]


def _tempered(logits: Tensor, temperature: float, suppress: Tensor | None) -> Tensor:
    """``z = logits / τ`` of one chunk in the compute dtype, suppressed ids at −∞: ``[N, c, V]``."""
    z = logits.to(_compute_dtype(logits)) / temperature
    if suppress is not None:
        z.index_fill_(-1, suppress, float("-inf"))
    return z


def _chunk_forward(z: Tensor, tokens: Tensor, with_entropy: bool, suppress: Tensor | None
                   ) -> tuple[Tensor, Tensor, Tensor | None]:
    """(logp, logsumexp, entropy or None) of one tempered chunk ``z [N, c, V]``."""
    norm = torch.logsumexp(z, dim=-1)  # [N, c]
    logp = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - norm
    entropy = None
    if with_entropy:
        log_probs = z - norm.unsqueeze(-1)  # [N, c, V]
        terms = log_probs.exp() * log_probs
        if suppress is not None:
            terms = terms.nan_to_num(nan=0.0)  # 0 · (−∞) at suppressed ids
        entropy = -terms.sum(-1)  # H = −Σ p log p
    return logp, norm, entropy


def _chunk_backward(z: Tensor, norm: Tensor, entropy: Tensor, tokens: Tensor, grad_logp: Tensor | None,
                    grad_entropy: Tensor | None, suppress: Tensor | None) -> Tensor:
    """∂(Σ g·logp + Σ g_H·H)/∂z for one chunk: ``[N, c, V]`` in the compute dtype."""
    log_probs = z - norm.unsqueeze(-1)  # [N, c, V]
    probs = log_probs.exp()  # 0 at suppressed ids
    grad_z = torch.zeros_like(z)
    if grad_logp is not None:
        g = grad_logp.to(z.dtype)  # [N, c]
        grad_z -= probs * g.unsqueeze(-1)  # −p · g
        grad_z.scatter_add_(-1, tokens.unsqueeze(-1), g.unsqueeze(-1))  # + onehot · g
    if grad_entropy is not None:
        term = probs * (log_probs + entropy.unsqueeze(-1)) * grad_entropy.to(z.dtype).unsqueeze(-1)
        grad_z -= term.nan_to_num(nan=0.0) if suppress is not None else term
    return grad_z


class _SelectiveLogSoftmax(torch.autograd.Function):
    """Chunked (logp, entropy) from logits with a recomputing backward."""

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, chunk: int, with_entropy: bool,
                suppress: Tensor | None):
        n, t, _ = logits.shape
        logp = torch.empty(n, t, dtype=_compute_dtype(logits), device=logits.device)  # [N, T]
        lse = torch.empty_like(logp)  # [N, T] log-normaliser of z = logits / τ
        entropy = torch.zeros_like(logp)  # [N, T]
        for start, end in _spans(t, chunk):
            z = _tempered(logits[:, start:end], temperature, suppress)  # [N, c, V]
            chunk_logp, norm, chunk_entropy = _chunk_forward(z, tokens[:, start:end], with_entropy, suppress)
            logp[:, start:end], lse[:, start:end] = chunk_logp, norm
            if chunk_entropy is not None:
                entropy[:, start:end] = chunk_entropy
        ctx.save_for_backward(logits, tokens, lse, entropy, suppress)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        logits, tokens, lse, entropy, suppress = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        grad_entropy = grad_entropy if ctx.with_entropy else None
        grad_logits = torch.empty_like(logits)  # [N, T, V], the logits' dtype
        for start, end in _spans(logits.shape[1], ctx.chunk):
            z = _tempered(logits[:, start:end], ctx.temperature, suppress)  # [N, c, V]
            grad_z = _chunk_backward(z, lse[:, start:end], entropy[:, start:end], tokens[:, start:end],
                                     None if grad_logp is None else grad_logp[:, start:end],
                                     None if grad_entropy is None else grad_entropy[:, start:end], suppress)
            grad_logits[:, start:end] = (grad_z / ctx.temperature).to(logits.dtype)
        return grad_logits, None, None, None, None, None


def _head_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, softcap: float | None = None
                 ) -> tuple[Tensor, Tensor | None]:
    """One chunk's logits ``[N, c, V]`` in the weight's dtype, autocast off (the same in forward and backward), and,
    with ``softcap`` c, the ``tanh(raw / c)`` ``[N, c, V]`` they are ``c ·`` of (the backward's ``1 − tanh²``; None
    without). The cap is applied in the logits' dtype, dividing, then ``tanh``, then multiplying, as the model does."""
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias)
        if softcap is None:
            return logits, None
        squashed = torch.tanh(logits / softcap)
        return squashed * softcap, squashed


class _FusedHeadLogSoftmax(torch.autograd.Function):
    """Chunked (logp, entropy) from hidden states and the LM head, recomputing each chunk's logits in the backward."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, temperature: float,
                chunk: int, with_entropy: bool, suppress: Tensor | None, softcap: float | None):
        n, t, _ = hidden.shape
        dtype = torch.promote_types(weight.dtype, torch.float32)
        logp = torch.empty(n, t, dtype=dtype, device=hidden.device)  # [N, T]
        lse = torch.empty_like(logp)
        entropy = torch.zeros_like(logp)
        for start, end in _spans(t, chunk):
            logits, _ = _head_logits(hidden[:, start:end], weight, bias, softcap)  # [N, c, V]
            z = _tempered(logits, temperature, suppress)
            chunk_logp, norm, chunk_entropy = _chunk_forward(z, tokens[:, start:end], with_entropy, suppress)
            logp[:, start:end], lse[:, start:end] = chunk_logp, norm
            if chunk_entropy is not None:
                entropy[:, start:end] = chunk_entropy
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, entropy, suppress)
        ctx.temperature, ctx.chunk, ctx.with_entropy, ctx.softcap = temperature, chunk, with_entropy, softcap
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, bias, tokens, lse, entropy, suppress = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_entropy = grad_entropy if ctx.with_entropy else None
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None  # [N, T, H]
        accumulate = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if needs_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=accumulate, device=weight.device) if needs_bias else None
        for start, end in _spans(hidden.shape[1], ctx.chunk):
            states = hidden[:, start:end]  # [N, c, H]
            logits, squashed = _head_logits(states, weight, bias, ctx.softcap)  # [N, c, V]
            z = _tempered(logits, ctx.temperature, suppress)
            grad_z = _chunk_backward(z, lse[:, start:end], entropy[:, start:end], tokens[:, start:end],
                                     None if grad_logp is None else grad_logp[:, start:end],
                                     None if grad_entropy is None else grad_entropy[:, start:end], suppress)
            grad_out = grad_z / ctx.temperature  # ∂/∂logits, [N, c, V]
            if squashed is not None:  # ∂(c·tanh(x / c))/∂x = 1 − tanh²(x / c)
                grad_out = grad_out * (1 - squashed.to(grad_out.dtype).square())
            if grad_hidden is not None:
                grad_hidden[:, start:end] = (grad_out.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += grad_out.flatten(0, 1).T.to(accumulate) @ states.flatten(0, 1).to(accumulate)
            if grad_bias is not None:
                grad_bias += grad_out.sum(dim=(0, 1)).to(accumulate)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None, None, None)


__all__ = ["fused_head_log_softmax", "naive_log_softmax", "selective_log_softmax"]
