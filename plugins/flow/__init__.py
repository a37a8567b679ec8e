"""The flow-matching plugin (SD3 / FLUX-style rectified-flow image models, Flow-GRPO family); docs/flow.md.

This package stays import-light: nothing here imports diffusers, the modules that need it import it themselves.

- :mod:`mmrl.plugins.flow.sde`: one SDE/ODE step as a Gaussian policy, its log-density and the KL between means;
  the kinds (flow_grpo, dance_grpo, cps, ode) are the classes of ``sde_kind_registry``.
- :mod:`mmrl.plugins.flow.schedule`: which denoising steps are stochastic and which are trained.
- :mod:`mmrl.plugins.flow.credit`: credit assignment over the steps (``plugin.credit``: step, chunk, branch,
  sliding_window, tree; GRPO-Guard's ratio normalisation), docs/credit.md.
- :mod:`mmrl.plugins.flow.adapters`: the ``flow_adapters`` registry and one adapter per model family (sd3, flux).
- :mod:`mmrl.plugins.flow.config`: ``FlowPluginConfig`` (the ``plugin:`` section), its validation, the prompt rows.
- :mod:`mmrl.plugins.flow.sampler`: ``FlowSampler``, the sampling engine the credit strategies build rollouts with.
- :mod:`mmrl.plugins.flow.plugin`: :class:`~mmrl.plugins.flow.plugin.FlowPlugin` (the contract; re-exports the
  config).
- :mod:`mmrl.plugins.flow.images`: captioned image grids for evaluations.
- :mod:`mmrl.plugins.flow.testing`: tiny SD3/FLUX pipelines with random weights and local tokenizers.
"""
