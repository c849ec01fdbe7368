"""Minder-style faulty-machine detection (specs/minder.md).

Modules, in the order data flows through them:
  collect   per-machine sampler (psutil, NVML, PFC, step times) -> trace rows
  trace     the trace format: read/write CSV/Parquet, validation counts
  windows   rows -> [metric, machine, second] grid -> normalised windows
  denoise   one LSTM-VAE per metric (train, save/load with safetensors)
  detect    dissimilarity, metric priority, threshold, continuity -> alerts
  actions   alerts as JSON lines, the exclude file the Slurm scripts read
  online    the monitor the trainer runs beside training
  synth, evaluate, baseline   synthetic traces and the evaluation report
  cli       `monitor detect|eval|train-denoiser|synth`
"""

from .actions import append_exclude, read_exclude, write_alerts
from .collect import Collector
from .denoise import Denoiser, DenoiserConfig, train_denoiser
from .detect import Alert, DetectConfig, declare, detect, score_grid
from .online import OnlineConfig, OnlineMonitor, torch_gather
from .trace import Trace, TraceError, TraceReport, read_trace, validate, write_trace
from .windows import Grid, to_grid

__all__ = [
    "Alert", "Collector", "DetectConfig", "Denoiser", "DenoiserConfig", "Grid", "OnlineConfig",
    "OnlineMonitor", "Trace", "TraceError", "TraceReport", "append_exclude", "declare", "detect",
    "read_exclude", "read_trace", "score_grid", "to_grid", "torch_gather", "train_denoiser",
    "validate", "write_alerts", "write_trace",
]
