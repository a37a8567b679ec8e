"""Countdown: combine the given numbers with + − × ÷ and parentheses to reach the target.

Registered reward ``countdown``: 1 if the completion's equation uses the given numbers (each at most as often as it
is given; with ``require_all`` every one exactly once, as in TinyZero's and d1's Countdown) and evaluates exactly to
the target; ``format_score`` if an equation was found but is wrong or breaks the rules (d1 gives 0.1); 0 when no
equation is found. Never raises on model output.

The equation is read from the last ``<answer>…</answer>`` block, else the last ``\\boxed{…}``, else the last line
holding a digit and an operator. An ``=`` splits it: the side holding an operator is the expression (``3*5+2 = 17``
and ``17 = 3*5+2`` both give ``3*5+2``). The expression is parsed by the recursive-descent parser below, in exact
rational arithmetic (``fractions.Fraction``): no ``eval``, bounded length, nesting and magnitude. Accepted tokens:
non-negative integers, ``+``, ``-`` / ``−``, ``*`` / ``×`` / ``·`` / ``\\times`` / ``\\cdot``, ``/`` / ``÷`` /
``\\div``, round and square brackets; anything else (letters, decimals, ``^``, unary minus) makes the equation
invalid. Division must be exact in the rationals (``7/2`` is 3.5, not 3). Only the last ``max_chars`` characters of a
completion are read (default 20,000; the equation comes at the end), which bounds the work per sample.
"""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction
from typing import Annotated, Any

from mmrl.registry import Range
from mmrl.reward import RewardError, RewardInput
from mmrl.rewards.boxes import MAX_ANSWER_CHARS, check_max_chars, completion_texts, extract_answer
from mmrl.rewards.reasoning import last_boxed

MAX_EXPRESSION = 200
MAX_DEPTH = 32
MAX_MAGNITUDE = 10**12

_REPLACEMENTS = (("\\times", "*"), ("\\cdot", "*"), ("\\div", "/"), ("×", "*"), ("·", "*"), ("÷", "/"), ("−", "-"),
                 ("\\left", ""), ("\\right", ""), ("$", ""), ("\\(", ""), ("\\)", ""))
_TOKEN = re.compile(r"\s*(?:(?P<number>[0-9]+)|(?P<op>[-+*/()\[\]]))")
_OPERATOR = re.compile(r"[-+*/×÷·−]|\\times|\\cdot|\\div")
_RUN = re.compile(r"[0-9+\-*/()\[\]\s]+")
_BLANK_REST = re.compile(r"\s*\Z")


class InvalidExpression(ValueError):
    """The text is not an expression of the accepted grammar (or overflows the bounds)."""


class _Parser:
    """expression := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ; factor := number | '(' expr ')'."""

    def __init__(self, text: str):
        self.tokens: list[tuple[str, str]] = []
        position = 0
        while position < len(text):
            match = _TOKEN.match(text, position)
            if match is None:
                if _BLANK_REST.match(text, position):
                    break
                raise InvalidExpression(f"unexpected {text[position:position + 10]!r}")
            kind = match.lastgroup or ""
            self.tokens.append((kind, match.group(kind)))
            position = match.end()
        self.index = 0
        self.depth = 0
        self.numbers: list[int] = []

    def parse(self) -> Fraction:
        if not self.tokens:
            raise InvalidExpression("empty")
        value = self.expression()
        if self.index != len(self.tokens):
            raise InvalidExpression("trailing tokens")
        return value

    def _peek(self) -> tuple[str, str] | None:
        return self.tokens[self.index] if self.index < len(self.tokens) else None

    def _check(self, value: Fraction) -> Fraction:
        if abs(value.numerator) > MAX_MAGNITUDE * max(value.denominator, 1) or value.denominator > MAX_MAGNITUDE:
            raise InvalidExpression("out of range")
        return value

    def expression(self) -> Fraction:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise InvalidExpression("too deeply nested")
        value = self.term()
        while (token := self._peek()) is not None and token[1] in ("+", "-"):
            self.index += 1
            right = self.term()
            value = self._check(value + right if token[1] == "+" else value - right)
        self.depth -= 1
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while (token := self._peek()) is not None and token[1] in ("*", "/"):
            self.index += 1
            right = self.factor()
            if token[1] == "/":
                if right == 0:
                    raise InvalidExpression("division by zero")
                value = self._check(value / right)
            else:
                value = self._check(value * right)
        return value

    def factor(self) -> Fraction:
        token = self._peek()
        if token is None:
            raise InvalidExpression("unexpected end")
        self.index += 1
        kind, text = token
        if kind == "number":
            if len(text) > 12:
                raise InvalidExpression("number too long")
            self.numbers.append(int(text))
            return Fraction(int(text))
        if text in ("(", "["):
            value = self.expression()
            closing = self._peek()
            if closing is None or closing[1] != {"(": ")", "[": "]"}[text]:
                raise InvalidExpression("unbalanced brackets")
            self.index += 1
            return value
        raise InvalidExpression(f"unexpected {text!r}")


