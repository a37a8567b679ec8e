"""Token log-probs and entropies from logits without materialising a float32 ``[N, T, V]`` log-softmax.

The naive computation ``log_softmax(logits.float() / τ).gather(-1, tokens)`` builds a float32 copy of the whole
``[N, T, V]`` logit tensor, and autograd keeps it (and the softmax) alive until the backward. With a 152k-token
vocabulary, G = 8 and 1,024 completion tokens that is 5 GB per copy. :func:`selective_log_softmax` instead

- computes ``logp = z[token] − logsumexp(z)`` with ``z = logits / τ`` in float32, one chunk of ``chunk_size``
  sequence positions at a time, so the float32 temporaries never exceed ``[N, chunk_size, V]``;
- saves for the backward only the logits it was given (any dtype), the tokens and the ``[N, T]`` log-normalisers;
- recomputes the softmax chunk by chunk in the backward: ∂logp/∂z = onehot(token) − p and
  ∂H/∂z = −p · (log p + H), both divided by τ for the logits.

It optionally returns the per-token entropy ``H = −Σ p log p`` of the same tempered distribution, with gradients
(an entropy bonus can train through it). Results are float32 whatever the logits' dtype (bf16 logits are upcast per
chunk, never as a whole).
"""

from __future__ import annotations

import torch
from torch import Tensor


def selective_log_softmax(
    logits: Tensor, tokens: Tensor, *, temperature: float = 1.0, chunk_size: int | None = 256,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``tokens`` under ``softmax(logits / temperature)``, chunked along the sequence.

    Args:
        logits: ``[N, T, V]`` in any floating dtype (the model's output for the positions that predict ``tokens``).
        tokens: ``[N, T]`` int64 token ids in ``[0, V)``.
        temperature: τ > 0; sampling divided the logits by it, so the log-probs must too.
        chunk_size: Sequence positions per float32 chunk (``None``: all positions at once).
        with_entropy: Also return the entropy of each position's tempered distribution.

    Returns:
        ``(logp [N, T], entropy [N, T] or None)``, float32 (float64 for float64 logits), differentiable with
        respect to ``logits``.
    """
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(f"selective_log_softmax: logits must be [N, T, V] and tokens [N, T], got "
                         f"{tuple(logits.shape)} and {tuple(tokens.shape)}")
    if not temperature > 0:
        raise ValueError(f"selective_log_softmax: temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"selective_log_softmax: chunk_size must be a positive integer or None, got {chunk_size}")
    chunk = logits.shape[1] if chunk_size is None else int(chunk_size)
    logp, entropy = _SelectiveLogSoftmax.apply(logits, tokens.long(), float(temperature), max(chunk, 1),
                                               bool(with_entropy))
    return logp, (entropy if with_entropy else None)


def naive_log_softmax(logits: Tensor, tokens: Tensor, *, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """The reference computation (full float32 log-softmax, then gather): ``(logp [N, T], entropy [N, T])``.

    Only for tests and benchmarks: it builds ``[N, T, V]`` float32 tensors.
    """
    log_probs = torch.log_softmax(logits.to(_compute_dtype(logits)) / temperature, dim=-1)  # [N, T, V]
    logp = log_probs.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)  # [N, T]
    entropy = -(log_probs.exp() * log_probs).sum(-1)  # [N, T]
    return logp, entropy


def _compute_dtype(logits: Tensor) -> torch.dtype:
    """float32 for half-precision and float32 logits; float64 stays float64 (gradient checks)."""
    return torch.promote_types(logits.dtype, torch.float32)


def _spans(length: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk, length)) for start in range(0, length, chunk)]


class _SelectiveLogSoftmax(torch.autograd.Function):
    """Chunked (logp, entropy) with a recomputing backward; see the module docstring for the math."""

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, chunk: int, with_entropy: bool):
        n, t, _ = logits.shape
        dtype = _compute_dtype(logits)
        logp = torch.empty(n, t, dtype=dtype, device=logits.device)  # [N, T]
        lse = torch.empty_like(logp)  # [N, T] log-normaliser of z = logits / τ
        entropy = torch.zeros_like(logp)  # [N, T]
        for start, end in _spans(t, chunk):
            z = logits[:, start:end].to(dtype) / temperature  # [N, c, V]
            norm = torch.logsumexp(z, dim=-1)  # [N, c]
            lse[:, start:end] = norm
            logp[:, start:end] = z.gather(-1, tokens[:, start:end].unsqueeze(-1)).squeeze(-1) - norm
            if with_entropy:
                probs = torch.exp(z - norm.unsqueeze(-1))  # [N, c, V]
                entropy[:, start:end] = norm - (probs * z).sum(-1)  # H = lse − Σ p z
        ctx.save_for_backward(logits, tokens, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        logits, tokens, lse, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        temperature, chunk = ctx.temperature, ctx.chunk
        use_entropy = ctx.with_entropy and grad_entropy is not None
        dtype = _compute_dtype(logits)
        grad_logits = torch.empty_like(logits)  # [N, T, V], the logits' dtype
        for start, end in _spans(logits.shape[1], chunk):
            z = logits[:, start:end].to(dtype) / temperature  # [N, c, V]
            log_probs = z - lse[:, start:end].unsqueeze(-1)  # [N, c, V]
            probs = log_probs.exp()
            grad_z = torch.zeros_like(z)
            if grad_logp is not None:
                g = grad_logp[:, start:end].to(dtype)  # [N, c]
                grad_z -= probs * g.unsqueeze(-1)  # −p · g
                grad_z.scatter_add_(-1, tokens[:, start:end].unsqueeze(-1), g.unsqueeze(-1))  # + onehot · g
            if use_entropy:
                h = entropy[:, start:end].unsqueeze(-1)  # [N, c, 1]
                grad_z -= probs * (log_probs + h) * grad_entropy[:, start:end].to(dtype).unsqueeze(-1)
            grad_logits[:, start:end] = (grad_z / temperature).to(logits.dtype)
        return grad_logits, None, None, None, None


__all__ = ["naive_log_softmax", "selective_log_softmax"]
