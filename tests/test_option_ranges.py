"""Declared ranges of registry options (``Annotated[float, Range(...)]``): the Range itself, and bind_options refusing
values outside it in one line naming the key."""

from __future__ import annotations

import math
from typing import Annotated, Any, Union

import pytest

from mmrl.config import ConfigError
from mmrl.config.schema import bind_options, option_kind
from mmrl.registry import ANY_FINITE, Range, callable_options, split_range


# ------------------------------------------------------------------------------------------------------ Range itself
def test_range_text_and_membership():
    unit = Range(0, 1, high_open=True)
    assert unit.text == "in [0, 1)" and str(unit) == "in [0, 1)"
    assert 0 in unit and 0.999 in unit and 1 not in unit and -1e-12 not in unit
    assert math.nan not in unit and math.inf not in unit and True not in unit and "0.5" not in unit
    above_one = Range(1, low_open=True)
    assert above_one.text == "> 1" and 1 not in above_one and 1.0000001 in above_one and 1e300 in above_one
    assert Range(0).text == ">= 0" and Range(high=5, high_open=True).text == "< 5" and Range(high=5).text == "<= 5"
    assert Range(1e-3, 0.25).text == "in [0.001, 0.25]" and Range(784).text == ">= 784"
    assert ANY_FINITE.text == "" and str(ANY_FINITE) == "any finite value"
    assert -1e300 in ANY_FINITE and math.nan not in ANY_FINITE and -math.inf not in ANY_FINITE


@pytest.mark.parametrize("arguments", [
    {"low": 1, "high": 0},  # empty
    {"low": 1, "high": 1, "low_open": True},  # empty
    {"low_open": True},  # an open end without a bound
    {"low": math.nan},
    {"high": math.inf},
    {"low": True},
])
def test_a_malformed_range_is_refused_when_declared(arguments):
    with pytest.raises(ValueError, match="Range"):
        Range(**arguments)


def test_split_range_reads_annotated_alone_and_inside_optional():
    declared = Range(1, low_open=True)
    assert split_range(Annotated[float, declared]) == (float, declared)
    assert split_range(Annotated[float, declared] | None) == (Union[float, None], declared)  # noqa: UP007
    assert split_range(Annotated[float | None, declared]) == (float | None, declared)
    assert split_range(float) == (float, None) and split_range(Annotated[int, "other"]) == (int, None)


# ------------------------------------------------------------------------------------------------------ bind_options
def _toy(batch, *, count: Annotated[int, Range(1)] = 2, cap: Annotated[float, Range(1, low_open=True)] | None = None,
         offset: Annotated[float, ANY_FINITE] = 0.0, share: Annotated[float, Range(0, 1)] = 0.5):
    """A toy registry entry.

    Args:
        count: An integer >= 1.
        cap: A number > 1, or null.
        offset: Any finite number.
        share: A fraction.
    """


@pytest.mark.parametrize(("options", "key", "allowed"), [
    ({"count": 0}, "k.count", "an integer >= 1"),
    ({"count": 2.5}, "k.count", "an integer >= 1"),  # integer options are checked as integers
    ({"count": "two"}, "k.count", "an integer >= 1"),
    ({"cap": 1}, "k.cap", "a number > 1 or null"),
    ({"cap": math.nan}, "k.cap", "a finite number > 1 or null"),
    ({"offset": math.inf}, "k.offset", "a finite number"),
    ({"share": -0.0001}, "k.share", "a number in [0, 1]"),
    ({"share": 1.0001}, "k.share", "a number in [0, 1]"),
])
def test_bind_options_refuses_values_outside_the_declared_range(options, key, allowed):
    with pytest.raises(ConfigError) as info:
        bind_options(_toy, options, "k", "toy 'x'")
    assert (info.value.key, info.value.allowed) == (key, allowed) and "\n" not in str(info.value)


def test_bind_options_keeps_values_inside_the_declared_range_with_their_types():
    bound = bind_options(_toy, {"count": 3.0, "cap": 1.5, "offset": -1e300, "share": 1}, "k", "toy 'x'")
    assert bound == {"count": 3, "cap": 1.5, "offset": -1e300, "share": 1.0}
    assert type(bound["count"]) is int and type(bound["share"]) is float
    assert bind_options(_toy, {"cap": None}, "k", "toy 'x'") == {"cap": None}
    kinds = {option.name: option_kind(option) for option in callable_options(_toy)}
    assert kinds == {"count": "int, >= 1", "cap": "float | null, > 1", "offset": "float, any finite value",
                     "share": "float, in [0, 1]"}


def test_bind_options_calls_an_entrys_nested_binding_with_the_bound_options():
    calls = []

    class Outer:
        def __init__(self, inner: dict[str, Any] | None = None, level: Annotated[int, Range(0)] = 0):
            """Args:
                inner: Options of the inner entry.
                level: Any level >= 0.
            """

        @staticmethod
        def bind_nested_options(options, key):
            calls.append((options, key))
            return {**options, "inner": bind_options(_toy, options.get("inner") or {}, f"{key}.inner", "toy 'x'")}

    assert bind_options(Outer, {"inner": {"count": 4.0}, "level": 1}, "r.args", "outer") == {
        "inner": {"count": 4}, "level": 1}
    assert calls == [({"inner": {"count": 4.0}, "level": 1}, "r.args")]
    with pytest.raises(ConfigError) as info:
        bind_options(Outer, {"inner": {"count": 0}}, "r.args", "outer")
    assert info.value.key == "r.args.inner.count" and info.value.allowed == "an integer >= 1"
