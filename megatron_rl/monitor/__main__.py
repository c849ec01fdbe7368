"""`python -m megatron_rl.monitor ...`: the monitor commands without the top-level CLI."""

import sys

from .cli import main

sys.exit(main())
