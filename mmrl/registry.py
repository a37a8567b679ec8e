"""Name → object registries.

Every algorithm in mmrl (advantage estimators, policy losses, KL estimators, aggregation modes), every plugin and
every reward is reached through a :class:`Registry`. Configs name entries by string; ``mmrl list`` prints them.

Entries are either objects registered eagerly (``@registry.register("name")``) by the module that defines the
registry, or *lazy* references ``"package.module:attribute"`` that are imported on first use, so that listing plugins
does not import diffusers. Everything defined outside a registry's own module arrives through the registry's
entry-point group, the built-in plugins and what they contribute included: mmrl's pyproject.toml declares the built-in
plugins in ``mmrl.plugins`` and the dLLM plugin's ``wd1`` and ``spg`` in ``mmrl.advantage_estimators`` and
``mmrl.policy_losses``, exactly as a third-party package declares its own. Installing a package is then enough for
configs and ``mmrl list`` to find its entries, and the core never imports a plugin to fill its registries.
Registries of a plugin's own (its model adapters, its credit strategies) are announced to ``mmrl list`` through the
group ``mmrl.registries`` (:data:`REGISTRY_GROUP`).

A numeric keyword option declares the values it accepts on its parameter with :class:`Range`, which the config
checks when it loads (``mmrl.config.schema.bind_options``) and ``mmrl list --options`` shows::

    clip_low: Annotated[float, Range(0, 1, high_open=True)] = 0.2        # a number in [0, 1)
    dual_clip: Annotated[float, Range(1, low_open=True)] | None = None    # a number > 1, or null
    max_chars: Annotated[int, Range(1)] = 20_000                          # an integer >= 1
    offset: Annotated[float, ANY_FINITE] = 0.0                            # every finite number
"""

from __future__ import annotations

import importlib
import inspect
import math
import types
import typing
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Annotated, Any, Generic, TypeVar, Union, get_args, get_origin

T = TypeVar("T")

REGISTRY_GROUP = "mmrl.registries"
"""Entry-point group of the registries that ``mmrl list`` shows besides the core's: each entry point's name is the
title (``flow.credit_strategies``: the credit strategies of plugin flow) and its value ``module:attribute`` the
:class:`Registry`."""

# The entry-point groups mmrl's own pyproject.toml fills: an installed mmrl whose metadata declares none of them was
# installed before its entry points were (an editable install is not refreshed by editing pyproject.toml).
OWN_ENTRY_POINT_GROUPS = frozenset({"mmrl.plugins", "mmrl.advantage_estimators", "mmrl.policy_losses", REGISTRY_GROUP})


class RegistryError(KeyError):
    """Unknown or conflicting registry name. The message is one line that lists what is allowed."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain.
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class Range:
    """The values a numeric option of a registry entry accepts, declared on its parameter with ``typing.Annotated``.

    The config refuses a value outside the range when it loads, in one line naming the key (``config key
    'algorithm.policy_loss.clip_low': got -1.0; allowed: a number in [0, 1)``); an ``int`` option is also checked to
    be an integer. ``Range()`` (:data:`ANY_FINITE`) says that every finite number is allowed. The function's own
    checks stay: they guard direct calls, which do not go through the config.

    Args:
        low: Smallest allowed value; None for no lower bound.
        high: Largest allowed value; None for no upper bound.
        low_open: Exclude ``low`` itself (``> low``).
        high_open: Exclude ``high`` itself (``< high``).
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __post_init__(self) -> None:
        for bound in (self.low, self.high):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))
                                      or not math.isfinite(bound)):
                raise ValueError(f"Range bounds must be finite numbers or None, got {self.low!r}, {self.high!r}")
        if (self.low_open and self.low is None) or (self.high_open and self.high is None):
            raise ValueError("an open end of a Range needs a bound on that side")
        if self.low is not None and self.high is not None:
            empty = self.low > self.high or (self.low == self.high and (self.low_open or self.high_open))
            if empty:
                raise ValueError(f"Range({self.low!r}, {self.high!r}) holds no value")

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    @property
    def text(self) -> str:
        """The bounds as a user reads them: ``in [0, 1)``, ``> 1``, ``>= 0``; empty for :data:`ANY_FINITE`."""
        low = None if self.low is None else _number(self.low)
        high = None if self.high is None else _number(self.high)
        if low is not None and high is not None:
            return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if low is not None:
            return f"{'>' if self.low_open else '>='} {low}"
        if high is not None:
            return f"{'<' if self.high_open else '<='} {high}"
        return ""

    def __str__(self) -> str:
        return self.text or "any finite value"


