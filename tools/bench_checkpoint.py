"""Checkpoint benchmark (this store vs torch_dist vs torch DCP): `megatron-rl bench checkpoint` as a script.

    torchrun --nproc-per-node=4 tools/bench_checkpoint.py --json out.json
    torchrun --nproc-per-node=2 tools/bench_checkpoint.py --model tiny-dense-4l --repeats 1

Saves from TP2 (x DP), loads back and reshards into TP1; prints blocking, save, load and
reshard times per method and the ratios to torch DCP. It writes into a new directory (or
an empty --dir) and removes only what it created. Everything is in
megatron_rl_lab/bench/checkpoint.py; `--help` lists the options.
"""

import sys

from megatron_rl_lab.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["checkpoint", *sys.argv[1:]]))
