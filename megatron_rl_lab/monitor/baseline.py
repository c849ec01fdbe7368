"""Baselines without windows or denoising, for the evaluation's side-by-side.

Both score every machine at every second against the other machines at that second and
reuse the detector's `declare` (same threshold semantics, priority and continuity), so
the comparison isolates what windows and denoising add.
- z-score: per metric, (x - median) / (1.4826 * MAD) across machines.
- Mahalanobis (the published paper's baseline): the distance of a machine's vector of
  per-metric z-scores from the others', under their covariance at that second
  (shrunk towards the identity; with few machines it is barely estimable: 8 machines
  and 7 metrics leave one degree of freedom, which is part of why it does worse).
"""

from __future__ import annotations

import numpy as np

from megatron_rl.monitor.detect import Scores
from megatron_rl.monitor.windows import Grid, fill_gaps, nanmedian


def _robust_z(grid: Grid, max_fill: int) -> np.ndarray:
    """[metrics, machines, T] per-second robust z-scores across machines (NaN = absent)."""
    x = fill_gaps(grid.values, max_fill)
    med = nanmedian(x, axis=1, keepdims=True)
    dev = np.abs(x - med)
    mad = 1.4826 * nanmedian(dev, axis=1, keepdims=True)
    typical = np.nanmedian(mad, axis=2, keepdims=True)  # guards seconds where all agree
    with np.errstate(invalid="ignore", divide="ignore"):
        return ((x - med) / np.fmax(mad, typical)).astype(np.float32)


def zscore_scores(grid: Grid, max_fill: int = 3) -> Scores:
    """Per-second robust z-scores, one "window" per second; |z| is what is thresholded."""
    z = np.abs(_robust_z(grid, max_fill))
    t = grid.times()
    return Scores(z, list(grid.metrics), list(grid.machines), t, t)


def mahalanobis_scores(grid: Grid, max_fill: int = 3, shrink: float = 0.1) -> Scores:
    """Per-second Mahalanobis distance across machines, as one pseudo-metric."""
    z = _robust_z(grid, max_fill)  # [K, N, T]
    present = ~np.isnan(z)
    zt = np.nan_to_num(np.clip(z, -50, 50)).transpose(2, 1, 0)  # [T, N, K], absent = typical
    n = np.maximum(present.any(0).sum(0), 2)  # machines present per second [T]
    mean = zt.sum(1, keepdims=True) / n[:, None, None]
    c = zt - mean
    cov = np.einsum("tnk,tnl->tkl", c, c) / (n - 1)[:, None, None]
    k = cov.shape[-1]
    diag = np.einsum("tkk->tk", cov).mean(-1)[:, None, None]
    cov = (1 - shrink) * cov + shrink * diag * np.eye(k)[None] + 1e-6 * np.eye(k)[None]
    inv = np.linalg.inv(cov)
    d2 = np.einsum("tnk,tkl,tnl->tn", c, inv, c)
    d = np.sqrt(np.maximum(d2, 0)).T.astype(np.float32)  # [N, T]
    d[~present.any(0)] = np.nan
    t = grid.times()
    return Scores(d[None], ["mahalanobis"], list(grid.machines), t, t)
