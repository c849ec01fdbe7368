"""Synthetic step and section times per machine (`synth` with `SynthConfig(step_metrics=True)`,
and always for the `straggler` fault kind).

What the trainer records (`OnlineMonitor.on_step(step_s, sections)`) and the collector
repeats at every sample until the next step ends: each machine's time for the last
finished step and for its rollout, train and weight-sync sections. Modelled here as the
machine's own work: the job's step length (shared, varying from step to step as response
lengths do) times the section's share, times per-machine noise, times how slow the
machine ran during that step (transient and persistent stragglers that are not faults,
and the `straggler` fault). Not modelled: in synchronous training a section that ends in
a collective takes every rank as long as the slowest one (the `coupled` generator models
that).
"""

from __future__ import annotations

import numpy as np

from megatron_rl.monitor.trace import STEP_METRICS

SECTIONS = STEP_METRICS[1:]  # rollout_time, train_time, sync_time
SHARE = {"rollout_time": 0.5, "train_time": 0.4, "sync_time": 0.1}
"""Share of a step each section takes on a healthy machine."""
NOISE = {"rollout_time": 0.05, "train_time": 0.02, "sync_time": 0.03}
"""Per-machine, per-step log-normal noise of each section (rollout varies most: each
rank generates its own responses)."""


def straggler_fault(rng) -> tuple[float, tuple[str, ...]]:
    """(slowdown 1.1-1.5x, sections it slows): half the time the whole machine, else one
    section (a slow NIC slows only the weight sync, a slow host only the rollout)."""
    factor = float(rng.uniform(1.1, 1.5))
    if rng.random() < 0.5:
        return factor, SECTIONS
    return factor, (SECTIONS[int(rng.integers(len(SECTIONS)))],)


def step_metrics(
    rng,
    period: float,
    speed: np.ndarray,
    t: np.ndarray,
    away: np.ndarray,
    fault: tuple[int, np.ndarray, float, tuple[str, ...]] | None = None,
    drop_frac: float = 0.0,
) -> dict[str, np.ndarray]:
    """{metric: [machines, T]} step and section times, forward-filled per second.

    speed: [machines, T] relative speed (1 normal); away: [machines, T] True where the
    machine reports nothing; fault: (machine, strength [T], slowdown, sections) or None.
    """
    n = speed.shape[0]
    lengths = period * np.exp(rng.normal(0, 0.1, int(1.5 * t[-1] / period) + 4))  # job-wide, step to step
    ends = rng.uniform(0, period) + np.cumsum(lengths)
    step_of = np.searchsorted(ends, t, side="right")  # step in progress at each second
    n_steps = int(np.searchsorted(ends, t[-1], side="right"))
    slow = np.stack(
        [
            np.bincount(step_of, weights=1 / speed[i], minlength=ends.size)
            / np.maximum(np.bincount(step_of, minlength=ends.size), 1)
            for i in range(n)
        ]
    )
    times = {}
    for name in SECTIONS:
        x = SHARE[name] * lengths[None] * slow * np.exp(rng.normal(0, NOISE[name], (n, ends.size)))
        if fault is not None and name in fault[3]:
            i, strength, factor = fault[0], fault[1], fault[2]
            on = np.bincount(step_of, weights=strength, minlength=ends.size) / np.maximum(
                np.bincount(step_of, minlength=ends.size), 1
            )
            x[i] *= 1 + (factor - 1) * on
        times[name] = x
    times = {"step_time": sum(times.values()), **times}
    lag = rng.uniform(0, 1, (n, 1))  # each sampler sees a finished step up to 1 s later
    last = np.stack([np.searchsorted(ends[:n_steps], t - lag[i, 0], side="right") - 1 for i in range(n)])
    out = {}
    for name in STEP_METRICS:
        v = np.take_along_axis(times[name], np.maximum(last, 0), 1).astype(np.float32)
        v[(last < 0) | away | (rng.random(v.shape) < drop_frac)] = np.nan
        out[name] = v
    return out
