"""GSM8K / MATH-style final answers: extraction from free text and numeric equivalence.

Registered reward ``gsm8k_answer`` (1 if the final answer equals the reference, else 0; never raises on model
output). A text can give its final answer in three formats:

- ``answer``: the content of the last ``<answer>…</answer>`` block (d1's XML prompt format, github
  dllm-reasoning/d1 ``diffu-grpo/reward_func.py``), or the last ``\\boxed{…}`` inside it;
- ``boxed``: the content of the last ``\\boxed{…}`` (MATH, Hendrycks et al. 2021, arXiv:2103.03874, writes its
  answers so; braces balanced);
- ``hashes``: what follows the last ``####`` on its line (GSM8K, Cobbe et al. 2021, arXiv:2110.14168, ends every
  reference solution with ``#### <answer>``).

The final answer is the one in the format the prompt asked for when the text has it, else the first present in the
order answer, boxed, hashes, else the last number of the text (integers, decimals, thousands separators, ``a/b``
fractions, a trailing ``%``). Which format the prompt asked for is the ``answer_format`` option; by default
(``auto``) it is read from the row's ``prompt``: the format whose marker (``<answer>``, ``\\boxed``, ``####``) the
prompt names, when it names exactly one. An ``<answer>`` block goes first otherwise: a model closes such a tag only
to give its final answer, whereas ``\\boxed{}`` also appears in worked steps.

The reference goes through the same extraction (in the default order), so a GSM8K ``answer`` column (with its
worked solution) or a MATH ``solution`` column can be used as they are. Equality is
:func:`mmrl.rewards.reasoning.math_equal`: numbers (fractions, LaTeX ``\\frac``, ``\\sqrt``, percents, ``$`` and
``\\text{}`` wrappers) within a relative tolerance, exactly for a reference written as an integer, or normalised
strings when the reference is not numeric.

Unlike ``math`` (which reads answers from ``<answer>`` tags, the R1 format), this reward also understands ``####``
and ``\\boxed{}`` outside the tags, which is what masked diffusion LMs prompted in the d1/SPG style write. Only the
last ``max_chars`` characters of a completion are read (references are read whole).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from mmrl.registry import Range
from mmrl.reward import RewardError, RewardInput
from mmrl.rewards.boxes import MAX_ANSWER_CHARS, check_max_chars, completion_text, completion_texts, extract_answer
from mmrl.rewards.reasoning import last_boxed, math_equal

AnswerFormat = Literal["auto", "answer", "boxed", "hashes"]
FORMATS: tuple[str, ...] = ("answer", "boxed", "hashes")  # the default order of preference
_MARKERS = {"answer": "<answer>", "boxed": "\\boxed", "hashes": "####"}

_HASHES = re.compile(r"####[ \t]*([^\n]*)")
_NUMBER = re.compile(
    r"(?<![0-9.])-?(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]{1,40})(?:\.[0-9]{1,40})?"
    r"(?:[ \t]*/[ \t]*[0-9]{1,40}(?:\.[0-9]{1,40})?)?[ \t]*%?"
)


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (with its sign, decimals, ``/denominator`` and ``%``), or None."""
    found = None
    for match in _NUMBER.finditer(text):
        found = match.group(0)
    return found.strip() if found is not None else None


def _check_format(answer_format: Any) -> None:
    if answer_format not in FORMATS:
        raise RewardError(
            f"answer_format must be answer, boxed or hashes (or auto in gsm8k_answer), got {answer_format!r}"
        )


def _in_format(text: str, answer_format: str) -> str | None:
    """The non-blank answer ``text`` gives in ``answer_format`` (one of :data:`FORMATS`), else None."""
    if answer_format == "answer":
        found = extract_answer(text)
        if found is not None:
            boxed = last_boxed(found)
            found = boxed if boxed is not None and boxed.strip() else found
    elif answer_format == "boxed":
        found = last_boxed(text)
    else:
        hashes = _HASHES.findall(text)
        found = hashes[-1] if hashes else None
    return found.strip() if found is not None and found.strip() else None


def extract_final_answer(text: Any, answer_format: str | None = None, *,
                         max_chars: int | None = MAX_ANSWER_CHARS) -> str | None:
    """The final answer of a GSM8K/MATH-style text (see the module docstring), or None when there is none.

    Args:
        text: The text (only its last ``max_chars`` characters are read).
        answer_format: The format tried first (``answer``, ``boxed`` or ``hashes``); None keeps the default order.
        max_chars: How many characters, from the end of the text, are read (None: all).
    """
    if max_chars is not None:
        check_max_chars(max_chars)
    if answer_format is not None:
        _check_format(answer_format)
    if not isinstance(text, str) or not text.strip():
        return None
    text = text if max_chars is None else text[-max_chars:]
    order = FORMATS if answer_format is None else (answer_format, *(f for f in FORMATS if f != answer_format))
    for candidate in order:
        found = _in_format(text, candidate)
        if found is not None:
            return found
    return last_number(text)


