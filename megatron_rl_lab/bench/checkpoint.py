"""Checkpoint benchmark: this store (sync, async, deferred snapshot) vs Megatron
dist_checkpointing (torch_dist) vs torch.distributed.checkpoint, same model and
distributed-optimizer state, one run.

    torchrun --nproc-per-node=4 tools/bench_checkpoint.py --json out.json
    torchrun --nproc-per-node=2 -m megatron_rl bench checkpoint --model tiny-dense-4l --repeats 1

Saves from TP2 (x DP) and loads back into the same layout and into TP1 (DP = world), and
reports per method (at world 1, one GPU, it saves from TP1 and has no other layout to load
into, so the reshard column is n/a): training-loop blocking time of a save, total save time (until committed),
load time, load-with-reshard time (max over ranks), and ratios to torch DCP. The async
blocking time (after the first async save, which allocates the host buffers and is reported
apart), the deferred-snapshot save (``snapshot="before_update"``: the call, and the call
plus the wait of an optimizer update issued right after it), the DCP save and every load
(the methods taking turns) are each timed ``repeats`` times; the medians are reported,
with every sample and the load average in the JSON (the machine may be shared). The DCP
baseline saves each rank's pieces as plain tensors keyed by canonical name and offsets (DCP
writes keys shared by several ranks once); such a state dict has no sharding metadata, so
it cannot reshard (reported as n/a).

The checkpoints go into a scratch directory the bench creates (:class:`Scratch`); it never
removes anything it did not create, and refuses a ``--dir`` that is not empty.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Optional

from megatron_rl.models.hf_config import ModelArch
from megatron_rl.parallel.config import LayoutError, ParallelConfig
from megatron_rl_lab.bench.args import BenchArgumentError, model_option, positive, run_checked, world_size
from megatron_rl_lab.bench.checkpoint_scratch import Scratch, scratch_problem
from megatron_rl_lab.bench.presets import PRESETS

DEFAULT_MODEL = "cpu-dense-85m"
"""The 323 MiB model of the numbers in docs/benchmarks.md."""
SAVE_LAYOUT = ParallelConfig(tensor_model_parallel_size=2)
RESHARD_LAYOUT = ParallelConfig()
SINGLE_DEVICE_LAYOUT = ParallelConfig()


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointBenchOptions:
    """Everything a run takes; the command line fills it field by field."""

    model: str = DEFAULT_MODEL
    """A preset (megatron_rl_lab/bench/presets.py) or an HF model directory / config.json (random weights)."""
    dir: Optional[Path] = None
    """Scratch directory: created if missing, or an existing empty one; default a new temporary one."""
    repeats: int = 5
    """Timed steady-state async saves, deferred saves, DCP saves and every method's loads (medians reported)."""
    json: Optional[Path] = None
    """Also write the results here (rank 0)."""
    keep: bool = False
    """Leave the checkpoints in place (else everything the bench created is removed)."""


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"preset ({', '.join(PRESETS)}) or HF model dir / config.json (default {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="scratch directory: must not exist (created, removed at the end) or be empty "
        "(its new contents removed at the end); default: a new directory under the system temp dir",
    )
    p.add_argument(
        "--repeats",
        type=positive,
        default=5,
        help="timed steady-state async saves, deferred saves, DCP saves and every method's loads (medians reported)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--keep", action="store_true", help="leave the checkpoints in the scratch directory")
    return p


def add_parser(sub) -> argparse.ArgumentParser:
    """The ``checkpoint`` subcommand of ``megatron-rl bench``."""
    p = sub.add_parser(
        "checkpoint",
        help="checkpoint store vs torch_dist vs torch DCP: blocking, save, load, reshard (torchrun)",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
    )
    return add_arguments(p)


