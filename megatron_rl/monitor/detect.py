"""Minder-style detection: windows -> denoise -> dissimilarity -> priority -> continuity.

`score_grid` does the array work, vectorised over metrics, machines and windows;
`declare` walks the windows in time order and turns per-window candidates into alerts.
They are separate so that evaluation can sweep the threshold without re-scoring.

Dissimilarity: a machine's score for one metric and window is the mean absolute distance
of its (denoised) window to the cross-machine median window. The Minder paper sums each
machine's distances to all others; for Manhattan distance (which the paper reports did
as well as Euclidean) the median is the point that sum is built around, and using it is
O(machines) instead of O(machines^2), which is what keeps 1024 machines under a second.
Scores are normalised across machines: (score - median) / spread, the spread being this
window's robust spread, at least the metric's typical one over the call and at most twice
it (`peers.peer_spread`).

Candidates: `mode="top1"` is the paper's rule (one machine per window: the top scorer of
the first metric, in priority order, whose top scorer passes the threshold).
`mode="any"` (default) makes every machine above the threshold in some metric a
candidate, the metric reported being the first such in priority order. With hundreds
of machines some machine is nearly always briefly odd (a data-loader burst, a slow
step), and under "top1" those brief outliers keep taking the single candidate slot
from a faulty machine and break its continuity (held-out F1 0.64 under "top1" against
0.98 under "any" with the first detector, falling with cluster size).

Declaring (`declare`): a crowd (`crowds`: many machines above the threshold in one
metric-window, which says the scale does not fit that window) makes no candidate and is
bridged by open runs without counting; a run is declared after the continuity, of which
the echo of a window score in the averaged scores counts only once it outlasts `echo_s`
(`_Run.counted_until`), and two bursts of candidacy with a gap between them in which the
machine recovered are joined only once a third comes (`_Run.joins_its_gaps`); a machine
that is a candidate in half of its windows over eight minutes is declared without a run
(`_Recurrence`, for weak intermittent faults; off with step-averaged metrics); the
straggler channel is declared on its own (`stragglers.py`).
"""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from .config import DetectConfig
from .denoise import Denoiser, WindowMedian
from .peers import (
    held_low,
    intermittency_scores,
    level_scores,
    level_z,
    peak_shortfalls,
    robust_z,
    shortfall_scores,
    trailing_max,
    whole_step_span,
)
from .period import (
    TimeScales,
    cycle_period,
    estimate_period,
    reported_period,
    step_average,
    time_scales,
    without_stale_steps,
)
from .skew import skew_scores
from .stragglers import straggler_scores
from .trace import STEP_METRICS, Trace
from .tuning import TUNING, Tuning
from .windows import (
    Grid,
    complete_trailing_mean_at,
    cut_windows,
    nanmedian,
    normalise_centred,
    normalise_lagged,
    to_grid,
    window_layout,
    window_means,
    window_times,
)


@dataclass
class Alert:
    """One declared machine. Times are trace seconds; `score` is its mean normalised score."""

    machine: str
    metric: str
    first_seen: float
    declared_at: float
    score: float

    def to_json(self) -> str:
        return json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()})


@dataclass
class Scores:
    """Normalised scores z[metric, machine, window] (NaN = not scored) and window times."""

    z: np.ndarray
    metrics: list[str]
    machines: list[str]
    win_start: np.ndarray
    win_end: np.ndarray
    scales: TimeScales | None = None
    """The time constants used (they follow the job's step period, `period.py`)."""
    straggler: "Scores | None" = None
    """The straggler channel (`stragglers.py`): step metrics only, declared on its own."""
    instant: np.ndarray | None = None
    """The window score alone (without the level, intermittency and peak scores), the
    shape of z; None: not kept (declare then has no echo rule)."""
    deep_peak: np.ndarray | None = None
    """Where a capacity's peak is at least peak_since_shortfall below the peers', the
    shape of z (`deep_peaks`); None: not kept (runs count from their first window)."""
    peak_backing_s: float = 0.0
    """Seconds before a deep peak's window that its run counts from (`peak_backing_s`)."""

    @property
    def step_period_s(self) -> float | None:
        """The job's step length as estimated from the trace (None if unknown)."""
        return self.scales.period_s if self.scales else None


