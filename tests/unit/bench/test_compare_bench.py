"""`megatron-rl bench compare` without a trainer: a bad spec refused in one line with exit code 2,
the runs' commands and environment, and resuming: with a stand-in runner that writes a
metrics.jsonl, an interrupted comparison run again executes only the run that had not
finished, and a crashed run is counted and not rerun unless asked."""

import argparse
import json
import os
import re
from pathlib import Path

import pytest

from megatron_rl.tasks.base_model import BASE_CACHE_ENV
from megatron_rl_lab.bench import compare, compare_plot
from megatron_rl_lab.bench.cli import main
from megatron_rl_lab.bench.compare_runs import MARKER
from megatron_rl_lab.bench.compare_spec import REQUIRED, SpecError, load_spec, parse_spec

STEPS = 3
SPEC = """\
name: t
config: {config}
overrides: [trainer.max_steps={steps}]
seeds: [1, 2]
variants:
  a: []
  b: [trainer.lr=0.1]
target: {{metric: reward/mean, value: 0.5, smooth: 1}}
last: 2
"""


def _spec_file(tmp_path, text=None):
    config = tmp_path / "recipe.yaml"
    config.write_text("trainer: {}\n")
    path = tmp_path / "spec.yaml"
    path.write_text(text if text is not None else SPEC.format(config=config, steps=STEPS))
    return path


def _args(tmp_path, *argv):
    sub = argparse.ArgumentParser().add_subparsers()
    return compare.add_parser(sub).parse_args([str(_spec_file(tmp_path)), "--out", str(tmp_path / "out"), *argv])


class StandIn:
    """Writes a metrics.jsonl as the trainer would; ``outcomes`` maps a run label to what to do
    instead of finishing: an exit code, ``"short"`` (exit 0 after one step) or ``"interrupt"``
    (Ctrl-C after one step)."""

    def __init__(self, outcomes=None):
        self.outcomes = dict(outcomes or {})
        self.calls = []

    def __call__(self, command, run_dir, env):
        label = f"{run_dir.parent.name}/{run_dir.name}"
        self.calls.append((label, list(command), dict(env)))
        outcome = self.outcomes.pop(label, 0)
        seed = int(run_dir.name.removeprefix("seed"))
        steps = 1 if outcome in ("interrupt", "short") else STEPS
        rows = [{"step": 0}] + [
            {"step": s, "reward/mean": 0.25 * s * seed, "timing/step_s": 1.0} for s in range(1, steps + 1)
        ]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if outcome == "interrupt":
            raise KeyboardInterrupt
        return (0 if outcome == "short" else outcome), 3.0


def _labels(runner):
    return [call[0] for call in runner.calls]


def _no_plot(report, title, out):
    return out


def _run(tmp_path, runner, *argv, draw=_no_plot):
    """The harness with the stand-in runner, the config check (which imports torch) replaced
    by the spec's step count, and no plot but where a test asks for one."""
    return compare.run_args(
        _args(tmp_path, *argv), run_one=runner, max_steps=lambda config, overrides: STEPS, draw=draw
    )


def test_an_interrupted_comparison_reruns_only_the_unfinished_run(tmp_path):
    first = StandIn({"b/seed2": "interrupt"})
    assert _run(tmp_path, first) == 75  # stopped: run again to go on
    assert _labels(first) == ["a/seed1", "b/seed1", "a/seed2", "b/seed2"]  # seed by seed
    assert not (tmp_path / "out/runs/b/seed2" / MARKER).exists()
    again = StandIn()
    assert _run(tmp_path, again) == 0
    assert _labels(again) == ["b/seed2"]
    assert _run(tmp_path, third := StandIn(), draw=compare_plot.draw) == 0 and third.calls == []
    report = json.loads((tmp_path / "out/compare.json").read_text())
    assert [r["status"] for r in report["runs"]] == ["done"] * 4
    # seed 1 rewards .25, .5, .75; seed 2 .5, 1, 1.5: last 2 steps .625 and 1.25
    assert report["at_equal_steps"]["reward/mean"]["a"]["per_seed"] == {"1": 0.625, "2": 1.25}
    assert report["to_target"]["variants"]["a"]["per_seed"]["1"] == {"step": 2, "time_s": 1.0}
    assert (tmp_path / "out/compare.png").stat().st_size > 0


def test_a_crash_is_counted_and_rerun_only_when_asked(tmp_path):
    assert _run(tmp_path, StandIn({"a/seed2": 1})) == 1
    marker = json.loads((tmp_path / "out/runs/a/seed2" / MARKER).read_text())
    assert (marker["status"], marker["exit_code"], marker["wall_s"]) == ("failed", 1, 3.0)
    assert _run(tmp_path, skipped := StandIn()) == 1 and skipped.calls == []
    report = json.loads((tmp_path / "out/compare.json").read_text())
    assert report["crashes"]["a"] == {"done": 1, "failed": 1, "pending": 0}
    assert report["at_equal_steps"]["reward/mean"]["a"]["n"] == 1  # the crashed seed is not averaged
    assert _run(tmp_path, retried := StandIn(), "--retry-failed") == 0 and _labels(retried) == ["a/seed2"]
    assert _run(tmp_path, StandIn(), "--report-only") == 0


