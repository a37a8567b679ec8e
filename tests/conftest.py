"""Shared fixtures: Accelerate's process-wide singletons are reset between tests that build trainers.

Also, before any test runs: a lowered ``ATEN_CPU_CAPABILITY`` (the quick tier of ``.ci/run``, or by hand) lowers
oneDNN's instruction set to match (``ONEDNN_MAX_CPU_ISA``, unless it is set already). torch 2.14.1 decides whether to
run bfloat16 attention through its packed brgemm kernels from what the CPU has (AMX / AVX-512-BF16, through oneDNN)
but packs the operands only when ATen's own capability is AVX-512: with ``ATEN_CPU_CAPABILITY=avx2`` or ``default``
on a CPU with AMX (an Intel Xeon of 2023 on), ``scaled_dot_product_attention`` on bf16 inputs of 64 positions or
more fails with "pack_vnni2 is only supported when avx512 is supported", which no real machine of that level hits.
oneDNN reads the variable at its first use, which comes later (the subprocesses the tests start inherit it).
"""

from __future__ import annotations

import os

import pytest

ONEDNN_ISA_FOR_CAPABILITY = {"avx2": "AVX2", "default": "SSE41"}
"""oneDNN's ``ONEDNN_MAX_CPU_ISA`` for an ``ATEN_CPU_CAPABILITY`` below AVX-512 (oneDNN's names)."""

_capability = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
if _capability in ONEDNN_ISA_FOR_CAPABILITY:
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", ONEDNN_ISA_FOR_CAPABILITY[_capability])


@pytest.fixture(autouse=True)
def _reset_accelerate_state():
    yield
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()
