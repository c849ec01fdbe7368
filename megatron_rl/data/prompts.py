"""Prompt datasets: rows with a prompt and a ground-truth answer, chat-templated to ids.

Rows follow the DAPO-Math-17k layout by default (``prompt`` is a list of chat messages or
a string, ``reward_model.ground_truth`` the answer); field names are configurable and may
be dotted paths into nested records. Every row is validated when the dataset is built,
and all bad rows are reported together in one error, each with its file and line (JSONL)
or row index (Parquet) and the field at fault.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_rl.data.sources import DatasetFormatError, read_rows

_MISSING = object()
MAX_LISTED_PROBLEMS = 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptFields:
    """Where a row keeps its prompt and answer, and how a plain-text prompt is wrapped."""

    prompt: str = "prompt"
    """Field (dotted path) holding a string or a list of ``{"role", "content"}`` messages."""
    answer: str = "reward_model.ground_truth"
    """Field (dotted path) holding the ground truth (string or number)."""
    system_prompt: Optional[str] = None
    """Prepended as a system message when set."""
    prompt_template: str = "{prompt}"
    """Applied to a plain-text prompt before it becomes the user message."""


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One usable row: chat-templated prompt ids, the answer, and where it came from."""

    prompt_ids: tuple[int, ...]
    answer: str
    location: str
    messages: tuple[dict, ...] = ()
    """The chat messages the ids were rendered from (a multi-turn episode renders them again,
    with the tools its environment lists)."""


def _get(row: Any, dotted: str) -> Any:
    value = row
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            return _MISSING
        value = value[key]
    return value


def _messages(value: Any, fields: PromptFields) -> list[dict]:
    """Chat messages from a prompt field value; raises ValueError saying what is wrong."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("is an empty string")
        messages = [{"role": "user", "content": fields.prompt_template.format(prompt=value)}]
    elif isinstance(value, (list, tuple)) and value:
        messages = []
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"message {i} is not a {{'role': str, 'content': str}} object: {m!r:.80}")
            messages.append({"role": m["role"], "content": m["content"]})
    else:
        raise ValueError(f"must be a non-empty string or list of chat messages, got {type(value).__name__}")
    if fields.system_prompt:
        messages = [{"role": "system", "content": fields.system_prompt}] + messages
    return messages


def _answer(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"must be a string or number, got {type(value).__name__}")
    text = str(value).strip()
    if not text:
        raise ValueError("is empty")
    return text


def parse_row(location: str, row: Any, fields: PromptFields) -> tuple[list[dict], str]:
    """One row's chat messages and answer, before tokenization (so a config check can read a
    file's first rows without a tokenizer); DatasetFormatError names the location and field."""
    if isinstance(row, Exception):
        raise DatasetFormatError(f"{location}: not valid JSON ({row})")
    if not isinstance(row, dict):
        raise DatasetFormatError(f"{location}: a row must be a JSON object, got {type(row).__name__}")
    found = []
    for name, convert in ((fields.prompt, lambda v: _messages(v, fields)), (fields.answer, _answer)):
        value = _get(row, name)
        if value is _MISSING:
            raise DatasetFormatError(f"{location}: field {name!r} is missing (row keys: {sorted(row)})")
        try:
            found.append(convert(value))
        except ValueError as exc:
            raise DatasetFormatError(f"{location}: field {name!r} {exc}") from None
    return found[0], found[1]


def encode_prompt(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of the chat template with the generation prompt (what the policy continues)."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


class PromptDataset:
    """All usable rows of one or more files, encoded once; indexable and sized.

    ``max_prompt_tokens`` drops longer prompts (counted in ``num_dropped_overlong``)
    rather than failing: long prompts are ordinary data, not malformed rows.
    """

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        tokenizer,
        *,
        fields: PromptFields = PromptFields(),
        max_prompt_tokens: Optional[int] = None,
    ):
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        if not paths:
            raise DatasetFormatError("no dataset files given")
        self.fields = fields
        self.records: list[PromptRecord] = []
        self.num_dropped_overlong = 0
        problems: list[str] = []
        for path in paths:
            for location, row in read_rows(path):
                record = self._record(location, row, tokenizer, problems)
                if record is None:
                    continue
                if max_prompt_tokens is not None and len(record.prompt_ids) > max_prompt_tokens:
                    self.num_dropped_overlong += 1
                else:
                    self.records.append(record)
        if problems:
            listed = "\n  ".join(problems[:MAX_LISTED_PROBLEMS])
            more = len(problems) - MAX_LISTED_PROBLEMS
            raise DatasetFormatError(
                f"{len(problems)} malformed row(s) (prompt field {fields.prompt!r}, answer field "
                f"{fields.answer!r}):\n  {listed}" + (f"\n  ... and {more} more" if more > 0 else "")
            )
        if not self.records:
            raise DatasetFormatError(
                f"no usable rows in {', '.join(map(str, paths))}"
                + (
                    f" ({self.num_dropped_overlong} longer than max_prompt_tokens={max_prompt_tokens})"
                    if self.num_dropped_overlong
                    else ""
                )
            )

    def _record(self, location: str, row: Any, tokenizer, problems: list[str]) -> Optional[PromptRecord]:
        try:
            messages, answer = parse_row(location, row, self.fields)
        except DatasetFormatError as exc:
            problems.append(str(exc))
            return None
        return PromptRecord(tuple(encode_prompt(tokenizer, messages)), answer, location, tuple(messages))

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> PromptRecord:
        return self.records[index]
