"""The ``environment.sandbox`` section: the limits of one tool call, checked field by field.

A value type of the config tree; the sandbox that enforces it is
:mod:`megatron_rl.environments.sandbox`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class SandboxConfig:
    """The limits of one tool call, and whether a run may go on with weaker isolation."""

    timeout_s: float = 5.0
    """Wall-clock limit of one call, counted from the code's start (0 < timeout_s <= 600)."""
    cpu_s: int = 10
    """CPU seconds each process of the call may use (RLIMIT_CPU; at the limit it is killed), 1..3600."""
    memory_mb: int = 1024
    """Address space of each process, MiB (RLIMIT_AS: beyond it allocations raise MemoryError), 64..1048576."""
    max_processes: int = 32
    """Processes and threads the code may have at once, counted for this call alone, 1..4096."""
    max_output_bytes: int = 16384
    """stdout and stderr together that reach the observation; past it the call is stopped
    and the observation cut with a marker, 64..67108864."""
    workdir_mb: int = 64
    """Size of the writable working directory (a tmpfs), MiB; also the largest file the code may write, 1..4096."""
    allow_weaker_isolation: bool = False
    """Run the tool even where an isolation is missing (see isolation.py); False: refuse, naming it."""
    python: str = sys.executable
    """Absolute path of the interpreter that runs the code (default: the one running megatron_rl);
    its prefixes are bound read-only into the sandbox."""

    def __post_init__(self):
        _check_number(
            "timeout_s", self.timeout_s, (int, float), 0, 600, "0 < timeout_s <= 600 (seconds)", open_low=True
        )
        _check_number("cpu_s", self.cpu_s, int, 1, 3600, "an integer 1..3600 (seconds)")
        _check_number("memory_mb", self.memory_mb, int, 64, 1 << 20, "an integer 64..1048576 (MiB)")
        _check_number("max_processes", self.max_processes, int, 1, 4096, "an integer 1..4096")
        _check_number("max_output_bytes", self.max_output_bytes, int, 64, 1 << 26, "an integer 64..67108864")
        _check_number("workdir_mb", self.workdir_mb, int, 1, 4096, "an integer 1..4096 (MiB)")
        if not isinstance(self.allow_weaker_isolation, bool):
            raise ValueError(f"allow_weaker_isolation must be true or false, got {self.allow_weaker_isolation!r}")
        if not isinstance(self.python, str) or not os.path.isabs(self.python):
            raise ValueError(f"python must be an absolute path to an interpreter, got {self.python!r}")


def _check_number(name: str, value, types, low, high, allowed: str, open_low: bool = False) -> None:
    ok = isinstance(value, types) and not isinstance(value, bool) and low <= value <= high
    if not ok or (open_low and value == low):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
