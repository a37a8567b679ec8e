"""The shared optimizer math: registries of pure tensor functions.

- :data:`advantage_estimators` — ``fn(rewards[N], group_ids[N], **opts) -> advantages[N]``
- :data:`policy_losses` — ``fn(logp[N,A], old_logp[N,A], advantages, mask[N,A], **opts) -> (loss[N,A], metrics)``
- :data:`kl_estimators` — ``fn(logp[N,A], ref_logp[N,A]) -> [N,A]``
- :data:`aggregation_modes` and :func:`aggregate` — ``[N,A] -> scalar`` with step-wide denominators
"""

# Modules that register more policy losses: covariance_losses (clip_cov, kl_cov), sequence_losses (vespo, luspo).
from mmrl.algos import covariance_losses, sequence_losses  # noqa: F401
from mmrl.algos.advantages import MULTI_REWARD_ORDERS, advantage_estimators, multi_reward_advantages
from mmrl.algos.aggregation import aggregate, aggregation_counts, aggregation_modes
from mmrl.algos.dynamic_sampling import batch_is_full, groups_with_spread, select_kept
from mmrl.algos.groups import GroupError, group_stats, validate_groups
from mmrl.algos.kl import kl_estimators
from mmrl.algos.policy_losses import broadcast_advantages, policy_losses
from mmrl.algos.ratios import RATIO_LEVELS, log_ratio

__all__ = [
    "MULTI_REWARD_ORDERS",
    "RATIO_LEVELS",
    "GroupError",
    "advantage_estimators",
    "aggregate",
    "aggregation_counts",
    "aggregation_modes",
    "batch_is_full",
    "broadcast_advantages",
    "group_stats",
    "groups_with_spread",
    "kl_estimators",
    "log_ratio",
    "multi_reward_advantages",
    "policy_losses",
    "select_kept",
    "validate_groups",
]