@dataclass
class Detection:
    alerts: list[Alert]
    scores: Scores
    candidates: list[tuple[float, str, str, float]] = field(default_factory=list)
    """(window end, machine, metric, z) for every window that had a candidate."""


def median_distance(rec: np.ndarray) -> np.ndarray:
    """Mean |window - cross-machine median window| per machine.

    rec: [..., window, machines] (machines last: the median sorts contiguous rows), NaN
    columns for machines to leave out -> [..., machines].
    """
    d = rec - nanmedian(rec, axis=-1, keepdims=True)
    return np.abs(d, out=d).mean(-2)  # NaN columns stay NaN


def score_grid(
    grid: Grid,
    cfg: DetectConfig = DetectConfig(),
    denoiser: Denoiser | WindowMedian | None = None,
    tuning: Tuning = TUNING,
) -> Scores:
    """Normalised dissimilarity of every machine, metric and window of a grid.

    `denoiser`: anything with `reconstruct(metric, windows)`; None compares raw windows.
    """
    if abs(grid.step_s - cfg.step_s) > 1e-9:
        raise ValueError(f"grid step {grid.step_s} s differs from DetectConfig.step_s {cfg.step_s} s")
    if tuning.skew_s >= cfg.window_s / 2:
        raise ValueError(f"Tuning.skew_s {tuning.skew_s} s must be under half of window_s {cfg.window_s} s")
    grid = without_stale_steps(grid, tuning.stale_steps)
    step_s, cycle_s = periods(grid, tuning)
    scales = time_scales(cfg, tuning, step_s, cycle_s, machines=len(grid.machines))
    max_fill = int(tuning.max_fill_s / cfg.step_s)
    values = grid.values
    if scales.average_s:  # long steps: compare step means, where stage phases cancel
        values = step_average(values, int(round(scales.average_s / cfg.step_s)), max_fill, grid.metrics)
    is_step = np.array([m in STEP_METRICS for m in grid.metrics], bool)
    resid, centre = residuals(values, is_step, cfg, tuning, max_fill)
    win = cut_windows(resid, cfg.window, cfg.stride)  # [metrics, machines, windows, window]
    with ThreadPoolExecutor(max_workers=1) if cfg.threads > 1 else nullcontext() as pool:
        # The denoiser (torch) runs on the pool's thread beside the skew and peer scores
        # (numpy); both release the GIL on whole arrays. The same operations on the same
        # data, so the same bits, and at 1024 machines x 7 metrics about 0.65 s instead of
        # 0.9-1.1 s when a second core is free (docs/monitor.md#evaluation).
        pending = pool.submit(denoised_windows, win, grid.metrics, denoiser) if pool else None
        shifted = skew_shifted(resid, centre, is_step, cfg, tuning)
        peer, deep, backing = None, None, 0.0
        if tuning.peer_scores:
            peer, deep, backing = peer_channel(grid, win, resid, is_step, cfg, tuning, scales, cycle_s)
        rec = pending.result() if pending else denoised_windows(win, grid.metrics, denoiser)
    s = median_distance(rec).transpose(0, 2, 1)  # [metrics, machines, windows]
    z = robust_z(s, 0.0, tuning.min_machines)  # the window score: no floor
    if shifted is not None:  # lowered to what the skew leaves; a void window stays void
        window_score = z[~is_step]
        z[~is_step] = np.where(np.isnan(window_score), np.nan, np.fmin(window_score, shifted))
    instant = z  # kept for the echo rule: the fmax below makes a new z, this one is not written
    if peer is not None:
        z = np.fmax(z, peer)
    metrics = list(grid.metrics)
    if tuning.gpu_joint and not is_step.any():
        joint = gpu_joint_scores(z, metrics, tuning.min_machines)
        if joint is not None:  # one more metric, scored last: only the scores, nothing to denoise
            z, metrics = np.concatenate([z, joint[None]]), metrics + [GPU_JOINT]
            instant = np.concatenate([instant, np.full_like(joint[None], np.nan)])
            deep = None if deep is None else np.concatenate([deep, np.zeros_like(joint[None], bool)])
    start, end = window_times(grid, cfg.window, cfg.stride)
    straggler = None
    if tuning.straggler_score and is_step.any():
        zs = straggler_scores(values[is_step], resid[is_step], cfg, tuning, scales.period_s or cycle_s)
        straggler = Scores(zs, [m for m in grid.metrics if m in STEP_METRICS], list(grid.machines), start, end, scales)
    return Scores(z, metrics, list(grid.machines), start, end, scales, straggler, instant, deep, backing)


