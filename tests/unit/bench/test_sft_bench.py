"""The SFT bench: arguments refused in one line and exit 2 (its measurement is a benchmark,
docs/benchmarks.md, not a test)."""

import argparse

import pytest

from megatron_rl_lab.bench import sft
from megatron_rl_lab.bench.args import BenchArgumentError
from megatron_rl_lab.bench.cli import main


def _args(*argv: str) -> argparse.Namespace:
    sub = argparse.ArgumentParser().add_subparsers()
    return sft.add_parser(sub).parse_args(list(argv))


def test_bad_arguments_are_refused():
    with pytest.raises(BenchArgumentError, match="--distribution 'uniform'; allowed: default, lognormal"):
        sft.make_plan(_args("--distribution", "uniform"), world=1)
    with pytest.raises(BenchArgumentError, match="--rows 12 must be a multiple of 8"):
        sft.make_plan(_args("--rows", "12"), world=1)
    with pytest.raises(BenchArgumentError, match="runs in one process; WORLD_SIZE=2"):
        sft.make_plan(_args(), world=2)


def test_bad_arguments_exit_2(capsys):
    assert main(["sft", "--model", "no-such-model"]) == 2
    assert "megatron-rl bench sft: error:" in capsys.readouterr().err
