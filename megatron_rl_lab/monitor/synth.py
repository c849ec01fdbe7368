"""Synthetic multi-machine traces with injected faults, for evaluation and tests.

What a synchronous training job looks like at 1 Hz, as far as the detector cares:
- one training step every 6-12 s shared by all machines (compute, then communication);
  each machine's sampler reads the step at its own sub-second phase, so machines differ
  from second to second even when nothing is wrong;
- common-mode movement: a diurnal cycle, a job-wide slow trend, checkpoint pauses in
  which every machine idles (entered and left with a second or two of skew);
- per-machine heterogeneity: fixed offsets, a slow thermal wander, heavy-tailed noise
  (Student t, 3 degrees of freedom) and rare single-sample sensor glitches;
- stragglers that are NOT faults: transient slowdowns of 5-60 s (shorter than the
  continuity window) and a few machines persistently a few percent slower;
- data defects: dropped samples, NaNs, a machine joining late or leaving early, a
  machine without one metric.
Faults (one machine, from a random start to the end of the trace): see FAULTS.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron_rl.monitor.trace import PRIORITY_METRICS, STEP_METRICS, Trace
from megatron_rl.monitor.windows import Grid

from .distractors import job_wide_load, pipeline_phases, sensor_spikes
from .stepsynth import step_metrics, straggler_fault

METRICS = PRIORITY_METRICS  # the seven metrics of the published system
GPU = ("gpu_duty_cycle", "gpu_power", "gpu_graphics_activity", "gpu_tensor_activity")
FAULTS = {
    # kind: metrics it moves (ground truth for "right metric")
    "gpu_drop": GPU,  # GPU throughput falls to 55-85 %
    "pfc_storm": ("pfc_tx_packets",),  # NIC sends 5-30x its usual pause frames
    "cpu_spike": ("cpu_util",),  # a runaway process takes 30-70 % of the CPU
    "nvlink_drop": ("nvlink_bandwidth",),  # NVLink traffic falls to 10-60 %
    "slow_drift": ("gpu_power", "gpu_graphics_activity", "gpu_tensor_activity"),  # throttling ramp
    "flapping": GPU,  # gpu_drop that comes and goes (on 20-60 s, off 5-20 s)
    # Added later (appended so the old kinds keep their random streams):
    "link_partial": ("nvlink_bandwidth",),  # one link at 40-60 % of its peers' bandwidth
    "gpu_flap": ("gpu_duty_cycle", "gpu_power", "gpu_graphics_activity", "gpu_tensor_activity"),
    # ^ GPU idles (~0 power/duty) for 10-60 s, then works for 10-60 s: abnormal ~50 % of the time
    "straggler": STEP_METRICS,  # step or section times 1.1-1.5x its peers' (the whole step or one section)
}
FAULT_KINDS = tuple(FAULTS)
ACTIVITY_FAULTS = ("gpu_drop", "flapping", "gpu_flap")  # change activity before metrics are derived
PERCENT = ("cpu_util", "gpu_duty_cycle", "gpu_graphics_activity", "gpu_tensor_activity")


@dataclass(frozen=True)
class SynthConfig:
    """One synthetic trace."""

    machines: int = 64
    duration_s: int = 900
    seed: int = 0
    fault: str | None = None
    """A FAULT_KINDS name, or None for a fault-free trace."""
    noise: float = 1.0
    """Multiplier on every noise source."""
    diurnal: float = 0.05
    """Relative amplitude of the job-wide daily cycle."""
    transient_rate: float = 1.0
    """Transient stragglers per machine-hour (5-60 s slowdowns, not faults)."""
    persistent_stragglers: int | None = None
    """Machines persistently 2-5 % slower (not faults); None draws 0-2."""
    drop_frac: float = 0.005
    nan_frac: float = 0.002
    churn: bool = True
    """Sometimes one machine joins late and one leaves early."""
    fault_start: tuple[float, float] = (120.0, 420.0)
    step_period_s: tuple[float, float] = (6.0, 12.0)
    """Range the training step's length is drawn from (RL steps take minutes: try 40-90)."""
    distractors: bool = False
    """Harder normal behaviour that must not alarm (see `distractors.py`): job-wide load
    changes, pipeline-stage phase offsets, multi-second sensor spikes on healthy machines.
    Off by default so traces of the original evaluation stay bit-identical."""
    step_metrics: bool = False
    """Also the trainer's step and section times (`stepsynth.py`); always on for the
    `straggler` kind. Off by default: traces of the earlier evaluations stay unchanged."""

    def __post_init__(self):
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"SynthConfig.fault = {self.fault!r}; allowed: None, {', '.join(FAULT_KINDS)}")
        if self.machines < 3 or self.duration_s < 60:
            raise ValueError("SynthConfig needs machines >= 3 and duration_s >= 60")