def skew_shifted(
    resid: np.ndarray, centre: np.ndarray, is_step: np.ndarray, cfg: DetectConfig, tuning: Tuning
) -> np.ndarray | None:
    """The per-second metrics' window scores with the samples shifted by up to `skew_s`
    (monitor/skew.py), or None when off; the window score is lowered to it."""
    lag = int(round(tuning.skew_s / cfg.step_s))
    if not lag or is_step.all():
        return None
    return skew_scores(resid[~is_step], centre[~is_step], lag, cfg.window, cfg.stride, tuning.min_machines)


def peer_channel(
    grid: Grid,
    win: np.ndarray,
    resid: np.ndarray,
    is_step: np.ndarray,
    cfg: DetectConfig,
    tuning: Tuning,
    scales: TimeScales,
    cycle_s: float | None,
) -> tuple[np.ndarray, np.ndarray | None, float]:
    """(peer scores [metrics, machines, windows], deep peaks or None, peak backing s)."""
    levels = whole_step_levels(resid, cfg, tuning, scales, cycle_s)
    peer = peer_scores(win, cfg, tuning, scales.intermittency_span_s, levels)
    deep, backing = None, 0.0
    if tuning.peak_score and not is_step.all():  # raw values: a step average has no peak left
        peak, deep_rows = peak_score(grid.values[~is_step], cfg, tuning, scales.period_s or cycle_s)
        peer[~is_step] = np.fmax(peer[~is_step], peak)
        deep = np.zeros(peer.shape, bool)
        deep[~is_step] = deep_rows
        backing = peak_backing_s(cfg, tuning, scales.period_s or cycle_s)
    # Step metrics: the window score alone. A step value is already a step's average;
    # averaging it again (level) or counting its abnormal windows (intermittency)
    # stretches a transient slowdown well past the steps it slowed, and on the tuning
    # seeds joined transient stragglers on one machine into false alarms.
    peer[is_step] = np.nan
    return peer, deep, backing


GPU_JOINT = "gpu_joint"
JOINT_METRICS = ("gpu_duty_cycle", "gpu_power", "gpu_tensor_activity")


def gpu_joint_scores(z: np.ndarray, metrics: list[str], min_machines: int) -> np.ndarray | None:
    """[machines, windows]: robust z across machines of the middle of each machine's three
    GPU scores (negative ones counted as 0); None unless all three metrics are there.

    The middle, not the mean: it needs two of the three GPU metrics off together, so one
    metric's noise or a single sensor's spike does not carry it. Re-scoring across
    machines puts it back in units of the peers' spread, whatever the three metrics'
    correlation on healthy machines."""
    if not all(m in metrics for m in JOINT_METRICS):
        return None
    rows = np.clip(z[[metrics.index(m) for m in JOINT_METRICS]], 0.0, None)  # NaN stays NaN
    return robust_z(nanmedian(rows, axis=0)[None], 0.0, min_machines)[0]


def residuals(
    values: np.ndarray, is_step: np.ndarray, cfg: DetectConfig, tuning: Tuning, max_fill: int
) -> tuple[np.ndarray, np.ndarray]:
    """(normalised residuals [metrics, machines, seconds], the median they are measured
    from [metrics, 1, seconds] in the same units, NaN for lagged step metrics).

    Per-second metrics are measured against the median at each second
    (`windows.normalise_centred`), step metrics (with `step_lag_s`) against the closest
    median within the lag (`windows.normalise_lagged`: step values switch at each
    machine's own sample). Each metric is normalised once, by the rule it needs."""
    lag = int(round(tuning.step_lag_s / cfg.step_s))
    lagged = is_step if lag else np.zeros_like(is_step)
    if not lagged.any():
        resid, _, centre = normalise_centred(values, max_fill)
        return resid, centre
    resid = np.empty(values.shape, np.float32)
    centre = np.full((values.shape[0], 1, values.shape[2]), np.nan, np.float32)
    if not lagged.all():
        resid[~lagged], _, centre[~lagged] = normalise_centred(values[~lagged], max_fill)
    resid[lagged] = normalise_lagged(values[lagged], max_fill, lag)[0]
    return resid, centre


