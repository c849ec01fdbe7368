"""HF directory -> megatron_rl checkpoint (same as `megatron-rl convert hf-to-megatron`).

python tools/convert_hf_to_megatron.py --hf DIR --out DIR [--tp N --pp N --ep N --etp N]
torchrun --nproc-per-node=4 tools/convert_hf_to_megatron.py --hf DIR --out DIR --tp 2 --ep 2
"""

import sys

from megatron_rl.bridge.cli import main

if __name__ == "__main__":
    sys.exit(main(["hf-to-megatron", *sys.argv[1:]]))
