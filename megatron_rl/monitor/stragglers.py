"""The straggler score: a rank persistently slower than its peers at some section of the
step, from the trainer's own step and section times (`trace.STEP_METRICS`).

Why a score of its own: the window score compares one 8 s window, about one step, and a
rank's section time varies from step to step by several per cent (each rank generates its
own responses; on the coupled generator's traces the rollout time of a healthy rank
varies by 7 % per step). A rank at 0.8x its peers is 25 % slower, three to four of those
per-step spreads: the window score put it at z 2-4, under the threshold, and the faults
were found late through the GPU metrics or not at all. The median over many steps has a
spread several times smaller, and a transient slowdown (a garbage collection, a page-cache
flush: seconds to a minute) shifts a median only when it covers about half of the span.

Its conditions, each for a reason measured on the evaluation's traces
(docs/monitor.md#evaluation):
- the span is at least `straggler_span_s` and `straggler_median_steps` steps, and it must
  be complete (a median of the first two steps of a call is a single step's luck);
- slow side only: a fast rank is not a fault, and in a synchronous job the slow rank's
  *wait* shrinks (its train time is shorter), which the window score still sees;
- the median must be at least `straggler_min_slowdown` slower than the peers' median:
  ranks a few per cent apart are ordinary hardware variation (both generators have
  healthy ranks 2-5 % slower), and with per-step noise of 2 % a z alone flags them;
- and the span's `straggler_low_quantile` (30th percentile) at least
  `straggler_min_low_slowdown` (5 %) slower: a rank that is slow in most of the span.
  Two transient slowdowns that together cover a little over half of the span carry the
  median, but the faster steps between them hold the 30th percentile near the peers'.
  The median stays the score's base: on its own the 30th percentile lost two of 18
  sustained stragglers, whose noisy steps dip under 10 %.

The score is declared as its own channel (`detect.declare`): its candidate windows do not
join runs with the other metrics', because a transient slowdown lights up the GPU metrics
while it lasts and the step median just after, and joined they made runs past continuity.
"""

from __future__ import annotations

import numpy as np

from .config import DetectConfig
from .peers import robust_z
from .tuning import Tuning
from .windows import cut_windows, nanmedian, nanquantile, window_means


def trailing_median(x: np.ndarray, span: int, min_present: float = 0.75, q: float = 0.5) -> np.ndarray:
    """Median (or the `q`-quantile) of the last `span` values along the last axis, ignoring
    NaNs; NaN where fewer than `min_present` of the span exist (also for the first values of
    a call)."""
    padded = np.concatenate([np.full(x.shape[:-1] + (span - 1,), np.nan, x.dtype), x], -1)
    view = np.lib.stride_tricks.sliding_window_view(padded, span, axis=-1)
    med = nanmedian(view, axis=-1) if q == 0.5 else nanquantile(view, q, axis=-1)
    med[(~np.isnan(view)).sum(-1) < min_present * span] = np.nan
    return med


def straggler_span(cfg: DetectConfig, tuning: Tuning, period_s: float | None) -> int:
    """Windows in the median: at least straggler_span_s and straggler_median_steps steps."""
    span_s = max(tuning.straggler_span_s, tuning.straggler_median_steps * (period_s or 0.0))
    return max(1, int(round(span_s / cfg.stride_s)))


def straggler_scores(
    values: np.ndarray, resid: np.ndarray, cfg: DetectConfig, tuning: Tuning, period_s: float | None
) -> np.ndarray:
    """z [step metrics, machines, windows] of each rank's median residual over the span,
    across ranks; where the rank's median time is less than straggler_min_slowdown above
    its peers' (or it is faster), at most 0.

    values: the step metrics' per-second values [step metrics, machines, seconds] (what the
    trainer reported); resid: the same, normalised (`windows.normalise_lagged`)."""
    span = straggler_span(cfg, tuning, period_s)
    level = trailing_median(window_means(cut_windows(resid, cfg.window, cfg.stride)), span)
    z = robust_z(level, 0.05, tuning.min_machines)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = values / nanmedian(values, axis=1, keepdims=True)
    ratio_windows = window_means(cut_windows(ratio, cfg.window, cfg.stride))
    slowdown = trailing_median(ratio_windows, span) - 1.0
    slow = slowdown >= tuning.straggler_min_slowdown
    rows = slow.any(axis=-1)  # [step metrics, machines]; usually none, or a rank or two
    if tuning.straggler_low_quantile is not None and rows.any():  # slow in most of the span, not in two bursts
        low = trailing_median(ratio_windows[rows], span, q=tuning.straggler_low_quantile) - 1.0
        slow[rows] &= low >= tuning.straggler_min_low_slowdown
    return np.where(slow, z, np.minimum(z, 0.0)).astype(np.float32)
