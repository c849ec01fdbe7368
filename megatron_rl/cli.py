"""`megatron-rl`: the command line (also `python -m megatron_rl`).

Config errors are reported by one validation pass (megatron_rl.from_config.checks) before Megatron
or any process group is touched (bad layouts, data and names before torch too), so they come
back in well under two seconds.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Optional, Sequence

from megatron_rl.commands import Subcommand, installed
from megatron_rl.launch import startup_gc

EPILOG = """\
examples:
  megatron-rl train --config examples/dapo.yaml trainer.max_steps=5
  torchrun --nproc-per-node=4 -m megatron_rl train --config examples/dapo.yaml \\
      parallel.tensor_model_parallel_size=2 parallel.expert_model_parallel_size=2
  megatron-rl layout --world-size 8 parallel.tensor_model_parallel_size=2 \\
      parallel.pipeline_model_parallel_size=2 parallel.expert_model_parallel_size=4
  megatron-rl config --config examples/dapo.yaml model.dtype=bf16
  megatron-rl convert hf-to-megatron --hf HF_DIR --out CKPT --tp 2 --ep 2
  megatron-rl convert megatron-to-hf --ckpt CKPT --out HF_DIR
  megatron-rl ckpt inspect CKPT --verify
  megatron-rl eval --config runs/dapo/config.yaml --ckpt runs/dapo --json val.json
  megatron-rl plot runs/dapo --keys reward/mean,actor/entropy
  megatron-rl tool python solve.py --timeout 2

Overrides are dotted key=value pairs over the config tree (sections: model, parallel,
trainer, algorithm, rollout, data, checkpoint, monitor, eval); unknown keys and bad values fail at once,
naming the key and what is allowed.
"""


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML recipe (see examples/)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. trainer.max_steps=3")


def build_parser(own_parsers: dict[str, Subcommand]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rl",
        description="RL for reasoning LLMs (dense and MoE) on Megatron-Core, with vLLM rollouts.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser(
        "train",
        help="train (SPMD under torchrun/srun, world size 1 alone)",
        description="Run training: the RL trainer (trainer.job=rl, the default; the recipe is "
        "algorithm.recipe; algorithm.recipe=reward_model trains a Bradley-Terry reward model on "
        "data.source=pairs:PATH or pairs:task:<name>; algorithm.recipe=sft fine-tunes the policy on chat "
        "conversations, data.source=PATH of messages rows or task:<name>) or the model smoke job "
        "(trainer.job=smoke: supervised next-token training of the tiny actor through Megatron's schedules).",
    )
    _add_config_args(train)
    show = sub.add_parser("config", help="print the resolved config as YAML")
    _add_config_args(show)
    layout = sub.add_parser(
        "layout",
        help="validate the run (layouts against the model it builds, recipe, data) and print every rank's coordinates",
    )
    _add_config_args(layout)
    layout.add_argument("--world-size", type=int, required=True, help="number of ranks")
    # Subcommands with their own parsers (loaded only when used: they import torch).
    for name, command in own_parsers.items():
        sub.add_parser(name, add_help=False, help=command.help)
    return parser


def _load(args, world_size: Optional[int] = None):
    from megatron_rl.config import load_config
    from megatron_rl.from_config import validate

    cfg = load_config(args.config, args.overrides)
    if world_size is not None:
        validate(cfg, world_size)
    return cfg


def _world_size_from_env() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))


def _report_supervised(summary: dict) -> None:
    """A supervised run's last lines (a reward model's, SFT's): its loss and every eval set's
    reported metric."""
    print(
        f"run dir: {summary['run_dir']}  train/loss (mean of first 5 steps of this run) "
        f"{summary['first_loss']:.4f} -> (last 5) {summary['last_loss']:.4f}"
    )
    for key, ((first_step, first), (last_step, last)) in summary.get("val", {}).items():
        print(f"{key} {first:.3f} (step {first_step}) -> {last:.3f} (step {last_step})")


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_rl.config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    own_parsers = installed()
    if argv[:1] and argv[0] in own_parsers:
        return own_parsers[argv[0]].run(argv[1:])
    parser = build_parser(own_parsers)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    cfg = None
    try:
        if args.command == "config":
            from megatron_rl.config import dump_yaml
            from megatron_rl.from_config.checks import check_recipe

            cfg = _load(args)
            check_recipe(cfg)  # an unknown recipe or override fails here (the layout needs a world size)
            print(dump_yaml(cfg), end="")
            return 0
        if args.command == "layout":
            cfg = _load(args, args.world_size)
            from megatron_rl.parallel.state import format_rank_map

            print(format_rank_map(cfg.parallel, args.world_size))
            return 0
        if args.command == "train":
            startup_gc.pause()  # until the run is built (launch.startup_gc)
            cfg = _load(args, _world_size_from_env())
            if cfg.trainer.job == "smoke":
                from megatron_rl.trainer.smoke import run

                startup_gc.resume()

                summary = run(cfg)
                print(
                    f"run dir: {summary['run_dir']}  lm_loss {summary['first_loss']:.3f} -> "
                    f"{summary['last_loss']:.3f} (chance {summary['chance_loss']:.3f})"
                )
                return summary.get("exit_code", 0)
            from megatron_rl.trainer import train

            summary = train(cfg)
            if summary.get("role") == "rollout":  # a rollout rank: the training ranks report the run
                return summary["exit_code"]
            if summary.get("error"):
                print(f"megatron-rl: error: {summary['error']}", file=sys.stderr)
            elif summary["steps"] and cfg.algorithm.supervised:
                _report_supervised(summary)
            elif summary["steps"] == 0:
                print(
                    f"run dir: {summary['run_dir']} already holds step {summary['last_step']} of "
                    f"trainer.max_steps={cfg.trainer.max_steps}: nothing to train (choose another "
                    "trainer.run_dir or a larger trainer.max_steps)"
                )
            else:
                print(
                    f"run dir: {summary['run_dir']}  reward (mean of first 5 steps of this run) "
                    f"{summary['first_reward']:.3f} -> (last 5) {summary['last_reward']:.3f}"
                )
                for name, ((first_step, first), (last_step, last)) in summary.get("val_accuracy", {}).items():
                    print(f"val/{name}/accuracy {first:.3f} (step {first_step}) -> {last:.3f} (step {last_step})")
            return summary["exit_code"]
        raise AssertionError(args.command)
    except ConfigError as err:
        print(f"megatron-rl: config error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        if args.command == "train":  # which rank, on which node, and why: the job log's one line
            from megatron_rl.launch.failure import describe_failure

            print(describe_failure(err, cfg and cfg.trainer.dist_timeout_s), file=sys.stderr, flush=True)
        raise


def entry() -> NoReturn:
    """The process entry (``megatron-rl``, ``python -m megatron_rl``). A ``train`` or ``eval``
    that returned ends its process at once, without the interpreter's teardown
    (launch.process_exit); one that raised, and every other command, exit as usual. Ctrl-C
    outside the training loop is one line and the shell's status for SIGINT, no traceback."""
    try:
        code = main()
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (which saves and stops instead)
        from megatron_rl.launch.signals import INTERRUPTED

        print("megatron-rl: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED)
    if sys.argv[1:2] in (["train"], ["eval"]):  # both hold a vLLM engine, whose teardown only costs time
        from megatron_rl.launch.process_exit import end_process

        end_process(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
