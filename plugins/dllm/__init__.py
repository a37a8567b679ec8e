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
- :mod:`mmrl.plugins.dllm.generation`: LLaDA's block semi-autoregressive decoding and the completion mask.
- :mod:`mmrl.plugins.dllm.adapters`: model families (``masked_lm``, ``llada``, ``dream``), the ``dllm_adapters``
  registry.
- :mod:`mmrl.plugins.dllm.objectives`: the ratio-free ``wd1`` and ``spg`` objectives, contributed to the core
  registries through entry points (pyproject.toml), as a third-party package would.
- :mod:`mmrl.plugins.dllm.plugin`: :class:`~mmrl.plugins.dllm.plugin.DLLMPlugin` and its config.
- :mod:`mmrl.plugins.dllm.toy`, :mod:`mmrl.plugins.dllm.pretrain`: the CPU toy world (addition) and the script that
  pretrains its bundled checkpoint (``assets/``).

See docs/dllm.md.
"""
