"""Chat conversations for supervised fine-tuning, from JSONL or Parquet, and their loss mask.

A row holds ``messages``: a list of ``{"role", "content"}`` messages (roles: ``ROLES``; an
assistant message may carry ``tool_calls`` instead of, or beside, its content), with at
least one assistant turn, and optionally ``tools``: the tool schemas the chat template
renders for the conversation. A malformed file is one line (how many rows are bad, the
first with its location, and what is allowed), before any model is built.

The loss mask is read off the chat template's own rendering, not guessed from marker
tokens: the conversation is rendered turn by turn, each assistant turn as the text the
template adds after the prompt for it (its generation prompt) up to the end of that turn.
Those pieces are tokenized one by one, as an RL sample is (a prompt, then the tokens the
policy generated), so the masked tokens are what the policy would have to generate. A
template that does not render each turn as a continuation of the turns before it (one
that rewrites earlier turns, e.g. drops their reasoning) cannot be masked this way and is
refused in one line naming the row.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from megatron_rl.data.pairs import ROLES
from megatron_rl.data.sources import DatasetFormatError, read_parsed

FORM = (
    "'messages': a list of {role, content} messages (roles " + ", ".join(ROLES) + ") with at least one "
    "assistant turn, and optionally 'tools': a list of tool schemas"
)
"""What a row may be, as the errors say it."""


@dataclasses.dataclass(frozen=True)
class ChatExample:
    """One conversation, the tools it may call, and where it came from."""

    messages: tuple[dict, ...]
    tools: Optional[tuple[dict, ...]]
    location: str


@dataclasses.dataclass(frozen=True)
class EncodedChat:
    """A conversation's token ids and which of them the loss reads (the assistant's)."""

    ids: list[int]
    mask: list[bool]


def _message(i: int, m: Any) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"message {i} is not a {{'role': str, 'content': str}} object: {m!r:.80}")
    if m["role"] not in ROLES:
        raise ValueError(f"message {i} has role {m['role']!r}; allowed roles: {list(ROLES)}")
    calls = m.get("tool_calls")
    if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list)):
        raise ValueError(f"message {i}: tool_calls must be a list, on an assistant message")
    content = m.get("content")
    if not isinstance(content, str) and not (calls and content is None):
        raise ValueError(f"message {i} has no string 'content' (only an assistant's tool call may go without)")
    out = {"role": m["role"], "content": content}
    if calls:
        out["tool_calls"] = calls
    return out


def parse_chat(location: str, row: Any) -> ChatExample:
    """One row as a conversation; DatasetFormatError names the location, the field and what is allowed."""
    if isinstance(row, Exception):
        raise DatasetFormatError(f"{location}: not valid JSON ({row})")
    if not isinstance(row, dict) or not isinstance(row.get("messages"), (list, tuple)) or not row["messages"]:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise DatasetFormatError(f"{location}: no non-empty 'messages' list (row: {keys}); a row holds {FORM}")
    try:
        messages = tuple(_message(i, m) for i, m in enumerate(row["messages"]))
    except ValueError as err:
        raise DatasetFormatError(f"{location}: field 'messages' {err}") from None
    if not any(m["role"] == "assistant" for m in messages):
        raise DatasetFormatError(f"{location}: no assistant turn, so nothing to learn; a row holds {FORM}")
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)):
        raise DatasetFormatError(f"{location}: field 'tools' must be a list of tool schemas (objects)")
    return ChatExample(messages, tuple(tools) if tools else None, location)


def read_chats(path: str | Path, limit: Optional[int] = None) -> list[ChatExample]:
    """All conversations of ``path`` (its first ``limit`` rows when given); one
    DatasetFormatError, one line, for a file that has a bad row or none at all."""
    return read_parsed(path, parse_chat, "conversation", FORM, limit)


def _render(tokenizer, example: ChatExample, upto: int, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        list(example.messages[:upto]),
        tools=list(example.tools) if example.tools else None,
        tokenize=False,
        add_generation_prompt=generation_prompt,
    )


def chat_pieces(tokenizer, example: ChatExample) -> list[tuple[str, bool]]:
    """The rendered conversation as consecutive ``(text, is_assistant)`` pieces whose join is
    the template's rendering of the whole; DatasetFormatError when the template does not
    render a turn as a continuation of the turns before it."""
    pieces: list[tuple[str, bool]] = []
    done = ""
    for k, message in enumerate(example.messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, example, k, generation_prompt=True)
        turn = _render(tokenizer, example, k + 1, generation_prompt=False)
        if not (prompt.startswith(done) and turn.startswith(prompt)):
            raise DatasetFormatError(
                f"{example.location}: the chat template does not render assistant turn {k} as a continuation of "
                "the conversation before it (it rewrites earlier turns), so its loss mask cannot be read off"
            )
        pieces += [(prompt[len(done) :], False), (turn[len(prompt) :], True)]
        done = turn
    whole = _render(tokenizer, example, len(example.messages), generation_prompt=False)
    if not whole.startswith(done):
        raise DatasetFormatError(f"{example.location}: the chat template rewrites the turns after the last answer")
    pieces.append((whole[len(done) :], False))
    return [(text, assistant) for text, assistant in pieces if text]


def encode_chat(tokenizer, example: ChatExample) -> EncodedChat:
    """Token ids of the conversation (each piece tokenized on its own) and the loss mask:
    True on the tokens of the assistant's turns, closing token included."""
    ids: list[int] = []
    mask: list[bool] = []
    for text, assistant in chat_pieces(tokenizer, example):
        piece = tokenizer(text, add_special_tokens=False).input_ids
        ids += piece
        mask += [assistant] * len(piece)
    return EncodedChat(ids, mask)
