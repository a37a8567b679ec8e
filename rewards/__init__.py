"""Reward functions, installed as ``mmrl.rewards``.

Every reward is registered in :data:`reward_functions` (see :mod:`mmrl.reward` for the interface). Built-in
rewards are registered lazily here, so that ``mmrl list`` does not import heavy model code; third-party rewards
register through the entry-point group ``mmrl.rewards``.
"""

from mmrl.reward import Reward, RewardError, RewardInput, reward_functions

_BUILTIN = {
    "exact_match": "mmrl.rewards.text_match:exact_match",
    "token_accuracy": "mmrl.rewards.text_match:token_accuracy",
    "iou": "mmrl.rewards.perception:iou",
    "giou": "mmrl.rewards.perception:giou",
    "detection": "mmrl.rewards.perception:detection",
    "count": "mmrl.rewards.perception:count",
    "format": "mmrl.rewards.reasoning:format_reward",
    "choice": "mmrl.rewards.reasoning:choice",
    "math": "mmrl.rewards.reasoning:math_reward",
}

for _name, _target in _BUILTIN.items():
    reward_functions.register_lazy(_name, _target)

__all__ = ["Reward", "RewardError", "RewardInput", "reward_functions"]
