"""The chunked selective log-softmax equals the naive log_softmax + gather, in value and gradient, without keeping
a float32 [N, T, V] tensor for the backward."""

from __future__ import annotations

import pytest
import torch

from mmrl.plugins.vlm.logprobs import fused_head_log_softmax, naive_log_softmax, selective_log_softmax


def _inputs(dtype=torch.float32, n=3, t=11, v=37, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, t, v, generator=generator) * 3).to(dtype).requires_grad_(True)
    tokens = torch.randint(0, v, (n, t), generator=generator)
    return logits, tokens


@pytest.mark.parametrize("chunk_size", [1, 4, 11, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_equals_naive_log_softmax_in_float32(chunk_size, temperature):
    logits, tokens = _inputs()
    logp, entropy = selective_log_softmax(logits, tokens, temperature=temperature, chunk_size=chunk_size,
                                          with_entropy=True)
    expected_logp, expected_entropy = naive_log_softmax(logits, tokens, temperature=temperature)
    assert logp.dtype == torch.float32 and logp.shape == tokens.shape
    torch.testing.assert_close(logp, expected_logp, rtol=0, atol=2e-6)
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=2e-6)


def test_gradients_equal_the_naive_gradients():
    logits, tokens = _inputs()
    weights_logp = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(1))
    weights_entropy = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(2))
    logp, entropy = selective_log_softmax(logits, tokens, temperature=0.8, chunk_size=3, with_entropy=True)
    ((logp * weights_logp).sum() + (entropy * weights_entropy).sum()).backward()
    ours = logits.grad.clone()
    logits.grad = None
    expected_logp, expected_entropy = naive_log_softmax(logits, tokens, temperature=0.8)
    ((expected_logp * weights_logp).sum() + (expected_entropy * weights_entropy).sum()).backward()
    torch.testing.assert_close(ours, logits.grad, rtol=1e-5, atol=1e-6)


def test_gradcheck_in_float64():
    logits, tokens = _inputs(torch.float64, n=2, t=5, v=7)
    assert torch.autograd.gradcheck(
        lambda x: selective_log_softmax(x, tokens, temperature=0.6, chunk_size=2, with_entropy=True), (logits,)
    )


def test_bfloat16_logits_are_upcast_per_chunk():
    logits, tokens = _inputs(torch.bfloat16)
    logp, entropy = selective_log_softmax(logits, tokens, chunk_size=4, with_entropy=True)
    expected_logp, expected_entropy = naive_log_softmax(logits.detach().float(), tokens)
    assert logp.dtype == torch.float32 and entropy.dtype == torch.float32
    torch.testing.assert_close(logp, expected_logp, rtol=0, atol=2e-6)  # same bf16 values, float32 math
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=2e-6)
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


def test_backward_saves_no_float32_copy_of_the_logits():
    """Only the bf16 logits themselves and [N, T] tensors are kept for the backward (the naive path keeps a float32
    [N, T, V] log-softmax)."""
    logits, tokens = _inputs(torch.bfloat16, n=2, t=16, v=64)
    full = logits.numel()

    def saved_float32_full(fn):
        saved = []

        def pack(tensor):
            saved.append((tensor.dtype, tensor.numel()))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            fn()
        return [entry for entry in saved if entry == (torch.float32, full)]

    assert not saved_float32_full(lambda: selective_log_softmax(logits, tokens, chunk_size=4, with_entropy=True))
    assert saved_float32_full(lambda: naive_log_softmax(logits, tokens))  # the check can fail


def test_rejects_bad_arguments():
    logits, tokens = _inputs()
    with pytest.raises(ValueError, match="tokens"):
        selective_log_softmax(logits, tokens[:, :-1])
    with pytest.raises(ValueError, match="temperature"):
        selective_log_softmax(logits, tokens, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        selective_log_softmax(logits, tokens, chunk_size=0)


def test_suppressed_ids_leave_the_distribution():
    """Suppressed ids (vision placeholders the sampler never emits) count as logit −∞: values, entropy and
    gradients equal the naive computation on masked logits, and those ids get no gradient."""
    logits, tokens = _inputs(n=2, t=6, v=13)
    tokens = tokens % 10  # targets are never suppressed
    suppress = torch.tensor([10, 12])
    logp, entropy = selective_log_softmax(logits, tokens, chunk_size=4, with_entropy=True, suppress=suppress)
    expected_logp, expected_entropy = naive_log_softmax(logits, tokens, suppress=suppress)
    torch.testing.assert_close(logp, expected_logp, rtol=0, atol=2e-6)
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=2e-6)
    assert not torch.allclose(logp, naive_log_softmax(logits, tokens)[0])
    (logp.sum() + entropy.sum()).backward()
    ours = logits.grad.clone()
    logits.grad = None
    # Reference gradients through a finite mask: a logit 40 below the rest has probability ~1e-18 (≈ 0 at float32
    # precision) but, unlike −∞, no NaN gradient through the naive entropy.
    masked = logits.index_fill(-1, suppress, float(logits.detach().min()) - 40.0)
    reference_logp, reference_entropy = naive_log_softmax(masked, tokens)
    (reference_logp.sum() + reference_entropy.sum()).backward()
    torch.testing.assert_close(ours, logits.grad, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(ours).all() and (ours[..., suppress] == 0).all()


def _head_inputs(dtype=torch.float32, n=2, t=9, h=6, v=23, seed=3):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, t, h, generator=generator).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=generator) * 0.7).to(dtype).requires_grad_(True)
    bias = torch.randn(v, generator=generator).to(dtype).requires_grad_(True)
    tokens = torch.randint(0, v - 2, (n, t), generator=generator)
    return hidden, weight, bias, tokens


