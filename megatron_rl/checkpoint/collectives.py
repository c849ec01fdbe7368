"""The checkpoint's own gloo process group, so a save's collectives finish on its background thread.

A save exchanges the ranks' plan digests (and, when they changed, the chunk lists). A
copy-at-save save issues the digest exchange from the training thread, after waiting for
every save in flight, and waits for it on the background thread. A deferred save issues it
on the background writer thread, where queued saves run one after another. Either way the
group sees the same sequence of collectives on every rank, and a separate group keeps them
out of the way of the collectives the training loop issues meanwhile. The group itself is
created on the training thread (``Checkpointer.save_items``), where every rank creates its
groups in the same order.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class CheckpointGroup:
    """One checkpointer's gloo group over all ranks and the exchanges a save makes on it.

    Created on first use (a collective: every rank saves at the same point), and again when
    the default group it was made under has been replaced (a new ``init_process_group``).
    """

    def __init__(self) -> None:
        self._made: Optional[tuple[object, object]] = None  # (default group it was made under, group)

    def get(self):
        """The group (collective on first use)."""
        default = dist.group.WORLD
        if self._made is None or self._made[0] is not default:
            self._made = (default, dist.new_group(backend="gloo"))
        return self._made[1]

    def forget(self) -> None:
        """Drop the reference (the group goes with ``destroy_process_group()``: destroying it
        here is not safe while another rank may still be finishing its last exchange)."""
        self._made = None

    def start_digest_gather(self, digest: str) -> Callable[[], list[str]]:
        """Start gathering every rank's digest (hex); the returned function waits for the result."""
        rank, size = world()
        if size == 1:
            return lambda: [digest]
        mine = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(size)]
        work = dist.all_gather(out, mine, group=self.get(), async_op=True)

        def result() -> list[str]:
            work.wait()
            return [bytes(t.tolist()).hex() for t in out]

        return result

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj`` (JSON-like), over the checkpoint group."""
        rank, size = world()
        if size == 1:
            return [obj]
        out: list = [None] * size
        dist.all_gather_object(out, obj, group=self.get())
        return out
