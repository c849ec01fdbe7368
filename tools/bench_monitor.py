"""Time one detection call: machines x 7 metrics x 15 min at 1 Hz, torch on one thread.

    python tools/bench_monitor.py [--machines 64,256,1024] [--repeats 5] [--model DIR|none]
        [--step-metrics] [--step-period 40,90] [--threads 1|2] [--cpus N] [--json FILE]

`--threads` is DetectConfig.threads (2: the denoiser on a second thread beside the peer
scores); `--cpus N` pins the process to N of the CPUs it may use (default: all), so
`--cpus 1` shows what a call costs when it has a single core to itself.

A call is what the online detector runs each time: normalise, window, denoise (the
packaged LSTM-VAEs unless --model none), score and declare, on an already resampled grid.
Resampling from trace rows (`to_grid`) is timed separately since the offline command
pays it once per file and the online monitor once per detection run.
Target (issues 8 and 23): <= 1 s for 1024 machines x 7 metrics.
CPU s is what the call's threads used together; wall s is what the caller waited.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core, before torch is imported

import torch  # noqa: E402

from megatron_rl.monitor.denoise import Denoiser, default_model_dir  # noqa: E402
from megatron_rl.monitor.detect import DetectConfig, declare, score_grid  # noqa: E402
from megatron_rl.monitor.windows import to_grid  # noqa: E402
from megatron_rl_lab.monitor.synth import SynthConfig, generate  # noqa: E402


def bench(
    machines: int,
    repeats: int,
    denoiser,
    cfg: DetectConfig,
    step_metrics: bool = False,
    step_period: tuple[float, float] = (6.0, 12.0),
) -> dict:
    st = generate(
        SynthConfig(
            machines=machines,
            seed=1,
            fault="gpu_drop",
            duration_s=900,
            step_metrics=step_metrics,
            step_period_s=step_period,
        )
    )
    calls, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        alerts = declare(score_grid(st.grid, cfg, denoiser), cfg).alerts
        calls.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)  # what the call itself used: less noisy on a shared VM
    trace = st.to_trace()
    t0 = time.perf_counter()
    to_grid(trace)
    resample = time.perf_counter() - t0
    return {
        "machines": machines,
        "metrics": len(st.grid.metrics),
        "seconds": st.grid.values.shape[-1],
        "rows": len(trace),
        "call_median_s": statistics.median(calls),
        "call_min_s": min(calls),
        "call_cpu_median_s": statistics.median(cpu),
        "load_avg_1min": os.getloadavg()[0],
        "threads": cfg.threads,
        "cpus": len(os.sched_getaffinity(0)),
        "to_grid_s": resample,
        "alerts": [a.machine for a in alerts],
        "fault": st.labels[0].machine,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machines", default="64,256,1024")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default=None, help="denoiser dir or 'none' (default: packaged)")
    ap.add_argument(
        "--step-metrics",
        action="store_true",
        help="add the trainer's step and section times (4 more metrics, not denoised)",
    )
    ap.add_argument(
        "--step-period",
        default="6,12",
        help="range of the job's step length in s (40,90: RL-like steps, averaged per step)",
    )
    ap.add_argument("--threads", type=int, default=DetectConfig.threads, help="DetectConfig.threads (1 or 2)")
    ap.add_argument("--cpus", type=int, default=0, help="pin to this many CPUs (0: all the process may use)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cpus:  # threads started later (the call's worker) inherit the mask
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.cpus])
    path = None if args.model == "none" else (args.model or default_model_dir())
    denoiser = Denoiser.load(path) if path else None
    cfg = DetectConfig(threads=args.threads)
    print(
        f"denoiser: {path or 'none'}; torch threads: {torch.get_num_threads()}; call threads: "
        f"{cfg.threads}; CPUs: {len(os.sched_getaffinity(0))}"
    )
    results = []
    for n in (int(x) for x in args.machines.split(",")):
        period = tuple(float(x) for x in args.step_period.split(","))
        r = bench(n, args.repeats, denoiser, cfg, args.step_metrics, period)
        results.append(r)
        print(
            f"{n:5d} machines x {r['metrics']} metrics x {r['seconds']} s: detection call "
            f"{r['call_median_s']:.3f} s median ({r['call_min_s']:.3f} min of {args.repeats}, "
            f"CPU {r['call_cpu_median_s']:.3f} s, load {r['load_avg_1min']:.1f}); "
            f"to_grid of {r['rows']} rows {r['to_grid_s']:.3f} s; "
            f"alerts {r['alerts']} (fault on {r['fault']})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
