"""The lab's subcommands, declared to the runtime's command line through entry points.

setup.py names each object below under the group `megatron_rl.commands`; `megatron-rl`
lists them in its help and runs `module.main(argv)` when one is used. This module imports
nothing heavy: the help of `megatron-rl` loads it.
"""

from megatron_rl.commands import Subcommand

BENCH = Subcommand(
    "megatron_rl_lab.bench.cli",
    "benchmarks: mfu | weight-sync | checkpoint | mismatch | packing | async | cp | tools | compare; "
    "see `bench --help`",
)
MONITOR_EVAL = Subcommand(
    "megatron_rl_lab.monitor.cli", "precision/recall/F1 on synthetic traces vs baselines", "eval_main"
)
MONITOR_SYNTH = Subcommand(
    "megatron_rl_lab.monitor.cli", "write a synthetic trace (and its fault labels)", "synth_main"
)
MONITOR_TRAIN_SYNTHETIC = Subcommand(
    "megatron_rl_lab.monitor.cli",
    "train the denoiser on synthetic fault-free traces (how the packaged weights are made)",
    "train_synthetic_main",
)
