"""Per-machine metric sampler (~1 Hz) writing the trace format.

Sources each return only what the machine offers: no GPU (or no nvidia-ml-py) means no
GPU metrics at all, never zeros, because a zero would read as a dead GPU to the
detector. Counters (network, disk, NVLink, PFC) become per-second rates, so their first
reading yields nothing. Every source failure is contained: the metric goes absent and
the sampler keeps running beside training.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from typing import Callable, Iterable, Mapping, Protocol

from .trace import STEP_METRICS, CsvTraceWriter

Row = tuple[float, str, str, float]


class Source(Protocol):
    def read(self) -> dict[str, float]: ...

    def close(self) -> None: ...


class _Rates:
    """Turns cumulative counters into per-second rates between successive reads."""

    def __init__(self):
        self._last: dict[str, tuple[float, float]] = {}

    def __call__(self, now: float, counters: dict[str, float]) -> dict[str, float]:
        out = {}
        for name, value in counters.items():
            prev = self._last.get(name)
            self._last[name] = (now, value)
            if prev is not None and now > prev[0] and value >= prev[1]:  # a reset gives no rate
                out[name] = (value - prev[1]) / (now - prev[0])
        return out


class PsutilSource:
    """CPU, host memory, network and disk throughput from psutil (every machine)."""

    def __init__(self):
        import psutil

        self._ps = psutil
        self._rates = _Rates()
        psutil.cpu_percent(interval=None)  # the first call only starts the measurement
        self.read()  # prime the counters, so the next read yields rates

    def read(self) -> dict[str, float]:
        ps, now = self._ps, time.monotonic()
        out = {"cpu_util": float(ps.cpu_percent(interval=None)), "host_mem_used": float(ps.virtual_memory().percent)}
        counters = {}
        net = ps.net_io_counters()
        if net is not None:
            counters.update(net_rx_bytes=net.bytes_recv, net_tx_bytes=net.bytes_sent)
        try:
            disk = ps.disk_io_counters()
        except (OSError, RuntimeError):  # containers without /proc/diskstats
            disk = None
        if disk is not None:
            counters.update(disk_read_bytes=disk.read_bytes, disk_write_bytes=disk.write_bytes)
        out.update(self._rates(now, counters))
        return out

    def close(self) -> None:
        pass


class NvmlSource:
    """GPU metrics through nvidia-ml-py (`pynvml`), imported lazily.

    Machine-level values: means over GPUs for utilisation, power and memory, the max for
    temperature, sums for throughputs and error counts. Graphics and tensor activity
    come from NVML's GPM interface (Hopper and newer) and are absent elsewhere. A metric
    that fails once on a device is not asked for again on it.
    """

    def __init__(self):
        self.available = False
        self._broken: set[tuple[int, str]] = set()
        self._rates = _Rates()
        self._gpm_prev: dict[int, object] = {}
        try:
            import pynvml  # nvidia-ml-py; optional

            pynvml.nvmlInit()
            self._nv = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.available = bool(self._handles)
        except Exception:  # no package, no driver, no GPU: no GPU metrics
            self._handles = []

    def _try(self, dev: int, name: str, fn: Callable[[], float]) -> float | None:
        if (dev, name) in self._broken:
            return None
        try:
            return float(fn())
        except Exception:
            self._broken.add((dev, name))
            return None

    def _device(self, i: int, h) -> dict[str, float]:
        nv = self._nv
        vals = {
            "gpu_duty_cycle": self._try(i, "util", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu),
            "gpu_power": self._try(i, "power", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
            "gpu_mem_used": self._try(i, "mem", lambda: _mem_percent(nv.nvmlDeviceGetMemoryInfo(h))),
            "gpu_temperature": self._try(i, "temp", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
            "pcie_tx_bytes": self._try(
                i, "pcie_tx", lambda: 1024.0 * nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES)
            ),
            "pcie_rx_bytes": self._try(
                i, "pcie_rx", lambda: 1024.0 * nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES)
            ),
            "gpu_ecc_errors": self._try(
                i,
                "ecc",
                lambda: nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
            ),
            "nvlink_counter": self._try(i, "nvlink", lambda: _nvlink_kib(nv, h) * 1024.0),
        }
        vals.update(self._gpm(i, h))
        return {k: v for k, v in vals.items() if v is not None}

    def _gpm(self, i: int, h) -> dict[str, float]:
        """Graphics and tensor activity between the previous read's GPM sample and now."""
        nv = self._nv
        if (i, "gpm") in self._broken:
            return {}
        try:
            sample = nv.nvmlGpmSampleAlloc()
            nv.nvmlGpmSampleGet(h, sample)
            prev, self._gpm_prev[i] = self._gpm_prev.get(i), sample
            if prev is None:
                return {}
            get = nv.c_nvmlGpmMetricsGet_t()
            get.version, get.numMetrics, get.sample1, get.sample2 = nv.NVML_GPM_METRICS_GET_VERSION, 2, prev, sample
            get.metrics[0].metricId = nv.NVML_GPM_METRIC_GRAPHICS_UTIL
            get.metrics[1].metricId = nv.NVML_GPM_METRIC_ANY_TENSOR_UTIL
            nv.nvmlGpmMetricsGet(get)
            nv.nvmlGpmSampleFree(prev)
            return {
                "gpu_graphics_activity": float(get.metrics[0].value),
                "gpu_tensor_activity": float(get.metrics[1].value),
            }
        except Exception:  # pre-Hopper GPUs and old drivers have no GPM
            self._broken.add((i, "gpm"))
            return {}

    def read(self) -> dict[str, float]:
        if not self.available:
            return {}
        per = [self._device(i, h) for i, h in enumerate(self._handles)]
        out: dict[str, float] = {}
        for name, how in _GPU_AGGREGATE.items():
            xs = [d[name] for d in per if name in d]
            if xs:
                out[name] = how(xs)
        nvlink = out.pop("nvlink_counter", None)
        if nvlink is not None:
            out.update(self._rates(time.monotonic(), {"nvlink_bandwidth": nvlink}))
        return out

    def close(self) -> None:
        if self.available:
            try:
                self._nv.nvmlShutdown()
            except Exception:
                pass
            self.available = False


