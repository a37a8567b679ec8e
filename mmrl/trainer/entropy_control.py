"""Adaptive entropy control: the entropy bonus's weight steered toward a target entropy (``algorithm.entropy_target``).

Skywork-OR1 (He et al. 2025, "Skywork Open Reasoner 1 Technical Report", arXiv:2505.22312, adaptive entropy
control in its MAGIC loss) replaces the fixed entropy weight by a coefficient c_k that follows the measured entropy
e_k: after step k, c_{k+1} = clip(c_k + Δ, c_min, c_max) when e_k is at or below the target, clip(c_k − Δ, ...)
otherwise, and the bonus that step k+1 trains with is c_{k+1}·1[e_k ≤ target]: none while the policy is above the
target, so the bonus only ever pushes entropy up toward it. (The rule as written here is read from TRL's and
Skywork-OR1's released code, below; the paper itself was not at hand when this was written.)

mmrl follows TRL's implementation (huggingface/trl@f2cd577, ``trl/trainer/grpo_trainer.py``):

- one update per optimizer step (L3196-3210), at the step's gradient-synchronising backward pass;
- e_k is the mean entropy over the step's trained actions (every micro-batch of the step, every process, each
  action weighted by its mask; the high-entropy subset with ``top_entropy_quantile`` < 1), TRL's window sums
  reduced over the processes (L3186-3200);
- the gate uses the previous step's entropy, initially +∞, so the first optimizer step trains no bonus (L828-830,
  L3176-3177); ``e ≤ target`` raises the coefficient (L3201);
- the coefficient and the last entropy are saved in every checkpoint and restored on resume (L3360-3374; here
  through Accelerate's ``register_for_checkpointing``, beside the EMA).

Skywork-OR1's released code (SkyworkAI/Skywork-OR1@64e96af) differs in three ways mmrl does not follow:
``verl/trainer/ppo/core_algos.py`` L56-74 (``EntController``) compares strictly (``e < target``), starts with the
gate open (``entropy_loss_enabled = 1``), and ``verl/trainer/ppo/ray_trainer.py`` L1168-1169 updates once per
training step from ``-mean(old_log_probs)`` over the response tokens (``verl/workers/actor/dp_actor.py``
L203-224: the sampled tokens' negative log-likelihood before the update, an estimate of the entropy, not the
entropy of the distribution). With its scripts' initial coefficient 0 (``or1_scripts/train/7b_8k.sh`` L12-17:
target 0.2, Δ 1e-4, c_max 0.005) the open first gate trains no bonus either.
"""

from __future__ import annotations

import math
from typing import Any


def next_entropy_coef(coef: float, entropy: float, *, target: float, delta: float, minimum: float,
                      maximum: float) -> float:
    """The coefficient after an optimizer step whose measured entropy was ``entropy``: up by ``delta`` when it is at
    or below ``target``, down by ``delta`` otherwise, clamped to ``[minimum, maximum]`` (TRL f2cd577
    ``grpo_trainer.py`` L3201-3208)."""
    if entropy <= target:
        return min(coef + delta, maximum)
    return max(coef - delta, minimum)


class AdaptiveEntropyCoef:
    """The adaptive entropy coefficient of a run (see the module docstring).

    Args:
        initial: c_0, the coefficient before the first update (``algorithm.entropy_coef``).
        target: The target entropy, nats per action (``algorithm.entropy_target``; any finite value, as a continuous
            policy's differential entropy can be negative).
        delta: Δ, the step per update (> 0).
        minimum: c_min.
        maximum: c_max (>= c_min; c_0 lies in [c_min, c_max]).

    Attributes:
        coef: The current coefficient c_k (the one the next optimizer step uses, if the gate is open).
        last_entropy: The entropy measured at the last update; +∞ before the first (the gate is closed).
        updates: Updates so far.
    """

    def __init__(self, initial: float, target: float, delta: float, minimum: float, maximum: float):
        if not math.isfinite(target):  # any finite value: a continuous policy's (differential) entropy can be < 0
            raise ValueError(f"entropy target must be a finite number, got {target}")
        if not (math.isfinite(delta) and delta > 0):
            raise ValueError(f"entropy coefficient delta must be a finite number > 0, got {delta}")
        if not (0 <= minimum <= maximum and math.isfinite(maximum)):
            raise ValueError(f"entropy coefficient bounds must satisfy 0 <= min <= max < inf, got [{minimum}, "
                             f"{maximum}]")
        if not minimum <= initial <= maximum:
            raise ValueError(f"initial entropy coefficient must lie in [{minimum}, {maximum}], got {initial}")
        self.target, self.delta = float(target), float(delta)
        self.minimum, self.maximum = float(minimum), float(maximum)
        self.coef = float(initial)
        self.last_entropy = math.inf
        self.updates = 0

    @classmethod
    def from_config(cls, algorithm: Any) -> AdaptiveEntropyCoef:
        """The controller of an :class:`mmrl.config.AlgorithmConfig` whose ``entropy_target`` is set."""
        if algorithm.entropy_target is None:
            raise ValueError("adaptive entropy control needs algorithm.entropy_target (it is null)")
        return cls(algorithm.entropy_coef, algorithm.entropy_target, algorithm.entropy_coef_delta,
                   algorithm.entropy_coef_min, algorithm.entropy_coef_max)

    @property
    def applied(self) -> float:
        """The coefficient the loss uses now: ``coef`` while the last measured entropy is at or below the target, else
        0 (0 before the first update)."""
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float) -> float:
        """Fold in the entropy measured over an optimizer step; returns the new coefficient.

        Raises:
            ValueError: ``entropy`` is not finite.
        """
        if not math.isfinite(entropy):
            raise ValueError(f"adaptive entropy control measured a mean entropy of {entropy}; it must be finite (a "
                             "non-finite forward; a NaN would silently lower the coefficient)")
        self.coef = next_entropy_coef(self.coef, entropy, target=self.target, delta=self.delta, minimum=self.minimum,
                                      maximum=self.maximum)
        self.last_entropy = float(entropy)
        self.updates += 1
        return self.coef

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef, "last_entropy": self.last_entropy, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"coef", "last_entropy", "updates"} - set(state)
        if missing:
            raise ValueError(f"adaptive entropy state lacks {', '.join(sorted(missing))}")
        self.coef = float(state["coef"])
        self.last_entropy = float(state["last_entropy"])
        self.updates = int(state["updates"])
