"""Weight-sync benchmark: a sharded Megatron actor into a colocated vLLM engine.

One torchrun launch builds one HF model (a qwen3 / qwen3_moe size preset or ``--hf DIR``)
and one vLLM engine per rank (vLLM's parallel groups are process-wide, so the engine
outlives the Megatron layouts). For each Megatron layout and bucket size it times
:class:`megatron_rl.rollout.sync.WeightSync` and, to say where the time goes, its two
halves run alone: the gather (iterating ``iter_hf_buckets``, no engine) and the engine's
load (the same buckets, pre-gathered). The yardstick is a plain ``copy_`` of the
same bytes into preallocated tensors of the same shapes, timed in the same run on rank 0
alone (the issue's target: sync <= 3x that copy on CPU) and on every rank at once (the
same core sharing the sync sees). Peak memory is the extra above the pre-sync level:
VmHWM reset through /proc/self/clear_refs on CPU, ``max_memory_allocated`` on GPU; the
gather buffers the sync keeps between syncs on CPU (one bucket plus one receive buffer)
are reported apart ("kept MB"), as they are already there before the timed syncs.

With ``--lora-rank R`` the actor has LoRA adapters on its dense linears, which the full syncs
merge in (``model.lora.sync: merged``, an engine without a LoRA slot). With ``--lora-sync
adapter`` the engine has a LoRA slot and one more row per layout times the adapters alone
into it (``sync: adapter``). vLLM allows one engine per process, so the two modes are two
launches, each against the plain copy of the full bytes in its own run; an engine with a
slot takes vLLM's own reload for a full sync (the in-place loader does not know vLLM's
LoRA-wrapped layers), so its merged rows are slower than the merged launch's.

    torchrun --nproc-per-node=2 tools/bench_weight_sync.py --preset cpu-dense-9m
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import math
import os
import platform as host
import re
import statistics
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from megatron_rl.models.hf_config import ModelArch
from megatron_rl.parallel.config import LayoutError, ParallelConfig
from megatron_rl.utils import dtypes
from megatron_rl_lab.bench.args import (
    BenchArgumentError,
    bench_parser,
    positive,
    positive_list,
    run_checked,
    save_json,
    world_size,
)
from megatron_rl_lab.bench.presets import PRESETS, resolve_model

DESCRIPTION = (
    "Time the Megatron -> vLLM weight sync per layout and bucket size (run under torchrun): "
    "seconds, GB/s, peak extra memory, the gather / vLLM-load split, and the ratio to a plain "
    "copy of the same bytes."
)
EPILOG = """\
examples:
  torchrun --nproc-per-node=2 tools/bench_weight_sync.py --preset cpu-dense-9m
  torchrun --nproc-per-node=4 tools/bench_weight_sync.py --preset cpu-moe-14m --vllm-tp 2 \\
      --layouts tp2,pp2,ep2,tp2_ep2_etp1 --bucket-mb 16,64,512 --json ws.json
  torchrun --nproc-per-node=2 tools/bench_weight_sync.py --hf /path/to/hf_model --dtype bf16

Layouts are '_'-joined sizes: tp2, pp2, ep2, tp2_pp2, tp2_ep2_etp1, tp1 (DP only); those
that do not fit the world size or the model are skipped (listed in the output).
"""


_LAYOUT_PART = re.compile(r"^(tp|pp|vpp|cp|ep|etp)(\d+)$")
_LAYOUT_FIELDS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "vpp": "virtual_pipeline_model_parallel_size",
    "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
}
_MB = 1 << 20
DEFAULT_PRESET = "cpu-dense-9m"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one run does (identical on every rank)."""

    arch: ModelArch
    model_label: str
    hf_dir: Optional[Path]
    """An existing HF model (``--hf``), or None: rank 0 writes the preset under work_dir."""
    work_dir: Path
    layouts: tuple[tuple[str, ParallelConfig], ...]
    skipped: tuple[str, ...]
    """'name: why' for each requested layout that does not fit."""
    bucket_bytes: tuple[int, ...]
    dtype: str
    vllm_tp: int
    iterations: int
    warmup: int
    copy_repeats: int
    kv_cache_gib: int
    cpu_linear: str
    json_path: Path
    lora_rank: int = 0
    """> 0: every layout gets LoRA adapters of this rank on its dense linears, which the full
    syncs merge in."""
    lora_sync: str = "merged"
    """With lora_rank: ``adapter`` gives the engine a LoRA slot and adds a row per layout
    timing the adapters alone into it; ``merged``: no slot, the full syncs only."""


