"""What every credit strategy shares: the strategy interface and the per-step weights (pure torch).

A strategy turns one :class:`~mmrl.plugin.PromptBatch` into a :class:`~mmrl.rollout.Rollout` through one of the
two sampling engines of the :class:`~mmrl.plugins.flow.sampler.FlowSampler` the plugin hands it (the strategy never
calls back into the plugin):

- the *chain* engine (``FlowSampler.chain_rollout``): every sample follows its own trajectory with its own noise, and
  a :class:`~mmrl.plugins.flow.schedule.StepPlan` says which steps are SDE and which are trained ("step", "chunk",
  "sliding_window");
- the *shared-prefix* engine (``FlowSampler.shared_rollout``, :mod:`.sharing`): the G samples of a group share
  trajectory prefixes and branch at given steps ("branch", "tree"), so every rollout call needs whole groups.

It then fills the per-action fields of the contract (``mask``, ``chunk_ids``, ``action_weights``) and, through
:meth:`CreditStrategy.action_rewards` (the plugin's ``Plugin.action_rewards`` hook), per-action rewards.

Per-step weights (``action_weights``), applied by every strategy when configured:

- noise-aware weighting (TempFlow-GRPO, He et al. 2025, arXiv:2508.04324): w_t = std_t / mean_{s ≤ S−2} std_s with
  std_t the transition std of step t (s_t·√Δ_t for the SDE kinds). For SD3.5's 10-step grid and a = 0.7 the
  normaliser is 1/2.2522, the constant 2.25 of the TempFlow-GRPO code (tested);
- GRPO-Guard's gradient reweighting (Wang et al. 2025, arXiv:2510.22319): w_t = (1/Δ_t) / mean_{s ≤ S−2} (1/Δ_s).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from mmrl.rollout import Rollout, RolloutError

if TYPE_CHECKING:
    from torch import nn

    from mmrl.plugin import PromptBatch
    from mmrl.plugins.flow.config import FlowPluginConfig
    from mmrl.plugins.flow.sampler import FlowSampler


class CreditStrategy:
    """One way of crediting the reward to denoising steps. Subclasses set :attr:`name` and implement
    :meth:`num_actions` and :meth:`sample`; the others have working defaults.

    Args:
        config: The plugin's config (the strategy reads ``config.credit`` and whatever else it needs).
    """

    name: ClassVar[str]
    #: Whether the G samples of a group share trajectory prefixes (then every rollout call needs whole groups).
    shares_prefixes: ClassVar[bool] = False
    #: Whether plugin.train_steps (fraction, random, window) picks the trained steps (then the config checks it).
    uses_step_selection: ClassVar[bool] = False

    def __init__(self, config: FlowPluginConfig):
        self.config = config
        self.credit = config.credit

    # ------------------------------------------------------------------ config
    def validate(self, config: FlowPluginConfig, path: str) -> None:
        """Cross-check the strategy's options against the plugin config; raise ConfigError."""

    def num_actions(self, config: FlowPluginConfig) -> int:
        """A, the width of the action axis (the plugin's ``max_actions``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ rollout
    def rollout(self, sampler: FlowSampler, policy: nn.Module, batch: PromptBatch) -> Rollout:
        """Sample ``batch`` and return the rollout with every per-action field filled in."""
        if self.shares_prefixes:
            check_whole_groups(batch, self.name)
        rollout = self.sample(sampler, policy, batch)
        return self.finalize(sampler, rollout)

    def sample(self, sampler: FlowSampler, policy: nn.Module, batch: PromptBatch) -> Rollout:
        raise NotImplementedError

    def finalize(self, sampler: FlowSampler, rollout: Rollout) -> Rollout:
        """Multiply the configured per-step weights into ``rollout.action_weights``."""
        weights = step_weights(self.config, sampler.sigma_grid(), rollout.replay["step_index"])
        if weights is not None:
            weights = weights.to(rollout.old_logp.device)
            rollout.action_weights = weights if rollout.action_weights is None else rollout.action_weights * weights
        return rollout

    # ------------------------------------------------------------------ credit
    def action_rewards(self, rollout: Rollout, rewards: Tensor) -> Tensor | None:
        """Per-action rewards ``[N, A]`` (the ``Plugin.action_rewards`` hook), or None (the default) for one advantage
        per sample."""
        return None

    def forward_check(self, actions: Tensor | None) -> None:
        """Called by ``FlowPlugin.forward``; a strategy refuses settings it cannot honour there."""


# ---------------------------------------------------------------------------------------------------- step weights
def transition_std(kind: str, sigmas: Tensor, noise_level: float) -> Tensor:
    """std of every step of the grid ``sigmas [S+1]`` → ``[S]`` (float64): s·√Δ for flow_grpo and dance_grpo, σ_next·
    sin(a·π/2) for cps, 0 for ode, exactly what :func:`~mmrl.plugins.flow.sde.sde_step` uses (the kind's own
    :meth:`~mmrl.plugins.flow.sde.SDEKind.transition_std`)."""
    from mmrl.plugins.flow.sde import transition_std as step_std

    sigmas = sigmas.detach().to(torch.float64).cpu()
    return step_std(kind, sigmas[:-1], sigmas[1:], noise_level=noise_level)


def _normalised(per_step: Tensor) -> Tensor:
    """``per_step [S]`` divided by its mean over the steps 0..S−2 (all steps when S = 1)."""
    reference = per_step[:-1] if per_step.numel() > 1 else per_step
    return per_step / reference.mean()


def noise_aware_weights(kind: str, sigmas: Tensor, noise_level: float) -> Tensor:
    """TempFlow-GRPO's noise-aware step weights ``[S]``: std_t / mean_{s ≤ S−2} std_s."""
    return _normalised(transition_std(kind, sigmas, noise_level))


