r"""``credit.strategy: branch`` — TempFlow-GRPO's trajectory branching.

He et al. 2025, "TempFlow-GRPO: When Timing Matters for GRPO in Flow Models", arXiv:2508.04324. The G samples of a
prompt share one initial noise and one deterministic (ODE) trajectory, the trunk. At a branch step k a sample leaves
it with one stochastic (SDE) step and then follows the ODE to the end:

    x_{t+1} = ODE(x_t)            for t < k      (the trunk, shared by the group)
    x_{k+1} ~ N(μ_θ(x_k), std_k²) (the sample's own noise)
    x_{t+1} = ODE(x_t)            for t > k      (the sample's own trajectory)

The only randomness between samples that branch at k is the step-k noise, so the spread of their rewards is credited
to step k alone: a process reward without an intermediate reward model. A sample trains its branch step only.

The released method (``credit.branch.points: null``, the default) branches at every step but the last, K = G/(S − 1)
samples per step. In the released code (Shredded-Pork/TempFlow-GRPO at e66824e):

- ``flow_grpo/diffusers_patch/sd3_pipeline_with_logprob_perstep.py``, ``pipeline_with_logprob``: in
  ``for i, t in enumerate(timesteps[:-1])`` the trunk takes the ODE step (``determistic=True``), the SDE step from
  the same velocity gives the branch samples, and each is completed by ODE steps (``for inner_i, inner_t in
  enumerate(timesteps[i+1:])``) into an image, so every step 0..S−2 has its own images (``all_image``);
- ``flow_grpo/diffusers_patch/sd3_sde_with_logprob_perstep.py``: ``num_samples = 6`` SDE samples per trunk and step
  (the README: "per branch exploration=6"; the authors' TempFlow-GRPO#3: N = 4 trunks × K = 6 per prompt);
- ``scripts/train_sd3_pr.py``: the rewards are stacked to ``[rows, S − 1]`` (one per branch step) and normalised by
  Flow-GRPO's per-prompt stat tracker, mean and std per prompt and column (``global_std = False`` in every ``*_pr``
  recipe of ``config/dgx.py``); row j of the loop ``for j in train_timesteps`` (``range(int(S·0.99))``: all S − 1
  branch steps) trains step j of every row with ``advantages[:, j]``, the loss times ``2.25·std_dev_t``
  (``credit.noise_weighting``).

What mmrl does differently, and why:

- one image per sample: upstream's row (trunk, e) holds the e-th branch of every step (S − 1 images, S − 1 trained
  columns, each with its own advantage); here every branch is its own sample with one active column. Each action's
  advantage depends only on its own image's reward and the loss is a mean over actions, so the gradient is the same
  sum Σ_{e,i} w_i·A_{e,i}·∇ log π(x^{e}_{i+1} | x_i), while the rollout contract keeps one image per sample;
- one trunk per group: the shared-prefix engine starts a group from one initial noise. The released code's tracker
  runs per process without gathering (``# gathered_rewards = {... accelerator.gather ...}``), and its ``*_pr``
  recipes put one prompt on a process per sampling batch (``train_batch_size = 1``), so its groups are the 6
  branches of one trunk too; the N = 4 trunks per prompt the authors describe would be 4 groups here;
- the recipe's estimator: ``grpo`` divides by the Bessel-corrected std, the tracker by the population std + 1e-4
  (a factor √((K − 1)/K) on the advantages).

Designated branch points (``credit.branch.points: [k_1, ..., k_P]``): the group is split evenly over the points (G/P
samples each, G a multiple of P, at least 2 per point), in order (the first G/P members branch at the first point).
This is the earlier reading of the paper's "designated branching points" kept as an option: a group costs less
(the trunk stops at k_P, no late branches), and it concentrates the credit on the steps a task decides early (the
shapes world decides objects and colours at high noise, docs/performance.md).

The action axis has one column per branch point; a sample is active (mask 1) only in the column of its own point,
and :meth:`BranchCredit.action_rewards` hands its reward to that column, so the core normalises the rewards per
(group, branch point) (:func:`mmrl.trainer.credit.action_advantages`): the samples branching at k are compared with
each other only. Compute per group: (k_max + 1) trunk evaluations + Σ_i (S − 1 − k_i) branch evaluations, against
G·S for Flow-GRPO; with the default, (S − 1) + K·S·(S − 1)/2.
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
    from mmrl.plugins.flow.config import FlowPluginConfig
    from mmrl.plugins.flow.sampler import FlowSampler


def branch_points(points: list[int] | None, num_steps: int) -> list[int]:
    """The branch steps: ``points``, or every step 0..S−2 when null (TempFlow-GRPO's released code branches in
    ``for i, t in enumerate(timesteps[:-1])``, never at the last step)."""
    return list(range(num_steps - 1)) if points is None else [int(point) for point in points]


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
    """TempFlow-GRPO: an ODE trunk per group, SDE branches at the branch points (by default every step but the
    last), ODE after them."""

    name = "branch"
    shares_prefixes = True

    def points(self, config: FlowPluginConfig) -> list[int]:
        return branch_points(config.credit.branch.points, config.num_steps)

    def validate(self, config: FlowPluginConfig, path: str) -> None:
        points = self.points(config)
        if not points:
            raise ConfigError(f"{path}.branch.points", config.credit.branch.points,
                              "a list of branch steps: with num_steps 1 null leaves no step to branch at (it "
                              "branches at steps 0..num_steps-2)")
        if max(points) >= config.num_steps:
            raise ConfigError(f"{path}.branch.points", points, f"steps in 0..{config.num_steps - 1}")
        if config.sde_kind().deterministic_last_step and max(points) == config.num_steps - 1:
            raise ConfigError(f"{path}.branch.points", points,
                              f"no branch at the last step with sde {config.sde!r} (its step is deterministic there)")

    def num_actions(self, config: FlowPluginConfig) -> int:
        return len(self.points(config))

    def template(self, group_size: int) -> SharedTemplate:
        points = self.points(self.config)
        try:
            return branch_template(group_size, points, self.config.num_steps)
        except ValueError as error:
            hint = ""
            if self.credit.branch.points is None:
                hint = (f"; points null branches at every step 0..{self.config.num_steps - 2}, so rollout.group_size "
                        f"must be a multiple of {len(points)} with at least 2 per step (e.g. {2 * len(points)}; the "
                        f"released code takes 6 per step), or list fewer points")
            raise RolloutError(f"credit.branch.points with rollout.group_size {group_size}: {error}{hint}") from None

    def sample(self, sampler: FlowSampler, policy: nn.Module, batch: PromptBatch) -> Rollout:
        return sampler.shared_rollout(policy, batch, self.template(batch.group_size))

    def action_rewards(self, rollout: Rollout, rewards: Tensor) -> Tensor:
        """Every column gets the sample's reward; the mask keeps only the sample's own branch point, so the core's
        per-(group, column) normalisation compares the samples that branched at the same step."""
        return rewards.float().unsqueeze(1).expand_as(rollout.old_logp).to(rollout.old_logp.device).clone()
