"""MFU benchmark: timed Megatron training steps of one model in one or many layouts.

Each case builds the actor (or critic) in Megatron DDP with the distributed optimizer
(:mod:`.training`) and runs warm-up then timed steps of ``get_forward_backward_func`` +
``optimizer.step()`` on synthetic tokens (every token is real: full rows, no padding, no
packing). Model FLOPs per step come from
:mod:`megatron_rl.models.flops`; MFU is achieved FLOP/s per device over the device's peak
(:mod:`.hardware`). Rank 0 prints one line per case and writes all results as JSON.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import platform as host
from functools import partial
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl import platform
from megatron_rl.models.builder import BuildOptions
from megatron_rl.models.flops import training_flops
from megatron_rl.models.hf_config import ModelArch
from megatron_rl.utils import dtypes
from megatron_rl_lab.bench import hardware, step_profile
from megatron_rl_lab.bench.args import save_json
from megatron_rl_lab.bench.plan import Case, MfuSettings
from megatron_rl_lab.bench.training import build_trainable, synthetic_microbatches, train_step


def run_case(arch: ModelArch, settings: MfuSettings, case: Case, peak_tflops: float) -> dict:
    """Build, warm up, time ``settings.steps`` steps; return this case's numbers (all ranks)."""
    from megatron_rl.models.builder import padded_vocab_size
    from megatron_rl.parallel import destroy, initialize

    world = dist.get_world_size()
    cuda = platform.current().is_cuda
    initialize(case.parallel, seed=settings.seed, model=arch.shape())
    hardware.reset_peak_memory(cuda)
    options = BuildOptions(
        dtype=settings.dtype,
        moe_token_dispatcher_type=settings.moe_token_dispatcher_type,
        recompute_activations=settings.recompute_activations,
        attention=settings.attention,
        experts=settings.experts,
        fusion=settings.fusion,
    )
    chunks, optimizer = build_trainable(settings.role, arch, case.parallel, options)
    experts = sorted({type(m.experts).__name__ for c in chunks for m in c.modules() if hasattr(m, "router")})
    per_rank = settings.global_batch_size // case.parallel.dp(world)
    micro = synthetic_microbatches(
        per_rank // case.micro_batch_size, case.micro_batch_size, settings.seq_length, arch.vocab_size, settings.seed
    )
    num_microbatches = len(micro)
    step = partial(train_step, chunks, optimizer, micro, settings.role)
    losses = [step() for _ in range(settings.warmup)]
    dist.barrier()
    timer = hardware.StepTimer(cuda)
    for _ in range(settings.steps):
        timer.start()
        losses.append(step())
        timer.stop()
    step_times = hardware.max_over_ranks(timer.seconds())  # the slowest rank sets the pace
    profile = step_profile.profile_step(step, cuda) if settings.profile else None
    peak_memory = hardware.max_over_ranks([float(hardware.peak_memory_bytes(cuda))])[0]
    everyone = [None] * world
    dist.all_gather_object(everyone, losses[-1])
    last_loss = next((loss for loss in everyone if loss is not None), None)
    del chunks, optimizer, micro
    destroy()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    vocab = padded_vocab_size(arch.vocab_size, case.parallel.tp)  # the LM head computes these rows
    flops = training_flops(
        arch, [settings.seq_length] * settings.global_batch_size, role=settings.role, vocab_size=vocab
    )
    step_s = sum(step_times) / len(step_times)
    achieved = flops.total / step_s / world / 1e12
    return {
        "layout": case.describe(world),
        "parallel": {**case.parallel.megatron_sizes(), "data_parallel_size": case.parallel.dp(world)},
        "micro_batch_size": case.micro_batch_size,
        "num_microbatches": num_microbatches,
        "tokens_per_step": flops.tokens,
        "step_time_s": step_s,
        "step_times_s": step_times,
        "step_time_min_s": min(step_times),
        "tokens_per_s": flops.tokens / step_s,
        "tokens_per_s_per_device": flops.tokens / step_s / world,
        "model_flops_per_step": flops.total,
        "flops_per_token": flops.per_token,
        "flops_breakdown": flops.as_dict(),
        "achieved_tflops_per_device": achieved,
        "mfu": achieved / peak_tflops,
        "peak_memory_gib": peak_memory / 2**30,
        "last_loss": last_loss,
        "experts_module": experts[0] if experts else None,
        "profile": profile,
    }


