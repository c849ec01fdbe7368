"""The lab's subcommands, declared to the runtime's command line through entry points.

setup.py names each object below under the group `megatron_rl.commands`; `megatron-rl`
lists them in its help and runs `module.main(argv)` when one is used. This module imports
nothing heavy: the help of `megatron-rl` loads it.
"""

from megatron_rl.commands import Subcommand

BENCH = Subcommand(
    "megatron_rl_lab.bench.cli",
    "benchmarks: mfu | weight-sync | checkpoint | mismatch | packing | async; see `bench --help`",
)
