"""Preference pairs from JSONL and Parquet (data.pairs): both row forms, the encoded
conversations, and one line naming what is wrong and what is allowed for every bad input."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.data import DatasetFormatError, encode_conversation, read_pairs

CHOSEN = [{"role": "user", "content": "max of 3 7"}, {"role": "assistant", "content": "Answer: 7"}]
REJECTED = [{"role": "user", "content": "max of 3 7"}, {"role": "assistant", "content": "Answer: 3"}]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_conversation_rows_and_prompt_rows_give_the_same_pair(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"chosen": CHOSEN, "rejected": REJECTED, "extra": 1},
            {"prompt": "max of 3 7", "chosen": "Answer: 7", "rejected": "Answer: 3"},
            {"prompt": CHOSEN[:1], "chosen": "Answer: 7", "rejected": "Answer: 3"},
        ],
    )
    pairs = read_pairs(path)
    assert [p.chosen for p in pairs] == [tuple(CHOSEN)] * 3
    assert [p.rejected for p in pairs] == [tuple(REJECTED)] * 3
    assert pairs[1].location == f"{path}:2"


def test_parquet_rows_read_like_jsonl(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"chosen": CHOSEN, "rejected": REJECTED}] * 2), path)
    pairs = read_pairs(path)
    assert len(pairs) == 2 and pairs[0].chosen == tuple(CHOSEN) and pairs[1].location == f"{path} row 1"


def test_a_conversation_is_encoded_whole_by_the_chat_template(tokenizer):
    ids = encode_conversation(tokenizer, CHOSEN)
    expected = "<|user|>max of 3 7<|end|><|assistant|>Answer: 7<|end|>"
    assert ids == tokenizer(expected, add_special_tokens=False).input_ids


@pytest.mark.parametrize(
    "row, message",
    [
        ({"rejected": REJECTED}, "field 'chosen' is missing (row keys: ['rejected']); a row holds 'chosen' and"),
        ({"chosen": CHOSEN}, "field 'rejected' is missing (row keys: ['chosen'])"),
        (
            {"chosen": [], "rejected": REJECTED},
            "field 'chosen' must be a non-empty list of chat messages, got an empty l",
        ),
        (
            {"chosen": CHOSEN, "rejected": [{"role": "robot", "content": "x"}]},
            "field 'rejected' message 0 has role 'robot'; allowed roles: ['system', 'user', 'assistant', 'tool']",
        ),
        ({"chosen": CHOSEN[:1], "rejected": REJECTED}, "field 'chosen' must end with the assistant's answer"),
        ({"prompt": "max of 3 7", "chosen": "Answer: 7", "rejected": ""}, "field 'rejected' must be a non-empty"),
        ({"prompt": "", "chosen": "a", "rejected": "b"}, "field 'prompt' is an empty string"),
        ("not json", "not valid JSON"),
    ],
)
def test_a_bad_row_is_one_line_naming_the_field_and_what_is_allowed(tmp_path, row, message):
    path = write_jsonl(tmp_path / "p.jsonl", [{"chosen": CHOSEN, "rejected": REJECTED}, row])
    with pytest.raises(DatasetFormatError) as err:
        read_pairs(path)
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(f"1 malformed pair row(s); the first: {path}:2: ")
    assert message in text


def test_a_missing_file_an_unknown_suffix_and_an_empty_file(tmp_path):
    with pytest.raises(DatasetFormatError, match="no such dataset file"):
        read_pairs(tmp_path / "none.jsonl")
    with pytest.raises(DatasetFormatError, match=r"unknown dataset format '\.csv'; allowed"):
        read_pairs(tmp_path / "p.csv")
    with pytest.raises(DatasetFormatError, match="holds no pairs; a row holds 'chosen' and 'rejected'"):
        read_pairs(write_jsonl(tmp_path / "empty.jsonl", []))
