"""Node-failure drills on the namespace nodes of .ci/slurm_up.sh: the damage lands on mrl-n3.

Each drill runs the smoke trainer under train_torchrun.sbatch on two nodes (mrl-n3 and one
more), one rank each, a checkpoint every SAVE_INTERVAL steps, breaks mrl-n3 once a
checkpoint has committed and training has moved past it, and checks that nothing committed
is lost: the job requeues itself, resumes from a step at least the last committed one,
recomputes the steps after it exactly as the broken attempt had (the smoke job's data is a
function of the step, so equal losses also mean the data position went on where it had
stopped), and ends with every step 1..STEPS in metrics.jsonl once. Each prints its recovery
time (failure -> first step of the requeued attempt), recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.slurm.jobs import Job, committed_step

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS, SAVE_INTERVAL = 40, 10
DIST_TIMEOUT_S = 20
"""trainer.dist_timeout_s of the drills: how long a rank waits for a peer that went silent."""
OUTAGE_AFTER_FAILURE_S = 15
"""Drill 2 keeps the link down this long after the cut node's task has exited: longer than the cut
node's slurmstepd tries to report its task's exit to srun (~11 s), the outage after which
srun alone would wait forever."""
NODE = "mrl-n3"
SBATCH = ["-p", "nodes", "-N2", f"--nodelist={NODE}", "--ntasks-per-node=1"]
ENV = {"MRL_NPROC_PER_NODE": "1", "MRL_SRUN_WATCH_S": "3"}
OVERRIDES = (
    f"trainer.max_steps={STEPS}",
    f"checkpoint.save_interval={SAVE_INTERVAL}",
    f"trainer.dist_timeout_s={DIST_TIMEOUT_S}",
)


def _past_a_checkpoint(job: Job):
    """Once a checkpoint has committed and two steps after it are logged: (committed, rows)."""

    def ready():
        done, rows = committed_step(job.run_dir), job.rows()
        return (done, rows) if done >= SAVE_INTERVAL and len(rows) >= done + 2 else None

    return job.wait_for("a committed checkpoint and two steps past it", ready, 120)


def _first_resumed_step(job: Job, since: float, timeout_s: float = 150) -> float:
    """Seconds from ``since`` until the requeued attempt logs its first step."""
    job.wait_for(
        "a step of the requeued attempt", lambda: any(r["slurm/restart_count"] >= 1 for r in job.rows()), timeout_s
    )
    return time.time() - since


def _nothing_lost(job: Job, before: list[dict], committed: int) -> int:
    """The job ended well, resumed at or after ``committed`` and retrained what ``before`` (the
    broken attempt's rows) logged past its resume step identically. Returns the resume step."""
    assert job.finish() == 0, job.text()
    log = job.text()
    assert re.search(r"attempt \d+\.0: launcher exit [1-9]\d*: .*; restart 1 of 3", log), log
    resumed = re.search(r"resumed from \S+ at step (\d+) \(restart 1\)", log)
    assert resumed, log
    start = int(resumed.group(1))
    assert start >= committed, f"resumed at {start}, but step {committed} had committed"
    rows = job.rows()
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), [r["step"] for r in rows]
    assert len(before) > start, f"no step past the resume point {start} was logged before the failure"
    for got, want in zip(rows[: len(before)], before):  # steps after `start` were computed again
        assert (got["step"], got["lm_loss"], got["grad_norm"]) == (want["step"], want["lm_loss"], want["grad_norm"])
    assert [r["slurm/restart_count"] for r in rows] == [0] * start + [1] * (STEPS - start)
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"] - 1.0, (rows[0], rows[-1])
    return start


