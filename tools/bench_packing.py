"""Sequence packing benchmark: padded vs packed training step on the same sequences.

    python tools/bench_packing.py                              # cpu-dense-5m, both distributions
    python tools/bench_packing.py --model tiny-moe-4l --rows 32 --json out.json

Runs `megatron-rl bench packing` in its own process and prints a markdown table
(docs/benchmarks.md keeps the measured one).
"""

import argparse
import sys

from megatron_rl_lab.bench.subprocess_run import run_bench


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cpu-dense-5m")
    p.add_argument("--rows", default="64")
    p.add_argument("--median", default="64")
    p.add_argument("--steps", default="3")
    p.add_argument("--json", default="bench_packing.json")
    args = p.parse_args()
    result = run_bench(
        "packing",
        ["--model", args.model, "--rows", args.rows, "--median", args.median, "--steps", args.steps],
        args.json,
    )
    print(f"{result['model']}, {result['date']}")
    print(
        "| distribution | rows | seq_length | budget | efficiency padded / packed | micro-batches padded / packed "
        "| step s padded / packed | speedup | max grad diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in result["results"]:
        eff, mbs, s = r["packing_efficiency"], r["micro_batches"], r["step_s"]
        print(
            f"| {r['distribution']} | {r['rows']} | {r['seq_length']} | {r['budget_tokens']} | "
            f"{eff['padded']:.3f} / {eff['packed']:.3f} | {mbs['padded']} / {mbs['packed']} | "
            f"{s['padded']:.2f} / {s['packed']:.2f} | {r['speedup_vs_padded']:.2f}x | {r['grad_max_abs_diff']:.1e} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
