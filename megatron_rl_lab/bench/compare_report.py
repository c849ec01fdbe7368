"""What `megatron-rl bench compare` reports: the runs' metrics rows in, one JSON-able dict out.

Only finished runs enter the statistics (a crashed run's curve stops where it crashed and
would bias every later step's mean); crashed runs are counted per variant instead. All
intervals are over seeds (:mod:`.seed_stats`):

- ``curves``: per metric and variant, at every step some seed logged it, the mean over
  seeds and its 95 % interval.
- ``wall_clock``: the same on a common time grid from 0 to the shortest finished run's
  total step time. A run's time at step s is the sum of ``timing/step_s`` over steps 2..s
  (start-up and the step-0 eval excluded, and step 1, which pays one-time costs: the
  engine's first batch, and in the first run of a machine the compile caches; the async
  bench leaves it out for the same reason), and its curve is interpolated linearly between
  the steps it logged.
- ``at_equal_steps``: per seed, the mean of a metric over the last ``last`` steps (steps
  > N - last); a metric logged more sparsely, like a held-out eval, gives its last value.
  Then the mean over seeds and each variant's Welch difference against the baseline.
- ``at_equal_time``: the same, with each run cut at the grid's end time.
- ``to_target``: per seed, the first step (and its time) at which the trailing mean of the
  target metric over ``smooth`` logged steps reaches the value (None if never); per
  variant, the mean over the seeds that reached it, how many did, and the baseline's mean
  divided by the variant's (above 1: the variant gets there sooner).
- ``stability``: per seed, the best mean of ``last`` consecutive logged steps of the target
  metric (reward/mean without a target), the mean of the last ``last``, and their gap.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional, Sequence

from megatron_rl_lab.bench import seed_stats as st
from megatron_rl_lab.bench.compare_spec import Spec

STEP_TIME = "timing/step_s"
FIRST_TIMED_STEP = 2
"""Steps before this one take no time on the wall-clock axis (one-time costs)."""
STABILITY_DEFAULT = "reward/mean"
"""The metric of ``stability`` when the spec has no target."""


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One run as the report sees it: ``status`` done | failed | pending, and its rows."""

    variant: str
    seed: int
    status: str
    rows: tuple[dict, ...] = ()


@dataclasses.dataclass(frozen=True)
class Series:
    """One run's values of one metric at the steps that logged it, with those steps' times."""

    steps: tuple[int, ...]
    values: tuple[float, ...]
    times: tuple[Optional[float], ...]


def expand_metrics(patterns: Sequence[str], rows: Sequence[dict]) -> list[str]:
    """Each pattern's metric names in the rows (``*`` matches one path part, e.g. a val set);
    a plain name stays even when no row has it (reported with no data)."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    out: list[str] = []
    for pattern in patterns:
        if "*" not in pattern:
            out.append(pattern)
            continue
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", "[^/]+") + "$")
        out.extend(k for k in keys if regex.match(k))
    return list(dict.fromkeys(out))


def cumulative_times(rows: Sequence[dict]) -> dict[int, Optional[float]]:
    """step -> seconds of steps FIRST_TIMED_STEP..step (0 before it); None from the first timed
    step without a time."""
    out: dict[int, Optional[float]] = {}
    total: Optional[float] = 0.0
    for row in sorted(rows, key=lambda r: r["step"]):
        if row["step"] >= FIRST_TIMED_STEP:
            step_s = row.get(STEP_TIME)
            total = None if total is None or not _number(step_s) else total + float(step_s)
        out[row["step"]] = total
    return out


def series(rows: Sequence[dict], metric: str) -> Series:
    """The finite values of ``metric``, by step (a null or missing value is no point)."""
    times = cumulative_times(rows)
    points = sorted((r["step"], float(r[metric])) for r in rows if _number(r.get(metric)))
    return Series(tuple(p[0] for p in points), tuple(p[1] for p in points), tuple(times[p[0]] for p in points))


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def total_time(rows: Sequence[dict]) -> Optional[float]:
    times = cumulative_times(rows)
    return times[max(times)] if times else None


# -- per-step and per-time curves ------------------------------------------------------------


def _aggregate(columns: Sequence[Sequence[float]]) -> dict:
    """Column-wise mean and interval: {"mean": [...], "lo": [...], "hi": [...], "n": [...]}."""
    cells = [st.mean_interval(list(c)) for c in columns]
    return {
        "mean": [c.mean if c else None for c in cells],
        "lo": [c.lo if c else None for c in cells],
        "hi": [c.hi if c else None for c in cells],
        "n": [c.n if c else 0 for c in cells],
    }


def step_curve(seed_series: Sequence[Series]) -> dict:
    """Mean and interval over seeds at every step any seed logged."""
    steps = sorted({s for one in seed_series for s in one.steps})
    by_step = [dict(zip(one.steps, one.values)) for one in seed_series]
    return {"step": steps, **_aggregate([[b[s] for b in by_step if s in b] for s in steps])}


def time_curve(seed_series: Sequence[Series], grid: Sequence[float]) -> dict:
    """Mean and interval over seeds at every grid time (a seed counts where it has a value)."""
    on_grid = []
    for one in seed_series:
        timed = [(t, v) for t, v in zip(one.times, one.values) if t is not None]
        on_grid.append(st.interpolate([t for t, _ in timed], [v for _, v in timed], grid))
    return _aggregate([[g[i] for g in on_grid if g[i] is not None] for i in range(len(grid))])


# -- the comparisons -----------------------------------------------------------------------


def window_value(one: Series, last: int, until_step: Optional[int] = None) -> Optional[float]:
    """The mean over the steps in (end - last, end] (end: ``until_step`` or the last logged),
    or the last logged value at or before the end when none is that recent."""
    kept = [(s, v) for s, v in zip(one.steps, one.values) if until_step is None or s <= until_step]
    if not kept:
        return None
    end = until_step if until_step is not None else kept[-1][0]
    recent = [v for s, v in kept if s > end - last]
    return sum(recent) / len(recent) if recent else kept[-1][1]


def last_step_by(rows: Sequence[dict], seconds: float) -> int:
    """The last step whose cumulative time is within ``seconds`` (0 if none)."""
    times = cumulative_times(rows)
    return max((s for s, t in times.items() if t is not None and t <= seconds + 1e-9), default=0)


def compare_values(per_seed: dict[str, dict[int, Optional[float]]], baseline: str) -> dict:
    """Per variant: the per-seed values, their mean and interval, and the Welch difference
    against the baseline variant (seeds with no value are left out)."""
    base = [v for v in per_seed.get(baseline, {}).values() if v is not None]
    out = {}
    for variant, values in per_seed.items():
        have = [v for v in values.values() if v is not None]
        interval = st.mean_interval(have)
        entry = {"per_seed": {str(s): v for s, v in values.items()}, **_interval_dict(interval)}
        if variant != baseline:
            diff = st.welch_difference(base, have)
            entry["vs_baseline"] = diff.to_dict() if diff else None
        out[variant] = entry
    return out


def _interval_dict(interval: Optional[st.Interval]) -> dict:
    if interval is None:
        return {"mean": None, "lo": None, "hi": None, "half_width": None, "n": 0}
    return interval.to_dict()


def to_target(runs: dict[str, list[RunResult]], spec: Spec) -> Optional[dict]:
    """Steps and seconds to the spec's target, per seed and per variant."""
    target = spec.target
    if target is None:
        return None
    out = {}
    for variant, results in runs.items():
        per_seed = {}
        for result in results:
            one = series(result.rows, target.metric)
            index = st.first_reaching(one.values, target.value, target.smooth)
            per_seed[str(result.seed)] = (
                {"step": one.steps[index], "time_s": one.times[index]} if index is not None else None
            )
        reached = [p for p in per_seed.values() if p is not None]
        steps = st.mean_interval([p["step"] for p in reached])
        times = st.mean_interval([p["time_s"] for p in reached if p["time_s"] is not None])
        out[variant] = {
            "per_seed": per_seed,
            "reached": len(reached),
            "of": len(results),
            "steps": _interval_dict(steps),
            "time_s": _interval_dict(times),
        }
    base = out.get(spec.baseline)
    for entry in out.values():
        for key, name in (("steps", "speedup_steps_vs_baseline"), ("time_s", "speedup_time_vs_baseline")):
            entry[name] = st.ratio(base and base[key]["mean"], entry[key]["mean"])
    return {"metric": target.metric, "value": target.value, "smooth": target.smooth, "variants": out}


