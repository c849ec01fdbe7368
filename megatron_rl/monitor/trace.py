"""The monitor's trace format (docs/monitor.md): rows of (timestamp, machine, metric, value).

A trace is one CSV or Parquet file, or a directory of them. In memory it is held
column-wise (numpy arrays, machines and metrics as integer codes) because a 15-minute
trace of 1024 machines has millions of rows. Reading validates as it goes: a malformed
file stops with one message naming the file, row and column and saying what is allowed;
tolerable defects (NaNs, out-of-order rows, unknown or missing metrics, machines joining
or leaving) are counted in a `TraceReport` instead.
"""

from __future__ import annotations

import csv
import difflib
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

COLUMNS = ("timestamp", "machine", "metric", "value")

# Metric priority of the published system; earlier names decide first.
PRIORITY_METRICS = (
    "pfc_tx_packets",
    "cpu_util",
    "gpu_duty_cycle",
    "gpu_power",
    "gpu_graphics_activity",
    "gpu_tensor_activity",
    "nvlink_bandwidth",
)
# Canonical names of lower priority (still known, so not reported as unknown).
EXTRA_METRICS = (
    "gpu_mem_used",
    "host_mem_used",
    "net_rx_bytes",
    "net_tx_bytes",
    "disk_read_bytes",
    "disk_write_bytes",
    "gpu_temperature",
    "pcie_tx_bytes",
    "pcie_rx_bytes",
    "gpu_ecc_errors",
    "step_time",
    "rollout_time",
    "train_time",
    "sync_time",
)
# Step-level metrics from the trainer (one value per step, repeated by the collector at
# every sample until the next step ends); the detector counts their continuity in steps.
STEP_METRICS = ("step_time", "rollout_time", "train_time", "sync_time")
CANONICAL_METRICS = PRIORITY_METRICS + EXTRA_METRICS

# Units written by the collector; documentation only, the detector is unit-free.
METRIC_UNITS = {
    "pfc_tx_packets": "pause frames/s",
    "cpu_util": "% of all cores",
    "gpu_duty_cycle": "% (mean over the machine's GPUs)",
    "gpu_power": "W (mean over GPUs)",
    "gpu_graphics_activity": "% (NVML GPM graphics util)",
    "gpu_tensor_activity": "% (NVML GPM any-tensor util)",
    "nvlink_bandwidth": "bytes/s (tx+rx, summed over GPUs)",
    "gpu_mem_used": "% of GPU memory",
    "host_mem_used": "% of host memory",
    "net_rx_bytes": "bytes/s",
    "net_tx_bytes": "bytes/s",
    "disk_read_bytes": "bytes/s",
    "disk_write_bytes": "bytes/s",
    "gpu_temperature": "deg C (max over GPUs)",
    "pcie_tx_bytes": "bytes/s",
    "pcie_rx_bytes": "bytes/s",
    "gpu_ecc_errors": "uncorrected, volatile (count)",
    "step_time": "s (last finished training step)",
    "rollout_time": "s (rollout section of the last finished step, this rank)",
    "train_time": "s (train section of the last finished step, this rank)",
    "sync_time": "s (weight-sync section of the last finished step, this rank)",
}


class TraceError(ValueError):
    """A trace that cannot be read; the message names what is wrong and what is allowed."""


def metric_order(names: Iterable[str]) -> list[str]:
    """Sort metric names by detection priority: the published order first, unknown names last."""
    rank = {name: i for i, name in enumerate(CANONICAL_METRICS)}
    return sorted(set(names), key=lambda n: (rank.get(n, len(rank)), n))


