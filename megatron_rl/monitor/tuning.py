"""The detector's tuned constants, each with why it has its value.

A user sets the few knobs of `DetectConfig` (threshold, continuity, windows, candidate
rule, threads), whose defaults open this module; everything after them was chosen by measurement on synthetic traces
(megatron_rl_lab.monitor's `monitor eval`, docs/monitor.md#evaluation) and is not a
setting. `Tuning` gathers them for the detector's functions; the lab passes a `Tuning`
with one constant changed to measure what it does. Times are in trace seconds; "the
design seeds" are the evaluation's tuning seeds, disjoint from the ones it reports on.
"""

from __future__ import annotations

from dataclasses import dataclass

# The user's knobs' defaults (DetectConfig).

WINDOW_S = 8.0
"""One window is 8 s, as in the published system: a few steps of a short-step job."""
STRIDE_S = 8.0
"""Windows do not overlap, so a run's windows are distinct seconds."""
STEP_S = 1.0
"""Collectors sample once a second, and the trace is resampled to that."""
THRESHOLD = 6.5
"""The normalised score a candidate must exceed: the best F1 for the packaged denoiser on
the design seeds (re-tune with `monitor eval` after retraining it)."""
CONTINUITY_S = 110.0
"""14 windows of candidacy (the paper uses about 4 minutes): with MAX_GAP_S, the shortest
that declared no healthy machine's chain of transient slowdowns on the design seeds."""

# Runs of candidacy.

MAX_GAP_S = 16.0
"""Two missed 8 s windows keep a run, so a fault whose score dips under the threshold now
and then is not reset; a longer gap joined two transient slowdowns of a healthy machine."""
MIN_FRACTION = 0.75
"""A run must be a candidate in at least this share of its windows, or gaps could carry it."""
CONTINUITY_PER_DOUBLING_S = 30.0
"""Continuity grows by this per doubling of the job above CONTINUITY_MACHINES, because a job
of N machines meets N times the transient slowdowns (at 512 machines, 20 s per doubling left
11 alarms in 66 traces, 30 s one)."""
CONTINUITY_MACHINES = 128
"""The largest job that keeps CONTINUITY_S as it is: the size the default was tuned at."""
JOIN_BURSTS = 3
"""A run's gaps join its bursts of candidacy only once it has three: two transient
slowdowns of a healthy machine are two bursts, an intermittent fault comes back a third time."""
GAP_DEPTH = 0.75
"""A gap separates bursts only if every score of the machine fell under this fraction of the
threshold in it: a sustained fault dipping just under the threshold has not recovered."""
ECHO_S = 80.0
"""Windows in which a run is above the threshold only through the averaged scores after its
window score stopped firing count only past this long, since the averages keep a transient
above the threshold for up to their span (72-96 s gave the same results, 40-56 s left alarms)."""
RECURRENCE_S = 480.0
"""A machine that is a candidate in RECURRENCE_FRACTION of its windows over 8 minutes is
declared without a run: a weak intermittent fault never holds one unbroken run."""
RECURRENCE_FRACTION = 0.5
"""Half of 60 windows: a healthy machine's transient slowdowns reach it only when three or
four fall within those 8 minutes."""
CROWD_FRACTION = 0.1
"""Over a tenth of the machines above the threshold in one metric-window means the scale
does not fit that window (a stall, bursty counters), not that they all broke."""
CROWD_MACHINES = 2
"""In a job of under 20 machines two machines already make a crowd: a pair that differs
together there is a rack or a pipeline stage, and such pairs made the small jobs' alarms."""

# Gaps and normalisation.

MAX_FILL_S = 3.0
"""Gaps up to 3 s are filled (a dropped sample or two); longer ones void the window."""
MIN_MACHINES = 3
"""Two machines cannot outvote each other, so a metric-window needs three to be scored."""
STEP_LAG_S = 3.0
"""Step metrics reach each collector at its own next sample, so machines switch up to a few
seconds apart and each is compared with the closest cross-machine median within this lag."""
SKEW_S = 2.0
"""The window score forgives a shift of up to 2 s of a machine's samples, since samplers run
at their own phase and clocks differ by a second or two (1 s left alarms, 3 s found later)."""
STALE_STEPS = 3.0
"""Step times not renewed for this many steps (at least 30 s) are a hang repeating the last
step, not a measurement, and are not scored."""

# Peer scores: level, intermittency, peak and the joint GPU score.

