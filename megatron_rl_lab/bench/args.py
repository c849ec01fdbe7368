"""What every bench's command line shares: argument types, the world size, the exit codes,
the JSON file of its result.

Each bench module (:mod:`.plan` for mfu, :mod:`.weight_sync`, :mod:`.checkpoint`) exposes
``add_parser(sub)`` and ``run_args(args) -> exit code``; :mod:`.cli` registers them. Bad
arguments are reported in one line with exit code 2 before torch or any process group is
touched, so a wrong flag under torchrun fails in well under a second on every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable, Optional, TypeVar

BAD_ARGUMENTS = 2

Plan = TypeVar("Plan")


class BenchArgumentError(ValueError):
    """Arguments that cannot run; reported before torch or any process group is touched."""


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def positive_list(convert: Callable[[str], float], example: str) -> Callable[[str], list]:
    """An argparse type for comma-separated positive numbers, e.g. ``1,2,4``."""

    def parse(text: str) -> list:
        try:
            values = [convert(x) for x in text.split(",") if x]
        except ValueError:
            values = []
        if not values or min(values) <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated positive numbers, e.g. {example}")
        return values

    return parse


def bench_parser(sub, name: str, help: str, description: str, epilog: str = "") -> argparse.ArgumentParser:
    """A bench's subcommand: its one-line help, its description and its epilog of examples
    printed as written."""
    return sub.add_parser(
        name, help=help, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def model_option(name_or_path: str, flag: str = "--model"):
    """The ModelArch a ``--model`` value names (a preset or an HF directory), or the one-line
    BenchArgumentError that lists the presets."""
    from megatron_rl_lab.bench.presets import resolve_model

    try:
        return resolve_model(name_or_path)
    except ValueError as err:
        raise BenchArgumentError(f"{flag}: {err}") from None


def world_size() -> int:
    """The launch's world size from the launcher's environment (no process group needed)."""
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))


def save_json(result: dict, path: Optional[Path]) -> None:
    """Write a bench's result where --json said (parents created; nothing when None)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def run_checked(bench: str, make_plan: Callable[[], Plan], run: Callable[[Plan], object]) -> int:
    """Plan, then run: exit code 2 with one line on stderr if the plan cannot run, else 0."""
    try:
        plan = make_plan()
    except BenchArgumentError as err:
        print(f"megatron-rl bench {bench}: error: {err}", file=sys.stderr)
        return BAD_ARGUMENTS
    run(plan)
    return 0
