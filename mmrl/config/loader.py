"""Reading a YAML recipe, applying ``key.sub=value`` overrides, and validating the result."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from mmrl.config.core import TrainConfig
from mmrl.config.schema import ConfigError, from_dict, to_dict


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading ``1e-4`` as a float (YAML 1.2) rather than the string PyYAML 1.1 makes of it."""


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 — a SafeLoader subclass


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"algorithm.policy_loss.clip_high=0.28"`` → (["algorithm", "policy_loss", "clip_high"], 0.28).

    The value is parsed as a YAML scalar or flow collection, so ``true``, ``null``, ``3e-4`` and ``[1, 2]`` work.
    """
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(text, text, "overrides of the form key.sub=value")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Set each ``key.sub=value`` in a nested mapping (creating sub-mappings; a bare name becomes {name: ...})."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for depth, part in enumerate(path[:-1]):
            child = node.get(part)
            if isinstance(child, str):  # `policy_loss: grpo` overridden with `policy_loss.clip_high=...`
                child = {"name": child}
            elif child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(".".join(path[: depth + 1]), child, "a mapping to set sub-keys in")
            node[part] = child
            node = child
        node[path[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Load a YAML mapping from ``path`` with a one-line error when it is missing or malformed."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("<config file>", str(path), "an existing YAML file")
    try:
        data = yaml_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError("<config file>", f"{path}{where}", "valid YAML") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("<config file>", str(path), "a YAML mapping at the top level")
    return data


def load_config(source: str | Path | Mapping[str, Any], overrides: Sequence[str] = ()) -> TrainConfig:
    """Read, override and validate a training config.

    Args:
        source: A YAML file path or an already-loaded mapping.
        overrides: ``key.sub=value`` strings applied in order.

    Raises:
        ConfigError: on the first wrong key, type or value, naming it.
    """
    data = read_yaml(source) if isinstance(source, (str, Path)) else _deep_copy(source)
    apply_overrides(data, overrides)
    return from_dict(TrainConfig, data)


def dump_config(config: TrainConfig) -> str:
    """The resolved config as YAML (what the run folder and checkpoints store)."""
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value
