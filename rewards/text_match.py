"""Verifiable text rewards: compare a completion with the row's reference answer.

Both rewards read ``payload[output]`` (a list of strings) and ``row[field]``, compare whitespace-separated tokens
and never raise on malformed output: anything that is not a string scores 0.
"""

from __future__ import annotations

from typing import Any

from mmrl.reward import RewardInput


def _tokens(text: Any) -> list[str] | None:
    return text.split() if isinstance(text, str) else None


def exact_match(batch: RewardInput, *, field: str = "solution", output: str = "completions") -> list[float]:
    """1 if the completion equals the reference up to whitespace, else 0.

    Args:
        field: Dataset column holding the reference answer.
        output: Payload entry holding the model's text outputs.
    """
    references = batch.column(field)
    completions = batch.output(output)
    scores = []
    for completion, reference in zip(completions, references, strict=True):
        predicted = _tokens(completion)
        scores.append(float(predicted is not None and predicted == _tokens(str(reference))))
    return scores


def token_accuracy(batch: RewardInput, *, field: str = "solution", output: str = "completions") -> list[float]:
    """Fraction of reference tokens reproduced at the right position, divided by the longer of the two lengths.

    Extra or missing tokens therefore cost as much as wrong ones; an empty completion against an empty reference
    scores 1.

    Args:
        field: Dataset column holding the reference answer.
        output: Payload entry holding the model's text outputs.
    """
    references = batch.column(field)
    completions = batch.output(output)
    scores = []
    for completion, reference in zip(completions, references, strict=True):
        predicted, target = _tokens(completion), _tokens(str(reference))
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
