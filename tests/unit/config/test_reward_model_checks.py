"""The reward-model recipe's checks (from_config.pair_checks): pairs data, whole pairs per
micro-batch and rank, eval sets of pairs; each failure one line, and `train` exits 2 on a
bad pairs file before any model is built."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.from_config import validate
from megatron_rl.tasks.base_model import BaseModelSettings

EXAMPLE = str(Path(__file__).resolve().parents[3] / "examples" / "reward_model.yaml")
PAIR = {"prompt": "max of 3 7", "chosen": "Answer: 7", "rejected": "Answer: 3"}


@pytest.fixture
def hf_dir(tmp_path):
    """A directory with the config.json of a tiny dense model (all the checks read)."""
    (tmp_path / "config.json").write_text(json.dumps(BaseModelSettings(family="qwen3").hf_fields(384)))
    return tmp_path


def _pairs(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_example_is_valid_at_tp1_and_tp2():
    validate(load_config(EXAMPLE, []), 1)
    validate(load_config(EXAMPLE, ["parallel.tensor_model_parallel_size=2"]), 2)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.recipe=grpo"], "holds preference pairs: they train a reward model (algorithm.recipe="),
        (["data.source=task:digits_max"], "needs data.source=pairs:PATH (a JSONL/Parquet file of preference pairs)"),
        (["data.source=pairs:task:nope"], "task 'nope' is not known; allowed:"),
        (["trainer.global_batch_size=48"], "global_batch_size=48 pairs must be a multiple of"),
        (["trainer.max_tokens_per_micro_batch=48"], "must be >= 2 x trainer.seq_length=32"),
        (["algorithm.overrides={clip_high: 0.3}"], "does not take algorithm.overrides"),
        (["eval.sets.held_out.source=pairs:task:digits_max"], "a reward model is evaluated on pairs"),
        (["data.source=pairs:none.jsonl", "eval.sets={}"], "data.source='pairs:none.jsonl': none.jsonl: no such"),
    ],
)
def test_a_bad_reward_model_config_is_one_line(hf_dir, overrides, message):
    if overrides[0].startswith("data.source=pairs:none"):
        overrides = [*overrides, f"model.hf_path={hf_dir}"]
    with pytest.raises(ConfigError) as err:
        validate(load_config(EXAMPLE, overrides), 2)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_pairs_file_needs_an_hf_model_and_held_out_needs_the_task(tmp_path, hf_dir):
    path = _pairs(tmp_path / "p.jsonl", [PAIR])
    with pytest.raises(ConfigError, match="model.hf_path must be set when data.source is a file"):
        validate(load_config(EXAMPLE, [f"data.source=pairs:{path}"]), 1)
    with pytest.raises(ConfigError, match="held_out' needs data.source=pairs:task:<name>"):
        validate(load_config(EXAMPLE, [f"data.source=pairs:{path}", f"model.hf_path={hf_dir}"]), 1)
    validate(load_config(EXAMPLE, [f"data.source=pairs:{path}", f"model.hf_path={hf_dir}", "eval.sets={}"]), 1)


def test_train_on_a_pairs_file_without_rejected_exits_2_in_one_line(tmp_path, hf_dir):
    path = _pairs(tmp_path / "p.jsonl", [PAIR, {"prompt": "max of 1 2", "chosen": "Answer: 2"}])
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl", "train", "--config", EXAMPLE, f"data.source=pairs:{path}",
         f"model.hf_path={hf_dir}", f"trainer.run_dir={tmp_path / 'run'}", "eval.sets={}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"megatron-rl: config error: data.source='pairs:{path}': 1 malformed pair row(s); the first: {path}:2: "
        "field 'rejected' is missing (row keys: ['chosen', 'prompt']); a row holds 'chosen' and 'rejected' "
        "conversations (lists of {role, content} messages ending with the assistant), or 'prompt' with 'chosen' "
        "and 'rejected' answer strings"
    ]
    assert not (tmp_path / "run").exists()  # nothing was built or written
