"""Normal behaviour that looks odd but must not alarm (used by `synth` with
`SynthConfig(distractors=True)`).

Each function draws from its caller's generator, so traces stay seeded and
deterministic. They model what a real synchronous job does that the original generator
did not: the whole job changes pace (a different sequence length, an evaluation pass),
pipeline stages run the same step at different offsets, and a healthy machine's sensor
misreads for a few seconds.
"""

from __future__ import annotations

import numpy as np


def pipeline_phases(rng, machines: int) -> np.ndarray:
    """[machines] phase offset in steps: machines are split into 2-8 pipeline stages in
    rank order and stage s starts its compute s/stages of a step later."""
    stages = int(rng.integers(2, 9))
    return (np.arange(machines) * stages // machines) / stages


def job_wide_load(rng, act: np.ndarray, comm: np.ndarray, t: np.ndarray) -> None:
    """1-3 job-wide load changes in place: for 30-300 s every machine computes at
    40-90 % (communication rises by the same share), all together."""
    for _ in range(int(rng.integers(1, 4))):
        start, length, level = rng.uniform(0, t[-1]), rng.uniform(30, 300), rng.uniform(0.4, 0.9)
        on = (t >= start) & (t < start + length)
        moved = act[:, on] * (1 - level)
        act[:, on] -= moved
        comm[:, on] += moved


def sensor_spikes(rng, metrics: dict[str, np.ndarray], t: np.ndarray, avoid: set[int]) -> None:
    """Short sensor spikes in place: about one per 4 machine-hours, on healthy machines,
    2-10 s long, the reading multiplied by 0-3 (clipped at 100 for percentages)."""
    names = list(metrics)
    n = next(iter(metrics.values())).shape[0]
    healthy = [i for i in range(n) if i not in avoid]
    for _ in range(int(rng.poisson(n * t.size / 3600 / 4)) + 1):
        name, i = names[rng.integers(len(names))], healthy[rng.integers(len(healthy))]
        start, length = rng.uniform(0, t[-1]), rng.uniform(2, 10)
        on = (t >= start) & (t < start + length)
        v = metrics[name][i]
        v[on] *= rng.uniform(0, 3)
        if name in ("cpu_util", "gpu_duty_cycle", "gpu_graphics_activity", "gpu_tensor_activity"):
            np.clip(v, 0, 100, out=v)
