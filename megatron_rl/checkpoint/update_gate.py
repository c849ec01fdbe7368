"""Hold optimizer updates until a deferred snapshot has copied the state they would change.

An async save with ``snapshot="before_update"`` returns without copying anything: the
background writer first copies this rank's share from the live tensors into host buffers,
then writes. In a training step only the optimizer's update changes parameters and
optimizer state in place, so a step pre-hook on every inner torch optimizer of the saved
state waits for that copy. In RL a whole rollout (and the old-logprob passes, which only
read the weights) sits between a save and the next update, so the copy is usually done
before anyone waits. Code that writes saved tensors some other way must call
:meth:`UpdateGate.wait` (``Checkpointer.wait_snapshot()``) first.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Iterable

import torch


class UpdateGate:
    """A checkpointer's gate: hooks each optimizer once; an optimizer waits for the newest
    snapshot of a save that included it (queued saves copy in order, so earlier ones are done)."""

    def __init__(self) -> None:
        self._holds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._hooks: list = []  # handles of the step pre-hooks, removed by release()
        self._snapshots: list[threading.Event] = []
        self.waited_s = 0.0
        """Total time updates waited for a snapshot (for the trainer's metrics)."""

    def hold(self, optimizers: Iterable[torch.optim.Optimizer], copied: threading.Event) -> None:
        """Until ``copied`` is set, a ``step()`` of any of ``optimizers`` waits for it."""
        for optimizer in optimizers:
            if optimizer not in self._holds:
                self._hooks.append(optimizer.register_step_pre_hook(self._before_step))
            self._holds[optimizer] = copied
        self._snapshots = [e for e in self._snapshots if not e.is_set()] + [copied]

    def _before_step(self, optimizer, args, kwargs) -> None:
        self._wait_for([self._holds.get(optimizer)])

    def release(self) -> None:
        """Unhook the optimizers (after :meth:`wait`: a hold released early lets an update
        race its copy)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._holds = weakref.WeakKeyDictionary()

    def wait(self) -> float:
        """Block until every snapshot in flight is copied; returns the seconds waited."""
        return self._wait_for(self._snapshots)

    def _wait_for(self, events) -> float:
        pending = [e for e in events if e is not None and not e.is_set()]
        if not pending:
            return 0.0
        start = time.perf_counter()
        for event in pending:
            event.wait()
        waited = time.perf_counter() - start
        self.waited_s += waited
        return waited
