"""Modality plugins, installed as ``mmrl.plugins``.

Built-in plugins are registered lazily here (``mmrl list`` does not import diffusers or transformers); third-party
plugins register through the entry-point group ``mmrl.plugins``. See :mod:`mmrl.plugin` for the contract.
"""

from mmrl.plugin import plugin_registry

_BUILTIN = {
    "toy": "mmrl.plugins.toy.plugin:ToyPlugin",
    "flow": "mmrl.plugins.flow.plugin:FlowPlugin",
}

for _name, _target in _BUILTIN.items():
    plugin_registry.register_lazy(_name, _target)
