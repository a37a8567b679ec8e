"""Sudoku completion: the fraction of the puzzle's empty cells that the completion fills correctly.

Registered reward ``sudoku``, the partial-credit reward of d1's Sudoku task (4×4 puzzles; 9×9 work the same way).
A puzzle is a string of n² cells (n = 4 or 9) read row by row, ``0`` or ``.`` marking an empty cell; the solution is
a string of n² digits 1..n. The completion's grid is read from the last ``<answer>…</answer>`` block if there is one,
else from the whole text: every digit (``0`` counts as a blank) and ``.``/``_`` in order, everything else (spaces,
``|``, commas, newlines, words) ignored. Fewer than n² cells is malformed and scores 0; with more, the last n² are
the grid (a model that restates the puzzle before answering is read correctly). The score is

    (number of originally empty cells whose predicted digit equals the solution) / (number of empty cells),

so given cells neither earn nor cost anything; a puzzle without empty cells scores 1 when the grid equals the
solution. Never raises on model output.
"""

from __future__ import annotations

from typing import Any

from mmrl.reward import RewardError, RewardInput
from mmrl.rewards.boxes import completion_texts, extract_answer

_CELL = frozenset("0123456789._")
_BLANK = frozenset("0._")


def parse_grid(text: Any, cells: int) -> str | None:
    """The last ``cells`` cell characters of the answer region of ``text`` (blanks as ``0``), or None if fewer."""
    if not isinstance(text, str):
        return None
    region = extract_answer(text[-50_000:])
    region = text[-50_000:] if region is None else region
    found = [("0" if ch in _BLANK else ch) for ch in region if ch in _CELL]
    if len(found) < cells:
        return None
    return "".join(found[-cells:])


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


def sudoku_score(text: Any, puzzle: str, solution: str) -> float:
    """The ``sudoku`` score of one completion for a validated puzzle and solution (strings of n² cells)."""
    predicted = parse_grid(text, len(puzzle))
    if predicted is None:
        return 0.0
    empty = [i for i, ch in enumerate(puzzle) if ch == "0"]
    if not empty:
        return float(predicted == solution)
    return sum(predicted[i] == solution[i] for i in empty) / len(empty)


def sudoku(
    batch: RewardInput, *, puzzle_field: str = "puzzle", solution_field: str = "solution",
    output: str = "completions",
) -> list[float]:
    """Fraction of the puzzle's empty cells filled correctly (0 for a malformed grid).

    Args:
        puzzle_field: Dataset column with the puzzle (16 or 81 cells, ``0`` or ``.`` for blanks).
        solution_field: Dataset column with the solved grid.
        output: Payload entry holding the model's text outputs.
    """
    texts = completion_texts(batch, output)
    scores = []
    for row, (text, puzzle, solution) in enumerate(
            zip(texts, batch.column(puzzle_field), batch.column(solution_field), strict=True)):
        grid = _grid(puzzle, row, puzzle_field, solution=False)
        answer = _grid(solution, row, solution_field, solution=True)
        if len(grid) != len(answer):
            raise RewardError(f"dataset row {row}: puzzle has {len(grid)} cells but the solution {len(answer)}")
        if any(g != "0" and g != a for g, a in zip(grid, answer, strict=True)):
            raise RewardError(f"dataset row {row}: the solution contradicts a given cell of the puzzle")
        scores.append(sudoku_score(text, grid, answer))
    return scores


__all__ = ["parse_grid", "sudoku", "sudoku_score"]
