"""What an MFU benchmark run will do: its command line, settings and cases (layout x micro-batch size).

No torch here, so bad arguments are reported in well under a second; :mod:`.mfu` runs the plan.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Optional

from megatron_rl.models.hf_config import ModelArch
from megatron_rl.parallel.config import LayoutError, ParallelConfig
from megatron_rl_lab.bench.args import (
    BenchArgumentError,
    bench_parser,
    model_option,
    positive,
    positive_list,
    run_checked,
    world_size,
)
from megatron_rl_lab.bench.presets import PRESETS, model_label

EPILOG = f"""\
examples:
  megatron-rl bench mfu --model cpu-dense-5m --seq-length 256 --global-batch-size 8
  torchrun --nproc-per-node=2 tools/bench_mfu.py --model cpu-moe-9m --sweep
  megatron-rl bench mfu --model gpu-dense-1b --dtype bf16 --seq-length 4096 \\
      --global-batch-size 16 --micro-batch-size 2          # one H100: target MFU >= 50%
  megatron-rl bench mfu --model gpu-moe-2b --dtype bf16 --seq-length 4096 \\
      --global-batch-size 16 --micro-batch-size 2          # one H100: target MFU >= 40%

--model takes a preset ({", ".join(PRESETS)})
or an HF model directory / config.json. Under torchrun the layout (--tp/--pp/--ep, or every
layout with --sweep) must fit the world size.
"""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MfuSettings:
    """One benchmark run (every case shares these)."""

    model: str
    """Preset name or HF config path (recorded as given)."""
    role: str = "actor"
    """actor (LM head) | critic (value head)."""
    dtype: str = "fp32"
    """fp32 | bf16 parameters and compute."""
    seq_length: int = 256
    global_batch_size: int = 8
    """Sequences per optimizer step over all data-parallel ranks."""
    steps: int = 5
    """Timed steps."""
    warmup: int = 2
    """Untimed steps first (allocator, thread pools, kernel selection)."""
    moe_token_dispatcher_type: str = "alltoall"
    recompute_activations: bool = False
    attention: str = "auto"
    """auto | sdpa | unfused (models.layer_spec.ATTENTIONS)."""
    experts: str = "auto"
    """auto | sequential | grouped: how MoE experts are computed (models.layer_spec.EXPERTS)."""
    fusion: str = "none"
    """none | compiled: the layers' elementwise work as shipped or compiled (models.fused_elementwise)."""
    profile: bool = False
    """One more step under torch.profiler: where the time went, by op category (.step_profile)."""
    peak_tflops: Optional[float] = None
    """Per-device peak to use instead of the table / the measured CPU peak."""
    peak_matmul_size: int = 2048
    """Matrix size of the CPU matmul peak measurement."""
    seed: int = 1234


