#!/usr/bin/env python
"""Build the embedded default's tiny supervised base model (see megatron_rl.tasks.base_model).

    python tools/make_tiny_base.py --out runs/tiny_base [--task digits_max] [--family qwen3_moe]
        [--seed 0] [--check-vllm]

Cached by the settings' content hash: a second call with the same settings returns at once.
"""

import sys

from megatron_rl.tasks.base_model import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
