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
  make the next launch fail (errno 17): :func:`remove_stale_shm` removes the ones nobody
  maps. Naming them per job, and every other patch of vLLM, is in
  :mod:`megatron_rl.platform.vllm_compat`.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Optional

import torch

SHM_DIR = Path("/dev/shm")
SHM_MARKER = "cpushm"
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


def mapped_shm_names() -> set[str]:
    """Names of /dev/shm files that some live process has mapped."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # process gone or not ours
            continue
        for line in text.splitlines():
            if "/dev/shm/" in line:
                names.add(line.rsplit("/dev/shm/", 1)[1].replace(" (deleted)", "").strip())
    return names


def release_shared_memory(shm_dir: Path = SHM_DIR) -> list[str]:
    """Free the shared memory vLLM's process groups hold in this process, for a process
    that ends without vLLM's shutdown (launch.process_exit); the names of the CPU
    communicator segments unlinked.

    Two kinds: the broadcast queue of each tensor-parallel group (Python shared memory,
    which the resource tracker would otherwise remove with a "leaked shared_memory objects"
    warning once the process is gone) goes with vLLM's own group teardown; the CPU
    communicator's segments, which nothing else removes, are unlinked by name."""
    from vllm.distributed.parallel_state import destroy_model_parallel

    destroy_model_parallel()
    return unlink_own_shm(shm_dir)


def unlink_own_shm(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the vLLM CPU communicator segments this process maps; return their names.

    For a process that ends without vLLM's shutdown (launch.process_exit). The mappings
    stay valid until the process is gone, and vLLM opens a segment by name only when an
    engine starts, so a rank of the same engine that is still running loses nothing. Two
    ranks of one engine map the same segments: the second finds them gone. A mapping shown
    "(deleted)" is already unlinked: its name may now be another file's."""
    names = {
        line.rsplit("/dev/shm/", 1)[1].strip()
        for line in Path("/proc/self/maps").read_text().splitlines()
        if "/dev/shm/" in line and not line.endswith("(deleted)")
    }
    removed = []
    for name in sorted(names):
        if SHM_MARKER in name:
            try:
                (shm_dir / name).unlink()
                removed.append(name)
            except FileNotFoundError:  # the other rank of the engine was first
                pass
    return removed


def remove_stale_shm(shm_dir: Path = SHM_DIR) -> list[str]:
    """Delete vLLM CPU communicator segments that no live process maps; return their names."""
    if not shm_dir.is_dir():
        return []
    in_use = mapped_shm_names()
    removed = []
    for path in shm_dir.iterdir():
        if SHM_MARKER in path.name and path.name not in in_use:
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:  # another rank removed it first, or not ours
                pass
    return removed
