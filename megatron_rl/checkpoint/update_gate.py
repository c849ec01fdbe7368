"""Hold optimizer updates until a deferred snapshot has copied the state they would change.

An async save with ``snapshot="before_update"`` returns without copying anything: the
background writer first copies this rank's share from the live tensors into host buffers,
then writes. In a training step only the optimizer's update changes parameters and
optimizer state in place, so a step pre-hook on every inner torch optimizer of the saved
state waits for that copy. In RL a whole rollout (and the old-logprob passes, which only
read the weights) sits between a save and the next update, so the copy is usually done
before anyone waits. Code that writes saved tensors some other way must call
:meth:`UpdateGate.wait` (``checkpoint.wait_snapshot()``) first.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Iterable, Optional

import torch


class UpdateGate:
    """The process's one gate: hooks each optimizer once, holds them on the newest snapshot
    (saves run one after another, so an earlier snapshot is always copied by then)."""

    def __init__(self) -> None:
        self._hooked: weakref.WeakSet = weakref.WeakSet()
        self._copied: Optional[threading.Event] = None
        self.waited_s = 0.0
        """Total time updates waited for a snapshot (for the trainer's metrics)."""

    def hold(self, optimizers: Iterable[torch.optim.Optimizer], copied: threading.Event) -> None:
        """Until ``copied`` is set, a ``step()`` of any of ``optimizers`` waits for it."""
        for optimizer in optimizers:
            if optimizer not in self._hooked:
                optimizer.register_step_pre_hook(self._before_step)
                self._hooked.add(optimizer)
        self._copied = copied

    def _before_step(self, optimizer, args, kwargs) -> None:
        self.wait()

    def wait(self) -> float:
        """Block until the pending snapshot (if any) is copied; returns the seconds waited."""
        copied = self._copied
        if copied is None or copied.is_set():
            return 0.0
        start = time.perf_counter()
        copied.wait()
        waited = time.perf_counter() - start
        self.waited_s += waited
        return waited