def test_exit_0_short_of_max_steps_is_not_finished(tmp_path):
    assert _run(tmp_path, StandIn({"b/seed1": "short"})) == 1
    marker = json.loads((tmp_path / "out/runs/b/seed1" / MARKER).read_text())
    assert (marker["status"], marker["exit_code"], marker["steps"], marker["max_steps"]) == ("failed", 0, 1, 3)


def test_the_runs_commands_and_environment(tmp_path):
    runner = StandIn()
    assert _run(tmp_path, runner, "--seeds", "2", "--variants", "b") == 0
    ((label, command, env),) = runner.calls
    assert label == "b/seed2"
    assert command[1:5] == ["-m", "megatron_rl", "train", "--config"]
    assert command[6:] == [
        "trainer.max_steps=3",
        "trainer.lr=0.1",
        "trainer.seed=2",
        "data.seed=0",  # one base for every seed
        f"trainer.run_dir={tmp_path / 'out/runs/b/seed2'}",
    ]
    assert env[BASE_CACHE_ENV] == str(tmp_path / "out/base_cache")
    assert env["VLLM_CACHE_ROOT"] in (str(tmp_path / "out/cache/vllm"), os.environ.get("VLLM_CACHE_ROOT"))
    report = json.loads((tmp_path / "out/compare.json").read_text())
    assert [r["status"] for r in report["runs"]] == ["pending", "pending", "pending", "done"]


def test_dry_run_prints_the_commands_and_runs_nothing(tmp_path, capsys):
    runner = StandIn()
    assert _run(tmp_path, runner, "--dry-run") == 0
    out = capsys.readouterr().out
    assert runner.calls == [] and out.count("# ") == 4 and "trainer.seed=2" in out
    assert not (tmp_path / "out").exists()


def test_a_run_dir_of_another_spec_is_refused(tmp_path, capsys):
    assert _run(tmp_path, StandIn(), "--seeds", "1", "--variants", "a") == 0
    spec = _spec_file(tmp_path)
    spec.write_text(spec.read_text().replace("trainer.max_steps=3", "trainer.max_steps=3, trainer.lr=0.5"))
    args = compare.add_parser(argparse.ArgumentParser().add_subparsers()).parse_args(
        [str(spec), "--out", str(tmp_path / "out")]
    )
    assert compare.run_args(args, run_one=StandIn(), max_steps=lambda c, o: STEPS, draw=_no_plot) == 2
    err = capsys.readouterr().err
    assert "runs/a/seed1 holds a run of another spec" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "change, message",
    [
        ({"seeds": []}, "seeds: expected a non-empty list of distinct integers, got []"),
        ({"seeds": [1, 1]}, "seeds: expected a non-empty list of distinct integers"),
        ({"variants": {"a b": []}}, "variants: name 'a b' must be a word"),
        ({"variants": {"a": ["trainer.seed=3"]}}, "variants.a: 'trainer.seed=3' sets a key the harness sets per run"),
        ({"overrides": ["trainer.lr"]}, "overrides: expected a list of 'key=value' config overrides"),
        ({"target": {"metric": "reward/mean"}}, "target.value: expected a number, got None"),
        ({"target": {"metric": "reward/mean", "value": 1, "window": 3}}, "target: expected a mapping with keys"),
        ({"last": 0}, "last: expected an integer >= 1, got 0"),
        ({"base_seed": "x"}, "base_seed: expected an integer or null"),
        ({"seed": [1]}, "unknown key 'seed'; allowed: name, config, seeds, variants, overrides"),
    ],
)
def test_bad_specs_name_the_key_and_what_it_allows(change, message):
    raw = {"name": "t", "config": "x.yaml", "seeds": [1], "variants": {"a": []}, **change}
    with pytest.raises(SpecError, match="^" + re.escape(message)):
        parse_spec(raw)


def test_a_bad_spec_exits_2_with_one_line_before_anything_runs(tmp_path, capsys):
    spec = _spec_file(tmp_path, "name: t\nconfig: x.yaml\nseeds: [1]\n")
    assert main(["compare", str(spec), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert (
        err == f"megatron-rl bench compare: error: {spec}: missing key 'variants' (required: {', '.join(REQUIRED)})\n"
    )
    assert main(["compare", str(_spec_file(tmp_path)), "--seeds", "7", "--dry-run"]) == 2
    assert capsys.readouterr().err == "megatron-rl bench compare: error: --seeds 7: choose from the spec's 1, 2\n"
    assert not (tmp_path / "out").exists()


def test_the_example_spec_parses():
    repo = Path(__file__).resolve().parents[3]
    spec = load_spec(repo / "examples/compare/tppo_vs_ppo.yaml")
    assert spec.baseline == "ppo" and list(spec.variants) == ["ppo", "tppo"] and (repo / spec.config).is_file()
