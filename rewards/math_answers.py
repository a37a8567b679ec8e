"""GSM8K / MATH-style final answers: extraction from free text and numeric equivalence.

Registered reward ``gsm8k_answer`` (1 if the final answer equals the reference, else 0; never raises on model
output). The final answer of a text is, in order of preference:

1. the content of the last ``\\boxed{…}`` (MATH, Hendrycks et al. 2021, arXiv:2103.03874, writes its answers so;
   braces balanced);
2. what follows the last ``####`` on its line (GSM8K, Cobbe et al. 2021, arXiv:2110.14168, ends every reference
   solution with ``#### <answer>``);
3. the content of the last ``<answer>…</answer>`` block (d1's XML prompt format);
4. the last number of the text (integers, decimals, thousands separators, ``a/b`` fractions, a trailing ``%``).

The reference goes through the same extraction, so a GSM8K ``answer`` column (with its worked solution) or a MATH
``solution`` column can be used as they are. Equality is :func:`mmrl.rewards.reasoning.math_equal`: numbers
(fractions, LaTeX ``\\frac``, ``\\sqrt``, percents, ``$`` and ``\\text{}`` wrappers) within a relative tolerance, or
normalised strings when the reference is not numeric.

Unlike ``math`` (which reads answers from ``<answer>`` tags, the R1 format), this reward also understands ``####``
and prefers ``\\boxed{}`` anywhere in the text, which is what masked diffusion LMs prompted in the d1/SPG style write.
"""

from __future__ import annotations

import re
from typing import Any

from mmrl.reward import RewardInput
from mmrl.rewards.boxes import completion_texts, extract_answer
from mmrl.rewards.reasoning import last_boxed, math_equal

MAX_TEXT = 20_000  # answers are read from the last characters of longer texts (bounded work per sample)

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


def extract_final_answer(text: Any) -> str | None:
    """The final answer of a GSM8K/MATH-style text (see the module docstring), or None when there is none."""
    if not isinstance(text, str) or not text.strip():
        return None
    text = text[-MAX_TEXT:]
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    hashes = _HASHES.findall(text)
    if hashes and hashes[-1].strip():
        return hashes[-1].strip()
    answer = extract_answer(text)
    if answer is not None and answer.strip():
        return answer.strip()
    return last_number(text)


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
    rel_tol: float = 1e-4,
    abs_tol: float = 1e-8,
) -> list[float]:
    """1 if the completion's final answer equals the reference's, else 0 (GSM8K ``####``, MATH ``\\boxed{}``).

    Both sides are read with :func:`extract_final_answer`; a reference with no answer in it is compared as it is.

    Args:
        field: Dataset column with the reference (a number, a bare answer, or a worked solution ending in
            ``#### x`` or containing ``\\boxed{x}``).
        output: Payload entry holding the model's text outputs.
        rel_tol: Relative tolerance of the numeric comparison.
        abs_tol: Absolute tolerance of the numeric comparison.
    """
    texts = completion_texts(batch, output)
    references = batch.column(field)
    scores = []
    for text, reference in zip(texts, references, strict=True):
        target = extract_final_answer(reference) if isinstance(reference, str) else reference
        if target is None:
            target = reference
        prediction = extract_final_answer(text)
        scores.append(float(answers_equal(prediction, target, rel_tol=rel_tol, abs_tol=abs_tol)))
    return scores


__all__ = ["answers_equal", "extract_final_answer", "gsm8k_answer", "last_number"]
