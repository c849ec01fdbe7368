"""Fault-tolerant launch under Slurm: the trainer's half of the contract with scripts/slurm.

The batch script and the trainer agree on three things, each in its own module:

  exit_codes  what a trainer exit means (done, stopped to be requeued, failed, bad config)
  signals     SIGUSR1/SIGTERM set a flag; every rank agrees on it at the same step
  status      the exit status file the trainer leaves in the run dir (torchrun hides codes)
  slurm_env   the job's identity (job id, restart count, node) from the environment
  policy      the batch script's decision after the launcher exits: done / requeue / fail
  exclude     the monitor's exclude file as a Slurm node list
  resume      metrics.jsonl continued on restart (rows past the resumed step dropped)
  process_exit  a rank whose run returned ends without the interpreter's teardown
  startup_gc  the garbage collector paused through a rank's start, then the heap frozen

Nothing here imports torch at module level, so `python -m megatron_rl.launch` is fast
enough to run from a batch script.
"""

from megatron_rl.launch.exit_codes import CONFIG_ERROR, DONE, FAILED, STOPPED
from megatron_rl.launch.signals import StopSignals
from megatron_rl.launch.slurm_env import SlurmEnv

__all__ = ["CONFIG_ERROR", "DONE", "FAILED", "STOPPED", "SlurmEnv", "StopSignals"]
