"""PPO against T-PPO on the synthetic digit task: wall-clock time to reach the same reward.

Runs ``megatron-rl train`` twice from one tiny supervised base (built once, so neither run
pays for it), with the embedded default's settings (examples/dapo.yaml) and only the
recipe changed, then reads both metrics.jsonl files. Time is the sum of ``timing/step_s``
(rollouts + training + weight sync; start-up excluded); reward is the moving average of
``reward/mean`` over the last ``--smooth`` steps (for T-PPO: responses that finished in
those steps).

    python tools/compare_ppo_tppo.py --out runs/compare --steps 30 --target 0.3
    python tools/compare_ppo_tppo.py --out runs/compare_steps --task digits_max_steps \
        --max-new-tokens 24 --window 4 --target 0.3 trainer.seq_length=64
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path


def _run(name: str, out: Path, base: Path, steps: int, overrides: list[str]) -> dict:
    run_dir = out / name
    cmd = [
        sys.executable,
        "-m",
        "megatron_rl",
        "train",
        "--config",
        "examples/dapo.yaml",
        f"trainer.run_dir={run_dir}",
        f"trainer.max_steps={steps}",
        f"model.hf_path={base}",
        f"data.source={base}/train.jsonl",
        "data.reward=digits",
        "eval.sets={}",  # the recipe's held-out split is a task's; this run reads a prompt file
        *overrides,
    ]
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, "wall_s": wall, "command": " ".join(cmd)}


def time_to_reward(rows: list[dict], target: float, smooth: int) -> tuple[float | None, int | None]:
    """(seconds of steps, step) at which the moving average of reward/mean first reaches ``target``."""
    elapsed, recent = 0.0, []
    for r in rows:
        elapsed += r["timing/step_s"]
        if r["reward/mean"] is not None and math.isfinite(r["reward/mean"]):
            recent = (recent + [r["reward/mean"]])[-smooth:]
        if len(recent) == smooth and sum(recent) / smooth >= target:
            return elapsed, r["step"]
    return None, None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/compare_ppo_tppo"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--target", type=float, default=0.3, help="moving-average reward to reach")
    parser.add_argument("--smooth", type=int, default=5, help="steps in the moving average")
    parser.add_argument("--window", type=int, default=4, help="T-PPO generation window (tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument(
        "--task",
        default="digits_max",
        help="digit task of the base (digits_max_steps: responses of 2-8 reasoning steps)",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides for both runs (key=value)")
    args = parser.parse_args(argv)

    from megatron_rl.tasks.base_model import BaseModelSettings, make_tiny_base

    base = args.out / "base_model"  # what task:<task> builds for the tiny-moe preset, seed 1234
    make_tiny_base(base, BaseModelSettings(task=args.task, family="qwen3_moe", seed=1234))
    common = [f"rollout.max_new_tokens={args.max_new_tokens}", *args.overrides]
    runs = {
        "ppo": _run("ppo", args.out, base, args.steps, ["algorithm.recipe=ppo", "algorithm.overrides={}", *common]),
        "tppo": _run(
            "tppo",
            args.out,
            base,
            args.steps,
            ["algorithm.recipe=tppo", f"algorithm.overrides={{generation_window: {args.window}}}", *common],
        ),
    }
    report = {
        "task": args.task,
        "target_reward": args.target,
        "smooth_steps": args.smooth,
        "steps": args.steps,
        "window": args.window,
        "max_new_tokens": args.max_new_tokens,
    }
    for name, run in runs.items():
        rows = run["rows"]
        seconds, step = time_to_reward(rows, args.target, args.smooth)
        rewards = [r["reward/mean"] for r in rows if r["reward/mean"] is not None]
        report[name] = {
            "time_to_target_s": seconds,
            "step_at_target": step,
            "mean_step_s": sum(r["timing/step_s"] for r in rows) / len(rows),
            "mean_rollout_s": sum(r["timing/rollout_s"] for r in rows) / len(rows),
            "first5_reward": sum(rewards[:5]) / max(len(rewards[:5]), 1),
            "last5_reward": sum(rewards[-5:]) / max(len(rewards[-5:]), 1),
            "process_wall_s": run["wall_s"],
            "command": run["command"],
        }
    a, b = report["ppo"]["time_to_target_s"], report["tppo"]["time_to_target_s"]
    report["speedup_tppo_over_ppo"] = a / b if a and b else None
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
