"""Weight-sync benchmark (Megatron layouts -> colocated vLLM): `megatron-rl bench weight-sync` as a script.

    torchrun --nproc-per-node=2 tools/bench_weight_sync.py --preset cpu-dense-9m
    torchrun --nproc-per-node=4 tools/bench_weight_sync.py --preset cpu-moe-14m \
        --layouts tp2,pp2,ep2,tp2_ep2_etp1 --bucket-mb 16,64,512 --json ws.json

Per layout x bucket size: sync time (median), bytes each rank's engine receives, GB/s,
peak extra memory, the gather / vLLM-load split, and the ratio to a plain copy of the
same bytes measured in the same run. `--help` lists the options.
"""

import sys

from megatron_rl_lab.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["weight-sync", *sys.argv[1:]]))
