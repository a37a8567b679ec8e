"""Exponential moving average of the trainable weights, with Flow-GRPO's warm-up."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


class EMA:
    """θ_ema ← d·θ_ema + (1 − d)·θ, with d = min(decay, (1 + s)/(10 + s)) at an update made after optimizer step
    s (0-based; ``s = k·update_every − 1`` for the k-th update).

    The warm-up keeps the average from being dominated by the initial weights early on. Flow-GRPO (arXiv:2505.05470;
    ``flow_grpo/ema.py`` ``EMAModuleWrapper`` with decay 0.9 and ``update_step_interval`` 8, called with the global
    optimizer step in ``scripts/train_sd3.py`` at yifan123/flow_grpo@ac4c86e) indexes the warm-up by the optimizer
    step, so its first update (s = 7) already uses d = 8/17 ≈ 0.47 and d reaches 0.9 by step 80; indexed by the count
    of updates instead it would start at 0.1 and reach 0.9 only after 80 updates (640 steps). Flow-GRPO calls its
    EMA once per training batch with the step counter, so with gradient accumulation the same step's update can be
    applied more than once; mmrl updates exactly once per ``update_every`` optimizer steps.

    Args:
        parameters: The trainable parameters (the list is kept; the tensors are read at each update).
        decay: Upper bound of the decay.
    """

    def __init__(self, parameters: Iterable[nn.Parameter], decay: float):
        self.parameters = list(parameters)
        self.decay = decay
        self.updates = 0
        self.shadow = [p.detach().clone().float() for p in self.parameters]

    def current_decay(self, step: int) -> float:
        """The decay of an update made after optimizer step ``step`` (0-based)."""
        return min(self.decay, (1 + step) / (10 + step))

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold the current weights in, after optimizer step ``step`` (0-based: the first step is 0)."""
        decay = self.current_decay(step)
        for shadow, param in zip(self.shadow, self.parameters, strict=True):
            shadow.mul_(decay).add_(param.detach().float(), alpha=1.0 - decay)
        self.updates += 1

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Temporarily load the averaged weights into the parameters (for evaluation)."""
        backup = [p.detach().clone() for p in self.parameters]
        with torch.no_grad():
            for shadow, param in zip(self.shadow, self.parameters, strict=True):
                param.copy_(shadow.to(param.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for saved, param in zip(backup, self.parameters, strict=True):
                    param.copy_(saved)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "shadow": [s.cpu() for s in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["shadow"]) != len(self.shadow):
            raise ValueError(f"EMA state has {len(state['shadow'])} tensors, this model {len(self.shadow)}")
        self.decay = state["decay"]
        self.updates = state["updates"]
        self.shadow = [s.to(p.device).float() for s, p in zip(state["shadow"], self.parameters, strict=True)]
