"""Reward functions, installed as ``mmrl.rewards``.

Every reward is registered in :data:`reward_functions` (see :mod:`mmrl.reward` for the interface). Built-in
rewards are registered lazily here, so that ``mmrl list`` does not import heavy model code; third-party rewards
register through the entry-point group ``mmrl.rewards``.
"""

from mmrl.reward import Reward, RewardError, RewardInput, reward_functions

_BUILTIN = {
    "exact_match": "mmrl.rewards.text_match:exact_match",
    "token_accuracy": "mmrl.rewards.text_match:token_accuracy",
    "overlong_penalty": "mmrl.rewards.length:overlong_penalty",
    "correct_length_bonus": "mmrl.rewards.length:CorrectLengthBonus",
    "iou": "mmrl.rewards.perception:iou",
    "giou": "mmrl.rewards.perception:giou",
    "detection": "mmrl.rewards.perception:detection",
    "count": "mmrl.rewards.perception:count",
    "format": "mmrl.rewards.reasoning:format_reward",
    "choice": "mmrl.rewards.reasoning:choice",
    "math": "mmrl.rewards.reasoning:math_reward",
    "numeric_match": "mmrl.rewards.answer_scores:numeric_match",
    "word_accuracy": "mmrl.rewards.answer_scores:word_accuracy",
    "rouge": "mmrl.rewards.answer_scores:rouge",
    "relative_accuracy": "mmrl.rewards.answer_scores:relative_accuracy",
    "clip_score": "mmrl.rewards.image_models:ClipScore",
    "pickscore": "mmrl.rewards.image_models:PickScore",
    "hpsv2": "mmrl.rewards.image_models:HPSv2",
    "aesthetic": "mmrl.rewards.image_models:Aesthetic",
    "jpeg_compressibility": "mmrl.rewards.image_models:JpegCompressibility",
    "jpeg_incompressibility": "mmrl.rewards.image_models:JpegIncompressibility",
    "clip_image_similarity": "mmrl.rewards.edits:ClipImageSimilarity",
    "clip_directional": "mmrl.rewards.edits:ClipDirectional",
    "pref_winrate": "mmrl.rewards.preference:PrefWinRate",
    "remote": "mmrl.rewards.remote:RemoteReward",
    "gsm8k_answer": "mmrl.rewards.math_answers:gsm8k_answer",
    "countdown": "mmrl.rewards.countdown:countdown",
    "sudoku": "mmrl.rewards.sudoku:sudoku",
    "shapes": "mmrl.rewards.shapes:ShapesReward",
    "shape_fidelity": "mmrl.rewards.shapes:ShapeFidelityReward",
    "shape_edit": "mmrl.rewards.shape_edits:ShapeEditReward",
    "per_frame": "mmrl.rewards.videos:PerFrameReward",
    "temporal_consistency": "mmrl.rewards.videos:temporal_consistency",
    "clip_temporal_consistency": "mmrl.rewards.videos:ClipTemporalConsistency",
    "clap": "mmrl.rewards.audio:Clap",
    "temporal_contrast": "mmrl.rewards.temporal_contrast:TemporalContrastReward",
    "per_task": "mmrl.rewards.per_task:PerTaskReward",
}

for _name, _target in _BUILTIN.items():
    reward_functions.register_lazy(_name, _target)

__all__ = ["Reward", "RewardError", "RewardInput", "reward_functions"]
