"""`megatron-rl bench <name>`: the benchmarks' command line (also tools/bench_*.py).

Bad arguments (unknown model, a layout that does not fit the world size or the model, a
batch that does not split) are reported before torch or any process group is touched.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

MFU_EPILOG = """\
examples:
  megatron-rl bench mfu --model cpu-dense --seq-length 256 --global-batch-size 8
  torchrun --nproc-per-node=2 tools/bench_mfu.py --model cpu-moe --sweep
  megatron-rl bench mfu --model gpu-dense-1b --dtype bf16 --seq-length 4096 \\
      --global-batch-size 16 --micro-batch-size 2          # one H100: target MFU >= 50%
  megatron-rl bench mfu --model gpu-moe-2b --dtype bf16 --seq-length 4096 \\
      --global-batch-size 16 --micro-batch-size 2          # one H100: target MFU >= 40%

--model takes a preset (tiny-dense, tiny-moe, cpu-dense, cpu-moe, gpu-dense-1b, gpu-moe-2b)
or an HF model directory / config.json. Under torchrun the layout (--tp/--pp/--ep, or every
layout with --sweep) must fit the world size.
"""


class BenchArgumentError(ValueError):
    pass


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated positive integers, e.g. 1,2,4")
    return values


def add_mfu_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "mfu", help="model FLOPs utilisation of Megatron training steps",
        description="Time Megatron training steps (DDP + distributed optimizer) of one model on "
        "synthetic tokens; report tokens/s, TFLOP/s per device, MFU and peak memory.",
        epilog=MFU_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="preset name or HF model dir / config.json")
    p.add_argument("--role", choices=("actor", "critic"), default="actor")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--seq-length", type=_positive, default=256)
    p.add_argument("--global-batch-size", type=_positive, default=8, help="sequences per step, all DP ranks")
    p.add_argument("--micro-batch-size", type=_positive, default=1)
    p.add_argument("--tp", type=_positive, default=1, help="tensor_model_parallel_size")
    p.add_argument("--pp", type=_positive, default=1, help="pipeline_model_parallel_size")
    p.add_argument("--vpp", type=_positive, default=None, help="virtual_pipeline_model_parallel_size")
    p.add_argument("--ep", type=_positive, default=1, help="expert_model_parallel_size")
    p.add_argument("--etp", type=_positive, default=None, help="expert_tensor_parallel_size (default: TP)")
    p.add_argument("--sweep", action="store_true",
                   help="every TP x PP (x EP) layout that fits the world size, x --sweep-micro-batch-sizes")
    p.add_argument("--sweep-micro-batch-sizes", type=_int_list, default=[1, 2, 4], metavar="1,2,4")
    p.add_argument("--steps", type=_positive, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--dispatcher", choices=("alltoall", "allgather"), default="alltoall",
                   help="MoE token dispatcher")
    p.add_argument("--recompute", action="store_true", help="full activation recomputation")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="per-device peak to divide by (default: GPU table, or the measured CPU matmul peak)")
    p.add_argument("--peak-matmul-size", type=_positive, default=2048, help="CPU peak: matrix size")
    p.add_argument("--json", type=Path, default=None,
                   help="results file (default runs/bench/mfu_<model>_<role>_<dtype>_world<W>.json)")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rl bench", description="Benchmarks.")
    sub = parser.add_subparsers(dest="bench", metavar="BENCH")
    for add_parser, _ in BENCHES.values():
        add_parser(sub)
    return parser


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))


def mfu_plan(args: argparse.Namespace, world: int):
    """(arch, settings, cases, json path) from the arguments; BenchArgumentError if they cannot run."""
    from megatron_rl.bench.plan import Case, MfuSettings, batch_problem, sweep_layouts
    from megatron_rl.bench.presets import model_label, resolve_model
    from megatron_rl.parallel.config import LayoutError, ParallelConfig

    try:
        arch = resolve_model(args.model)
    except ValueError as err:
        raise BenchArgumentError(str(err)) from None
    if args.warmup < 0:
        raise BenchArgumentError(f"--warmup {args.warmup} must be >= 0")
    if args.seq_length > arch.max_position_embeddings:
        raise BenchArgumentError(
            f"--seq-length {args.seq_length} exceeds the model's max_position_embeddings "
            f"{arch.max_position_embeddings}"
        )
    settings = MfuSettings(
        model=args.model, role=args.role, dtype=args.dtype, seq_length=args.seq_length,
        global_batch_size=args.global_batch_size, steps=args.steps, warmup=args.warmup,
        moe_token_dispatcher_type=args.dispatcher, recompute_activations=args.recompute,
        peak_tflops=args.peak_tflops, peak_matmul_size=args.peak_matmul_size,
    )
    if args.sweep:
        cases = [Case(p, m) for p in sweep_layouts(arch, world) for m in args.sweep_micro_batch_sizes]
        cases = [c for c in cases if batch_problem(settings, c, world) is None]
        if not cases:
            raise BenchArgumentError(
                f"no layout x micro-batch size splits global batch {args.global_batch_size} at world size {world}"
            )
    else:
        layout = ParallelConfig(
            tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
            virtual_pipeline_model_parallel_size=args.vpp, expert_model_parallel_size=args.ep,
            expert_tensor_parallel_size=args.etp,
        )
        try:
            layout.validate(world, arch.shape())
        except LayoutError as err:
            raise BenchArgumentError(f"layout: {err}") from None
        cases = [Case(layout, args.micro_batch_size)]
        problem = batch_problem(settings, cases[0], world)
        if problem:
            raise BenchArgumentError(problem)
    path = args.json or Path("runs/bench") / f"mfu_{model_label(args.model)}_{args.role}_{args.dtype}_world{world}.json"
    return arch, settings, cases, path


def run_mfu(args: argparse.Namespace) -> int:
    try:
        plan = mfu_plan(args, _world_size())
    except BenchArgumentError as err:
        print(f"megatron-rl bench mfu: error: {err}", file=sys.stderr)
        return 2
    from megatron_rl.bench.mfu import run

    run(*plan)
    return 0


#: bench name -> (adds its subparser, runs it from the parsed args and returns the exit code).
#: weight-sync and checkpoint benches register here the same way.
def _add_weight_sync(sub):
    from megatron_rl.bench import weight_sync

    return weight_sync.add_parser(sub)


def _run_weight_sync(args) -> int:
    from megatron_rl.bench import weight_sync

    return weight_sync.run_args(args)


def _add_checkpoint(sub):
    p = sub.add_parser("checkpoint", add_help=False,
                       help="checkpoint store vs torch_dist vs torch DCP (tools/bench_checkpoint.py; run under torchrun)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def _run_checkpoint(args) -> int:
    import runpy

    script = Path(__file__).resolve().parents[2] / "tools" / "bench_checkpoint.py"
    if not script.is_file():
        print(f"megatron-rl bench checkpoint: {script} not found (run from a source checkout)", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


BENCHES: dict[str, tuple[Callable, Callable[[argparse.Namespace], int]]] = {
    "mfu": (add_mfu_parser, run_mfu),
    "weight-sync": (_add_weight_sync, _run_weight_sync),
    "checkpoint": (_add_checkpoint, _run_checkpoint),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``argv`` starts with the bench name, e.g. ``["mfu", "--model", "cpu-dense"]``."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.bench is None:
        parser.print_help()
        return 2
    return BENCHES[args.bench][1](args)


if __name__ == "__main__":
    sys.exit(main())