@dataclass
class Trace:
    """Column-wise trace rows; `machine_idx`/`metric_idx` index `machines`/`metrics`."""

    timestamps: np.ndarray  # float64 [rows], seconds
    machine_idx: np.ndarray  # int32 [rows]
    metric_idx: np.ndarray  # int32 [rows]
    values: np.ndarray  # float64 [rows], NaN where a value is missing
    machines: list[str]
    metrics: list[str]

    def __len__(self) -> int:
        return int(self.timestamps.shape[0])

    @classmethod
    def from_rows(cls, rows: Iterable[Sequence]) -> "Trace":
        """Build from (timestamp, machine, metric, value) tuples, e.g. collector output."""
        machines: dict[str, int] = {}
        metrics: dict[str, int] = {}
        ts, mi, ki, vs = [], [], [], []
        for t, machine, metric, value in rows:
            ts.append(float(t))
            mi.append(machines.setdefault(str(machine), len(machines)))
            ki.append(metrics.setdefault(str(metric), len(metrics)))
            vs.append(float("nan") if value is None else float(value))
        return cls(
            np.asarray(ts, np.float64),
            np.asarray(mi, np.int32),
            np.asarray(ki, np.int32),
            np.asarray(vs, np.float64),
            list(machines),
            list(metrics),
        )

    def rows(self) -> Iterable[tuple[float, str, str, float]]:
        for t, m, k, v in zip(self.timestamps, self.machine_idx, self.metric_idx, self.values):
            yield float(t), self.machines[m], self.metrics[k], float(v)

    def select(self, mask: np.ndarray) -> "Trace":
        """Rows where `mask` is true; machine and metric names are kept as they are."""
        return Trace(
            self.timestamps[mask],
            self.machine_idx[mask],
            self.metric_idx[mask],
            self.values[mask],
            list(self.machines),
            list(self.metrics),
        )

    @staticmethod
    def concat(parts: Sequence["Trace"]) -> "Trace":
        """Concatenate traces, merging machine and metric names."""
        machines: dict[str, int] = {}
        metrics: dict[str, int] = {}
        cols: list[tuple[np.ndarray, ...]] = []
        for p in parts:
            mmap = np.array([machines.setdefault(m, len(machines)) for m in p.machines] or [0], np.int32)
            kmap = np.array([metrics.setdefault(k, len(metrics)) for k in p.metrics] or [0], np.int32)
            cols.append((p.timestamps, mmap[p.machine_idx], kmap[p.metric_idx], p.values))
        if not cols:
            return Trace.from_rows([])
        return Trace(*(np.concatenate([c[i] for c in cols]) for i in range(4)), list(machines), list(metrics))


@dataclass
class TraceReport:
    """Counts of the defects a detector tolerates; printed by `monitor detect`."""

    rows: int = 0
    machines: int = 0
    start: float = math.nan
    end: float = math.nan
    nan_values: int = 0  # empty, NaN or infinite values (treated as missing)
    out_of_order: int = 0  # rows earlier than the previous row of the same machine and metric
    duplicates: int = 0  # repeated (timestamp, machine, metric); averaged
    unknown_metrics: list[str] = field(default_factory=list)  # allowed, lowest priority
    missing_metrics: list[str] = field(default_factory=list)  # priority metrics absent
    partial_metrics: dict[str, int] = field(default_factory=dict)  # metric -> machines lacking it
    joined: dict[str, float] = field(default_factory=dict)  # machine -> first sample time
    left: dict[str, float] = field(default_factory=dict)  # machine -> last sample time

    def lines(self) -> list[str]:
        out = [f"{self.rows} rows, {self.machines} machines, t = {self.start:.1f} .. {self.end:.1f} s"]
        counts = [
            ("NaN/missing values", self.nan_values),
            ("out-of-order rows", self.out_of_order),
            ("duplicate rows (averaged)", self.duplicates),
        ]
        out += [f"{name}: {n}" for name, n in counts if n]
        if self.unknown_metrics:
            out.append(
                "non-canonical metrics (lowest priority): "
                + ", ".join(name + _did_you_mean(name) for name in self.unknown_metrics)
            )
        if self.missing_metrics:
            out.append("priority metrics absent: " + ", ".join(self.missing_metrics))
        for metric, n in self.partial_metrics.items():
            out.append(f"metric {metric} missing on {n} machine(s)")
        if self.joined:
            out.append(f"machines joining late: {len(self.joined)} ({_head(self.joined)})")
        if self.left:
            out.append(f"machines leaving early: {len(self.left)} ({_head(self.left)})")
        return out


def _head(d: dict[str, float], n: int = 3) -> str:
    items = [f"{k}@{v:.0f}s" for k, v in list(d.items())[:n]]
    return ", ".join(items) + (", ..." if len(d) > n else "")


