"""Patches of torch 2.13.0 for CPU runs, in the :mod:`.patch` form.

``gloo_shared_device``: on CPU every process group is gloo: Megatron-Core's layout groups,
their gloo twins, each checkpointer's group, vLLM's TP and PP groups. torch gives each gloo
group a transport device of its own, and each device runs an event-loop thread that wakes
every 10 ms even when nothing is sent. A rank of the world-8 test launch held about 300
groups, so 8 ranks woke 240,000 times a second on 2 cores; the ranks doing the work waited
behind them (docs/benchmarks.md, "One gloo device per process"). The patch gives every
group of a process one device, as gloo's API allows: a device serves any number of groups.

``vec_isa_probe_memo``: before inductor builds a C++ kernel (vLLM's CPU engine builds some
even when eager), it checks which vector instruction sets work here: it compiles a probe
kernel per set once, but loads each in a fresh interpreter in every process. That is six
probes on an AVX-512 machine, about 1 CPU-s of every rank's start (a fresh process that
imports torch and picks the ISA: 4.0 CPU-s with the probes, 3.0 with them remembered). The
patch remembers a probe that passed in inductor's cache directory, keyed by the machine's
CPU, the compiler, the flags, torch and the probe's code, so each probe loads once per
machine. A failed probe is not remembered: it runs again next time.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from megatron_rl.platform import torch_internals
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

VEC_ISA_PROBES_DIR = "megatron_rl-vec-isa-probes"
"""Under inductor's cache directory: one empty file per probe that passed on this machine."""


def cpu_identity() -> str:
    """The CPU's model and feature flags (the first processor's in /proc/cpuinfo): a passed
    probe is remembered for this kind of CPU only, should a cache directory be shared."""
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0].splitlines()
    except OSError:
        return os.uname().machine
    return "\n".join(line for line in lines if line.startswith(("model name", "flags")))


def vec_isa_probe_marker(isa, code: str) -> Path:
    key = "\0".join((cpu_identity(), torch_internals.vec_isa_probe_fingerprint(isa), code))
    name = hashlib.sha256(key.encode()).hexdigest()[:32]
    return Path(torch_internals.inductor_cache_dir()) / VEC_ISA_PROBES_DIR / name


def _remember_passed_probes(original):
    """``VecISA.check_build`` that answers a probe which passed here before from its marker,
    and otherwise runs it, leaving a marker (written whole, by rename) when it passes."""

    def check_build(self, code: str) -> bool:
        marker = vec_isa_probe_marker(self, code)
        if marker.is_file():
            return True
        passed = original(self, code)
        if passed:
            marker.parent.mkdir(parents=True, exist_ok=True)
            handle, staging = tempfile.mkstemp(dir=marker.parent, prefix=".probe-")
            os.close(handle)
            os.replace(staging, marker)
        return passed

    return check_build


VEC_ISA_PROBE_MEMO = Patch(
    "vec_isa_probe_memo",
    "torch._inductor.cpu_vec_isa",
    "VecISA.check_build",
    "cpu_vec_isa.VecISA.__bool__ and the AVX-512 bf16, VNNI and AMX checks (pick_vec_isa, "
    "which every C++ kernel inductor builds asks for)",
    _remember_passed_probes,
    why="every process loads each ISA's probe kernel in a fresh interpreter: six probes, "
    "about 1 CPU-s of every rank's start on an AVX-512 machine",
)

PATCHES: list[Patch] = [GLOO_SHARED_DEVICE, VEC_ISA_PROBE_MEMO]


def patch_names() -> list[str]:
    return [p.name for p in PATCHES]


def install(exclude: tuple[str, ...] = ()) -> None:
    """Apply every patch not named in ``exclude`` (names of other layers are ignored)."""
    for patch in PATCHES:
        patch.revert() if patch.name in exclude else patch.apply()
