"""Requeue the running job, moving the monitor's excluded hosts into its ExcNodeList.

Order matters (measured on Slurm 22.05): `scontrol update ExcNodeList=` is refused for a
running job ("Job is no longer pending execution"), so the job is requeued first and
updated while pending. The requeue sends SIGTERM to the batch shell and its children, so
the caller ignores SIGTERM meanwhile (the shell's `trap '' TERM`; here as well).
"""

from __future__ import annotations

import re
import signal
import subprocess
from typing import Sequence


class RequeueError(RuntimeError):
    pass


def _scontrol(*args: str) -> str:
    proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RequeueError(
            f"scontrol {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc.stdout


def current_excluded(job_id: str) -> list[str]:
    """The job's ExcNodeList entries (hostlist expressions kept as Slurm wrote them)."""
    match = re.search(r"\bExcNodeList=(\S+)", _scontrol("show", "job", job_id))
    if match is None or match.group(1) == "(null)":
        return []
    return match.group(1).split(",")


def requeue(job_id: str, exclude: Sequence[str] = ()) -> list[str]:
    """Requeue ``job_id``; add ``exclude`` to its excluded nodes. Returns the new ExcNodeList."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        keep = current_excluded(job_id) if exclude else []
        _scontrol("requeue", job_id)
        if not exclude:
            return keep
        merged = keep + [h for h in exclude if h not in keep]
        _scontrol("update", f"JobId={job_id}", f"ExcNodeList={','.join(merged)}")
        return merged
    finally:
        signal.signal(signal.SIGTERM, previous)
