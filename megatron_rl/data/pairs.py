"""Preference pairs for reward-model training, from JSONL or Parquet.

A row is one pair in either of two forms:

- ``chosen`` and ``rejected``: two whole conversations, each a non-empty list of
  ``{"role", "content"}`` messages ending with the assistant's answer (the part scored);
- ``prompt`` (a string, or a list of messages) with ``chosen`` and ``rejected`` answer
  strings: the two conversations are the prompt followed by each answer as the assistant.

Roles are those a chat template renders (:data:`ROLES`). A malformed file is reported in
one line (how many rows are bad, the first of them with its location, and what is
allowed), because the trainer stops on it before any model is built.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from megatron_rl.data.sources import DatasetFormatError, read_parsed

ROLES = ("system", "user", "assistant", "tool")
"""Message roles a pair may hold: the ones chat templates render."""
FORMS = (
    "'chosen' and 'rejected' conversations (lists of {role, content} messages ending with the "
    "assistant), or 'prompt' with 'chosen' and 'rejected' answer strings"
)
"""What a row may be, as the errors say it."""


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """One row: the preferred and the dispreferred conversation, and where it came from."""

    chosen: tuple[dict, ...]
    rejected: tuple[dict, ...]
    location: str


def _message(i: int, m: Any) -> dict:
    if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
        raise ValueError(f"message {i} is not a {{'role': str, 'content': str}} object: {m!r:.80}")
    if m["role"] not in ROLES:
        raise ValueError(f"message {i} has role {m['role']!r}; allowed roles: {list(ROLES)}")
    return {"role": m["role"], "content": m["content"]}


def _conversation(value: Any) -> tuple[dict, ...]:
    """A conversation field: a non-empty list of messages that ends with the assistant."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"must be a non-empty list of chat messages, got {_describe(value)}")
    messages = tuple(_message(i, m) for i, m in enumerate(value))
    if messages[-1]["role"] != "assistant":
        raise ValueError(
            f"must end with the assistant's answer (the part scored), not a {messages[-1]['role']!r} message"
        )
    return messages


def _prompt(value: Any) -> tuple[dict, ...]:
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("is an empty string")
        return ({"role": "user", "content": value},)
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"must be a non-empty string or list of chat messages, got {_describe(value)}")
    return tuple(_message(i, m) for i, m in enumerate(value))


def _answer(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"must be a non-empty answer string when the row has a 'prompt', got {_describe(value)}")
    return value


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple, str)) and not value:
        return f"an empty {type(value).__name__}"
    return type(value).__name__


def parse_pair(location: str, row: Any) -> PreferencePair:
    """One row as a pair; DatasetFormatError names the location, the field and what is allowed."""
    if isinstance(row, Exception):
        raise DatasetFormatError(f"{location}: not valid JSON ({row})")
    if not isinstance(row, dict):
        raise DatasetFormatError(f"{location}: a row must be a JSON object, got {type(row).__name__}")
    missing = [key for key in ("chosen", "rejected") if row.get(key) is None]
    if missing:
        raise DatasetFormatError(
            f"{location}: field {missing[0]!r} is missing (row keys: {sorted(row)}); a row holds {FORMS}"
        )
    field = "chosen"
    try:
        if row.get("prompt") is not None:
            field = "prompt"
            prompt = _prompt(row["prompt"])
            field = "chosen"
            chosen = prompt + ({"role": "assistant", "content": _answer(row["chosen"])},)
            field = "rejected"
            rejected = prompt + ({"role": "assistant", "content": _answer(row["rejected"])},)
        else:
            chosen = _conversation(row["chosen"])
            field = "rejected"
            rejected = _conversation(row["rejected"])
    except ValueError as err:
        raise DatasetFormatError(f"{location}: field {field!r} {err}") from None
    return PreferencePair(chosen, rejected, location)


def read_pairs(path: str | Path, limit: Optional[int] = None) -> list[PreferencePair]:
    """All pairs of ``path`` (its first ``limit`` rows when given); one DatasetFormatError,
    one line, for a file that has a bad row or none at all."""
    return read_parsed(path, parse_pair, "pair", FORMS, limit)


def write_pairs(path: str | Path, rows: Iterable[dict]) -> int:
    """Write pair rows (either form) as JSONL; returns how many."""
    count = 0
    with Path(path).open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
            count += 1
    return count


def encode_conversation(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of a whole conversation through the tokenizer's chat template (no
    generation prompt: the assistant's answer is there, closed as the template closes it)."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=False)
    return tokenizer(text, add_special_tokens=False).input_ids
