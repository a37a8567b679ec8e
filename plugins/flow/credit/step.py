"""``credit.strategy: step`` — Flow-GRPO's uniform credit (the default).

Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL", arXiv:2505.05470. Every trained step of a
sample carries the sample's group-relative advantage. Which steps are stochastic and trained is
``plugin.train_steps`` (:mod:`mmrl.plugins.flow.schedule`): Flow-GRPO's first fraction, DanceGRPO's random subset or
Flow-GRPO-Fast's random window. This is the flow plugin's behaviour from before the ``credit`` section existed,
unchanged: mask all ones, no chunk ids, no per-action rewards (per-step weights only when configured).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from mmrl.plugins.flow.credit.base import CreditStrategy
from mmrl.plugins.flow.schedule import StepPlan, plan_steps
from mmrl.rollout import Rollout

if TYPE_CHECKING:
    from mmrl.plugin import PromptBatch
    from mmrl.plugins.flow.config import FlowPluginConfig
    from mmrl.plugins.flow.sampler import FlowSampler


def step_plan(config: FlowPluginConfig, batch: PromptBatch, run_seed: int) -> StepPlan:
    """The :class:`StepPlan` of ``plugin.train_steps`` for ``batch``."""
    return plan_steps(
        config.train_steps, config.num_steps, seeds=batch.seeds, group_ids=batch.group_ids, run_seed=run_seed,
        timestep_fraction=config.timestep_fraction, window_size=config.window_size,
        window_range=config.resolved_window_range() if config.train_steps == "window" else None,
    )


class StepCredit(CreditStrategy):
    """Flow-GRPO: one advantage per sample on every trained step (``plugin.train_steps`` picks the steps)."""

    name = "step"
    uses_step_selection = True

    def num_actions(self, config: FlowPluginConfig) -> int:
        return config.step_selection_count()

    def sample(self, sampler: FlowSampler, policy: nn.Module, batch: PromptBatch) -> Rollout:
        return sampler.chain_rollout(policy, batch, step_plan(self.config, batch, sampler.runtime.seed))
