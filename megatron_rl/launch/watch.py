"""Stop an srun that outlives its job step (run beside it by scripts/slurm/*.sbatch).

srun returns once every task has reported its exit. A node whose network was cut while its
task ended never delivers that report: measured on Slurm 22.05 (the drills of
tests/slurm/test_drills.py), the node's slurmstepd gives up sending it to srun, reports the
step's end to slurmctld once the link is back, and srun waits on forever, so the batch
script never gets to requeue. This watcher asks slurmctld for the job's steps every
``every_s`` seconds; once srun's step has been seen and is then gone at two checks in a row,
it kills srun, which the batch script sees as a failed launch (requeue).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

BOOKKEEPING_STEPS = ("batch", "extern", "interactive")
"""Steps that are not srun's: the batch shell's own, the extern step of PrologFlags=contain."""


def launched_steps(job_id: str) -> list[str] | None:
    """The job's srun steps running in slurmctld (e.g. ['7.0']); None when slurmctld did not answer."""
    try:
        proc = subprocess.run(
            ["squeue", "-h", "-s", "-j", job_id, "-o", "%i"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        return None
    return [s for s in proc.stdout.split() if s.split(".")[-1] not in BOOKKEEPING_STEPS]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def watch(pid: int, job_id: str, every_s: float) -> bool:
    """Until ``pid`` (srun) exits: True when it had to be killed (its step ended without it)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # `scancel --signal=USR1 --batch` reaches the shell's children
    seen, missing = False, 0
    while _alive(pid):
        time.sleep(every_s)
        steps = launched_steps(job_id)
        if steps is None:  # slurmctld busy or unreachable: no evidence either way
            continue
        seen = seen or bool(steps)
        missing = missing + 1 if seen and not steps else 0
        if missing >= 2 and _alive(pid):
            print(
                f"megatron-rl slurm: srun (pid {pid}) still waits {missing * every_s:.0f} s after its step "
                f"of job {job_id} ended (a task's exit report lost with a node's network); stopping it",
                flush=True,
            )
            os.kill(pid, signal.SIGKILL)
            return True
    return False
