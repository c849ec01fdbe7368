"""The SFT recipe's checks (from_config.sft_checks): conversations data, whole conversations
per micro-batch and rank, eval sets of conversations, nothing an RL run needs; each failure
one line, and `train` exits 2 on a file with no assistant turn before any model is built."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.from_config import validate
from megatron_rl.tasks.base_model import BaseModelSettings

EXAMPLE = str(Path(__file__).resolve().parents[3] / "examples" / "sft.yaml")
CHAT = {"messages": [{"role": "user", "content": "max 3 7"}, {"role": "assistant", "content": "Answer: 7"}]}


@pytest.fixture
def hf_dir(tmp_path):
    """A directory with the config.json of a tiny dense model (all the checks read)."""
    (tmp_path / "config.json").write_text(json.dumps(BaseModelSettings(family="qwen3").hf_fields(384)))
    return tmp_path


def _chats(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_example_is_valid_at_tp1_and_tp2():
    validate(load_config(EXAMPLE, []), 1)
    validate(load_config(EXAMPLE, ["parallel.tensor_model_parallel_size=2"]), 2)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.source=pairs:task:digits_max"], "holds preference pairs: they train a reward model"),
        (["data.source=reasoning_gym:chain_sum"], "algorithm.recipe=sft needs data.source=PATH (a JSONL/Parquet file"),
        (["data.source=task:nope"], "task 'nope' is not known; allowed:"),
        (["trainer.global_batch_size=48"], "global_batch_size=48 conversations must be a multiple of"),
        (["algorithm.overrides={clip_high: 0.3}"], "algorithm.recipe=sft does not take algorithm.overrides"),
        (["reward.scorers={v: {kind: rule}}"], "algorithm.recipe=sft does not take reward.scorers"),
        (["eval.sets.held_out.max_prompts=8", "eval.sets.held_out.source=x.jsonl"], "applies to prompt sets"),
    ],
)
def test_a_bad_sft_config_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(load_config(EXAMPLE, overrides), 2)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_conversations_file_needs_held_out_sets_of_its_own(tmp_path, hf_dir):
    path = _chats(tmp_path / "c.jsonl", [CHAT])
    file_data = [f"data.source={path}", f"model.hf_path={hf_dir}", "data.seed=null"]
    with pytest.raises(ConfigError, match="held_out' needs data.source=task:<name>"):
        validate(load_config(EXAMPLE, file_data), 1)
    with pytest.raises(ConfigError, match="is the training data; evaluate on conversations training never reads"):
        validate(load_config(EXAMPLE, [*file_data, f"eval.sets.held_out.source={path}"]), 1)
    validate(load_config(EXAMPLE, [*file_data, "eval.sets={}"]), 1)


def test_train_on_a_file_without_an_assistant_turn_exits_2_in_one_line(tmp_path, hf_dir):
    path = _chats(tmp_path / "c.jsonl", [CHAT, {"messages": [{"role": "user", "content": "max 1 2"}]}])
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl", "train", "--config", EXAMPLE, f"data.source={path}", "data.seed=null",
         f"model.hf_path={hf_dir}", f"trainer.run_dir={tmp_path / 'run'}", "eval.sets={}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"megatron-rl: config error: data.source='{path}': 1 malformed conversation row(s); the first: {path}:2: "
        "no assistant turn, so nothing to learn; a row holds 'messages': a list of {role, content} messages "
        "(roles system, user, assistant, tool) with at least one assistant turn, and optionally 'tools': a list "
        "of tool schemas"
    ]
    assert not (tmp_path / "run").exists()  # nothing was built or written
