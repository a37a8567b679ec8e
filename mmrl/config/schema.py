"""Typed, validated configuration dataclasses.

Every config section is a dataclass whose fields are declared with :func:`config_field`: a default, help text,
and — where the value comes from a paper — the reference. :func:`from_dict` validates a plain mapping (from YAML
and command-line overrides) into the dataclass, and raises :class:`ConfigError` on the first problem with a
one-line message naming the key, what was given and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import types
import typing
from collections.abc import Collection, Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

from mmrl.registry import Option, Range, Registry, RegistryError, callable_options

T = TypeVar("T")


class ConfigError(ValueError):
    """A config key with a wrong name, type or value. ``str(error)`` is one line."""

    def __init__(self, key: str, given: Any, allowed: str):
        self.key, self.given, self.allowed = key, given, allowed
        shown = repr(given) if not isinstance(given, str) or len(given) < 80 else repr(given[:77] + "...")
        super().__init__(f"config key '{key}': got {shown}; allowed: {allowed}")


def config_field(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    ref: str | None = None,
    choices: tuple[Any, ...] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    default_factory: Any = dataclasses.MISSING,
    eval_only: bool = False,
) -> Any:
    """A dataclass field carrying its help text, paper reference and value constraints.

    Args:
        default: The default value.
        help: One or two sentences: what the field does and what the usual value is.
        ref: Where the default comes from (paper and section), if anywhere.
        choices: Allowed values.
        minimum: Smallest allowed value (inclusive unless ``exclusive_minimum``).
        maximum: Largest allowed value (inclusive).
        exclusive_minimum: Make ``minimum`` exclusive (``> minimum``).
        default_factory: For mutable defaults.
        eval_only: The field changes what an evaluation does and nothing of training (the held-out data, the
            decoding of an evaluation): ``mmrl eval`` may evaluate a checkpoint with another value than the run
            was trained with (:func:`eval_only_keys`).
    """
    metadata = {
        "help": help,
        "ref": ref,
        "choices": choices,
        "minimum": minimum,
        "maximum": maximum,
        "exclusive_minimum": exclusive_minimum,
        "eval_only": eval_only,
    }
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass
class RegistryChoice:
    """A registry entry chosen by name, with options bound to the entry's keyword parameters.

    In YAML either ``policy_loss: gspo`` or ``policy_loss: {name: grpo, clip_high: 0.28}``.
    """

    name: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.options}


def registry_choice_field(registry_path: str, default: str, *, help: str, ref: str | None = None) -> Any:
    """A :class:`RegistryChoice` field validated against the registry at ``registry_path`` (``module:attr``)."""
    field = config_field(default_factory=lambda: RegistryChoice(default), help=help, ref=ref)
    field.metadata = types.MappingProxyType({**field.metadata, "registry": registry_path, "registry_default": default})
    return field


# ---------------------------------------------------------------------------------------------------------- loading
def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Validate ``data`` into the dataclass ``cls``.

    Unknown keys, wrong types, NaN or infinite numbers (in any float field, list item, mapping value or registry
    option), values outside the declared choices or range, and failures of the dataclass's own ``validate()`` method
    raise :class:`ConfigError` naming the full dotted key.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(path or "<root>", data, f"a mapping with keys {', '.join(_field_names(cls))}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in known:
            suggestion = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f" (did you mean '{suggestion[0]}'?)" if suggestion else ""
            raise ConfigError(_join(path, str(key)), data[key], f"one of the keys {', '.join(known)}{hint}")
    values = {}
    for name, field in known.items():
        key = _join(path, name)
        if name in data:
            values[name] = _convert(data[name], hints[name], key, field.metadata)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(key, None, f"a value is required ({field.metadata.get('help', '')})")
    instance = cls(**values)
    _check_registry_defaults(instance, known, path)
    validate = getattr(instance, "validate", None)
    if callable(validate):
        validate(path)
    return instance


def to_dict(config: Any) -> Any:
    """Plain, YAML-serialisable form of a config (the inverse of :func:`from_dict`)."""
    if hasattr(config, "to_dict") and not isinstance(config, type):
        return config.to_dict()
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, Mapping):
        return {str(k): to_dict(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    return config


def eval_only_keys(config: Any, prefix: str = "") -> list[str]:
    """The dotted keys (as :func:`to_dict` writes them, e.g. ``plugin.eval_dataset``) of the fields that a config and
    its nested sections declare ``eval_only`` (:func:`config_field`): the keys a checkpoint may be evaluated with at
    another value than it was trained with. A section written by its own ``to_dict`` (the plugin section) names its
    keys through its ``eval_only_keys(prefix)``."""
    if isinstance(config, type):
        return []
    if hasattr(config, "to_dict"):
        own = getattr(config, "eval_only_keys", None)
        return own(prefix) if own is not None else []
    if not dataclasses.is_dataclass(config):
        return []
    keys = []
    for field in dataclasses.fields(config):
        key = f"{prefix}{field.name}"
        if field.metadata.get("eval_only"):
            keys.append(key)
        else:
            keys.extend(eval_only_keys(getattr(config, field.name), f"{key}."))
    return keys


class _Required:
    """What :func:`describe_fields` gives as the default of a field that has none (the config must set it)."""

    def __repr__(self) -> str:
        return "required"


REQUIRED = _Required()


def describe_fields(cls: type) -> list[tuple[str, str, Any, str, str | None]]:
    """``(name, type, default, help, reference)`` for every field of a config dataclass, as a user writes them.

    The type names the declared range too (``"float, > 0.0"``). The default is :data:`REQUIRED` for a field without
    one and a registry choice's default is its entry's name, followed by rows for that entry's options
    (``policy_loss.clip_low``, with their :class:`~mmrl.registry.Range`; ``mmrl list --options`` shows every entry's).
    Nested sections are expanded (``section.key``); an optional section or a list of sections gets its own row and
    rows for its fields (``lora.rank``, ``functions[].name``).
    """
    rows = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        annotation = hints[field.name]
        help_text, ref = field.metadata.get("help", ""), field.metadata.get("ref")
        if field.metadata.get("registry"):  # written as the entry's name, or {name, options}
            entry_name = field.metadata["registry_default"]
            rows.append((field.name, "name or {name, options}", entry_name, help_text, ref))
            registry = _resolve_registry(field.metadata["registry"])
            for option in registry.options(entry_name):
                default = REQUIRED if option.required else to_dict(option.default)
                rows.append((f"{field.name}.{option.name}", option_kind(option), default,
                             f"Option of {registry.kind} {entry_name!r}: {option.help}", None))
            continue
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
            rows.extend((f"{field.name}.{name}", *rest) for name, *rest in describe_fields(annotation))
            continue
        if field.default_factory is not dataclasses.MISSING:
            default = to_dict(field.default_factory())
        elif field.default is dataclasses.MISSING:
            default = REQUIRED
        else:
            default = to_dict(field.default)
        bounds = _range_text(field.metadata)
        kind = _type_name(annotation) + (f", {bounds}" if bounds else "")
        rows.append((field.name, kind + (", evaluation only" if field.metadata.get("eval_only") else ""), default,
                     help_text, ref))
        section, suffix = _section_in(annotation)
        if section is not None:
            rows.extend((f"{field.name}{suffix}.{name}", *rest) for name, *rest in describe_fields(section))
    return rows


def _section_in(annotation: Any) -> tuple[type | None, str]:
    """The config dataclass held by ``X | None`` (suffix ``""``) or ``list[X]`` (suffix ``"[]"``), else None."""
    origin = get_origin(annotation)
    args = [a for a in get_args(annotation) if a is not type(None)]
    if origin in (Union, types.UnionType) and len(args) == 1:
        if isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
            return args[0], ""
        return _section_in(args[0])
    if origin in (list, tuple) and args and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
        return args[0], "[]"
    return None, ""


# ------------------------------------------------------------------------------------------------------ conversion
def _convert(value: Any, annotation: Any, key: str, metadata: Mapping[str, Any]) -> Any:
    if metadata.get("registry"):
        if isinstance(value, Mapping) and "name" not in value:  # options only: keep the default entry
            value = {"name": metadata["registry_default"], **value}
        return _convert_registry_choice(value, key, _resolve_registry(metadata["registry"]))
    converted = _convert_type(value, annotation, key, _range_text(metadata))
    choices = metadata.get("choices")
    if choices is not None and converted not in choices:
        raise ConfigError(key, value, f"one of {', '.join(repr(c) for c in choices)}")
    _check_range(converted, key, metadata)
    return converted


def _convert_type(value: Any, annotation: Any, key: str, bounds: str = "") -> Any:
    """Convert ``value`` to ``annotation`` or raise :class:`ConfigError`. ``bounds`` (e.g. ``"> 0.0"``) is the
    field's declared range, quoted when a number is refused for not being finite."""
    origin = get_origin(annotation)
    args = get_args(annotation)
    if annotation is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _convert_type(value, option, key, bounds)
            except ConfigError as error:
                if len(args) == 2 and type(None) in args and error.key != key:  # `X | None` failing inside X
                    raise
                errors.append(error.allowed)
        raise ConfigError(key, value, " or ".join(errors + (["null"] if type(None) in args else [])))
    if origin is Literal:
        if value not in args:
            raise ConfigError(key, value, f"one of {', '.join(repr(a) for a in args)}")
        return value
    if origin in (list, tuple):
        item_type = args[0] if args else Any
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, value, f"a list of {_type_name(item_type)}")
        items = [_convert_type(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or annotation is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(key, value, "a mapping")
        value_type = args[1] if len(args) == 2 else Any
        return {str(k): _convert_type(v, value_type, f"{key}.{k}") for k, v in value.items()}
    if isinstance(annotation, type) and hasattr(annotation, "from_config_value"):
        return annotation.from_config_value(value, key)  # sections that validate themselves (plugin, rewards)
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return from_dict(annotation, value, key)
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, value, "true or false")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(key, value, f"an integer {bounds}".rstrip())
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, value, "a number")
        if not math.isfinite(value):  # YAML's .nan/.inf, or a literal like 1e400 that overflows to inf
            raise ConfigError(key, value, f"a finite number {bounds}".rstrip())
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(key, value, "a string")
        return value
    raise TypeError(f"config key '{key}': unsupported annotation {annotation!r}")


