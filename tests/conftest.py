"""Shared fixtures: Accelerate's process-wide singletons are reset between tests that build trainers."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _reset_accelerate_state():
    yield
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()
