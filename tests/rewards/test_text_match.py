"""exact_match and token_accuracy: whitespace tokens compared with the reference, and their cap on the text read."""

from __future__ import annotations

import pytest

from mmrl.reward import RewardError, RewardInput
from mmrl.rewards.text_match import exact_match, token_accuracy


def make_batch(completions, references):
    return RewardInput(rows=[{"solution": r} for r in references], payload={"completions": list(completions)})


def test_exact_match_and_token_accuracy_by_hand():
    batch = make_batch(["the  cat\nsat", "the dog sat", "the cat", "", None], ["the cat sat"] * 4 + ["x"])
    assert exact_match(batch) == [1.0, 0.0, 0.0, 0.0, 0.0]
    # token_accuracy: 3/3; "dog" wrong → 2/3; 2 of 3 tokens → 2/3; empty → 0/3; not text → 0.
    assert token_accuracy(batch) == pytest.approx([1.0, 2 / 3, 2 / 3, 0.0, 0.0])
    assert token_accuracy(make_batch([" "], [""])) == [1.0]


def test_longer_completions_than_max_chars_score_zero():
    # Both compare the whole completion, so a completion over the cap cannot be judged on a part: it scores 0.
    batch = make_batch(["the cat sat", "the cat sat "], ["the cat sat", "the cat sat"])  # 11 and 12 characters
    assert exact_match(batch, max_chars=11) == [1.0, 0.0]
    assert token_accuracy(batch, max_chars=11) == [1.0, 0.0]
    assert exact_match(batch) == [1.0, 1.0] and token_accuracy(batch) == [1.0, 1.0]  # default cap: 200,000
    long = make_batch(["a " * 100_001], ["a " * 100_001])  # 200,002 characters
    assert exact_match(long) == [0.0] and exact_match(long, max_chars=200_002) == [1.0]
    with pytest.raises(RewardError, match="max_chars must be a positive integer"):
        token_accuracy(batch, max_chars=0)
