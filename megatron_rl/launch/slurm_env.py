"""The Slurm job this process belongs to, read from the environment (empty outside Slurm)."""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Mapping, Optional


@dataclasses.dataclass(frozen=True)
class SlurmEnv:
    job_id: Optional[str]
    """SLURM_JOB_ID; None when not running under Slurm."""
    restart_count: int
    """SLURM_RESTART_COUNT: how many times this job was requeued (0 on the first run)."""
    node: str
    """SLURMD_NODENAME, else the short hostname: the name `--exclude` needs."""
    node_list: Optional[str]
    """SLURM_JOB_NODELIST (compressed Slurm syntax, e.g. gpu[01-04])."""

    @classmethod
    def from_environ(cls, environ: Optional[Mapping[str, str]] = None) -> "SlurmEnv":
        env = os.environ if environ is None else environ
        raw = env.get("SLURM_RESTART_COUNT", "0") or "0"
        try:
            restarts = int(raw)
        except ValueError:
            raise ValueError(f"SLURM_RESTART_COUNT={raw!r} is not an integer") from None
        return cls(
            job_id=env.get("SLURM_JOB_ID") or None,
            restart_count=restarts,
            node=env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0],
            node_list=env.get("SLURM_JOB_NODELIST") or None,
        )

    @property
    def attempt(self) -> str:
        """Identifies one run of the job: '<job id>.<restart count>' ('local.0' outside Slurm)."""
        return f"{self.job_id or 'local'}.{self.restart_count}"