@pytest.mark.parametrize("chunk_size", [1, 4, None])
def test_fused_head_equals_the_naive_head_and_log_softmax(chunk_size):
    hidden, weight, bias, tokens = _head_inputs()
    suppress = torch.tensor([21, 22])
    logp, entropy = fused_head_log_softmax(hidden, weight, bias, tokens, temperature=0.9, chunk_size=chunk_size,
                                           with_entropy=True, suppress=suppress)
    expected_logp, expected_entropy = naive_log_softmax(hidden @ weight.T + bias, tokens, temperature=0.9,
                                                        suppress=suppress)
    torch.testing.assert_close(logp, expected_logp, rtol=0, atol=2e-6)
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=2e-6)
    weights = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(5))
    ((logp * weights).sum() + entropy.sum()).backward()
    ours = [t.grad.clone() for t in (hidden, weight, bias)]
    for tensor in (hidden, weight, bias):
        tensor.grad = None
    masked = (hidden @ weight.T + bias).index_fill(-1, suppress, -60.0)  # finite stand-in for −∞ (see above)
    reference_logp, reference_entropy = naive_log_softmax(masked, tokens, temperature=0.9)
    ((reference_logp * weights).sum() + reference_entropy.sum()).backward()
    for mine, reference in zip(ours, (hidden.grad, weight.grad, bias.grad), strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)


def test_fused_head_gradcheck_in_float64():
    hidden, weight, bias, tokens = _head_inputs(torch.float64, n=2, t=4, h=3, v=7)
    assert torch.autograd.gradcheck(
        lambda h, w, b: fused_head_log_softmax(h, w, b, tokens, temperature=0.7, chunk_size=3, with_entropy=True),
        (hidden, weight, bias),
    )


@pytest.mark.parametrize("chunk_size", [3, None])
def test_fused_head_applies_the_logit_softcap_in_value_and_gradient(chunk_size):
    """``softcap`` c (Gemma's ``final_logit_softcapping``): the log-probs, entropies and gradients are those of the
    naive log-softmax of ``c · tanh((hidden @ W.T + b) / c)`` through autograd; a cap small enough to bind changes
    them (dropping it would score another distribution); a cap that is not positive is refused."""
    hidden, weight, bias, tokens = _head_inputs()
    logp, entropy = fused_head_log_softmax(hidden, weight, bias, tokens, temperature=0.8, chunk_size=chunk_size,
                                           with_entropy=True, softcap=1.5)
    weights = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(6))
    ((logp * weights).sum() + 0.5 * entropy.sum()).backward()
    ours = [t.grad.clone() for t in (hidden, weight, bias)]
    for tensor in (hidden, weight, bias):
        tensor.grad = None
    capped = torch.tanh((hidden @ weight.T + bias) / 1.5) * 1.5
    expected_logp, expected_entropy = naive_log_softmax(capped, tokens, temperature=0.8)
    torch.testing.assert_close(logp, expected_logp, rtol=0, atol=2e-6)
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=2e-6)
    ((expected_logp * weights).sum() + 0.5 * expected_entropy.sum()).backward()
    for mine, reference in zip(ours, (hidden.grad, weight.grad, bias.grad), strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        uncapped, _ = fused_head_log_softmax(hidden, weight, bias, tokens, temperature=0.8, chunk_size=chunk_size)
    assert float((uncapped - logp.detach()).abs().max()) > 0.1
    with pytest.raises(ValueError, match=r"softcap must be > 0 or None, got 0.0"):
        fused_head_log_softmax(hidden, weight, bias, tokens, softcap=0.0)


def test_fused_head_softcap_gradcheck_in_float64():
    hidden, weight, bias, tokens = _head_inputs(torch.float64, n=2, t=4, h=3, v=7)
    assert torch.autograd.gradcheck(
        lambda h, w, b: fused_head_log_softmax(h, w, b, tokens, temperature=0.7, chunk_size=3, with_entropy=True,
                                               softcap=0.8),
        (hidden, weight, bias),
    )


def test_fused_head_keeps_neither_logits_nor_float32_copies_for_backward():
    """Only the hidden states, the head's weight and [N, T] tensors are saved: no [N, T, V] tensor of any dtype."""
    hidden, weight, _, tokens = _head_inputs(torch.bfloat16, n=2, t=16, h=8, v=64)
    saved = []

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logp, _ = fused_head_log_softmax(hidden, weight, None, tokens, chunk_size=4, with_entropy=True)
    assert saved and (2, 16, 64) not in saved
    logp.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    expected, _ = naive_log_softmax(hidden.detach().float() @ weight.detach().float().T, tokens)
    torch.testing.assert_close(logp, expected, rtol=0, atol=0.05)  # the head runs in bf16, the softmax in fp32


def test_fused_head_rejects_mismatched_shapes():
    hidden, weight, bias, tokens = _head_inputs()
    with pytest.raises(ValueError, match=r"weight \[V, H\]"):
        fused_head_log_softmax(hidden, weight[:, :-1], bias, tokens)