def stability(runs: dict[str, list[RunResult]], metric: str, window: int) -> dict:
    """Per seed: the best and the last mean of ``window`` consecutive logged steps, and the gap."""
    out = {}
    for variant, results in runs.items():
        per_seed = {}
        for result in results:
            values = series(result.rows, metric).values
            best, last = st.best_window_mean(values, window), st.last_window_mean(values, window)
            gap = None if best is None or last is None else best - last
            per_seed[str(result.seed)] = {"best": best, "last": last, "best_minus_last": gap}
        out[variant] = {"per_seed": per_seed}
        for key in ("best", "last", "best_minus_last"):
            have = [p[key] for p in per_seed.values() if p[key] is not None]
            out[variant][key] = _interval_dict(st.mean_interval(have))
    return {"metric": metric, "window": window, "variants": out}


def crashes(results: Sequence[RunResult], variants: Sequence[str]) -> dict:
    return {
        v: {
            status: sum(r.variant == v and r.status == status for r in results)
            for status in ("done", "failed", "pending")
        }
        for v in variants
    }


# -- the report ----------------------------------------------------------------------------


def build_report(spec: Spec, results: Sequence[RunResult]) -> dict:
    """The comparison of the finished runs among ``results`` (see the module docstring)."""
    done = {v: [r for r in results if r.variant == v and r.status == "done"] for v in spec.variants}
    all_rows = [row for rs in done.values() for r in rs for row in r.rows]
    metrics = expand_metrics(spec.metrics, all_rows)
    totals = [total_time(r.rows) for rs in done.values() for r in rs]
    end = min(totals) if totals and None not in totals else None
    grid = st.time_grid(end, spec.grid_points) if end else []
    report = {
        "metrics": metrics,
        "curves": {},
        "wall_clock": {"grid_s": grid, "curves": {}},
        "at_equal_steps": {},
        "at_equal_time": {"time_s": end, "metrics": {}},
    }
    for metric in metrics:
        by_variant = {v: [series(r.rows, metric) for r in rs] for v, rs in done.items()}
        report["curves"][metric] = {v: step_curve(s) for v, s in by_variant.items()}
        report["at_equal_steps"][metric] = compare_values(
            {v: {r.seed: window_value(s, spec.last) for r, s in zip(done[v], ss)} for v, ss in by_variant.items()},
            spec.baseline,
        )
        if not grid:
            continue
        report["wall_clock"]["curves"][metric] = {v: time_curve(s, grid) for v, s in by_variant.items()}
        report["at_equal_time"]["metrics"][metric] = compare_values(
            {
                v: {r.seed: window_value(s, spec.last, last_step_by(r.rows, end)) for r, s in zip(done[v], ss)}
                for v, ss in by_variant.items()
            },
            spec.baseline,
        )
    report["to_target"] = to_target(done, spec)
    report["stability"] = stability(done, spec.target.metric if spec.target else STABILITY_DEFAULT, spec.last)
    report["crashes"] = crashes(results, list(spec.variants))
    return report