def peak_score(
    values: np.ndarray, cfg: DetectConfig, tuning: Tuning, period_s: float | None
) -> tuple[np.ndarray, np.ndarray]:
    """`peers.peak_scores` of the raw per-second values [metrics, machines, seconds] over
    max(peak_span_s, peak_steps steps), in the windows of the other scores, and where
    that peak is deep (`deep_peaks`)."""
    span = peak_span(cfg, tuning, period_s)
    win = cut_windows(values, cfg.window, cfg.stride)
    short, steady = peak_shortfalls(win, span, tuning.min_machines)
    score = shortfall_scores(short, steady, tuning.peak_tolerance, tuning.peak_hold_windows)
    # Deep only where every second of the span (and of the held windows) was sampled: a
    # dropped sample may have been the burst, and the peak then reads low for no fault.
    gaps = np.isnan(win).any(-1).astype(np.float32)
    sampled = trailing_max(gaps, span + tuning.peak_hold_windows - 1) == 0
    return score, deep_peaks(score, short, steady, span, cfg, tuning) & sampled


STEADY_SPANS = 5
"""A peak's steadiness (the spread of a machine's own peak ratio over the call) is only
measured when the call holds this many of its spans; with 4-minute steps a 15-minute
call holds one, every metric looked steady, and a pause-frame counter's lucky bursts
passed for a capacity."""


def deep_peaks(
    score: np.ndarray, short: np.ndarray, steady: np.ndarray, span: int, cfg: DetectConfig, tuning: Tuning
) -> np.ndarray:
    """[metrics, machines, windows]: above the threshold, a peak at least
    peak_since_shortfall below the peers' for peak_hold_windows windows, on a metric whose
    peak is a capacity (its machines' own peaks steady within peak_tolerance).

    On such a metric a shortfall that scores is many times the machine's own usual
    variation, so the whole span ran slow, not only its last window. On a bursty counter
    (pause frames) the largest burst of a span is luck, so no such claim."""
    if not tuning.peak_since_shortfall or score.shape[-1] < STEADY_SPANS * span:
        return np.zeros(score.shape, bool)
    capacity = np.nan_to_num(steady, nan=np.inf) <= tuning.peak_tolerance  # [metrics, 1, 1]
    with np.errstate(invalid="ignore"):
        low = held_low(short, tuning.peak_hold_windows) >= tuning.peak_since_shortfall
        return (score > cfg.threshold) & low & capacity


def peak_seconds(tuning: Tuning, period_s: float | None) -> float:
    """Seconds a peak is the largest over: max(peak_span_s, peak_steps steps)."""
    return max(tuning.peak_span_s, tuning.peak_steps * (period_s or 0.0))


def peak_span(cfg: DetectConfig, tuning: Tuning, period_s: float | None) -> int:
    """`peak_seconds` in windows."""
    return max(1, int(round(peak_seconds(tuning, period_s) / cfg.stride_s)))


def peak_reach_s(cfg: DetectConfig, tuning: Tuning, period_s: float | None) -> float:
    """Seconds before a window's start that its peak covers: the span's earlier windows,
    and those of the windows it was held over (`held_low`)."""
    return (peak_span(cfg, tuning, period_s) + tuning.peak_hold_windows - 2) * cfg.stride_s


def peak_backing_s(cfg: DetectConfig, tuning: Tuning, period_s: float | None) -> float:
    """Seconds before a deep peak's window that its run counts from: `peak_reach_s`, at
    most peak_span_s. With long steps a span is four steps, more than continuity_s;
    backed by all of it, one held window would be an alert (on synth with 40-90 s steps
    that declared healthy machines' GPU peaks 7 s after they were first seen)."""
    return min(peak_reach_s(cfg, tuning, period_s), tuning.peak_span_s)


