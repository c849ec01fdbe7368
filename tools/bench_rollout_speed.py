"""Rollout decode speed of the colocated vLLM engine on one process, per CPU linear format.

Why: ``rollout.cpu_linear`` trades sync cost (plain weights: a sync is a copy) against decode
speed (packed oneDNN weights are faster); this measures the decode side of that trade.

    python tools/bench_rollout_speed.py --preset cpu-dense-82m --cpu-linear packed,plain

Writes the preset model under --work-dir once (megatron_rl_lab/bench/presets.py, as every bench), then per
format builds one engine (each in a fresh process: vLLM's state is process-wide) and times
``generate`` of --prompts prompts x --n samples x --max-tokens tokens (median of --repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(model_dir: str, cpu_linear: str, prompts: int, n: int, max_tokens: int, repeats: int, cache: str) -> dict:
    import torch

    from megatron_rl.rollout import EngineConfig, RolloutEngine, Sampling

    engine = RolloutEngine(
        model_dir, EngineConfig(max_model_len=128, load_tokenizer=False, cpu_linear=cpu_linear, cache_dir=cache)
    )
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(3, 90, (12,), generator=g).tolist() for _ in range(prompts)]
    sampling = Sampling(n=n, max_tokens=max_tokens, temperature=1.0)
    engine.generate(batch[:2], sampling)  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = engine.generate(batch, sampling)
        rates.append(sum(len(s.token_ids) for group in out for s in group) / (time.perf_counter() - start))
    return {"cpu_linear": cpu_linear, "rows": prompts * n, "tokens_per_s": statistics.median(rates), "samples": rates}


def main(argv=None) -> int:
    from megatron_rl_lab.bench.presets import PRESETS
    from megatron_rl_lab.bench.weight_sync import DEFAULT_PRESET

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=list(PRESETS), default=DEFAULT_PRESET)
    p.add_argument("--cpu-linear", default="packed,plain", help="comma-separated: packed, plain")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work-dir", type=Path, default=Path("runs/bench/rollout_speed"))
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one format in this process
    args = p.parse_args(argv)
    model_dir = args.work_dir / "models" / args.preset
    cache = str(args.work_dir / "cache")
    if args.one:
        print(json.dumps(measure(str(model_dir), args.one, args.prompts, args.n, args.max_tokens, args.repeats, cache)))
        return 0
    formats = [f for f in args.cpu_linear.split(",") if f]
    bad = [f for f in formats if f not in ("packed", "plain")]
    if bad:
        p.error(f"--cpu-linear {bad[0]!r}: allowed packed, plain")
    if not (model_dir / "config.json").is_file():
        from megatron_rl_lab.testing.hf_models import save_tiny_model

        save_tiny_model(PRESETS[args.preset], model_dir, seed=0)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    for fmt in formats:
        cmd = [sys.executable, __file__, "--one", fmt, *(argv or sys.argv[1:])]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-2000:], file=sys.stderr)
            return proc.returncode
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        print(
            f"{args.preset}: cpu_linear={fmt}: {result['tokens_per_s']:.0f} tok/s "
            f"({result['rows']} rows x {args.max_tokens} tokens)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
