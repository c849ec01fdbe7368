"""The picture of a `megatron-rl bench compare` report: one panel per metric against the step,
and the wall-clock panel of the target metric (reward/mean without a target), each with a
line per variant for the mean over seeds and a shaded band for its 95 % interval.

Drawn from the report dict alone (so ``--report-only`` redraws it from compare.json's
inputs), with matplotlib's file-only Agg backend, as `megatron-rl plot` does, and written
atomically (tmp + rename).
"""

from __future__ import annotations

import math
from pathlib import Path

from megatron_rl.trainer.plot import save_png

COLUMNS = 2
PANEL_W, PANEL_H = 6.0, 2.8
"""Inches per panel."""


def _band(ax, xs, curve: dict, label: str, color) -> None:
    points = [(x, m) for x, m in zip(xs, curve["mean"]) if m is not None]
    if not points:
        return
    ax.plot([p[0] for p in points], [p[1] for p in points], color=color, linewidth=1.3, label=label)
    band = [(x, lo, hi) for x, lo, hi in zip(xs, curve["lo"], curve["hi"]) if lo is not None and hi is not None]
    if band:
        ax.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band], color=color, alpha=0.2)


def panels(report: dict) -> list[tuple[str, str, dict, object]]:
    """(title, x label, {variant: curve}, x values or 'step') of each panel that has data."""
    out = []
    for metric, curves in report["curves"].items():
        if any(m is not None for c in curves.values() for m in c["mean"]):
            out.append((metric, "step", curves, None))
    wall = report["wall_clock"]
    metric = report["stability"]["metric"]
    if metric in wall["curves"]:
        out.append(
            (
                f"{metric} at equal wall-clock",
                "seconds of steps 2.. (timing/step_s)",
                wall["curves"][metric],
                wall["grid_s"],
            )
        )
    return out


def draw(report: dict, title: str, out: Path) -> Path:
    """Write the report's panels to ``out`` (PNG); returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = panels(report) or [("no finished run yet", "step", {}, None)]
    rows = math.ceil(len(chosen) / COLUMNS)
    fig, axes = plt.subplots(rows, COLUMNS, squeeze=False, figsize=(PANEL_W * COLUMNS, PANEL_H * rows + 0.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (name, xlabel, curves, grid) in zip(axes.flat, chosen):
        for i, (variant, curve) in enumerate(curves.items()):
            n = max(curve["n"], default=0)
            _band(ax, curve["step"] if grid is None else grid, curve, f"{variant} (n={n})", colors[i % len(colors)])
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.grid(alpha=0.3)
        if curves:
            ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(chosen) :]:
        ax.set_visible(False)
    fig.suptitle(f"{title}: mean over seeds, shaded 95 % interval", fontsize=10)
    return save_png(fig, out)
