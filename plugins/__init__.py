"""Modality plugins, installed as ``mmrl.plugins``.

Importing this package registers nothing. The built-in plugins (``toy``, ``flow``, ``dllm``, ``vlm``) and what they
contribute to the core's registries (the dLLM plugin's ``wd1`` advantage weights and its ``wd1`` and ``spg`` policy
losses) are entry points of mmrl's own pyproject.toml, declared exactly as a third-party package declares its plugin::

    [project.entry-points."mmrl.plugins"]
    my_modality = "my_package.plugin:MyPlugin"

    [project.entry-points."mmrl.policy_losses"]
    my_loss = "my_package.losses:my_loss"

See :mod:`mmrl.plugin` for the contract and docs/plugins.md for a walk-through.
"""