def _prompt_text(prompt: Any) -> str:
    """The text of a prompt: a string, or every message's text of a conversation (string or text-part content)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        return "\n".join(completion_text([message]) for message in prompt if isinstance(message, dict))
    return ""


def requested_format(prompt: Any) -> str | None:
    """The answer format a prompt asks for: the one of :data:`FORMATS` whose marker it names, if it names exactly one.

    The markers are ``<answer>``, ``\\boxed`` and ``####``; a prompt naming none or several gives None.
    """
    text = _prompt_text(prompt)
    named = [answer_format for answer_format in FORMATS if _MARKERS[answer_format] in text]
    return named[0] if len(named) == 1 else None


def answers_equal(prediction: Any, reference: Any, *, rel_tol: float = 1e-4, abs_tol: float = 1e-8) -> bool:
    """Whether two final answers (already extracted) are the same number, or the same normalised text."""
    if prediction is None or reference is None:
        return False
    if isinstance(reference, (int, float)) and not isinstance(reference, bool):
        reference = repr(reference)
    return math_equal(prediction, reference, rel_tol=rel_tol, abs_tol=abs_tol)


def gsm8k_answer(
    batch: RewardInput,
    *,
    field: str = "solution",
    output: str = "completions",
    rel_tol: Annotated[float, Range(0)] = 1e-4,
    abs_tol: Annotated[float, Range(0)] = 1e-8,
    answer_format: AnswerFormat = "auto",
    max_chars: Annotated[int, Range(1)] = MAX_ANSWER_CHARS,
) -> list[float]:
    """1 if the completion's final answer equals the reference's, else 0 (GSM8K ``####``, MATH ``\\boxed{}``).

    Both sides are read with :func:`extract_final_answer`; a reference with no answer in it is compared as it is.

    Args:
        field: Dataset column with the reference (a number, a bare answer, or a worked solution ending in
            ``#### x`` or containing ``\\boxed{x}``).
        output: Payload entry holding the model's text outputs.
        rel_tol: Relative tolerance of the numeric comparison (not applied to a reference written as an integer,
            which must be met exactly).
        abs_tol: Absolute tolerance of the numeric comparison.
        answer_format: The format the prompt asks the answer in, read first when the completion has several:
            ``answer`` (``<answer>`` tags), ``boxed`` (``\\boxed{}``), ``hashes`` (``####``), or ``auto``: the
            one the row's ``prompt`` names (``<answer>``, ``\\boxed`` or ``####``), and ``answer`` first when it
            names none or several (set it when the format is asked in a system prompt the rows do not hold).
        max_chars: Characters read per completion: its last ``max_chars`` (the answer comes at the end), which
            bounds the work per sample. References are read whole.
    """
    if answer_format != "auto":
        _check_format(answer_format)
    check_max_chars(max_chars)
    texts = completion_texts(batch, output)
    references = batch.column(field)
    # The G samples of a group share their row, and often their text: each distinct (text, format, reference) is
    # scored once per call (extraction and comparison are pure functions of them).
    def score(text: Any, wanted: str | None, reference: Any) -> float:
        target = extract_final_answer(reference, max_chars=None) if isinstance(reference, str) else reference
        prediction = extract_final_answer(text, wanted, max_chars=max_chars)
        return float(answers_equal(prediction, reference if target is None else target, rel_tol=rel_tol,
                                   abs_tol=abs_tol))

    scored: dict[tuple[Any, ...], float] = {}
    scores = []
    for row, text, reference in zip(batch.rows, texts, references, strict=True):
        wanted = requested_format(row.get("prompt")) if answer_format == "auto" else answer_format
        reference_key = _memo_key(reference)
        if reference_key is None or not isinstance(text, str):
            scores.append(score(text, wanted, reference))
            continue
        key = (text, wanted, reference_key)
        if key not in scored:
            scored[key] = score(text, wanted, reference)
        scores.append(scored[key])
    return scores


def _memo_key(value: Any) -> tuple[type, Any] | None:
    """A dictionary key for a reference (its type kept, so ``1`` and ``"1"`` and ``1.0`` stay apart), or None for a
    value that cannot be one (a list, a dict)."""
    if isinstance(value, float):
        return float, repr(value)  # -0.0 and 0.0 are read differently (repr), and nan != nan
    if isinstance(value, (str, int, bool)) or value is None:
        return type(value), value
    return None


__all__ = ["FORMATS", "answers_equal", "extract_final_answer", "gsm8k_answer", "last_number", "requested_format"]
