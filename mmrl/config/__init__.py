"""Typed configs: sections with help text and paper references, YAML loading and overrides."""

from mmrl.config.core import (
    AlgorithmConfig,
    DynamicSamplingConfig,
    EMAConfig,
    EvalConfig,
    OptimConfig,
    PluginSpec,
    RewardsConfig,
    RewardSpec,
    RolloutConfig,
    RunConfig,
    TrainConfig,
)
from mmrl.config.loader import apply_overrides, dump_config, load_config, parse_override, read_yaml
from mmrl.config.schema import (
    ConfigError,
    RegistryChoice,
    config_field,
    describe_fields,
    eval_only_keys,
    from_dict,
    to_dict,
)

__all__ = [
    "AlgorithmConfig",
    "ConfigError",
    "DynamicSamplingConfig",
    "EMAConfig",
    "EvalConfig",
    "OptimConfig",
    "PluginSpec",
    "RegistryChoice",
    "RewardSpec",
    "RewardsConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainConfig",
    "apply_overrides",
    "config_field",
    "describe_fields",
    "dump_config",
    "eval_only_keys",
    "from_dict",
    "load_config",
    "parse_override",
    "read_yaml",
    "to_dict",
]