# ---- arguments -----------------------------------------------------------------------


def parse_layout(text: str) -> ParallelConfig:
    """'tp2_ep2_etp1' -> ParallelConfig; ValueError naming the bad part."""
    sizes: dict[str, int] = {}
    for part in text.split("_"):
        match = _LAYOUT_PART.match(part)
        if not match:
            raise ValueError(
                f"layout {text!r}: {part!r} is not <kind><size> with kind one of {', '.join(_LAYOUT_FIELDS)}"
            )
        kind, size = match.group(1), int(match.group(2))
        if kind in sizes:
            raise ValueError(f"layout {text!r} gives {kind} twice")
        sizes[kind] = size
    fields = {_LAYOUT_FIELDS[k]: v for k, v in sizes.items()}
    if fields.get("virtual_pipeline_model_parallel_size") == 1:
        fields["virtual_pipeline_model_parallel_size"] = None
    try:
        return ParallelConfig(**fields)
    except TypeError as err:
        raise ValueError(f"layout {text!r}: {err}") from None


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    model = p.add_mutually_exclusive_group()
    model.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=None,
        metavar="PRESET",
        help=f"model to generate (default {DEFAULT_PRESET}; one of {', '.join(PRESETS)}); "
        "written once under --work-dir",
    )
    model.add_argument("--hf", type=Path, default=None, help="an existing HF model directory instead")
    p.add_argument(
        "--layouts",
        default="tp2,pp2,ep2,tp2_ep2_etp1",
        help="comma-separated Megatron layouts, e.g. tp2,pp2,ep2,tp2_ep2_etp1 (default)",
    )
    p.add_argument(
        "--bucket-mb",
        type=positive_list(float, "16,64,512"),
        default=[16.0, 64.0, 512.0],
        metavar="16,64,512",
        help="sync bucket sizes in MiB",
    )
    p.add_argument("--vllm-tp", type=positive, default=1, help="vLLM tensor_parallel_size (divides the world)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="Megatron and vLLM weights")
    p.add_argument("--iterations", type=positive, default=3, help="timed syncs per layout x bucket")
    p.add_argument("--warmup", type=int, default=1, help="untimed syncs first")
    p.add_argument("--copy-repeats", type=positive, default=5, help="timed plain copies (median)")
    p.add_argument(
        "--cpu-linear",
        choices=("packed", "plain"),
        default="packed",
        help="CPU: vLLM's linear weights packed for oneDNN (vLLM's default) or plain (torch's linear)",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=positive,
        default=1,
        help="vLLM KV cache per rank on CPU (whole GiB: vLLM reads VLLM_CPU_KVCACHE_SPACE as an int)",
    )
    p.add_argument(
        "--lora-rank",
        type=positive,
        default=None,
        help="LoRA adapters of this rank on QKV, the attention output, FC1 and FC2 (dense models), merged in by "
        "the full syncs",
    )
    p.add_argument(
        "--lora-sync",
        choices=("merged", "adapter"),
        default="merged",
        help="with --lora-rank: 'adapter' builds the engine with a LoRA slot and adds a row per layout syncing the "
        "adapters alone into it; 'merged': no slot (as the trainer's merged mode)",
    )
    p.add_argument(
        "--work-dir", type=Path, default=Path("runs/bench/weight_sync"), help="generated models and compile caches"
    )
    p.add_argument(
        "--json", type=Path, default=None, help="results file (default <work-dir>/weight_sync_<model>_world<W>.json)"
    )
    return p


def add_parser(sub) -> argparse.ArgumentParser:
    """The ``weight-sync`` subcommand for ``megatron-rl bench``."""
    p = bench_parser(
        sub,
        "weight-sync",
        help="Megatron -> vLLM weight sync: time, GB/s, memory, vs a plain copy",
        description=DESCRIPTION,
        epilog=EPILOG,
    )
    return add_arguments(p)


def _resolve_model(args) -> tuple[ModelArch, str, Optional[Path]]:
    if args.hf is not None:
        if not (args.hf / "config.json").is_file():
            raise BenchArgumentError(f"--hf {args.hf}: no config.json there (an HF model directory is needed)")
        try:
            return resolve_model(str(args.hf)), args.hf.name or "model", args.hf
        except ValueError as err:
            raise BenchArgumentError(f"--hf {args.hf}: {err}") from None
    name = args.preset or DEFAULT_PRESET
    return PRESETS[name], name, None


def make_plan(args: argparse.Namespace, world: int) -> Plan:
    """The run's plan from parsed arguments; BenchArgumentError when nothing can run."""
    arch, label, hf_dir = _resolve_model(args)
    if world % args.vllm_tp:
        raise BenchArgumentError(f"--vllm-tp {args.vllm_tp} must divide the world size {world}")
    if args.warmup < 0:
        raise BenchArgumentError(f"--warmup {args.warmup} must be >= 0")
    if args.lora_rank and arch.is_moe:
        raise BenchArgumentError(
            f"--lora-rank needs a dense model ({label} is MoE): vLLM 0.32 builds a MoE model with a LoRA slot "
            "only on GPU"
        )
    layouts, skipped = [], []
    for name in [n.strip() for n in args.layouts.split(",") if n.strip()]:
        try:
            layout = parse_layout(name)
        except ValueError as err:
            raise BenchArgumentError(str(err)) from None
        try:
            layout.validate(world, arch.shape())
        except LayoutError as err:
            skipped.append(f"{name}: {err}")
            continue
        layouts.append((name, layout))
    if not layouts:
        hint = " (run it under torchrun --nproc-per-node=2 or more, or pass --layouts tp1)" if world == 1 else ""
        raise BenchArgumentError(
            f"none of --layouts {args.layouts} fits world size {world} and this model{hint}: " + "; ".join(skipped)
        )
    json_path = args.json or args.work_dir / f"weight_sync_{label}_world{world}.json"
    return Plan(
        arch=arch,
        model_label=label,
        hf_dir=hf_dir,
        work_dir=args.work_dir,
        layouts=tuple(layouts),
        skipped=tuple(skipped),
        bucket_bytes=tuple(int(mb * _MB) for mb in args.bucket_mb),
        dtype=dtypes.long_name(args.dtype),
        vllm_tp=args.vllm_tp,
        iterations=args.iterations,
        warmup=args.warmup,
        copy_repeats=args.copy_repeats,
        kv_cache_gib=args.kv_cache_gib,
        cpu_linear=args.cpu_linear,
        json_path=json_path,
        lora_rank=args.lora_rank or 0,
        lora_sync=args.lora_sync,
    )


# ---- measurement -----------------------------------------------------------------------


def _cuda() -> bool:
    from megatron_rl import platform

    return platform.current().is_cuda


def _current_memory(cuda: bool) -> int:
    import torch

    if cuda:
        return int(torch.cuda.memory_allocated())
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _measure(fn: Callable[[], object]) -> tuple[float, float, int]:
    """(wall seconds, this process's CPU seconds, peak bytes above the start level) of ``fn``.

    CPU seconds exclude time spent waiting, for the network or for a core: on a shared
    host they show what the work itself costs.
    """
    import torch

    from megatron_rl_lab.bench import hardware

    cuda = _cuda()
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
    hardware.reset_peak_memory(cuda)  # also returns freed heap pages to the OS on CPU
    before = _current_memory(cuda)
    start, cpu_start = time.perf_counter(), time.process_time()
    fn()
    if cuda:
        torch.cuda.synchronize()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return seconds, cpu_seconds, max(hardware.peak_memory_bytes(cuda) - before, 0)


@dataclasses.dataclass
class Timing:
    """Repeated collective runs of one phase: per run the slowest rank."""

    wall_s: list[float]
    cpu_s: list[float]
    peak_bytes: int
    """The largest peak of any run on any rank."""

    @property
    def wall(self) -> float:
        return statistics.median(self.wall_s)

    @property
    def cpu(self) -> float:
        return statistics.median(self.cpu_s)


def _repeat(fn: Callable[[], object], times: int) -> Timing:
    import torch.distributed as dist

    from megatron_rl_lab.bench import hardware

    timing = Timing([], [], 0)
    for _ in range(times):
        dist.barrier()
        wall, cpu, peak = hardware.max_over_ranks(list(map(float, _measure(fn))))
        timing.wall_s.append(wall)
        timing.cpu_s.append(cpu)
        timing.peak_bytes = max(timing.peak_bytes, int(peak))
    return timing


def _copy_seconds(sources: list, repeats: int) -> tuple[list[float], list[float]]:
    """(wall, CPU) seconds of a plain copy_ of ``sources`` into preallocated same-shape tensors."""
    import torch

    targets = [torch.empty_like(t) for t in sources]
    cuda = _cuda()

    def copy_all():
        for dst, src in zip(targets, sources):
            dst.copy_(src)
        if cuda:
            torch.cuda.synchronize()

    copy_all()  # touch the target pages once: a real buffer is reused, not freshly mapped
    walls, cpus = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        copy_all()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu_start)
    return walls, cpus


