"""`python -m megatron_rl.launch`: the batch script's helpers (fast: no torch import).

finish  --run-dir D --rc N [--max-restarts K]   after the launcher exits: decide, requeue the
                                                job (excluding the monitor's hosts) when due, and
                                                exit with the code the batch script should exit with
decide  --run-dir D --rc N [--max-restarts K]   print done | requeue | stop | fail (no action)
exclude --run-dir D                             print the exclude file as a node list
watch   --pid P --job J [--every S]              beside srun: kill it when it outlives its job
                                                step (launch/watch.py)
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_rl.launch", description="Helpers for scripts/slurm/*.sbatch."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    f = sub.add_parser(
        "finish",
        help="decide, and requeue this Slurm job (SLURM_JOB_ID) when due; "
        "exit 0 (done or requeued), 75 (stopped) or the failure code",
    )
    d = sub.add_parser(
        "decide", help="after the launcher exits: print done, requeue, stop or fail (the reason goes to stderr)"
    )
    for p in (f, d):
        p.add_argument("--run-dir", required=True)
        p.add_argument("--rc", type=int, required=True, help="the launcher's exit code")
        p.add_argument(
            "--max-restarts",
            type=int,
            default=3,
            help="requeue a failure only while SLURM_RESTART_COUNT is below this (default 3)",
        )
    e = sub.add_parser("exclude", help="print <run-dir>/monitor/exclude_hosts.txt as a comma-separated node list")
    e.add_argument("--run-dir", required=True)
    w = sub.add_parser("watch", help="kill srun (--pid) once its step of job --job has ended without it")
    w.add_argument("--pid", type=int, required=True)
    w.add_argument("--job", required=True)
    w.add_argument("--every", type=float, default=30.0, help="seconds between two looks at the job's steps")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command in ("decide", "finish"):
            from megatron_rl.launch.policy import decide
            from megatron_rl.launch.slurm_env import SlurmEnv
            from megatron_rl.launch.status import read_status

            env = SlurmEnv.from_environ()
            decision = decide(args.rc, read_status(args.run_dir), env, args.max_restarts)
            if args.command == "decide":
                print(decision.action)
                print(f"megatron-rl launch: {decision.reason}", file=sys.stderr)
                return 0
            print(f"megatron-rl slurm: {decision.reason}", flush=True)
            return _finish(decision.action, args.rc, args.run_dir, env)
        if args.command == "exclude":
            from megatron_rl.launch.exclude import node_list

            print(node_list(args.run_dir))
            return 0
        if args.command == "watch":
            from megatron_rl.launch.watch import watch

            watch(args.pid, args.job, args.every)
            return 0
    except ValueError as err:
        print(f"megatron-rl launch: error: {err}", file=sys.stderr)
        return 2
    raise AssertionError(args.command)


def _finish(action: str, rc: int, run_dir: str, env) -> int:
    from megatron_rl.launch.exit_codes import FAILED, STOPPED

    if action == "done":
        return 0
    if action == "stop":
        return STOPPED
    if action == "requeue":
        if env.job_id is None:
            print("megatron-rl slurm: not inside a Slurm job (no SLURM_JOB_ID), cannot requeue", flush=True)
            return rc or FAILED
        from megatron_rl.launch.exclude import excluded_hosts
        from megatron_rl.launch.requeue import RequeueError, requeue

        try:
            hosts = excluded_hosts(run_dir)
        except ValueError as err:  # a bad exclude file must not cost the run its requeue
            print(f"megatron-rl slurm: ignoring the exclude file: {err}", flush=True)
            hosts = []
        try:
            excluded = requeue(env.job_id, hosts)
        except RequeueError as err:
            print(f"megatron-rl slurm: {err}", flush=True)
            return rc or FAILED
        print(
            f"megatron-rl slurm: requeued job {env.job_id}" + (f", excluding {','.join(excluded)}" if hosts else ""),
            flush=True,
        )
        return 0
    return rc or FAILED
