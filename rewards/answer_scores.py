"""Answer scores of Video-R1's non-multiple-choice questions: numbers, OCR transcriptions, free-form text, regression.

Video-R1 (Feng et al. 2025, arXiv:2503.21776) trains on a mix of question types, each scored by its own accuracy
rule (tulerfeng/Video-R1@59d65c3, ``src/r1-v/src/open_r1/grpo.py`` ``accuracy_reward``, L66-165):

==============  =======================  ======================================================================
Video-R1 type   mmrl reward              score of the ``<answer>`` content against the reference's
==============  =======================  ======================================================================
``numerical``   ``numeric_match``        1 if both are numbers equal after rounding to 2 decimals, and either
                                         both or neither contain a ``.`` or ``,`` (L122-132); else 0
``OCR``         ``word_accuracy``        1 − word error rate (word-level Levenshtein distance / reference
                                         words), clipped to [0, 1] (L83-100, L134-137)
``free-form``   ``rouge``                mean F-measure of ROUGE-1, ROUGE-2 and ROUGE-L with Porter stemming
                                         (``rouge_score``, L102-106, L138-140)
``regression``  ``relative_accuracy``    1 − min(1, (|answer − reference| + 1e-9) / (|reference| + 1e-9))
                                         (L141-147)
==============  =======================  ======================================================================

(``multiple choice`` is :func:`mmrl.rewards.reasoning.choice`.) Route a mixed dataset's rows to them with
``per_task`` (``field: problem_type``). Numbers are read as Video-R1 reads them: commas removed, then Python's
``float``; a non-finite value scores 0 (Video-R1: ``nan`` compares unequal, ``inf`` raises and its handler scores 0).

Deliberate differences: the answer is the **last** ``<answer>`` block (:func:`mmrl.rewards.boxes.extract_answer`, as
every mmrl reward reads it; Video-R1's ``re.search`` takes the first), and a completion without one scores 0 (as
Video-R1's empty extraction does, except that an empty OCR or free-form reference would then score 1 there); the
reference is its ``<answer>`` content when it has one, else the whole field. A completion is read up to its last
``max_chars`` characters, which bounds the work per sample (word_accuracy is quadratic in words).
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from mmrl.extras import require_extra
from mmrl.registry import Range
from mmrl.reward import RewardError, RewardInput
from mmrl.rewards.boxes import MAX_ANSWER_CHARS, answer_region, check_max_chars, completion_texts, extract_answer

MAX_ANSWER_WORDS = 2_000  # word_accuracy compares at most this many words of each side (quadratic work)


def _pairs(batch: RewardInput, field: str, output: str, max_chars: int) -> list[tuple[str | None, str]]:
    """(the completion's answer or None, the reference's answer) per sample."""
    texts = completion_texts(batch, output, last_chars=max_chars)
    references = batch.column(field)
    pairs = []
    for i, (text, reference) in enumerate(zip(texts, references, strict=True)):
        if reference is None or isinstance(reference, (list, dict)):
            raise RewardError(f"dataset row {i} field {field!r} must hold the reference answer as text or a number, "
                              f"got {type(reference).__name__}")
        answer = extract_answer(text)
        pairs.append((None if answer is None else answer.strip(), answer_region(str(reference)).strip()))
    return pairs


def video_r1_number(text: str) -> float | None:
    """Video-R1's ``normalize_number``: ``float`` of the text without commas; None if it does not parse or is not
    finite."""
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def numeric_match(batch: RewardInput, *, field: str = "solution", output: str = "completions",
                  decimals: Annotated[int, Range(0)] = 2,
                  max_chars: Annotated[int, Range(1)] = MAX_ANSWER_CHARS) -> list[float]:
    """Video-R1's ``numerical`` score (module docstring): 1 if the answer and the reference are numbers equal after
    rounding to ``decimals`` places and agree on containing a decimal mark (``.`` or ``,``), else 0.

    Args:
        field: Dataset column with the reference number.
        output: Payload entry holding the model's text outputs.
        decimals: Rounding before the comparison (Video-R1: 2).
        max_chars: Characters read per completion (its last ones).
    """
    _check(decimals=decimals, max_chars=max_chars)
    scores = []
    for answer, reference in _pairs(batch, field, output, max_chars):
        if answer is None or _has_mark(answer) != _has_mark(reference):
            scores.append(0.0)
            continue
        ours, theirs = video_r1_number(answer), video_r1_number(reference)
        scores.append(float(ours is not None and theirs is not None
                            and round(ours, decimals) == round(theirs, decimals)))
    return scores


def _has_mark(text: str) -> bool:
    return "." in text or "," in text


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Word-level Levenshtein distance between whitespace-split texts, divided by the reference's word count (at
    least 1): Video-R1's ``wer``.

    >>> word_error_rate("the cat sat", "the cat sat down")
    0.3333333333333333
    """
    ref, hyp = reference.split()[:MAX_ANSWER_WORDS], hypothesis.split()[:MAX_ANSWER_WORDS]
    previous = list(range(len(hyp) + 1))  # distances of the empty reference prefix
    for i, word in enumerate(ref, start=1):
        current = [i] + [0] * len(hyp)
        for j, other in enumerate(hyp, start=1):
            current[j] = previous[j - 1] if word == other else 1 + min(previous[j], current[j - 1], previous[j - 1])
        previous = current
    return previous[-1] / max(1, len(ref))


