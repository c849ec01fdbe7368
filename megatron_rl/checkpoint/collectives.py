"""The checkpoint's own gloo process group, so a save's collectives finish on its background thread.

A save exchanges the ranks' plan digests (and, when they changed, the chunk lists). A
copy-at-save save issues the digest exchange from the training thread, after waiting for
every save in flight, and waits for it on the background thread. A deferred save issues it
on the background writer thread, where queued saves run one after another. Either way the
group sees the same sequence of collectives on every rank, and a separate group keeps them
out of the way of the collectives the training loop issues meanwhile. The group itself is
created on the training thread (``store.save_items``), where every rank creates its groups
in the same order.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

_group: Optional[tuple[object, object]] = None  # (default group it was made under, checkpoint group)


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def checkpoint_group():
    """Collective on first use (every rank saves at the same point): a gloo group over all ranks."""
    global _group
    default = dist.group.WORLD
    if _group is None or _group[0] is not default:
        _group = (default, dist.new_group(backend="gloo"))
    return _group[1]


def start_digest_gather(digest: str) -> Callable[[], list[str]]:
    """Start gathering every rank's digest (hex); the returned function waits for the result."""
    rank, size = world()
    if size == 1:
        return lambda: [digest]
    mine = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.uint8)
    out = [torch.empty_like(mine) for _ in range(size)]
    work = dist.all_gather(out, mine, group=checkpoint_group(), async_op=True)

    def result() -> list[str]:
        work.wait()
        return [bytes(t.tolist()).hex() for t in out]

    return result


def gather_objects(obj) -> list:
    """Every rank's ``obj`` (JSON-like), over the checkpoint group."""
    rank, size = world()
    if size == 1:
        return [obj]
    out: list = [None] * size
    dist.all_gather_object(out, obj, group=checkpoint_group())
    return out
