"""What idle gloo process groups cost on CPU, with and without the platform's shared device.

    python tools/bench_gloo_groups.py                       # world 4, 0 and 100 groups, 10 s idle
    python tools/bench_gloo_groups.py --world 8 --groups 0 50 300 --idle-s 20

Each configuration is one torchrun launch: every rank creates the default group and
``groups`` more over all ranks (as Megatron-Core's layouts and the checkpointers do), runs
one all-reduce on each, then sleeps ``idle-s`` seconds and reports the CPU it used while
asleep and its threads. Without the patch (``MEGATRON_RL_CPU_PATCHES_EXCLUDE=gloo_shared_device``)
torch 2.13.0 gives every group its own transport device and event-loop thread; with it
(the default on CPU) a process's groups share one. Writes JSON (--json) and prints a table;
docs/benchmarks.md keeps the measured one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

from megatron_rl_lab.testing.torchrun import run_script

PATCH = "gloo_shared_device"


def rank_body(groups: int, idle_s: float, out_dir: Path) -> None:
    """One rank: the groups, one all-reduce each, then ``idle_s`` asleep, measured."""
    import torch
    import torch.distributed as dist

    from megatron_rl import platform as mrl_platform

    mrl_platform.init_distributed()
    made = [dist.new_group(list(range(dist.get_world_size()))) for _ in range(groups)]
    for group in made:
        dist.all_reduce(torch.ones(1), group=group)
    dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(idle_s)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    record = {"idle_cpu_s": cpu_s, "threads": len(os.listdir("/proc/self/task"))}
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def launch(world: int, groups: int, idle_s: float, shared: bool) -> dict:
    """One torchrun launch of :func:`rank_body`: the CPU the sleeping ranks used together,
    in cores kept busy, and the threads of the rank that had most."""
    with tempfile.TemporaryDirectory(prefix="bench-gloo-") as tmp:
        env = {"MEGATRON_RL_CPU_PATCHES_EXCLUDE": "" if shared else PATCH}
        proc = run_script(Path(__file__), world, ["--rank-body", str(groups), str(idle_s), tmp], 600, env)
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    idle = sum(r["idle_cpu_s"] for r in ranks)
    return {
        "world": world,
        "groups": groups,
        "shared_device": shared,
        "idle_cores": round(idle / idle_s, 4),  # all ranks together, in cores kept busy
        "threads_per_rank": max(r["threads"] for r in ranks),
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-body":
        rank_body(int(sys.argv[2]), float(sys.argv[3]), Path(sys.argv[4]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--groups", type=int, nargs="+", default=[0, 100])
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--json", default="bench_gloo_groups.json")
    args = p.parse_args()
    rows = [launch(args.world, g, args.idle_s, shared) for g in args.groups for shared in (False, True)]
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "idle_s": args.idle_s,
        "rows": rows,
    }
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"{result['date']}, {os.cpu_count()} CPUs, {args.idle_s:g} s idle")
    print("| world | groups | shared device | idle cores (all ranks) | threads per rank |")
    print("|---|---|---|---|---|")
    for r in rows:
        cells = (r["world"], r["groups"], r["shared_device"], f"{r['idle_cores']:.3f}", r["threads_per_rank"])
        print("| " + " | ".join(map(str, cells)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