def guard_reweighting(sigmas: Tensor) -> Tensor:
    """GRPO-Guard's gradient reweighting ``[S]``: (1/Δ_t) / mean_{s ≤ S−2} (1/Δ_s)."""
    sigmas = sigmas.detach().to(torch.float64).cpu()
    return _normalised(1.0 / (sigmas[:-1] - sigmas[1:]))


def step_weights(config: FlowPluginConfig, sigmas: Tensor, step_index: Tensor) -> Tensor | None:
    """The configured per-step weights gathered at ``step_index [N, A]`` → ``[N, A]`` float32, or None."""
    credit = config.credit
    per_step = torch.ones(sigmas.shape[0] - 1, dtype=torch.float64)
    if not (credit.noise_weighting or credit.ratio_norm_reweight):
        return None
    if credit.noise_weighting:
        per_step = per_step * noise_aware_weights(config.sde, sigmas, config.noise_level)
    if credit.ratio_norm_reweight:
        per_step = per_step * guard_reweighting(sigmas)
    return per_step.to(torch.float32)[step_index.cpu()]


# ---------------------------------------------------------------------------------------------------- groups
def group_members(group_ids: Tensor) -> Tensor:
    """``[N]`` the position of every sample among the samples of its group, in batch order (0..G−1)."""
    seen: Counter[int] = Counter()
    members = []
    for group in group_ids.tolist():
        members.append(seen[group])
        seen[group] += 1
    return torch.tensor(members, dtype=torch.long)


def check_whole_groups(batch: PromptBatch, strategy: str) -> None:
    """Raise a one-line RolloutError unless every group of ``batch`` has all ``batch.group_size`` samples."""
    counts = Counter(batch.group_ids.tolist())
    partial = {group: count for group, count in counts.items() if count != batch.group_size}
    if partial:
        group, count = next(iter(partial.items()))
        raise RolloutError(
            f"flow credit strategy {strategy!r} shares trajectory prefixes within a group, so every rollout call "
            f"needs whole groups: set rollout.layout: contiguous and rollout.batch_size to a multiple of "
            f"rollout.group_size (this call got {count} of the {batch.group_size} samples of group {group})"
        )


def grouped_rows(group_ids: Tensor) -> tuple[list[int], Tensor]:
    """The groups in order of first appearance and ``[num_groups, G]`` the batch rows of their members."""
    order: dict[int, list[int]] = {}
    for row, group in enumerate(group_ids.tolist()):
        order.setdefault(group, []).append(row)
    sizes = {len(rows) for rows in order.values()}
    if len(sizes) != 1:
        raise RolloutError(f"groups of different sizes in one rollout call: {sorted(sizes)}")
    return list(order), torch.tensor(list(order.values()), dtype=torch.long)


def finite_mean(values: Tensor) -> float:
    """Mean of the finite entries (0.0 when there is none)."""
    finite = values[torch.isfinite(values)]
    return float(finite.double().mean()) if finite.numel() else 0.0