ANY_FINITE = Range()
"""The explicit declaration of a numeric option that accepts every finite number (``Annotated[float, ANY_FINITE]``)."""


def _number(value: float) -> str:
    """``1`` for 1.0, ``0.2`` for 0.2: bounds written as a user would type them."""
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else repr(float(value))


def split_range(annotation: Any) -> tuple[Any, Range | None]:
    """``(annotation without its Range, the Range or None)`` for ``Annotated[X, Range(...)]``, also inside
    ``... | None`` (``Annotated[float, Range(1, low_open=True)] | None``)."""
    if get_origin(annotation) is Annotated:
        base, *extras = get_args(annotation)
        declared = [extra for extra in extras if isinstance(extra, Range)]
        return base, (declared[0] if declared else None)
    if get_origin(annotation) in (Union, types.UnionType):
        parts = [split_range(member) for member in get_args(annotation)]
        declared = [found for _, found in parts if found is not None]
        if declared:
            return Union[tuple(base for base, _ in parts)], declared[0]  # noqa: UP007 — built from a tuple
    return annotation, None


@dataclass(frozen=True)
class Option:
    """One keyword option of a registered callable, read from its signature and docstring.

    ``annotation`` is the resolved type without its :class:`Range` (``Any`` when the type cannot be resolved);
    ``range`` is the declared range, if any.
    """

    name: str
    default: Any
    annotation: Any
    help: str
    range: Range | None = None

    @property
    def required(self) -> bool:
        return self.default is inspect.Parameter.empty


class Registry(Generic[T]):
    """A case-sensitive mapping from names to registered objects.

    Args:
        kind: What the entries are, used in messages (``"advantage estimator"``).
        entry_point_group: Optional entry-point group scanned once, on first lookup, for third-party entries.
            Each entry point's name is the registry name and its value ``module:attribute`` the object.
        populate: Optional module imported on first lookup; importing it registers entries that live in other
            modules of the same package (``"mmrl.rewards"`` declares the built-in rewards lazily). Never a plugin
            package: plugins contribute through entry points.
        supplied: Keyword parameters the registry's caller passes itself (the aggregation counts, an estimator's
            model inputs): they are not options, so :meth:`options` and ``mmrl list --options`` leave them out.
    """

    def __init__(self, kind: str, entry_point_group: str | None = None, populate: str | None = None,
                 supplied: Collection[str] = ()):
        self.kind = kind
        self.entry_point_group = entry_point_group
        self.populate = populate
        self.supplied = frozenset(supplied)
        self._entries: dict[str, T] = {}
        self._lazy: dict[str, str] = {}
        self._entry_points_loaded = entry_point_group is None and populate is None

    # ------------------------------------------------------------------ registration
    def register(self, name: str, obj: T | None = None) -> Any:
        """Register ``obj`` under ``name``, or return a decorator that does.

        Registering the same object twice under one name is allowed (module reloads); a different object raises.
        """
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{self.kind} names must be non-empty strings, got {name!r}")

        def _add(target: T) -> T:
            existing = self._entries.get(name)
            if existing is not None and existing is not target and _qualname(existing) != _qualname(target):
                raise RegistryError(
                    f"{self.kind} {name!r} is already registered to {_qualname(existing)}; "
                    f"refusing to rebind it to {_qualname(target)}"
                )
            self._lazy.pop(name, None)
            self._entries[name] = target
            return target

        if obj is not None:
            return _add(obj)
        return _add

    def register_lazy(self, name: str, target: str) -> None:
        """Register ``"package.module:attribute"`` under ``name``, imported on first :meth:`get`."""
        if ":" not in target:
            raise RegistryError(f"lazy {self.kind} {name!r} must look like 'package.module:attribute', got {target!r}")
        if name in self._entries or (name in self._lazy and self._lazy[name] != target):
            raise RegistryError(f"{self.kind} {name!r} is already registered")
        self._lazy[name] = target

    # ------------------------------------------------------------------ lookup
    def get(self, name: str) -> T:
        """Return the entry called ``name``; raise :class:`RegistryError` naming the allowed entries if unknown."""
        self._load_entry_points()
        if name in self._entries:
            return self._entries[name]
        if name in self._lazy:
            module_name, attribute = self._lazy[name].split(":", 1)
            module = importlib.import_module(module_name)
            obj = getattr(module, attribute)
            # Importing the module may itself have registered the object under this name.
            self._lazy.pop(name, None)
            return self.register(name, obj)
        raise RegistryError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names()) or '(none)'}"
                            + _stale_install_hint(self.entry_point_group))

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        self._load_entry_points()
        return name in self._entries or name in self._lazy

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted(set(self._entries) | set(self._lazy))

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def describe(self, name: str) -> str:
        """First line of the entry's docstring (imports lazy entries)."""
        doc = inspect.getdoc(self.get(name)) or ""
        return doc.strip().splitlines()[0] if doc.strip() else ""

    def options(self, name: str) -> list[Option]:
        """The keyword options a callable entry accepts, from its signature (see :func:`callable_options`), except
        the parameters the registry's caller supplies."""
        return [option for option in callable_options(self.get(name)) if option.name not in self.supplied]

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        if self.populate is not None:
            importlib.import_module(self.populate)
        if self.entry_point_group is None:
            return
        for entry_point in metadata.entry_points(group=self.entry_point_group):
            if entry_point.name not in self._entries and entry_point.name not in self._lazy:
                self._lazy[entry_point.name] = entry_point.value


