"""Trainer exit codes, the part of the contract the batch script reads.

75 is sysexits' EX_TEMPFAIL ("try again later"): the run is healthy and saved a checkpoint
at the step it stopped. 2 is a config error, which a requeue would only repeat. Anything
else non-zero (including 128+N for a signal death) is a failure that may be retried a
limited number of times.
"""

DONE = 0
"""All trainer.max_steps steps ran and the final checkpoint is committed."""
FAILED = 1
"""The trainer raised; whatever was committed before is intact."""
CONFIG_ERROR = 2
"""Bad config or layout; requeueing would fail the same way."""
STOPPED = 75
"""Stopped on a signal after committing a checkpoint at the current step: requeue me
(SIGUSR1), or stop here (SIGTERM: cancel / time limit; SIGINT: Ctrl-C); the status file
says which."""

_NAMES = {DONE: "done", FAILED: "failed", CONFIG_ERROR: "config error", STOPPED: "stopped after a checkpoint"}


def describe(code: int) -> str:
    """Human-readable meaning of an exit code (as a shell reports it)."""
    if code in _NAMES:
        return _NAMES[code]
    if code > 128:
        return f"killed by signal {code - 128}"
    return f"failed with exit code {code}"