PEER_SCORES = True
"""Score each machine's residual level and intermittency against its peers: a degraded
metric keeps its window shape, and a flapping fault is abnormal only half the time."""
LEVEL_SPAN_S = 32.0
"""The level averages several training steps, so pipeline-stage phases cancel."""
WHOLE_STEP_LEVEL = True
"""With steps of at most LEVEL_SPAN_S / 2 the level spans a whole number of steps, since only
whole steps cancel the phase of pipeline stages."""
INTERMITTENCY_SPAN_S = 180.0
"""Three 60 s slices: one or two transient slowdowns rarely touch all three, a fault that is
never off for more than a minute touches every one."""
ABNORMAL_Z = 5.0
"""A window's level counts as abnormal for the intermittency score above this |z|."""
PEAK_SCORE = True
"""Score each machine's peak rate against its peers': a link at half speed moves the same
bytes per step over twice as long, so only its peak shows the fault."""
PEAK_STEPS = 4.0
"""The peak is taken over at least four steps, so the sampling phase varies and the largest
reading nears the link's capacity."""
PEAK_SPAN_S = 80.0
"""... and over at least 80 s: with 6-12 s steps, four steps left healthy peaks unsteady by
6 %, the score's unit (64-96 s gave the same results)."""
PEAK_TOLERANCE = 0.05
"""A peak shortfall is scored in units of at least 5 %, since healthy peaks of the same
hardware agree within a few per cent."""
PEAK_HOLD_WINDOWS = 2
"""A peak shortfall scores only when it holds for two windows: a transient slowdown lowered
a peak for one, which joined two runs."""
PEAK_SINCE_SHORTFALL = 0.3
"""A run whose capacity peak is 30 % or more under its peers' counts its continuity from the
start of the peak's span: every shortfall that scores (6.5 units of 5 %) is that deep, so
the whole span ran slow."""
GPU_JOINT = True
"""Without step times, also score the middle of each machine's three GPU scores: a GPU whose
clock decays moves all three by a few spreads and none to the threshold."""

# The straggler channel and the step period.

STRAGGLER_SCORE = True
"""Score each rank's step and section times by their median over many steps, declared on its
own: a rank at 0.8x its peers is three to four per-step spreads off, too little for a window."""
STRAGGLER_STEPS = 3
"""A candidate on a step metric needs three steps as well as the continuity: with steps of
minutes, the seconds alone could be one slow step."""
STRAGGLER_SPAN_S = 96.0
"""The straggler median spans 96 s, so a transient slowdown shorter than about half of it
does not move it."""
STRAGGLER_MEDIAN_STEPS = 5
"""... and at least five steps, so with long steps two slow steps do not move it."""
STRAGGLER_MIN_SLOWDOWN = 0.1
"""A rank's median time must be 10 % above its peers' to score: a few per cent is ordinary
hardware variation."""
STRAGGLER_LOW_QUANTILE: float | None = 0.3
"""... and its 30th percentile over the span must be slow too (None: no such gate): slow in
most of the span, not in two bursts that happen to cover half of it."""
STRAGGLER_MIN_LOW_SLOWDOWN = 0.05
"""How far above its peers' that percentile must be: half the median's gate, since a slow
rank's faster steps pull it down."""
STRAGGLER_THRESHOLD = 5.0
"""The straggler channel's own threshold: the slowdown gates already hold healthy ranks back,
4.5-5 found every straggler with no more alarms, 4 added alarms, 5.5 missed ranks."""
FOLLOW_STEP = True
"""The time scales follow the job's step period estimated from the trace, since RL steps of
minutes put machines in different phases of a step at any second."""
CONTINUITY_STEPS = 4.0
"""With long steps a run needs four steps of candidacy (chosen among 2-5 with 40-90 s steps):
step averaging makes a transient last a step longer."""