def _plain_copy(sources: list, repeats: int) -> dict:
    """Copy time of the same bytes: rank 0 alone (others wait), then every rank at once."""
    import torch.distributed as dist

    from megatron_rl_lab.bench import hardware

    alone = ([0.0] * repeats, [0.0] * repeats)
    dist.barrier()
    if dist.get_rank() == 0:
        alone = _copy_seconds(sources, repeats)
    alone_wall, alone_cpu = hardware.max_over_ranks(alone[0]), hardware.max_over_ranks(alone[1])
    dist.barrier()
    together = hardware.max_over_ranks(_copy_seconds(sources, repeats)[0])
    return {
        "copy_s": statistics.median(alone_wall),
        "copy_cpu_s": statistics.median(alone_cpu),
        "copy_all_ranks_s": statistics.median(together),
    }


def gather_received_bytes(chunks, arch: ModelArch) -> int:
    """Bytes this rank receives from other ranks during one gather (the network part)."""
    import torch.distributed as dist

    from megatron_rl.bridge import ExportPlans

    rank = dist.get_rank()
    total = 0
    for unit in ExportPlans().export_plan(chunks, arch).units:  # collective: a fresh plan
        itemsize = unit.dtype.itemsize
        for source in unit.sources:
            if source.owner != rank:
                total += sum(math.prod(part.shape) for part in source.parts) * itemsize
    return total


