"""What one device can do and what a run used of it: peak FLOP/s, step timing, peak memory.

MFU divides achieved model FLOP/s by a peak. On GPUs the peak is the vendor's dense
tensor-core number for the run's dtype (fp32 runs use TF32 tensor cores, so their peak is
the TF32 one). CPUs have no such table, so the peak is measured: a large ``torch.matmul``
loop on the same machine, in the same run, with the same thread count each rank trains with,
all ranks at once (so ranks that share cores see the share they train with).
"""

from __future__ import annotations

import ctypes
import os
import resource
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl import platform

#: Dense (no sparsity) tensor-core peak TFLOP/s per GPU by dtype, from NVIDIA's data sheets.
#: Ordered: the first key found in the device name wins (PCIe/NVL before the SXM default).
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "fp32": 378.0},
    "H100 NVL": {"bf16": 835.0, "fp32": 417.5},
    "H100": {"bf16": 989.0, "fp32": 494.5},  # SXM
    "H200": {"bf16": 989.0, "fp32": 494.5},
    "H800": {"bf16": 989.0, "fp32": 494.5},
    "A100": {"bf16": 312.0, "fp32": 156.0},
    "A800": {"bf16": 312.0, "fp32": 156.0},
}


def gpu_peak_tflops(device_name: str, dtype: str) -> Optional[float]:
    """The table's peak for a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3'); None if unknown."""
    name = device_name.upper().replace("-", " ")
    for key, peaks in GPU_PEAK_TFLOPS.items():
        if all(part.upper() in name for part in key.split()):
            if dtype not in peaks:
                raise ValueError(f"no {key} peak for dtype={dtype!r}; known: {sorted(peaks)}")
            return peaks[dtype]
    return None


def measure_matmul_tflops(
    device: torch.device, dtype: torch.dtype, size: int, min_seconds: float = 1.0, rounds: int = 3
) -> float:
    """Best TFLOP/s of ``rounds`` timed loops of size x size matmuls (2 n^3 FLOPs each)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.matmul(a, b, out=out)  # warm-up: thread pool, kernel selection
    sync()
    best = 0.0
    for _ in range(rounds):
        count, start = 0, time.perf_counter()
        while True:
            torch.matmul(a, b, out=out)
            count += 1
            if device.type == "cuda" and count % 10:
                continue  # sync rarely on GPU so launches queue up as in training
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds / rounds:
                break
        best = max(best, 2 * size**3 * count / elapsed / 1e12)
    return best


class StepTimer:
    """Wall time per step: CUDA events on GPU (no host sync inside the loop), else perf_counter."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._marks: list = []

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._marks.append([self._mark(), None])

    def stop(self) -> None:
        self._marks[-1][1] = self._mark()

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [begin.elapsed_time(end) / 1e3 for begin, end in self._marks]
        return [end - begin for begin, end in self._marks]


def reset_peak_memory(cuda: bool) -> None:
    """Start a new high-water mark (GPU allocator; on Linux CPU, the process's peak RSS)."""
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        return
    _return_freed_memory_to_os()
    try:  # Linux >= 4.0: writing 5 resets VmHWM to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _return_freed_memory_to_os() -> None:
    """glibc keeps freed heap pages; trim them so RSS shows what the process still holds."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_memory_bytes(cuda: bool) -> int:
    """Peak since :func:`reset_peak_memory`: max_memory_allocated on GPU, peak RSS on CPU."""
    if cuda:
        return int(torch.cuda.max_memory_allocated())
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # since process start


def max_over_ranks(values: list[float]) -> list[float]:
    """Element-wise maximum over all ranks (collective): the slowest rank sets a step's pace."""
    device = platform.current().device if platform.current().is_cuda else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def memory_kind(cuda: bool) -> str:
    if cuda:
        return "torch.cuda.max_memory_allocated"
    return "peak RSS (VmHWM)" if os.path.exists("/proc/self/clear_refs") else "peak RSS since start"