def periods(grid: Grid, tuning: Tuning) -> tuple[float | None, float | None]:
    """(the job's step period for the time scales, the period the per-second metrics
    repeat at), in seconds, None where unknown or not needed.

    The step period is the reported one, else the per-second cycle (without follow_step
    only a reported one, for the step metrics' continuity: then this is the detector with
    fixed time constants). The cycle is what an average over whole steps must span: the
    whole-step level with short steps, the step average with long ones."""
    reported = reported_period(grid)
    short = reported is None or reported <= tuning.level_span_s / 2  # long steps: no whole-step level
    need_cycle = (tuning.whole_step_level and short) or tuning.follow_step
    cycle = cycle_period(grid) if need_cycle else None
    step = reported if reported is not None or not tuning.follow_step else cycle
    return step, cycle


def whole_step_levels(
    resid: np.ndarray, cfg: DetectConfig, tuning: Tuning, scales: TimeScales, cycle_s: float | None
) -> np.ndarray | None:
    """Residual levels [metrics, machines, windows] averaged over whole steps, or None to
    keep the level over `level_span_s` of window means.

    Only for short steps (at most level_span_s / 2): there the level span holds several
    steps but not a whole number of them, and the left-over part of a step differs
    between pipeline stages. Longer steps are step-averaged before this (`step_average`),
    which already cancels the phase."""
    if not tuning.whole_step_level or scales.average_s or not cycle_s or cycle_s > tuning.level_span_s / 2:
        return None
    offset, n_win = window_layout(resid.shape[-1], cfg.window, cfg.stride)
    ends = offset + np.arange(n_win) * cfg.stride + cfg.window - 1
    return complete_trailing_mean_at(resid, whole_step_span(tuning.level_span_s, cycle_s, cfg.step_s), ends)


def denoised_windows(win: np.ndarray, metrics: list[str], denoiser: Denoiser | WindowMedian | None) -> np.ndarray:
    """[metrics, machines, windows, window] residual windows -> reconstructions
    [metrics, windows, window, machines] (machines last, for the median), NaN for
    windows with a gap.

    Every window goes through the denoiser, gaps zero-filled and voided afterwards: each
    window's reconstruction depends on that window alone, so this gives the same numbers
    as denoising only the complete ones, without gathering and scattering them (about a
    tenth of the denoiser's time at 1024 machines). The denoiser gets a transposed view
    of a time-major array, which is the layout its LSTM runs in: no further copy.
    """
    n_k, n_m, n_w, w = win.shape
    rec = np.empty((n_k, n_w, w, n_m), np.float32)
    for k, metric in enumerate(metrics):
        x = np.ascontiguousarray(win[k].transpose(2, 1, 0)).reshape(w, n_w * n_m)  # [window, batch]
        gap = np.isnan(x).any(0)
        x[:, gap] = 0.0
        if denoiser is not None and metric not in STEP_METRICS:  # a step value is flat: nothing to denoise
            x = denoiser.reconstruct(metric, x.T).T
        rec[k] = x.reshape(w, n_w, n_m).transpose(1, 0, 2)
        rec[k].transpose(0, 2, 1)[gap.reshape(n_w, n_m)] = np.nan
    return rec


def step_period(grid: Grid) -> float | None:
    """The job's step length in seconds (`period.estimate_period`)."""
    return estimate_period(grid)


def peer_scores(
    win: np.ndarray,
    cfg: DetectConfig,
    tuning: Tuning,
    intermittency_span_s: float | None = None,
    levels: np.ndarray | None = None,
) -> np.ndarray:
    """max(level, intermittency) score [metrics, machines, windows] from residual windows;
    `levels`: residual levels to score instead of the mean of the last level_span_s of
    windows (`whole_step_levels`)."""
    means = window_means(win)
    span = lambda sec: max(1, int(round(sec / (cfg.stride_s))))  # noqa: E731
    if levels is None:
        level = level_scores(means, span(tuning.level_span_s), tuning.min_machines)
    else:
        level = level_z(levels, tuning.min_machines)
    inter = intermittency_scores(
        means, span(intermittency_span_s or tuning.intermittency_span_s), tuning.abnormal_z, tuning.min_machines
    )
    return np.fmax(level, inter)


