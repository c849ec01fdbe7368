"""Peer-relative level and intermittency scores: what the window shape score misses.

The Minder score (detect.py) compares the *shape* of each 8 s window with the other
machines'. Two kinds of fault slip through it:
- a partial, sustained degradation of one metric (a link at half its bandwidth): the
  window is the right shape, just lower, and once the VAE has smoothed it the distance
  is small next to the step-phase noise;
- an intermittent fault (GPU idle 10-60 s, then fine 10-60 s): each run of abnormal
  windows is shorter than the continuity rule needs.

Both show up in the *level* of a machine's residual (its deviation from the per-second
cross-machine median, `windows.normalise`) averaged over several training steps:
averaging over >= one step cancels pipeline-stage phase offsets, and the per-second
median already removed everything the job does together (pauses, load changes).
`level_scores` is that average over `span` windows, normalised across machines at each
window (median/MAD, floored by the metric's typical spread). `intermittency_scores` is
the fraction of the last `span` windows in which a machine's own 8 s level was abnormal,
so a fault that is on half the time scores steadily instead of in bursts.

Whole steps (`whole_step_span`, with `windows.complete_trailing_mean`): a mean cancels the step's phase
only if it spans a whole number of steps. 32 s of 7 s steps is four steps and 4 s, and
those 4 s are a different part of the step on each pipeline stage; with stages apart,
that left-over alone moved healthy machines' levels by about as much as a GPU at 85 %
of its peers moves its own. So when the job's step period is known and short, the level
is the mean of the per-second residuals over the whole number of steps nearest the
level span, ending at each window's last second.

Peaks (`peak_scores`): a link at half speed in a synchronous job moves the same bytes per
step over twice as long, so every average above is the same as its peers'; only its peak
rate, the largest per-second value over several steps, is about half theirs.
"""

from __future__ import annotations

import warnings

import numpy as np

from .windows import nanmedian, window_maxima


def trailing_mean(x: np.ndarray, span: int) -> np.ndarray:
    """Mean of the last `span` values along the last axis, ignoring NaNs (NaN if all are).

    Differences of running sums, taken with two slices rather than a gather of the
    window starts: the same subtractions in half the time."""
    ok = ~np.isnan(x)
    total = np.cumsum(np.where(ok, x, 0.0), -1, dtype=np.float64)
    count = np.cumsum(ok, -1)
    if span < x.shape[-1]:  # the first `span` values need nothing taken off
        total[..., span:] -= total[..., :-span].copy()
        count[..., span:] -= count[..., :-span].copy()
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / count, np.nan).astype(np.float32)


SPREAD_CAP = 2.0
"""A window's own cross-machine spread may widen a z's denominator to at most this many
times the metric's typical spread: a job-wide pause seen through a step average scatters
the healthy machines for a step, and dividing by all of it hides a faulty machine whose
deviation has not changed."""

QUIET_SPREAD = 0.05
"""Windows whose spread is below this fraction of the metric's 90th-percentile spread are
quiet (every machine agrees) and do not count toward its typical spread (`typical_spread`)."""