@dataclass
class FaultLabel:
    machine: str
    kind: str
    start: float
    end: float
    metrics: tuple[str, ...]


@dataclass
class SynthTrace:
    grid: Grid
    labels: list[FaultLabel]
    config: SynthConfig
    stragglers: list[str] = field(default_factory=list)

    def to_trace(self, jitter_s: float = 0.2) -> Trace:
        """Rows as a collector would write them: absent samples absent, timestamps jittered."""
        g = self.grid
        rng = np.random.default_rng(self.config.seed + 7)
        present = ~np.isnan(g.values)
        after_value = np.concatenate([np.zeros_like(present[..., :1]), present[..., :-1]], axis=-1)
        nan_row = ~present & after_value & (rng.random(g.values.shape) < 0.3)  # some drops are NaN rows
        k, i, t = np.nonzero(present | nan_row)
        order = np.argsort(t, kind="stable")  # rows in time order, as collectors write them
        k, i, t = k[order], i[order], t[order]
        ts = g.start + t * g.step_s + rng.uniform(-jitter_s, jitter_s, t.size)
        return Trace(
            ts,
            i.astype(np.int32),
            k.astype(np.int32),
            g.values[k, i, t].astype(np.float64),
            list(g.machines),
            list(g.metrics),
        )


def _activity(u: np.ndarray, period: float, frac: float) -> np.ndarray:
    """Mean of a compute/communicate square wave over (u-1, u]: the 1 s NVML average."""

    def integral(x):
        return np.floor(x / period) * frac * period + np.minimum(np.mod(x, period), frac * period)

    return integral(u) - integral(u - 1.0)


def _noise(rng, shape, scale):
    """Heavy-tailed noise: Student t with 3 degrees of freedom, cut at 10 scales."""
    return (np.clip(rng.standard_t(3, size=shape), -10, 10) * scale).astype(np.float32)


def _pauses(rng, n, t, duration):
    """Checkpoint pauses: [machines, T] activity multiplier, 0.05 while a machine idles."""
    mult = np.ones((n, t.size), np.float32)
    start = rng.uniform(60, 360)
    while start < duration:
        length = rng.uniform(10, 30)
        skew_in, skew_out = rng.uniform(0, 2, (2, n, 1))
        idle = (t[None] >= start + skew_in) & (t[None] < start + length + skew_out)
        mult[idle] = 0.05
        start += rng.uniform(300, 600)
    return mult


def _base_activity(
    rng, cfg: SynthConfig, t: np.ndarray, stage_phase: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, float]:
    """[machines, T] compute and communication activity in [0, 1] (before faults), and
    the step period in seconds."""
    n = cfg.machines
    period, frac = rng.uniform(*cfg.step_period_s), rng.uniform(0.6, 0.8)
    # Step lengths jitter together on all machines: a common warp of time.
    warp = np.cumsum(rng.normal(0, 0.05, t.size))
    phase = rng.uniform(0, 1, (n, 1)) + rng.normal(0, 0.1, (n, t.size))  # sampler phase
    if stage_phase is not None:
        phase = phase + stage_phase[:, None] * period  # pipeline stage s runs its step later
    act = _activity(t[None] + warp[None] + phase, period, frac)
    running = _pauses(rng, n, t, cfg.duration_s)
    return (act * running).astype(np.float32), ((1 - act) * running).astype(np.float32), period


