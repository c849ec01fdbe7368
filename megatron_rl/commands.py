"""Subcommands with their own parsers, and the ones other installed packages add.

The runtime's own (convert, ckpt, eval, plot, monitor, tool) are listed here; a package beside it (the
lab's benchmarks, megatron_rl_lab) declares more under the entry-point group
`megatron_rl.commands`, so the runtime runs them without importing that package by name.
An entry named `monitor.eval` is a subcommand of `monitor`.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "megatron_rl.commands"


@dataclass(frozen=True)
class Subcommand:
    """`module.<main>(argv) -> int` runs it; the module is imported only when it is used."""

    module: str
    help: str
    main: str = "main"
    """The function of `module` that runs it (one module may hold several subcommands)."""

    def run(self, argv: list[str]) -> int:
        return getattr(import_module(self.module), self.main)(argv)


RUNTIME = {
    "convert": Subcommand(
        "megatron_rl.bridge.cli",
        "HF <-> Megatron checkpoints: hf-to-megatron, megatron-to-hf; see `convert --help`",
    ),
    "ckpt": Subcommand("megatron_rl.checkpoint.cli", "inspect and verify checkpoints; see `ckpt --help`"),
    "eval": Subcommand(
        "megatron_rl.evaluation.cli",
        "evaluate a checkpoint or an HF model on the config's eval sets, as the trainer does; see `eval --help`",
    ),
    "plot": Subcommand(
        "megatron_rl.trainer.plot", "draw a run's reward/length/entropy curves and its val curves to RUN_DIR/curves.png"
    ),
    "monitor": Subcommand(
        "megatron_rl.monitor.cli",
        "faulty-machine detection (Minder): detect, train-denoiser, and the lab's eval, synth; see `monitor --help`",
    ),
    "tool": Subcommand(
        "megatron_rl.environments.tool_cli",
        "run a file as one sandboxed call of the episodes' Python tool: python FILE; see `tool python --help`",
    ),
}


def installed(scope: str = "") -> dict[str, Subcommand]:
    """Subcommands of `megatron-rl` (scope "") or of `megatron-rl <scope>`: the runtime's
    own first, then the entry points of installed packages, by name. An entry point that
    names a runtime command does not replace it."""
    found = dict(RUNTIME) if not scope else {}
    prefix = f"{scope}." if scope else ""
    for point in entry_points(group=ENTRY_POINT_GROUP):
        name = point.name[len(prefix) :] if point.name.startswith(prefix) else None
        if name and "." not in name and name not in found:
            found[name] = point.load()
    return found
