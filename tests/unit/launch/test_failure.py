"""megatron_rl.launch.failure: the one line a failed rank prints, on real gloo errors.

The errors are raised by two real gloo ranks on this machine: a peer that stops answering
(its collective never comes) and a peer whose process is gone (its sockets close).
"""

from __future__ import annotations

import os
import queue
import socket

import pytest
import torch
import torch.multiprocessing as mp

from megatron_rl.launch.failure import describe_failure


def _rank(rank: int, port: int, peer_dies: bool, out, past_barrier, release) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2))
    dist.barrier()
    if rank == 0:
        past_barrier.set()
    if rank == 1:
        if peer_dies:
            # Rank 1 can leave the barrier before rank 0 has its last message: wait for it,
            # or rank 0 fails inside the barrier instead of the collective under test.
            past_barrier.wait(30)
            os._exit(0)  # the process is gone: its sockets close
        release.wait(60)  # stays alive but never joins the collective below
        return
    try:
        dist.all_reduce(torch.ones(1))
        out.put("no error")
    except RuntimeError as err:
        out.put(describe_failure(err, 2.0, {"RANK": "0", "SLURMD_NODENAME": "node-a"}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "peer_dies, expected",
    [
        (
            False,
            "megatron-rl: rank 0 on node-a failed: a collective waited longer than trainer.dist_timeout_s=2 "
            "for a peer (node down or network cut?): ",
        ),
        (True, "megatron-rl: rank 0 on node-a failed: lost the connection to peer 127.0.0.1 ("),
    ],
)
def test_names_rank_node_and_cause_of_a_gloo_failure(peer_dies, expected):
    ctx = mp.get_context("spawn")
    out, past_barrier, release = ctx.Queue(), ctx.Event(), ctx.Event()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, peer_dies, out, past_barrier, release)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        line = out.get(timeout=60)  # rank 0's report
    except queue.Empty:
        pytest.fail(f"rank 0 did not report within 60 s; exit codes {[p.exitcode for p in procs]}")
    finally:
        release.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert line.startswith(expected), line


def test_other_errors_keep_their_type_and_first_line():
    env = {"SLURM_PROCID": "3", "SLURMD_NODENAME": "gpu7"}
    line = describe_failure(ValueError("bad shape\nmore detail"), None, env)
    assert line == "megatron-rl: rank 3 on gpu7 failed: ValueError: bad shape"
