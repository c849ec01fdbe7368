"""Process hygiene for a vLLM engine colocated with training; patches nothing (the vLLM
patches are in platform/vllm_compat.py; docs/platform.md, "vLLM on CPU").

What must happen before the engine is built:
- environment (in-process engine, KV cache size, no thread pinning, caches in the run dir,
  the log level) and the torch thread count, which vLLM's CPU worker freezes once it starts;
- vLLM's own log level (``rollout.log_level``, default warning): at INFO it prints several
  lines per engine start and per weight load, which bury the trainer's progress line. vLLM
  takes ``VLLM_LOGGING_LEVEL`` into its logging config when an engine is made, so the
  variable is set here; a logger an earlier engine already configured is set directly;
- shared-memory segments of vLLM's CPU communicator survive a crashed or killed rank and
  make the next launch fail (errno 17): the engine sweeps the ones nobody maps
  (:func:`megatron_rl.platform.vllm_shm.remove_stale_shm`) before it starts. Naming them per
  job, and every other patch of vLLM, is in :mod:`megatron_rl.platform.vllm_compat`.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Optional

import torch

LOG_LEVELS = ("debug", "info", "warning", "error")


def prepare_environment(
    cache_dir: Optional[Path], kv_cache_gib: float, threads: Optional[int], log_level: str = "warning"
) -> None:
    """Set vLLM's environment and the thread count; call before importing the engine."""
    set_log_level(log_level)
    env = os.environ
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: tensors travel by reference
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", _gib(kv_cache_gib))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if cache_dir is not None:
        env.setdefault("VLLM_CACHE_ROOT", str(cache_dir / "vllm"))
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor"))
    if threads is not None:
        torch.set_num_threads(threads)


def set_log_level(level: str) -> None:
    """vLLM logs at ``level`` (one of :data:`LOG_LEVELS`) from now on, in this process and
    in processes it starts; the configured level wins over an inherited VLLM_LOGGING_LEVEL."""
    if level not in LOG_LEVELS:
        raise ValueError(f"vLLM log level {level!r}; allowed: {list(LOG_LEVELS)}")
    os.environ["VLLM_LOGGING_LEVEL"] = level.upper()
    if "vllm.logger" in sys.modules:  # an earlier engine may have set up its handlers from the old value
        logger = logging.getLogger("vllm")
        logger.setLevel(level.upper())
        for handler in logger.handlers:
            handler.setLevel(level.upper())


def _gib(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