def _check_range(value: Any, key: str, metadata: Mapping[str, Any]) -> None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    minimum, maximum = metadata.get("minimum"), metadata.get("maximum")
    exclusive = metadata.get("exclusive_minimum")
    if not math.isfinite(value):  # NaN compares False with every bound, so it would pass the checks below
        raise ConfigError(key, value, f"a finite number {_range_text(metadata)}".rstrip())
    too_small = minimum is not None and (value <= minimum if exclusive else value < minimum)
    too_large = maximum is not None and value > maximum
    if too_small or too_large:
        raise ConfigError(key, value, f"a number {_range_text(metadata)}")


def _range_text(metadata: Mapping[str, Any]) -> str:
    """The declared range of a field as text (``"> 0.0"``, ``">= 0.0 and <= 1.0"``), empty when there is none."""
    minimum, maximum = metadata.get("minimum"), metadata.get("maximum")
    low = "" if minimum is None else (f"> {minimum}" if metadata.get("exclusive_minimum") else f">= {minimum}")
    high = "" if maximum is None else f"<= {maximum}"
    return " and ".join(part for part in (low, high) if part)


def _resolve_registry(path: str) -> Registry[Any]:
    import importlib

    module_name, attribute = path.split(":")
    return getattr(importlib.import_module(module_name), attribute)


