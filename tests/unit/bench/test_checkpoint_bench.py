"""`bench checkpoint`: its options reach the run, it refuses a --dir it would have to clear,
it removes only what it created, and one real run under torchrun (world 2)."""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl_lab.bench import checkpoint as bench
from megatron_rl_lab.bench.args import BenchArgumentError
from megatron_rl_lab.bench.checkpoint_scratch import Scratch
from megatron_rl_lab.testing.torchrun import run_script

ROOT = Path(__file__).resolve().parents[3]
SUBDIRS = ("ours", "torch_dist", "dcp")


def _bench_cli(*argv: str, world: int = 2) -> subprocess.CompletedProcess:
    env = dict(os.environ, WORLD_SIZE=str(world))
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl", "bench", "checkpoint", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_option_has_a_flag_and_reaches_the_run(tmp_path):
    argv = [
        "--model",
        "tiny-moe-4l",
        "--dir",
        str(tmp_path / "d"),
        "--repeats",
        "3",
        "--json",
        str(tmp_path / "o.json"),
        "--keep",
    ]
    args = bench.add_arguments(argparse.ArgumentParser()).parse_args(argv)
    options = bench.options_from_args(args)
    assert options == bench.CheckpointBenchOptions(
        model="tiny-moe-4l", dir=tmp_path / "d", repeats=3, json=tmp_path / "o.json", keep=True
    )
    assert {f.name for f in dataclasses.fields(options)} <= set(vars(args))
    plan = bench.make_plan(options, world=2)
    assert plan.arch.family == "qwen3_moe" and plan.options is options


def test_plan_rejects_what_cannot_run(tmp_path):
    options = bench.CheckpointBenchOptions(model="tiny-dense-4l")
    with pytest.raises(BenchArgumentError, match="world size 3 is not divisible by tensor_model_parallel_size"):
        bench.make_plan(options, world=3)
    with pytest.raises(BenchArgumentError, match="--model: model 'cpu-dense' is neither a preset"):
        bench.make_plan(dataclasses.replace(options, model="cpu-dense"), world=2)
    (tmp_path / "file").write_text("x")
    with pytest.raises(BenchArgumentError, match="exists and is not a directory"):
        bench.make_plan(dataclasses.replace(options, dir=tmp_path / "file"), world=2)


def test_one_device_saves_from_tp1_and_has_no_reshard_layout():
    plan = bench.make_plan(bench.CheckpointBenchOptions(model="tiny-dense-4l"), world=1)
    assert plan.save_layout.tp == 1 and plan.reshard_layout is None
    assert bench.make_plan(bench.CheckpointBenchOptions(model="tiny-dense-4l"), world=2).reshard_layout.tp == 1


def test_a_non_empty_dir_is_refused_with_exit_2_and_left_alone(tmp_path):
    (tmp_path / "data.txt").write_text("precious")
    proc = _bench_cli("--model", "tiny-dense-4l", "--dir", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr == (
        f"megatron-rl bench checkpoint: error: --dir {tmp_path} exists and is not empty; "
        "pass a new or empty directory (the bench removes only what it creates)\n"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["data.txt"] and (tmp_path / "data.txt").read_text() == "precious"


def test_a_new_dir_is_removed_up_to_the_first_directory_that_existed(tmp_path):
    scratch = Scratch(tmp_path / "a" / "b", SUBDIRS)
    root = scratch.create()
    assert root == tmp_path / "a" / "b" and sorted(p.name for p in root.iterdir()) == sorted(SUBDIRS)
    (scratch.path("dcp") / "x.bin").write_bytes(b"1")
    scratch.remove()
    assert list(tmp_path.iterdir()) == []


def test_an_empty_dir_keeps_itself_and_what_others_put_there(tmp_path):
    scratch = Scratch(tmp_path, SUBDIRS)
    scratch.create()
    (scratch.path("ours") / "step_1").mkdir()
    (tmp_path / "someone_else.txt").write_text("not the bench's")
    scratch.empty("dcp")
    assert scratch.path("dcp").is_dir() and list(scratch.path("dcp").iterdir()) == []
    with pytest.raises(KeyError):
        scratch.empty("someone_else.txt")
    scratch.remove()
    assert [p.name for p in tmp_path.iterdir()] == ["someone_else.txt"]


def test_without_dir_a_fresh_temporary_directory_is_made_and_removed():
    scratch = Scratch(None, SUBDIRS)
    root = scratch.create()
    assert root.is_dir() and root.name.startswith("megatron-rl-bench-ckpt-")
    scratch.remove()
    assert not root.exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_short_run_at_world_2_reports_every_method_and_cleans_up(tmp_path):
    out, scratch = tmp_path / "result.json", tmp_path / "new" / "scratch"
    proc = run_script(
        ROOT / "tools" / "bench_checkpoint.py",
        2,
        ["--model", "tiny-dense-4l", "--repeats", "1", "--dir", str(scratch), "--json", str(out)],
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    r = json.loads(out.read_text())
    assert r["world_size"] == 2 and r["model"]["name"] == "tiny-dense-4l"
    for key in (
        "ours_sync_save_s",
        "ours_async_blocking_s",
        "ours_deferred_call_s",
        "torch_dist_save_s",
        "dcp_save_s",
        "ours_load_s",
        "torch_dist_load_s",
        "dcp_load_s",
        "ours_reshard_load_s",
    ):
        assert r[key] > 0, key
    assert r["dcp_reshard_load_s"] is None and len(r["dcp_save_samples_s"]) == 1
    assert len(r["ours_load_samples_s"]) == len(r["torch_dist_reshard_load_samples_s"]) == 1
    # fp32 bytes over the two TP ranks of one replica: TINY_DENSE's 208896 split weights, plus
    # its norms on each rank (4 layers x (2 x 64 hidden + 2 x 32 q/k head) + 64 final).
    assert r["model_bytes"] == 4 * (208896 + 2 * (4 * (2 * 64 + 2 * 32) + 64))
    assert all(size > 0 for size in r["checkpoint_bytes"].values())
    assert "ours (async, deferred)" in proc.stdout and "torch DCP" in proc.stdout
    assert list(tmp_path.iterdir()) == [out]  # "new" was created by the bench, so it is gone


def test_the_cuda_synchronize_no_op_holds_only_inside_its_block():
    """The torch_dist baseline's save needs it on the CPU build (Megatron 0.16.1's filesystem
    writer synchronizes unconditionally); nothing else in the process may see it."""
    import torch

    from megatron_rl_lab.bench.checkpoint_timing import _cuda_synchronize_is_a_noop

    if torch.cuda.is_available():
        pytest.skip("a CUDA build synchronizes for real")
    original = torch.cuda.synchronize
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.synchronize()  # what the writer would hit without the block
    with _cuda_synchronize_is_a_noop():
        assert torch.cuda.synchronize() is None
    assert torch.cuda.synchronize is original
