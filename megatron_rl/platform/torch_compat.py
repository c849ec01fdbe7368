"""Patches of torch 2.13.0's distributed package for CPU runs, in the :mod:`.patch` form.

On CPU every process group is gloo: Megatron-Core's layout groups, their gloo twins, each
checkpointer's group, vLLM's TP and PP groups. torch gives each gloo group a transport
device of its own, and each device runs an event-loop thread that wakes every 10 ms even
when nothing is sent. A rank of the world-8 test launch held about 300 groups, so 8 ranks
woke 240,000 times a second on 2 cores; the ranks doing the work waited behind them
(docs/benchmarks.md, "One gloo device per process"). The patch below gives every group of
a process one device, as gloo's API allows: a device serves any number of groups.
"""

from __future__ import annotations

import os

from megatron_rl.platform.patch import Patch

TORCH_VERSION = "2.13.0"
"""The torch release these patches were written for."""


def _gloo_devices(backend_class) -> list:
    """The transport devices torch 2.13.0 creates for a new gloo group: one per interface
    named in ``GLOO_SOCKET_IFNAME``, else one on the address this host's name resolves to
    (its pybind constructor, read from torch/csrc/distributed/c10d/init.cpp)."""
    interfaces = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if len(interfaces) > 1:
        return [backend_class.create_device(interface=name) for name in interfaces.split(",")]
    return [backend_class.create_default_device()]


def _one_device_per_process(original):
    """A ``ProcessGroupGloo`` whose groups share this process's devices, made on first use.
    A subclass, so torch's ``isinstance`` checks still hold; options as torch sets them
    (two worker threads per device, the caller's timeout)."""
    shared: list = []

    class SharedDeviceGloo(original):
        def __init__(self, store, rank, size, timeout):
            if not shared:
                shared.extend(_gloo_devices(original))
            options = original._Options()
            options._devices = list(shared)
            options._threads = 2 * len(shared)
            options._timeout = timeout
            super().__init__(store, rank, size, options)

    return SharedDeviceGloo


GLOO_SHARED_DEVICE = Patch(
    "gloo_shared_device",
    "torch.distributed.distributed_c10d",
    "ProcessGroupGloo",
    "distributed_c10d._new_process_group_helper for the gloo backend (init_process_group, "
    "new_group, new_subgroups_by_enumeration: every gloo group torch creates)",
    _one_device_per_process,
    why="one event-loop thread per group, each polling 100 times a second: idle groups took "
    "half the CPU of the world-8 test launch",
)

PATCHES: list[Patch] = [GLOO_SHARED_DEVICE]


def patch_names() -> list[str]:
    return [p.name for p in PATCHES]


def install(exclude: tuple[str, ...] = ()) -> None:
    """Apply every patch not named in ``exclude`` (names of other layers are ignored)."""
    for patch in PATCHES:
        patch.revert() if patch.name in exclude else patch.apply()
