"""Rollouts ahead of training: colocated vs disaggregated at max_staleness 0, 1 and 1 with
partial rollouts.

    python tools/bench_async.py                                   # 1 training + 1 rollout rank
    python tools/bench_async.py --task digits_max_steps --max-new-tokens 32   # longer answers
    python tools/bench_async.py --task digits_max_work --max-new-tokens 160 --prompts-per-step 8 \
        --steps 10 --set trainer.seq_length=192 --set trainer.lr=0.0003   # generation-heavy
    python tools/bench_async.py --train-ranks 2 --rollout-ranks 2 --dir runs/bench-async-w4

Runs `megatron-rl bench async` in its own process (it launches one trainer run per mode with
torchrun) and prints a markdown table (docs/benchmarks.md keeps the measured one). Every
option but --json goes to the bench as given, with the bench's defaults (its options:
`megatron-rl bench async --help`).
"""

import argparse
import sys

from megatron_rl_lab.bench.subprocess_run import run_bench


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default="bench_async.json")
    args, bench_options = p.parse_known_args()
    print_table(run_bench("async", bench_options, args.json))
    return 0


def print_table(result: dict) -> None:
    print(f"{result['recipe']}, {result['date']}, {result['machine']['cpus']} CPUs")
    print(
        "| mode | world | tokens/s | samples/s | step s | train s | rollout s | generation s | overlap | rollout busy "
        "| train idle s | rollout idle s | staleness mean / max | partial samples | length | reward step 1 -> N |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in result["modes"]:
        m, world = result["modes"][mode], result["runs"][mode]["world"]
        curve = m["reward_curve"]
        print(
            f"| {mode} | {world} | {m['tokens_per_s']:.0f} | {_fmt(m['samples_per_s'], '.1f')} | "
            f"{m['step_s']:.2f} | {m['train_s']:.2f} | "
            f"{m['rollout_s']:.2f} | {_fmt(m['generation_s'], '.2f')} | {_fmt(m['overlap_fraction'], '.2f')} | "
            f"{_fmt(m['rollout_busy_fraction'], '.2f')} | "
            f"{_fmt(m['train_idle_s'], '.2f')} | {_fmt(m['rollout_idle_s'], '.2f')} | "
            f"{_fmt(m['staleness_mean'], '.1f')} / {_fmt(m['staleness_max'], 'd')} | "
            f"{_fmt(m['partial_samples'], '.1f')} | {_fmt(m['response_length'], '.1f')} | "
            f"{curve[0]:.3f} -> {curve[-1]:.3f} |"
        )
    speedups = [
        f"{k.removeprefix('speedup_').replace('_vs_', ' vs ').replace('samples_', 'samples/s ')}: {v:.2f}x"
        for k, v in result.items()
        if k.startswith("speedup_")
    ]
    print("speedup " + "; ".join(speedups))


if __name__ == "__main__":
    sys.exit(main())
