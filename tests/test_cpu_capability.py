"""The quick tier's lowered CPU capability (``.ci/run``) runs what a machine of that level runs (tests/conftest.py)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tests.conftest import ONEDNN_ISA_FOR_CAPABILITY


def test_bfloat16_attention_runs_and_matches_float32_at_this_capability():
    """bf16 attention over 64 positions, forward and backward (the size at which torch 2.14.1 takes its packed brgemm
    path on AMX CPUs, which failed under ``ATEN_CPU_CAPABILITY=avx2``/``default`` until the conftest lowered oneDNN
    to match), against the same attention in float32."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if capability in ONEDNN_ISA_FOR_CAPABILITY:
        assert os.environ.get("ONEDNN_MAX_CPU_ISA")  # set by the conftest (or by hand)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, generator=generator) for _ in range(3))
    reference = F.scaled_dot_product_attention(q, k, v)
    q16, k16, v16 = (t.to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q16, k16, v16)
    out.float().square().sum().backward()
    torch.testing.assert_close(out.float(), reference, atol=3e-2, rtol=3e-2)  # bf16 keeps 8 bits of mantissa
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q16, k16, v16))
