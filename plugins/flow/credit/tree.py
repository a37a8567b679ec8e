r"""``credit.strategy: tree`` — BranchGRPO's branching tree with per-depth advantages.

Li et al. 2025, "BranchGRPO: Stable and Efficient GRPO with Structured Branching in Diffusion Models",
arXiv:2509.06040. A group is one tree: the G = k^d samples start from one x at σ = 1 and every node splits into k
children at each of the d split steps, so samples share the prefix of their paths up to the split that separates
them (``credit.tree.sde_steps: all``: every step is an SDE step, as in BranchGRPO; ``splits``: SDE at the split
steps only, ODE in between). Every leaf is one sample and one image.

Credit (BranchGRPO's reward fusion and depth-wise advantage):

- the reward of a node is the mean reward of the leaves below it: R(n) = mean_{ℓ ∈ leaves(n)} r_ℓ;
- the edge into node n (the step that created it) is trained once, with the advantage of n, normalised among the
  nodes of the same depth of the same tree: A(n) = (R(n) − mean_{depth(n)} R) / std_{depth(n)} R.

On the contract: column j is denoising step t_j for every sample, so a column is a tree depth. The edge into the
node that member m sits on after step t_j is stored on every member below it but trained (mask 1) on its first
member only; :meth:`TreeCredit.action_rewards` returns R(node) for every (member, column), and the core's per-(group,
column) normalisation over the active entries *is* the per-depth normalisation above (use ``algorithm.advantage:
grpo`` for BranchGRPO's z-score; columns with a single node, i.e. before the first split, carry no comparison and are
not trained). Steps from the first split to S − 2 are trained with ``sde_steps: all`` (the last step is left out as
in Flow-GRPO, where it is nearly deterministic; on BranchGRPO's 20-step grid with DanceGRPO's η = 0.3 it is not, and
the released code trains it too: ``train_branchgrpo_flux.py:1225`` at Fredreic1849/BranchGRPO@19fbb9f), the split
steps with ``splits``.

Width pruning (``credit.tree.width_pruning: f``, BranchGRPO's mode 2): of the edges after the last split (one per
leaf), only those of the best and the worst leaves (max(2, ⌊f·G⌋) leaves, half each, best first) are
back-propagated: the others get action weight 0 (and are not recomputed), while the advantages are still computed on
every node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from mmrl.config import ConfigError
from mmrl.plugins.flow.credit.base import CreditStrategy, grouped_rows
from mmrl.plugins.flow.credit.sharing import SharedTemplate
from mmrl.rollout import Rollout, RolloutError

if TYPE_CHECKING:
    from mmrl.plugin import PromptBatch
    from mmrl.plugins.flow.config import FlowPluginConfig
    from mmrl.plugins.flow.sampler import FlowSampler


def tree_trained_steps(split_points: list[int], num_steps: int, sde_steps: str) -> list[int]:
    """The trained steps: the split steps, and with ``sde_steps='all'`` every step from the first split to S − 2."""
    if sde_steps == "splits":
        return list(split_points)
    return sorted(set(range(split_points[0], num_steps - 1)) | set(split_points))


def tree_template(group_size: int, split_points: list[int], branching: int, num_steps: int,
                  sde_steps: str = "all") -> SharedTemplate:
    """The template of one tree: member m's node after step s is m // k^(d − c_s), c_s = #splits ≤ s."""
    depth = len(split_points)
    if group_size != branching**depth:
        raise ValueError(f"a tree with {depth} splits into {branching} has {branching**depth} leaves, but the group "
                         f"has {group_size} samples")
    if max(split_points) >= num_steps:
        raise ValueError(f"split points {split_points} must lie in 0..{num_steps - 1}")
    splits = torch.tensor(split_points)
    done = torch.tensor([int((splits <= s).sum()) for s in range(num_steps)])  # [S] splits done by step s
    members = torch.arange(group_size).unsqueeze(1)  # [G, 1]
    width = branching ** (depth - done)  # [S] leaves below a node after step s
    node = members // width.unsqueeze(0)  # [G, S]
    if sde_steps == "all":
        stochastic = torch.ones(group_size, num_steps, dtype=torch.bool)
    else:
        stochastic = torch.zeros(group_size, num_steps, dtype=torch.bool)
        stochastic[:, splits] = True
    trained = tree_trained_steps(split_points, num_steps, sde_steps)
    step_index = torch.tensor(trained).expand(group_size, len(trained)).clone()
    mask = (members % width[step_index] == 0).float()  # the first member below each node trains its edge
    return SharedTemplate(node=node, stochastic=stochastic, step_index=step_index, mask=mask)