def options_from_args(args: argparse.Namespace) -> CheckpointBenchOptions:
    fields = {f.name for f in dataclasses.fields(CheckpointBenchOptions)}
    return CheckpointBenchOptions(**{k: v for k, v in vars(args).items() if k in fields})


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checked run: the options, the model they name, and the layouts it saves and reshards in."""

    options: CheckpointBenchOptions
    arch: ModelArch
    save_layout: ParallelConfig = SAVE_LAYOUT
    reshard_layout: Optional[ParallelConfig] = RESHARD_LAYOUT
    """None at world 1: a single device has no second layout to load into."""


def make_plan(options: CheckpointBenchOptions, world: int) -> Plan:
    """The checked run (no torch, no process group); BenchArgumentError when it cannot run."""
    if options.repeats < 1:
        raise BenchArgumentError(f"--repeats must be >= 1, got {options.repeats}")
    arch = model_option(options.model)
    if world == 1:
        return _checked(Plan(options, arch, SINGLE_DEVICE_LAYOUT, None), world)
    return _checked(Plan(options, arch), world)


def _checked(plan: Plan, world: int) -> Plan:
    layouts = [plan.save_layout] + ([plan.reshard_layout] if plan.reshard_layout else [])
    for layout in layouts:
        try:
            layout.validate(world, plan.arch.shape())
        except LayoutError as err:
            raise BenchArgumentError(f"the TP2 save / TP1 reshard layouts at world size {world}: {err}") from None
    problem = scratch_problem(plan.options.dir)
    if problem:
        raise BenchArgumentError(problem)
    return plan


def run_args(args: argparse.Namespace) -> int:
    """``megatron-rl bench checkpoint``: the exit code."""
    return run_checked("checkpoint", lambda: make_plan(options_from_args(args), world_size()), run)


def run(plan: Plan) -> dict:
    """The whole benchmark under torchrun (every rank); rank 0 prints and writes JSON."""
    import torch.distributed as dist

    from megatron_rl import platform
    from megatron_rl_lab.bench.checkpoint_timing import METHODS, measure

    platform.init_distributed()
    scratch = Scratch(plan.options.dir, METHODS)
    root = scratch.create()
    try:
        result = measure(plan.arch, plan.save_layout, plan.reshard_layout, scratch, plan.options.repeats)
        dist.barrier()  # every rank is done with the files (after a failure: rank 0 removes at once)
    finally:
        if not plan.options.keep:
            scratch.remove()
    result["model"] = {"name": plan.options.model, "arch": dataclasses.asdict(plan.arch)}
    result["dir"] = str(root) if plan.options.keep else None
    if dist.get_rank() == 0:
        print_report(result)
        if plan.options.json:
            plan.options.json.write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return result


def print_report(r: dict) -> None:
    mb = r["model_bytes"] / 2**20
    reshard = f"reshard to {r['reshard_layout']}" if r["reshard_layout"] else "no reshard at world 1"
    print(
        f"{r['model']['name']}: {mb:.0f} MiB fp32 (+ distributed Adam state), world {r['world_size']}, "
        f"save {r['save_layout']}, {reshard}"
    )
    print(f"{'method':<24}{'blocking s':>11}{'save s':>9}{'load s':>9}{'reshard s':>11}")
    rows = [
        ("ours (sync)", r["ours_sync_save_s"], r["ours_sync_save_s"], r["ours_load_s"], r["ours_reshard_load_s"]),
        (
            "ours (async)",
            r["ours_async_blocking_s"],
            r["ours_async_save_s"],
            r["ours_load_s"],
            r["ours_reshard_load_s"],
        ),
        ("ours (async, deferred)", r["ours_deferred_call_s"], None, None, None),
        (
            "megatron torch_dist",
            r["torch_dist_save_s"],
            r["torch_dist_save_s"],
            r["torch_dist_load_s"],
            r["torch_dist_reshard_load_s"],
        ),
        ("torch DCP", r["dcp_save_s"], r["dcp_save_s"], r["dcp_load_s"], None),
    ]
    for name, *values in rows:
        print(
            f"{name:<24}"
            + "".join(f"{v:>{w}.3f}" if v is not None else f"{'n/a':>{w}}" for v, w in zip(values, (11, 9, 9, 11)))
        )
    for key, value in r["ratios"].items():
        if value is not None:
            print(f"  {key}: {value:.1f}x")

    def show(xs):
        return " ".join(f"{x:.3f}" for x in xs)

    print(
        f"  async blocking samples s: {show(r['ours_async_blocking_samples_s'])}; "
        f"DCP save samples s: {show(r['dcp_save_samples_s'])}"
    )
    print(
        f"  deferred snapshot call samples s: {show(r['ours_deferred_call_samples_s'])}; "
        f"with an update right after it: {show(r['ours_deferred_immediate_update_samples_s'])}"
    )
    loads = ("ours_load", "dcp_load", "torch_dist_load", "ours_reshard_load", "torch_dist_reshard_load")
    shown = [f"{k}: {show(r[k + '_samples_s'])}" for k in loads if r.get(k + "_samples_s")]
    print("  load samples s: " + "; ".join(shown))
    print(f"  first async save (allocates host buffers) blocking s: {r['ours_async_first_blocking_s']:.3f}")
    print(f"  load average at start {show(r['loadavg_start'])}, at end {show(r['loadavg_end'])}")
    if r["dir"]:
        print(f"  checkpoints kept in {r['dir']}")