def _stragglers(rng, cfg: SynthConfig, act, cpu_extra, t, avoid, speed) -> list[int]:
    """Apply non-fault slowdowns in place (to `speed` too); returns persistently slow
    machine indices."""
    n = cfg.machines
    events = rng.poisson(cfg.transient_rate * n * cfg.duration_s / 3600)
    for _ in range(events):
        i, start, length = rng.integers(n), rng.uniform(0, cfg.duration_s), rng.uniform(5, 60)
        on = (t >= start) & (t < start + length)
        mult = rng.uniform(0.5, 0.85)
        act[i, on] *= mult
        speed[i, on] *= mult
        cpu_extra[i, on] += rng.uniform(10, 30)
    count = rng.integers(0, 3) if cfg.persistent_stragglers is None else cfg.persistent_stragglers
    choices = [i for i in range(n) if i not in avoid]
    slow = rng.choice(choices, size=min(count, len(choices)), replace=False)
    for i in slow:
        mult = rng.uniform(0.95, 0.98)
        act[i] *= mult
        speed[i] *= mult
    return [int(i) for i in slow]


def _metrics(rng, cfg: SynthConfig, act, comm, cpu_extra, t) -> dict[str, np.ndarray]:
    """Per-metric [machines, T] values from activity, with offsets, wander and noise."""
    n, size, s = cfg.machines, act.shape, cfg.noise
    day = 1 + cfg.diurnal * np.sin(2 * np.pi * (t + rng.uniform(0, 86400)) / 86400)[None]
    trend = 1 + rng.normal(0, 0.03) * t[None] / cfg.duration_s
    off = lambda sd: rng.normal(0, sd, (n, 1))  # noqa: E731  fixed per-machine offset
    wander = np.cumsum(rng.normal(0, 0.4, size), axis=1) * np.exp(-np.arange(t.size) / 600)[None]
    m = {
        "pfc_tx_packets": (60 + 500 * comm * trend) * np.exp(_noise(rng, size, 0.15 * s)) + off(8),
        "cpu_util": 22 + 8 * comm + cpu_extra + off(1.5) + _noise(rng, size, 1.5 * s),
        "gpu_duty_cycle": 100 * (0.35 + 0.63 * act) * day + off(0.5) + _noise(rng, size, 1.5 * s),
        "gpu_power": (120 + 560 * act) * day * trend + off(8) + 1.5 * wander + _noise(rng, size, 15 * s),
        "gpu_graphics_activity": 100 * (0.3 + 0.6 * act) * day + off(0.5) + _noise(rng, size, 2 * s),
        "gpu_tensor_activity": 100 * (0.05 + 0.5 * act) * day + off(0.5) + _noise(rng, size, 2 * s),
        "nvlink_bandwidth": (1e9 + 2e10 * comm * trend) * (1 + off(0.01)) + _noise(rng, size, 4e8 * s),
    }
    glitch = lambda: rng.random(size) < 0.001  # noqa: E731  a sensor reads nonsense for a second
    for name, v in m.items():
        g = glitch()
        v[g] *= rng.uniform(0, 2, g.sum())
        m[name] = np.clip(v, 0, 100 if name in PERCENT else None)
    return m


def _fault_mask(rng, kind: str, t: np.ndarray, start: float) -> np.ndarray:
    """[T] fault strength in [0, 1]: on from `start`, ramping or flapping by kind."""
    if kind == "slow_drift":
        return np.clip((t - start) / rng.uniform(200, 400), 0, 1)
    on = (t >= start).astype(np.float32)
    if kind in ("flapping", "gpu_flap"):
        on_s, off_s = ((20, 60), (5, 20)) if kind == "flapping" else ((10, 60), (10, 60))
        edge, state = start, 1.0
        while edge < t[-1]:
            length = rng.uniform(*on_s) if state else rng.uniform(*off_s)
            on[(t >= edge) & (t < edge + length)] = state
            edge, state = edge + length, 1.0 - state
    return on


def _inject(rng, kind: str, strength: np.ndarray, act_f: np.ndarray, m: dict, f: int) -> None:
    """Apply a fault to machine f in place (activity-driven kinds change `act_f` before
    metrics are derived; the rest change metric arrays after)."""
    if kind in ("gpu_drop", "flapping"):
        act_f *= 1 - strength * rng.uniform(0.15, 0.45 if kind == "gpu_drop" else 0.6)
    elif kind == "gpu_flap":
        act_f *= 1 - strength * rng.uniform(0.9, 1.0)
    elif kind == "link_partial":
        m["nvlink_bandwidth"][f] *= 1 - strength * rng.uniform(0.4, 0.6)
    elif kind == "pfc_storm":
        m["pfc_tx_packets"][f] += strength * rng.uniform(5, 30) * 300 * np.exp(rng.normal(0, 0.3, strength.size))
    elif kind == "cpu_spike":
        m["cpu_util"][f] = np.minimum(100, m["cpu_util"][f] + strength * rng.uniform(30, 70))
    elif kind == "nvlink_drop":
        m["nvlink_bandwidth"][f] *= 1 - strength * rng.uniform(0.4, 0.9)
    elif kind == "slow_drift":
        drop = 1 - strength * rng.uniform(0.2, 0.4)
        for name in FAULTS["slow_drift"]:
            m[name][f] *= drop


