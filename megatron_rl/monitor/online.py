"""Online mode: sample on every machine, detect on one rank, beside training.

The trainer owns the timing: it calls `on_step` after every step on every rank. Every
`detect_every_steps` steps the ranks hand their new samples to a gather function (a
collective, so all ranks must call it at the same step, which is why this is driven by
steps and not by a timer thread), and the detector rank runs the same detector as the
offline command over the last `lookback_s` seconds (longer with long steps: see
`OnlineMonitor.history_s`), appends alerts to
`<run_dir>/monitor/alerts.jsonl` and the machines to the exclude file.

torch.distributed is optional: `gather` is any function taking this rank's samples (a
column-wise `Trace`, cheap to pickle) and returning every rank's on the detector rank
(None elsewhere); `torch_gather` builds one from a process group. Without one the
monitor runs single-process.
"""

from __future__ import annotations

import logging
import os
import statistics
from collections import deque
from pathlib import Path
from typing import Callable, Mapping

from .actions import append_exclude, write_alerts
from .collect import Collector, default_hostname
from .config import OnlineConfig
from .denoise import Denoiser
from .detect import Alert, detect, peak_seconds
from .period import time_scales
from .trace import Trace
from .tuning import TUNING
from .windows import to_grid

log = logging.getLogger(__name__)
Gather = Callable[[Trace], "list[Trace] | None"]


def torch_gather(group=None, dst: int = 0) -> Gather:
    """A gather over a torch.distributed group (gloo recommended: rows are Python objects)."""
    import torch.distributed as dist

    def gather(samples: Trace) -> list[Trace] | None:
        me = dist.get_rank(group)
        out = [None] * dist.get_world_size(group) if me == dst else None
        dist.gather_object(samples, out, dst=dst, group=group)
        return out

    return gather


class OnlineMonitor:
    """One per rank. `sample_here` on one rank per machine; `is_detector` on one rank.

    `denoiser` overrides `cfg.model_dir` on the detector rank when given.
    """

    def __init__(
        self,
        cfg: OnlineConfig,
        run_dir: str | os.PathLike,
        *,
        is_detector: bool = True,
        sample_here: bool = True,
        gather: Gather | None = None,
        collector: Collector | None = None,
        denoiser: Denoiser | None = None,
    ):
        self.cfg = cfg
        self.dir = Path(run_dir) / "monitor"
        self.is_detector = is_detector
        self.exclude_file = Path(cfg.exclude_file) if cfg.exclude_file else self.dir / "exclude_hosts.txt"
        self.alerts_file = self.dir / "alerts.jsonl"
        self._gather = gather or (lambda samples: [samples])
        self.collector = collector
        if sample_here and collector is None:
            host = default_hostname()
            trace = str(self.dir / "traces" / f"{host}.csv") if cfg.write_traces else None
            self.collector = Collector(host, cfg.interval_s, trace_path=trace)
        self.denoiser = denoiser if denoiser is not None or not is_detector else _load_denoiser(cfg.model_dir)
        self._chunks: list[Trace] = []
        self.declared: set[str] = set()
        self.alerts: list[Alert] = []
        self.stop_requested = False
        self._steps = 0
        self._step_times: deque[float] = deque(maxlen=20)  # this rank's recent steps, for history_s

    def start(self) -> "OnlineMonitor":
        if self.collector is not None:
            self.collector.start()
        return self

    def stop(self) -> None:
        if self.collector is not None:
            self.collector.stop()

    def on_step(
        self, step_time_s: float | None = None, sections: Mapping[str, float | None] | None = None
    ) -> list[Alert]:
        """Call on every rank after each training step; returns new alerts (detector rank).

        `sections`: this rank's section times of the step ({"rollout_time", "train_time",
        "sync_time"} in seconds), the straggler signal; recorded where this rank samples.
        """
        self._steps += 1
        if step_time_s is not None and step_time_s > 0:
            self._step_times.append(float(step_time_s))
        if self.collector is not None and (step_time_s is not None or sections):
            self.collector.record_step_time(step_time_s, sections)
        if self._steps % self.cfg.detect_every_steps:
            return []
        rows = self.collector.drain() if self.collector is not None else []
        gathered = self._gather(Trace.from_rows(rows))  # collective: all ranks, same step
        if not self.is_detector or gathered is None:
            return []
        self._chunks += [t for t in gathered if t is not None and len(t)]
        return self.detect_now()

    def history_s(self, machines: int | None = None) -> float:
        """Seconds of samples each detection sees: lookback_s, or with long steps what a
        run needs to be declared in a job of `machines`: the slowest score to fill (the
        peak over peak_steps steps), then its continuity, plus a step of margin.

        With `follow_step` both are counted in steps: with 4-minute steps that is 16
        minutes each, and a fixed 15-minute lookback never holds a run that long: the
        monitor would declare nothing (docs/monitor.md#using-it)."""
        if not self.cfg.grow_lookback or not self._step_times:
            return self.cfg.lookback_s
        period = statistics.median(self._step_times)
        d = self.cfg.detect
        scales = time_scales(d, TUNING, period, machines=machines)
        fill = max(peak_seconds(TUNING, period), scales.average_s)
        return max(self.cfg.lookback_s, fill + max(scales.continuity_s, scales.step_continuity_s) + period)

    def detect_now(self) -> list[Alert]:
        """Run the detector over the last history_s() seconds and act on new alerts."""
        if not self._chunks:
            return []
        trace = Trace.concat(self._chunks)
        end = float(trace.timestamps.max())
        trace = trace.select(trace.timestamps >= end - self.history_s(len(trace.machines)))
        self._chunks = [trace]  # older rows are dropped for good
        grid = to_grid(trace, self.cfg.detect.step_s)
        if grid.values.shape[1] < TUNING.min_machines:
            return []
        new = detect(grid, self.cfg.detect, self.denoiser, already=self.declared).alerts
        if new:
            self._act(new)
        return new

    def _act(self, alerts: list[Alert]) -> None:
        write_alerts(self.alerts_file, alerts, append=True)
        added = append_exclude(self.exclude_file, [a.machine for a in alerts])
        for a in alerts:
            log.warning(
                "monitor: %s declared faulty (metric %s, score %.1f, first seen %.0f)",
                a.machine,
                a.metric,
                a.score,
                a.first_seen,
            )
        if added:
            log.warning("monitor: excluded on requeue: %s (%s)", ", ".join(added), self.exclude_file)
        self.declared.update(a.machine for a in alerts)
        self.alerts.extend(alerts)
        self.stop_requested = self.stop_requested or self.cfg.stop_on_alert


def _load_denoiser(model_dir: str | None) -> Denoiser | None:
    from .denoise import default_model_dir

    if model_dir == "none":
        return None
    path = model_dir or default_model_dir()
    if path is None:
        return None
    try:
        return Denoiser.load(path)
    except (OSError, KeyError, ValueError) as e:
        log.warning("monitor: denoiser at %s not loaded (%s); comparing raw windows", path, e)
        return None
