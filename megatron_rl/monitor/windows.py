"""From trace rows to the arrays the detector and the denoiser see.

Three steps, shared by detection and denoiser training so both see the same inputs:
`to_grid` resamples rows onto a dense [metric, machine, second] array (NaN = absent);
`normalise` fills short gaps, subtracts the cross-machine median at every second and
divides by the metric's robust spread; `cut_windows` slices fixed-length windows.
Normalising against the other machines at the same second removes everything the
machines share (diurnal drift, checkpoint pauses, the phase of the training step), so
what is left is each machine's deviation, in comparable units for every metric.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from .trace import Trace, metric_order


@dataclass
class Grid:
    """Dense samples: `values[k, i, t]` is metric k of machine i at `start + t*step_s`."""

    values: np.ndarray  # float32 [metrics, machines, T], NaN where absent
    metrics: list[str]  # priority order (see trace.metric_order)
    machines: list[str]
    start: float
    step_s: float = 1.0

    @property
    def duration_s(self) -> float:
        return self.values.shape[-1] * self.step_s

    def times(self) -> np.ndarray:
        return self.start + np.arange(self.values.shape[-1]) * self.step_s


def to_grid(trace: Trace, step_s: float = 1.0, start: float | None = None, end: float | None = None) -> Grid:
    """Resample onto a 1/step_s Hz grid: nearest bin, duplicates averaged, NaNs dropped."""
    metrics = metric_order(trace.metrics)
    remap = np.array([metrics.index(k) for k in trace.metrics] or [0], np.int64)
    ts = trace.timestamps
    start = float(ts.min()) if start is None and len(ts) else float(start or 0.0)
    end = float(ts.max()) if end is None and len(ts) else float(end if end is not None else start)
    n_t = int(np.floor((end - start) / step_s + 0.5)) + 1
    keep = np.isfinite(trace.values) & (ts >= start) & (ts <= end)
    b = np.floor((ts[keep] - start) / step_s + 0.5).astype(np.int64)
    b = np.minimum(b, n_t - 1)
    n_m, n_k = len(trace.machines), len(metrics)
    flat = (remap[trace.metric_idx[keep]] * n_m + trace.machine_idx[keep]) * n_t + b
    size = n_k * n_m * n_t
    sums = np.bincount(flat, weights=trace.values[keep], minlength=size)
    counts = np.bincount(flat, minlength=size)
    with np.errstate(invalid="ignore", divide="ignore"):
        values = (sums / counts).astype(np.float32)
    return Grid(values.reshape(n_k, n_m, n_t), metrics, list(trace.machines), start, step_s)


def fillable_gaps(x: np.ndarray, max_gap: int) -> tuple[np.ndarray, np.ndarray]:
    """(flat positions of the NaNs in runs of at most `max_gap` along the last axis that
    have a value before them, the flat position of that value for each): the gaps that
    `fill_gaps` and `fill_gaps_from` fill. Longer runs (a machine that is away) and NaNs
    before the first value are left out.

    Works on the NaN positions only (a few percent of a trace), not on the whole array."""
    flat = x.reshape(-1)
    pos = np.flatnonzero(np.isnan(flat))
    if max_gap <= 0 or pos.size == 0:
        return pos[:0], pos[:0]
    n_t = x.shape[-1]
    new_run = np.ones(pos.size, bool)
    new_run[1:] = (np.diff(pos) != 1) | (pos[1:] % n_t == 0)  # runs do not cross rows
    run = np.cumsum(new_run) - 1
    starts = pos[new_run]
    fillable = (np.bincount(run) <= max_gap) & (starts % n_t != 0)  # short, and a value before it
    ok = fillable[run]
    return pos[ok], starts[run[ok]] - 1


def fill_gaps(x: np.ndarray, max_gap: int) -> np.ndarray:
    """Forward-fill runs of at most `max_gap` NaNs along the last axis (`fillable_gaps`)."""
    pos, before = fillable_gaps(x, max_gap)
    if pos.size == 0:
        return x
    out = x.reshape(-1).copy()
    out[pos] = out[before]
    return out.reshape(x.shape)


def fill_gaps_from(x: np.ndarray, centre: np.ndarray, max_gap: int) -> np.ndarray:
    """Fill the gaps of `fillable_gaps` in x [metrics, machines, T] with the cross-machine
    median centre [metrics, 1, T] at the same second, not with the machine's last value.

    A dropped sample of a bursty counter (network bytes at ~100x their base for a second
    or two per transfer) often follows a burst, and a forward fill copies the burst: one
    extra transfer in that machine's step mean, or an extra burst-sized residual in its
    window. The median says the machine did what its peers did, which is all a missing
    sample can say; a gap is then neither evidence of a fault nor against one."""
    pos, _ = fillable_gaps(x, max_gap)
    if pos.size == 0:
        return x
    n_m, n_t = x.shape[-2], x.shape[-1]
    out = x.reshape(-1).copy()
    out[pos] = centre.reshape(-1)[(pos // (n_m * n_t)) * n_t + pos % n_t]
    return out.reshape(x.shape)


def _sorted_rows(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray | None]:
    """`axis` moved last and sorted (NaNs last), and the count of values per row (None when
    the axis is empty). Rows made contiguous first: sorting them takes ~2/3 of the time of
    strided ones."""
    s = np.moveaxis(x, axis, -1).copy(order="C")
    s.sort(axis=-1)
    if s.shape[-1] == 0:
        return s, None
    return s, (~np.isnan(s)).sum(-1, keepdims=True)


def nanmedian(x: np.ndarray, axis: int, keepdims: bool = False) -> np.ndarray:
    """Median ignoring NaNs (NaN where all are NaN); sort-based, ~8x faster than np.nanmedian."""
    s, n = _sorted_rows(x, axis)
    if n is None:  # nothing to take a median of (e.g. a trace shorter than one window)
        med = np.full(s.shape[:-1], np.nan, np.result_type(x.dtype, np.float16))
        return np.expand_dims(med, axis) if keepdims else med
    lo = np.take_along_axis(s, np.maximum((n - 1) // 2, 0), -1)
    hi = np.take_along_axis(s, np.maximum(n // 2, 0), -1)
    med = np.where(n > 0, 0.5 * (lo + hi), np.nan)[..., 0]
    return np.expand_dims(med, axis) if keepdims else med


def nanquantile(x: np.ndarray, q: float, axis: int) -> np.ndarray:
    """The q-quantile ignoring NaNs, interpolated linearly as np.nanquantile does (NaN
    where all are NaN); sort-based like `nanmedian`, which stays the median's (its bits)."""
    s, n = _sorted_rows(x, axis)
    if n is None:
        return np.full(s.shape[:-1], np.nan, np.result_type(x.dtype, np.float16))
    last = np.maximum(n - 1, 0)  # index of the largest value (0 in an all-NaN row)
    position = q * last
    below = np.floor(position).astype(np.int64)
    lo = np.take_along_axis(s, below, -1)
    hi = np.take_along_axis(s, np.minimum(below + 1, last), -1)
    value = lo + (position - below) * (hi - lo)
    return np.where(n > 0, value, np.nan)[..., 0].astype(np.result_type(x.dtype, np.float16))