def evaluate_expression(text: str) -> tuple[Fraction, list[int]]:
    """Exact value of an arithmetic expression and the integers it uses, in order.

    Raises:
        InvalidExpression: outside the grammar of the module docstring, too long, too deep or too large.
    """
    if not isinstance(text, str) or len(text) > MAX_EXPRESSION:
        raise InvalidExpression("not a string of at most 200 characters")
    for old, new in _REPLACEMENTS:
        text = text.replace(old, new)
    parser = _Parser(text)
    return parser.parse(), parser.numbers


def extract_equation(text: Any, *, max_chars: int = MAX_ANSWER_CHARS) -> str | None:
    """The expression side of the equation in the last ``max_chars`` characters of a completion (module docstring)."""
    check_max_chars(max_chars)
    if not isinstance(text, str) or not text.strip():
        return None
    text = text[-max_chars:]
    region = extract_answer(text)
    if region is None:
        region = last_boxed(text)
    if region is None:
        lines = [line for line in text.splitlines() if re.search(r"[0-9]", line) and _OPERATOR.search(line)]
        if not lines:
            return None
        region = lines[-1]
    boxed = last_boxed(region)
    if boxed is not None:
        region = boxed
    for old, new in _REPLACEMENTS:
        region = region.replace(old, new)
    region = region.strip()
    if not region:
        return None
    for side in region.split("="):
        # The longest run of expression characters holding a digit and an operator ("So 3*5+2" → "3*5+2").
        runs = [run.strip() for run in _RUN.findall(side) if re.search(r"[0-9]", run) and _OPERATOR.search(run)]
        if runs:
            return max(runs, key=len)
    return region.split("=")[0].strip() or None


def _numbers(value: Any, row: int, field: str) -> list[int]:
    if isinstance(value, str):
        value = [part for part in re.split(r"[\s,\[\]]+", value) if part]
    try:
        numbers = [int(v) for v in value]
    except (TypeError, ValueError):
        raise RewardError(f"dataset row {row} field {field!r} must list integers, got {value!r}") from None
    if any(n < 0 for n in numbers):
        raise RewardError(f"dataset row {row} field {field!r} must list non-negative integers, got {value!r}")
    return numbers


def countdown_score(text: Any, numbers: list[int], target: int | Fraction, *, require_all: bool = True,
                    format_score: float = 0.0, max_chars: int = MAX_ANSWER_CHARS) -> float:
    """The ``countdown`` score of one completion (see the module docstring)."""
    equation = extract_equation(text, max_chars=max_chars)
    if equation is None:
        return 0.0
    try:
        value, used = evaluate_expression(equation)
    except (InvalidExpression, ArithmeticError, RecursionError):
        return format_score
    given, taken = Counter(numbers), Counter(used)
    allowed = taken == given if require_all else all(taken[n] <= given[n] for n in taken)
    return 1.0 if allowed and value == Fraction(target) else format_score


def countdown(
    batch: RewardInput,
    *,
    numbers_field: str = "numbers",
    target_field: str = "target",
    output: str = "completions",
    require_all: bool = True,
    format_score: Annotated[float, Range(0, 1)] = 0.0,
    max_chars: Annotated[int, Range(1)] = MAX_ANSWER_CHARS,
) -> list[float]:
    """1 if the equation reaches the target with the given numbers, ``format_score`` if it is wrong, 0 if absent.

    Args:
        numbers_field: Dataset column with the given numbers (a list of integers or a string like ``"3 5 7"``).
        target_field: Dataset column with the target integer.
        output: Payload entry holding the model's text outputs.
        require_all: Every given number must be used exactly once (TinyZero, d1); False allows leaving some out
            (each still at most as often as given).
        format_score: Score of a found but wrong or rule-breaking equation (d1: 0.1).
        max_chars: Characters read per completion: its last ``max_chars`` (the equation comes at the end), which
            bounds the work per sample.
    """
    if not 0.0 <= format_score <= 1.0:
        raise RewardError(f"countdown format_score must be in [0, 1], got {format_score}")
    texts = completion_texts(batch, output, last_chars=max_chars)
    numbers_column, targets = batch.column(numbers_field), batch.column(target_field)
    scores = []
    for row, (text, numbers, target) in enumerate(zip(texts, numbers_column, targets, strict=True)):
        try:
            goal = int(target)
        except (TypeError, ValueError):
            raise RewardError(f"dataset row {row} field {target_field!r} must be an integer, got {target!r}") from None
        scores.append(countdown_score(text, _numbers(numbers, row, numbers_field), goal, require_all=require_all,
                                      format_score=format_score, max_chars=max_chars))
    return scores


__all__ = ["InvalidExpression", "countdown", "countdown_score", "evaluate_expression", "extract_equation"]