def _defects(rng, cfg: SynthConfig, values: np.ndarray, avoid: set[int]) -> None:
    """Dropped samples, NaNs, churn and a machine without one metric, in place."""
    n_k, n, n_t = values.shape
    values[rng.random(values.shape) < cfg.drop_frac + cfg.nan_frac] = np.nan
    others = [i for i in range(n) if i not in avoid]
    if cfg.churn and rng.random() < 0.3 and others:
        values[:, rng.choice(others), : int(rng.uniform(60, 300))] = np.nan  # joins late
    if cfg.churn and rng.random() < 0.3 and others:
        values[:, rng.choice(others), int(rng.uniform(500, 850) * n_t / 900) :] = np.nan  # leaves
    if rng.random() < 0.2 and others:
        values[rng.integers(n_k), rng.choice(others)] = np.nan  # no such sensor


def generate(cfg: SynthConfig) -> SynthTrace:
    """One synthetic trace and its fault labels (empty for a fault-free trace)."""
    rng = np.random.default_rng([cfg.seed, cfg.machines, FAULT_KINDS.index(cfg.fault) + 1 if cfg.fault else 0])
    t = np.arange(cfg.duration_s, dtype=np.float64)
    drng = np.random.default_rng([cfg.seed, cfg.machines, 7919])  # own stream: old traces unchanged
    srng = np.random.default_rng([cfg.seed, cfg.machines, 7927])  # step metrics: likewise
    stage_phase = pipeline_phases(drng, cfg.machines) if cfg.distractors else None
    act, comm, period = _base_activity(rng, cfg, t, stage_phase)
    cpu_extra, speed = np.zeros_like(act), np.ones_like(act)
    f = int(rng.integers(cfg.machines)) if cfg.fault else -1
    slow = _stragglers(rng, cfg, act, cpu_extra, t, avoid={f}, speed=speed)
    labels, strength = [], None
    if cfg.fault:
        start = float(rng.uniform(*cfg.fault_start))
        strength = _fault_mask(rng, cfg.fault, t, start).astype(np.float32)
        factor, sections = straggler_fault(srng) if cfg.fault == "straggler" else (1.0, ())
        slowed = ("step_time",) + sections if sections else FAULTS[cfg.fault]
        labels.append(FaultLabel(f"node{f:04d}", cfg.fault, start, float(t[-1]), slowed))
        if cfg.fault in ACTIVITY_FAULTS:
            _inject(rng, cfg.fault, strength, act[f], {}, f)
    if cfg.distractors:
        job_wide_load(drng, act, comm, t)
    m = _metrics(rng, cfg, act, comm, cpu_extra, t)
    if cfg.distractors:
        sensor_spikes(drng, m, t, avoid={f})
    if cfg.fault and cfg.fault not in ACTIVITY_FAULTS:
        _inject(rng, cfg.fault, strength, act[f], m, f)
    values = np.stack([m[k] for k in METRICS]).astype(np.float32)
    _defects(rng, cfg, values, avoid={f})
    metrics = list(METRICS)
    if cfg.step_metrics or cfg.fault == "straggler":
        fault = (f, strength, factor, sections) if cfg.fault == "straggler" else None
        steps = step_metrics(srng, period, speed, t, np.isnan(values).all(0), fault, cfg.drop_frac + cfg.nan_frac)
        values = np.concatenate([values, np.stack([steps[k] for k in STEP_METRICS])])
        metrics += list(STEP_METRICS)
    machines = [f"node{i:04d}" for i in range(cfg.machines)]
    grid = Grid(values, metrics, machines, start=0.0, step_s=1.0)
    return SynthTrace(grid, labels, cfg, [machines[i] for i in slow])
