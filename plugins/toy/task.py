"""Synthetic digit-sequence tasks with a verifiable answer.

A prompt is a short sequence of digits ("3 0 4"); the answer is a deterministic function of it: the reversed
sequence, the sorted sequence or a copy. Train and eval prompts are disjoint.
"""

from __future__ import annotations

import random
from typing import Any

TASKS = {
    "reverse": lambda digits: list(reversed(digits)),
    "sort": sorted,
    "copy": list,
}


def make_splits(
    task: str, *, num_digits: int, min_length: int, max_length: int, train_size: int, eval_size: int, seed: int
) -> dict[str, list[dict[str, Any]]]:
    """Draw ``train_size + eval_size`` distinct prompts and split them.

    Each row is ``{"prompt": "3 0 4", "digits": [3, 0, 4], "solution": "4 0 3"}``.
    """
    if task not in TASKS:
        raise ValueError(f"unknown toy task {task!r}; choose one of {', '.join(TASKS)}")
    possible = sum(num_digits**length for length in range(min_length, max_length + 1))
    wanted = train_size + eval_size
    if wanted > possible:
        raise ValueError(
            f"toy task: {wanted} distinct prompts requested but only {possible} exist with {num_digits} digits and "
            f"lengths {min_length}..{max_length}; lower train_size/eval_size or widen the lengths"
        )
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    rows = []
    while len(rows) < wanted:
        length = rng.randint(min_length, max_length)
        digits = tuple(rng.randrange(num_digits) for _ in range(length))
        if digits in seen:
            continue
        seen.add(digits)
        answer = TASKS[task](list(digits))
        rows.append({
            "prompt": " ".join(map(str, digits)),
            "digits": list(digits),
            "solution": " ".join(map(str, answer)),
        })
    return {"train": rows[:train_size], "eval": rows[train_size:]}