# ---- one layout ---------------------------------------------------------------------------


def _build_layout(plan: Plan, layout: ParallelConfig, hf_dir: Path):
    from megatron_rl.bridge import load_hf
    from megatron_rl.models.builder import BuildOptions, build_model
    from megatron_rl.parallel import initialize

    initialize(layout, seed=1, model=plan.arch.shape())
    options = BuildOptions(dtype=dtypes.short_name(plan.dtype), attention="sdpa" if plan.lora_rank else "auto")
    chunks = build_model("actor", plan.arch, layout, options)
    load_hf(chunks, hf_dir, plan.arch)
    if plan.lora_rank:
        _add_trained_adapters(chunks, plan.lora_rank)
    return chunks


LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")


def _add_trained_adapters(chunks, rank: int) -> None:
    """Adapters with a non-zero B (as after training: a merge then changes every adapted weight)."""
    import torch

    from megatron_rl.models.lora import LoraSettings, add_adapters

    with torch.no_grad():
        for adapter in add_adapters(chunks, LoraSettings(rank=rank, alpha=2.0 * rank, targets=LORA_TARGETS)).values():
            adapter.b.normal_(0.0, 0.01)


def bench_bucket(chunks, arch: ModelArch, engine, plan: Plan, bucket_bytes: int) -> dict:
    """Time sync / gather alone / load alone / plain copy for one bucket size (collective)."""

    from megatron_rl.bridge import PER_EXPERT, iter_hf_buckets
    from megatron_rl.rollout.adapter_sync import PolicySync
    from megatron_rl.rollout.replicas import Replicas
    from megatron_rl.rollout.sync import WeightSync

    dtype = dtypes.to_torch(plan.dtype)
    weight_sync = WeightSync(chunks, arch, Replicas(engine), bucket_bytes)
    merged = PolicySync(weight_sync)  # a LoRA actor's adapters merged in (nothing to merge without)
    stats = []
    for _ in range(plan.warmup):
        merged.sync()
    sync = _repeat(lambda: stats.append(merged.sync()), plan.iterations)
    last = stats[-1]
    kept = sum(t.numel() * t.element_size() for t in weight_sync.plans.buffers(chunks, arch, PER_EXPERT).tensors())

    def gather_only():  # the sync's own plans and buffers: its gather, without the engine
        for _ in iter_hf_buckets(chunks, arch, bucket_bytes, dtype=dtype, plans=weight_sync.plans):
            pass

    gather = _repeat(gather_only, plan.iterations)
    # The sync's own buckets, copied out of the reused bucket buffer: the load alone of what the sync loads.
    gathered = [
        [(n, t.clone()) for n, t in bucket]
        for bucket in iter_hf_buckets(chunks, arch, bucket_bytes, dtype=dtype, plans=weight_sync.plans)
    ]

    def load_only(buckets):  # an argument, not a closure: the `del gathered` below frees the list
        for bucket in buckets:
            engine.load_weights(bucket)
        engine.finish_weight_update()

    load = _repeat(functools.partial(load_only, gathered), plan.iterations)
    copy = _plain_copy([t for bucket in gathered for _, t in bucket], plan.copy_repeats)
    del gathered
    return {
        "bucket_mb": bucket_bytes / _MB,
        "buckets": last.buckets,
        "tensors": last.tensors,
        "bytes": last.bytes,
        "largest_bucket_mb": last.largest_bucket_bytes / _MB,
        "sync_s": sync.wall,
        "sync_s_all": sync.wall_s,
        "sync_cpu_s": sync.cpu,
        "gb_per_s": last.bytes / sync.wall / 1e9,
        "gather_s": gather.wall,
        "gather_cpu_s": gather.cpu,
        "load_s": load.wall,
        "load_cpu_s": load.cpu,
        "other_s": sync.wall - gather.wall - load.wall,
        **copy,
        "copy_gb_per_s": last.bytes / copy["copy_s"] / 1e9,
        "ratio_to_copy": sync.wall / copy["copy_s"],
        "ratio_to_copy_all_ranks": sync.wall / copy["copy_all_ranks_s"],
        "ratio_cpu_time_to_copy": sync.cpu / max(copy["copy_cpu_s"], 1e-9),
        "peak_extra_mb": sync.peak_bytes / _MB,
        "gather_peak_extra_mb": gather.peak_bytes / _MB,
        "load_peak_extra_mb": load.peak_bytes / _MB,
        "kept_buffers_mb": kept / _MB,
    }


