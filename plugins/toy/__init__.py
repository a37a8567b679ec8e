"""The reference plugin: a tiny categorical sequence policy on a verifiable digit task (see :mod:`.plugin`)."""

from mmrl.plugins.toy.model import TinyPolicyConfig, TinySequencePolicy
from mmrl.plugins.toy.plugin import ToyPlugin, ToyPluginConfig

__all__ = ["TinyPolicyConfig", "TinySequencePolicy", "ToyPlugin", "ToyPluginConfig"]
