"""megatron_rl checkpoint -> HF directory (same as `megatron-rl convert megatron-to-hf`).

python tools/convert_megatron_to_hf.py --ckpt DIR --out DIR [--step N] [--dtype bf16]
"""

import sys

from megatron_rl.bridge.cli import main

if __name__ == "__main__":
    sys.exit(main(["megatron-to-hf", *sys.argv[1:]]))
