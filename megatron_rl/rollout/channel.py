"""Messages over the bridge between training rank 0 and the rollout ranks.

The bridge is two process groups outside either role's default world
(:mod:`megatron_rl.launch.roles`), one per direction: *down* carries commands (and weight
buckets) from training rank 0 to every rollout rank, *up* carries rollout rank 0's answers
back. They are used through the groups' own methods rather than ``torch.distributed``'s
functions (which only know groups of the default world).

A gloo send completes only once the receiver has posted its receive, so each side keeps a
:class:`Inbox`: a thread that always waits on its direction's group and queues what
arrives. Neither side then blocks on a send while the other is busy (generating, or
training), which is what lets rollouts run ahead of training. Objects travel pickled in a
byte tensor behind their length; tensors are broadcast in place (no copy through pickle).
"""

from __future__ import annotations

import pickle
import queue
import threading
from typing import Any, Callable, Optional

import torch

TRAINER, ROLLOUT_LEADER = 0, 1
"""Bridge ranks: training rank 0, and the rollout rank that answers."""


class Channel:
    """Object and tensor messages over one process group (gloo on CPU). ``send_timeout_s``
    bounds how long a sender waits for the receivers (a frozen peer never posts its
    receive); None: as long as the group's own timeout."""

    def __init__(self, group, send_timeout_s: Optional[float] = None):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.send_timeout_s = send_timeout_s

    def broadcast_tensor(self, tensor: torch.Tensor, root: int = TRAINER) -> torch.Tensor:
        """``tensor`` from ``root`` into every member's ``tensor`` (same shape and dtype)."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = root
        self._wait(self.group.broadcast([tensor], options), sending=self.rank == root)
        return tensor

    def _wait(self, work, sending: bool) -> None:
        import datetime

        if sending and self.send_timeout_s is not None:
            work.wait(datetime.timedelta(seconds=self.send_timeout_s))  # raises RuntimeError when it expires
        else:
            work.wait()

    def broadcast_object(self, obj: Any = None, root: int = TRAINER) -> Any:
        """``obj`` from ``root`` to every member (others pass nothing and get it back)."""
        payload = _to_bytes(obj) if self.rank == root else None
        length = self.broadcast_tensor(torch.tensor([0 if payload is None else payload.numel()]), root)
        data = payload if payload is not None else torch.empty(int(length), dtype=torch.uint8)
        return pickle.loads(self.broadcast_tensor(data, root).numpy().tobytes())

    def send_object(self, obj: Any, dst: int) -> None:
        payload = _to_bytes(obj)
        self._wait(self.group.send([torch.tensor([payload.numel()])], dst, 0), sending=True)
        self._wait(self.group.send([payload], dst, 1), sending=True)

    def recv_object(self, src: int) -> Any:
        length = torch.zeros(1, dtype=torch.int64)
        self.group.recv([length], src, 0).wait()
        data = torch.empty(int(length), dtype=torch.uint8)
        self.group.recv([data], src, 1).wait()
        return pickle.loads(data.numpy().tobytes())


class Inbox:
    """A daemon thread that runs ``receive`` until it returns a message ``is_last`` accepts,
    queuing every message; :meth:`get` takes them in order. An exception in the thread is
    queued too and raised by the :meth:`get` that reaches it."""

    def __init__(self, receive: Callable[[], Any], is_last: Callable[[Any], bool], name: str):
        self._queue: queue.Queue = queue.Queue()
        self._receive, self._is_last = receive, is_last
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                message = self._receive()
            except Exception as err:  # the group broke or timed out: tell the reader
                self._queue.put(_Failure(err))
                return
            self._queue.put(message)
            if self._is_last(message):
                return

    def get(self, timeout: Optional[float] = None) -> Any:
        message = self._queue.get(timeout=timeout)
        if isinstance(message, _Failure):
            raise message.error
        return message


class _Failure:
    def __init__(self, error: Exception):
        self.error = error


def _to_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