def _top1(z_win: np.ndarray, threshold: float, excluded: np.ndarray) -> list[tuple[int, int, float]]:
    """Spec rule for one window: [(machine, metric, z)] of the top scorer of the first
    metric (priority order) whose top non-excluded scorer exceeds the threshold."""
    zz = np.where(excluded[None, :] | np.isnan(z_win), -np.inf, z_win)
    best = zz.argmax(1)
    best_z = zz[np.arange(zz.shape[0]), best]
    hit = np.flatnonzero(best_z > threshold)
    if hit.size == 0:
        return []
    k = int(hit[0])
    return [(int(best[k]), k, float(best_z[k]))]


def _any(z_win: np.ndarray, threshold: float, excluded: np.ndarray) -> list[tuple[int, int, float]]:
    """Every non-excluded machine above threshold in some metric, with its first such metric."""
    above = (z_win > threshold) & ~excluded[None, :]  # NaN compares False
    machines = np.flatnonzero(above.any(0))
    metric = above[:, machines].argmax(0)  # first True in priority order
    return [(int(i), int(k), float(z_win[k, i])) for i, k in zip(machines, metric)]


CANDIDATE_RULES = {"any": _any, "top1": _top1}


@dataclass
class _Run:
    start: int  # window index where the run began
    last_hit: int
    hits: int = 0
    z_sum: float = 0.0
    metrics: Counter = field(default_factory=Counter)
    need_s: float = 0.0  # the longest continuity any of its metrics asks for
    bridged: int = 0  # windows where it was above the threshold only in a crowd
    last_instant: int = -1  # the last window where its window score itself was above the threshold
    since: float = float("inf")  # the earliest start of a peak span backing it (peak_since_shortfall)
    bursts: int = 1  # stretches of candidacy, each after a gap of at least one window
    burst_start: int = 0  # window where the latest burst began

    def counted_until(self, w: int, scores: Scores, echo_s: float) -> int:
        """The window up to which the run's span counts at window w: w, or while the run is
        in the echo of its window score (above the threshold only through the averaged
        scores, for at most echo_s since the window score last was), that last window."""
        if self.last_instant < 0 or w == self.last_instant:
            return w
        return self.last_instant if scores.win_end[w] - scores.win_end[self.last_instant] <= echo_s else w

    def span_s(self, w: int, scores: Scores, stride_s: float) -> float:
        """Seconds of the run that count toward continuity, from its first window or from
        the start of a deep peak shortfall's span before it; crowd windows do not count."""
        return scores.win_end[w] - min(scores.win_start[self.start], self.since) - self.bridged * stride_s

    def counted_windows(self, w: int) -> int:
        return w - self.start + 1 - self.bridged

    def joins_its_gaps(self, w: int, scores: Scores, join_bursts: int) -> bool:
        """Whether the run's gaps may join its bursts at window w: with one burst, or with at
        least join_bursts; in between, only when its latest burst alone holds continuity.
        A burst begins after a gap in which the machine recovered (`recovered`).

        Two bursts with one gap between them are what two transient slowdowns of a healthy
        machine look like, and what the first minutes of an intermittent fault look like.
        The intermittent fault goes on and brings a third burst; the two slowdowns do not."""
        if self.bursts == 1 or self.bursts >= join_bursts:
            return True
        return scores.win_end[w] - scores.win_start[self.burst_start] >= self.need_s


def crowds(z: np.ndarray, threshold: float, fraction: float, smallest: int = 2) -> np.ndarray:
    """[metrics, windows]: True where at least `smallest` machines, and more than
    `fraction` of the scored ones, are above the threshold on that metric.

    The scores are robust z across machines, so in a healthy window only a few per cent
    can be that far out. Many at once means the scale is wrong for that window, not that
    many machines broke: a job-wide stall after which the typical spread is that of idle
    machines, or a bursty counter whose bursts land in different seconds for different
    machines' samplers. Without this rule such windows make hundreds of false alarms on the
    coupled generator's traces. In a job of under 20 machines two are already a
    crowd: a pair that differs together there is a group (a rack, a pipeline stage), and
    such pairs made every fault-free alarm left on the coupled generator's small jobs."""
    above = (z > threshold).sum(1)  # NaN compares False
    scored = (~np.isnan(z)).sum(1)
    return (above >= smallest) & (above > fraction * scored)


