"""Minder-style faulty-machine detection (docs/monitor.md).

Modules, in the order data flows through them:
  collect   per-machine sampler (psutil, NVML, PFC, step times) -> trace rows
  trace     the trace format: read/write CSV/Parquet, validation counts
  windows   rows -> [metric, machine, second] grid -> normalised windows
  denoise   one LSTM-VAE per metric (train, save/load with safetensors)
  tuning    the tuned constants, with why each has its value
  detect    dissimilarity, metric priority, threshold, continuity -> alerts
  actions   alerts as JSON lines, the exclude file the Slurm scripts read
  online    the monitor the trainer runs beside training
  cli       `monitor detect|train-denoiser`, and the installed `monitor.*` entry points
The synthetic traces and the evaluation that measure the detector are the lab's
(megatron_rl_lab.monitor).
"""

import importlib

# Loaded on first use: `denoise` imports torch, and the config tree reads OnlineConfig
# (monitor.config) where torch must not be imported yet.
_WHERE = {
    "append_exclude": "actions",
    "read_exclude": "actions",
    "write_alerts": "actions",
    "Collector": "collect",
    "Denoiser": "denoise",
    "DenoiserConfig": "denoise",
    "train_denoiser": "denoise",
    "Alert": "detect",
    "DetectConfig": "detect",
    "declare": "detect",
    "detect": "detect",
    "score_grid": "detect",
    "OnlineConfig": "config",
    "OnlineMonitor": "online",
    "torch_gather": "online",
    "TUNING": "tuning",
    "Tuning": "tuning",
    "Trace": "trace",
    "TraceError": "trace",
    "TraceReport": "trace",
    "read_trace": "trace",
    "validate": "trace",
    "write_trace": "trace",
    "Grid": "windows",
    "to_grid": "windows",
}


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(name)


__all__ = [
    "Alert",
    "Collector",
    "DetectConfig",
    "Denoiser",
    "DenoiserConfig",
    "Grid",
    "OnlineConfig",
    "OnlineMonitor",
    "TUNING",
    "Trace",
    "TraceError",
    "TraceReport",
    "Tuning",
    "append_exclude",
    "declare",
    "detect",
    "read_exclude",
    "read_trace",
    "score_grid",
    "to_grid",
    "torch_gather",
    "train_denoiser",
    "validate",
    "write_alerts",
    "write_trace",
]