def _mean(xs):
    return sum(xs) / len(xs)


_GPU_AGGREGATE = {
    "gpu_duty_cycle": _mean,
    "gpu_power": _mean,
    "gpu_mem_used": _mean,
    "gpu_graphics_activity": _mean,
    "gpu_tensor_activity": _mean,
    "gpu_temperature": max,
    "pcie_tx_bytes": sum,
    "pcie_rx_bytes": sum,
    "gpu_ecc_errors": sum,
    "nvlink_counter": sum,
}


def _mem_percent(info) -> float:
    return 100.0 * info.used / info.total


def _nvlink_kib(nv, h) -> float:
    """Cumulative NVLink data KiB (tx + rx) of a GPU from NVML field values."""
    fields = nv.nvmlDeviceGetFieldValues(
        h, [nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX]
    )
    if any(f.nvmlReturn != nv.NVML_SUCCESS for f in fields):
        raise RuntimeError("NVLink throughput fields not supported")
    return float(sum(f.value.ullVal for f in fields))


_PAUSE_COUNTER = re.compile(r"^\s*(tx_prio\d+_pause|tx_pause_ctrl_phy|tx_pause_frames)\s*:\s*(\d+)", re.M)


def parse_pause_frames(ethtool_stats: str) -> int | None:
    """Sum of transmitted pause-frame counters in `ethtool -S` output (None if none)."""
    found = _PAUSE_COUNTER.findall(ethtool_stats)
    return sum(int(v) for _, v in found) if found else None


