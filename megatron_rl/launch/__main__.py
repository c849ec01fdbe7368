import sys

from megatron_rl.launch.cli import main

sys.exit(main())
