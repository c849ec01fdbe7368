"""megatron_rl.launch without a cluster: exit-code policy, exclude file, metrics resume, stop signals.

The signal test sends real signals to this process; the agreement test runs two real gloo
ranks, one of which is signalled, and checks both stop at the same step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch.multiprocessing as mp

from megatron_rl.launch import exit_codes
from megatron_rl.launch.exclude import excluded_hosts, node_list
from megatron_rl.launch.policy import decide
from megatron_rl.launch.resume import continue_metrics
from megatron_rl.launch.signals import StopSignals
from megatron_rl.launch.slurm_env import SlurmEnv
from megatron_rl.launch.status import read_status, write_status

JOB = SlurmEnv(job_id="42", restart_count=1, node="n1", node_list="n[1-2]")


def _status(code, signal_name=None, attempt="42.1", step=7):
    return {"code": code, "signal": signal_name, "attempt": attempt, "step": step}


@pytest.mark.parametrize(
    "rc, status, max_restarts, action",
    [
        (0, None, 3, "done"),
        (75, None, 3, "requeue"),  # srun passes the trainer's code through
        (1, _status(75, "SIGUSR1"), 3, "requeue"),  # torchrun turns it into 1: the status file says
        (0, _status(75, "SIGUSR1"), 0, "requeue"),  # a stop is not a failure: no limit
        (1, _status(75, "SIGTERM"), 3, "stop"),  # cancel / time limit: saved, not requeued
        (1, _status(75, "SIGINT"), 3, "stop"),  # Ctrl-C: saved, not requeued
        (137, _status(75, "SIGUSR1", attempt="42.0"), 3, "requeue"),  # the earlier attempt's file is ignored...
        (137, _status(75, "SIGUSR1", attempt="42.0"), 1, "fail"),  # ...so this is a failure, over the limit
        (2, None, 3, "fail"),  # config error: a requeue would repeat it
        (1, _status(0), 0, "done"),  # finished, then a rank tripped on teardown
    ],
)
def test_decide(rc, status, max_restarts, action):
    assert decide(rc, status, JOB, max_restarts).action == action


def test_decide_reason_names_the_failure():
    reason = decide(137, None, JOB, 3).reason
    assert reason == "attempt 42.1: launcher exit 137: killed by signal 9; restart 2 of 3"
    assert exit_codes.describe(75) == "stopped after a checkpoint"


def test_slurm_env():
    env = SlurmEnv.from_environ(
        {
            "SLURM_JOB_ID": "9",
            "SLURM_RESTART_COUNT": "2",
            "SLURMD_NODENAME": "gpu07",
            "SLURM_JOB_NODELIST": "gpu[07-08]",
        }
    )
    assert (env.job_id, env.restart_count, env.node, env.attempt) == ("9", 2, "gpu07", "9.2")
    assert SlurmEnv.from_environ({}).attempt == "local.0"
    with pytest.raises(ValueError, match="SLURM_RESTART_COUNT='x' is not an integer"):
        SlurmEnv.from_environ({"SLURM_RESTART_COUNT": "x"})


def test_exclude_file(tmp_path):
    assert excluded_hosts(tmp_path) == [] and node_list(tmp_path) == ""
    (tmp_path / "monitor").mkdir()
    (tmp_path / "monitor" / "exclude_hosts.txt").write_text("# declared by the monitor\ngpu03\n\n gpu11 \ngpu03\n")
    assert node_list(tmp_path) == "gpu03,gpu11"
    (tmp_path / "monitor" / "exclude_hosts.txt").write_text("gpu03,gpu04\n")
    with pytest.raises(ValueError, match="'gpu03,gpu04' is not a hostname"):
        excluded_hosts(tmp_path)


def test_metrics_continue_from_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "lm_loss": 1.0 / s} for s in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lm_lo')  # torn by a kill
    with continue_metrics(path, 3) as f:
        f.write(json.dumps({"step": 4, "lm_loss": 9.0}) + "\n")
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3] + [{"step": 4, "lm_loss": 9.0}]
    with continue_metrics(path, 0) as f:  # no checkpoint: a fresh start
        pass
    assert path.read_text() == ""


def test_status_file_round_trip(tmp_path):
    assert read_status(tmp_path) is None
    write_status(tmp_path, exit_codes.STOPPED, 5, "SIGUSR1", JOB)
    status = read_status(tmp_path)
    assert {k: status[k] for k in ("code", "meaning", "step", "signal", "attempt")} == {
        "code": 75,
        "meaning": "stopped after a checkpoint",
        "step": 5,
        "signal": "SIGUSR1",
        "attempt": "42.1",
    }
    assert decide(1, status, JOB, 0).action == "requeue"


def test_stop_signals_set_a_flag_and_restore_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    with StopSignals() as stop:
        assert stop.agree() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == signal.SIGUSR1 and stop.agree() == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.agree() == signal.SIGTERM  # a cancel is never downgraded to a requeue
    assert signal.getsignal(signal.SIGUSR1) is before


def _rank(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    with StopSignals() as stop:
        for step in range(1, 10):
            if rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)  # only rank 1 is signalled
            agreed = stop.agree()
            if agreed is not None:
                out.put((rank, step, agreed.name))
                break
    dist.destroy_process_group()


def test_ranks_agree_on_the_stop_step():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == [(0, 3, "SIGUSR1"), (1, 3, "SIGUSR1")]


def test_cli_outside_slurm(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    decide_cmd = [sys.executable, "-m", "megatron_rl.launch", "decide", "--run-dir", str(tmp_path), "--rc", "137"]
    proc = subprocess.run(decide_cmd, env=env, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "requeue\n") and "killed by signal 9" in proc.stderr
    finish = [sys.executable, "-m", "megatron_rl.launch", "finish", "--run-dir", str(tmp_path), "--rc", "137"]
    proc = subprocess.run(finish, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 137 and "not inside a Slurm job" in proc.stdout