def _convert_registry_choice(value: Any, key: str, registry: Registry[Any]) -> RegistryChoice:
    if isinstance(value, RegistryChoice):
        value = value.to_dict()
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, Mapping) or "name" not in value:
        raise ConfigError(key, value, f"a {registry.kind} name or a mapping with 'name' and its options")
    name = value["name"]
    try:
        entry = registry.get(name)
    except RegistryError:
        raise ConfigError(f"{key}.name", name, f"one of {', '.join(registry.names())}") from None
    options = {k: v for k, v in value.items() if k != "name"}
    return RegistryChoice(name, bind_options(entry, options, key, f"{registry.kind} {name!r}"))


def bind_options(entry: Any, options: Mapping[str, Any], key: str, what: str,
                 supplied: Collection[str] = ()) -> dict[str, Any]:
    """Validate ``options`` against the keyword parameters of a registry entry: names, types (numbers must be
    finite, ``int`` options integers) and each option's declared :class:`~mmrl.registry.Range`.

    An entry whose options name another registry's entry and its options (``pref_winrate``'s judge and
    ``judge_args``) may define ``bind_nested_options(options, key) -> options``; it is called with the bound options,
    so that the nested options are checked when the config loads too.

    Args:
        entry: The registered callable or class.
        options: The options from the config.
        key: Dotted config key of the options, for messages.
        what: The entry as messages name it, e.g. ``"policy loss 'grpo'"``.
        supplied: Parameters the caller passes itself; they are neither options nor required from the config.
    """
    allowed = {option.name: option for option in callable_options(entry) if option.name not in supplied}
    bound = {}
    for name, value in options.items():
        if name not in allowed:
            listed = ", ".join(f"{o.name}={o.default!r}" for o in allowed.values() if not o.required) or "(none)"
            raise ConfigError(_join(key, name), value, f"options of {what}: {listed}")
        option = allowed[name]
        if not _is_tensor_annotation(option.annotation):
            bounds = option.range.text if option.range is not None else ""
            value = _convert_type(value, option.annotation, _join(key, name), bounds)
            _check_option_range(value, option, _join(key, name))
        bound[name] = value
    missing = [o.name for o in allowed.values() if o.required and o.name not in bound]
    if missing:
        raise ConfigError(_join(key, missing[0]), None, f"a value is required by {what}")
    nested = getattr(entry, "bind_nested_options", None)
    return nested(bound, key) if callable(nested) else bound