def _job_processes(node: str, job_id: str) -> dict[int, str]:
    """pid -> command name of the job's processes in the node's network namespace (those whose
    environment holds its SLURM_JOB_ID: other jobs sharing the node are left alone)."""
    out = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True, check=True).stdout
    names = {}
    for pid in map(int, out.split()):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"SLURM_JOB_ID={job_id}".encode() in environ:
                names[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue
    return names


def _job_tasks(node: str, job_id: str) -> dict[int, str]:
    """The job's own processes on the node (its torchrun and ranks), Slurm's slurmstepd left out."""
    return {pid: name for pid, name in _job_processes(node, job_id).items() if name != "slurmstepd"}


def test_kill_9_of_a_node_requeues_and_loses_nothing_committed(slurm_env, tmp_path):
    """Drill 1: SIGKILL to every process of the job on mrl-n3 (its torchrun and its rank), mid-run.
    Slurm's own daemons there stay: slurmd, and the step's slurmstepd, without which srun
    waits for the task's exit report until cancelled (Slurm 22.05; docs/platform.md)."""
    job = Job(slurm_env, "train_torchrun.sbatch", tmp_path / "kill", SBATCH, ENV, overrides=OVERRIDES)
    committed, _ = _past_a_checkpoint(job)
    victims = _job_tasks(NODE, job.job_id)
    failed_at = time.time()
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    before = job.rows()
    assert "python" in victims.values(), victims  # the rank itself (torchrun shows as pt_elastic)
    recovery = _first_resumed_step(job, failed_at)
    start = _nothing_lost(job, before, committed)
    # The log names the lost node: the surviving rank's line when gloo reports the closed socket
    # before srun ends that rank (it names the address, resolved to the node), else srun's
    # report of the killed task (which of the two comes first is a race).
    log = job.text()
    assert re.search(
        r"megatron-rl: rank 0 on mrl-n\d failed: lost the connection to peer 10\.77\.0\.3 \(mrl-n3\)"
        r"|srun: error: mrl-n3: task \d+: Killed",
        log,
    ), log[-4000:]
    print(
        f"drill kill -9 {NODE}: killed {sorted(victims.values())} after committed step {committed}, "
        f"resumed at {start}; recovery {recovery:.1f} s; job {job.seconds:.1f} s"
    )


def test_network_cut_fails_within_the_timeout_names_the_rank_and_requeues(slurm_env, tmp_path):
    """Drill 2: mrl-n3's link to the bridge goes down mid-run. The ranks' collectives give up
    after trainer.dist_timeout_s, each failing with one line naming its rank and node; the
    link comes back OUTAGE_AFTER_FAILURE_S after the cut node's task has exited (seen from
    the host, in the node's namespace), and the job requeues (srun, which never hears from
    the cut task, is stopped by the launch watcher once the step has ended) and resumes on
    the same nodes. Timed from the first rank's failure, the
    link may come back before a loaded node's rank has timed out: srun then hears its exit
    and the watcher has nothing to stop."""
    veth = "mrlv" + NODE.removeprefix("mrl-n")
    job = Job(slurm_env, "train_torchrun.sbatch", tmp_path / "cut", SBATCH, ENV, overrides=OVERRIDES, timeout_s=240)
    committed, _ = _past_a_checkpoint(job)
    cut_at = time.time()
    subprocess.run(["ip", "link", "set", veth, "down"], check=True)
    try:
        pattern = re.compile(
            r"megatron-rl: rank (\d+) on (\S+) failed: a collective waited longer than "
            rf"trainer.dist_timeout_s={DIST_TIMEOUT_S} for a peer"
        )
        failure = job.wait_for("the rank's timeout error", lambda: pattern.search(job.text()), DIST_TIMEOUT_S + 40)
        failed_after = time.time() - cut_at
        before = job.rows()
        job.wait_for("the cut node's task to exit", lambda: not _job_tasks(NODE, job.job_id), DIST_TIMEOUT_S + 60)
        time.sleep(OUTAGE_AFTER_FAILURE_S)  # the outage itself, not a wait for something
    finally:
        subprocess.run(["ip", "link", "set", veth, "up"], check=True)
    assert failed_after < DIST_TIMEOUT_S + 30, failed_after
    assert failure.group(2).startswith("mrl-n"), failure.group(0)
    recovery = _first_resumed_step(job, cut_at, 180)
    start = _nothing_lost(job, before, committed)
    assert re.search(r"srun \(pid \d+\) still waits \d+ s after its step of job \d+ ended", job.text()), job.text()
    print(
        f"drill network cut {NODE}: '{failure.group(0)}' {failed_after:.1f} s after the cut (committed step "
        f"{committed}), link up {OUTAGE_AFTER_FAILURE_S} s later, srun stopped by the watcher, resumed at {start}; "
        f"recovery {recovery:.1f} s; job {job.seconds:.1f} s"
    )


def _declare_faulty(host: str, peers: list[str], run_dir: Path) -> list[str]:
    """The monitor's offline detector (`megatron-rl monitor detect`, the real command) on a
    made-up trace where ``host`` draws 9 W less than its peers for 350 s (as the monitor's own
    tests inject faults); it writes the alert and appends to the run's exclude file."""
    import numpy as np

    from megatron_rl.monitor.cli import main as monitor
    from megatron_rl.monitor.trace import Trace, write_trace

    machines = [host] + [p for p in peers if p != host] + [f"spare{i}" for i in range(5)]
    metrics, duration = ["cpu_util", "gpu_duty_cycle", "gpu_power"], 400
    rng = np.random.default_rng(0)
    # A slow job-wide drift: a periodic common signal would read as the job's step period
    # (monitor.period), and continuity would stretch to 4 such steps.
    common = 50 + 10 * np.sin(2 * np.pi * np.arange(duration) / 1000)
    values = np.stack([common[None] * (k + 1) + rng.normal(0, 1.0, (len(machines), duration)) for k in range(3)])
    values[2, 0, 50:] -= 9.0
    k, i, t = np.nonzero(np.ones_like(values, dtype=bool))
    trace = run_dir.parent / "trace.csv"
    write_trace(
        Trace(
            t.astype(float), i.astype(np.int32), k.astype(np.int32), values[k, i, t].astype(float), machines, metrics
        ),
        trace,
    )
    exclude = run_dir / "monitor" / "exclude_hosts.txt"
    assert (
        monitor(
            [
                "detect",
                "--trace",
                str(trace),
                "--out",
                str(run_dir / "monitor" / "alerts.jsonl"),
                "--model",
                "none",
                "--continuity-s",
                "120",
                "--threshold",
                "5",
                "--exclude-file",
                str(exclude),
            ]
        )
        == 0
    )
    return exclude.read_text().split()


def _hostnames(node_list: str, env: dict) -> list[str]:
    out = subprocess.run(
        ["scontrol", "show", "hostnames", node_list], env=env, capture_output=True, text=True, check=True
    ).stdout
    return out.split()


def test_a_node_the_monitor_declares_faulty_is_left_out_on_requeue(slurm_env, tmp_path):
    """Drill 3: while the job runs on two of the three namespace nodes, the monitor declares one
    of them faulty (mrl-n3 when the job has it, else its second node). Every rank sees its
    node in the exclude file at its next step; the ranks stop together after a checkpoint,
    the batch script requeues the job with the node in ExcNodeList, and the run resumes on
    the two others at exactly the step it stopped at."""
    run_dir = tmp_path / "faulty"
    job = Job(
        slurm_env,
        "train_torchrun.sbatch",
        run_dir,
        ["-p", "nodes", "-N2", "--ntasks-per-node=1"],
        ENV,
        overrides=OVERRIDES,
    )
    first = re.search(
        r"restart 0 on (\S+) ",
        job.wait_for("the first attempt's nodes", lambda: "restart 0 on" in job.text() and job.text()),
    )
    nodes = _hostnames(first.group(1), slurm_env)
    faulty = NODE if NODE in nodes else nodes[1]
    _past_a_checkpoint(job)
    declared_at = time.time()
    assert _declare_faulty(faulty, nodes, run_dir) == [faulty]
    recovery = _first_resumed_step(job, declared_at)
    assert job.finish() == 0, job.text()
    log = job.text()
    assert f"this node ({faulty}) is listed in {run_dir / 'monitor' / 'exclude_hosts.txt'}" in log, log
    stopped = re.search(r"trainer status 75 at step (\d+): stopped after a checkpoint, requeue", log)
    assert stopped, log
    stop_step = int(stopped.group(1))
    restart = re.search(r"restart 1 on (\S+) .*ExcNodeList=(\S+)", log)
    assert restart and restart.group(2) == faulty, log
    assert faulty not in _hostnames(restart.group(1), slurm_env), restart.group(0)
    assert f"resumed from {run_dir / 'checkpoints'} at step {stop_step} (restart 1)" in log, log
    rows = job.rows()
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), [r["step"] for r in rows]
    assert [r["slurm/restart_count"] for r in rows] == [0] * stop_step + [1] * (STEPS - stop_step)
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"] - 1.0, (rows[0], rows[-1])
    print(
        f"drill monitor declares {faulty} faulty (job on {nodes}): stopped after step {stop_step}, requeued on "
        f"{restart.group(1)} excluding {faulty}; recovery {recovery:.1f} s; job {job.seconds:.1f} s"
    )
