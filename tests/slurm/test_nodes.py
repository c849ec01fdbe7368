"""The namespace nodes of .ci/slurm_up.sh (partition `nodes`, mrl-n1..mrl-n3): several hosts on one machine.

Each node is a slurmd in its own network and UTS namespace, so a job spanning two of them
sees two hostnames and two addresses, and its tasks meet over the private bridge the way
ranks on two machines meet over the network.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
NODES = {"mrl-n1", "mrl-n2", "mrl-n3"}


@pytest.fixture(scope="module")
def nodes_env(slurm_env) -> dict:
    """slurm_env, once the cluster is known to have the namespace nodes up."""
    proc = subprocess.run(
        ["sinfo", "-h", "-p", "nodes", "-N", "-o", "%N %T"], env=slurm_env, capture_output=True, text=True, timeout=20
    )
    states = dict(line.split() for line in proc.stdout.splitlines())
    assert set(states) == NODES and set(states.values()) <= {"idle", "mixed", "allocated"}, (
        f"partition 'nodes' of the test cluster: {states or proc.stderr.strip()} (started by an older .ci/slurm_up.sh?)"
    )
    return slurm_env


def test_srun_on_two_nodes_sees_two_hostnames(nodes_env):
    proc = subprocess.run(
        ["srun", "-p", "nodes", "-N2", "hostname"], env=nodes_env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    names = proc.stdout.split()
    assert len(names) == 2 and len(set(names)) == 2 and set(names) <= NODES, names


def test_gloo_all_reduce_across_two_nodes(nodes_env, tmp_path):
    """sbatch on two nodes, one task each: MASTER_ADDR is the first node's name, resolved
    inside the namespaces; the tasks see different hostnames and addresses, reduce, and
    megatron_rl's same-host test says they are on different hosts."""
    log = tmp_path / "job.log"
    script = (
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)'
        " MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 40000 )); "
        f"srun {sys.executable} {REPO / 'tests' / 'slurm' / 'allreduce_task.py'}"
    )
    env = dict(nodes_env, OMP_NUM_THREADS="1")  # sbatch exports it to the job
    proc = subprocess.run(
        ["sbatch", "--wait", "-p", "nodes", "-N2", "--ntasks-per-node=1", f"--output={log}", "--wrap", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = log.read_text() if log.exists() else "(no log)"
    assert proc.returncode == 0, f"{proc.stderr}\n{text}"
    tasks = sorted((json.loads(line) for line in text.splitlines() if line.startswith("{")), key=lambda t: t["rank"])
    assert [t["sum"] for t in tasks] == [3.0, 3.0], text  # ranks 0 and 1 contribute 1 and 2
    assert [t["hostname"] for t in tasks] == [t["node"] for t in tasks], text
    assert len({t["hostname"] for t in tasks}) == 2 and len({t["addr"] for t in tasks}) == 2, text
    assert all(t["addr"].startswith("10.77.0.") for t in tasks), text
    assert [t["same_host"] for t in tasks] == [False, False], text  # bridge/host_arena.py tells the nodes apart
