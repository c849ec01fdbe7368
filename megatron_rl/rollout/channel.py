"""Messages over the bridge between training rank 0 and the rollout ranks.

The bridge is a process group outside either role's default world
(:mod:`megatron_rl.launch.roles`), so it is used through the group's own methods rather
than ``torch.distributed``'s functions (which only know groups of the default world).
Two kinds of traffic: Python objects (commands, prompts, samples, check results), pickled
into a byte tensor behind its length; and tensors broadcast in place (weight buckets, with
no copy through pickle). Bridge rank 0 (training rank 0) sends every command to all
rollout ranks; rollout rank 0 (bridge rank 1) answers.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

TRAINER, ROLLOUT_LEADER = 0, 1
"""Bridge ranks: training rank 0, and the rollout rank that answers."""


class Channel:
    """Object and tensor messages over one process group (gloo on CPU)."""

    def __init__(self, group):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()

    def broadcast_tensor(self, tensor: torch.Tensor, root: int = TRAINER) -> torch.Tensor:
        """``tensor`` from ``root`` into every member's ``tensor`` (same shape and dtype)."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = root
        self.group.broadcast([tensor], options).wait()
        return tensor

    def broadcast_object(self, obj: Any = None, root: int = TRAINER) -> Any:
        """``obj`` from ``root`` to every member (others pass nothing and get it back)."""
        payload = _to_bytes(obj) if self.rank == root else None
        length = self.broadcast_tensor(torch.tensor([0 if payload is None else payload.numel()]), root)
        data = payload if payload is not None else torch.empty(int(length), dtype=torch.uint8)
        return pickle.loads(self.broadcast_tensor(data, root).numpy().tobytes())

    def send_object(self, obj: Any, dst: int) -> None:
        payload = _to_bytes(obj)
        self.group.send([torch.tensor([payload.numel()])], dst, 0).wait()
        self.group.send([payload], dst, 1).wait()

    def recv_object(self, src: int) -> Any:
        length = torch.zeros(1, dtype=torch.int64)
        self.group.recv([length], src, 0).wait()
        data = torch.empty(int(length), dtype=torch.uint8)
        self.group.recv([data], src, 1).wait()
        return pickle.loads(data.numpy().tobytes())


def _to_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