def recovered(gap: np.ndarray, below: float) -> bool:
    """Whether a gap in a run ([metrics, windows] of the machine's scores) holds a window
    in which every score was under `below`: the machine was back among its peers, not
    just under the threshold for a moment. A void window (no score) shows neither."""
    top = np.fmax.reduce(gap, axis=0)  # NaN only where every metric is void
    return bool((top < below).any())


class _Recurrence:
    """The recurrence rule: a machine that was the candidate in at least `fraction` of its
    scored windows over the last `span` windows is declared, run or no run.

    Continuity asks for one unbroken run, which a weak intermittent fault (its score
    crossing the threshold in every other minute) may never hold; over eight minutes it
    is still the candidate about half the time. A healthy machine's transient slowdowns
    (each under a minute, plus up to half a minute of the level's smear) reach that only
    when three or four fall in those eight minutes."""

    def __init__(self, z: np.ndarray, span: int, fraction: float):
        n_m, n_w = z.shape[1], z.shape[2]
        self.span, self.fraction = span, fraction
        self.metric = np.full((n_m, n_w), -1, np.int64)  # candidate metric per window, -1: none
        self.z = np.zeros((n_m, n_w))
        self.scored = ~np.isnan(z).all(0)  # [machines, windows]

    def record(self, i: int, k: int, w: int, zi: float) -> None:
        self.metric[i, w], self.z[i, w] = k, zi

    def due(self, w: int, excluded: np.ndarray) -> np.ndarray:
        """Machines the rule declares at window w."""
        if not self.span or w + 1 < self.span:
            return np.empty(0, np.int64)
        span = slice(w + 1 - self.span, w + 1)
        hits = (self.metric[:, span] >= 0).sum(1)
        scored = self.scored[:, span].sum(1)
        ok = (scored >= 0.9 * self.span) & (hits >= self.fraction * scored) & ~excluded
        return np.flatnonzero(ok)

    def alert(self, i: int, w: int, scores: Scores) -> Alert:
        """The alert for machine i: its most frequent candidate metric over the span, first
        seen at its first candidate window in the span, scored by their mean z."""
        hit = np.flatnonzero(self.metric[i, w + 1 - self.span : w + 1] >= 0) + w + 1 - self.span
        metric = Counter(self.metric[i, hit].tolist()).most_common(1)[0][0]
        return Alert(
            scores.machines[i],
            scores.metrics[metric],
            float(scores.win_start[hit[0]]),
            float(scores.win_end[w]),
            float(self.z[i, hit].mean()),
        )


def _recurrence_span(scores: Scores, cfg: DetectConfig, tuning: Tuning) -> int:
    """Windows in the recurrence horizon for this call; 0 when the rule is off."""
    # A step average makes every window of a step (and of the next) move together, so the
    # fraction of candidate windows would count a few steps, not many windows: on the tuning
    # seeds with 40-90 s steps the rule declared dozens of healthy machines.
    if scores.scales is not None and scores.scales.average_s:
        return 0
    return int(round(tuning.recurrence_s / cfg.stride_s))


