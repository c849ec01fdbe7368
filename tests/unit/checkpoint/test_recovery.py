"""Resuming past a damaged checkpoint: real steps written by the store, then damaged on
disk; the newest intact step is chosen, a damaged one is renamed (never deleted) with one
warning line naming it and the bad file, or the run stops (on_corrupt=fail)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_rl.checkpoint import Checkpointer, iter_model_tensors
from megatron_rl.checkpoint import format as fmt
from megatron_rl.checkpoint.items import Item
from megatron_rl.checkpoint.recovery import newest_intact_step, set_aside
from megatron_rl.config import ConfigError, load_config
from megatron_rl.trainer.state import CRITIC_DIR, choose_resume_step

HEADER = {"extra": {}, "layout": {"world_size": 1}}
RECORD = {"rng": None, "optimizer": None}
ROWS = 512  # 512 x 1024 float32: 2 MiB, two checksum blocks


def _weights(step: int) -> torch.Tensor:
    return torch.full((ROWS, 1024), float(step))


def _save_steps(root, steps):
    with Checkpointer() as ckpt:
        for step in steps:
            ckpt.save_items(root, step, [Item("w", (ROWS, 1024), (0, 0), _weights(step))], HEADER, RECORD).wait()


def _flip_byte(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.fixture
def run(tmp_path):
    root = tmp_path / "checkpoints"
    _save_steps(root, [1, 2, 3])
    return root


def _choose(root, on_corrupt="fallback", roots=None):
    warnings = []
    step = newest_intact_step(roots or [root], on_corrupt, warn=warnings.append)
    return step, warnings


def test_an_intact_newest_step_is_chosen_and_nothing_moves(run):
    assert _choose(run) == (3, [])
    assert fmt.committed_steps(run) == [1, 2, 3]


def test_a_flipped_byte_in_the_second_block_sets_the_step_aside(run):
    data = run / "step_3" / "data_0.bin"
    _flip_byte(data, (1 << 20) + 12345)  # only a full read of the step finds it
    before = data.read_bytes()
    step, warnings = _choose(run)
    assert step == 2 and fmt.committed_steps(run) == [1, 2]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "checkpoint step 3 is corrupt" in warnings[0] and f"{data}" in warnings[0] and "tensor w" in warnings[0]
    assert f"moved aside to {run / 'step_3.corrupt'}" in warnings[0]
    assert (run / "step_3.corrupt" / "data_0.bin").read_bytes() == before  # kept byte for byte
    assert (run / fmt.LATEST).read_text() == "2\n"
    assert dict(iter_model_tensors(run, step))["w"].equal(_weights(2))


def test_fail_stops_with_one_line_and_moves_nothing(run):
    _flip_byte(run / "step_3" / "data_0.bin", 7)
    with pytest.raises(fmt.CheckpointError) as err:
        _choose(run, "fail")
    message = str(err.value)
    assert "\n" not in message and "checkpoint step 3" in message and "step_3/data_0.bin" in message
    assert "checkpoint.on_corrupt=fail" in message
    assert fmt.committed_steps(run) == [1, 2, 3] and not (run / "step_3.corrupt").exists()


def test_damaged_metadata_and_truncated_data_are_named(run):
    meta = run / "step_3" / fmt.METADATA
    meta.write_text(meta.read_text().replace('"world_size":1', '"world_size":2'))
    data = run / "step_2" / "data_0.bin"
    data.write_bytes(data.read_bytes()[:1000])
    step, warnings = _choose(run)
    assert step == 1 and len(warnings) == 2
    assert "step 3" in warnings[0] and "metadata.json: checksum mismatch" in warnings[0]
    assert "step 2" in warnings[1] and f"{data} is truncated" in warnings[1]
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step_")) == [
        "step_1",
        "step_2.corrupt",
        "step_3.corrupt",
    ]


def test_a_damaged_critic_step_sets_aside_both_roles(tmp_path):
    actor, critic = tmp_path / "checkpoints", tmp_path / "checkpoints" / CRITIC_DIR
    _save_steps(critic, [1, 2])
    _save_steps(actor, [1, 2])
    _flip_byte(critic / "step_2" / "data_0.bin", 3)
    step, warnings = _choose(actor, roots=[actor, critic])
    assert step == 1 and len(warnings) == 1 and f"{critic / 'step_2' / 'data_0.bin'}" in warnings[0]
    assert fmt.committed_steps(actor) == [1] and fmt.committed_steps(critic) == [1]
    assert (actor / "step_2.corrupt").is_dir() and (critic / "step_2.corrupt").is_dir()


def test_nothing_intact_is_an_error_and_nothing_committed_is_a_fresh_run(run, tmp_path):
    for step in (1, 2, 3):
        _flip_byte(run / f"step_{step}" / "data_0.bin", 0)
    with pytest.raises(fmt.CheckpointError, match=r"no intact checkpoint under .*: steps \[1, 2, 3\] are all corrupt"):
        _choose(run)
    assert len(list(run.glob("step_*.corrupt"))) == 3  # all kept
    assert _choose(tmp_path / "fresh") == (None, [])


def test_a_second_corrupt_copy_of_a_step_gets_its_own_name(run):
    first = set_aside(run, 3)
    _save_steps(run, [3])
    second = set_aside(run, 3)
    assert (first.name, second.name) == ("step_3.corrupt", "step_3.corrupt.2")
    assert fmt.committed_steps(run) == [1, 2]


def test_on_corrupt_is_validated():
    assert load_config(None, []).checkpoint.on_corrupt == "fallback"
    assert load_config(None, ["checkpoint.on_corrupt=fail"]).checkpoint.on_corrupt == "fail"
    allowed = r"checkpoint.on_corrupt='skip' is not allowed; choose one of \['fail', 'fallback'\]"
    with pytest.raises(ConfigError, match=allowed):
        load_config(None, ["checkpoint.on_corrupt=skip"])


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_trainer_choice_fails_as_a_config_error(run, one_rank_group, capsys):
    _flip_byte(run / "step_3" / "data_0.bin", 5)
    with pytest.raises(ConfigError, match="checkpoint step 3 under .* is corrupt"):
        choose_resume_step(run, "fail")
    assert choose_resume_step(run, "fallback") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: checkpoint step 3 is corrupt")


def test_train_with_on_corrupt_fail_stops_before_building_anything(tmp_path):
    """`megatron-rl train` itself: exit 2, the error as the last stderr line, no base model built."""
    _save_steps(tmp_path / "run" / "checkpoints", [1, 2])
    _flip_byte(tmp_path / "run" / "checkpoints" / "step_2" / "data_0.bin", 9)
    repo = Path(__file__).resolve().parents[3]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rl",
            "train",
            f"trainer.run_dir={tmp_path / 'run'}",
            "checkpoint.on_corrupt=fail",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron-rl: config error: checkpoint step 2 under") and "step_2/data_0.bin" in last
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints", "config.yaml"]
    assert fmt.committed_steps(tmp_path / "run" / "checkpoints") == [1, 2]
