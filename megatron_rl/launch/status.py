"""The exit status file: how the trainer tells the batch script why it exited.

torchrun reports any worker failure as exit code 1, so the code alone cannot say "stopped
to be requeued" through torchrun. Rank 0 therefore writes ``<run_dir>/launch/exit_status.json``
after the last checkpoint is committed; it names the attempt (job id + restart count) so a
file left by an earlier attempt is never mistaken for this one's.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

from megatron_rl.launch.exit_codes import describe
from megatron_rl.launch.slurm_env import SlurmEnv

STATUS_FILE = Path("launch") / "exit_status.json"


def write_status(
    run_dir, code: int, step: int, signal_name: Optional[str] = None, env: Optional[SlurmEnv] = None
) -> Path:
    """Atomically (write + rename) record this attempt's exit. Call on rank 0 only."""
    env = env or SlurmEnv.from_environ()
    path = Path(run_dir) / STATUS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "code": code,
        "meaning": describe(code),
        "step": step,
        "signal": signal_name,
        "attempt": env.attempt,
        "job_id": env.job_id,
        "restart_count": env.restart_count,
        "node": env.node,
        "time": time.time(),
    }
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)
    return path


def read_status(run_dir) -> Optional[dict]:
    """The last recorded exit, or None when there is none (or it is unreadable)."""
    path = Path(run_dir) / STATUS_FILE
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
