r"""``credit.strategy: branch`` — TempFlow-GRPO's trajectory branching.

He et al. 2025, "TempFlow-GRPO: When Timing Matters for GRPO in Flow Models", arXiv:2508.04324. The G samples of a
prompt share one deterministic (ODE) trajectory from one initial noise (the paper's seed group). At a branch step k
a sample leaves it with one stochastic (SDE) step and then follows the ODE to the end:

    x_{t+1} = ODE(x_t)            for t < k      (shared by the group)
    x_{k+1} ~ N(μ_θ(x_k), std_k²) (the sample's own noise)
    x_{t+1} = ODE(x_t)            for t > k      (the sample's own trajectory)

The only randomness between samples that branch at k is the step-k noise, so the spread of their rewards is credited
to step k alone: a process reward without an intermediate reward model. Only step k is trained.

Several branch points: the group is split evenly over ``credit.branch.points`` (G/P samples each, G a multiple of
P, at least 2 per point), in order (the first G/P members branch at the first point). The action axis has one
column per branch point; a sample is active (mask 1) only in the column of its own point, and
:meth:`BranchCredit.action_rewards` hands its reward to that column, so the core normalises the rewards per (group,
branch point): the samples branching at k are compared with each other only.

Noise-aware weighting (``credit.noise_weighting: true`` in the recipe) weights step k's loss by std_k / mean std.
Compute per group: (k_max + 1) trunk evaluations + Σ_i (S − 1 − k_i) branch evaluations, against G·S for Flow-GRPO.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from mmrl.config import ConfigError
from mmrl.plugins.flow.credit.base import CreditStrategy
from mmrl.plugins.flow.credit.sharing import SharedTemplate, canonical
from mmrl.rollout import Rollout, RolloutError

if TYPE_CHECKING:
    from mmrl.plugin import PromptBatch
    from mmrl.plugins.flow.plugin import FlowPlugin, FlowPluginConfig


def branch_template(group_size: int, points: list[int], num_steps: int) -> SharedTemplate:
    """The template of a group of ``group_size`` samples split evenly over the branch ``points``.

    Member m branches at ``points[m // (G / P)]``; columns are the branch points; member m is active in its own.
    """
    count = len(points)
    if group_size % count or group_size // count < 2:
        raise ValueError(f"a group of {group_size} samples cannot be split evenly over {count} branch points with "
                         "at least 2 samples each")
    if max(points) >= num_steps:
        raise ValueError(f"branch points {points} must lie in 0..{num_steps - 1}")
    per_point = group_size // count
    own = torch.tensor([points[m // per_point] for m in range(group_size)])  # [G] branch step of each member
    steps = torch.arange(num_steps)
    on_trunk = steps.unsqueeze(0) < own.unsqueeze(1)  # [G, S]
    raw = torch.where(on_trunk, torch.full((group_size, num_steps), -1), torch.arange(group_size).unsqueeze(1))
    node = torch.stack([canonical(raw[:, s]) for s in range(num_steps)], dim=1)
    stochastic = steps.unsqueeze(0) == own.unsqueeze(1)
    step_index = torch.tensor(points).expand(group_size, count).clone()
    mask = (step_index == own.unsqueeze(1)).float()
    return SharedTemplate(node=node, stochastic=stochastic, step_index=step_index, mask=mask)


class BranchCredit(CreditStrategy):
    """TempFlow-GRPO: an ODE trunk per group, SDE branches at the branch points, ODE after them."""

    name = "branch"
    shares_prefixes = True

    def validate(self, config: FlowPluginConfig, path: str) -> None:
        points = config.credit.branch.points
        if max(points) >= config.num_steps:
            raise ConfigError(f"{path}.branch.points", points, f"steps in 0..{config.num_steps - 1}")
        if config.sde == "cps" and max(points) == config.num_steps - 1:
            raise ConfigError(f"{path}.branch.points", points,
                              "no branch at the last step with sde 'cps' (its step is deterministic there)")

    def num_actions(self, config: FlowPluginConfig) -> int:
        return len(config.credit.branch.points)

    def template(self, group_size: int) -> SharedTemplate:
        try:
            return branch_template(group_size, list(self.credit.branch.points), self.config.num_steps)
        except ValueError as error:
            raise RolloutError(f"credit.branch.points with rollout.group_size {group_size}: {error}") from None

    def sample(self, plugin: FlowPlugin, policy: nn.Module, batch: PromptBatch) -> Rollout:
        return plugin.shared_rollout(policy, batch, self.template(batch.group_size))

    def action_rewards(self, rollout: Rollout, rewards: Tensor) -> Tensor:
        """Every column gets the sample's reward; the mask keeps only the sample's own branch point, so the core's
        per-(group, column) normalisation compares the samples that branched at the same step."""
        return rewards.float().unsqueeze(1).expand_as(rollout.old_logp).to(rollout.old_logp.device).clone()
