"""Prompt files shared by the plugins: JSONL rows with a ``"prompt"`` string, or plain text with one prompt per line.

Rows keep every other key of their JSON object (a ``solution``, a ``count``, an image path...), which rewards read
from ``RewardInput.rows``. A malformed file is a one-line ``ValueError`` naming the file and line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl_prompts(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file, one JSON object with a ``"prompt"`` string per non-blank line.

    Args:
        path: The file.

    Returns:
        The objects in file order.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: a line is not valid JSON or not an object with a ``"prompt"`` string (names file and line).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file at {path}")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} line {number}: not valid JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path} line {number}: expected a JSON object with a 'prompt' string")
        rows.append(row)
    return rows


def read_prompt_file(path: str | Path) -> list[dict[str, Any]]:
    """Prompt rows from ``path``: :func:`read_jsonl_prompts` for a ``.jsonl`` file, else one ``{"prompt": line}``
    row per non-blank line of text (stripped)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return read_jsonl_prompts(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompt file at {path}")
    return [{"prompt": line.strip()} for line in path.read_text().splitlines() if line.strip()]


__all__ = ["read_jsonl_prompts", "read_prompt_file"]