def word_accuracy(batch: RewardInput, *, field: str = "solution", output: str = "completions",
                  max_chars: Annotated[int, Range(1)] = MAX_ANSWER_CHARS) -> list[float]:
    """Video-R1's ``OCR`` score: ``1 − WER(reference, answer)`` clipped to [0, 1] (:func:`word_error_rate`); 0
    without an answer.

    Args:
        field: Dataset column with the reference transcription.
        output: Payload entry holding the model's text outputs.
        max_chars: Characters read per completion (its last ones).
    """
    _check(max_chars=max_chars)
    return [0.0 if answer is None else min(1.0, max(0.0, 1.0 - word_error_rate(reference, answer)))
            for answer, reference in _pairs(batch, field, output, max_chars)]


_SCORERS: dict[bool, Any] = {}


def rouge(batch: RewardInput, *, field: str = "solution", output: str = "completions", stemmer: bool = True,
          max_chars: Annotated[int, Range(1)] = MAX_ANSWER_CHARS) -> list[float]:
    """Video-R1's ``free-form`` score: the mean F-measure of ROUGE-1, ROUGE-2 and ROUGE-L between the reference and
    the answer (Google's ``rouge_score`` package, ``use_stemmer`` as Video-R1: Porter stemming), clipped to [0, 1];
    0 without an answer. Needs ``pip install 'mmrl[text-rewards]'``.

    Args:
        field: Dataset column with the reference text.
        output: Payload entry holding the model's text outputs.
        stemmer: Porter-stem the words before matching (Video-R1: yes).
        max_chars: Characters read per completion (its last ones).
    """
    _check(max_chars=max_chars)
    require_extra("text-rewards", "reward 'rouge'")
    if stemmer not in _SCORERS:
        from rouge_score import rouge_scorer

        _SCORERS[stemmer] = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=stemmer)
    scorer = _SCORERS[stemmer]
    scores = []
    for answer, reference in _pairs(batch, field, output, max_chars):
        if answer is None:
            scores.append(0.0)
            continue
        measured = scorer.score(reference, answer)
        mean = (measured["rouge1"].fmeasure + measured["rouge2"].fmeasure + measured["rougeL"].fmeasure) / 3
        scores.append(min(1.0, max(0.0, mean)))
    return scores


def relative_accuracy(batch: RewardInput, *, field: str = "solution", output: str = "completions",
                      max_chars: Annotated[int, Range(1)] = MAX_ANSWER_CHARS) -> list[float]:
    """Video-R1's ``regression`` score: ``1 − min(1, (|answer − reference| + 1e-9) / (|reference| + 1e-9))``; 0 when
    either is not a finite number. As in Video-R1, an answer of exactly 0 to a reference of 0 scores 0 (the two
    1e-9 terms make it 100% off).

    Args:
        field: Dataset column with the reference number.
        output: Payload entry holding the model's text outputs.
        max_chars: Characters read per completion (its last ones).
    """
    _check(max_chars=max_chars)
    scores = []
    for answer, reference in _pairs(batch, field, output, max_chars):
        ours = None if answer is None else video_r1_number(answer)
        theirs = video_r1_number(reference)
        if ours is None or theirs is None:
            scores.append(0.0)
            continue
        relative = (abs(ours - theirs) + 1e-9) / (abs(theirs) + 1e-9)
        scores.append(1.0 - min(1.0, max(0.0, relative)) if math.isfinite(relative) else 0.0)
    return scores


def _check(*, max_chars: int, decimals: int = 0) -> None:
    check_max_chars(max_chars)
    if isinstance(decimals, bool) or not isinstance(decimals, int) or decimals < 0:
        raise RewardError(f"decimals must be a non-negative int, got {decimals!r}")


__all__ = ["MAX_ANSWER_WORDS", "numeric_match", "relative_accuracy", "rouge", "video_r1_number", "word_accuracy",
           "word_error_rate"]
