"""Sudoku completion: the fraction of the puzzle's empty cells that the completion fills correctly.

Registered reward ``sudoku``, the partial-credit reward of d1's Sudoku task (4×4 puzzles; 9×9 work the same way).
A puzzle is a string of n² cells (n = 4 or 9) read row by row, ``0`` or ``.`` marking an empty cell; the solution is
a string of n² digits 1..n. The completion's grid is read from the last ``<answer>…</answer>`` block if there is one,
else from the whole text, as d1 reads it (github dllm-reasoning/d1, ``diffu-grpo/reward_func.py`` at 837888f,
``extract_answer_sudoku`` lines 175-180 and ``validate_sudoku_solution`` lines 183-199): its digits only, in order
(``0`` is a blank; spaces, ``|``, commas, full stops, newlines and words are ignored), and the grid is the first n²
of them, so text after a complete grid (``" (4x4 grid)"``, a full stop) does not shift it. Fewer than n² digits is
malformed and scores 0 (d1 pads a short grid with zeros and credits the cells it has). The score is

    (number of originally empty cells whose predicted digit equals the solution) / (number of empty cells),

so given cells neither earn nor cost anything; a puzzle without empty cells scores 1 when the grid equals the
solution. Only the last ``max_chars`` characters of a completion are read. Never raises on model output.
"""

from __future__ import annotations

import itertools
import re
from typing import Annotated, Any

from mmrl.registry import Range
from mmrl.reward import RewardError, RewardInput
from mmrl.rewards.boxes import MAX_ANSWER_CHARS, answer_region, check_max_chars, completion_texts

_CELL = frozenset("0123456789._")  # cells of a dataset puzzle (blanks 0, . or _)
_BLANK = frozenset("0._")
_DIGIT = re.compile(r"[0-9]")


def parse_grid(text: Any, cells: int, *, max_chars: int = MAX_ANSWER_CHARS) -> str | None:
    """The first ``cells`` digits of the answer region of ``text``'s last ``max_chars`` characters, or None if fewer.

    The answer region is the last ``<answer>`` block, else the whole (capped) text; only ASCII digits are cells.
    """
    check_max_chars(max_chars)
    if not isinstance(text, str):
        return None
    region = answer_region(text[-max_chars:])
    found = "".join(match.group() for match in itertools.islice(_DIGIT.finditer(region), cells))
    return found if len(found) == cells else None


def _grid(value: Any, row: int, field: str, *, solution: bool) -> str:
    text = "".join(ch for ch in str(value) if not ch.isspace() and ch not in "|,")
    size = {16: 4, 81: 9}.get(len(text))
    valid = size is not None and all(ch in _CELL for ch in text)
    if valid and solution:
        valid = all(ch.isdigit() and 1 <= int(ch) <= size for ch in text)
    if not valid:
        kind = "solution digits 1..n" if solution else "cells (digits, 0 or . for blanks)"
        raise RewardError(f"dataset row {row} field {field!r} must hold 16 or 81 {kind}, got {value!r}")
    return "".join("0" if ch in _BLANK else ch for ch in text)


def sudoku_score(text: Any, puzzle: str, solution: str, *, max_chars: int = MAX_ANSWER_CHARS) -> float:
    """The ``sudoku`` score of one completion for a validated puzzle and solution (strings of n² cells)."""
    predicted = parse_grid(text, len(puzzle), max_chars=max_chars)
    if predicted is None:
        return 0.0
    empty = [i for i, ch in enumerate(puzzle) if ch == "0"]
    if not empty:
        return float(predicted == solution)
    return sum(predicted[i] == solution[i] for i in empty) / len(empty)


def sudoku(
    batch: RewardInput, *, puzzle_field: str = "puzzle", solution_field: str = "solution",
    output: str = "completions", max_chars: Annotated[int, Range(1)] = MAX_ANSWER_CHARS,
) -> list[float]:
    """Fraction of the puzzle's empty cells filled correctly (0 for a malformed grid).

    The grid is the first n² digits of the completion's answer region (see the module docstring).

    Args:
        puzzle_field: Dataset column with the puzzle (16 or 81 cells, ``0`` or ``.`` for blanks).
        solution_field: Dataset column with the solved grid.
        output: Payload entry holding the model's text outputs.
        max_chars: Characters read per completion: its last ``max_chars`` (the answer comes at the end), which
            bounds the work per sample.
    """
    texts = completion_texts(batch, output, last_chars=max_chars)
    scores = []
    for row, (text, puzzle, solution) in enumerate(
            zip(texts, batch.column(puzzle_field), batch.column(solution_field), strict=True)):
        grid = _grid(puzzle, row, puzzle_field, solution=False)
        answer = _grid(solution, row, solution_field, solution=True)
        if len(grid) != len(answer):
            raise RewardError(f"dataset row {row}: puzzle has {len(grid)} cells but the solution {len(answer)}")
        if any(g != "0" and g != a for g, a in zip(grid, answer, strict=True)):
            raise RewardError(f"dataset row {row}: the solution contradicts a given cell of the puzzle")
        scores.append(sudoku_score(text, grid, answer, max_chars=max_chars))
    return scores


__all__ = ["parse_grid", "sudoku", "sudoku_score"]
