"""One Slurm task of test_nodes.py: a gloo all_reduce with the other tasks, then one JSON line.

Rank and world from srun (SLURM_PROCID / SLURM_NTASKS); MASTER_ADDR / MASTER_PORT from the
job script. Prints what the task saw: its node, hostname, address, the reduced sum and
whether megatron_rl's same-host test (shared-memory weight transfer) thinks all ranks share
this host.
"""

import json
import os
import socket

import torch
import torch.distributed as dist

from megatron_rl.bridge.host_arena import all_ranks_on_this_host

rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group("gloo", rank=rank, world_size=world)
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
same_host = all_ranks_on_this_host()
print(
    json.dumps(
        {
            "rank": rank,
            "node": os.environ["SLURMD_NODENAME"],
            "hostname": socket.gethostname(),
            "addr": socket.gethostbyname(socket.gethostname()),
            "sum": total.item(),
            "same_host": same_host,
        }
    ),
    flush=True,
)
dist.destroy_process_group()
