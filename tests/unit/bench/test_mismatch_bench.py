"""The mismatch benchmark's arguments: bad ones are refused in one line before anything is built."""

import argparse

import pytest

from megatron_rl_lab.bench import mismatch
from megatron_rl_lab.bench.args import BenchArgumentError
from megatron_rl_lab.bench.cli import main


def _args(*argv: str) -> argparse.Namespace:
    sub = argparse.ArgumentParser().add_subparsers()
    return mismatch.add_parser(sub).parse_args(list(argv))


def test_plan_takes_moe_presets_and_refuses_the_rest():
    plan = mismatch.make_plan(_args("--model", "cpu-moe-64e", "--dtype", "fp32"), world=1)
    assert (plan.arch.num_moe_experts, plan.arch.moe_router_topk, plan.dtype) == (64, 8, "float32")
    with pytest.raises(
        BenchArgumentError,
        match="--model tiny-dense-4l is not a MoE model; MoE presets: tiny-moe, tiny-moe-4l, cpu-moe-9m",
    ):
        mismatch.make_plan(_args("--model", "tiny-dense-4l"), world=1)
    with pytest.raises(BenchArgumentError, match="--dtype 'fp16'; allowed: fp32, bf16"):
        mismatch.make_plan(_args("--dtype", "fp16"), world=1)
    with pytest.raises(BenchArgumentError, match="runs in one process; WORLD_SIZE=2"):
        mismatch.make_plan(_args(), world=2)


def test_bad_arguments_exit_2(capsys):
    assert main(["mismatch", "--model", "cpu-dense-5m"]) == 2
    assert "megatron-rl bench mismatch: error: --model cpu-dense-5m is not a MoE model" in capsys.readouterr().err