def validate(trace: Trace, presence_tolerance_s: float = 5.0) -> TraceReport:
    """Count the tolerable defects of a trace (reading already rejected malformed rows)."""
    if len(trace) == 0:
        raise TraceError("the trace has no rows; expected rows of timestamp, machine, metric, value")
    ts, mi = trace.timestamps, trace.machine_idx
    rep = TraceReport(rows=len(trace), machines=len(trace.machines), start=float(ts.min()), end=float(ts.max()))
    rep.nan_values = int((~np.isfinite(trace.values)).sum())
    # Out of order: within one (machine, metric) series, in file order, a timestamp below
    # its predecessor. (A file grouped by metric is fine; time going back within a series is not.)
    series = trace.metric_idx.astype(np.int64) * len(trace.machines) + mi
    order = np.argsort(series, kind="stable")
    same = series[order][1:] == series[order][:-1]
    rep.out_of_order = int((np.diff(ts[order]) < 0)[same].sum())
    by_series_time = np.lexsort((ts, series))
    s_sorted, t_sorted = series[by_series_time], ts[by_series_time]
    rep.duplicates = int(((s_sorted[1:] == s_sorted[:-1]) & (t_sorted[1:] == t_sorted[:-1])).sum())
    present = set(trace.metrics)
    rep.unknown_metrics = sorted(present - set(CANONICAL_METRICS))
    rep.missing_metrics = [m for m in PRIORITY_METRICS if m not in present]
    n_mach = len(trace.machines)
    pairs = np.unique(trace.metric_idx.astype(np.int64) * n_mach + mi)
    per_metric = np.bincount(pairs // n_mach, minlength=len(trace.metrics))
    for k in np.flatnonzero(per_metric < n_mach):
        rep.partial_metrics[trace.metrics[k]] = int(n_mach - per_metric[k])
    first = np.full(n_mach, np.inf)
    last = np.full(n_mach, -np.inf)
    np.minimum.at(first, mi, ts)
    np.maximum.at(last, mi, ts)
    for i, name in enumerate(trace.machines):
        if first[i] > rep.start + presence_tolerance_s:
            rep.joined[name] = float(first[i])
        if last[i] < rep.end - presence_tolerance_s:
            rep.left[name] = float(last[i])
    return rep


def _did_you_mean(name: str) -> str:
    close = difflib.get_close_matches(name, CANONICAL_METRICS, n=1, cutoff=0.8)
    return f" (did you mean {close[0]}?)" if close else ""


def check_strict(trace: Trace, where: str = "trace") -> None:
    """Raise TraceError on the first defect `validate` only counts and `detect --strict`
    refuses: a metric name that is not canonical, or time going back within one machine's
    series of a metric.

    Both are tolerated by default because they are common and harmless in real traces (a
    site's own metrics; a clock stepped back by NTP, a file concatenated from parts). A
    pipeline that writes its own traces knows it has neither, and there a typo such as
    `gpu_dutycycle` would otherwise be scored last under its own name while the metric
    it meant goes missing, and a reordering bug would be averaged away unseen.
    """
    unknown = sorted(set(trace.metrics) - set(CANONICAL_METRICS))
    if unknown:
        name = unknown[0]
        raise TraceError(
            f"{where}: unknown metric {name!r}{_did_you_mean(name)}; allowed: "
            f"{', '.join(CANONICAL_METRICS)} (without --strict, other names are scored last)"
        )
    series = trace.metric_idx.astype(np.int64) * len(trace.machines) + trace.machine_idx
    order = np.argsort(series, kind="stable")  # file order within each series
    ts = trace.timestamps[order]
    back = np.flatnonzero((np.diff(ts) < 0) & (series[order][1:] == series[order][:-1]))
    if back.size:
        j = order[back[0] + 1]
        raise TraceError(
            f"{where}: time goes back in machine {trace.machines[trace.machine_idx[j]]!r}, metric "
            f"{trace.metrics[trace.metric_idx[j]]!r}: {ts[back[0] + 1]:g} s after "
            f"{ts[back[0]]:g} s; with --strict each machine's series of a metric must be "
            f"in time order (without it, rows are sorted and counted)"
        )


# ----------------------------------------------------------------------------- reading


def read_trace(path: str | os.PathLike) -> Trace:
    """Read a CSV/Parquet file or a directory of them; raise TraceError on bad input."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix in (".csv", ".parquet") and f.is_file())
        if not files:
            raise TraceError(f"{p}: directory holds no .csv or .parquet trace files")
        return Trace.concat([_read_file(f) for f in files])
    if not p.exists():
        raise TraceError(f"{p}: no such file or directory")
    return _read_file(p)


def _read_file(p: Path) -> Trace:
    if p.suffix == ".parquet":
        return _read_parquet(p)
    if p.suffix == ".csv":
        return _read_csv(p)
    raise TraceError(f"{p}: unsupported file type {p.suffix!r}; allowed: .csv, .parquet")


def _column_positions(p: Path, header: Sequence[str]) -> list[int]:
    names = [h.strip() for h in header]
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise TraceError(
            f"{p}: missing column(s) {', '.join(map(repr, missing))}; a trace needs "
            f"columns {', '.join(COLUMNS)} (extra columns are ignored); found "
            f"{', '.join(map(repr, names)) or 'no header'}"
        )
    return [names.index(c) for c in COLUMNS]


def _parse_float(p: Path, row: int, column: str, text: str, allow_missing: bool) -> float:
    try:
        x = float(text)
    except ValueError:
        if allow_missing and text.strip() == "":
            return math.nan
        what = "a value (a number; empty or nan for missing)" if allow_missing else "seconds as a finite number"
        raise TraceError(f"{p}: row {row}: column {column!r} is {text!r}; expected {what}") from None
    if not allow_missing and not math.isfinite(x):
        raise TraceError(f"{p}: row {row}: column {column!r} is {text!r}; expected seconds as a finite number")
    return x


def _read_csv(p: Path) -> Trace:
    machines: dict[str, int] = {}
    metrics: dict[str, int] = {}
    ts, mi, ki, vs = [], [], [], []
    with open(p, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise TraceError(f"{p}: empty file; expected a header {','.join(COLUMNS)} and rows")
        it, im, ik, iv = _column_positions(p, header)
        width = len(header)
        for row_no, row in enumerate(reader, start=2):  # row numbers as an editor shows them
            if len(row) != width:
                if not row:
                    continue  # a blank line
                raise TraceError(f"{p}: row {row_no}: has {len(row)} fields; the header has {width}")
            machine, metric = row[im].strip(), row[ik].strip()
            if not machine:
                raise TraceError(f"{p}: row {row_no}: column 'machine' is empty; expected a hostname")
            if not metric:
                raise TraceError(
                    f"{p}: row {row_no}: column 'metric' is empty; expected a metric "
                    f"name such as {', '.join(PRIORITY_METRICS[:3])}"
                )
            ts.append(_parse_float(p, row_no, "timestamp", row[it], allow_missing=False))
            vs.append(_parse_float(p, row_no, "value", row[iv], allow_missing=True))
            mi.append(machines.setdefault(machine, len(machines)))
            ki.append(metrics.setdefault(metric, len(metrics)))
    return Trace(
        np.asarray(ts, np.float64),
        np.asarray(mi, np.int32),
        np.asarray(ki, np.int32),
        np.asarray(vs, np.float64),
        list(machines),
        list(metrics),
    )


def _import_pyarrow(p: Path):
    try:
        import pyarrow.parquet as pq  # optional dependency
    except ImportError:
        raise TraceError(
            f"{p}: reading or writing Parquet needs pyarrow (pip install pyarrow); CSV traces need nothing extra"
        ) from None
    return pq


def _read_parquet(p: Path) -> Trace:
    pq = _import_pyarrow(p)
    try:
        table = pq.read_table(p)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise TraceError(f"{p}: not a readable Parquet file ({e})") from None
    _column_positions(p, table.column_names)
    cols = {c: table.column(c).to_pylist() for c in COLUMNS}
    rows = []
    for i, (t, m, k, v) in enumerate(zip(*(cols[c] for c in COLUMNS))):
        row_no = i + 1  # Parquet rows have no header line
        if t is None or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise TraceError(f"{p}: row {row_no}: column 'timestamp' is {t!r}; expected seconds as a finite number")
        if not m:
            raise TraceError(f"{p}: row {row_no}: column 'machine' is {m!r}; expected a hostname")
        if not k:
            raise TraceError(f"{p}: row {row_no}: column 'metric' is {k!r}; expected a metric name")
        if v is not None and not isinstance(v, (int, float)):
            raise TraceError(f"{p}: row {row_no}: column 'value' is {v!r}; expected a number or null")
        rows.append((t, m, k, v))
    return Trace.from_rows(rows)


# ----------------------------------------------------------------------------- writing


def write_trace(trace: Trace, path: str | os.PathLike) -> None:
    """Write a whole trace atomically (temp file + rename), as CSV or Parquet by suffix."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix == ".parquet":
        pq = _import_pyarrow(p)
        import pyarrow as pa

        table = pa.table(
            {
                "timestamp": trace.timestamps,
                "machine": [trace.machines[i] for i in trace.machine_idx],
                "metric": [trace.metrics[i] for i in trace.metric_idx],
                "value": trace.values,
            }
        )
        with _atomic_path(p) as tmp:
            pq.write_table(table, tmp)
        return
    if p.suffix != ".csv":
        raise TraceError(f"{p}: unsupported file type {p.suffix!r}; allowed: .csv, .parquet")
    with _atomic_path(p) as tmp, open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for t, m, k, v in trace.rows():
            w.writerow((repr(t), m, k, "" if math.isnan(v) else repr(v)))


class _atomic_path:
    """Context manager yielding a temp path in the target's directory, renamed on success."""

    def __init__(self, target: Path):
        self.target = target

    def __enter__(self) -> str:
        fd, self.tmp = tempfile.mkstemp(prefix=f".{self.target.name}.", dir=self.target.parent)
        os.close(fd)
        return self.tmp

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            os.replace(self.tmp, self.target)
        elif os.path.exists(self.tmp):
            os.unlink(self.tmp)


class CsvTraceWriter:
    """Appends rows to a CSV trace as they are sampled (header written once)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._f = open(self.path, "a", newline="")
        self._w = csv.writer(self._f)
        if new:
            self._w.writerow(COLUMNS)

    def write(self, rows: Iterable[Sequence]) -> None:
        for t, m, k, v in rows:
            self._w.writerow((repr(float(t)), m, k, "" if v is None or math.isnan(v) else repr(float(v))))
        self._f.flush()  # a crash loses at most the rows of one sample

    def close(self) -> None:
        self._f.close()
