"""Modality plugins, installed as ``mmrl.plugins``.

Built-in plugins are registered lazily here (``mmrl list`` does not import diffusers or transformers); third-party
plugins register through the entry-point group ``mmrl.plugins``. See :mod:`mmrl.plugin` for the contract.
"""

from mmrl.algos.advantages import advantage_estimators
from mmrl.algos.policy_losses import policy_losses
from mmrl.plugin import plugin_registry

_BUILTIN = {
    "toy": "mmrl.plugins.toy.plugin:ToyPlugin",
    "flow": "mmrl.plugins.flow.plugin:FlowPlugin",
    "dllm": "mmrl.plugins.dllm.plugin:DLLMPlugin",
    "vlm": "mmrl.plugins.vlm.plugin:VLMPlugin",
}

for _name, _target in _BUILTIN.items():
    plugin_registry.register_lazy(_name, _target)

# Algorithms a plugin contributes to the core registries, declared here so that `mmrl list` and config validation
# see them without importing the plugin's dependencies (the dLLM objectives need only torch).
_PLUGIN_ALGORITHMS = (
    (advantage_estimators, "wd1", "mmrl.plugins.dllm.objectives:wd1_weights"),
    (policy_losses, "wd1", "mmrl.plugins.dllm.objectives:wd1_policy_loss"),
    (policy_losses, "spg", "mmrl.plugins.dllm.objectives:spg_policy_loss"),
)
for _registry, _name, _target in _PLUGIN_ALGORITHMS:
    if _name not in _registry:  # a reload after the objectives module registered itself
        _registry.register_lazy(_name, _target)
