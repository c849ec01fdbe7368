"""Replay coupled traces through the online monitor, with and without a lookback that
grows with the step (`OnlineConfig.grow_lookback`), and report recall per fault kind,
false alarms and delays.

    python tools/replay_online_monitor.py [--machines 8,32] [--faulty 2] [--fault-free 2]
        [--seed 700000] [--duration-s 3600] [--step-period 150,300] [--model DIR|none]
        [--json FILE]

Unlike `monitor eval` (one offline detection over each whole trace), this is what a job
gets: the real OnlineMonitor, detection every `detect_every_steps` steps over its own
history, each machine declared once. Delays count from the fault's start to the
detection that declared it. A declared machine other than the faulty one, or the
faulty one before its fault, is a false alarm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from collections import Counter

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from megatron_rl.monitor.config import OnlineConfig  # noqa: E402
from megatron_rl.monitor.denoise import Denoiser, default_model_dir  # noqa: E402
from megatron_rl.monitor.detect import DetectConfig  # noqa: E402
from megatron_rl_lab.monitor.coupled import COUPLED_FAULT_KINDS, CoupledConfig, generate_coupled  # noqa: E402
from megatron_rl_lab.monitor.replay import replay_online  # noqa: E402


def one_trace(cfg: CoupledConfig, grow: bool, denoiser) -> dict:
    st = generate_coupled(cfg)
    label = st.labels[0] if st.labels else None
    step = float(np.nanmedian(st.grid.values[st.grid.metrics.index("step_time")]))
    online = OnlineConfig(detect=DetectConfig(), grow_lookback=grow)
    with tempfile.TemporaryDirectory() as run_dir:
        declared = replay_online(st.grid, step, online, run_dir, denoiser)
    hit = [d for d in declared if label and d.alert.machine == label.machine and d.at >= label.start]
    return dict(
        fault=cfg.fault,
        machines=cfg.machines,
        seed=cfg.seed,
        step_s=round(step, 1),
        found=bool(hit),
        delay_s=round(hit[0].at - label.start) if hit else None,
        false_alarms=len(declared) - len(hit),
    )


def summary(rows: list[dict]) -> dict:
    faulty = [r for r in rows if r["fault"]]
    found = [r for r in faulty if r["found"]]
    fa = sum(r["false_alarms"] for r in rows)
    p = len(found) / max(1, len(found) + fa)
    rec = len(found) / max(1, len(faulty))
    kinds = Counter(r["fault"] for r in faulty)
    hits = Counter(r["fault"] for r in found)
    return dict(
        recall=round(rec, 3),
        precision=round(p, 3),
        f1=round(2 * p * rec / (p + rec), 3) if found else 0.0,
        found=len(found),
        faults=len(faulty),
        false_alarms=fa,
        fault_free_false_alarms=sum(r["false_alarms"] for r in rows if not r["fault"]),
        median_delay_s=statistics.median([r["delay_s"] for r in found]) if found else None,
        per_kind={k: f"{hits[k]}/{kinds[k]}" for k in kinds},
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--machines", default="8,32")
    p.add_argument("--faulty", type=int, default=2, help="faulty traces per (kind, size)")
    p.add_argument("--fault-free", type=int, default=2, help="fault-free traces per size")
    p.add_argument("--seed", type=int, default=700_000)
    p.add_argument("--duration-s", type=int, default=3600)
    p.add_argument("--step-period", default="150,300", help="range of the nominal step in s")
    p.add_argument("--model", default=None, help="denoiser dir or 'none' (default: packaged)")
    p.add_argument("--json", help="write the rows and summaries here")
    a = p.parse_args()
    torch.set_num_threads(1)
    lo, hi = (float(x) for x in a.step_period.split(","))
    denoiser = None if a.model == "none" else Denoiser.load(a.model or default_model_dir())
    configs = [
        CoupledConfig(
            machines=n, duration_s=a.duration_s, seed=a.seed + j, fault=kind, step_period_s=(lo, hi), step_metrics=True
        )
        for n in (int(x) for x in a.machines.split(","))
        for kind, count in [(None, a.fault_free)] + [(k, a.faulty) for k in COUPLED_FAULT_KINDS]
        for j in range(count)
    ]
    result = {}
    for grow in (False, True):
        rows = [one_trace(c, grow, denoiser) for c in configs]
        name = "grown lookback" if grow else "fixed 900 s lookback"
        result[name] = dict(summary=summary(rows), rows=rows)
        print(name, json.dumps(result[name]["summary"]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), **result), f, indent=1)


if __name__ == "__main__":
    main()