def _check_option_range(value: Any, option: Option, key: str) -> None:
    """Refuse a converted number outside the option's declared range (None passes where the type allows it)."""
    if option.range is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if value not in option.range:
        raise ConfigError(key, value, _range_allowed(option.annotation, option.range))


def _range_allowed(annotation: Any, declared: Range) -> str:
    """What a ranged option allows, in words: ``a number in [0, 1)``, ``an integer >= 1``, ``a number > 1 or null``."""
    members = set(get_args(annotation)) if get_origin(annotation) in (Union, types.UnionType) else {annotation}
    noun = "an integer" if int in members and float not in members else "a number"
    return f"{noun} {declared.text}".rstrip() + (" or null" if type(None) in members else "")


def option_kind(option: Option) -> str:
    """The type and range of a registry option as ``mmrl list --options`` and ``mmrl explain`` show them:
    ``float, in [0, 1)``, ``float | null, > 1``, ``int, >= 1``, ``float, any finite value``; empty when untyped."""
    if option.annotation is Any or option.annotation is inspect.Parameter.empty:
        return ""
    kind = _type_name(option.annotation)
    return kind if option.range is None else f"{kind}, {option.range}"


def _is_tensor_annotation(annotation: Any) -> bool:
    text = repr(annotation)
    return "Tensor" in text or "Generator" in text


def _check_registry_defaults(instance: Any, known: Mapping[str, dataclasses.Field], path: str) -> None:
    """Defaults of registry-choice fields are validated too (a default name must exist)."""
    for name, field in known.items():
        registry_path = field.metadata.get("registry")
        value = getattr(instance, name)
        if registry_path and isinstance(value, RegistryChoice):
            registry = _resolve_registry(registry_path)
            setattr(instance, name, _convert_registry_choice(value, _join(path, name), registry))


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (list, tuple):
        return f"list[{_type_name(args[0]) if args else 'any'}]"
    if origin is dict:
        return "mapping"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return "mapping"  # a section, written as a mapping of its fields
    return getattr(annotation, "__name__", str(annotation))
