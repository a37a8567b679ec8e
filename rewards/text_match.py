"""Verifiable text rewards: compare a completion with the row's reference answer.

Both rewards read ``payload[output]`` (a list of strings) and ``row[field]``, compare whitespace-separated tokens
and never raise on malformed output: anything that is not a string scores 0, and so does a completion longer than
``max_chars`` characters (both compare the whole completion, so it cannot be judged on a part; the cap bounds the
work per sample, which is linear in the text).
"""

from __future__ import annotations

from typing import Annotated, Any

from mmrl.registry import Range
from mmrl.reward import RewardInput
from mmrl.rewards.boxes import MAX_WHOLE_CHARS, check_max_chars


def _tokens(text: Any, max_chars: int | None = None) -> list[str] | None:
    """Whitespace tokens of a string; None for anything else or a string longer than ``max_chars``."""
    if not isinstance(text, str) or (max_chars is not None and len(text) > max_chars):
        return None
    return text.split()


def exact_match(batch: RewardInput, *, field: str = "solution", output: str = "completions",
                max_chars: Annotated[int, Range(1)] = MAX_WHOLE_CHARS) -> list[float]:
    """1 if the completion equals the reference up to whitespace, else 0.

    Args:
        field: Dataset column holding the reference answer.
        output: Payload entry holding the model's text outputs.
        max_chars: Longest completion compared, in characters; a longer one scores 0.
    """
    check_max_chars(max_chars)
    references = batch.column(field)
    completions = batch.output(output)
    scores = []
    for completion, reference in zip(completions, references, strict=True):
        predicted = _tokens(completion, max_chars)
        scores.append(float(predicted is not None and predicted == _tokens(str(reference))))
    return scores


def token_accuracy(batch: RewardInput, *, field: str = "solution", output: str = "completions",
                   max_chars: Annotated[int, Range(1)] = MAX_WHOLE_CHARS) -> list[float]:
    """Fraction of reference tokens reproduced at the right position, divided by the longer of the two lengths.

    Extra or missing tokens therefore cost as much as wrong ones; an empty completion against an empty reference
    scores 1.

    Args:
        field: Dataset column holding the reference answer.
        output: Payload entry holding the model's text outputs.
        max_chars: Longest completion compared, in characters; a longer one scores 0.
    """
    check_max_chars(max_chars)
    references = batch.column(field)
    completions = batch.output(output)
    scores = []
    for completion, reference in zip(completions, references, strict=True):
        predicted, target = _tokens(completion, max_chars), _tokens(str(reference))
        if predicted is None:
            scores.append(0.0)
            continue
        longest = max(len(predicted), len(target))
        if longest == 0:
            scores.append(1.0)
            continue
        # Lengths may differ: the longer one sets the denominator.
        correct = sum(p == t for p, t in zip(predicted, target, strict=False))
        scores.append(correct / longest)
    return scores