def bench_adapters(chunks, plan: Plan, engine, name: str, full: dict) -> dict:
    """The adapters alone into the engine's LoRA slot (rollout.adapter_sync), against the
    merged full sync of the same layout (``full``, its largest bucket) and a copy of its bytes."""
    import torch.distributed as dist

    from megatron_rl.rollout.adapter_sync import AdapterSync
    from megatron_rl.rollout.replicas import Replicas

    lora = dict(rank=plan.lora_rank, alpha=2.0 * plan.lora_rank, dropout=0.0)
    adapters = AdapterSync(chunks, plan.arch, Replicas(engine), lora)
    stats = []
    for _ in range(plan.warmup):
        adapters.sync()
    sync = _repeat(lambda: stats.append(adapters.sync()), plan.iterations)
    row = {
        "layout": name,
        "sync": "adapter",
        "parallel": full["parallel"],
        "tensors": stats[-1].tensors,
        "bytes": stats[-1].bytes,
        "sync_s": sync.wall,
        "sync_s_all": sync.wall_s,
        "sync_cpu_s": sync.cpu,
        "peak_extra_mb": sync.peak_bytes / _MB,
        "full_sync_bytes": full["bytes"],
        "full_sync_s": full["sync_s"],
        "bytes_share_of_full": stats[-1].bytes / full["bytes"],
        "seconds_share_of_full": sync.wall / full["sync_s"],
        "ratio_to_full_copy": sync.wall / full["copy_s"],
    }
    if dist.get_rank() == 0:
        print(
            f"{name:<14} adapters alone: {row['bytes'] / _MB:.2f} MB/rank ({100 * row['bytes_share_of_full']:.2f} % "
            f"of the full sync), {row['sync_s']:.4f} s ({100 * row['seconds_share_of_full']:.2f} % of the merged "
            f"full sync, {row['ratio_to_full_copy']:.2f}x a copy of the full bytes)",
            flush=True,
        )
    return row


