"""Rule-based reasoning rewards for R1-style training: output format, multiple choice and math answers.

Registered rewards (all 0/1 floats; they never raise on malformed model output):

- ``format``: the completion is ``<think>…</think>`` followed by ``<answer>…</answer>`` and nothing else, the
  format reward of R1-V, Visual-RFT (arXiv:2503.01785) and VLM-R1's general tasks (arXiv:2504.07615; its REC
  ``format_reward_rec`` differs: a search anywhere, with a box required inside the answer, docs/rewards.md).
- ``choice``: the option letter in the answer equals the ground-truth letter.
- ``math``: the final answer is numerically equal to the ground truth (fractions, decimals, percents, LaTeX).

Answers are read from the last ``<answer>…</answer>`` block (see :func:`mmrl.rewards.boxes.extract_answer`). A blank
answer never scores on ``choice`` or ``math``: Visual-RFT's substring classification reward gave 1 to empty
answers and models collapsed to them (Visual-RFT issue #176).

``math`` uses a small exact-enough numeric evaluator written for this module rather than ``sympy`` parsing, which
evaluates its input with Python's ``eval`` and can hang on adversarial expressions.

Every text is read in time linear in its length, and each reward reads at most ``max_chars`` characters of a
completion: ``choice`` and ``math`` its last ones (the answer comes at the end), ``format`` all of it (a longer
completion scores 0).
"""

from __future__ import annotations

import functools
import math
import re
from typing import Annotated, Any

from mmrl.registry import Range
from mmrl.reward import RewardError, RewardInput
from mmrl.rewards.boxes import MAX_ANSWER_CHARS, MAX_WHOLE_CHARS, check_max_chars, completion_texts, extract_answer

# ---------------------------------------------------------------------------------------------------- format

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_ANSWER_OPEN, _ANSWER_CLOSE = "<answer>", "</answer>"
_SPACES = re.compile(r"\s*")


def is_think_answer(text: str) -> bool:
    """Whether ``text`` fullmatches ``\\s*<think>.*?</think>\\s*<answer>.*?</answer>\\s*`` (DOTALL), in linear time.

    Matching that pattern with ``re`` backtracks: on ``"<think>" + "</think><answer>" * k`` every ``</think>``
    restarts a scan for ``</answer>`` to the end of the text, O(k · len) in all. The pattern only asks that, once
    the surrounding whitespace is stripped, the text starts with ``<think>``, ends with ``</answer>``, and holds
    ``</think>``, optional whitespace and ``<answer>`` in between (the two ``.*?`` take anything else). This scans
    the occurrences of ``</think>`` once each; the whitespace runs after distinct occurrences are disjoint.
    """
    core = text.strip()  # str.strip removes exactly the characters re's \s matches (str.isspace)
    if not (core.startswith(_THINK_OPEN) and core.endswith(_ANSWER_CLOSE)):
        return False
    middle_end = len(core) - len(_ANSWER_CLOSE)  # "<answer>" must end before the final "</answer>"
    position = len(_THINK_OPEN)
    while (close := core.find(_THINK_CLOSE, position, middle_end)) >= 0:
        after = _SPACES.match(core, close + len(_THINK_CLOSE)).end()
        if core.startswith(_ANSWER_OPEN, after, middle_end):
            return True
        position = close + len(_THINK_CLOSE)
    return False


def format_reward(batch: RewardInput, *, output: str = "completions",
                  max_chars: Annotated[int, Range(1)] = MAX_WHOLE_CHARS) -> list[float]:
    """1 if the completion is ``<think>…</think>`` then ``<answer>…</answer>`` and nothing else, else 0.

    The test is ``re.fullmatch(r"<think>.*?</think>\\s*<answer>.*?</answer>", text, re.DOTALL)`` (newlines allowed
    inside the tags, as in R1-V, Visual-RFT and VLM-R1), with leading and trailing whitespace of the completion
    ignored, computed in linear time by :func:`is_think_answer`. The format reward alone does not check the answer's
    content; pair it with an answer reward.

    Args:
        output: Payload entry holding the model's text outputs.
        max_chars: Longest completion judged, in characters; a longer one scores 0 (the format concerns the whole
            text, from its first character to its last, so it cannot be judged on a part).
    """
    check_max_chars(max_chars)
    return [float(len(text) <= max_chars and is_think_answer(text)) for text in completion_texts(batch, output)]