class PfcSource:
    """PFC pause frames sent per second, from `ethtool -S` on the given interfaces.

    interfaces="auto" keeps the interfaces whose statistics have pause counters (RDMA
    NICs); none found, or no ethtool, means no `pfc_tx_packets` metric.
    """

    def __init__(self, interfaces: Iterable[str] | str = "auto", timeout_s: float = 0.5):
        self._timeout = timeout_s
        self._rates = _Rates()
        self._ethtool = shutil.which("ethtool")
        if not self._ethtool:
            self.interfaces: list[str] = []
            return
        if interfaces == "auto":
            import psutil

            interfaces = [n for n in psutil.net_if_addrs() if n != "lo"]
        self.interfaces = [i for i in interfaces if self._count(i) is not None]

    def _count(self, iface: str) -> int | None:
        try:
            out = subprocess.run(
                [self._ethtool, "-S", iface], capture_output=True, text=True, timeout=self._timeout, check=False
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        return parse_pause_frames(out)

    def read(self) -> dict[str, float]:
        counts = [c for c in (self._count(i) for i in self.interfaces) if c is not None]
        if not counts:
            return {}
        return self._rates(time.monotonic(), {"pfc_tx_packets": float(sum(counts))})

    def close(self) -> None:
        pass


class StepTimeSource:
    """The trainer's step and section times of the last finished step (absent before one).

    Step-level metrics arrive once per step but are read at every sample, so the trace
    holds the last step's value at every second until the next step ends: forward-filled
    within a step, which is how they line up with the per-second metrics in the grid.
    """

    def __init__(self):
        self._last: dict[str, float] = {}

    def record(self, seconds: float | None = None, sections: Mapping[str, float | None] | None = None) -> None:
        unknown = sorted(set(sections or {}) - set(STEP_METRICS[1:]))
        if unknown:
            raise ValueError(f"unknown section time(s) {unknown}; allowed: {', '.join(STEP_METRICS[1:])}")
        new = {"step_time": seconds, **(sections or {})}
        self._last.update({k: float(v) for k, v in new.items() if v is not None})

    def read(self) -> dict[str, float]:
        return dict(self._last)

    def close(self) -> None:
        pass


def default_hostname() -> str:
    """The name Slurm knows this node by (what `sbatch --exclude` needs): SLURMD_NODENAME
    when running under Slurm, else the short hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def default_sources(pfc: bool = True) -> list[Source]:
    out: list[Source] = [PsutilSource(), NvmlSource()]
    if pfc:
        out.append(PfcSource())
    return out


class Collector:
    """Samples all sources every `interval_s` into rows (timestamp, machine, metric, value).

    Rows go to an optional CSV trace file and to an in-memory buffer (bounded by
    `keep_rows`) that `drain()` empties, e.g. for gathering to the detector's rank.
    """

    def __init__(
        self,
        hostname: str | None = None,
        interval_s: float = 1.0,
        sources: list[Source] | None = None,
        trace_path: str | None = None,
        keep_rows: int = 200_000,
        clock: Callable[[], float] = time.time,
    ):
        if interval_s <= 0:
            raise ValueError(f"Collector interval_s = {interval_s}; must be > 0")
        self.hostname = hostname or default_hostname()
        self.interval_s = interval_s
        self.steps = StepTimeSource()
        self.sources = (default_sources() if sources is None else list(sources)) + [self.steps]
        self._writer = CsvTraceWriter(trace_path) if trace_path else None
        self._buffer: collections.deque[Row] = collections.deque(maxlen=keep_rows)
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0  # source exceptions contained so far

    def record_step_time(self, seconds: float | None, sections: Mapping[str, float | None] | None = None) -> None:
        """Hook for the trainer: call once per finished step with its wall time and,
        optionally, this rank's section times ({"rollout_time": s, "train_time": s,
        "sync_time": s}; None values are skipped)."""
        self.steps.record(seconds, sections)

    def sample(self) -> dict[str, float]:
        """Read every source once; returns {metric: value} and records the rows."""
        values: dict[str, float] = {}
        for src in self.sources:
            try:
                values.update(src.read())
            except Exception:  # one failing source must not stop the others
                self.errors += 1
        now = self._clock()
        rows = [(now, self.hostname, k, float(v)) for k, v in values.items()]
        with self._lock:
            self._buffer.extend(rows)
            if self._writer:
                self._writer.write(rows)
        return values

    def drain(self) -> list[Row]:
        """Rows sampled since the last drain."""
        with self._lock:
            rows = list(self._buffer)
            self._buffer.clear()
        return rows

    def start(self) -> "Collector":
        """Sample in a daemon thread until stop(); ticks stay on a fixed grid."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="monitor-collector", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            self.sample()
            next_tick += self.interval_s
            delay = next_tick - time.monotonic()
            if delay < 0:  # fell behind (a slow source): skip missed ticks, do not burst
                next_tick, delay = time.monotonic(), 0.0
            self._stop.wait(delay)

    def stop(self) -> None:
        """Stop sampling and release the sources (NVML); a stopped collector stays stopped."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s + 5)
            self._thread = None
        for src in self.sources:
            src.close()
        if self._writer:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "Collector":
        return self.start()

    def __exit__(self, *_) -> None:
        self.stop()
