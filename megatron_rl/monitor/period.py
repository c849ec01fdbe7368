"""The job's step period, estimated from the trace, and the time scales that follow it.

The detector's default time constants (8 s windows, a 32 s level, 110 s continuity)
assume training steps of seconds: then a window or two already spans a step, and the
per-second comparison across machines sees the same phase of the step everywhere except
for small sampler offsets. RL steps take minutes, and pipeline stages run the same step
tens of seconds apart, so at any second different machines sit in different phases of
the step and their per-second metrics differ for no fault at all.

What follows the step period P (`time_scales`):
- **Step averaging.** When P is longer than the level span covers twice
  (`P > level_span_s / 2`, 16 s by default), each machine's per-second metric is first
  replaced by its mean over the last P seconds (one whole step; P here is the
  per-second metrics' own cycle when it agrees with the reported step, `average_span`).
  The mean of a periodic signal over one full period does not depend on its phase, so
  pipeline-stage offsets and sampler phases cancel before machines are compared; a
  fault that changes a machine's work still changes its step mean. The 8 s windows then
  slide over step means, i.e. every window covers at least one whole step. Step metrics (`step_time`
  and the section times) already hold one value per step and are left as they are.
- **Continuity** for every metric is max(continuity_s, continuity_steps x P) (continuity_s
  grown for jobs above `continuity_machines`, `size_continuity_s`): a run of
  candidacy has to span several steps, not one odd step (with short steps this is
  continuity_s: 4 x 12 s < 110 s). Step averaging makes a transient slowdown last a step
  longer and, noise averaged away, stand out more; several steps of candidacy is what
  still tells it from a fault.
- **Intermittency span**: its slices must outlast one step-averaged transient
  (60 s plus the step), so each slice is stretched by P when step averaging is on.

Estimating P (`estimate_period`): the median `step_time` when the trainer reports it
(else the sum of the section medians), else the dominant period of the machines' own
per-second metrics: the autocorrelation of each machine's series (so pipeline-stage
offsets between machines do not matter), averaged over machines and metrics, and its
highest peak after the first trough. No clear peak: None, and the default time scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import DetectConfig
from .trace import STEP_METRICS
from .tuning import Tuning
from .windows import Grid, complete_trailing_mean, fill_gaps_from, nanmedian


def reported_period(grid: Grid) -> float | None:
    """Median `step_time` over machines and seconds (else the sum of the section
    medians): how long one training step takes, as the trainer reports it."""
    have = {m: k for k, m in enumerate(grid.metrics) if m in STEP_METRICS}
    names = ["step_time"] if "step_time" in have else list(have)
    medians = [np.nanmedian(grid.values[have[m]]) for m in names if np.isfinite(grid.values[have[m]]).any()]
    return float(sum(medians)) if medians else None


STALE_MIN_S = 30.0
"""A step value is stale after max(stale_steps steps, this long) without a new step."""


def unchanged_for(x: np.ndarray) -> np.ndarray:
    """Samples since each value of x [..., T] last changed (NaNs are gaps: the value before
    them carries on), counted from the first sample; int32."""
    t = np.arange(x.shape[-1], dtype=np.int32)
    seen = np.where(np.isnan(x), np.int32(0), t)
    np.maximum.accumulate(seen, axis=-1, out=seen)
    carried = np.take_along_axis(x, seen, -1)  # forward-filled (leading NaNs stay NaN)
    changed = np.ones(x.shape, bool)
    np.not_equal(carried[..., 1:], carried[..., :-1], out=changed[..., 1:])  # NaN != NaN: leading gaps are new
    last = np.where(changed, t, np.int32(0))
    np.maximum.accumulate(last, axis=-1, out=last)
    np.subtract(t, last, out=last)
    return last


def without_stale_steps(grid: Grid, stale_steps: float) -> Grid:
    """The grid with step and section times blanked (NaN) where a machine has not reported a
    new step for max(stale_steps reported steps, STALE_MIN_S): what is left is the last
    step before a stall, not a measurement of now.

    Why: when the job hangs (a machine stops, and every collective waits for it), no rank
    finishes a step and every collector repeats its rank's last step times. A rank whose
    last step happened to be slow (a transient) then looks slow for as long as the hang
    lasts, long enough to be declared: on the coupled generator's hang traces these were
    half of the false alarms with step metrics. The stalled rank itself
    is found by its GPU and host metrics. 0 keeps every value; so does a grid with nothing
    stale (the same object, no copy)."""
    is_step = np.flatnonzero([m in STEP_METRICS for m in grid.metrics])
    period = reported_period(grid)
    if not stale_steps or not is_step.size or period is None:
        return grid
    limit = max(stale_steps * period, STALE_MIN_S) / grid.step_s
    stale = unchanged_for(grid.values[is_step]) > limit
    if not stale.any():
        return grid
    values = grid.values.copy()
    step = values[is_step]
    step[stale] = np.nan
    values[is_step] = step
    return Grid(values, grid.metrics, grid.machines, grid.start, grid.step_s)


def autocorrelation_period(
    values: np.ndarray, max_machines: int = 64, min_lag: int = 2, max_frac: float = 1 / 3, min_prominence: float = 0.05
) -> float | None:
    """Dominant period (in samples) of per-machine series; values: [metrics, machines, T].

    Each series (a metric of one machine) is centred and its autocorrelation normalised
    to 1 at lag 0; they are averaged with equal weight. At most `max_machines` machines,
    spread evenly over the list, are used: the period is the job's, and 64 machines'
    worth of series is plenty (and keeps the cost to a few ms at any cluster size).
    The period is the highest peak after the first trough, between `min_lag` and
    `max_frac` of the trace (at least three periods in view), and only if that peak
    rises `min_prominence` above the trough; else None. An earlier peak that rises at
    least 80 % as high is taken instead (the highest can be a multiple of the period).
    """
    n_k, n_m, n_t = values.shape
    if n_t < 3 * min_lag + 3:
        return None
    pick = np.unique(np.linspace(0, n_m - 1, min(n_m, max_machines)).round().astype(int))
    x = values[:, pick].reshape(-1, n_t).astype(np.float64)
    ok = np.isfinite(x)
    mean = np.where(ok, x, 0).sum(-1, keepdims=True) / np.maximum(ok.sum(-1, keepdims=True), 1)
    x = np.where(ok, x - mean, 0.0)  # a missing sample counts as the series' mean
    spec = np.fft.rfft(x, 2 * n_t)
    acf = np.fft.irfft(spec.real**2 + spec.imag**2, 2 * n_t)[:, :n_t]
    live = acf[:, 0] > 0
    if not live.any():
        return None
    acf = (acf[live] / acf[live, :1]).mean(0)
    hi = int(n_t * max_frac)
    if hi <= min_lag + 2:
        return None
    d = np.diff(acf[: hi + 1])
    troughs = np.flatnonzero((d[:-1] < 0) & (d[1:] >= 0)) + 1
    troughs = troughs[troughs >= min_lag]
    if troughs.size == 0:
        return None
    first = int(troughs[0])
    best = first + int(np.argmax(acf[first : hi + 1]))
    rise = acf[best] - acf[first]
    if best >= hi or rise < min_prominence:  # still rising at the edge, or flat
        return None
    # The earliest peak nearly as high as the highest: sampled at whole seconds, a period
    # of 6.5 s peaks lower at lag 6-7 than its double does at lag 13 (an octave error).
    peaks = np.flatnonzero((d[:-1] > 0) & (d[1:] <= 0)) + 1
    peaks = peaks[(peaks > first) & (peaks <= best) & (acf[peaks] - acf[first] >= 0.8 * rise)]
    peak = int(peaks[0]) if peaks.size else best
    # Parabolic interpolation of the peak: sub-sample precision for short periods.
    a, b, c = acf[peak - 1], acf[peak], acf[peak + 1]
    shift = 0.5 * (a - c) / (a - 2 * b + c) if (a - 2 * b + c) < 0 else 0.0
    return float(peak + shift)


def estimate_period(grid: Grid) -> float | None:
    """The job's step period in seconds: reported step times, else autocorrelation."""
    reported = reported_period(grid)
    return reported if reported is not None else cycle_period(grid)


