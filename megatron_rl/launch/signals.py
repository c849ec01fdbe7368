"""Stop requests by signal, agreed on by every rank at the same step.

Slurm (or torchrun, or an operator) may signal only some ranks, and a signal lands at a
random point of a step. So the handler only sets a flag; once per step the loop calls
:meth:`StopSignals.agree`, an all-reduce (MAX) of the flag, and every rank gets the same
answer at the same step, checkpoints together and exits together.

SIGUSR1 means "save and get requeued" (`sbatch --signal=B:USR1@N`, `scancel --signal=USR1`,
or this node listed in the exclude file: an :class:`~megatron_rl.launch.exclude.ExcludeWatch`);
SIGTERM means "save and stop" (scancel, time limit, torchrun shutting workers down). SIGINT
(Ctrl-C at a terminal) means the same, said by a person: the step finishes, a checkpoint is
committed, one line says how to resume; a second Ctrl-C ends the process at once (the last
committed checkpoint stays, an unfinished save is never read back). When ranks saw different
signals, the strongest wins (SIGINT over SIGTERM over SIGUSR1): a cancel must not turn into
a requeue.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Optional

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
# Ranked so that MAX over ranks picks the strongest request.
_RANK = {0: 0, int(signal.SIGUSR1): 1, int(signal.SIGTERM): 2, int(signal.SIGINT): 3}
INTERRUPTED = 128 + int(signal.SIGINT)
"""The exit status of a second Ctrl-C, as a shell reports a process ended by SIGINT."""
_BY_RANK = {v: k for k, v in _RANK.items()}


class StopSignals:
    """Context manager: installs the handlers on enter, restores the previous ones on exit."""

    def __init__(self, signals=STOP_SIGNALS, exclude=None):
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.received: Optional[signal.Signals] = None
        self.exclude = exclude
        """An ExcludeWatch (launch/exclude.py), or None: this node declared faulty counts as SIGUSR1."""
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        sig = signal.Signals(signum)
        if sig == signal.SIGINT and self.received == signal.SIGINT:
            _stop_at_once()
        if self.received is None or _RANK[int(sig)] > _RANK[int(self.received)]:
            self.received = sig

    def __enter__(self) -> "StopSignals":
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def agree(self, group=None) -> Optional[signal.Signals]:
        """Collective: the strongest stop signal any rank has received, or None.

        Call it at the same point of every step on every rank of ``group`` (default: world).
        Without an initialised process group it answers for this process alone.
        """
        import torch
        import torch.distributed as dist

        if self.received is None and self.exclude is not None and self.exclude.listed():
            print(
                f"this node ({self.exclude.node}) is listed in {self.exclude.path}: stopping after a "
                "checkpoint, to requeue without it",
                flush=True,
            )
            self.received = signal.SIGUSR1
        local = _RANK[int(self.received)] if self.received is not None else 0
        if dist.is_available() and dist.is_initialized():
            nccl = dist.get_backend(group) == "nccl"
            flag = torch.tensor([local], dtype=torch.int64, device=torch.cuda.current_device() if nccl else "cpu")
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            local = int(flag.item())
        return signal.Signals(_BY_RANK[local]) if local else None


_WHY = {signal.SIGUSR1: "a requeue", signal.SIGTERM: "cancel or time limit", signal.SIGINT: "Ctrl-C"}


def stop_line(sig: signal.Signals, step: int, checkpoint_dir) -> str:
    """The one line a run stopped by ``sig`` ends with: why, where its checkpoint is, and how
    to go on (the same command resumes from the newest committed checkpoint of the run dir)."""
    return (
        f"stopped on {sig.name} after step {step} ({_WHY[sig]}); checkpoint saved in {checkpoint_dir}; "
        "the same command resumes from it"
    )


def _stop_at_once() -> None:
    """The second Ctrl-C: no step end, no save, no traceback. Committed checkpoints are
    whole files behind a commit marker, so an interrupted save only leaves a step that
    resuming skips."""
    print(
        "megatron-rl: second Ctrl-C: stopping now, without a checkpoint of this step",
        file=sys.stderr,
        flush=True,
    )
    os._exit(INTERRUPTED)
