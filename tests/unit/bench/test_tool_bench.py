"""The tool-episodes benchmark without an engine: arguments refused in one line with exit
code 2, the calculator that stands in for a remote tool, the padding of a turn's calls to
their drawn duration, and the JSON summary of hand-made batch records against numbers
computed by hand."""

import argparse
import time

import pytest

from megatron_rl.environments.tool_calls import ToolCall, ToolResult
from megatron_rl_lab.bench import tool_episodes as bench
from megatron_rl_lab.bench.args import BenchArgumentError
from megatron_rl_lab.bench.cli import main


def _args(tmp_path, *argv: str) -> argparse.Namespace:
    sub = argparse.ArgumentParser().add_subparsers()
    return bench.add_parser(sub).parse_args(["--dir", str(tmp_path / "runs"), *argv])


def test_bad_arguments_are_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(BenchArgumentError, match="runs one engine in one process, not WORLD_SIZE=2"):
        bench.make_plan(_args(tmp_path), world=2)
    with pytest.raises(BenchArgumentError, match="--batches 1: the sums start at batch 2"):
        bench.make_plan(_args(tmp_path, "--batches", "1"), world=1)
    with pytest.raises(BenchArgumentError, match="no config.json there"):
        bench.make_plan(_args(tmp_path, "--base", str(tmp_path)), world=1)
    with pytest.raises(BenchArgumentError, match="environment.tools is empty; the bench times tool calls"):
        bench.make_plan(_args(tmp_path, "--set", "environment.name=single_turn", "--set", "environment.tools=[]"), 1)
    assert bench.make_plan(_args(tmp_path), world=1).tool_seconds == (0.2, 1.0)
    assert main(["tools", "--set", "trainer.seq_lenght=1", "--dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-rl bench tools: error: --config ") and "seq_lenght" in err
    assert err.count("\n") == 1
    with pytest.raises(SystemExit):
        _args(tmp_path, "--tool-seconds", "1,0.2")


def test_the_calculator_answers_arithmetic_as_print_would_and_refuses_the_rest():
    codes = ["print(347 * 812)", "print(7 // 2, -3 ** 2)", "import os", "print(9 ** 99999)", "print(1 / 0)", "x("]
    results = bench.CalculatorService().run([ToolCall("python", {"code": c}) for c in codes])
    assert [r.observation for r in results[:2]] == ["281764\n", "3 -9\n"]
    assert [r.status for r in results] == ["ok", "ok", "error", "error", "error", "error"]
    assert "only print(<arithmetic>)" in results[2].observation and "too large" in results[3].observation


class Instant:
    def run(self, calls):
        return [ToolResult("1\n") for _ in calls]


def test_a_turn_takes_its_drawn_duration_at_least():
    runner = bench.PaddedRunner(Instant(), 0.05, 0.1, seed=0)
    started = time.perf_counter()
    for _ in range(3):
        assert runner.run([ToolCall("python", {"code": "print(1)"})])[0].observation == "1\n"
    assert 0.15 <= time.perf_counter() - started < 0.6


def test_the_summary_sums_the_batches_after_the_first():
    def batch(overlap, lockstep, single):
        return {"overlap": overlap, "lockstep": lockstep, "single_turn": single}

    first = batch(
        {"tokens": 1, "seconds": 9.0, "engine_calls": 9}, {"tokens": 1, "seconds": 9.0}, {"tokens": 1, "seconds": 1.0}
    )
    rest = [
        batch(
            {"tokens": 100, "seconds": 2.0, "engine_calls": 3},
            {"tokens": 90, "seconds": 3.0},
            {"tokens": 100, "seconds": 1.0},
        ),
        batch(
            {"tokens": 200, "seconds": 3.0, "engine_calls": 5},
            {"tokens": 210, "seconds": 4.0},
            {"tokens": 200, "seconds": 2.0},
        ),
    ]
    out = bench.summarize([first, *rest])
    assert out["timed_batches"] == 2 and out["modes"]["overlap"]["engine_calls"] == 8
    assert out["modes"]["overlap"]["tokens_per_s"] == pytest.approx(300 / 5.0)
    assert out["modes"]["single_turn"]["tokens_per_s"] == pytest.approx(300 / 3.0)
    assert out["overlap_vs_single_turn"] == pytest.approx(0.6)
    assert out["lockstep_vs_single_turn"] == pytest.approx((300 / 7.0) / 100.0)
    with pytest.raises(ValueError, match="no batches from index 1 on"):
        bench.summarize([first])