def bench_layout(plan: Plan, name: str, layout: ParallelConfig, hf_dir: Path, engine) -> list[dict]:
    import torch
    import torch.distributed as dist

    from megatron_rl.parallel import destroy
    from megatron_rl_lab.bench import hardware

    world = dist.get_world_size()
    chunks = _build_layout(plan, layout, hf_dir)
    try:
        received = hardware.max_over_ranks([float(gather_received_bytes(chunks, plan.arch))])[0]
        rows = []
        for bucket_bytes in plan.bucket_bytes:
            row = bench_bucket(chunks, plan.arch, engine, plan, bucket_bytes)
            rows.append(
                {
                    "layout": name,
                    "parallel": layout.describe(world),
                    "gather_received_mb_max_rank": received / _MB,
                    **row,
                }
            )
            _print_row(rows[-1])
        if plan.lora_rank and plan.lora_sync == "adapter":
            rows.append(bench_adapters(chunks, plan, engine, name, rows[-1]))
        return rows
    finally:
        del chunks
        destroy()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ---- the run --------------------------------------------------------------------------------


def _prepare_model(plan: Plan) -> Path:
    """The HF directory every rank loads: ``--hf`` or the preset, written once by rank 0."""
    from megatron_rl_lab.testing.hf_models import save_tiny_model_on_rank0

    if plan.hf_dir is not None:
        return plan.hf_dir
    return save_tiny_model_on_rank0(plan.arch, plan.work_dir / "models" / plan.model_label, seed=0)


def _transport(world: int) -> str:
    """How the sync gathers buckets in this run (collective: the same-host check)."""
    from megatron_rl.bridge import host_arena

    if world == 1:
        return "local copies"
    if _cuda() or host_arena.transport_setting() != "auto" or not host_arena.all_ranks_on_this_host():
        return "broadcast"
    return "shared arena"


def _build_engine(plan: Plan, hf_dir: Path):
    from megatron_rl.bridge.lora_export import hf_modules
    from megatron_rl.rollout import EngineConfig, RolloutEngine

    config = EngineConfig(
        tensor_parallel_size=plan.vllm_tp,
        dtype=plan.dtype,
        max_model_len=128,
        load_tokenizer=False,
        cpu_kv_cache_gib=plan.kv_cache_gib,
        cpu_linear=plan.cpu_linear,
        cache_dir=str(plan.work_dir / "cache"),
        lora_rank=plan.lora_rank if plan.lora_sync == "adapter" else 0,
        lora_modules=hf_modules(plan.arch, LORA_TARGETS) if plan.lora_rank and plan.lora_sync == "adapter" else (),
    )
    return RolloutEngine(hf_dir, config)


_COLUMNS = (
    "layout",
    "bucket MB",
    "bkts",
    "MB/rank",
    "sync s",
    "GB/s",
    "gather s",
    "load s",
    "copy s",
    "x copy",
    "x copy(all)",
    "x copy(cpu)",
    "peak+ MB",
    "kept MB",
)


