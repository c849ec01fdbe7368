"""Run a test body under torchrun on gloo, many cases per launch.

A launch costs 6-15 s of imports and process-group setup, so a body script runs a whole
list of cases (layouts) in one launch and reports each case's result; the pytest side
launches once per module and turns each case into its own test.

Body side::

    from megatron_rl_lab.testing.torchrun import run_cases
    if __name__ == "__main__":
        run_cases({"tp2": case_tp2, "pp2": case_pp2})   # each returns a JSON-able dict

Pytest side::

    results = launch(BODY, world_size=4)     # {case: {"ok": bool, "result"|"error": ...}}
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Optional, Sequence

RESULT_ENV = "MEGATRON_RL_TEST_RESULT"
CASES_ENV = "MEGATRON_RL_TEST_CASES"


class LaunchError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(
    script: Path, world_size: int, args: Sequence[str] = (), timeout_s: float = 1200, env: Optional[dict] = None
) -> subprocess.CompletedProcess:
    """``script`` under torchrun at ``world_size`` on a free port, one thread per rank (the
    ranks share the host's cores); the finished process with its output captured."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={world_size}",
        f"--master-port={_free_port()}",
        str(script),
        *args,
    ]
    return run_process_group(cmd, env, timeout_s)


def run_process_group(
    cmd: Sequence[str], env: Optional[dict], timeout_s: float, cwd: Optional[Path] = None
) -> subprocess.CompletedProcess:
    """``cmd`` in a session of its own, output captured. On a timeout every descendant is
    killed, not only the leader: a torchrun killed alone leaves its ranks (and their vLLM
    workers) running, and those orphans slow every later test on a 2-core machine.
    torchrun starts each rank in a session of its own, so killing torchrun's session is
    not enough: the ranks are found by their parent links."""
    proc = subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout_s, output=out, stderr=err) from None
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C): leave nothing behind
            kill_tree(proc.pid)
    _kill_leftovers(proc.pid)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first), from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop(0)
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s descendants, then its session."""
    for child in descendants(pid):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _kill_leftovers(pid)


def _kill_leftovers(session: int) -> None:
    """Children that outlived a finished launch (a rank's stray worker) go with it."""
    try:
        os.killpg(session, signal.SIGKILL)
    except ProcessLookupError:
        pass


def launch(
    script: Path,
    world_size: int,
    args: Sequence[str] = (),
    timeout_s: float = 1200,
    cases: Optional[Sequence[str]] = None,
    env: Optional[dict] = None,
) -> dict:
    """Run ``script`` with torchrun at ``world_size``; return rank 0's case results.
    ``env`` adds variables for the ranks (e.g. ``MEGATRON_RL_FORCE_CPU=1`` for a CPU
    reference run on a GPU machine)."""
    with tempfile.TemporaryDirectory(prefix="mrl-torchrun-") as tmp:
        result_path = Path(tmp) / "result.json"
        env = {**(env or {}), RESULT_ENV: str(result_path)}
        if cases is not None:
            env[CASES_ENV] = ",".join(cases)
        start = time.time()
        proc = run_script(script, world_size, args, timeout_s, env)
        if not result_path.exists():
            tail = (proc.stdout + proc.stderr)[-6000:]
            raise LaunchError(
                f"torchrun exited {proc.returncode} with no result after {time.time() - start:.0f} s:\n{tail}"
            )
        results = json.loads(result_path.read_text())
        for err in sorted(Path(tmp).glob("*.err")):  # failures seen by ranks other than 0
            case, _, error = err.read_text().partition("\n")
            if results.get(case, {}).get("ok") is not True:
                results[case] = {"ok": False, "error": error}
        if proc.returncode != 0:
            results["__launch__"] = {"ok": False, "error": (proc.stdout + proc.stderr)[-6000:]}
        return results


def run_cases(cases: dict[str, Callable[[], dict]]) -> None:
    """Body side: run each case on every rank; rank 0 records results as they finish.

    A case that raises on one rank would leave the others blocked in a collective, so the
    first failure is recorded and the launch stops (the remaining cases report 'not run').
    """
    import torch.distributed as dist

    from megatron_rl import platform

    platform.init_distributed(timeout_s=300)
    wanted = os.environ.get(CASES_ENV)
    names = [n for n in cases if not wanted or n in wanted.split(",")]
    rank = dist.get_rank()
    results: dict = {n: {"ok": False, "error": "not run (an earlier case failed)"} for n in names}

    def write() -> None:
        if rank == 0:
            path = Path(os.environ[RESULT_ENV])
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(results, indent=1, default=str))
            tmp.replace(path)

    for name in names:
        start = time.time()
        try:
            result = cases[name]()
            results[name] = {"ok": True, "result": result, "seconds": round(time.time() - start, 2)}
            write()
        except Exception:
            error = f"rank {rank}: {traceback.format_exc()}"
            results[name] = {"ok": False, "error": error}
            Path(f"{os.environ[RESULT_ENV]}.{rank}.err").write_text(f"{name}\n{error}")
            write()
            raise
    write()
    dist.destroy_process_group()
