"""Prompt files shared by the plugins: JSONL rows with a ``"prompt"`` string, or plain text with one prompt per line.

Rows keep every other key of their JSON object (a ``solution``, a ``count``, an image path...), which rewards read
from ``RewardInput.rows``. A malformed file is a one-line ``ValueError`` naming the file and line. Also the check of
the plugins' ``chat_template_kwargs`` (:func:`check_chat_template_kwargs`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RESERVED_CHAT_TEMPLATE_KEYS = ("conversation", "tokenize", "add_generation_prompt", "continue_final_message",
                               "return_dict", "return_tensors")
"""``apply_chat_template`` arguments the plugins set themselves: a prompt is the text of the chat with the assistant
turn opened."""


def check_chat_template_kwargs(kwargs: Any, path: str) -> None:
    """Validate a plugin's ``chat_template_kwargs``: a mapping of string keys (the chat template's variables, such as
    ``enable_thinking``, or ``apply_chat_template`` arguments such as ``chat_template``) that are none of
    :data:`RESERVED_CHAT_TEMPLATE_KEYS`.

    Raises:
        ConfigError: naming ``path`` and the first offending key.
    """
    from mmrl.config import ConfigError

    if not isinstance(kwargs, dict) or not all(isinstance(key, str) for key in kwargs):
        raise ConfigError(path, kwargs, "a mapping of chat-template variable names to values")
    reserved = [key for key in kwargs if key in RESERVED_CHAT_TEMPLATE_KEYS]
    if reserved:
        raise ConfigError(f"{path}.{reserved[0]}", kwargs[reserved[0]],
                          f"a key other than {', '.join(RESERVED_CHAT_TEMPLATE_KEYS)} (the plugin sets those)")


def iter_jsonl(path: str | Path, *, error: type[ValueError] = ValueError) -> Iterator[tuple[str, Any]]:
    """The JSON value of every non-blank line of a JSONL file, with where it came from.

    The one JSONL reader of mmrl: the prompt files below and the VLM plugin's datasets (which validate their own
    keys) read through it, so a malformed line fails the same way everywhere.

    Args:
        path: The file (it must exist; the callers say what they expected when it does not).
        error: The exception class raised for a line that is not valid JSON (a ``ValueError`` subclass, such as the
            VLM plugin's ``DataError``).

    Yields:
        ``(where, value)``: ``where`` is ``"{path} line {number}"`` for messages, ``value`` the decoded JSON.

    Raises:
        error: ``"{path} line {number}: not valid JSON ({reason} at column {column})"``.
    """
    path = Path(path)
    with path.open() as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                value = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as failure:
                raise error(f"{where}: not valid JSON ({failure.msg} at column {failure.colno})") from None
            yield where, value


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
    for where, row in iter_jsonl(path):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{where}: expected a JSON object with a 'prompt' string")
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


__all__ = ["iter_jsonl", "read_jsonl_prompts", "read_prompt_file"]