@dataclasses.dataclass(frozen=True)
class Case:
    """One layout and micro-batch size."""

    parallel: ParallelConfig
    micro_batch_size: int

    def describe(self, world: int) -> str:
        p = self.parallel
        parts = [f"TP{p.tp}", f"PP{p.pp}"] + ([f"VPP{p.vpp}"] if p.vpp > 1 else [])
        parts += [f"EP{p.ep}", f"ETP{p.etp}", f"DP{p.dp(world)}"]
        return "·".join(parts) + f" mbs{self.micro_batch_size}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def sweep_layouts(arch: ModelArch, world: int) -> list[ParallelConfig]:
    """Every TP x PP (x EP for MoE) layout that fits the world size and the model."""
    layouts = []
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            for ep in _divisors(world // pp) if arch.is_moe else [1]:
                layout = ParallelConfig(
                    tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
                )
                try:
                    layout.validate(world, arch.shape())
                except LayoutError:
                    continue
                layouts.append(layout)
    return layouts


def batch_problem(settings: MfuSettings, case: Case, world: int) -> Optional[str]:
    """Why this case cannot split the global batch (None when it can)."""
    dp = case.parallel.dp(world)
    if settings.global_batch_size % (case.micro_batch_size * dp):
        return (
            f"global batch {settings.global_batch_size} is not divisible by micro_batch_size x "
            f"data-parallel size = {case.micro_batch_size}x{dp}"
        )
    return None


def add_parser(sub) -> argparse.ArgumentParser:
    """The ``mfu`` subcommand of ``megatron-rl bench``."""
    p = bench_parser(
        sub,
        "mfu",
        help="model FLOPs utilisation of Megatron training steps",
        description="Time Megatron training steps (DDP + distributed optimizer) of one model on "
        "synthetic tokens; report tokens/s, TFLOP/s per device, MFU and peak memory.",
        epilog=EPILOG,
    )
    p.add_argument("--model", required=True, help="preset name or HF model dir / config.json")
    p.add_argument("--role", choices=("actor", "critic"), default="actor")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--seq-length", type=positive, default=256)
    p.add_argument("--global-batch-size", type=positive, default=8, help="sequences per step, all DP ranks")
    p.add_argument("--micro-batch-size", type=positive, default=1)
    p.add_argument("--tp", type=positive, default=1, help="tensor_model_parallel_size")
    p.add_argument("--pp", type=positive, default=1, help="pipeline_model_parallel_size")
    p.add_argument("--vpp", type=positive, default=None, help="virtual_pipeline_model_parallel_size")
    p.add_argument("--ep", type=positive, default=1, help="expert_model_parallel_size")
    p.add_argument("--etp", type=positive, default=None, help="expert_tensor_parallel_size (default: TP)")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="every TP x PP (x EP) layout that fits the world size, x --sweep-micro-batch-sizes",
    )
    p.add_argument("--sweep-micro-batch-sizes", type=positive_list(int, "1,2,4"), default=[1, 2, 4], metavar="1,2,4")
    p.add_argument("--steps", type=positive, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument(
        "--dispatcher",
        choices=("alltoall", "allgather", "local"),
        default="alltoall",
        help="MoE token dispatcher: Megatron's alltoall or allgather, or local (every expert on this rank, "
        "no host sync; EP1·ETP1 only)",
    )
    p.add_argument("--recompute", action="store_true", help="full activation recomputation")
    p.add_argument(
        "--profile",
        action="store_true",
        help="one more step under torch.profiler; time by op category and the top ops in the JSON",
    )
    p.add_argument(
        "--attention",
        choices=("auto", "sdpa", "unfused"),
        default="auto",
        help="auto: Transformer Engine if installed, else SDPA; unfused: Megatron's local attention, for comparison",
    )
    p.add_argument(
        "--experts",
        choices=("auto", "sequential", "grouped"),
        default="auto",
        help="MoE experts: auto (grouped GEMMs for bf16 on Hopper, else one expert after another), "
        "sequential (Megatron's SequentialMLP), grouped",
    )
    p.add_argument(
        "--fusion",
        choices=("none", "compiled"),
        default="none",
        help="the layers' norms, RoPE and gated SiLU as Megatron's local spec ships them, or compiled "
        "by torch.compile (one kernel per direction each)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="per-device peak to divide by (default: GPU table, or the measured CPU matmul peak)",
    )
    p.add_argument("--peak-matmul-size", type=positive, default=2048, help="CPU peak: matrix size")
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        help="results file (default runs/bench/mfu_<model>_<role>_<dtype>_world<W>.json)",
    )
    return p


def _cases(args: argparse.Namespace, arch: ModelArch, settings: MfuSettings, world: int) -> list[Case]:
    """The sweep's cases that split the batch, or the one layout asked for (checked)."""
    if args.sweep:
        cases = [Case(p, m) for p in sweep_layouts(arch, world) for m in args.sweep_micro_batch_sizes]
        cases = [c for c in cases if batch_problem(settings, c, world) is None]
        if not cases:
            raise BenchArgumentError(
                f"no layout x micro-batch size splits global batch {args.global_batch_size} at world size {world}"
            )
        return cases
    layout = ParallelConfig(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp,
        expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=args.etp,
    )
    try:
        layout.validate(world, arch.shape())
    except LayoutError as err:
        raise BenchArgumentError(f"layout: {err}") from None
    case = Case(layout, args.micro_batch_size)
    problem = batch_problem(settings, case, world)
    if problem:
        raise BenchArgumentError(problem)
    return [case]


def make_plan(args: argparse.Namespace, world: int):
    """(arch, settings, cases, json path) from the arguments; BenchArgumentError if they cannot run."""
    arch = model_option(args.model)
    if args.warmup < 0:
        raise BenchArgumentError(f"--warmup {args.warmup} must be >= 0")
    if args.seq_length > arch.max_position_embeddings:
        raise BenchArgumentError(
            f"--seq-length {args.seq_length} exceeds the model's max_position_embeddings {arch.max_position_embeddings}"
        )
    settings = MfuSettings(
        model=args.model,
        role=args.role,
        dtype=args.dtype,
        seq_length=args.seq_length,
        global_batch_size=args.global_batch_size,
        steps=args.steps,
        warmup=args.warmup,
        moe_token_dispatcher_type=args.dispatcher,
        recompute_activations=args.recompute,
        attention=args.attention,
        experts=args.experts,
        fusion=args.fusion,
        profile=args.profile,
        peak_tflops=args.peak_tflops,
        peak_matmul_size=args.peak_matmul_size,
    )
    cases = _cases(args, arch, settings, world)
    path = args.json or Path("runs/bench") / f"mfu_{model_label(args.model)}_{args.role}_{args.dtype}_world{world}.json"
    return arch, settings, cases, path


def run_args(args: argparse.Namespace) -> int:
    """``megatron-rl bench mfu``: the exit code."""

    def run(plan):
        from megatron_rl_lab.bench.mfu import run

        run(*plan)

    return run_checked("mfu", lambda: make_plan(args, world_size()), run)
