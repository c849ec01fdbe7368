"""Train-inference mismatch grid: `megatron-rl bench mismatch` per MoE preset and dtype.

    python tools/bench_mismatch.py                       # tiny-moe-4l, cpu-moe-64e x fp32, bf16
    python tools/bench_mismatch.py --models cpu-moe-14m --dtypes bf16 --prompts 32 --json out.json

Each case runs in its own process (vLLM's state is process-wide); the results go to one
JSON file and a markdown table (docs/benchmarks.md keeps the measured one).
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from megatron_rl_lab.bench.subprocess_run import run_bench


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny-moe-4l,cpu-moe-64e")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--prompts", default="16")
    p.add_argument("--json", default="bench_mismatch.json")
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for dtype in args.dtypes.split(","):
                out = Path(tmp) / f"{model}-{dtype}.json"
                results.append(
                    run_bench("mismatch", ["--model", model, "--dtype", dtype, "--prompts", args.prompts], out)
                )
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print("| model | dtype | tokens | agreement (own) | mean abs dlogp own / replay | k3 KL own / replay | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        own, rep = r["own_routers"], r["replayed"]
        ratio = r["k3_ratio_replay_over_own"]
        print(
            f"| {r['model']} ({r['experts']} experts, top-{r['topk']}) | {r['dtype']} | {own['tokens']} | "
            f"{own['router_agreement']:.3f} | {own['mean_abs_dlogp']:.2e} / {rep['mean_abs_dlogp']:.2e} | "
            f"{own['k3_kl']:.2e} / {rep['k3_kl']:.2e} | {'-' if ratio is None else f'{ratio:.2f}'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
