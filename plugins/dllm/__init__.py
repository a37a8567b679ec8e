"""Masked-diffusion language models (LLaDA, Dream, DiffuCoder, ...) for group-relative RL.

A masked diffusion LM has no tractable sequence log-likelihood; RL methods score a completion with a Monte Carlo
surrogate computed from a few forwards of the mask predictor on partially masked copies of the completion.

Modules (imported on demand, this package imports nothing heavy):

- :mod:`mmrl.plugins.dllm.estimators`: the ``likelihood_estimators`` registry (``one_step``, ``elbo_t``, ``elbo_l``,
  ``coupled``, ``spg_lower``, ``spg_upper``), :func:`~mmrl.plugins.dllm.estimators.draw_plan` /
  :func:`~mmrl.plugins.dllm.estimators.score_plan` for sharing masks between the current, old and reference
  policies, and the exact-ELBO test oracle :func:`~mmrl.plugins.dllm.estimators.exact_elbo`.
- :mod:`mmrl.plugins.dllm.masking`: :class:`~mmrl.plugins.dllm.masking.MaskPlan` and the samplers of masks and
  timesteps (all randomness comes from an explicit ``torch.Generator``).
"""
