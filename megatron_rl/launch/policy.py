"""What the batch script does after the launcher (srun / torchrun) exits.

  done     the trainer finished (exit 0)
  requeue  it stopped on SIGUSR1 after checkpointing (exit 75), or it failed and the job
           has been restarted fewer than ``max_restarts`` times (SLURM_RESTART_COUNT)
  stop     it stopped on SIGTERM (cancel / time limit) or SIGINT (Ctrl-C): saved, but not
           to be requeued
  fail     config error (a requeue would repeat it) or the restart limit is used up

This attempt's status file, when present, overrides the exit code (torchrun turns every
worker exit into 1); a status file from an earlier attempt is ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_rl.launch.exit_codes import CONFIG_ERROR, DONE, STOPPED, describe
from megatron_rl.launch.slurm_env import SlurmEnv

ACTIONS = ("done", "requeue", "stop", "fail")


@dataclasses.dataclass(frozen=True)
class Decision:
    action: str
    """One of ACTIONS."""
    reason: str
    """One line for the job log."""


def decide(rc: int, status: Optional[dict], env: SlurmEnv, max_restarts: int) -> Decision:
    if max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts} must be >= 0")
    mine = status is not None and status.get("attempt") == env.attempt
    code = int(status["code"]) if mine else rc
    where = f"attempt {env.attempt}: launcher exit {rc}" + (
        f", trainer status {code} at step {status.get('step')}" if mine else ""
    )
    if code == DONE:
        return Decision("done", f"{where}: done")
    if code == STOPPED:
        if mine and status.get("signal") in ("SIGTERM", "SIGINT"):
            why = "cancel or time limit" if status["signal"] == "SIGTERM" else "Ctrl-C"
            return Decision("stop", f"{where}: stopped on {status['signal']} ({why}), not requeued")
        return Decision("requeue", f"{where}: stopped after a checkpoint, requeue")
    if code == CONFIG_ERROR:
        return Decision("fail", f"{where}: config error, a requeue would repeat it")
    if env.restart_count < max_restarts:
        return Decision("requeue", f"{where}: {describe(code)}; restart {env.restart_count + 1} of {max_restarts}")
    return Decision("fail", f"{where}: {describe(code)}; restart limit {max_restarts} reached")
