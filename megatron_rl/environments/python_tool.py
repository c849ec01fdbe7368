"""The Python tool of a tool-using episode: code in, the observation the model reads out.

Every call runs in a fresh sandbox (sandbox.py) and returns a :class:`ToolResult`; it never
raises and never waits past the call's limits, whatever the code does, so an episode's
loop needs no error handling of its own. The status is one of tool_calls.STATUSES, for counting:

- ``ok``: the code exited 0; the observation is its stdout, then its stderr;
- ``error``: it exited otherwise; stdout, then ``error: <the traceback's last line>``;
- ``memory``: it raised MemoryError at the memory limit;
- ``timeout``: the wall clock or the CPU limit ended it (``error: timed out after 5.0 s``);
- ``output_limit``: it wrote more than max_output_bytes; what fit, then ``error: output cut at N bytes``;
- ``killed``: a signal ended it (``error: killed by signal SIGSEGV``);
- ``sandbox_error``: the sandbox itself could not run it; the observation says why.

Calls from many threads at once are safe (:meth:`PythonTool.run_many`, :meth:`PythonTool.acall`).
"""

from __future__ import annotations

import asyncio
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

from megatron_rl.environments.isolation import IsolationReport, probe_isolation, require_isolation
from megatron_rl.environments.sandbox import Outcome, Sandbox, SandboxConfig
from megatron_rl.environments.tool_calls import (
    ERROR,
    KILLED,
    MEMORY,
    OK,
    OUTPUT_LIMIT,
    SANDBOX_ERROR,
    TIMEOUT,
    ToolCall,
    ToolResult,
)

ERROR_LINE_CHARS = 500
"""The error line is cut here: a traceback's last line may repeat a huge value."""
CPU_LIMIT_SHARE = 0.9
"""A process killed with at least this share of cpu_s used was killed by the CPU limit
(the kernel's accounting and wait4's differ by a tick or so)."""


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _then(output: str, line: str) -> str:
    """`output`, then `line` on a line of its own."""
    line = line[:ERROR_LINE_CHARS]
    return f"{output}\n{line}" if output and not output.endswith("\n") else output + line


def _last_line(data: bytes) -> str:
    lines = [line for line in _text(data).splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def observe(outcome: Outcome, config: SandboxConfig) -> ToolResult:
    """The observation and status of one sandbox outcome (see the module docstring)."""
    both, stdout = _text(outcome.stdout + outcome.stderr), _text(outcome.stdout)
    kind = outcome.verdict
    if kind == "setup":
        return ToolResult(f"error: the sandbox could not start: {outcome.detail}", SANDBOX_ERROR, outcome.seconds)
    if kind == "lost":
        return ToolResult(f"error: the sandbox failed: {outcome.detail}", SANDBOX_ERROR, outcome.seconds)
    if kind == "timeout":
        return ToolResult(_then(both, f"error: timed out after {config.timeout_s} s"), TIMEOUT, outcome.seconds)
    if outcome.output_cut:
        line = f"error: output cut at {config.max_output_bytes} bytes"
        return ToolResult(_then(both, line), OUTPUT_LIMIT, outcome.seconds)
    if kind == "signal":
        if outcome.signal in (signal.SIGKILL, signal.SIGXCPU) and outcome.cpu_s >= CPU_LIMIT_SHARE * config.cpu_s:
            line = f"error: CPU time limit of {config.cpu_s} s reached"
            return ToolResult(_then(stdout, line), TIMEOUT, outcome.seconds)
        line = f"error: killed by {_signal_name(outcome.signal)}"
        return ToolResult(_then(stdout, line), KILLED, outcome.seconds)
    if kind == "exit" and outcome.exit_code == 0:
        return ToolResult(both, OK, outcome.seconds)
    last = _last_line(outcome.stderr_tail)
    if last.startswith("MemoryError"):
        line = f"error: MemoryError (the limit is {config.memory_mb} MiB per process)"
        return ToolResult(_then(stdout, line), MEMORY, outcome.seconds)
    line = f"error: {last}" if last else f"error: exit status {outcome.exit_code}"
    return ToolResult(_then(stdout, line), ERROR, outcome.seconds)


class PythonTool:
    """Runs model-written Python, one sandbox per call.

    Built once per run: it probes the isolation (unless given a report), refuses a missing
    one unless the config opts out (isolation.IsolationError, one line) and plans the
    sandbox's root. Immutable afterwards, so one instance serves every episode's thread."""

    def __init__(self, config: Optional[SandboxConfig] = None, report: Optional[IsolationReport] = None):
        self.config = SandboxConfig() if config is None else config
        self.report = probe_isolation() if report is None else report
        require_isolation(self.config, self.report)
        self.sandbox = Sandbox(self.config, self.report)

    def __call__(self, code: str) -> ToolResult:
        start = time.monotonic()
        try:
            return observe(self.sandbox.run(code), self.config)
        except Exception as err:  # a broken machine (no fds, no fork) must not end the episode's loop
            line = f"error: the sandbox could not start: {type(err).__name__}: {err}"
            return ToolResult(line, SANDBOX_ERROR, time.monotonic() - start)

    async def acall(self, code: str) -> ToolResult:
        """The call for an asyncio episode loop: runs in a worker thread, never blocks the loop."""
        return await asyncio.to_thread(self, code)

    def run_many(self, codes: Sequence[str], max_workers: int = 8) -> list[ToolResult]:
        """Run `codes` concurrently, at most `max_workers` sandboxes at once; results in order."""
        if not codes:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(codes)))) as pool:
            return list(pool.map(self, codes))


class PythonToolRunner:
    """The episodes' `ToolRunner` for the ``python`` tool: each call's ``code`` argument in a
    sandbox of its own, all of a turn's calls at once."""

    def __init__(self, tool: PythonTool, max_workers: int = 8):
        self.tool, self.max_workers = tool, max_workers

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        return self.tool.run_many([str(call.arguments.get("code", "")) for call in calls], self.max_workers)


def run_many(
    codes: Sequence[str],
    config: Optional[SandboxConfig] = None,
    max_workers: int = 8,
    report: Optional[IsolationReport] = None,
) -> list[ToolResult]:
    """One PythonTool for `codes` (see PythonTool.run_many); raises IsolationError as it does."""
    return PythonTool(config, report).run_many(codes, max_workers)
