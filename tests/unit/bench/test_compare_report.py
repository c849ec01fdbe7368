"""The comparison report on hand-made metrics rows: per-step curves over seeds, the last-steps
comparison with the baseline, the equal-wall-clock cut, steps and seconds to the target, and
crashed runs counted but kept out of the statistics."""

import pytest

from megatron_rl_lab.bench import compare_report as rep
from megatron_rl_lab.bench.compare_spec import parse_spec


def _rows(rewards, step_s=1.0, val=None):
    """Step 0 (the eval of the starting weights, no reward), then one row per reward."""
    rows = [{"step": 0, **({"val/held_out/accuracy": val[0]} if val else {})}]
    for step, reward in enumerate(rewards, start=1):
        rows.append({"step": step, "reward/mean": reward, "timing/step_s": step_s, "rollout/truncated": None})
    if val:
        rows[-1]["val/held_out/accuracy"] = val[1]
    return tuple(rows)


def _spec(**extra):
    return parse_spec(
        {
            "name": "t",
            "config": "recipe.yaml",
            "seeds": [1, 2],
            "variants": {"a": [], "b": ["trainer.lr=0.1"]},
            "last": 2,
            "grid_points": 5,
            **extra,
        }
    )


def test_curves_and_the_comparison_at_equal_steps():
    results = [
        rep.RunResult("a", 1, "done", _rows([0.0, 0.5, 1.0, 1.0], val=(0.1, 0.3))),
        rep.RunResult("a", 2, "done", _rows([0.0, 0.5, 0.5, 0.5], val=(0.1, 0.5))),
        rep.RunResult("b", 1, "done", _rows([0.0, 1.0, 1.0, 1.0], val=(0.1, 0.5))),
        rep.RunResult("b", 2, "failed", _rows([0.0])),  # crashed: counted, not averaged
    ]
    report = rep.build_report(_spec(), results)
    assert report["metrics"] == [
        "reward/mean",
        "val/held_out/accuracy",
        "actor/entropy",
        "response_length/mean",
        "rollout/truncated",
    ]
    curve = report["curves"]["reward/mean"]["a"]
    assert curve["step"] == [1, 2, 3, 4] and curve["mean"] == [0.0, 0.5, 0.75, 0.75] and curve["n"] == [2] * 4
    assert curve["hi"][2] == pytest.approx(0.75 + 12.7062 * 0.35355 / 1.41421, abs=1e-4)  # sd of .5, 1: .3536
    assert report["curves"]["reward/mean"]["b"]["lo"] == [None] * 4  # one finished seed: no interval
    assert report["curves"]["rollout/truncated"]["a"] == {"step": [], "mean": [], "lo": [], "hi": [], "n": []}
    equal = report["at_equal_steps"]["reward/mean"]
    assert equal["a"]["per_seed"] == {"1": 1.0, "2": 0.5}  # mean of steps 3 and 4
    assert equal["a"]["mean"] == 0.75 and equal["a"]["half_width"] == pytest.approx(12.7062 * 0.25)
    assert equal["b"]["vs_baseline"]["diff"] == 0.25 and equal["b"]["vs_baseline"]["half_width"] is None
    # a held-out set evaluated at steps 0 and 4 gives its last value
    assert report["at_equal_steps"]["val/held_out/accuracy"]["a"]["per_seed"] == {"1": 0.3, "2": 0.5}
    assert report["crashes"] == {
        "a": {"done": 2, "failed": 0, "pending": 0},
        "b": {"done": 1, "failed": 1, "pending": 0},
    }


def test_equal_wall_clock_cuts_every_run_at_the_shortest_total():
    results = [
        rep.RunResult("a", 1, "done", _rows([0.0, 0.25, 0.5, 0.75], step_s=1.0)),  # steps 2-4: 3 s
        rep.RunResult("b", 1, "done", _rows([0.0, 0.5, 1.0, 1.0], step_s=2.0)),  # 6 s: steps 1-2 by 3 s
    ]
    report = rep.build_report(_spec(seeds=[1]), results)
    assert report["wall_clock"]["grid_s"] == [0.0, 0.75, 1.5, 2.25, 3.0]
    # b's steps 1-4 end at 0 (step 1 takes no time: one-time costs), 2, 4 and 6 s
    assert report["wall_clock"]["curves"]["reward/mean"]["b"]["mean"] == [0.0, 0.1875, 0.375, 0.5625, 0.75]
    at_time = report["at_equal_time"]
    assert at_time["time_s"] == 3.0
    assert at_time["metrics"]["reward/mean"]["a"]["per_seed"] == {"1": 0.625}  # steps 3, 4
    assert at_time["metrics"]["reward/mean"]["b"]["per_seed"] == {"1": 0.25}  # steps 1, 2
    assert at_time["metrics"]["reward/mean"]["b"]["vs_baseline"]["diff"] == pytest.approx(-0.375)


def test_steps_and_seconds_to_the_target_and_stability():
    spec = _spec(target={"metric": "reward/mean", "value": 0.5, "smooth": 2})
    results = [
        rep.RunResult("a", 1, "done", _rows([0.0, 0.0, 0.5, 0.5, 0.5, 1.0], step_s=1.0)),  # at step 4 (3 s)
        rep.RunResult("a", 2, "done", _rows([0.0, 0.0, 0.0, 0.0, 0.5, 1.0], step_s=1.0)),  # at 6 (5 s)
        rep.RunResult("b", 1, "done", _rows([0.5, 0.5, 0.5, 0.5, 0.5, 0.5], step_s=2.0)),  # at 2 (2 s)
        rep.RunResult("b", 2, "done", _rows([0.0, 0.0, 0.0, 0.0, 0.0, 0.0], step_s=2.0)),  # never
    ]
    target = rep.build_report(spec, results)["to_target"]["variants"]
    assert target["a"]["per_seed"] == {"1": {"step": 4, "time_s": 3.0}, "2": {"step": 6, "time_s": 5.0}}
    assert target["a"]["steps"]["mean"] == 5.0 and target["a"]["reached"] == 2
    assert target["b"]["per_seed"]["2"] is None and (target["b"]["reached"], target["b"]["of"]) == (1, 2)
    assert target["b"]["time_s"]["mean"] == 2.0 and target["b"]["time_s"]["half_width"] is None
    assert target["b"]["speedup_time_vs_baseline"] == 4.0 / 2.0
    assert target["b"]["speedup_steps_vs_baseline"] == 5.0 / 2.0
    stable = rep.build_report(spec, results)["stability"]["variants"]["a"]["per_seed"]["1"]
    assert stable == {"best": 0.75, "last": 0.75, "best_minus_last": 0.0}


def test_cumulative_times_and_wildcard_metrics():
    rows = [{"step": 0}, {"step": 1, "timing/step_s": 2.0}, {"step": 2, "timing/step_s": 3.0}, {"step": 3}]
    assert rep.cumulative_times(rows) == {0: 0.0, 1: 0.0, 2: 3.0, 3: None}  # step 1 takes no time
    keys = [{"step": 0, "val/x/accuracy": 1, "val/y/accuracy": 1, "val/x/pass@4": 1}]
    assert rep.expand_metrics(["val/*/accuracy", "reward/mean"], keys) == [
        "val/x/accuracy",
        "val/y/accuracy",
        "reward/mean",
    ]
