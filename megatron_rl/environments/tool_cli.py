"""`megatron-rl tool python FILE`: one call of the episodes' Python tool, as the model sees it.

    megatron-rl tool python FILE [--timeout S] [--allow-weaker-isolation]

Runs FILE's code as one tool call, in the sandbox and under the limits an episode uses
(SandboxConfig's defaults; --timeout replaces the wall-clock limit), and prints the
observation the model would read on stdout; the sandbox's isolation line and the call's
status go to stderr. The exit status is 0 whatever the code does: a crash, a hang or a
flood is an observation, not a failure of the command. A bad path or option value, or a
missing isolation without --allow-weaker-isolation, is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Optional, Sequence

from megatron_rl.launch.one_line_cli import OneLineParser

BAD_INPUT = 2


class ToolInputError(ValueError):
    """A path or option the command cannot use; the message says what is allowed."""


def build_parser() -> argparse.ArgumentParser:
    from megatron_rl.environments.sandbox import SandboxConfig

    parser = OneLineParser(
        prog="megatron-rl tool", description="Run one call of an episode's tool and print what the model sees."
    )
    tools = parser.add_subparsers(dest="tool", metavar="TOOL", required=True)
    python = tools.add_parser(
        "python",
        help="run a Python file as one sandboxed tool call",
        description="Run FILE as one call of the Python tool (sandboxed, with the episode's limits) and print "
        "the observation the model would read. Exit 0 whatever the code does.",
        epilog="example: megatron-rl tool python solve.py --timeout 2",
    )
    python.add_argument("file", type=Path, metavar="FILE", help="the Python source to run (UTF-8)")
    python.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help=f"wall-clock limit of the call in seconds, 0 < S <= 600 (default {SandboxConfig.timeout_s})",
    )
    python.add_argument(
        "--allow-weaker-isolation",
        action="store_true",
        help="run even where this machine lacks an isolation (the first stderr line names what is missing)",
    )
    return parser


def read_source(path: Path) -> str:
    """FILE's text, or ToolInputError saying why it cannot be the tool's code."""
    if not path.exists():
        raise ToolInputError(f"FILE {path} does not exist (give a Python source file)")
    if not path.is_file():
        raise ToolInputError(f"FILE {path} is not a file (give a Python source file)")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ToolInputError(f"FILE {path} is not UTF-8 text (give a Python source file)") from None
    except OSError as err:
        raise ToolInputError(f"FILE {path} cannot be read: {err.strerror}") from None


def make_config(args: argparse.Namespace):
    from megatron_rl.environments.sandbox import SandboxConfig

    config = SandboxConfig(allow_weaker_isolation=args.allow_weaker_isolation)
    if args.timeout is None:
        return config
    try:
        return dataclasses.replace(config, timeout_s=args.timeout)
    except ValueError:
        raise ToolInputError(f"--timeout {args.timeout:g}: give seconds, 0 < S <= 600") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_rl.environments.isolation import IsolationError, probe_isolation
    from megatron_rl.environments.python_tool import PythonTool

    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        config = make_config(args)
        code = read_source(args.file)
        report = probe_isolation()
        tool = PythonTool(config, report)
    except (ToolInputError, IsolationError, ValueError) as err:
        print(f"megatron-rl tool: error: {err}", file=sys.stderr)
        return BAD_INPUT
    print(report.line(), file=sys.stderr, flush=True)
    result = tool(code)
    end = "" if result.observation.endswith("\n") or not result.observation else "\n"
    sys.stdout.write(result.observation + end)
    sys.stdout.flush()
    print(f"status: {result.status} ({result.seconds:.2f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
