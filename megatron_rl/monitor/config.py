"""The monitor's settings as the trainer's `monitor:` config section (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import tuning

MODES = ("any", "top1")


@dataclass(frozen=True)
class DetectConfig:
    """What a user sets on the detector; times are in the trace's seconds. The tuned
    constants behind these knobs are in monitor/tuning.py."""

    threshold: float = tuning.THRESHOLD
    """A machine is a candidate when its normalised score exceeds this. Tuned for the
    packaged denoiser (docs/monitor.md#evaluation); re-tune with `monitor eval` after
    retraining it. Lower finds weaker faults sooner and raises more false alarms."""
    continuity_s: float = tuning.CONTINUITY_S
    """Declare a machine only after it has been the candidate this long (the published
    system used about 4 minutes). Jobs above 128 machines need more (30 s per doubling),
    long training steps at least 4 steps. Shorter declares sooner, with more false alarms."""
    window_s: float = tuning.WINDOW_S
    """Length of one window (8 s in the published system)."""
    stride_s: float = tuning.STRIDE_S
    """Step between windows; equal to window_s means non-overlapping windows."""
    step_s: float = tuning.STEP_S
    """Sampling period the trace is resampled to (the collectors sample at 1 Hz)."""
    mode: str = "any"
    """Candidate rule: "any" (every machine above threshold) or "top1" (the paper's
    single top scorer per window); see the docstring of monitor/detect.py."""
    threads: int = 2
    """Threads one detection call may use: 2 runs the denoiser (torch) on a second thread
    beside the peer, skew and peak scores (numpy), which both release the GIL; the scores
    are the same bits either way. 1 keeps the whole call on the calling thread."""

    def __post_init__(self):
        checks = [
            (self.mode in MODES, f"mode must be one of {', '.join(MODES)}"),
            (self.step_s > 0, "step_s must be > 0"),
            (self.window_s >= 2 * self.step_s, "window_s must cover at least 2 samples"),
            (
                self.window_s > 2 * tuning.SKEW_S,
                f"window_s must be over twice the {tuning.SKEW_S:g} s of sampler skew the window score forgives",
            ),
            (self.step_s <= self.stride_s, "stride_s must be >= step_s"),
            (self.threshold > 0, "threshold must be > 0"),
            (self.continuity_s >= 0, "continuity_s must be >= 0"),
            (self.threads in (1, 2), "threads must be 1 or 2"),
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