def declare(
    scores: Scores, cfg: DetectConfig = DetectConfig(), already: set[str] | None = None, tuning: Tuning = TUNING
) -> Detection:
    """Turn per-window candidates into alerts with the continuity rule.

    Machines in `already` (declared by an earlier call) are never candidates again, so a
    second faulty machine is not hidden behind the first one.
    """
    machines, pick = scores.machines, CANDIDATE_RULES[cfg.mode]
    need = continuity(scores, cfg, tuning)
    excluded = np.array([m in (already or set()) for m in machines], bool)
    crowd = crowds(scores.z, cfg.threshold, tuning.crowd_fraction, tuning.crowd_machines)
    instant = None  # the window score alone, for the echo rule (`_Run.counted_until`); crowds do not count
    if tuning.echo_s and scores.instant is not None:
        instant = np.where(crowd[:, None, :], np.nan, scores.instant)
    z = np.where(crowd[:, None, :], np.nan, scores.z)  # a crowd makes no candidate ...
    in_crowd = ((scores.z > cfg.threshold) & crowd[:, None, :]).any(0)  # ... but bridges [machines, windows]
    deep = scores.deep_peak  # [metrics, machines, windows]: a capacity's peak far below the peers'
    runs: dict[int, _Run] = {}
    recurrence = _Recurrence(z, _recurrence_span(scores, cfg, tuning), tuning.recurrence_fraction)
    alerts, candidates = [], []
    for w in range(z.shape[2]):
        now = scores.win_end[w]
        picked = set()
        for i, k, zi in pick(z[:, :, w], cfg.threshold, excluded):
            picked.add(i)
            candidates.append((float(now), machines[i], scores.metrics[k], zi))
            recurrence.record(i, k, w, zi)
            run = runs.setdefault(i, _Run(start=w, last_hit=w, burst_start=w))
            if run.last_hit < w - 1 and recovered(z[:, i, run.last_hit + 1 : w], tuning.gap_depth * cfg.threshold):
                run.bursts, run.burst_start = run.bursts + 1, w  # back after a real gap: a new burst
            run.hits, run.last_hit, run.z_sum = run.hits + 1, w, run.z_sum + zi
            run.metrics[scores.metrics[k]] += 1
            run.need_s = max(run.need_s, need[k])  # a slow step cannot lend its span to continuity_s
            if instant is not None and (instant[:, i, w] > cfg.threshold).any():
                run.last_instant = w
            if deep is not None and deep[k, i, w]:  # the whole span ran slow
                run.since = min(run.since, float(scores.win_start[w]) - scores.peak_backing_s)
            upto = run.counted_until(w, scores, tuning.echo_s)  # w itself unless the window score fired before
            if (
                run.span_s(upto, scores, cfg.stride_s) >= run.need_s
                and run.hits >= tuning.min_fraction * run.counted_windows(w)
                and run.joins_its_gaps(w, scores, tuning.join_bursts)
            ):
                alerts.append(
                    Alert(
                        machines[i],
                        run.metrics.most_common(1)[0][0],
                        float(scores.win_start[run.start]),
                        float(now),
                        run.z_sum / run.hits,
                    )
                )
                excluded[i] = True
                del runs[i]
        for i, run in runs.items():
            if i not in picked and in_crowd[i, w]:  # neither a hit nor a miss
                run.last_hit, run.bridged = w, run.bridged + 1
        for i in recurrence.due(w, excluded):  # after the runs: a run's alert names its own start
            alerts.append(recurrence.alert(i, w, scores))
            excluded[i] = True
            runs.pop(i, None)
        for j in [j for j, r in runs.items() if now - scores.win_end[r.last_hit] > tuning.max_gap_s]:
            del runs[j]  # out of candidacy for too long: the run is broken
    if scores.straggler is not None:
        channel = replace(cfg, threshold=tuning.straggler_threshold)
        alerts = earliest(alerts + declare(scores.straggler, channel, already, tuning).alerts)
    return Detection(alerts, scores, candidates)


def earliest(alerts: list[Alert]) -> list[Alert]:
    """One alert per machine, the first declared (two channels may both declare it), in
    the order they were declared."""
    first: dict[str, Alert] = {}
    for a in sorted(alerts, key=lambda a: a.declared_at):
        first.setdefault(a.machine, a)
    return list(first.values())


def continuity(scores: Scores, cfg: DetectConfig, tuning: Tuning = TUNING) -> np.ndarray:
    """Seconds of candidacy needed per metric: continuity_s (longer for jobs above
    `continuity_machines`: more machines meet more transient slowdowns), with `follow_step` at least
    `continuity_steps` steps of the job, and for step metrics also `straggler_steps`
    steps (one value per step: seconds alone could mean a single slow step)."""
    # declare's cfg: a sweep may change continuity_s
    scales = time_scales(cfg, tuning, scores.step_period_s, machines=len(scores.machines))
    need = np.full(len(scores.metrics), scales.continuity_s)
    need[[m in STEP_METRICS for m in scores.metrics]] = scales.step_continuity_s
    return need


def detect(
    trace: Trace | Grid,
    cfg: DetectConfig = DetectConfig(),
    denoiser: Denoiser | WindowMedian | None = None,
    already: set[str] | None = None,
    tuning: Tuning = TUNING,
) -> Detection:
    """Score a trace (or an already resampled grid) and declare faulty machines."""
    grid = trace if isinstance(trace, Grid) else to_grid(trace, cfg.step_s)
    return declare(score_grid(grid, cfg, denoiser, tuning), cfg, already, tuning)