def normalise(values: np.ndarray, max_gap: int = 3, floor_frac: float = 1e-3) -> tuple[np.ndarray, np.ndarray]:
    """Deviation from the cross-machine median, in units of the metric's robust spread.

    values: [metrics, machines, T]. Returns (residuals of the same shape, scale [metrics]).
    The scale is 1.4826 * MAD of all residuals of the metric, floored at `floor_frac` of
    the metric's typical magnitude so that metrics which are almost identical everywhere
    do not turn rounding into huge scores. A gap of at most `max_gap` samples is a
    residual of 0 (`fill_gaps_from`); a longer one stays NaN.
    """
    resid, scale, _ = normalise_centred(values, max_gap, floor_frac)
    return resid, scale


def normalise_centred(
    values: np.ndarray, max_gap: int = 3, floor_frac: float = 1e-3
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`normalise`, and the cross-machine median [metrics, 1, T] in the same units (what a
    residual is measured from, for comparing a machine with the median at another second)."""
    centre = nanmedian(values, axis=1, keepdims=True)  # of the machines sampled at that second
    resid = fill_gaps_from(values, centre, max_gap) - centre  # a short gap: 0, as the median
    scale = _robust_scale(resid, centre, floor_frac)
    resid /= scale[:, None, None]
    centre /= scale[:, None, None]
    return resid.astype(np.float32, copy=False), scale, centre.astype(np.float32, copy=False)


def normalise_lagged(
    values: np.ndarray, max_gap: int = 3, lag: int = 3, floor_frac: float = 1e-3
) -> tuple[np.ndarray, np.ndarray]:
    """`normalise` for step metrics: each machine's deviation from the closest of the
    cross-machine medians within `lag` samples either side.

    A step value changes when the step ends, and each machine's collector picks the new
    value up at its own next sample: the machines switch up to a few seconds apart. In
    those seconds the ones still showing the last step differ from the median by a whole
    step-to-step change, hundreds of times the timer noise that sets the scale, and the
    machine that samples last does so at every step. Matching against the medians just
    before and after forgives the lag; a rank that is really slower differs from all of
    them.

    The candidates are the median now and the smallest and largest median within the lag:
    exactly the medians there when at most one step ends within the lag (steps longer than
    2 x lag); with shorter steps a middle value is skipped, which can only leave a larger
    deviation. Three candidates instead of 2 x lag + 1 keep this a small part of a call.
    """
    x = fill_gaps(values, max_gap)
    centre = nanmedian(x, axis=1, keepdims=True)  # [metrics, 1, T]: cheap to slide
    padded = np.pad(centre, [(0, 0), (0, 0), (lag, lag)], constant_values=np.nan)
    near = np.lib.stride_tricks.sliding_window_view(padded, 2 * lag + 1, axis=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN stretches stay NaN
        lowest, highest = np.nanmin(near, axis=-1), np.nanmax(near, axis=-1)
    resid = x - centre
    best = np.abs(resid)
    best[np.isnan(best)] = np.inf
    d, dist = np.empty_like(resid), np.empty_like(resid)
    for candidate in (lowest, highest):
        np.subtract(x, candidate, out=d)
        np.abs(d, out=dist)
        closer = dist < best  # NaN compares False
        np.copyto(best, dist, where=closer)
        np.copyto(resid, d, where=closer)
    scale = _robust_scale(resid, centre, floor_frac)
    resid /= scale[:, None, None]
    return resid.astype(np.float32, copy=False), scale


def _robust_scale(resid: np.ndarray, centre: np.ndarray, floor_frac: float) -> np.ndarray:
    """Per metric: 1.4826 * MAD of the residuals, at least floor_frac of the typical level."""
    scale = np.empty(resid.shape[0], np.float32)
    for k in range(resid.shape[0]):
        r = np.abs(resid[k].ravel()[:: _subsample(resid[k].size)])  # a spread needs no 10^6 samples
        r = r[np.isfinite(r)]
        level = np.abs(centre[k]).ravel()
        level = level[np.isfinite(level)]
        mad = 1.4826 * float(np.median(r)) if r.size else 0.0
        typical = float(np.median(level)) if level.size else 0.0
        scale[k] = max(mad, floor_frac * typical, 1e-9)
    return scale


def _subsample(size: int, target: int = 100_000) -> int:
    """Stride that leaves about `target` of `size` samples; 7 is coprime to common shapes."""
    return 1 if size <= target else 7 * max(1, size // (7 * target))


def complete_trailing_mean(x: np.ndarray, span: int, min_present: float = 0.9) -> np.ndarray:
    """Mean of the last `span` samples at every sample of x [..., T], ignoring NaNs; NaN for
    the first span - 1 samples and where fewer than `min_present` of the span exist. A mean
    meant to cover whole training steps must not cover part of one: it would depend on the
    step's phase again (the step average, the whole-step level)."""
    n_t = x.shape[-1]
    mean = np.full(x.shape, np.nan, x.dtype)
    if n_t < span:
        return mean
    gap = np.isnan(x)
    # Running sums with a leading zero (float64: metrics in bytes/s reach 1e10); a
    # window's sum is the difference of two of them, written straight into x's dtype.
    run = np.zeros(x.shape[:-1] + (n_t + 1,), np.float64)
    np.cumsum(np.where(gap, 0.0, x), -1, out=run[..., 1:])
    np.subtract(run[..., span:], run[..., :-span], out=mean[..., span - 1 :], casting="same_kind")
    mean[..., span - 1 :] /= span
    rows_t = mean.reshape(-1, n_t)  # a view: `mean` is contiguous
    holed = np.flatnonzero(gap.reshape(-1, n_t).any(-1))  # rows with missing samples: few
    if holed.size:
        missing = np.zeros((holed.size, n_t + 1), np.int32)
        np.cumsum(gap.reshape(-1, n_t)[holed], -1, out=missing[:, 1:])
        count = span - (missing[:, span:] - missing[:, :-span])
        sums = run.reshape(-1, n_t + 1)[holed]
        with np.errstate(invalid="ignore", divide="ignore"):
            m = (sums[:, span:] - sums[:, :-span]) / count
        rows_t[holed, span - 1 :] = np.where(count >= min_present * span, m, np.nan)
    return mean


def complete_trailing_mean_at(x: np.ndarray, span: int, at: np.ndarray, min_present: float = 0.9) -> np.ndarray:
    """`complete_trailing_mean(x, span, min_present)[..., at]` (the same numbers, bit for
    bit), without the means at the other samples.

    The whole-step level needs one mean per window, an eighth of the samples: the running
    sums are still over every sample, but the differences, the missing-sample counts and
    the division only at `at`. Most rows of a real trace have a dropped sample somewhere,
    so the full version takes its slower path for nearly all of them; at 1024 machines x
    7 metrics this takes about a third of its time."""
    n_t = x.shape[-1]
    at = np.asarray(at)
    mean = np.full(x.shape[:-1] + (at.size,), np.nan, x.dtype)
    done = at >= span - 1
    if n_t < span or not done.any():
        return mean
    end = at[done] + 1  # running-sum positions just past each mean's last sample
    gap = np.isnan(x)
    run = np.zeros(x.shape[:-1] + (n_t + 1,), np.float64)
    np.cumsum(np.where(gap, 0.0, x), -1, out=run[..., 1:])
    total = run[..., end] - run[..., end - span]
    out = total.astype(x.dtype) / x.dtype.type(span)  # as the full version: rounded, then divided
    holed = gap.any(-1)
    if holed.any():  # rows with a gap: the mean of what is there, as the full version
        missing = np.zeros(x.shape[:-1] + (n_t + 1,), np.int32)
        np.cumsum(gap, -1, out=missing[..., 1:])
        count = span - (missing[..., end] - missing[..., end - span])
        with np.errstate(invalid="ignore", divide="ignore"):
            kept = np.where(count >= min_present * span, total / count, np.nan)
        out = np.where(holed[..., None], kept.astype(x.dtype), out)
    mean[..., done] = out
    return mean


def window_layout(n_t: int, window: int, stride: int) -> tuple[int, int]:
    """(first sample offset, number of windows); the last window ends at the last sample."""
    if n_t < window:
        return 0, 0
    n_win = (n_t - window) // stride + 1
    return n_t - window - (n_win - 1) * stride, n_win


def cut_windows(x: np.ndarray, window: int, stride: int) -> np.ndarray:
    """[..., T] -> [..., n_windows, window] (a view when possible), aligned to the end."""
    offset, n_win = window_layout(x.shape[-1], window, stride)
    if n_win == 0:
        return np.empty(x.shape[:-1] + (0, window), x.dtype)
    view = np.lib.stride_tricks.sliding_window_view(x[..., offset:], window, axis=-1)
    return view[..., ::stride, :][..., :n_win, :]


PAIRWISE_LANES = 8
"""numpy sums a contiguous run of 8 to 128 values in 8 running lanes, then adds the lanes
as ((0+1)+(2+3))+((4+5)+(6+7)) and the left-over values one by one (its pairwise sum)."""


def window_means(win: np.ndarray) -> np.ndarray:
    """`win.mean(-1)` for [..., windows, window], the same numbers bit for bit.

    numpy reduces each 8-sample window in a loop of its own, whose start-up costs about
    as much as the 8 additions; adding whole slices in numpy's own order
    (`PAIRWISE_LANES`) runs each addition over every window at once: 21 -> 17 ms at 1024
    machines x 7 metrics, and window means are taken six times per detection call. Other
    window lengths fall back to numpy."""
    n = win.shape[-1]
    if not PAIRWISE_LANES <= n <= 128 or win.dtype not in (np.float32, np.float64):
        return win.mean(-1)  # numpy sums float16 in float32, and its way is the reference
    lanes = [win[..., j] for j in range(PAIRWISE_LANES)]  # views: never written to
    for i in range(PAIRWISE_LANES, n - n % PAIRWISE_LANES, PAIRWISE_LANES):
        lanes = [lane + win[..., i + j] for j, lane in enumerate(lanes)]
    pairs = [lanes[a] + lanes[a + 1] for a in range(0, PAIRWISE_LANES, 2)]
    pairs[0] += pairs[1]
    pairs[2] += pairs[3]
    total = pairs[0]
    total += pairs[2]
    for i in range(n - n % PAIRWISE_LANES, n):
        total += win[..., i]
    total /= total.dtype.type(n)
    return total


def window_maxima(win: np.ndarray) -> np.ndarray:
    """`np.fmax.reduce(win, axis=-1)` (the largest value of each window, NaN only for a
    window without one), by slices: a maximum does not depend on the order, and numpy's
    per-window loop took 48-58 ms at 1024 machines x 7 metrics against 12-13 ms."""
    out = win[..., 0].copy()
    for j in range(1, win.shape[-1]):
        np.fmax(out, win[..., j], out=out)
    return out


def window_times(grid: Grid, window: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) time of each window; `end` is the time of its last sample."""
    offset, n_win = window_layout(grid.values.shape[-1], window, stride)
    first = offset + np.arange(n_win) * stride
    return grid.start + first * grid.step_s, grid.start + (first + window - 1) * grid.step_s


def normal_windows(grid: Grid, window: int, max_gap: int = 3) -> dict[str, np.ndarray]:
    """Complete, non-overlapping normalised windows per metric: denoiser training data."""
    resid, _ = normalise(grid.values, max_gap)
    out = {}
    for k, metric in enumerate(grid.metrics):
        w = cut_windows(resid[k], window, window).reshape(-1, window)
        out[metric] = np.ascontiguousarray(w[~np.isnan(w).any(axis=1)])
    return out
