"""A buffer that every rank of one host maps: the same-host transport of the bucketed export.

When all ranks run on one CPU host (the colocated CPU setup, a laptop, CI), gathering a
bucket by gloo broadcasts moves every byte through loopback TCP and then copies it again
into the HF tensors. With a shared arena each owner instead writes its pieces straight
into their places in the HF tensors, once, and every rank reads the finished bucket in
place: a bucket costs each rank only its own share of the copies, and the host holds one
bucket instead of one per rank. torch.distributed still orders the phases (barriers).

The arena is a file in /dev/shm that is unlinked as soon as every rank has mapped it,
so a crashed run leaves nothing behind. Where /dev/shm cannot hold it, or ranks span
hosts, or tensors live on a GPU, the caller keeps the broadcast transport.
"""

from __future__ import annotations

import os
import socket
import uuid
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

SHM_DIR = Path("/dev/shm")
TRANSPORT_ENV = "MEGATRON_RL_GATHER"
"""``auto`` (default: the shared arena where every rank is on this host), ``broadcast``."""
TRANSPORTS = ("auto", "broadcast")


def transport_setting() -> str:
    value = os.environ.get(TRANSPORT_ENV, "auto")
    if value not in TRANSPORTS:
        raise ValueError(f"{TRANSPORT_ENV}={value!r}; allowed: {', '.join(TRANSPORTS)}")
    return value


def _host_identity() -> str:
    """Same string on ranks that share memory: hostname and this boot of the kernel."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def all_ranks_on_this_host() -> bool:
    """Collective over the default group (metadata only)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    identities: list = [None] * dist.get_world_size()
    dist.all_gather_object(identities, _host_identity())
    return len(set(identities)) == 1


def open_shared(nbytes: int, tag: str) -> Optional[torch.Tensor]:
    """A ``uint8`` tensor of ``nbytes`` mapped by every rank (collective), or None when
    /dev/shm cannot hold it (then every rank gets None, with one warning)."""
    name = [None]
    if dist.get_rank() == 0:
        name[0] = _create(nbytes, tag)
    dist.broadcast_object_list(name, src=0)
    if name[0] is None:
        return None
    path = SHM_DIR / name[0]
    try:
        arena = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    finally:
        dist.barrier()  # every rank has mapped it (or failed): the name is no longer needed
        if dist.get_rank() == 0:
            path.unlink(missing_ok=True)
    return arena


def _create(nbytes: int, tag: str) -> Optional[str]:
    name = f"megatron_rl-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as err:
        warnings.warn(f"shared gather arena unavailable ({err}); using broadcasts", stacklevel=3)
        return None
    try:
        # Reserve the pages now: a tmpfs that runs out of room while being written kills
        # the writer with SIGBUS; fallocate fails cleanly instead.
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError as err:
        os.close(fd)
        path.unlink(missing_ok=True)
        warnings.warn(
            f"/dev/shm cannot hold a {nbytes / 2**20:.0f} MiB gather arena ({err}); "
            f"using broadcasts (a smaller rollout bucket size fits)",
            stacklevel=3,
        )
        return None
    os.close(fd)
    return name
