"""`megatron-rl bench <name>`: the benchmarks' command line (tools/bench_*.py call it too).

Every bench module has the same two entry points, ``add_parser(sub)`` and
``run_args(args) -> exit code``; this table only names them. Bad arguments (unknown model, a
layout that does not fit the world size or the model, a batch that does not split, a
checkpoint directory that is not empty) are reported before torch or any process group is
touched (:mod:`.args`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

#: bench name -> the module with its ``add_parser`` and ``run_args`` (imported on use).
BENCHES: dict[str, str] = {
    "mfu": "megatron_rl_lab.bench.plan",
    "weight-sync": "megatron_rl_lab.bench.weight_sync",
    "checkpoint": "megatron_rl_lab.bench.checkpoint",
    "mismatch": "megatron_rl_lab.bench.mismatch",
    "packing": "megatron_rl_lab.bench.packing",
    "sft": "megatron_rl_lab.bench.sft",
    "async": "megatron_rl_lab.bench.async_rollouts",
    "cp": "megatron_rl_lab.bench.context_parallel",
    "tools": "megatron_rl_lab.bench.tool_episodes",
    "compare": "megatron_rl_lab.bench.compare",
    "grpo-reference": "megatron_rl_lab.bench.grpo_reference",
    "step": "megatron_rl_lab.bench.step",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rl bench", description="Benchmarks.")
    sub = parser.add_subparsers(dest="bench", metavar="BENCH")
    for module in BENCHES.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``argv`` starts with the bench name, e.g. ``["mfu", "--model", "cpu-dense-5m"]``."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.bench is None:
        parser.print_help()
        return 2
    return importlib.import_module(BENCHES[args.bench]).run_args(args)


if __name__ == "__main__":
    sys.exit(main())
