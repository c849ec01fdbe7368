"""Statistics over seeds for `megatron-rl bench compare`: pure functions on lists of floats.

A handful of seeds is the norm (3-5 on a CPU, each run minutes), so an interval is a
Student-t one: for n values with mean m and sample standard deviation s (n - 1 in the
denominator), the 95 % two-sided interval is m +/- t_{0.975, n-1} * s / sqrt(n). One seed
has no spread to estimate: its interval is None, never zero. Two variants are compared by
Welch's interval for the difference of their means, which does not assume equal variances
(PPO and T-PPO need not scatter alike across seeds).

The t quantiles are a table (df 1..30, from scipy.stats.t.ppf(0.975, df) to 4 decimals)
rather than a scipy dependency; past df 30 the normal 1.96 stands in for t (it is 2.042 at
df 30, so the interval there is at most 4 % too narrow). Welch's degrees of freedom are not
whole: they are rounded down to the table's integer, which widens the interval slightly.

Nothing here imports torch or numpy: the harness's report is rebuilt on any machine.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from typing import Optional, Sequence

T_975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)  # fmt: skip
"""t_{0.975, df} for df = 1..30 (index df - 1)."""
NORMAL_975 = 1.96
"""The normal quantile used past the table (df > 30)."""


def t_975(df: float) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (rounded down; >= 1)."""
    if not df >= 1:
        raise ValueError(f"t quantile needs df >= 1, got {df}")
    whole = int(math.floor(df))
    return T_975[whole - 1] if whole <= len(T_975) else NORMAL_975


@dataclasses.dataclass(frozen=True)
class Interval:
    """A mean over seeds and its 95 % interval (``lo``/``hi``/``half_width`` None for one seed)."""

    mean: float
    n: int
    half_width: Optional[float]

    @property
    def lo(self) -> Optional[float]:
        return None if self.half_width is None else self.mean - self.half_width

    @property
    def hi(self) -> Optional[float]:
        return None if self.half_width is None else self.mean + self.half_width

    def to_dict(self) -> dict:
        return {"mean": self.mean, "lo": self.lo, "hi": self.hi, "half_width": self.half_width, "n": self.n}


def mean_interval(values: Sequence[float]) -> Optional[Interval]:
    """The mean of ``values`` and its Student-t 95 % interval; None for no values."""
    n = len(values)
    if n == 0:
        return None
    mean = statistics.fmean(values)
    if n == 1:
        return Interval(mean, 1, None)
    return Interval(mean, n, t_975(n - 1) * statistics.stdev(values) / math.sqrt(n))


@dataclasses.dataclass(frozen=True)
class Difference:
    """``mean(variant) - mean(baseline)`` and Welch's 95 % interval for it (None when either
    side has fewer than two values)."""

    diff: float
    half_width: Optional[float]
    df: Optional[float]

    def to_dict(self) -> dict:
        lo = None if self.half_width is None else self.diff - self.half_width
        hi = None if self.half_width is None else self.diff + self.half_width
        return {"diff": self.diff, "lo": lo, "hi": hi, "half_width": self.half_width, "df": self.df}


def welch_difference(baseline: Sequence[float], variant: Sequence[float]) -> Optional[Difference]:
    """Welch's interval for ``mean(variant) - mean(baseline)``; None when a side is empty.

    Standard error sqrt(s_a^2/n_a + s_b^2/n_b); Welch-Satterthwaite degrees of freedom
    (s_a^2/n_a + s_b^2/n_b)^2 / ((s_a^2/n_a)^2/(n_a-1) + (s_b^2/n_b)^2/(n_b-1)). Both sides
    without spread give a zero-width interval (the seeds agree exactly)."""
    if not baseline or not variant:
        return None
    diff = statistics.fmean(variant) - statistics.fmean(baseline)
    if len(baseline) < 2 or len(variant) < 2:
        return Difference(diff, None, None)
    va = statistics.variance(baseline) / len(baseline)
    vb = statistics.variance(variant) / len(variant)
    if va + vb == 0:
        return Difference(diff, 0.0, None)
    df = (va + vb) ** 2 / (va**2 / (len(baseline) - 1) + vb**2 / (len(variant) - 1))
    return Difference(diff, t_975(df) * math.sqrt(va + vb), df)


def trailing_means(values: Sequence[float], window: int) -> list[Optional[float]]:
    """The mean of each value and the ``window - 1`` before it; None until a full window."""
    out: list[Optional[float]] = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / window if i >= window - 1 else None)
    return out


def best_window_mean(values: Sequence[float], window: int) -> Optional[float]:
    """The largest mean of ``window`` consecutive values (None when there are fewer)."""
    full = [m for m in trailing_means(values, window) if m is not None]
    return max(full) if full else None


def last_window_mean(values: Sequence[float], window: int) -> Optional[float]:
    """The mean of the last ``window`` values (None when there are fewer)."""
    return statistics.fmean(values[-window:]) if len(values) >= window else None


def first_reaching(values: Sequence[float], target: float, window: int) -> Optional[int]:
    """The index of the first value whose trailing mean over ``window`` values is >= ``target``."""
    for i, mean in enumerate(trailing_means(values, window)):
        if mean is not None and mean >= target:
            return i
    return None


def interpolate(xs: Sequence[float], ys: Sequence[float], grid: Sequence[float]) -> list[Optional[float]]:
    """``ys(xs)`` linearly interpolated at each grid point; None outside [xs[0], xs[-1]]
    (a curve is not extended past what was measured). ``xs`` ascending."""
    out: list[Optional[float]] = []
    for x in grid:
        if not xs or x < xs[0] or x > xs[-1]:
            out.append(None)
            continue
        i = bisect.bisect_left(xs, x)
        if xs[i] == x:
            out.append(ys[i])
            continue
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        out.append(y0 + (y1 - y0) * (x - x0) / (x1 - x0))
    return out


def time_grid(end: float, points: int) -> list[float]:
    """``points`` evenly spaced times from 0 to ``end`` inclusive."""
    return [end * i / (points - 1) for i in range(points)]


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    """numerator / denominator, None when either is missing or the denominator is zero."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator
