"""A second, independent trace generator: synchronous RL training simulated step by step.

Why a second generator: the detector was developed and tuned on traces of one generator
(`synth`), so its numbers say how well it separates *that* generator's faults from *that*
generator's noise. This module models the cluster from first principles instead, without
sharing code or parameter choices with `synth`, so that an evaluation on its traces says
whether the detector holds on a different (and, we think, more physical) picture.

What is modelled, and how it differs from drawing per-metric signals directly:

* **A schedule, not signals.** Each step every machine (one pipeline-stage replica of a
  data-parallel group) decodes its own rollout batch, computes rewards on the CPU, meets
  the others in a gather, trains (intra-machine parameter gather over NVLink, compute,
  gradient reduce-scatter over NVLink, pipeline bubbles by stage), joins the data-parallel
  gradient all-reduce over the network and receives the new weights. Every section that
  ends in a collective ends when the *slowest* machine gets there: the others wait. So one
  slow machine lowers everyone else's utilisation and stretches every step, and is itself
  busy for longer. Sensor signals are rendered from this schedule at 10 Hz.
* **Where waiting shows.** Waiting in the host-side experience gather and at the weight-
  sync barrier leaves the GPU idle; waiting inside an NCCL collective (pipeline bubbles,
  the gradient all-reduce) runs a spinning kernel, which NVML's duty cycle counts as busy
  while tensor activity and power stay near idle. Duty cycle therefore does not simply
  track work.
* **Sensors with their own behaviour.** Power is a first-order low-pass (1-2 s) of the
  activity above an idle floor; duty cycle is the fraction of the last second with any
  kernel resident; NVLink, network and PFC values are per-second counter rates; PFC pause
  frames come in heavy-tailed bursts whose rate rises with network load; CPU utilisation
  follows host work (reward computation, dataloader, checkpoint serialisation).
* **Heterogeneity.** Two hardware groups (racks with different power caps and NVLink
  generations), per-machine gains and offsets, and samplers that read at their own
  sub-second phase with 0-2 s of clock skew, so machines see different slices of a step.
* **Harmless oddities, never labelled.** Job-wide checkpoint pauses and load changes,
  per-machine transient slowdowns (GC, page-cache flushes; seconds to a minute), short
  single-machine sensor spikes, dropped samples and NaNs, collector restarts (30-90 s
  gaps), collectors that start late or stop early.
* **Faults act on the physics** (a slower link, a slower or stopped machine) and the
  coupling decides what every machine's sensors show; see `COUPLED_FAULT_KINDS`.

Step metrics (`step_metrics`): each rank reports its own times of the last finished step.
`rollout_time` is the rank's own generation plus reward computation, which ends before
any collective, so it differs by rank (a slow rank's is longer). `train_time` runs from
the rank's rollout end to the end of the gradient all-reduce: it absorbs the wait for the
slowest rollout, so a fast rank's is *longer* and `rollout_time + train_time` is the same
on every rank. `sync_time` (weight sync, started together after the all-reduce, ended by
a barrier) and `step_time` are equal on every rank up to timer noise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron_rl.monitor.trace import STEP_METRICS, metric_order
from megatron_rl.monitor.windows import Grid

from .synth import FaultLabel, SynthTrace

COUPLED_FAULT_KINDS = (
    "link_half",
    "nic_degraded",
    "gpu_flapping",
    "hang",
    "pfc_storm",
    "cpu_saturation",
    "thermal_decay",
    "straggler_slow",
)

SENSOR_METRICS = (
    "pfc_tx_packets",
    "cpu_util",
    "gpu_duty_cycle",
    "gpu_power",
    "gpu_tensor_activity",
    "nvlink_bandwidth",
    "net_rx_bytes",
    "net_tx_bytes",
)

# Metrics each fault moves on its own machine (the label's `metrics`).
FAULT_METRICS = {
    "link_half": ("nvlink_bandwidth",),
    "nic_degraded": ("net_rx_bytes", "net_tx_bytes"),
    "gpu_flapping": ("gpu_duty_cycle", "gpu_power", "gpu_tensor_activity", "nvlink_bandwidth"),
    "hang": (
        "cpu_util",
        "gpu_duty_cycle",
        "gpu_power",
        "gpu_tensor_activity",
        "nvlink_bandwidth",
        "net_rx_bytes",
        "net_tx_bytes",
    ),
    "pfc_storm": ("pfc_tx_packets", "net_rx_bytes"),
    "cpu_saturation": ("cpu_util",),
    "thermal_decay": ("gpu_power", "gpu_tensor_activity", "gpu_duty_cycle", "rollout_time"),
    "straggler_slow": ("gpu_duty_cycle", "gpu_power", "gpu_tensor_activity", "rollout_time", "train_time"),
}

TICK_S = 0.1
"""Resolution of the simulated activity; sensors average it over their 1 s sample."""
WARMUP_S = 40.0
"""The job runs this long before the trace starts, so the trace does not open on step 0."""
CHUNK_MACHINES = 128
"""Machines rendered at once: bounds memory at 1024 machines and fixes the noise streams."""

# Fixed per-step work at full speed (s). They come from the model size, not the step
# length: an 8-GPU machine moving its parameter shards over NVLink (~1 s each way), the
# data-parallel gradient all-reduce at line rate of 8x400 Gb/s (~1.4 s: tens of GB of
# gradients per pipeline stage), the weight broadcast to the inference engine (~0.8 s),
# rewards on the CPU (~0.2 s) and a host-side gather of the experience (0.1 s). Transfers
# of a second or more are what lets a per-second counter rate see a slower link at all.
NV_GATHER_S, NV_SCATTER_S, ALLREDUCE_S, WEIGHT_SYNC_S, REWARD_S, GATHER_S = 1.0, 1.0, 1.4, 0.8, 0.2, 0.1
FIXED_S = NV_GATHER_S + NV_SCATTER_S + ALLREDUCE_S + WEIGHT_SYNC_S + REWARD_S + GATHER_S
BUBBLE_S = 0.15
"""Pipeline fill per stage: stage s starts training s bubbles after stage 0."""
ROLLOUT_SHARE = 0.66
"""Share of the step's compute time spent decoding (RL steps are generation-heavy)."""

# The step's sections, in order; each machine has one segment of each per step.
SEGMENTS = (
    "decode",
    "reward",
    "host_wait",
    "pipe_lead",
    "nv_gather",
    "compute",
    "nv_scatter",
    "grad_wait",
    "allreduce",
    "ar_wait",
    "weight_sync",
    "sync_wait",
    "checkpoint",
)
SEG = {name: i for i, name in enumerate(SEGMENTS)}
N_SEG = len(SEGMENTS)

# Per segment: fraction of time with a kernel resident, tensor-pipe load (0..1), host CPU %.
# Waits inside NCCL collectives (pipe_lead, grad_wait, ar_wait) spin a kernel: busy, cool.
KERNEL = np.array([0.88, 0.05, 0.0, 1.0, 1.0, 0.97, 1.0, 1.0, 1.0, 1.0, 0.6, 0.0, 0.1], np.float32)
MATH = np.array([0.0, 0.0, 0.0, 0.02, 0.08, 0.86, 0.1, 0.02, 0.05, 0.02, 0.05, 0.0, 0.0], np.float32)
CPU = np.array([30, 55, 8, 12, 12, 22, 12, 10, 10, 10, 15, 8, 40], np.float32)
# NVLink: fraction of the machine's peak (transfer segments are scaled by its link factor).
NVLINK = np.array([0.05, 0, 0, 0, 1.0, 0.06, 1.0, 0, 0, 0, 0.15, 0, 0], np.float32)
NVLINK_TRANSFER = np.array([s in ("nv_gather", "nv_scatter") for s in SEGMENTS])
# Network bytes/s at full NIC speed (transfer segments are scaled by the NIC factor).
NET_PEAK = 3.0e11
"""8 x 400 Gb/s NICs at ~75 % efficiency, per direction."""
NET_TX = np.array([3e8, 2e8, 0, 0, 0, 2e9, 0, 0, NET_PEAK, 0, 1e10, 0, 4e9], np.float32)
NET_RX = np.array([3e8, 2e8, 0, 0, 0, 2e9, 0, 0, NET_PEAK, 0, 1e11, 0, 2e8], np.float32)
NET_TRANSFER = np.array([s in ("allreduce", "weight_sync") for s in SEGMENTS])


@dataclass(frozen=True)
class CoupledConfig:
    """One coupled trace: cluster size, length, seed, and at most one faulty machine."""

    machines: int = 32
    """Machines in the job, 3..1024; one machine is one pipeline-stage replica."""
    duration_s: int = 900
    """Trace length in seconds (300..86400); faults start in 2/15..7/15 of it."""
    seed: int = 0
    """Everything random derives from it; the fault draws from its own stream, so the
    same seed with and without a fault shares the job, the machines and the distractors."""
    fault: str | None = None
    """None (fault-free) or one of COUPLED_FAULT_KINDS."""
    step_metrics: bool = False
    """Add STEP_METRICS (always on for `straggler_slow`)."""
    step_period_s: tuple[float, float] = (6.0, 12.0)
    """Range of the job's nominal step length (s); each step varies around it."""
    distractors: bool = True
    """Harmless oddities (see the module docstring); off only to isolate physics in tests."""

    def __post_init__(self) -> None:
        if not isinstance(self.machines, (int, np.integer)) or not 3 <= self.machines <= 1024:
            raise ValueError(f"machines: {self.machines!r}; allowed: an integer from 3 to 1024")
        if not isinstance(self.duration_s, (int, np.integer)) or not 300 <= self.duration_s <= 86_400:
            raise ValueError(f"duration_s: {self.duration_s!r}; allowed: an integer from 300 to 86400")
        if self.fault is not None and self.fault not in COUPLED_FAULT_KINDS:
            raise ValueError(f"fault: {self.fault!r}; allowed: None or one of {', '.join(COUPLED_FAULT_KINDS)}")
        p = tuple(self.step_period_s)
        if len(p) != 2 or not 5.5 <= p[0] <= p[1] <= 600.0:
            raise ValueError(
                f"step_period_s: {self.step_period_s!r}; allowed: (low, high) with 5.5 <= low "
                f"<= high <= 600 (a step needs compute beyond its fixed {FIXED_S:.1f} s of transfers)"
            )

    @property
    def with_step_metrics(self) -> bool:
        """A straggler is what step metrics exist to show, so its traces always carry them."""
        return self.step_metrics or self.fault == "straggler_slow"


@dataclass
class Machines:
    """Fixed per-machine traits (hardware group, sensors, pipeline stage)."""

    idle_w: np.ndarray
    peak_w: np.ndarray
    power_gain: np.ndarray
    power_tau_s: np.ndarray
    nvlink_peak: np.ndarray
    cpu_base: np.ndarray
    sample_offset_s: np.ndarray
    """Sub-second sampling phase (0-1 s) plus clock skew (0-2 s)."""
    stage: np.ndarray
    stages: int


def draw_machines(n: int, rng: np.random.Generator) -> Machines:
    """Two racks: group A (power cap 700 W, idle ~70 W, newer NVLink, 1.8 TB/s summed) and
    group B (cap 620 W, idle ~90 W with warmer inlet air, 1.5 TB/s). A group is a
    contiguous block of machines, as racks are."""
    in_a = np.arange(n) < int(round(n * rng.uniform(0.4, 0.7)))
    idle = np.where(in_a, 70.0, 90.0) + rng.normal(0, 4, n)
    peak = np.where(in_a, 690.0, 610.0) + rng.normal(0, 8, n)
    stages = int(min(8, max(2, 2 ** round(np.log2(max(n, 4) / 4)))))
    return Machines(
        idle_w=idle,
        peak_w=peak,
        power_gain=rng.normal(1.0, 0.025, n),
        power_tau_s=rng.uniform(1.0, 2.0, n),
        nvlink_peak=np.where(in_a, 1.8e12, 1.5e12) * rng.normal(1, 0.01, n),
        cpu_base=rng.uniform(2.0, 6.0, n),
        sample_offset_s=rng.uniform(0, 1, n) + rng.uniform(0, 2, n),
        stage=np.arange(n) % stages,
        stages=stages,
    )


@dataclass
class Fault:
    """The faulty machine, when the fault starts, and what it does to that machine."""

    kind: str
    machine: int
    start: float
    end: float
    strength: float
    """link/NIC factor, speed factor, or thermal depth, depending on `kind`."""
    off_windows: list[tuple[float, float]] = field(default_factory=list)
    """gpu_flapping: the (start, end) seconds the GPU is gone."""


def draw_fault(cfg: CoupledConfig, rng: np.random.Generator) -> Fault | None:
    """Where, when and how strong. Strengths: link and NIC at 40-60 % of peers, a
    straggler at 0.75-0.85x, thermal throttling to 0.62-0.75x with a 2-5 minute time
    constant. CPU saturation and the PFC storm have fixed effects (`Factors.of`,
    `apply_fault_activity`, `sample_chunk`); a flapping GPU is gone 16-24 s, back 16-24 s."""
    if cfg.fault is None:
        return None
    d = cfg.duration_s
    machine = int(rng.integers(cfg.machines))
    start = float(rng.uniform(d * 2 / 15, d * 7 / 15))
    strength = {
        "link_half": rng.uniform(0.4, 0.6),
        "nic_degraded": rng.uniform(0.4, 0.6),
        "straggler_slow": rng.uniform(0.75, 0.85),
        "thermal_decay": rng.uniform(0.25, 0.38),
    }.get(cfg.fault, 1.0)
    fault = Fault(cfg.fault, machine, start, float(d), float(strength))
    if cfg.fault == "gpu_flapping":
        t = start
        while t < d:
            off = rng.uniform(16, 24)
            fault.off_windows.append((t, min(t + off, d)))
            t += off + rng.uniform(16, 24)
    return fault


@dataclass
class Timeline:
    """The simulated time axis: ticks of TICK_S from -WARMUP_S to a little past the end."""

    origin: float
    ticks: int

    @property
    def end(self) -> float:
        return self.origin + self.ticks * TICK_S

    def times(self) -> np.ndarray:
        return self.origin + (np.arange(self.ticks) + 0.5) * TICK_S


def compute_speed(cfg: CoupledConfig, tl: Timeline, fault: Fault | None, rng: np.random.Generator) -> np.ndarray:
    """Per machine and tick, the rate of compute progress (1 = nominal). Transient slowdowns
    (GC, page-cache flush: about one per machine per 30 min, 2-60 s, to 0.55-0.9x) are
    distractors; faults slow, throttle or stop the machine."""
    speed = np.ones((cfg.machines, tl.ticks), np.float32)
    t = tl.times()
    if cfg.distractors:
        for m in range(cfg.machines):
            for _ in range(rng.poisson(cfg.duration_s / 1800)):
                a = rng.uniform(-WARMUP_S, cfg.duration_s)
                length = float(np.exp(rng.uniform(np.log(2), np.log(60))))
                speed[m, (t >= a) & (t < a + length)] *= rng.uniform(0.55, 0.9)
    if fault is None:
        return speed
    row, after = speed[fault.machine], t >= fault.start
    if fault.kind == "straggler_slow":
        row[after] *= fault.strength
    elif fault.kind == "thermal_decay":
        row[after] *= thermal_factor(t[after] - fault.start, fault.strength)
    elif fault.kind == "hang":
        row[after] = 0.0
    elif fault.kind == "gpu_flapping":
        for a, b in fault.off_windows:
            row[(t >= a) & (t < b)] = 0.0
    return speed


def thermal_factor(since_s: np.ndarray, depth: float) -> np.ndarray:
    """Clock (and so speed) of a throttling GPU: falls by `depth` with a 200 s time constant."""
    return 1.0 - depth * (1.0 - np.exp(-np.asarray(since_s) / 200.0))


@dataclass
class Progress:
    """Cumulative compute progress per machine, searchable for when work finishes."""

    cum: np.ndarray  # float64 [machines, ticks + 1]
    origin: float

    @classmethod
    def of(cls, speed: np.ndarray, origin: float) -> "Progress":
        cum = np.zeros((speed.shape[0], speed.shape[1] + 1))
        np.cumsum(speed * TICK_S, axis=1, out=cum[:, 1:])
        return cls(cum, origin)

    def finish(self, start: np.ndarray, work: np.ndarray) -> np.ndarray:
        """When each machine, starting at `start`, has done `work` seconds of nominal
        compute; inf if it never does within the timeline (a hung machine)."""
        n, width = self.cum.shape
        big = self.cum[:, -1].max() + float(np.max(work)) + 10.0
        pos = np.clip((np.asarray(start) - self.origin) / TICK_S, 0, width - 1)
        i0 = np.floor(pos).astype(int)
        i1 = np.minimum(i0 + 1, width - 1)
        rows = np.arange(n)
        c0 = self.cum[rows, i0] + (pos - i0) * (self.cum[rows, i1] - self.cum[rows, i0])
        offset = rows * big
        idx = np.searchsorted((self.cum + offset[:, None]).ravel(), c0 + work + offset) - rows * width
        done = (idx < width) & np.isfinite(start)
        idx = np.clip(idx, 1, width - 1)
        prev, nxt = self.cum[rows, idx - 1], self.cum[rows, idx]
        frac = np.clip((c0 + work - prev) / np.maximum(nxt - prev, 1e-12), 0, 1)
        return np.where(done, self.origin + (idx - 1 + frac) * TICK_S, np.inf)


@dataclass
class Job:
    """Job-level draws, one per possible step, made up front so that a fault (which
    changes how many steps fit) does not shift the other steps' draws."""

    period_s: float
    step_scale: np.ndarray  # [steps] response-length factor of the step
    train_scale: np.ndarray  # [steps]
    rank_length: np.ndarray  # [steps, machines] this rank's share of the responses
    load_times: np.ndarray  # job-wide load changes: when ...
    load_factors: np.ndarray  # ... and the cumulative factor from then on
    checkpoints: np.ndarray  # [k, 2] (time, pause length)

    def load(self, t: float) -> float:
        i = np.searchsorted(self.load_times, t, side="right")
        return float(self.load_factors[i - 1]) if i else 1.0


def draw_job(cfg: CoupledConfig, rng: np.random.Generator) -> Job:
    """Step length nominal in `step_period_s`; steps vary (lognormal, sigma 0.18) because
    response lengths do, and ranks within a step by sigma 0.08. Checkpoint pauses of
    10-30 s every 4-7 minutes; up to two job-wide load changes of 0.7-1.4x."""
    steps = int((cfg.duration_s + WARMUP_S) / 3.0) + 2
    scale = rng.lognormal(0, 0.18, steps)
    ck_t = np.cumsum(rng.uniform(240, 420, 8 + cfg.duration_s // 240))
    checkpoints = np.stack([ck_t, rng.uniform(10, 30, ck_t.size)], axis=1)
    changes = int(rng.integers(0, 3)) if cfg.distractors else 0
    load_t = np.sort(rng.uniform(60, cfg.duration_s - 60, changes))
    return Job(
        period_s=float(rng.uniform(*cfg.step_period_s)),
        step_scale=scale,
        train_scale=scale**0.7 * rng.lognormal(0, 0.05, steps),
        rank_length=rng.lognormal(0, 0.08, (steps, cfg.machines)),
        load_times=load_t,
        load_factors=np.cumprod(rng.uniform(0.7, 1.4, changes)),
        checkpoints=checkpoints if cfg.distractors else np.zeros((0, 2)),
    )


@dataclass
class Factors:
    """Per-machine multipliers the faults set: link and NIC speed, decode and reward speed."""

    link: np.ndarray
    nic: np.ndarray
    decode: np.ndarray
    reward: np.ndarray

    @classmethod
    def of(cls, n: int, fault: Fault | None) -> "Factors":
        f = cls(np.ones(n), np.ones(n), np.ones(n), np.ones(n))
        if fault is not None:
            m = fault.machine
            if fault.kind == "link_half":
                f.link[m] = fault.strength
            elif fault.kind == "nic_degraded":
                f.nic[m] = fault.strength
            elif fault.kind == "pfc_storm":
                f.nic[m] = 0.75  # its pause frames throttle the flows into it
            elif fault.kind == "cpu_saturation":
                f.decode[m], f.reward[m] = 0.85, 0.4  # kernel launches and rewards wait for a core
        return f

    def at(self, t: float, fault: Fault | None) -> "Factors":
        """The factors in force at time t (faults act from their start)."""
        if fault is None or t >= fault.start:
            return self
        return Factors.of(len(self.link), None)


@dataclass
class Schedule:
    """Segment boundaries per machine and the per-rank section times of finished steps."""

    bounds: np.ndarray  # [machines, steps * N_SEG], segment start times (may be inf)
    step_end: np.ndarray  # [steps] the job's step end (inf: never ended)
    rollout: np.ndarray  # [steps, machines]
    train: np.ndarray
    sync: np.ndarray
    step: np.ndarray


def simulate_steps(
    cfg: CoupledConfig, tl: Timeline, mach: Machines, job: Job, prog: Progress, base: Factors, fault: Fault | None
) -> Schedule:
    """Run the synchronous step loop until the timeline ends or the job stalls."""
    compute_s = job.period_s - FIXED_S
    lead = mach.stage * BUBBLE_S
    tail = (mach.stages - 1 - mach.stage) * BUBBLE_S
    rows, ends, sections = [], [], []
    t, s, ck = tl.origin, 0, 0
    while t < tl.end and s < job.step_scale.size:
        f = base.at(t, fault)
        load = job.load(t)
        decode_work = compute_s * ROLLOUT_SHARE * job.step_scale[s] * load * job.rank_length[s] / f.decode
        dec_end = prog.finish(np.full(cfg.machines, t), decode_work)
        reward_end = dec_end + REWARD_S / f.reward
        g = reward_end.max() + GATHER_S
        gather_end = g + lead + NV_GATHER_S / f.link
        comp_end = prog.finish(
            gather_end, np.full(cfg.machines, compute_s * (1 - ROLLOUT_SHARE) * job.train_scale[s] * load)
        )
        scatter_end = comp_end + NV_SCATTER_S / f.link
        a = (scatter_end + tail).max()
        ar_end = a + ALLREDUCE_S / f.nic
        ar = ar_end.max()
        ws_end = ar + WEIGHT_SYNC_S / f.nic
        step_end = ws_end.max()
        pause = 0.0
        if ck < len(job.checkpoints) and step_end >= job.checkpoints[ck, 0]:
            pause, ck = float(job.checkpoints[ck, 1]), ck + 1
        one = np.ones(cfg.machines)
        rows.append(
            np.stack(
                [
                    one * t,
                    dec_end,
                    reward_end,
                    one * g,
                    g + lead,
                    gather_end,
                    comp_end,
                    scatter_end,
                    one * a,
                    ar_end,
                    one * ar,
                    ws_end,
                    one * step_end,
                ],
                axis=1,
            )
        )
        ends.append(step_end)
        with np.errstate(invalid="ignore"):  # a stalled step's inf - inf: NaN, never reported
            sections.append((reward_end - t, ar - reward_end, one * (step_end - ar), one * (step_end - t)))
        t, s = step_end + pause, s + 1
    sec = [np.array([x[k] for x in sections]) for k in range(4)]
    return Schedule(np.concatenate(rows, axis=1), np.array(ends), *sec)


@dataclass
class Activity:
    """What a chunk of machines is doing at each tick: the sensors' ground truth."""

    kernel: np.ndarray  # fraction of the tick with a kernel resident
    math: np.ndarray  # tensor-pipe load 0..1
    cpu: np.ndarray  # host CPU %
    nvlink: np.ndarray  # bytes/s
    net_tx: np.ndarray
    net_rx: np.ndarray
    power_floor: np.ndarray | None = None  # W; overrides the power model where finite


def segment_at_ticks(bounds: np.ndarray, tl: Timeline) -> tuple[np.ndarray, np.ndarray]:
    """Index of the segment each machine is in at each tick, and the position (0..1) within
    it. One searchsorted over all machines: rows are offset so that they stay sorted."""
    n, width = bounds.shape
    b = np.clip(bounds, tl.origin, tl.end + 1.0)
    big = tl.end - tl.origin + 10.0
    offset = np.arange(n)[:, None] * big
    flat = (b - tl.origin + offset).ravel()
    q = (tl.times()[None] - tl.origin + offset).ravel()
    idx = np.searchsorted(flat, q, side="right") - 1
    idx = np.clip(idx - np.repeat(np.arange(n) * width, tl.ticks), 0, width - 1).reshape(n, tl.ticks)
    start = np.take_along_axis(b, idx, 1)
    stop = np.take_along_axis(np.concatenate([b, np.full((n, 1), tl.end + 1.0)], 1), idx + 1, 1)
    pos = np.clip((tl.times()[None] - start) / np.maximum(stop - start, 1e-6), 0, 1)
    return idx % N_SEG, pos.astype(np.float32)


def render_activity(
    kind: np.ndarray,
    pos: np.ndarray,
    nvlink_peak: np.ndarray,
    link: np.ndarray,
    nic: np.ndarray,
    rng: np.random.Generator,
) -> Activity:
    """Per-tick activity from the segment kinds. Decode is memory-bound with a draining
    batch: tensor load falls from ~0.55 to ~0.15 across it, with large tick-to-tick
    variance (sequences finish, KV-cache reads vary); training compute is steady."""
    shape = kind.shape
    math = MATH[kind].copy()
    decode = kind == SEG["decode"]
    math[decode] = 0.55 - 0.4 * pos[decode]
    math += rng.normal(0, 1, shape).astype(np.float32) * np.where(decode, 0.12, 0.03).astype(np.float32)
    nvl = NVLINK[kind] * nvlink_peak[:, None].astype(np.float32)
    nvl = np.where(NVLINK_TRANSFER[kind], nvl * link, nvl)
    nic = np.where(NET_TRANSFER[kind], nic, np.float32(1))
    return Activity(
        kernel=KERNEL[kind].copy(),
        math=np.clip(math, 0, 1),
        cpu=CPU[kind].copy(),
        nvlink=nvl,
        net_tx=NET_TX[kind] * nic,
        net_rx=NET_RX[kind] * nic,
    )


def apply_fault_activity(act: Activity, t: np.ndarray, row: int, mach: Machines, m: int, fault: Fault) -> None:
    """What the faulty machine's own sensors see beyond its changed schedule.

    hang: a kernel wedges (NVML reports the GPU busy at a flat ~25 % of the dynamic power
    range, no tensor work), traffic stops, one host thread spins (~1 % of 96 cores).
    gpu_flapping: while gone the GPU runs nothing and reads ~8 W. thermal_decay: lower
    clocks and voltage cut dynamic power with the square of the clock, and the GPM tensor
    utilisation (relative to the boost clock) with the clock. cpu_saturation: a runaway
    host process holds the cores at ~96 %."""
    after = t >= fault.start
    if fault.kind == "hang":
        act.kernel[row, after], act.math[row, after], act.cpu[row, after] = 1.0, 0.0, 1.0
        act.nvlink[row, after] = act.net_tx[row, after] = act.net_rx[row, after] = 0.0
        act.power_floor = np.full(act.kernel.shape, np.nan, np.float32)
        act.power_floor[row, after] = mach.idle_w[m] + 0.25 * (mach.peak_w[m] - mach.idle_w[m])
    elif fault.kind == "gpu_flapping":
        act.power_floor = np.full(act.kernel.shape, np.nan, np.float32)
        for a, b in fault.off_windows:
            off = (t >= a) & (t < b)
            act.kernel[row, off] = act.math[row, off] = act.nvlink[row, off] = 0.0
            act.power_floor[row, off] = 8.0
    elif fault.kind == "thermal_decay":
        clock = thermal_factor(t[after] - fault.start, fault.strength).astype(np.float32)
        act.math[row, after] *= clock
        act.power_floor = np.full(act.kernel.shape, np.nan, np.float32)
        dyn = (mach.peak_w[m] - mach.idle_w[m]) * (0.12 * act.kernel[row, after] + 0.88 * act.math[row, after])
        act.power_floor[row, after] = mach.idle_w[m] + dyn * clock  # math already carries one factor
    elif fault.kind == "cpu_saturation":
        act.cpu[row, after] = 96.0


def power_trace(act: Activity, mach: Machines, sl: slice) -> np.ndarray:
    """GPU power per tick: idle floor plus the dynamic range times a mix of kernel residency
    (12 %) and tensor load (88 %), low-passed with each machine's 1-2 s sensor lag."""
    idle, peak = mach.idle_w[sl, None], mach.peak_w[sl, None]
    target = (idle + (peak - idle) * (0.12 * act.kernel + 0.88 * act.math)) * mach.power_gain[sl, None]
    if act.power_floor is not None:
        target = np.where(np.isnan(act.power_floor), target, act.power_floor)
    alpha = (1.0 - np.exp(-TICK_S / mach.power_tau_s[sl])).astype(np.float32)
    out = np.empty_like(target, dtype=np.float32)
    y = target[:, 0].astype(np.float32)
    for i in range(target.shape[1]):
        y = y + alpha * (target[:, i] - y)
        out[:, i] = y
    return out


def pfc_ticks(act: Activity, rng: np.random.Generator) -> np.ndarray:
    """Pause frames per tick: bursts arrive more often under network load (incast during
    the all-reduce), and their sizes are Pareto (alpha 1.4): mostly zero, sometimes
    hundreds, rarely thousands."""
    util = (act.net_tx + act.net_rx) / (2 * NET_PEAK)
    bursts = rng.poisson(0.002 + 0.03 * util)
    sizes = (rng.pareto(1.4, bursts.shape) + 1.0) * 15.0
    return (bursts * sizes).astype(np.float32)


def sample_ticks(cfg: CoupledConfig, tl: Timeline, offsets: np.ndarray) -> np.ndarray:
    """Tick index at which each machine's collector takes its sample stamped second k:
    the true time is k plus the machine's phase and clock skew."""
    true_t = np.arange(cfg.duration_s)[None] + offsets[:, None]
    return np.clip(np.round((true_t - tl.origin) / TICK_S).astype(int), 10, tl.ticks)


def window_mean(x: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Mean of x over the 1 s (10 ticks) ending at each sample tick: what a counter rate,
    NVML's duty cycle or a GPM average reports."""
    cum = np.zeros((x.shape[0], x.shape[1] + 1))
    np.cumsum(x, axis=1, out=cum[:, 1:])
    return ((np.take_along_axis(cum, at, 1) - np.take_along_axis(cum, at - 10, 1)) / 10).astype(np.float32)


def sample_chunk(
    cfg: CoupledConfig,
    tl: Timeline,
    mach: Machines,
    sched: Schedule,
    base: Factors,
    fault: Fault | None,
    sl: slice,
    rng: np.random.Generator,
) -> dict[str, np.ndarray]:
    """Per-second sensor readings [machines in sl, seconds] for one chunk of machines."""
    kind, pos = segment_at_ticks(sched.bounds[sl], tl)
    t = tl.times()
    link, nic = link_and_nic_per_tick(base, sl, fault, t)
    act = render_activity(kind, pos, mach.nvlink_peak[sl], link, nic, rng)
    if fault is not None and sl.start <= fault.machine < sl.stop:
        apply_fault_activity(act, t, fault.machine - sl.start, mach, fault.machine, fault)
    at = sample_ticks(cfg, tl, mach.sample_offset_s[sl])
    n, secs = at.shape
    power = np.take_along_axis(power_trace(act, mach, sl), at - 1, 1)
    out = {
        "gpu_duty_cycle": np.round(100 * window_mean(act.kernel, at)),
        "gpu_tensor_activity": 100 * window_mean(act.math, at) + rng.normal(0, 0.4, (n, secs)),
        "gpu_power": power * rng.normal(1, 0.01, (n, secs)) + rng.normal(0, 2, (n, secs)),
        "nvlink_bandwidth": window_mean(act.nvlink, at) * rng.normal(1, 0.01, (n, secs)),
        "net_tx_bytes": window_mean(act.net_tx, at) + rng.uniform(1e5, 1e6, (n, secs)),
        "net_rx_bytes": window_mean(act.net_rx, at) + rng.uniform(1e5, 1e6, (n, secs)),
        "cpu_util": window_mean(act.cpu, at) + mach.cpu_base[sl, None] + rng.normal(0, 1.5, (n, secs)),
        "pfc_tx_packets": 10 * window_mean(pfc_ticks(act, rng), at),
    }
    if fault is not None and fault.kind == "pfc_storm" and sl.start <= fault.machine < sl.stop:
        storm = np.arange(secs) >= fault.start
        out["pfc_tx_packets"][fault.machine - sl.start, storm] = rng.lognormal(np.log(3e4), 0.8, storm.sum())
    for k in ("gpu_duty_cycle", "gpu_tensor_activity", "cpu_util"):
        out[k] = np.clip(out[k], 0, 100)
    return {k: np.maximum(v, 0).astype(np.float32) for k, v in out.items()}


def link_and_nic_per_tick(
    base: Factors, sl: slice, fault: Fault | None, t: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The chunk's link and NIC factors per tick: nominal until the fault starts (the
    schedule used nominal transfer times before it too)."""
    link = np.ones((sl.stop - sl.start, t.size), np.float32)
    nic = np.ones_like(link)
    if fault is not None and sl.start <= fault.machine < sl.stop:
        after = t >= fault.start
        link[fault.machine - sl.start, after] = base.link[fault.machine]
        nic[fault.machine - sl.start, after] = base.nic[fault.machine]
    return link, nic


def step_metric_values(
    cfg: CoupledConfig, sched: Schedule, mach: Machines, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Per-second step metrics [machines, seconds]: at each sample, the section times of the
    last step that had ended by then on the machine's clock (NaN before the first), with
    ~3 ms of timer noise per rank. A stalled job keeps repeating its last finished step."""
    finished = np.isfinite(sched.step_end)
    ends = sched.step_end[finished]
    sample_t = np.arange(cfg.duration_s)[None] + mach.sample_offset_s[:, None]
    last = np.searchsorted(ends, sample_t, side="right") - 1  # [machines, seconds]
    out = {}
    for name, table in (
        ("rollout_time", sched.rollout),
        ("train_time", sched.train),
        ("sync_time", sched.sync),
        ("step_time", sched.step),
    ):
        vals = table[finished] + rng.normal(0, 0.003, table[finished].shape)  # [steps, machines]
        if vals.size == 0:
            out[name] = np.full(last.shape, np.nan, np.float32)
            continue
        got = np.take_along_axis(vals.T, np.maximum(last, 0), 1)
        out[name] = np.where(last >= 0, got, np.nan).astype(np.float32)
    return out


def add_collection_noise(values: np.ndarray, metrics: list[str], cfg: CoupledConfig, rng: np.random.Generator) -> None:
    """Harmless collection defects, in place on [metric, machine, second]: short sensor
    spikes (about one per machine per 10 min, 1-3 s, 1.5-3x), dropped samples (0.3 % of
    machine-seconds) and single NaNs (0.1 %), collector restarts (30-90 s gaps; counters
    need one more sample to give a rate), and collectors that start late or stop early."""
    k, n, d = values.shape
    sensors = [metrics.index(m) for m in SENSOR_METRICS]
    for m in range(n):
        for _ in range(rng.poisson(d / 600)):
            j, a = sensors[rng.integers(len(sensors))], int(rng.integers(d))
            values[j, m, a : a + int(rng.integers(1, 4))] *= rng.uniform(1.5, 3.0)
    for j in ("gpu_duty_cycle", "gpu_tensor_activity", "cpu_util"):
        np.clip(values[metrics.index(j)], 0, 100, out=values[metrics.index(j)])
    values[:, rng.random((n, d)) < 0.003] = np.nan
    values[rng.random(values.shape) < 0.001] = np.nan
    counters = [metrics.index(m) for m in ("nvlink_bandwidth", "net_rx_bytes", "net_tx_bytes", "pfc_tx_packets")]
    for _ in range(min(n // 4, rng.poisson(0.4 + n / 64))):
        m, a = int(rng.integers(n)), int(rng.uniform(60, d - 120))
        b = a + int(rng.uniform(30, 90))
        values[:, m, a:b] = np.nan
        values[counters, m, b] = np.nan
    if rng.random() < 0.25:
        values[:, int(rng.integers(n)), : int(rng.uniform(10, 60))] = np.nan
    if rng.random() < 0.25:
        values[:, int(rng.integers(n)), d - int(rng.uniform(10, 60)) :] = np.nan


def generate_coupled(cfg: CoupledConfig) -> SynthTrace:
    """A 1 Hz trace of the simulated job and the label of its fault (if any)."""
    streams = [np.random.default_rng(s) for s in np.random.SeedSequence([cfg.seed, 0xC0B1ED]).spawn(6)]
    machines_rng, job_rng, distractor_rng, _, step_rng, noise_rng = streams
    # Each kind draws its machine, start and strength from its own stream, so one seed's
    # faults of different kinds do not all hit the same machine at the same second.
    kind_index = COUPLED_FAULT_KINDS.index(cfg.fault) + 1 if cfg.fault else 0
    fault_rng = np.random.default_rng([cfg.seed, 0xC0B1ED, 0xFA, kind_index])
    tl = Timeline(origin=-WARMUP_S, ticks=int(round((cfg.duration_s + WARMUP_S + 4.0) / TICK_S)))
    mach = draw_machines(cfg.machines, machines_rng)
    job = draw_job(cfg, job_rng)
    fault = draw_fault(cfg, fault_rng)
    speed = compute_speed(cfg, tl, fault, distractor_rng)
    base = Factors.of(cfg.machines, fault)
    sched = simulate_steps(cfg, tl, mach, job, Progress.of(speed, tl.origin), base, fault)
    names = list(SENSOR_METRICS) + (list(STEP_METRICS) if cfg.with_step_metrics else [])
    metrics = metric_order(names)
    values = np.empty((len(metrics), cfg.machines, cfg.duration_s), np.float32)
    for c, lo in enumerate(range(0, cfg.machines, CHUNK_MACHINES)):
        sl = slice(lo, min(lo + CHUNK_MACHINES, cfg.machines))
        chunk_rng = np.random.default_rng([cfg.seed, 0xC0B1ED, c])
        for name, v in sample_chunk(cfg, tl, mach, sched, base, fault, sl, chunk_rng).items():
            values[metrics.index(name), sl] = v
    if cfg.with_step_metrics:
        for name, v in step_metric_values(cfg, sched, mach, step_rng).items():
            values[metrics.index(name)] = v
    if cfg.distractors:
        add_collection_noise(values, metrics, cfg, noise_rng)
    names_of = [f"node{m:04d}" for m in range(cfg.machines)]
    grid = Grid(values, metrics, names_of, start=0.0)
    labels = []
    if fault is not None:
        moved = tuple(m for m in FAULT_METRICS[fault.kind] if m in metrics)
        labels.append(FaultLabel(names_of[fault.machine], fault.kind, fault.start, fault.end, moved))
    stragglers = [names_of[fault.machine]] if fault is not None and fault.kind == "straggler_slow" else []
    return SynthTrace(grid, labels, cfg, stragglers)
