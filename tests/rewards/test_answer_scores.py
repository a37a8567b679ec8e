"""Video-R1's per-type answer scores (numeric_match, word_accuracy, rouge, relative_accuracy) against values computed
by hand from Video-R1's rules (tulerfeng/Video-R1@59d65c3, src/r1-v/src/open_r1/grpo.py L66-165), and inside
per_task as a Video-R1 mix routes them."""

from __future__ import annotations

import functools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmrl.reward import RewardError, RewardInput, build_reward
from mmrl.rewards.answer_scores import (
    numeric_match,
    relative_accuracy,
    rouge,
    word_accuracy,
    word_error_rate,
)


def _batch(answers, references, **columns):
    texts = [a if a is None or "<answer>" in a else f"<think>…</think><answer>{a}</answer>" for a in answers]
    texts = ["no tags at all" if t is None else t for t in texts]
    rows = [{"solution": r, **{k: v[i] for k, v in columns.items()}} for i, r in enumerate(references)]
    return RewardInput(rows=rows, payload={"completions": texts})


def test_numeric_match_follows_video_r1s_numerical_rule():
    cases = [
        ("3.14", "3.14", 1.0), ("3.141", "3.14", 1.0),  # equal after rounding to 2 decimals
        ("3.15", "3.14", 0.0), ("42", "<answer>42</answer>", 1.0),  # the reference's answer block is read
        ("3", "3.0", 0.0),  # one has a decimal mark, the other not
        ("1,000", "1000", 0.0),  # a thousands comma counts as a mark, as in Video-R1
        ("1,000", "1,000.0", 1.0), ("-2.5", "-2.50", 1.0),
        ("nan", "nan", 0.0), ("inf", "inf", 0.0), ("twelve", "12", 0.0), (None, "12", 0.0),
    ]
    scores = numeric_match(_batch([c[0] for c in cases], [c[1] for c in cases]))
    assert scores == [c[2] for c in cases]
    assert numeric_match(_batch(["3.149"], ["3.1"]), decimals=1) == [1.0]


def _edit_distance(ref: tuple[str, ...], hyp: tuple[str, ...]) -> int:
    """Word edit distance by its recursive definition (an independent check of the dynamic programme)."""
    @functools.cache
    def d(i: int, j: int) -> int:
        if i == 0 or j == 0:
            return i + j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (ref[i - 1] != hyp[j - 1]))
    return d(len(ref), len(hyp))


@pytest.mark.parametrize(("reference", "hypothesis"), [
    ("the cat sat on the mat", "the cat sit on mat"), ("a b c", "c b a"), ("one", ""), ("", "extra words"),
    ("x y z w", "x y z w"), ("hello world again", "hello brave new world"),
])
def test_word_error_rate_is_the_word_edit_distance_over_the_reference_words(reference, hypothesis):
    expected = _edit_distance(tuple(reference.split()), tuple(hypothesis.split())) / max(1, len(reference.split()))
    assert word_error_rate(reference, hypothesis) == pytest.approx(expected)


def test_word_accuracy_is_one_minus_the_error_rate_clipped():
    # 2 edits (sat -> sit, a deleted "the") over 6 reference words; 3 insertions over 1 word clip to 0.
    scores = word_accuracy(_batch(["the cat sit on mat", "one two three four", "exact text", None],
                                  ["the cat sat on the mat", "one", "exact text", "anything"]))
    assert scores == pytest.approx([1 - 2 / 6, 0.0, 1.0, 0.0])


def test_rouge_is_the_mean_f_measure_of_rouge_1_2_and_l_with_stemming():
    pytest.importorskip("rouge_score")
    # Stemmed: reference [the, cat, are, run, fast], answer [a, cat, run, fast]. ROUGE-1: 3 shared words, P 3/4,
    # R 3/5, F 2/3; ROUGE-2: "run fast" shared, P 1/3, R 1/4, F 2/7; ROUGE-L: LCS cat run fast, F 2/3.
    scores = rouge(_batch(["a cat runs fast", "same words here", None], ["the cats are running fast",
                                                                          "same words here", "text"]))
    assert scores == pytest.approx([(2 / 3 + 2 / 7 + 2 / 3) / 3, 1.0, 0.0])
    unstemmed = rouge(_batch(["a cat runs fast"], ["the cats are running fast"]), stemmer=False)
    assert unstemmed[0] < scores[0]  # cats/cat and runs/running no longer match


def test_relative_accuracy_follows_video_r1s_regression_rule():
    scores = relative_accuracy(_batch(["9", "11", "25", "1,500", "0", "x", None], ["10", "10", "10", "1500", "0",
                                                                                 "10", "10"]))
    # |9 - 10| / 10 = 0.1; 25 is 150% off (clipped to 1); commas are removed; 0 for 0 is (1e-9)/(1e-9) = 1 off.
    assert scores == pytest.approx([0.9, 0.9, 0.0, 1.0, 0.0, 0.0, 0.0])


def test_a_reference_that_is_not_text_is_a_dataset_error():
    with pytest.raises(RewardError, match="dataset row 0 field 'solution' must hold the reference answer"):
        numeric_match(_batch(["1"], [[1, 2]]))
    with pytest.raises(RewardError, match="max_chars must be a positive integer"):
        word_accuracy(_batch(["1"], ["1"]), max_chars=0)
    with pytest.raises(RewardError, match="decimals must be a non-negative int"):
        numeric_match(_batch(["1"], ["1"]), decimals=-1)


def test_per_task_routes_a_video_r1_mix():
    """A Video-R1 batch of five question types, each row scored by its type's reward through per_task."""
    pytest.importorskip("rouge_score")
    tasks = {"multiple choice": {"name": "choice"}, "numerical": {"name": "numeric_match"},
             "OCR": {"name": "word_accuracy"}, "free-form": {"name": "rouge"},
             "regression": {"name": "relative_accuracy"}}
    reward = build_reward("per_task", {"field": "problem_type", "tasks": tasks})
    batch = _batch(["B", "3.5", "stop here now", "same words here", "9"],
                   ["B", "3.5", "stop here", "same words here", "10"],
                   problem_type=["multiple choice", "numerical", "OCR", "free-form", "regression"])
    assert reward(batch) == pytest.approx([1.0, 1.0, 0.5, 1.0, 0.9])


ANY_TEXT = st.lists(st.sampled_from(["<answer>", "</answer>", "1", ".", ",", "-", "e5", "nan", "inf", " ", "word",
                                     "\n", "9" * 40, "0"]), max_size=30).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=ANY_TEXT)
def test_rewards_never_raise_and_stay_in_range(text):
    batch = RewardInput(rows=[{"solution": "12.5"}, {"solution": "the answer text"}],
                        payload={"completions": [text, text]})
    scores = numeric_match(batch) + relative_accuracy(batch) + word_accuracy(batch)
    try:
        scores += rouge(batch)
    except ImportError:
        pass
    assert all(math.isfinite(s) and 0.0 <= s <= 1.0 for s in scores)


def test_an_empty_batch_scores_nothing():
    empty = RewardInput(rows=[], payload={"completions": []})
    assert numeric_match(empty) == word_accuracy(empty) == relative_accuracy(empty) == []