def _stale_install_hint(group: str | None) -> str:
    """A hint for an unknown name in a group that mmrl's own metadata should fill but does not (a stale install)."""
    if group not in OWN_ENTRY_POINT_GROUPS:
        return ""
    try:
        distribution = metadata.distribution("mmrl")
    except metadata.PackageNotFoundError:
        return " (mmrl is not installed, so its built-in entries are missing: pip install -e .)"
    if group in {entry_point.group for entry_point in distribution.entry_points}:
        return ""
    # Where the metadata came from: a stale ``mmrl.egg-info`` left in the working directory by an old build shadows
    # the installed metadata for every command run from the repository root (sys.path starts with it). importlib
    # keeps the folder in a private attribute; without it the hint just leaves the location out.
    source = getattr(distribution, "_path", None)
    where = f" ({source})" if source is not None else ""
    return (f" (mmrl's installed metadata{where} has no {group!r} entry points: reinstall it, pip install -e ., after "
            "pyproject.toml changed, or delete a stale mmrl.egg-info in the working directory)")


def _qualname(obj: Any) -> str:
    module = getattr(obj, "__module__", type(obj).__module__)
    name = getattr(obj, "__qualname__", type(obj).__qualname__)
    return f"{module}.{name}"


# Parameters every function of a registry receives from the trainer; they are not user options.
DATA_PARAMETERS = frozenset(
    {"rewards", "group_ids", "logp", "old_logp", "ref_logp", "advantages", "mask", "chunk_ids", "loss", "self", "batch"}
)


def callable_options(fn: Callable[..., Any]) -> list[Option]:
    """Keyword options of ``fn``: keyword-only parameters and parameters with defaults, except data tensors.

    Help text comes from the ``Args:`` section of the docstring (Hugging Face style), types and :class:`Range`
    declarations from the resolved annotations. For a class, the options of ``__init__`` are returned.
    """
    target = fn.__init__ if inspect.isclass(fn) else fn
    signature = inspect.signature(target)
    help_by_name = _docstring_args(inspect.getdoc(target) or inspect.getdoc(fn) or "")
    hints = _resolved_annotations(target)
    options = []
    for parameter in signature.parameters.values():
        if parameter.name in DATA_PARAMETERS or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.kind is parameter.POSITIONAL_ONLY:
            continue
        if parameter.kind is parameter.POSITIONAL_OR_KEYWORD and parameter.default is parameter.empty:
            continue  # a leading data argument (the batch, the model, ...), not an option
        annotation, declared = split_range(hints.get(parameter.name, Any))
        options.append(
            Option(parameter.name, parameter.default, annotation, help_by_name.get(parameter.name, ""), declared)
        )
    return options


def _resolved_annotations(target: Callable[..., Any]) -> dict[str, Any]:
    """The parameter types of ``target`` with their ``Annotated`` extras; {} when they cannot be resolved (a
    third-party entry annotated with names imported only for type checkers), which leaves its options unchecked."""
    try:
        return typing.get_type_hints(target, include_extras=True)
    except (NameError, TypeError):
        return {}


def _docstring_args(doc: str) -> dict[str, str]:
    """Parse the ``Args:`` block of a Hugging Face style docstring into {name: first help sentence}."""
    result: dict[str, str] = {}
    in_args = False
    current = None
    for raw in doc.splitlines():
        line = raw.rstrip()
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:", "Options:"):
            in_args = True
            continue
        if in_args and stripped.endswith(":") and not line.startswith(" "):
            break  # next section (Returns:, Shapes:, ...)
        if not in_args or not stripped:
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= 4 and ":" in stripped:
            head, _, tail = stripped.partition(":")
            name = head.split("(")[0].strip().strip("`*")
            if name.isidentifier():
                current = name
                result[current] = tail.strip()
                continue
        if current is not None:
            result[current] = (result[current] + " " + stripped).strip()
    return result
