"""Prompt datasets from JSONL and Parquet: DAPO-style rows, chat templating, and one clear
error listing every malformed row with its file:line (JSONL) or row index (Parquet)."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.data import DatasetFormatError, PromptDataset, PromptFields


def write_jsonl(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def dapo_row(question, truth):
    return {
        "data_source": "math",
        "prompt": [{"role": "user", "content": question}],
        "ability": "MATH",
        "reward_model": {"ground_truth": truth, "style": "rule"},
    }


def test_dapo_rows_are_chat_templated(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [dapo_row("max of 3 7", "7"), dapo_row("1+1?", 2)])
    ds = PromptDataset(path, tokenizer)
    assert len(ds) == 2
    expected = tokenizer("<|user|>max of 3 7<|end|><|assistant|>", add_special_tokens=False).input_ids
    assert list(ds[0].prompt_ids) == expected
    assert (ds[0].answer, ds[1].answer) == ("7", "2")  # numbers become strings
    assert ds[1].location == f"{path}:2"


def test_string_prompts_with_custom_fields_template_and_system_prompt(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "s.jsonl", [{"q": "3 7", "a": "7"}])
    fields = PromptFields(prompt="q", answer="a", prompt_template="max of {prompt}", system_prompt="be brief")
    ds = PromptDataset(path, tokenizer, fields=fields)
    text = "<|system|>be brief<|end|><|user|>max of 3 7<|end|><|assistant|>"
    assert list(ds[0].prompt_ids) == tokenizer(text, add_special_tokens=False).input_ids


def test_malformed_jsonl_rows_are_reported_together_with_line_numbers(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            dapo_row("ok", "1"),  # line 1: fine
            "",  # line 2: blank, skipped
            {"prompt": "no answer here"},  # line 3: answer missing
            "{not json",  # line 4
            dapo_row("ok", "2"),  # line 5: fine
            {"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "3"}},  # line 6
            {"prompt": 5, "reward_model": {"ground_truth": "3"}},  # line 7
            dapo_row("ok", ""),  # line 8: empty answer
        ],
    )
    with pytest.raises(DatasetFormatError) as info:
        PromptDataset(path, tokenizer)
    message = str(info.value)
    assert message.startswith("5 malformed row(s) (prompt field 'prompt', answer field 'reward_model.ground_truth')")
    listed = re.findall(r"bad\.jsonl:(\d+): (.*)", message)
    assert [int(n) for n, _ in listed] == [3, 4, 6, 7, 8]
    reasons = dict((int(n), text) for n, text in listed)
    assert reasons[3].startswith("field 'reward_model.ground_truth' is missing")
    assert reasons[4].startswith("not valid JSON")
    assert reasons[6].startswith("field 'prompt' message 0 is not a")
    assert reasons[7].startswith("field 'prompt' must be a non-empty string or list")
    assert reasons[8] == "field 'reward_model.ground_truth' is empty"


def test_parquet_rows_and_row_index_in_errors(tmp_path, tokenizer):
    good = tmp_path / "good.parquet"
    pq.write_table(pa.Table.from_pylist([dapo_row("max of 1 2", "2"), dapo_row("max of 5 4", "5")]), good)
    ds = PromptDataset(good, tokenizer)
    assert [r.answer for r in ds.records] == ["2", "5"]
    assert ds[1].location == f"{good} row 1"

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "a", "solution": "1"}, {"question": None, "solution": "2"}]), bad)
    with pytest.raises(
        DatasetFormatError, match=r"1 malformed row\(s\)[^\n]*\n  .*bad\.parquet row 1: field 'question' must be"
    ):
        PromptDataset(bad, tokenizer, fields=PromptFields(prompt="question", answer="solution"))


def test_overlong_prompts_are_dropped_and_counted(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "l.jsonl",
        [{"prompt": "max of 1", "answer": "1"}, {"prompt": "max of " + " ".join("9" * 40), "answer": "9"}],
    )
    ds = PromptDataset(path, tokenizer, fields=PromptFields(answer="answer"), max_prompt_tokens=20)
    assert (len(ds), ds.num_dropped_overlong) == (1, 1)


def test_unknown_format_and_missing_file(tmp_path, tokenizer):
    with pytest.raises(DatasetFormatError, match=r"unknown dataset format '\.csv'; allowed"):
        PromptDataset(tmp_path / "x.csv", tokenizer)
    with pytest.raises(DatasetFormatError, match="no such dataset file"):
        PromptDataset(tmp_path / "x.jsonl", tokenizer)
