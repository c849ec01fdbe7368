"""Tools by name, as a run's ``environment.tools`` lists them: the schema the prompt shows
and how the run builds what executes a call.

Every entry is built from the same two things (the sandbox limits and the isolation this
machine has), so a run builds its tools without branching on their names; one runner then
sends each call to its tool's own runner (:class:`ToolsByName`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from megatron_rl.environments.isolation import IsolationReport
from megatron_rl.environments.sandbox import SandboxConfig
from megatron_rl.environments.tool_calls import ToolCall, ToolResult, ToolRunner, ToolSpec

PYTHON = ToolSpec(
    "python",
    "Run Python code in a sandbox; returns what it prints.",
    {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
)


def _python_runner(config: SandboxConfig, report: IsolationReport) -> ToolRunner:
    from megatron_rl.environments.python_tool import PythonTool, PythonToolRunner

    return PythonToolRunner(PythonTool(config, report))


@dataclasses.dataclass(frozen=True)
class ToolEntry:
    spec: ToolSpec
    runner: Callable[[SandboxConfig, IsolationReport], ToolRunner]
    """Builds the tool's runner; raises isolation.IsolationError (one line) where the
    sandbox lacks an isolation the config does not let it do without."""


TOOLS: dict[str, ToolEntry] = {"python": ToolEntry(PYTHON, _python_runner)}


def check_tool_names(names: Sequence[str]) -> None:
    unknown = [name for name in names if name not in TOOLS]
    if unknown:
        raise ValueError(f"tool {unknown[0]!r} is not known; allowed: {sorted(TOOLS)}")


class ToolsByName:
    """One runner for several tools: each call goes to its tool's runner, results in call order."""

    def __init__(self, runners: dict[str, ToolRunner]):
        self.runners = runners

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        results: list = [None] * len(calls)
        for name, runner in self.runners.items():
            mine = [i for i, call in enumerate(calls) if call.name == name]
            for i, result in zip(mine, runner.run([calls[i] for i in mine]) if mine else []):
                results[i] = result
        return results


def build_tools(
    names: Sequence[str], config: SandboxConfig, report: IsolationReport
) -> tuple[tuple[ToolSpec, ...], ToolRunner]:
    """The specs the prompt lists and one runner for all of ``names``."""
    check_tool_names(names)
    runners = {name: TOOLS[name].runner(config, report) for name in names}
    return tuple(TOOLS[name].spec for name in names), ToolsByName(runners)
