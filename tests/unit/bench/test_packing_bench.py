"""The packing benchmark: arguments refused in one line; one small real run where packed and
padded give the same loss and gradients, and the efficiencies are the lengths' own."""

import argparse
import json
import subprocess
import sys

import pytest

from megatron_rl_lab.bench import packing
from megatron_rl_lab.bench.args import BenchArgumentError
from megatron_rl_lab.bench.cli import main


def _args(*argv: str) -> argparse.Namespace:
    sub = argparse.ArgumentParser().add_subparsers()
    return packing.add_parser(sub).parse_args(list(argv))


def test_bad_arguments_are_refused():
    with pytest.raises(BenchArgumentError, match="--distributions 'uniform'; allowed: default, lognormal"):
        packing.make_plan(_args("--distributions", "uniform"), world=1)
    with pytest.raises(BenchArgumentError, match="--rows 12 must be a multiple of 8"):
        packing.make_plan(_args("--rows", "12"), world=1)
    with pytest.raises(BenchArgumentError, match="runs in one process; WORLD_SIZE=2"):
        packing.make_plan(_args(), world=2)


def test_bad_arguments_exit_2(capsys):
    assert main(["packing", "--model", "no-such-model"]) == 2
    assert "megatron-rl bench packing: error:" in capsys.readouterr().err


def test_lognormal_lengths_are_capped_at_16x_the_median():
    prompts, responses, seq_length = packing.sequence_lengths("lognormal", 512, 8, seed=0)
    assert seq_length == 32 + 128 and set(prompts) == {32}
    assert max(responses) <= 128 and min(responses) >= 1
    assert sorted(responses)[256] in range(6, 11)  # the median, within sampling noise of 8


def test_a_small_run_packs_without_changing_the_gradient(tmp_path):
    out = tmp_path / "packing.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rl",
            "bench",
            "packing",
            "--model",
            "tiny-dense-4l",
            "--rows",
            "8",
            "--median",
            "4",
            "--steps",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in json.loads(out.read_text())["results"]:
        prompts, responses, seq_length = packing.sequence_lengths(r["distribution"], 8, 4, seed=0)
        real = sum(prompts) + sum(responses)
        assert r["real_tokens"] == real
        assert r["packing_efficiency"]["padded"] == pytest.approx(real / (8 * seq_length))
        assert r["packing_efficiency"]["packed"] == 1.0  # world 1, no TP: no padding at all
        assert r["grad_max_abs_diff"] < 1e-6 and r["loss_abs_diff"] < 1e-6  # fp32, as the schedules tests
