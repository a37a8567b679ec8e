"""Rollouts whose samples share trajectory prefixes (pure torch; the model enters as a velocity function).

The G samples of a group form a tree: they start from one x at σ = 1 (drawn from the group id) and stay together
until a step splits them. A :class:`SharedTemplate` describes that tree once for every group: ``node[m, s]`` is the
node member m sits on *after* step s (members on one node share the state), so the parent of a node after step s is
the node its members sat on after step s − 1 (the root for s = 0). Each step the engine evaluates the velocity once
per node (not once per sample) and takes one step per child node: an SDE step with the noise of the child's first
member, or an ODE step. TempFlow-GRPO's branching (an ODE trunk with SDE branches) and BranchGRPO's binary tree are
two templates (:mod:`.branch`, :mod:`.tree`).

Randomness: the noise of a child node after step s comes from a generator seeded by (the seed of the node's first
member, s), so a rollout does not depend on how groups are split over rollout calls or processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from mmrl.plugins.flow.sde import SDEStepOutput
from mmrl.seeding import derive_seed

_NODE_NOISE_TAG = 0x7E3B

VelocityFn = Callable[[Tensor, int, Tensor], Tensor]
"""``velocity(x [M, *latent], step s, group [M]) -> v [M, *latent]``: the model at step s for rows of the groups."""
StepFn = Callable[[Tensor, Tensor, int, bool, "list[torch.Generator] | None"], SDEStepOutput]
"""``step(v, x, s, stochastic, generators) -> SDEStepOutput``: one SDE (or ODE) step from σ_s to σ_{s+1}."""


def canonical(column: Tensor) -> Tensor:
    """Relabel node ids ``[G]`` as 0, 1, ... in order of first appearance."""
    labels: dict[int, int] = {}
    return torch.tensor([labels.setdefault(int(v), len(labels)) for v in column.tolist()], dtype=torch.long)


@dataclass(frozen=True)
class SharedTemplate:
    """The sharing structure of one group (the same for every group of a batch).

    Attributes:
        node: ``[G, S]`` long, the node of member m after step s; ids are 0..K_s−1 in order of first appearance.
        stochastic: ``[G, S]`` bool, whether step s into member m's node is an SDE step (equal within a node).
        step_index: ``[G, A]`` long, the denoising step of each action column (increasing along a row).
        mask: ``[G, A]`` float, 1 where member m trains column j (an SDE edge is trained on one member only).
    """

    node: Tensor
    stochastic: Tensor
    step_index: Tensor
    mask: Tensor

    def __post_init__(self) -> None:
        group_size, num_steps = self.node.shape
        if self.stochastic.shape != self.node.shape or self.step_index.shape != self.mask.shape:
            raise ValueError("template shapes disagree")
        if self.step_index.shape[0] != group_size or not bool((self.step_index.diff(dim=1) > 0).all()):
            raise ValueError("step_index must be [G, A] and increase along each row")
        for s in range(num_steps):
            column = self.node[:, s]
            if not torch.equal(column, canonical(column)):
                raise ValueError(f"node ids after step {s} are not canonical: {column.tolist()}")
            for node in range(int(column.max()) + 1):
                members = (column == node).nonzero().flatten()
                if s > 0 and self.node[members, s - 1].unique().numel() != 1:
                    raise ValueError(f"node {node} after step {s} has members on different parents")
                if self.stochastic[members, s].unique().numel() != 1:
                    raise ValueError(f"node {node} after step {s} mixes SDE and ODE members")
        if self.node[:, -1].unique().numel() != group_size:
            raise ValueError("every member must end on its own node (one image per sample)")
        trained = self.mask > 0
        steps = self.step_index[trained]
        members = torch.arange(group_size).unsqueeze(1).expand_as(self.step_index)[trained]
        if not bool(self.stochastic[members, steps].all()):
            raise ValueError("a trained column is an ODE step (it has no density)")

    @property
    def group_size(self) -> int:
        return int(self.node.shape[0])

    @property
    def num_steps(self) -> int:
        return int(self.node.shape[1])

    @property
    def num_actions(self) -> int:
        return int(self.step_index.shape[1])

    def num_nodes(self, step: int) -> int:
        """K after ``step`` (1 for the root, step = −1)."""
        return 1 if step < 0 else int(self.node[:, step].max()) + 1

    def parents(self, step: int) -> Tensor:
        """``[K_step]`` the parent (a node after step − 1) of every node after ``step``."""
        count = self.num_nodes(step)
        first = self.representatives(step)
        return torch.zeros(count, dtype=torch.long) if step == 0 else self.node[first, step - 1]

    def representatives(self, step: int) -> Tensor:
        """``[K_step]`` the first member of every node after ``step``."""
        column = self.node[:, step]
        return torch.stack([(column == node).nonzero()[0, 0] for node in range(self.num_nodes(step))])

    def node_stochastic(self, step: int) -> Tensor:
        return self.stochastic[self.representatives(step), step]

    def evaluations(self) -> int:
        """Velocity evaluations per group: one per node before every step, Σ_s K_{s−1}."""
        return sum(self.num_nodes(s - 1) for s in range(self.num_steps))


@dataclass
class SharedResult:
    """What :func:`shared_rollout` returns, with R groups.

    Attributes:
        before: ``[R, G, A, *latent]`` x before each column's step, per member.
        after: ``[R, G, A, *latent]`` the state after it (the sampled action where the column is SDE).
        old_logp: ``[R, G, A]`` log-density of ``after`` (0 for ODE steps).
        means: ``[R, G, A, *latent]`` the transition means (only with ``keep_means``).
        final: ``[R, G, *latent]`` every member's final latents.
        evaluations: velocity rows evaluated (R × template.evaluations()).
    """

    before: Tensor
    after: Tensor
    old_logp: Tensor
    means: Tensor | None
    final: Tensor
    evaluations: int


def shared_rollout(
    template: SharedTemplate,
    initial: Tensor,
    seeds: Tensor,
    velocity: VelocityFn,
    step: StepFn,
    *,
    keep_means: bool = False,
    predict: Callable[[Tensor, Tensor, int], Tensor] | None = None,
) -> SharedResult:
    """Run R groups through ``template``.

    Args:
        template: The sharing structure (G members, S steps, A columns).
        initial: ``[R, *latent]`` x at σ = 1 of every group (the root).
        seeds: ``[R, G]`` the per-sample seeds of the members (``PromptBatch.seeds``): node noise comes from them.
        velocity: The model, see :data:`VelocityFn`.
        step: One sampler step, see :data:`StepFn`.
        keep_means: Also return the transition means (GRPO-Guard's RatioNorm needs the old means).
        predict: ``predict(x, v, s)``, the latent to return as each member's ``final`` instead of its state after the
            last step, from the input and velocity of its last step (the flow plugin's ``decode_latent:
            predicted_x0``: x̂₀ = x − σ·v, shared by the children of one node at the last step).
    """
    num_groups = initial.shape[0]
    latent = tuple(initial.shape[1:])
    group_size, num_actions = template.group_size, template.num_actions
    before = initial.new_zeros(num_groups, group_size, num_actions, *latent)
    after = torch.zeros_like(before)
    means = torch.zeros_like(before) if keep_means else None
    old_logp = initial.new_zeros(num_groups, group_size, num_actions)
    state = initial.unsqueeze(1)  # [R, K, *latent], K = 1: the root
    evaluations = 0
    for s in range(template.num_steps):
        count = state.shape[1]
        groups = torch.arange(num_groups, device=initial.device).repeat_interleave(count)
        v = velocity(state.reshape(num_groups * count, *latent), s, groups).reshape(num_groups, count, *latent)
        evaluations += num_groups * count
        parents = template.parents(s).to(initial.device)
        x_parent, v_parent = state[:, parents], v[:, parents]  # [R, K_s, *latent]
        if predict is not None and s == template.num_steps - 1:
            predicted = predict(x_parent.reshape(-1, *latent), v_parent.reshape(-1, *latent), s)
            predicted = predicted.reshape(x_parent.shape)  # [R, K_S, *latent], one per final node
        children = parents.numel()
        next_state = torch.empty_like(x_parent)
        next_mean = torch.empty_like(x_parent)
        logp = initial.new_zeros(num_groups, children)
        kinds = template.node_stochastic(s)
        representatives = template.representatives(s)
        for stochastic in (True, False):
            index = (kinds == stochastic).nonzero().flatten()
            if index.numel() == 0:
                continue
            generators = None
            if stochastic:
                generators = [
                    torch.Generator().manual_seed(derive_seed(int(seeds[r, member]), s, _NODE_NOISE_TAG))
                    for r in range(num_groups) for member in representatives[index].tolist()
                ]
            device_index = index.to(initial.device)
            out = step(v_parent[:, device_index].reshape(-1, *latent), x_parent[:, device_index].reshape(-1, *latent),
                       s, stochastic, generators)
            next_state[:, device_index] = out.prev_sample.reshape(num_groups, index.numel(), *latent)
            next_mean[:, device_index] = out.mean.reshape(num_groups, index.numel(), *latent)
            logp[:, device_index] = out.log_prob.reshape(num_groups, index.numel())
        members, columns = (template.step_index == s).nonzero(as_tuple=True)  # the columns that are step s
        if members.numel():
            source = torch.zeros_like(members) if s == 0 else template.node[members, s - 1]
            target = template.node[members, s]
            members, columns, source, target = (t.to(initial.device) for t in (members, columns, source, target))
            before[:, members, columns] = state[:, source]
            after[:, members, columns] = next_state[:, target]
            old_logp[:, members, columns] = logp[:, target]
            if means is not None:
                means[:, members, columns] = next_mean[:, target]
        state = next_state
    final = (state if predict is None else predicted)[:, template.node[:, -1].to(initial.device)]
    return SharedResult(before, after, old_logp, means, final, evaluations)
