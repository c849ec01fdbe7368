"""data.chat: conversations for SFT, read and checked in one line per bad file, and the loss
mask read off the chat template's rendering: exactly the assistant's turns (closing token
included), on multi-turn and tool conversations; a template that rewrites earlier turns is
refused."""

import copy
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.data.chat import ChatExample, encode_chat, read_chats
from megatron_rl.data.sources import DatasetFormatError

MULTI_TURN = (
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "max 3 7"},
    {"role": "assistant", "content": "Answer: 7"},
    {"role": "user", "content": "max 9 2"},
    {"role": "assistant", "content": "Answer: 9"},
)
CALL = {"name": "python", "arguments": {"code": "print(12*3)"}}
TOOLS = ({"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}},)
WITH_TOOLS = (
    {"role": "user", "content": "12 times 3"},
    {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": CALL}]},
    {"role": "tool", "content": "36"},
    {"role": "assistant", "content": "Answer: 36"},
)


def _assistant_texts(tokenizer, encoded):
    """The decoded runs of masked tokens."""
    runs, current = [], []
    for token, masked in zip(encoded.ids, encoded.mask):
        if masked:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [tokenizer.decode(run) for run in runs]


def test_the_mask_is_the_assistant_turns_of_a_multi_turn_conversation(tokenizer):
    encoded = encode_chat(tokenizer, ChatExample(MULTI_TURN, None, "x"))
    whole = (
        "<|system|>Be brief.<|end|><|user|>max 3 7<|end|><|assistant|>Answer: 7<|end|>"
        "<|user|>max 9 2<|end|><|assistant|>Answer: 9<|end|>"
    )
    assert tokenizer.apply_chat_template(list(MULTI_TURN), tokenize=False) == whole  # the template, as written here
    assert tokenizer.decode(encoded.ids) == whole
    assert _assistant_texts(tokenizer, encoded) == ["Answer: 7<|end|>", "Answer: 9<|end|>"]


def test_a_tool_call_is_learned_and_the_tool_response_is_not(tokenizer):
    encoded = encode_chat(tokenizer, ChatExample(WITH_TOOLS, TOOLS, "x"))
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(12*3)"}}</tool_call><|end|>'
    assert _assistant_texts(tokenizer, encoded) == [call, "Answer: 36<|end|>"]
    rendered = tokenizer.apply_chat_template(list(WITH_TOOLS), tools=list(TOOLS), tokenize=False)
    assert tokenizer.decode(encoded.ids) == rendered and "<tool_response>\n36\n</tool_response>" in rendered


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    forgetful = copy.deepcopy(tokenizer)  # drops every answer but the last, as reasoning templates drop thoughts
    forgetful.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|assistant|><|end|>"
        "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    with pytest.raises(DatasetFormatError, match="does not render assistant turn 4 as a continuation"):
        encode_chat(forgetful, ChatExample(MULTI_TURN, None, "f.jsonl:1"))


def test_jsonl_and_parquet_rows_are_read(tmp_path):
    rows = [{"messages": list(MULTI_TURN)}, {"messages": list(WITH_TOOLS), "tools": list(TOOLS)}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist([{"messages": list(MULTI_TURN)}]), tmp_path / "c.parquet")
    chats = read_chats(tmp_path / "c.jsonl")
    assert [len(c.messages) for c in chats] == [5, 4] and chats[1].tools == TOOLS and chats[0].tools is None
    assert read_chats(tmp_path / "c.parquet")[0].messages[2] == {"role": "assistant", "content": "Answer: 7"}


@pytest.mark.parametrize(
    "row, message",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, ":1: no assistant turn, so nothing to learn"),
        ({"text": "hi"}, ":1: no non-empty 'messages' list (row: ['text'])"),
        (
            {"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
            ":1: field 'messages' message 0 has role 'narrator'; allowed roles: ['system', 'user', 'assistant',",
        ),
        ({"messages": [{"role": "assistant"}]}, ":1: field 'messages' message 0 has no string 'content'"),
        ({"messages": [{"role": "assistant", "content": "y"}], "tools": "python"}, ":1: field 'tools' must be a list"),
    ],
)
def test_a_bad_row_is_one_line_naming_it(tmp_path, row, message):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DatasetFormatError) as err:
        read_chats(path)
    assert f"1 malformed conversation row(s); the first: {path}{message}" in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