def cycle_period(grid: Grid) -> float | None:
    """The period the per-second metrics themselves repeat at, in seconds (their
    autocorrelation; None without a clear one).

    This, not the reported step time, is what an average has to span a whole number of
    to cancel the step's phase: the median of reported step times is a median over
    steps of varying length, and a few per cent off it leaves part of a step in every
    mean of several steps."""
    per_second = [k for k, m in enumerate(grid.metrics) if m not in STEP_METRICS]
    lag = autocorrelation_period(grid.values[per_second]) if per_second else None
    return None if lag is None else lag * grid.step_s


@dataclass(frozen=True)
class TimeScales:
    """The detector's time constants for one call, in seconds (see the module docstring)."""

    period_s: float | None
    """The estimated step period (None: not known)."""
    average_s: float
    """Per-second metrics are averaged over this trailing span first (0: not averaged)."""
    continuity_s: float
    """Candidacy a run needs on a per-second metric."""
    step_continuity_s: float
    """Candidacy a run needs on a step metric: continuity_s and `straggler_steps` steps
    (a run on both kinds of metric needs the longer)."""
    intermittency_span_s: float
    """Span of the intermittency score (three slices)."""


def time_scales(
    cfg: DetectConfig,
    tuning: Tuning,
    period_s: float | None,
    cycle_s: float | None = None,
    machines: int | None = None,
) -> TimeScales:
    """Time constants for a job of `machines` (None: not counted) whose step takes
    `period_s` (None: the defaults) and whose per-second metrics repeat every `cycle_s`
    (None: not known)."""
    p = period_s or 0.0
    followed = p if tuning.follow_step else 0.0  # without follow_step: the fixed time constants
    average = average_span(followed, cycle_s) if followed > tuning.level_span_s / 2 else 0.0
    base = cfg.continuity_s + size_continuity_s(tuning, machines)
    return TimeScales(
        period_s=period_s,
        average_s=average,
        continuity_s=max(base, tuning.continuity_steps * followed),
        step_continuity_s=max(base, tuning.straggler_steps * p),
        intermittency_span_s=tuning.intermittency_span_s + 3 * average,
    )