def _row_cells(r: dict) -> tuple:
    return (
        r["layout"],
        f"{r['bucket_mb']:.3g}",
        r["buckets"],
        f"{r['bytes'] / _MB:.1f}",
        f"{r['sync_s']:.3f}",
        f"{r['gb_per_s']:.2f}",
        f"{r['gather_s']:.3f}",
        f"{r['load_s']:.3f}",
        f"{r['copy_s']:.4f}",
        f"{r['ratio_to_copy']:.1f}",
        f"{r['ratio_to_copy_all_ranks']:.1f}",
        f"{r['ratio_cpu_time_to_copy']:.1f}",
        f"{r['peak_extra_mb']:.1f}",
        f"{r['kept_buffers_mb']:.1f}",
    )


def _fmt(cells: Sequence) -> str:
    widths = (14, 9, 4, 8, 7, 6, 8, 7, 7, 6, 11, 11, 8, 7)
    return " ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))


def _print_row(row: dict) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(_fmt(_row_cells(row)), flush=True)


def table(rows: list[dict]) -> str:
    """The printed table of the full syncs (also for the docs)."""
    return "\n".join([_fmt(_COLUMNS)] + [_fmt(_row_cells(r)) for r in rows if r.get("sync") != "adapter"])


def run(plan: Plan) -> dict:
    """The whole benchmark under torchrun (every rank); rank 0 prints and writes JSON."""
    import torch
    import torch.distributed as dist

    from megatron_rl import platform

    platform.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    load_before = os.getloadavg()  # shared machines: how busy the host was is part of the result
    hf_dir = _prepare_model(plan)
    engine = _build_engine(plan, hf_dir)
    transport = _transport(world)
    if rank == 0:
        for line in plan.skipped:
            print(f"skipped layout {line}", flush=True)
        print(
            f"engine built in {engine.build_s:.1f} s; world {world}, vLLM TP{plan.vllm_tp}, "
            f"CPU linear weights {plan.cpu_linear}, gather {transport}, "
            f"{plan.iterations} timed syncs (median)\n{_fmt(_COLUMNS)}",
            flush=True,
        )
    rows = []
    for name, layout in plan.layouts:
        rows.extend(bench_layout(plan, name, layout, hf_dir, engine))
    result = {
        "benchmark": "weight_sync",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": host.node(),
        "device": torch.cuda.get_device_name() if _cuda() else f"CPU ({os.cpu_count()} cores visible)",
        "world_size": world,
        "torch_threads": torch.get_num_threads(),
        "host_load_average_1min": {"start": load_before[0], "end": os.getloadavg()[0]},
        "model": {
            "name": plan.model_label,
            "hf_dir": str(hf_dir),
            "family": plan.arch.family,
            "arch": dataclasses.asdict(plan.arch),
        },
        "dtype": plan.dtype,
        "vllm_tp": plan.vllm_tp,
        "cpu_linear": plan.cpu_linear,
        "gather_transport": transport,
        "iterations": plan.iterations,
        "warmup": plan.warmup,
        "engine_build_s": engine.build_s,
        "memory_kind": "torch.cuda.max_memory_allocated - memory_allocated"
        if _cuda()
        else "VmHWM (reset via /proc/self/clear_refs) - VmRSS before, max over ranks",
        "skipped_layouts": list(plan.skipped),
        "lora_rank": plan.lora_rank,
        "lora_sync": plan.lora_sync if plan.lora_rank else None,
        "results": rows,
    }
    if rank == 0:
        save_json(result, plan.json_path)
        print(f"wrote {plan.json_path}", flush=True)
    dist.barrier()
    return result


def run_args(args: argparse.Namespace) -> int:
    """``megatron-rl bench weight-sync``: the exit code.

    The process group stays after the run: vLLM's exit hook destroys its groups on it, then the rest.
    """
    return run_checked("weight-sync", lambda: make_plan(args, world_size()), run)
