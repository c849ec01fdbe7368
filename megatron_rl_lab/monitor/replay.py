"""Drive the online monitor from a recorded grid, as the trainer drives it in a job.

`OnlineMonitor` only sees what its collector hands over at each detection and what the
trainer reports per step. Replaying a trace through the real monitor (rather than one
offline `detect` over the whole trace) measures what a job would get: detection every
`detect_every_steps` steps, each over the monitor's own history, machines declared once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from megatron_rl.monitor.config import OnlineConfig
from megatron_rl.monitor.denoise import Denoiser
from megatron_rl.monitor.detect import Alert
from megatron_rl.monitor.online import OnlineMonitor
from megatron_rl.monitor.windows import Grid


class GridFeed:
    """A collector stand-in: each `drain` hands out the next `per_drain` seconds of a grid
    as trace rows (time, machine, metric, value); NaN samples are left out, as a sampler
    that missed them would."""

    def __init__(self, grid: Grid, per_drain: int):
        self.grid, self.per_drain, self.t = grid, max(1, int(per_drain)), 0

    @property
    def done(self) -> bool:
        return self.t >= self.grid.values.shape[-1]

    @property
    def now(self) -> float:
        """Trace time of the last sample handed out."""
        return self.grid.start + min(self.t, self.grid.values.shape[-1]) * self.grid.step_s

    def drain(self) -> list[tuple[float, str, str, float]]:
        g, stop = self.grid, min(self.t + self.per_drain, self.grid.values.shape[-1])
        k, i, t = np.nonzero(~np.isnan(g.values[..., self.t : stop]))
        rows = [
            (g.start + (self.t + tt) * g.step_s, g.machines[ii], g.metrics[kk], float(g.values[kk, ii, self.t + tt]))
            for kk, ii, tt in zip(k.tolist(), i.tolist(), t.tolist())
        ]
        self.t = stop
        return rows

    def record_step_time(self, step_time_s, sections=None) -> None:
        """The grid already holds the step metrics it was recorded with."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


@dataclass
class Declared:
    at: float
    """Trace time of the detection that declared it (what a job would act on)."""
    alert: Alert


def replay_online(
    grid: Grid, step_time_s: float, cfg: OnlineConfig, run_dir: str | os.PathLike, denoiser: Denoiser | None = None
) -> list[Declared]:
    """Feed `grid` to an OnlineMonitor as a job with steps of `step_time_s` would (the
    samples of detect_every_steps steps at each detection) and return what it declared;
    alerts and the exclude file go under run_dir."""
    if step_time_s <= 0:
        raise ValueError(f"step_time_s: {step_time_s!r}; allowed: > 0")
    feed = GridFeed(grid, int(round(cfg.detect_every_steps * step_time_s / grid.step_s)))
    mon = OnlineMonitor(cfg, run_dir, collector=feed, denoiser=denoiser)
    out = []
    while not feed.done:
        out += [Declared(feed.now, a) for a in mon.on_step(step_time_s=step_time_s)]
    return out
