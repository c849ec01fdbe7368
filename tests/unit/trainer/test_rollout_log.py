"""trainer.save_rollouts: the step's rows as JSON lines, checked against hand values."""

import json

import pytest
import torch

from megatron_rl.config import ConfigError, load_config
from megatron_rl.rollout import Sample
from megatron_rl.trainer.assembly import assemble
from megatron_rl.trainer.rollout_log import read_rollouts, rollout_records, step_path, write_rollouts
from megatron_rl.trainer.rollouts import TrainRows


def _batch():
    # Row 0: prompt (5, 6), response (1, 2, 3), its first token trained by an earlier step.
    # Row 1: prompt (7,), response (4, 8), the whole response in the loss.
    samples = [
        Sample(prompt_ids=[5, 6], token_ids=[1, 2, 3], logprobs=[-0.5, -0.25, -2.0], finish_reason="stop"),
        Sample(prompt_ids=[7], token_ids=[4, 8], logprobs=[-1.0, -0.125], finish_reason="length"),
    ]
    rows = TrainRows(
        samples,
        rewards=[1.0, -0.5],
        correct=[1.0, 0.0],
        group_index=[3, 3],
        loss_start=[1, 0],
        fresh_start=[0, 0],
        truncated=[False, False],
    )
    batch = assemble(rows, seq_length=6, pad_token_id=0, temperature=1.0)
    batch.old_logprobs = batch.scatter([[-0.75, -0.5, -1.5], [-1.25, -0.375]])
    batch.advantages = batch.scatter([[0.5, 0.5, 0.5], [-0.5, -0.5]])
    return batch


def test_each_row_is_one_record_of_response_token_lists():
    first, second = rollout_records(_batch())
    assert first == {
        "row": 0,
        "group_index": 3,
        "prompt_ids": [5, 6],
        "token_ids": [1, 2, 3],
        "rollout_logprobs": [-0.5, -0.25, -2.0],
        "reward": 1.0,
        "correct": 1.0,
        "loss_start": 1,
        "finish_reason": "stop",
        "old_logprobs": [-0.75, -0.5, -1.5],
        "advantages": [0.5, 0.5, 0.5],
        "loss_mask": [0, 1, 1],
    }
    assert second["token_ids"] == [4, 8] and second["loss_mask"] == [1, 1]
    assert second["old_logprobs"] == [-1.25, -0.375] and second["advantages"] == [-0.5, -0.5]
    assert second["reward"] == -0.5 and second["finish_reason"] == "length"
    assert "ref_logprobs" not in second and "values" not in second


def test_fields_the_recipe_computes_are_written_too():
    batch = _batch()
    batch.ref_logprobs = batch.scatter([[-1.0, -1.0, -1.0], [-2.0, -2.0]])
    records = rollout_records(batch)
    assert [r["ref_logprobs"] for r in records] == [[-1.0, -1.0, -1.0], [-2.0, -2.0]]


def test_the_file_is_written_whole_under_the_step_number(tmp_path):
    path = write_rollouts(tmp_path, 7, _batch())
    assert path == tmp_path / "rollouts" / "step_000007.jsonl" == step_path(tmp_path, 7)
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["row"] == 1
    assert [p.name for p in path.parent.iterdir()] == ["step_000007.jsonl"]  # no temporary left
    assert read_rollouts(path) == rollout_records(_batch())
    # A rewrite (a resumed run trains the step again) replaces the file.
    batch = _batch()
    batch.advantages = torch.zeros_like(batch.advantages)
    write_rollouts(tmp_path, 7, batch)
    assert read_rollouts(path)[0]["advantages"] == [0.0, 0.0, 0.0]


def test_the_config_key_defaults_off_and_needs_the_rl_job():
    assert load_config(None).trainer.save_rollouts is False
    assert load_config(None, ["trainer.save_rollouts=true"]).trainer.save_rollouts is True
    with pytest.raises(ConfigError, match="trainer.save_rollouts=true needs trainer.job=rl"):
        load_config(None, ["trainer.save_rollouts=true", "trainer.job=smoke"])