def size_continuity_s(tuning: Tuning, machines: int | None) -> float:
    """Seconds of continuity a job of `machines` needs beyond continuity_s: 0 up to
    `continuity_machines`, then `continuity_per_doubling_s` per doubling (see there)."""
    if not machines or machines <= tuning.continuity_machines:
        return 0.0
    return tuning.continuity_per_doubling_s * float(np.log2(machines / tuning.continuity_machines))


def average_span(period_s: float, cycle_s: float | None) -> float:
    """Seconds a step average spans: the per-second metrics' own cycle when it is the same
    step as `period_s` (within a quarter of it; a half or a double of the step is not),
    else `period_s`.

    Only a whole cycle cancels the phase of pipeline stages. The reported period is the
    median of per-second step-time readings, which counts a long step once per second it
    lasts: on the tuning traces with 40-90 s steps it is off the drawn step length by
    4 % (median, at most 10 %; mostly long), so every mean would cover part of a step
    twice, a different part on each stage; the autocorrelation is within 0.5 %."""
    if cycle_s and abs(cycle_s / period_s - 1) <= 0.25:
        return cycle_s
    return period_s


def step_average(
    values: np.ndarray, span: int, max_gap: int, metrics: list[str], min_present: float = 0.9
) -> np.ndarray:
    """Trailing mean over `span` samples of every per-second metric (step metrics are
    copied as they are); values: [metrics, machines, T].

    Short gaps are filled with the cross-machine median first (`windows.fill_gaps_from`,
    as `windows.normalise` does): a forward fill after a burst added a whole extra transfer
    to a machine's step mean of a network counter. A mean over fewer
    than `min_present` of its span is NaN, since a mean over part of a step depends on
    the phase again. The first span - 1 samples are NaN: no whole step yet.
    """
    if span <= 1:
        return values.copy()
    rows = [k for k, m in enumerate(metrics) if m not in STEP_METRICS]
    x = values[rows]
    mean = complete_trailing_mean(fill_gaps_from(x, nanmedian(x, axis=1, keepdims=True), max_gap), span, min_present)
    if len(rows) == values.shape[0]:
        return mean
    out = values.copy()
    out[rows] = mean
    return out
