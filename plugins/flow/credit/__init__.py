"""Credit assignment over denoising steps for the flow plugin (``plugin.credit``); docs/credit.md.

One module per strategy, each registered by name in :data:`credit_strategies` (lazily, so listing them imports
nothing heavy; a third-party package adds one through the entry-point group ``mmrl.flow_credit``):

=================  ==========================================  =============================================
``step``           Flow-GRPO's uniform credit (the default)     arXiv:2505.05470
``chunk``          Chunk-GRPO's chunk-level ratio               arXiv:2510.21583
``branch``         TempFlow-GRPO's trajectory branching         arXiv:2508.04324
``sliding_window`` MixGRPO's moving SDE window                  arXiv:2507.21802
``tree``           BranchGRPO's tree with per-depth advantages  arXiv:2509.06040
=================  ==========================================  =============================================

GRPO-Guard's ratio normalisation (arXiv:2510.22319) is a loss option of every strategy (:mod:`.guard`). The typed
config is :class:`CreditConfig` (:mod:`.config`); shared machinery lives in :mod:`.base`, :mod:`.sharing` (rollouts
with shared prefixes) and :mod:`.solvers` (the ODE tail of MixGRPO-Flash).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmrl.plugins.flow.credit.config import (
    BranchCreditConfig,
    ChunkCreditConfig,
    CreditConfig,
    SlidingWindowCreditConfig,
    TreeCreditConfig,
)
from mmrl.registry import Registry

if TYPE_CHECKING:
    from mmrl.plugins.flow.credit.base import CreditStrategy

credit_strategies: Registry[type[CreditStrategy]] = Registry("flow credit strategy",
                                                              entry_point_group="mmrl.flow_credit")

credit_strategies.register_lazy("step", "mmrl.plugins.flow.credit.step:StepCredit")
credit_strategies.register_lazy("chunk", "mmrl.plugins.flow.credit.chunk:ChunkCredit")
credit_strategies.register_lazy("branch", "mmrl.plugins.flow.credit.branch:BranchCredit")
credit_strategies.register_lazy("sliding_window", "mmrl.plugins.flow.credit.sliding_window:SlidingWindowCredit")
credit_strategies.register_lazy("tree", "mmrl.plugins.flow.credit.tree:TreeCredit")

__all__ = [
    "BranchCreditConfig",
    "ChunkCreditConfig",
    "CreditConfig",
    "SlidingWindowCreditConfig",
    "TreeCreditConfig",
    "credit_strategies",
]