def measure_peak(settings: MfuSettings) -> dict:
    """Per-device peak TFLOP/s and where it came from.

    CPU: every rank measures an fp32 matmul loop at the same time, with the threads it
    trains with, and the per-device peak is the mean over ranks.
    """
    plat = platform.current()
    if settings.peak_tflops:
        return {"tflops": settings.peak_tflops, "source": "--peak-tflops"}
    if plat.is_cuda:
        name = torch.cuda.get_device_name()
        value = hardware.gpu_peak_tflops(name, settings.dtype)
        if value is not None:
            return {"tflops": value, "source": f"table: {name}, dense {settings.dtype} tensor-core peak"}
        value = hardware.measure_matmul_tflops(plat.device, dtypes.to_torch(settings.dtype), 8192, 2.0)
        return {"tflops": value, "source": f"measured {settings.dtype} matmul on {name} (not in the table)"}
    dist.barrier()
    mine = hardware.measure_matmul_tflops(torch.device("cpu"), torch.float32, settings.peak_matmul_size, 2.0)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    return {
        "tflops": sum(per_rank) / len(per_rank),
        "per_rank": per_rank,
        "source": f"measured fp32 {settings.peak_matmul_size}^3 matmul, "
        f"{torch.get_num_threads()} thread(s) per rank, all ranks at once",
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"CPU: {len(names)} x {names[0]}"
    except (OSError, IndexError):
        return f"CPU ({host.machine()})"


def _context(arch: ModelArch, settings: MfuSettings) -> dict:
    from megatron_rl.models.layer_spec import describe_attention, uses_transformer_engine

    plat = platform.current()
    te = uses_transformer_engine(settings.attention)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": host.node(),
        "device": torch.cuda.get_device_name() if plat.is_cuda else _cpu_name(),
        "world_size": dist.get_world_size(),
        "load_average_1m_before": os.getloadavg()[0],
        "torch_threads_per_rank": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformer_engine": te,
        "layer_spec": describe_attention(settings.attention),
        "memory_kind": hardware.memory_kind(plat.is_cuda),
        "settings": dataclasses.asdict(settings),
        "arch": dataclasses.asdict(arch),
    }


def _rate(tflops: float, cuda: bool) -> str:
    return f"{tflops:7.1f} TFLOP/s" if cuda else f"{tflops * 1e3:7.2f} GFLOP/s"


def run(arch: ModelArch, settings: MfuSettings, cases: list[Case], json_path: Optional[Path]) -> dict:
    """The whole benchmark on this rank (call on every rank); rank 0 prints and writes JSON."""
    platform.init_distributed()
    plat = platform.current()
    rank, world = dist.get_rank(), dist.get_world_size()
    if plat.is_cuda and settings.dtype == "fp32":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 training runs TF32 tensor cores
        torch.backends.cudnn.allow_tf32 = True
    say = print if rank == 0 else (lambda *a, **k: None)
    report = _context(arch, settings)
    say(
        f"bench mfu: {settings.model} {settings.role} {settings.dtype}, seq {settings.seq_length}, "
        f"global batch {settings.global_batch_size}, world {world} on {report['device']}, "
        f"{report['torch_threads_per_rank']} thread(s)/rank, {report['layer_spec']}, fusion {settings.fusion}",
        flush=True,
    )
    peaks = [measure_peak(settings)]
    say(f"peak per device: {_rate(peaks[0]['tflops'], plat.is_cuda)} ({peaks[0]['source']})", flush=True)
    report["cases"] = []
    for case in cases:
        result = run_case(arch, settings, case, peaks[0]["tflops"])
        report["cases"].append(result)
        say(
            f"{result['layout']:34s} {result['tokens_per_s']:10.1f} tokens/s  "
            f"{_rate(result['achieved_tflops_per_device'], plat.is_cuda)}/device  "
            f"step {result['step_time_s']:.3f} s  peak mem {result['peak_memory_gib']:.2f} GiB  "
            f"loss {result['last_loss']:.3f}"
            + (f"  experts {result['experts_module']}" if result["experts_module"] else ""),
            flush=True,
        )
        if result["profile"]:
            say(step_profile.describe(result["profile"]), flush=True)
    if not plat.is_cuda and not settings.peak_tflops:
        peaks.append(measure_peak(settings))  # again after the load: the machine may be shared
    peak = max(p["tflops"] for p in peaks)  # the best estimate of what the device can do
    report["peak"] = {"tflops": peak, "source": peaks[0]["source"]}
    if len(peaks) > 1:
        report["peak"]["measurements"] = [dict(p, when=w) for p, w in zip(peaks, ("before", "after"))]
    for result in report["cases"]:
        result["mfu"] = result["achieved_tflops_per_device"] / peak
        # On a shared machine the fastest step is the least disturbed one.
        result["mfu_best_step"] = result["mfu"] * result["step_time_s"] / result["step_time_min_s"]
    report["load_average_1m_after"] = os.getloadavg()[0]
    say(
        f"MFU vs {_rate(peak, plat.is_cuda).strip()} per device: "
        + ", ".join(f"{r['layout']} {100 * r['mfu']:.1f}%" for r in report["cases"])
    )
    if rank == 0 and json_path is not None:
        save_json(report, json_path)
        say(f"wrote {json_path}")
    return report