@dataclass(frozen=True)
class Tuning:
    """The constants above as one value the detector's functions read; each field is the
    constant of the same name in upper case. Not a user setting: the lab builds one with a
    field changed (`dataclasses.replace(TUNING, ...)`) to measure what that field does."""

    max_gap_s: float = MAX_GAP_S
    min_fraction: float = MIN_FRACTION
    continuity_per_doubling_s: float = CONTINUITY_PER_DOUBLING_S
    continuity_machines: int = CONTINUITY_MACHINES
    join_bursts: int = JOIN_BURSTS
    gap_depth: float = GAP_DEPTH
    echo_s: float = ECHO_S
    recurrence_s: float = RECURRENCE_S
    recurrence_fraction: float = RECURRENCE_FRACTION
    crowd_fraction: float = CROWD_FRACTION
    crowd_machines: int = CROWD_MACHINES
    max_fill_s: float = MAX_FILL_S
    min_machines: int = MIN_MACHINES
    step_lag_s: float = STEP_LAG_S
    skew_s: float = SKEW_S
    stale_steps: float = STALE_STEPS
    peer_scores: bool = PEER_SCORES
    level_span_s: float = LEVEL_SPAN_S
    whole_step_level: bool = WHOLE_STEP_LEVEL
    intermittency_span_s: float = INTERMITTENCY_SPAN_S
    abnormal_z: float = ABNORMAL_Z
    peak_score: bool = PEAK_SCORE
    peak_steps: float = PEAK_STEPS
    peak_span_s: float = PEAK_SPAN_S
    peak_tolerance: float = PEAK_TOLERANCE
    peak_hold_windows: int = PEAK_HOLD_WINDOWS
    peak_since_shortfall: float = PEAK_SINCE_SHORTFALL
    gpu_joint: bool = GPU_JOINT
    straggler_score: bool = STRAGGLER_SCORE
    straggler_steps: int = STRAGGLER_STEPS
    straggler_span_s: float = STRAGGLER_SPAN_S
    straggler_median_steps: int = STRAGGLER_MEDIAN_STEPS
    straggler_min_slowdown: float = STRAGGLER_MIN_SLOWDOWN
    straggler_low_quantile: float | None = STRAGGLER_LOW_QUANTILE
    straggler_min_low_slowdown: float = STRAGGLER_MIN_LOW_SLOWDOWN
    straggler_threshold: float = STRAGGLER_THRESHOLD
    follow_step: bool = FOLLOW_STEP
    continuity_steps: float = CONTINUITY_STEPS

    def __post_init__(self):
        checks = [
            (self.max_gap_s >= 0 and self.max_fill_s >= 0, "max_gap_s and max_fill_s must be >= 0"),
            (
                self.continuity_per_doubling_s >= 0 and self.continuity_machines >= 1,
                "continuity_per_doubling_s must be >= 0 and continuity_machines >= 1",
            ),
            (0 < self.min_fraction <= 1, "min_fraction must be in (0, 1]"),
            (self.straggler_steps >= 1, "straggler_steps must be >= 1"),
            (
                self.straggler_span_s > 0 and self.straggler_median_steps >= 1,
                "straggler_span_s must be > 0 and straggler_median_steps >= 1",
            ),
            (
                self.straggler_min_slowdown >= 0 and self.straggler_threshold > 0,
                "straggler_min_slowdown must be >= 0 and straggler_threshold > 0",
            ),
            (
                self.straggler_low_quantile is None or 0 <= self.straggler_low_quantile <= 1,
                "straggler_low_quantile must be null or in [0, 1]",
            ),
            (self.continuity_steps >= 0, "continuity_steps must be >= 0"),
            (self.recurrence_s >= 0 and self.echo_s >= 0, "recurrence_s and echo_s must be >= 0 (0: off)"),
            (self.step_lag_s >= 0 and self.stale_steps >= 0, "step_lag_s and stale_steps must be >= 0 (0: off)"),
            (self.skew_s >= 0, "skew_s must be >= 0 (0: off)"),
            (
                self.peak_steps > 0 and self.peak_tolerance > 0 and self.peak_span_s > 0,
                "peak_steps, peak_span_s and peak_tolerance must be > 0",
            ),
            (self.peak_hold_windows >= 1, "peak_hold_windows must be >= 1"),
            (0 <= self.peak_since_shortfall <= 1, "peak_since_shortfall must be in [0, 1] (0: off)"),
            (0 < self.crowd_fraction <= 1, "crowd_fraction must be in (0, 1] (1: off)"),
            (self.crowd_machines >= 2, "crowd_machines must be >= 2 (one machine is an outlier, not a crowd)"),
            (0 < self.recurrence_fraction <= 1, "recurrence_fraction must be in (0, 1]"),
            (self.join_bursts >= 2, "join_bursts must be >= 2 (2: every gap joins)"),
            (0 < self.gap_depth <= 1, "gap_depth must be in (0, 1] (1: any gap)"),
            (self.min_machines >= 3, "min_machines must be >= 3 (two machines cannot outvote each other)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"Tuning: {msg}; got {self}")


TUNING = Tuning()
"""The detector's tuning: the constants above."""