def node_rewards(rewards: Tensor, group_ids: Tensor, nodes: Tensor) -> Tensor:
    """R(node) for every (sample, column): the mean of the finite rewards of the samples of the same group on the
    same node in that column.

    Args:
        rewards: ``[N]`` sample (leaf) rewards; non-finite ones are left out of every mean.
        group_ids: ``[N]``.
        nodes: ``[N, A]`` the node of each sample in each column.

    Returns:
        ``[N, A]`` float32 (0 where a node has no finite reward).
    """
    _, dense = torch.unique(group_ids.cpu(), return_inverse=True)  # [N]
    nodes = nodes.cpu().long()
    num_actions = nodes.shape[1]
    width = int(nodes.max()) + 1 if nodes.numel() else 1
    keys = (dense.unsqueeze(1) * num_actions + torch.arange(num_actions)) * width + nodes  # [N, A]
    values = rewards.detach().cpu().double()
    finite = torch.isfinite(values)
    contribution = torch.where(finite, values, torch.zeros_like(values)).unsqueeze(1).expand_as(keys)
    size = int(keys.max()) + 1
    sums = torch.zeros(size, dtype=torch.float64).index_add(0, keys.flatten(), contribution.flatten())
    counts = torch.zeros(size, dtype=torch.float64).index_add(
        0, keys.flatten(), finite.double().unsqueeze(1).expand_as(keys).flatten())
    means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    return means[keys].float()


def width_pruning_keep(rewards: Tensor, fraction: float) -> Tensor:
    """``[G]`` bool: the leaves whose post-split edges stay trained, max(2, ⌊f·G⌋) of them, the best half (rounded
    down) and the worst rest by reward (BranchGRPO's width pruning, mode 2). Non-finite rewards rank last."""
    size = rewards.numel()
    keep = min(size, max(2, int(size * fraction)))
    best = keep // 2
    ranked = torch.where(torch.isfinite(rewards), rewards.double(), torch.full_like(rewards.double(), -torch.inf))
    order = torch.argsort(ranked, descending=True, stable=True)
    kept = torch.zeros(size, dtype=torch.bool)
    kept[order[:best]] = True
    kept[order[size - (keep - best):]] = True
    return kept


class TreeCredit(CreditStrategy):
    """BranchGRPO: k-ary splits, leaf rewards averaged up the tree, advantages normalised per depth."""

    name = "tree"
    shares_prefixes = True

    def validate(self, config: FlowPluginConfig, path: str) -> None:
        tree = config.credit.tree
        if max(tree.split_points) >= config.num_steps:
            raise ConfigError(f"{path}.tree.split_points", tree.split_points,
                              f"steps in 0..{config.num_steps - 1}")
        if config.sde_kind().deterministic_last_step and max(tree.split_points) == config.num_steps - 1:
            raise ConfigError(f"{path}.tree.split_points", tree.split_points,
                              f"no split at the last step with sde {config.sde!r} (its step is deterministic there)")
        if tree.width_pruning is not None and tree.sde_steps != "all":
            raise ConfigError(f"{path}.tree.width_pruning", tree.width_pruning,
                              "null with sde_steps 'splits' (no trained edge follows the last split)")

    def num_actions(self, config: FlowPluginConfig) -> int:
        tree = config.credit.tree
        return len(tree_trained_steps(tree.split_points, config.num_steps, tree.sde_steps))

    def template(self, group_size: int) -> SharedTemplate:
        tree = self.credit.tree
        try:
            return tree_template(group_size, list(tree.split_points), tree.branching, self.config.num_steps,
                                 tree.sde_steps)
        except ValueError as error:
            raise RolloutError(f"credit.tree with rollout.group_size {group_size}: {error}") from None

    def sample(self, sampler: FlowSampler, policy: nn.Module, batch: PromptBatch) -> Rollout:
        template = self.template(batch.group_size)
        rollout = sampler.shared_rollout(policy, batch, template)
        _, rows = grouped_rows(batch.group_ids)
        nodes = torch.empty_like(rollout.replay["step_index"])
        columns = template.node.gather(1, template.step_index).to(nodes.device)  # [G, A]
        nodes[rows.flatten().to(nodes.device)] = columns.repeat(rows.shape[0], 1)
        rollout.replay["tree_node"] = nodes
        return rollout

    def action_rewards(self, rollout: Rollout, rewards: Tensor) -> Tensor:
        per_action = node_rewards(rewards, rollout.group_ids, rollout.replay["tree_node"])
        fraction = self.credit.tree.width_pruning
        if fraction is not None:
            self._prune(rollout, rewards, fraction)
        return per_action.to(rollout.old_logp.device)

    def _prune(self, rollout: Rollout, rewards: Tensor, fraction: float) -> None:
        """Zero the action weights of the pruned leaves' edges after the last split (mutates ``rollout``)."""
        last_split = max(self.credit.tree.split_points)
        after = (rollout.replay["step_index"] > last_split).cpu()  # [N, A]
        keep = torch.ones(len(rollout), dtype=torch.bool)
        _, rows = grouped_rows(rollout.group_ids.cpu())
        for group_rows in rows:
            keep[group_rows] = width_pruning_keep(rewards.detach().cpu()[group_rows], fraction)
        weights = torch.where(after & ~keep.unsqueeze(1), 0.0, 1.0).to(rollout.old_logp)
        rollout.action_weights = weights if rollout.action_weights is None else rollout.action_weights * weights
        rollout.metrics["tree_pruned_fraction"] = float((weights == 0).float().mean())
