"""`megatron-rl plot RUN_DIR`: the run's learning curves (metrics.jsonl) as one PNG.

The training curves are one column of panels; a run that evaluates (``val/<set>/...``
rows, the step-0 row of the starting weights among them) gets a second column beside it,
one panel per eval set with its accuracy (avg@n) and every pass@k.

Reads only the run directory, so it works on a finished run, a running one (the rows
written so far) and a copy of a cluster run's directory on a laptop. matplotlib is
imported only here and drawn with the file-only Agg backend (no display needed).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

DEFAULT_KEYS = ("reward/mean", "response_length/mean", "actor/entropy")


class PlotError(ValueError):
    """A run directory or metrics file that cannot be plotted; the message says why."""


Series = dict[str, tuple[list[int], list[float]]]
VAL_PANEL_METRICS = re.compile(r"^val/(?P<set>[^/]+)/(accuracy|pass@\d+)$")
"""The val metrics drawn beside the training curves: each set's accuracy and pass@k."""


def read_rows(metrics_file: Path) -> list[dict]:
    """The rows of a metrics.jsonl; a malformed line is an error naming the file and line."""
    rows = []
    for number, line in enumerate(metrics_file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise PlotError(f"{metrics_file}:{number}: not a JSON object ({err.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise PlotError(f"{metrics_file}:{number}: expected a JSON object with an integer 'step'")
        rows.append(row)
    if not rows:
        raise PlotError(f"{metrics_file} holds no steps yet")
    return rows


def load_series(metrics_file: Path, keys: Sequence[str], skip_missing: bool = False) -> Series:
    """{key: (steps, values)} for every key, skipping steps where the key is absent or null.

    A key no row holds is an error listing the keys that are there (``skip_missing``: leave
    it out instead, e.g. entropy in a run that never updated the actor)."""
    return series_of(read_rows(metrics_file), keys, skip_missing, str(metrics_file))


def series_of(rows: Sequence[dict], keys: Sequence[str], skip_missing: bool, where: str) -> Series:
    present = sorted({k for row in rows for k in row if k != "step"})
    series = {}
    for key in keys:
        points = [
            (row["step"], float(row[key]))
            for row in rows
            if isinstance(row.get(key), (int, float))
            and not isinstance(row.get(key), bool)
            and math.isfinite(float(row[key]))
        ]
        if not points and skip_missing:
            continue
        if not points:
            raise PlotError(f"no step of {where} has {key!r}; keys present: {', '.join(present)}")
        series[key] = ([p[0] for p in points], [p[1] for p in points])
    return series


def val_panels(rows: Sequence[dict]) -> dict[str, Series]:
    """{eval set: its accuracy and pass@k series}, sets and metrics in the order rows name them."""
    keys = list(dict.fromkeys(k for row in rows for k in row if VAL_PANEL_METRICS.match(k)))
    panels: dict[str, list[str]] = {}
    for key in keys:
        panels.setdefault(VAL_PANEL_METRICS.match(key)["set"], []).append(key)
    return {name: series_of(rows, names, skip_missing=True, where="") for name, names in panels.items()}


def draw(series: Series, title: str, out: Path, val: Optional[dict[str, Series]] = None) -> Path:
    """One panel per key, stacked, shared step axis; with ``val``, a second column of one
    panel per eval set. Written atomically (tmp + rename)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    val = {name: panel for name, panel in (val or {}).items() if panel}
    height = max(len(series), len(val))
    fig, axes = plt.subplots(
        height, 2 if val else 1, sharex=True, squeeze=False, figsize=(7 * (2 if val else 1), 2.2 * height + 0.6)
    )
    for ax, (key, (steps, values)) in zip(axes[:, 0], series.items()):
        ax.plot(steps, values, marker="." if len(steps) < 60 else None, linewidth=1.2)
        ax.set_ylabel(key, fontsize=9)
        ax.grid(alpha=0.3)
    for ax, (name, panel) in zip(axes[:, 1] if val else (), val.items()):
        for key, (steps, values) in panel.items():
            accuracy = key.endswith("/accuracy")  # pass@1 equals it for 0/1 rewards: dashed lines stay visible
            ax.plot(steps, values, "-" if accuracy else "--", marker=".", linewidth=1.2, label=key.rsplit("/", 1)[1])
        ax.set_ylabel(f"val/{name}", fontsize=9)
        ax.legend(fontsize=8, loc="best")
        ax.grid(alpha=0.3)
    for column in range(axes.shape[1]):
        used = len(series) if column == 0 else len(val)
        for ax in axes[used:, column]:
            ax.set_visible(False)
        axes[used - 1, column].set_xlabel("step")
        axes[used - 1, column].xaxis.set_tick_params(labelbottom=True)
    fig.suptitle(title, fontsize=10)
    return save_png(fig, out)


def save_png(fig, out: Path) -> Path:
    """Write ``fig`` to ``out`` whole or not at all (a temporary file renamed over it, so a
    reader never sees half a PNG) and close it; returns ``out``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    tmp.replace(out)
    return out


def plot_run(run_dir: Path, keys: Sequence[str] = DEFAULT_KEYS, out: Optional[Path] = None) -> Path:
    """Draw ``keys`` of ``run_dir``/metrics.jsonl, and the val curves beside them when the
    run has any; returns the PNG path (default RUN_DIR/curves.png)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PlotError(f"{run_dir} is not a directory (expected a run dir holding metrics.jsonl)")
    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.is_file():
        raise PlotError(f"{run_dir} has no metrics.jsonl (is it a trainer.run_dir?)")
    rows = read_rows(metrics_file)
    series = series_of(rows, keys, tuple(keys) == DEFAULT_KEYS, str(metrics_file))
    if not series:
        raise PlotError(f"no step of {metrics_file} has any of {', '.join(keys)}")
    return draw(series, str(run_dir), Path(out) if out else run_dir / "curves.png", val_panels(rows))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron-rl plot", description="Draw a run's learning curves from RUN_DIR/metrics.jsonl to a PNG."
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a trainer.run_dir")
    parser.add_argument(
        "--keys",
        default=",".join(DEFAULT_KEYS),
        help=f"comma-separated metric names, one panel each (default: {','.join(DEFAULT_KEYS)})",
    )
    parser.add_argument("--out", help="PNG path (default: RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    keys = [k.strip() for k in args.keys.split(",") if k.strip()]
    if not keys:
        parser.error("--keys names no metric")
    try:
        path = plot_run(Path(args.run_dir), keys, Path(args.out) if args.out else None)
    except PlotError as err:
        print(f"megatron-rl plot: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
