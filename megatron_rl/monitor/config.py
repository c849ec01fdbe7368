"""The monitor's settings as the trainer's `monitor:` config section (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("any", "top1")


@dataclass(frozen=True)
class DetectConfig:
    """Detector settings; times are in the trace's seconds."""

    window_s: float = 8.0
    """Length of one window (8 s in the published system)."""
    stride_s: float = 8.0
    """Step between windows; equal to window_s means non-overlapping windows."""
    threshold: float = 6.5
    """A machine is a candidate when its normalised score exceeds this. Tuned for the
    packaged denoiser (docs/monitor.md); re-tune with `monitor eval` after retraining."""
    continuity_s: float = 110.0
    """Declare a machine only after it has been the candidate this long (~4 min published;
    here 14 windows of 8 s, chosen with max_gap_s on the tuning seeds, docs/monitor-log.md)."""
    max_gap_s: float = 16.0
    """A run of candidacy survives this many seconds without the machine being the
    candidate (0 = strictly consecutive, as published): two missed 8 s windows, so a
    fault whose score dips under the threshold now and then keeps its run. It need not
    bridge a flapping fault's off-periods: the intermittency score (peers.py) stays high
    while such a fault comes and goes. A longer tolerance joined two separate transient
    slowdowns of a healthy machine into one run (docs/monitor-log.md)."""
    continuity_per_doubling_s: float = 30.0
    """Above `continuity_machines` machines, continuity_s grows by this much per doubling of
    the job (170 s at 512 machines, 200 s at 1024). A healthy machine's transient slowdowns
    are rare per machine, but a job of N machines meets N times as many, and the long ones
    (two slowdowns back to back) then came every 10-30 minutes at 1024 machines on the synth
    generator. How long such a chain lasts falls off about geometrically, so each doubling
    of the job asks for a fixed step more: 20 s per doubling left 11 alarms in 66 traces of
    512 machines, 30 s one (docs/monitor-log.md, "Continuity grows with the job"). 0: the
    same continuity at every size, faster and with more false alarms on large jobs."""
    continuity_machines: int = 128
    """See continuity_per_doubling_s: the largest job that keeps continuity_s as it is (the
    size the default was tuned at)."""
    min_fraction: float = 0.75
    """... but the machine must be the candidate in at least this fraction of the run's windows."""
    max_fill_s: float = 3.0
    """Gaps up to this long are filled (a per-second metric with the cross-machine median at
    that second, windows.fill_gaps_from; a step metric with its last value); longer gaps
    void a window."""
    min_machines: int = 3
    """A metric window is scored only if at least this many machines have it."""
    step_s: float = 1.0
    """Sampling period the trace is resampled to."""
    mode: str = "any"
    """Candidate rule: "any" (every machine above threshold) or "top1" (the paper's
    single top scorer per window); see the docstring of monitor/detect.py."""
    peer_scores: bool = True
    """Also score each machine's residual level and intermittency against its peers
    (monitor/peers.py): finds partial one-metric degradations and flapping faults."""
    peak_score: bool = True
    """Also score each machine's peak per-second value over peak_steps steps against its
    peers' (peers.peak_scores; only with peer_scores): a link at half speed moves the same
    bytes per step over twice as long, so every average the other scores compare is the
    same as its peers', and only its peak rate, about half theirs, shows the fault."""
    peak_steps: float = 4.0
    """The peak is the largest value over max(peak_span_s, this many steps): one step's
    transfer of ~1 s falls across two sampling seconds and reads low; over several steps
    the sampling phase varies and the largest reading nears the link's capacity."""
    peak_span_s: float = 80.0
    """... and over at least this long. With 6-12 s steps, 4 steps left the healthy
    machines' own peaks unsteady by 6 %, the unit of the score, so a link at 0.6x on the
    faster of two racks scored 5-6 (docs/monitor-log.md, "Quiet windows, a straggler channel,
    stale step times, longer peaks and the echo rule"); 64-96 s gave the same results on
    the design seeds."""
    peak_tolerance: float = 0.05
    """A peak's shortfall below the peers' median peak is scored in units of at least this
    fraction (threshold 6.5: a peak about a third below the peers'): healthy machines'
    peaks of the same hardware agree within a few per cent, and a smaller unit would
    score the sampling-phase noise of the peak. A metric whose machines' own peaks are
    unsteady (bursts of random size) uses that unsteadiness instead (peers.peak_scores)."""
    peak_hold_windows: int = 2
    """A peak shortfall scores only when it holds in this many consecutive windows: a
    healthy machine's transient slowdown lowered its peak for one window, which filled
    the gap between two candidacy runs and joined them (docs/monitor-log.md)."""
    peak_since_shortfall: float = 0.3
    """A run whose window has a capacity's peak at least this far below its peers' (0:
    off) counts its continuity from where that peak's span began, not from the window.
    On a capacity the unit of the peak score is peak_tolerance (5 %), so a shortfall that
    scores (6.5 units) is already 32.5 % or more: 0.3 backs every run a capacity's
    shortfall scores in. Such a span max is as far below the machine's own usual ratio as
    any score above the threshold, so the whole span ran slow; counting from the window
    put the span's 80 s on top of continuity_s. 0.5 until 2026-11-27 (docs/monitor-log.md,
    "Runs backed by any scoring capacity shortfall")."""
    gpu_joint: bool = True
    """On traces without step metrics, also score the middle of each machine's three GPU
    scores (duty cycle, power, tensor activity) against its peers as one more metric,
    `gpu_joint` (detect.gpu_joint_scores): a GPU whose clock decays moves all three by a
    few peer spreads, none of them to the threshold. With step metrics the slowdown shows
    in the rollout time, and the joint score only added alarms (docs/monitor-log.md, "A joint
    GPU score without step times")."""
    skew_s: float = 2.0
    """A machine's window score counts only what still differs from the median with its
    samples shifted by up to this many seconds either way (monitor/skew.py; 0: off):
    collectors sample at their own phase and hosts' clocks differ by a second or two,
    and a network counter's burst read a second early is ~100x off at that second. On
    the design seeds 1 s left two more fault-free alarms and 3 s declared later without
    step metrics (docs/monitor-log.md, "Sampler skew in the window score")."""
    level_span_s: float = 32.0
    """The level score averages this long (several training steps, so phases cancel)."""
    whole_step_level: bool = True
    """When the per-second metrics repeat with a period of at most level_span_s / 2 (the
    training step), the level averages the whole number of steps nearest level_span_s
    instead: only whole steps cancel pipeline-stage phases (monitor/peers.py)."""
    intermittency_span_s: float = 180.0
    """The intermittency score counts abnormal windows over this long."""
    abnormal_z: float = 5.0
    """A window's level is abnormal for the intermittency count above this |z|."""
    straggler_steps: int = 3
    """A machine that is the candidate on a step metric (step or section time, one value
    per training step) needs this many of the job's steps as well as continuity_s: with
    steps of minutes, continuity_s alone would declare one slow step."""
    straggler_score: bool = True
    """Also score each rank's step and section times by their median over many steps, as a
    channel declared on its own (monitor/stragglers.py): a rank at 0.8x its peers is three
    to four per-step spreads off, too little for one window."""
    straggler_span_s: float = 96.0
    """The straggler median spans at least this long: a transient slowdown shorter than
    about half of it, less a window, does not move the median."""
    straggler_median_steps: int = 5
    """... and at least this many steps (with long steps, two slow steps do not move it)."""
    straggler_min_slowdown: float = 0.1
    """A rank's median time must be at least this fraction above its peers' to score: ranks
    a few per cent apart are ordinary hardware variation."""
    straggler_low_quantile: float | None = 0.3
    """... and this quantile of its time over the span (None: no such gate) at least
    `straggler_min_low_slowdown` above its peers': slow in most of the span, not in two
    bursts that happen to cover half of it (monitor/stragglers.py)."""
    straggler_min_low_slowdown: float = 0.05
    """See straggler_low_quantile: how far above its peers' that quantile must be (5 %,
    half the median's gate, since a slow rank's faster steps pull it down)."""
    straggler_threshold: float = 5.0
    """The straggler channel's threshold (the other scores use `threshold`). Lower than
    theirs because the slowdown gate above already holds healthy ranks back: on the design
    seeds 4.5-5 found every straggler with no more alarms, 4 added alarms and 5.5 and 6.5
    missed ranks whose 13-14 s steps put fewer steps in the span."""
    stale_steps: float = 3.0
    """Step and section times not renewed for max(this many steps, 30 s) are stale and not
    scored: during a hang every rank repeats its last step (period.without_stale_steps)."""
    follow_step: bool = True
    """Make the time scales follow the job's step period, estimated from the trace
    (monitor/period.py): with steps longer than level_span_s / 2, per-second metrics are
    averaged over one step before machines are compared, and every metric's continuity is
    at least continuity_steps steps. Short steps keep the default time constants."""
    continuity_steps: float = 4.0
    """With follow_step, a run needs max(continuity_s, this many steps) of candidacy
    (chosen on the tuning seeds with 40-90 s steps among 2-5; docs/monitor-log.md)."""
    step_lag_s: float = 3.0
    """Step metrics change at each machine's own next sample after a step ends, so
    machines switch to the new value up to this many seconds apart; each is compared
    with the closest of the cross-machine medians within this lag (windows.normalise_lagged)."""
    crowd_fraction: float = 0.1
    """A metric-window in which at least crowd_machines and more than this fraction of the
    scored machines are above the threshold is a crowd, not an outlier: it makes no
    machine a candidate, and a run already open bridges it without counting it toward
    continuity (detect.crowds)."""
    crowd_machines: int = 2
    """See crowd_fraction: the fewest machines that make a crowd, which decides in jobs of
    under 20 machines. 3 until 2026-11-27: two machines of an 8-machine job that differ
    from the others together (a rack, a pipeline stage) were declared (docs/monitor-log.md,
    "A pair is a crowd in a small job")."""
    recurrence_s: float = 480.0
    """A second way to be declared, for intermittent faults too weak to hold a run: a
    machine that was the candidate in at least recurrence_fraction of its scored windows
    over the last recurrence_s (at least 90 % of them scored). Off (0) with step-averaged
    metrics, whose windows within a step are not independent (docs/monitor-log.md)."""
    echo_s: float = 80.0
    """A run that was above the threshold through its window score and since then only
    through the averaged scores (level, intermittency, peak) is in their echo: those
    windows count toward continuity only once they last longer than this (detect.declare).
    The averages keep a transient slowdown above the threshold for up to their span after
    it ended (the peak's 80 s the longest that declares alone); 72-96 s gave the same
    results on the design seeds, 40-56 s left some alarms, 0 (off) all of them."""
    recurrence_fraction: float = 0.5
    """See recurrence_s. With 0.5 over 480 s (30 of 60 windows), a healthy machine's
    transient slowdowns (a candidate for the slowdown plus up to half a minute of the
    level's smear) must come three or four times in eight minutes to be declared."""
    join_bursts: int = 3
    """A run's gaps (up to max_gap_s each) join its stretches of candidacy into one run
    only once it has this many of them; with fewer, its latest stretch alone must hold
    continuity (detect._Run.joins_its_gaps). 3: two transient slowdowns of a healthy
    machine, the second soon after the first, are not one run, and an intermittent fault
    is declared once it comes back a third time. 2: every gap joins (the rule until
    2026-11-27; docs/monitor-log.md, "Two bursts are not a run")."""
    gap_depth: float = 0.75
    """A gap separates two bursts (join_bursts) only if in one of its windows every score
    of the machine fell under this fraction of the threshold: a sustained fault whose
    score dips just under the threshold for a window has not recovered (1: any gap)."""
    threads: int = 2
    """Threads one detection call may use: 2 runs the denoiser (torch) on a second thread
    beside the peer, skew and peak scores (numpy); both release the GIL, so with a second
    core free a call at 1024 machines x 7 metrics took 0.6-0.7 s against 0.8-1.1 s. The
    same operations on the same data: the scores are the same bits either way (checked in
    tests/unit/monitor/test_fast_paths.py). 1 keeps the whole call on the calling thread."""

    def __post_init__(self):
        checks = [
            (self.mode in MODES, f"mode must be one of {', '.join(MODES)}"),
            (self.step_s > 0, "step_s must be > 0"),
            (self.window_s >= 2 * self.step_s, "window_s must cover at least 2 samples"),
            (self.step_s <= self.stride_s, "stride_s must be >= step_s"),
            (self.threshold > 0, "threshold must be > 0"),
            (
                self.continuity_s >= 0 and self.max_gap_s >= 0 and self.max_fill_s >= 0,
                "continuity_s, max_gap_s and max_fill_s must be >= 0",
            ),
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
            (0 <= self.skew_s < self.window_s / 2, "skew_s must be >= 0 (0: off) and under half of window_s"),
            (
                self.peak_steps > 0 and self.peak_tolerance > 0 and self.peak_span_s > 0,
                "peak_steps, peak_span_s and peak_tolerance must be > 0",
            ),
            (self.peak_hold_windows >= 1, "peak_hold_windows must be >= 1"),
            (0 <= self.peak_since_shortfall <= 1, "peak_since_shortfall must be in [0, 1] (0: off)"),
            (0 < self.crowd_fraction <= 1, "crowd_fraction must be in (0, 1] (1: off)"),
            (self.crowd_machines >= 2, "crowd_machines must be >= 2 (one machine is an outlier, not a crowd)"),
            (0 < self.recurrence_fraction <= 1, "recurrence_fraction must be in (0, 1]"),
            (self.threads in (1, 2), "threads must be 1 or 2"),
            (self.join_bursts >= 2, "join_bursts must be >= 2 (2: every gap joins)"),
            (0 < self.gap_depth <= 1, "gap_depth must be in (0, 1] (1: any gap)"),
            (self.min_machines >= 3, "min_machines must be >= 3 (two machines cannot outvote each other)"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"DetectConfig: {msg}; got {self}")

    @property
    def window(self) -> int:
        return int(round(self.window_s / self.step_s))

    @property
    def stride(self) -> int:
        return int(round(self.stride_s / self.step_s))


@dataclass(frozen=True)
class OnlineConfig:
    """Settings of the monitor that runs beside training."""

    enabled: bool = False
    """Whether the trainer starts the monitor (`monitor.enabled=true`)."""
    interval_s: float = 1.0
    """Sampling period on every machine."""
    detect_every_steps: int = 5
    """Gather samples and run the detector every this many training steps (RL steps
    take tens of seconds to minutes, so this adds that much to the detection delay)."""
    lookback_s: float = 900.0
    """Seconds of history the detector looks at on each run (with `grow_lookback`, more
    when the steps are long)."""
    grow_lookback: bool = True
    """Look back far enough for a run to be declared with long steps: the peak's span,
    then the continuity, then a step (`OnlineMonitor.history_s`); False: lookback_s only."""
    exclude_file: str | None = None
    """Hostnames declared faulty are appended here; default <run_dir>/monitor/exclude_hosts.txt."""
    model_dir: str | None = None
    """Denoiser weights (train-denoiser output); None: the packaged default; "none": raw windows."""
    stop_on_alert: bool = False
    """Set `stop_requested` on the detector rank when a machine is declared."""
    write_traces: bool = True
    """Each sampling machine also writes <run_dir>/monitor/traces/<host>.csv."""
    detect: DetectConfig = field(default_factory=DetectConfig)

    def __post_init__(self):
        if self.interval_s <= 0 or self.detect_every_steps < 1 or self.lookback_s <= 0:
            raise ValueError(
                f"OnlineConfig: interval_s and lookback_s must be > 0 and detect_every_steps >= 1; got {self}"
            )
