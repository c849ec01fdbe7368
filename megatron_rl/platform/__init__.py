"""Device and backend choice: CUDA + NCCL when a GPU is present, else CPU + gloo.

This package is the only place that knows which one it is. Everything else asks for
``current().device`` and wraps Megatron-Core calls in :func:`megatron_scope`, which on
CPU activates the compatibility layer (:mod:`.cpu_compat`) and on GPU does nothing.
Every patch of a dependency lives here: Megatron-Core's in :mod:`.cpu_compat` (and fixes
of its release in :mod:`.megatron_fixes`), vLLM's CPU backend's in :mod:`.vllm_compat`
(installed by the rollout engine on CPU), torch's gloo groups' in :mod:`.torch_compat`; all
four lists use the :mod:`.patch` form. So does
every read of a dependency's private API: one accessor per use, named by dependency
(:mod:`.megatron_internals`, :mod:`.vllm_internals`, :mod:`.torch_internals`,
:mod:`.python_internals`), each stating the release it was read from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Iterator

import torch

from megatron_rl.platform import megatron_fixes


@dataclasses.dataclass(frozen=True)
class Platform:
    device: torch.device
    backend: str  # torch.distributed backend

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


@functools.lru_cache(maxsize=1)
def current() -> Platform:
    """Detect the platform once per process and install what it needs."""
    megatron_fixes.install()
    if torch.cuda.is_available() and os.environ.get("MEGATRON_RL_FORCE_CPU") != "1":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return Platform(torch.device("cuda", local_rank), "nccl")
    from megatron_rl.platform import cpu_compat, torch_compat

    # Tests that show a patch is needed switch it off here (comma-separated names).
    exclude = tuple(n for n in os.environ.get("MEGATRON_RL_CPU_PATCHES_EXCLUDE", "").split(",") if n)
    torch_compat.install(exclude=exclude)
    cpu_compat.install(exclude=tuple(n for n in exclude if n not in torch_compat.patch_names()))
    return Platform(torch.device("cpu"), "gloo")


@contextlib.contextmanager
def megatron_scope() -> Iterator[None]:
    """Wrap calls into Megatron-Core (build, forward/backward, optimizer, checkpoint)."""
    if current().is_cuda:
        yield
        return
    from megatron_rl.platform import cpu_compat

    with cpu_compat.cuda_to_cpu_scope():
        yield


def launch_env() -> tuple[int, int]:
    """This process's (rank, world size) in its launch: torchrun's variables, srun's, or a
    plain single process (world 1 on a free local port); the torchrun names are filled in."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:  # srun without torchrun
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    if "RANK" not in env:  # plain single process
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(_free_port()))
    return int(env["RANK"]), int(env["WORLD_SIZE"])


def init_distributed(timeout_s: float = 600.0) -> None:
    """Create the default process group from torchrun/srun environment (world 1 alone)."""
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        return
    launch_env()
    plat = current()
    dist.init_process_group(
        backend=plat.backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=plat.device if plat.is_cuda else None,
    )


def init_distributed_on_store(store, rank: int, world_size: int, timeout_s: float) -> None:
    """The default process group over ``world_size`` ranks that meet in ``store`` (a prefix of
    the launch's store): a launch split into roles gives each role a world of its own."""
    import datetime

    import torch.distributed as dist

    plat = current()
    dist.init_process_group(
        backend=plat.backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=plat.device if plat.is_cuda else None,
    )


def process_group_on_store(store, rank: int, world_size: int, timeout_s: float):
    """A process group outside the default world (between roles), used through its own
    methods: gloo on CPU; on GPU NCCL (written from torch's sources, untested on GPU)."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if current().is_cuda:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transformer_config_overrides() -> dict:
    """TransformerConfig fields this platform needs (CPU: no fused CUDA kernels)."""
    if current().is_cuda:
        return {}
    return dict(
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # gloo: batched p2p gave wrong losses with the interleaved schedule at PP=2.
        batch_p2p_comm=False,
        batch_p2p_sync=False,
    )