# ---------------------------------------------------------------------------------------------------- choice

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}`` (or ``\\fbox{…}``) in ``text`` whose braces close; ``None`` if none does.

    One pass pairs every brace from the first ``\\boxed{`` on with its closing brace (a stack of open braces), so
    unclosed ``\\boxed{`` spam costs linear time, not a scan to the end of the text per occurrence.
    """
    starts = [m.end() for m in _BOXED.finditer(text)]  # positions just after each "\boxed{"
    if not starts:
        return None
    closing: dict[int, int] = {}  # position of a "{" → position of its "}"
    opened: list[int] = []
    for brace in _BRACE.finditer(text, starts[0] - 1):
        if brace.group() == "{":
            opened.append(brace.start())
        elif opened:
            closing[opened.pop()] = brace.start()
    for start in reversed(starts):
        end = closing.get(start - 1)
        if end is not None:
            return text[start:end]
    return None


_ARTICLE_NEXT = re.compile(r"\s+[a-z]")  # "A" then a lowercase word: the article, not option A


def _strip_markup(text: str) -> str:
    text = re.sub(r"\\(?:text|textbf|mathrm|mathbf)\s*\{([^{}]*)\}", r"\1", text)
    return text.replace("**", "").replace("`", "").replace("$", "").strip()


def _option_texts(options: Any, letters: str) -> dict[str, str]:
    """{letter: normalised option text} from a list of option strings or a {letter: text} mapping."""
    if isinstance(options, dict):
        pairs = [(str(k).strip().upper(), v) for k, v in options.items()]
    elif isinstance(options, (list, tuple)):
        pairs = list(zip(letters, options, strict=False))
    else:
        return {}
    result = {}
    for letter, option in pairs:
        if isinstance(option, str):
            body = re.sub(r"^\s*\(?[A-Z]\s*[).:]\s*", "", option)  # "A. Paris" / "(A) Paris" → "Paris"
            result[letter] = _normalise_text(body)
    return result


def _normalise_text(text: str) -> str:
    return " ".join(_strip_markup(text).lower().rstrip(".").split())


def extract_choice(text: Any, letters: str = "ABCDE", options: Any = None) -> str | None:
    """The option letter a text answers with, or ``None`` when it is missing or ambiguous.

    Reads the ``<answer>`` block when present (else the whole text), and inside it the last ``\\boxed{}`` if any.
    Heuristics, in order:

    1. The answer is just a letter, possibly bracketed or followed by ``.``/``:`` (``"B"``, ``"(b)"``, ``"B."``).
    2. It starts with a letter label: ``"B. 42"``, ``"(B) 42"``, ``"B) 42"``, ``"B: 42"``.
    3. The last phrase like ``"answer is B"``, ``"answer: (B)"``, ``"option B"``, ``"choice B"``.
    4. The answer equals the text of exactly one option (when ``options`` are given).
    5. Exactly one distinct letter appears in parentheses (``"… (C) …"``).
    6. Exactly one distinct standalone capital letter appears, unless it is only ever ``"A"`` followed by a
       lowercase word (the article). Hedges such as ``"A or B"`` name two letters and yield ``None``.

    Args:
        text: The model output.
        letters: The valid option letters (uppercase).
        options: Optional option texts: a list (in letter order) or a ``{letter: text}`` mapping.
    """
    if not isinstance(text, str):
        return None
    region = extract_answer(text)
    region = text if region is None else region
    boxed = last_boxed(region)
    answer = _strip_markup(boxed if boxed is not None else region)
    if not answer or not letters:
        return None
    # No pattern below has two unbounded quantifiers that can share a run of characters (e.g. "\s*:?\s*" could
    # split a run of n spaces in n ways, and retry each split at every failure: quadratic, 13 s on "answer" + 16,000
    # spaces + "z"); each whitespace run is followed by a token that cannot start with whitespace.
    valid = re.escape(letters.upper())
    whole = re.fullmatch(rf"[(\[]?\s*([{valid}])\s*(?:[)\]]\s*)?[.:]?", answer, re.IGNORECASE)
    if whole:
        return whole.group(1).upper()
    label = re.match(rf"[(\[]?([{valid}])(?:[)\]]\s*[.:]?|\s*[.:])(?:\s|$)", answer)
    if label:
        return label.group(1)
    phrases = re.findall(
        rf"(?i:answer|option|choice)\s*(?:(?i:is|would be|should be)\s*)?(?::\s*)?(?i:option\s*)?[(\[]?"
        rf"([{valid}])(?![A-Za-z0-9])",
        answer,
    )
    if phrases:
        return phrases[-1]
    if options is not None:
        normalised = _normalise_text(answer)
        hits = [letter for letter, body in _option_texts(options, letters.upper()).items() if body == normalised]
        if len(hits) == 1 and hits[0] in letters.upper():
            return hits[0]
    bracketed = set(re.findall(rf"\(([{valid}])\)", answer))
    if len(bracketed) == 1:
        return bracketed.pop()
    standalone = list(re.finditer(rf"(?<![A-Za-z0-9'])([{valid}])(?![A-Za-z0-9'])", answer))
    distinct = {m.group(1) for m in standalone}
    article = all(m.group(1) == "A" and _ARTICLE_NEXT.match(answer, m.end()) for m in standalone)
    if len(distinct) == 1 and not article:
        return distinct.pop()
    return None


def choice(
    batch: RewardInput,
    *,
    field: str = "solution",
    output: str = "completions",
    letters: str = "ABCDE",
    options_field: str | None = None,
    max_chars: Annotated[int, Range(1)] = MAX_ANSWER_CHARS,
) -> list[float]:
    """1 if the option letter of the answer (see :func:`extract_choice`) equals the ground-truth letter, else 0.

    The ground truth may be a letter (``"B"``, ``"(B)"``, ``"B. Paris"``, ``"<answer>B</answer>"``) or, with
    ``options_field``, the text of the correct option. An answer with no letter, several candidate letters or a
    blank answer scores 0.

    Args:
        field: Dataset column with the correct option.
        output: Payload entry holding the model's text outputs.
        letters: Valid option letters, in order (``"ABCDE"``; use e.g. ``"ABCDEFGHIJ"`` for ten options).
        options_field: Optional dataset column with the option texts (a list in letter order or a letter → text
            mapping), so that an answer quoting an option's text counts as that letter.
        max_chars: Characters read per completion: its last ``max_chars`` (the answer comes at the end), which
            bounds the work per sample.
    """
    texts = completion_texts(batch, output, last_chars=max_chars)
    references = batch.column(field)
    option_lists = batch.column(options_field) if options_field else [None] * len(texts)
    scores = []
    for i, (text, reference, options) in enumerate(zip(texts, references, option_lists, strict=True)):
        target = extract_choice(str(reference), letters, options)
        if target is None:
            raise RewardError(
                f"dataset row {i} field {field!r} names no option letter among {letters!r}: {reference!r}"
            )
        scores.append(float(extract_choice(text, letters, options) == target))
    return scores


# ---------------------------------------------------------------------------------------------------- math values


class _Unparsable(ValueError):
    """The expression is outside the supported grammar."""


_MAX_EXPRESSION = 400
_MAX_DEPTH = 40
_MAX_MAGNITUDE = 1e300

_TOKEN = re.compile(
    r"\s*(?:(?P<number>(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]*)?(?:[eE][-+]?[0-9]{1,4})?"
    r"|\.[0-9]+(?:[eE][-+]?[0-9]{1,4})?)"
    r"|(?P<command>\\[A-Za-z]+)|(?P<word>pi|π)|(?P<symbol>[-+*/^(){}\[\]%]))"
)

_REPLACEMENTS = (
    ("\\left", ""), ("\\right", ""), ("\\displaystyle", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""),
    ("\\:", ""), ("\\ ", " "), ("~", " "), ("\\%", "%"), ("\\$", ""), ("$", ""), ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"), ("\\cdot", "*"), ("\\times", "*"), ("\\div", "/"), ("×", "*"), ("÷", "/"),
    ("−", "-"), ("^\\circ", ""), ("^{\\circ}", ""), ("°", ""), ("\\(", ""), ("\\)", ""), ("\\[", ""), ("\\]", ""),
)


# A pure function of a string of at most _MAX_EXPRESSION characters (both callers check), called on the same
# answers and references sample after sample and step after step: cached.
@functools.lru_cache(maxsize=4096)
def _normalise_expression(text: str) -> str:
    text = re.sub(r"\\(?:text|mathrm|textbf|mbox|operatorname)\s*\{([^{}]*)\}", r" \1 ", text)
    for old, new in _REPLACEMENTS:
        text = text.replace(old, new)
    text = re.sub(r"\\frac\s*([0-9])\s*([0-9])", r"\\frac{\1}{\2}", text)  # \frac12 → \frac{1}{2}
    # A mixed number 2\frac{1}{2} is 2 + 1/2, not 2 · 1/2.
    text = re.sub(r"(?<![0-9.])([0-9]+)\s*\\frac\{([0-9]+)\}\{([0-9]+)\}", r"(\1+\2/\3)", text)
    text = text.strip().rstrip(".").strip()
    if "=" in text:  # "x = 3/4" → "3/4"
        text = text.rsplit("=", 1)[1].strip()
    return text


class _Evaluator:
    """Recursive-descent evaluator for + − × ÷ ^ %, parentheses/braces, \\frac, \\sqrt and π, on floats.

    Implicit multiplication is accepted before a bracket, a command or π (``2\\pi``, ``3(4)``), not between two
    numbers. Results with a magnitude above 1e300, complex or non-finite values are rejected.
    """

    def __init__(self, text: str):
        self.tokens: list[tuple[str, str]] = []
        position = 0
        while position < len(text):
            match = _TOKEN.match(text, position)
            if match is None or match.end() == position:
                if text[position:].strip() == "":
                    break
                raise _Unparsable(text[position:])
            kind = match.lastgroup or ""
            self.tokens.append((kind, match.group(kind)))
            position = match.end()
        self.index = 0
        self.depth = 0
        self.percent = False

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.index] if self.index < len(self.tokens) else None

    def take(self, value: str | None = None) -> tuple[str, str]:
        token = self.peek()
        if token is None or (value is not None and token[1] != value):
            raise _Unparsable(f"expected {value!r}")
        self.index += 1
        return token

    def evaluate(self) -> float:
        value = self.expression()
        if self.peek() is not None:
            raise _Unparsable("trailing tokens")
        return value

    def _check(self, value: Any) -> float:
        if isinstance(value, complex) or not math.isfinite(value) or abs(value) > _MAX_MAGNITUDE:
            raise _Unparsable("out of range")
        return float(value)

    def expression(self) -> float:
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise _Unparsable("too deeply nested")
        value = self.term()
        while (token := self.peek()) is not None and token[1] in "+-" and token[0] == "symbol":
            self.take()
            right = self.term()
            value = self._check(value + right if token[1] == "+" else value - right)
        self.depth -= 1
        return value

    def term(self) -> float:
        value = self.unary()
        while (token := self.peek()) is not None:
            if token[0] == "symbol" and token[1] in "*/":
                self.take()
                right = self.unary()
                if token[1] == "/":
                    if right == 0:
                        raise _Unparsable("division by zero")
                    value = self._check(value / right)
                else:
                    value = self._check(value * right)
            elif token[0] in ("command", "word") or (token[0] == "symbol" and token[1] in "({"):
                value = self._check(value * self.unary())  # implicit multiplication
            else:
                break
        return value

    def unary(self) -> float:
        token = self.peek()
        if token is not None and token[0] == "symbol" and token[1] in "+-":
            self.take()
            value = self.unary()
            return -value if token[1] == "-" else value
        return self.power()

    def power(self) -> float:
        base = self.postfix()
        token = self.peek()
        if token is not None and token == ("symbol", "^"):
            self.take()
            exponent = self.unary()
            if abs(exponent) > 1000 or (base == 0 and exponent < 0):
                raise _Unparsable("exponent out of range")
            try:
                return self._check(base ** exponent)
            except OverflowError:
                raise _Unparsable("overflow") from None
        return base

    def postfix(self) -> float:
        value = self.primary()
        while self.peek() == ("symbol", "%"):
            self.take()
            self.percent = True
            value = value / 100.0
        return value

    def group(self) -> float:
        token = self.peek()
        if token is not None and token[1] in ("{", "("):
            return self.primary()
        if token is not None and token[0] == "number":  # \sqrt2
            return self.primary()
        raise _Unparsable("expected a group")

    def primary(self) -> float:
        kind, value = self.take()
        if kind == "number":
            return self._check(float(value.replace(",", "")))
        if kind == "word":
            return math.pi
        if kind == "symbol" and value in "({[":
            closing = {"(": ")", "{": "}", "[": "]"}[value]
            inner = self.expression()
            self.take(closing)
            return inner
        if kind == "command":
            if value == "\\pi":
                return math.pi
            if value == "\\frac":
                numerator, denominator = self.group(), self.group()
                if denominator == 0:
                    raise _Unparsable("division by zero")
                return self._check(numerator / denominator)
            if value == "\\sqrt":
                degree = 2.0
                if self.peek() == ("symbol", "["):
                    self.take()
                    degree = self.expression()
                    self.take("]")
                radicand = self.group()
                if radicand < 0 or degree <= 0:
                    raise _Unparsable("bad root")
                return self._check(radicand ** (1.0 / degree))
        raise _Unparsable(f"unexpected {value!r}")


def math_value(text: Any) -> tuple[float, bool] | None:
    """Evaluate a final answer to a number: ``(value, had_percent)``, or ``None`` if it is not a plain number.

    Handles integers, decimals, thousands separators (``1,234``), fractions (``3/4``, ``\\frac{3}{4}``,
    ``\\dfrac34``), percents (``75%``, ``75\\%``, returned as 0.75 with ``had_percent``), signs, ``^``, ``\\sqrt``,
    ``\\pi``, ``\\times``/``\\cdot``, ``$…$`` and ``\\text{…}`` wrappers, degree signs, and a leading ``x =``.
    """
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        try:
            return (float(text), False) if math.isfinite(float(text)) else None
        except OverflowError:
            return None
    if not isinstance(text, str) or len(text) > _MAX_EXPRESSION:
        return None
    expression = _normalise_expression(text)
    if not expression:
        return None
    try:
        evaluator = _Evaluator(expression)
        value = evaluator.evaluate()
    except (_Unparsable, ArithmeticError, RecursionError):
        return None
    return value, evaluator.percent


_LAST_NUMBER = re.compile(
    r"(?<![0-9.])-?(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]{1,40})(?:\.[0-9]{1,40})?"
    r"(?:\s*/\s*(?:[0-9]{1,40})(?:\.[0-9]{1,40})?)?\s*%?"
)


def _last_number(text: str) -> str | None:
    numbers = _LAST_NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


_BOX_TOKEN_ANSWER = re.compile(r"<\|begin_of_box\|>([^<]{0,2000})<\|end_of_box\|>")


def last_box_tokens(text: str) -> str | None:
    """Content of the last ``<|begin_of_box|>…<|end_of_box|>`` pair in ``text`` (GLM-4.1V / GLM-4.5V mark their final
    answer so: zai-org/GLM-V@8fc9756 ``glmv_reward/src/glmv_reward/utils/text.py`` ``find_boxed_content``), or
    ``None``."""
    found = None
    for match in _BOX_TOKEN_ANSWER.finditer(text):
        found = match.group(1)
    return found


def extract_math_answer(text: Any) -> str | None:
    """The final answer of a math completion as a string, or ``None``.

    The last ``\\boxed{…}`` of the answer region (the ``<answer>`` block, else the whole text), else its last
    ``<|begin_of_box|>…<|end_of_box|>`` (GLM's answer box, :func:`last_box_tokens`); else the ``<answer>`` content;
    else, without an answer tag, the last number of the text (including ``a/b`` and ``%``).
    """
    if not isinstance(text, str):
        return None
    answer = extract_answer(text)
    scope = text if answer is None else answer
    boxed = last_boxed(scope)
    if boxed is None:
        boxed = last_box_tokens(scope)
    if boxed is not None:
        candidate: str | None = boxed
    elif answer is not None:
        candidate = answer
    else:
        candidate = _last_number(text)
    if candidate is None or not candidate.strip():
        return None
    return candidate.strip()


def _close(a: float, b: float, rel_tol: float, abs_tol: float) -> bool:
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol)


def _candidates(value: tuple[float, bool]) -> list[float]:
    number, had_percent = value
    return [number, number * 100.0] if had_percent else [number]


_INTEGER = re.compile(r"[-+]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)")


def integer_literal(value: Any) -> int | None:
    """The integer ``value`` is written as (``42``, ``-7``, ``1,000``, ``$12$``, ``x = 5``), else ``None``.

    A Python ``int`` counts; ``12.0``, ``3/4``, ``75%`` or ``\\frac{4}{2}`` do not (they are not written as integers).
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if not isinstance(value, str) or len(value) > _MAX_EXPRESSION:
        return None
    text = _normalise_expression(value)
    return int(text.replace(",", "")) if _INTEGER.fullmatch(text) else None


def math_equal(prediction: Any, reference: Any, rel_tol: float = 1e-4, abs_tol: float = 1e-8) -> bool:
    """Whether a predicted final answer equals the reference answer.

    Both are evaluated by :func:`math_value`. Numbers are equal within ``rel_tol``/``abs_tol``; a percent on either
    side also matches its value ×100 (``75%`` equals both ``0.75`` and ``75``). If the prediction does not evaluate
    as a whole, its last number is tried. A reference written as an integer (:func:`integer_literal`) must be met
    exactly: an integer prediction must be the same integer (compared as integers, so large ones too), any other
    prediction must lie within ``abs_tol`` of it (``rel_tol`` would let 10001 pass for 10000). If the reference is
    not numeric, the normalised strings must be equal (case, spaces, ``$``, ``\\text{}`` and a trailing period
    ignored). A blank prediction is never equal.
    """
    if prediction is None or (isinstance(prediction, str) and not prediction.strip()):
        return False
    target = math_value(reference)
    if target is None:
        if not isinstance(reference, str) or not reference.strip() or not isinstance(prediction, str):
            return False
        return _normalise_text(prediction).replace(" ", "") == _normalise_text(reference).replace(" ", "")
    value = math_value(prediction)
    if value is None and isinstance(prediction, str):
        prediction = _last_number(prediction)
        value = math_value(prediction) if prediction is not None else None
    if value is None:
        return False
    integer = integer_literal(reference)
    if integer is not None:
        predicted_integer = integer_literal(prediction)
        if predicted_integer is not None:
            return predicted_integer == integer
        return any(abs(p - integer) <= abs_tol for p in _candidates(value))
    return any(_close(p, t, rel_tol, abs_tol) for p in _candidates(value) for t in _candidates(target))


def _reference_answer(reference: Any) -> Any:
    if not isinstance(reference, str):
        return reference
    answer = extract_answer(reference)
    scope = reference if answer is None else answer
    boxed = last_boxed(scope)
    return (boxed if boxed is not None else scope).strip()


def math_reward(
    batch: RewardInput,
    *,
    field: str = "solution",
    output: str = "completions",
    rel_tol: Annotated[float, Range(0)] = 1e-4,
    abs_tol: Annotated[float, Range(0)] = 1e-8,
    max_chars: Annotated[int, Range(1)] = MAX_ANSWER_CHARS,
) -> list[float]:
    """1 if the completion's final answer equals the ground truth numerically (or textually), else 0.

    The final answer is the last ``\\boxed{…}``, else the last GLM answer box (``<|begin_of_box|>…<|end_of_box|>``),
    else the ``<answer>`` content, else (without an answer tag) the last
    number of the completion (see :func:`extract_math_answer`); equality is :func:`math_equal`. The ground truth may
    be a number or a string (its ``\\boxed{}`` or ``<answer>`` content is used when present). Expressions with
    variables are compared as normalised strings only; there is no symbolic algebra.

    Args:
        field: Dataset column with the reference answer.
        output: Payload entry holding the model's text outputs.
        rel_tol: Relative tolerance of the numeric comparison (not applied to a reference written as an integer).
        abs_tol: Absolute tolerance of the numeric comparison (matters for answers near 0).
        max_chars: Characters read per completion: its last ``max_chars`` (the answer comes at the end), which
            bounds the work per sample.
    """
    texts = completion_texts(batch, output, last_chars=max_chars)
    references = batch.column(field)
    scores = []
    for text, reference in zip(texts, references, strict=True):
        prediction = extract_math_answer(text)
        scores.append(float(math_equal(prediction, _reference_answer(reference), rel_tol, abs_tol)))
    return scores


__all__ = [
    "choice",
    "extract_choice",
    "extract_math_answer",
    "format_reward",
    "integer_literal",
    "is_think_answer",
    "last_box_tokens",
    "last_boxed",
    "math_equal",
    "math_reward",
    "math_value",
]
