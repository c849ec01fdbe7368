"""MFU of Megatron training steps: `megatron-rl bench mfu` as a script (torchrun-friendly).

    python tools/bench_mfu.py --model cpu-dense-5m
    torchrun --nproc-per-node=2 tools/bench_mfu.py --model cpu-moe-9m --sweep
    python tools/bench_mfu.py --model gpu-dense-1b --dtype bf16 --seq-length 4096 \
        --global-batch-size 16 --micro-batch-size 2

Prints one line per layout (tokens/s, achieved FLOP/s per device, step time, peak memory),
then MFU against the device peak (GPU: data-sheet table; CPU: an fp32 matmul loop measured
in the same run), and writes everything as JSON (--json). `--help` lists all options.
"""

import sys

from megatron_rl_lab.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["mfu", *sys.argv[1:]]))