def typical_spread(mad: np.ndarray) -> np.ndarray:
    """The metric's typical cross-machine spread [metrics, 1, 1]: the median of the
    per-window spreads mad [metrics, 1, windows] over its windows that are not quiet.

    Why not the median over all windows: a bursty counter (network bytes at 100x during
    the all-reduce, sampled by collectors a second or two apart) has windows in which
    every machine saw the same bursts and agrees to rounding, and windows in which some
    caught one more burst than others and the spread is hundreds of times larger. When
    more than half are of the first kind, the median is the rounding: the cap then holds
    the denominator of a busy window at twice the rounding, and healthy machines score
    z in the hundreds. On the coupled generator's design seeds that made 22 of 24 false
    alarms with 6-12 s steps.
    A metric whose spread is of one kind throughout (every metric of the synth generator)
    has no window below a twentieth of its 90th percentile, so nothing changes for it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a metric with no spread at all
        high = np.nanpercentile(mad, 90, axis=2, keepdims=True)
    busy = np.where(mad > QUIET_SPREAD * high, mad, np.nan)
    return nanmedian(busy, axis=2, keepdims=True)


def peer_spread(mad: np.ndarray) -> np.ndarray:
    """The denominator of a robust z from the per-window spreads mad [metrics, 1, windows]:
    this window's spread, at least the metric's typical one (`typical_spread`) and at most
    SPREAD_CAP times it.

    Why a cap: with step-averaged metrics a job-wide event that is not periodic (a
    checkpoint pause, the edge of a load change) separates pipeline stages for about a
    step, and the healthy machines' spread grows 2-5x while a faulty machine's deviation
    does not change; dividing by the whole of it hid sustained faults for a step and
    broke their runs. Up to twice the typical spread still discounts a window in which
    everyone is scattered. A metric with no typical spread (identical on every machine in
    every window) has nothing to cap by: its windows keep their own spread, as before the
    cap, instead of a zero divisor."""
    typical = typical_spread(mad)
    cap = np.where(typical > 0, SPREAD_CAP * typical, np.inf)
    return np.fmin(np.fmax(mad, typical), cap)


def robust_z(s: np.ndarray, floor: float, min_machines: int) -> np.ndarray:
    """(s - median) / max(`peer_spread`, floor) across machines; s: [metrics, machines,
    windows]. NaN where that spread is 0 (floor 0: the window score) or fewer than
    `min_machines` machines have a score."""
    med = nanmedian(s, axis=1, keepdims=True)
    mad = 1.4826 * nanmedian(np.abs(s - med), axis=1, keepdims=True)
    denom = np.fmax(peer_spread(mad), floor)
    with np.errstate(invalid="ignore", divide="ignore"):
        z = (s - med) / np.where(denom > 0, denom, np.nan)
    z[np.broadcast_to((~np.isnan(s)).sum(1, keepdims=True) < min_machines, z.shape)] = np.nan
    return z.astype(np.float32, copy=False)


def level_scores(means: np.ndarray, span: int, min_machines: int) -> np.ndarray:
    """|z| of each machine's residual level over the last `span` windows; means:
    [metrics, machines, windows] of per-window residual means."""
    return level_z(trailing_mean(means, span), min_machines)


def level_z(levels: np.ndarray, min_machines: int) -> np.ndarray:
    """|robust z| across machines of residual levels [metrics, machines, windows]."""
    return np.abs(robust_z(levels, 0.05, min_machines))


def whole_step_span(target_s: float, period_s: float, step_s: float = 1.0) -> int:
    """Samples in the whole number of steps (at least one) closest to `target_s`."""
    steps = max(1, int(np.floor(target_s / period_s + 0.5)))
    return max(1, int(np.floor(steps * period_s / step_s + 0.5)))


def intermittency_scores(
    means: np.ndarray, span: int, abnormal_z: float, min_machines: int, parts: int = 3
) -> np.ndarray:
    """How often the machine's own window level was abnormal (|z| > abnormal_z) in EVERY
    one of `parts` consecutive slices of the last `span` windows: the smallest slice
    fraction, as a robust z across machines (floor 0.05, so a handful of stray windows
    cannot score high).

    Taking the smallest slice is what separates a recurring fault from bursts: one or two
    transient slowdowns (each <= 60 s) rarely touch all three 60 s slices of a 180 s span,
    while a fault that is never off for more than ~60 s shows up in every slice."""
    abnormal = np.abs(robust_z(means, 0.05, min_machines)) > abnormal_z
    part = max(1, span // parts)
    frac = trailing_mean(np.where(np.isnan(means), np.nan, abnormal.astype(np.float32)), part)
    low = frac
    for j in range(1, parts):  # NaN until every slice exists
        shifted = np.concatenate([np.full_like(frac[..., : j * part], np.nan), frac[..., : -j * part]], -1)
        low = np.minimum(low, shifted)
    return robust_z(low, 0.05, min_machines)


def trailing_max(x: np.ndarray, span: int) -> np.ndarray:
    """Largest of the last `span` values along the last axis, ignoring NaNs (NaN if all
    are). Doubling: after each pass `out` covers twice as many values, so a span of n
    takes about log2(n) passes instead of n."""
    out, width = x.copy(), 1
    while 2 * width <= span:
        out[..., width:] = np.fmax(out[..., width:], out[..., :-width])
        width *= 2
    rest = span - width  # join two overlapping blocks of `width` to cover the span
    if rest > 0:
        out[..., rest:] = np.fmax(out[..., rest:], out[..., :-rest].copy())
    return out


def peak_scores(
    win: np.ndarray, span: int, tolerance: float, min_machines: int, min_present: float = 0.75, hold: int = 1
) -> np.ndarray:
    """How far each machine's peak sits BELOW its peers': [metrics, machines, windows];
    win: raw per-second values cut into windows [metrics, machines, windows, window].

    The peak is the largest per-second value over the last `span` windows (several steps:
    one step's peak depends on how its transfers fall across sampling seconds; the largest
    over several is close to the link's capacity). Each peak is divided by the peers'
    median peak, and the shortfall 1 - ratio is divided by the metric's steadiness: the
    typical (median over machines) robust spread of a machine's OWN ratio over the call,
    at least `tolerance`. Why not the cross-machine spread, as the level score uses: a
    capacity differs between hardware groups for good (two racks whose links differ by
    17 % make the spread of every window as wide as a half-speed link's shortfall), while
    on each machine it is steady; a metric whose peak is not a capacity (pause-frame
    bursts, whose largest one in a span is a matter of luck) is unsteady on every machine,
    so its large spread keeps its scores small. That is the rule for which metrics the
    score applies to. Low peaks only: a trailing maximum holds a healthy machine's sensor
    spike for a whole span, and a counter cannot run faster than its link.
    NaN where less than `min_present` of the span has values (also at the start of the
    call: a maximum over fewer steps reads low by chance), where the peers' median
    peak is 0 (an idle job), or fewer than `min_machines` machines have a peak.
    `hold`: the score of a window is the smallest of the last `hold` windows' (NaN if
    any is NaN), so a shortfall must last that long (`held_low`)."""
    return shortfall_scores(*peak_shortfalls(win, span, min_machines, min_present), tolerance, hold)


def shortfall_scores(short: np.ndarray, steady: np.ndarray, tolerance: float, hold: int) -> np.ndarray:
    """Peak shortfalls in units of the metric's steadiness (at least `tolerance`), held
    for `hold` windows: the score of `peak_scores` from `peak_shortfalls`' two parts."""
    unit = np.fmax(np.nan_to_num(steady, nan=tolerance), tolerance)
    return held_low(short / unit, hold).astype(np.float32, copy=False)


def peak_shortfalls(
    win: np.ndarray, span: int, min_machines: int, min_present: float = 0.75
) -> tuple[np.ndarray, np.ndarray]:
    """(1 - each machine's peak / its peers' median peak [metrics, machines, windows], each
    metric's steadiness [metrics, 1, 1]): the two parts of `peak_scores`, with its NaNs."""
    wmax = window_maxima(win)  # NaN only for a window without a value
    peak = trailing_max(wmax, span)
    seen = np.minimum(np.arange(1, wmax.shape[-1] + 1), span) / span  # of the span, inside the call
    peak[trailing_mean((~np.isnan(wmax)).astype(np.float32), span) * seen < min_present] = np.nan
    med = nanmedian(peak, axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = peak / np.where(med > 0, med, np.nan)
    own = nanmedian(ratio, axis=2, keepdims=True)
    steady = nanmedian(1.4826 * nanmedian(np.abs(ratio - own), axis=2, keepdims=True), axis=1, keepdims=True)
    short = 1.0 - ratio
    short[np.broadcast_to((~np.isnan(peak)).sum(1, keepdims=True) < min_machines, short.shape)] = np.nan
    return short, steady


def held_low(score: np.ndarray, hold: int) -> np.ndarray:
    """The smallest of the last `hold` values along the last axis; NaN where any of them
    is NaN or fewer than `hold` exist. A healthy machine's transient slowdown lowers its
    peak over a whole span for a window or so; a slow link does so for good."""
    out = score.copy()
    for j in range(1, hold):
        out[..., j:] = np.minimum(out[..., j:], score[..., :-j])  # NaN propagates
    out[..., : hold - 1] = np.nan
    return out
