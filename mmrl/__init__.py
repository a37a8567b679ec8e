"""mmrl: group-relative reinforcement learning (GRPO and its family) for generative and multimodal models.

The core (:mod:`mmrl.algos`, :mod:`mmrl.rollout`, :mod:`mmrl.plugin`, :mod:`mmrl.trainer`) owns the math and the
training loop; modality plugins live in :mod:`mmrl.plugins` and rewards in :mod:`mmrl.rewards`.
"""

__version__ = "0.1.0"
