"""The window score without what sampler skew explains.

Each machine's collector samples at its own phase, and hosts' clocks differ by a second
or two. A machine whose counters read every transfer a second or two before its peers'
differs from the cross-machine median at each one, though nothing is wrong with it: a
network counter is ~100x its base during a transfer of a second or two, so one shifted
burst outweighs everything else in the window. With few machines (8, in two pipeline
stages) such a machine is the farthest from the median in window after window; on the
coupled generator's never-used seeds this made half of the false alarms, and the same
bursts, landing in different windows for different machines, made crowds that broke
faulty machines' runs.

A fault is not a shift: a machine that is stopped, flapping, slowed, or on a link at half
speed still differs from the median however its samples are moved, so the window score
keeps only what survives the best shift of up to `skew_s` (monitor/tuning.py).
"""

from __future__ import annotations

import numpy as np

from .peers import robust_z
from .windows import cut_windows, window_layout, window_means


def skew_distances(resid: np.ndarray, centre: np.ndarray, lag: int, window: int, stride: int) -> np.ndarray:
    """[metrics, machines, windows]: each machine's mean |x(t + d) - median(t)| over a
    window, the smallest over the shifts d of at most `lag` samples either way.

    resid: [metrics, machines, T] residuals x - median in a metric's scale; centre:
    [metrics, 1, T] the median in the same units (`windows.normalise_centred`), so that
    x(t + d) - median(t) = resid(t + d) + centre(t + d) - centre(t). Near either end of
    the trace a shift reaches past it for up to `lag` seconds of a window: the mean is
    then over the rest, so the newest window, the one an online call acts on, can still
    match a machine that reads late. NaN samples leave a window's distance NaN for
    that shift, as they do unshifted."""
    n_t = resid.shape[-1]
    offset, n_win = window_layout(n_t, window, stride)
    best = window_means(np.abs(cut_windows(resid, window, stride)))
    if n_win == 0:
        return best
    moved = np.empty_like(resid)
    for d in range(1, min(lag, n_t - 1) + 1):
        for late, early, outside in (
            (slice(d, None), slice(None, -d), (n_t - d, n_t)),
            (slice(None, -d), slice(d, None), (0, d)),
        ):
            np.add(resid[..., late], centre[..., late] - centre[..., early], out=moved[..., early])
            moved[..., outside[0] : outside[1]] = 0.0  # past the trace: no sample, counted out below
            dist = window_means(cut_windows(np.abs(moved, out=moved), window, stride))
            for w in {0, n_win - 1}:  # only the first and last window can reach past the trace
                first = offset + w * stride
                gone = max(0, min(outside[1], first + window) - max(outside[0], first))
                if gone:
                    dist[..., w] *= window / (window - gone)
            np.fmin(best, dist, out=best)
    return best


def skew_scores(
    resid: np.ndarray, centre: np.ndarray, lag: int, window: int, stride: int, min_machines: int
) -> np.ndarray:
    """Robust z across machines [metrics, machines, windows] of `skew_distances`, on the
    window score's terms (no floor)."""
    return robust_z(skew_distances(resid, centre, lag, window, stride), 0.0, min_machines)
