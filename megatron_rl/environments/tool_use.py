"""Tool use: each turn either calls tools, whose results come back as tool messages, or
answers, and the answer is scored by a reward function.

A turn with at least one call (well-formed or not) is answered with one ``tool`` message
per call, in the order written: the runner's output for a well-formed call, ``Error: ...``
for a malformed one (the policy learns from the message; nothing raises). A turn without
calls is the final answer. How many turns an episode may take is the driver's limit.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.environments.interface import EnvironmentSetup, EpisodeRecord, EpisodeStart, Step
from megatron_rl.environments.single_turn import AnswerScorer
from megatron_rl.environments.tool_calls import ERROR, OK, TIMEOUT, ToolCall, ToolCallError, ToolResult, get_tool_parser

ERROR_PREFIX = "Error: "
"""Opens the tool message of a malformed call."""


class ToolUse:
    """Tool calls run by the setup's runner; the final answer scored by its reward."""

    def __init__(self, setup: EnvironmentSetup):
        if not setup.tools or setup.tool_runner is None:
            raise ValueError("the tools environment needs tools and a tool_runner in its setup")
        self.tools = {tool.name: tool for tool in setup.tools}
        if len(self.tools) != len(setup.tools):
            raise ValueError(f"tool names repeat: {[tool.name for tool in setup.tools]}")
        self.specs = tuple(setup.tools)
        self.runner = setup.tool_runner
        self.parser = get_tool_parser(setup.tool_parser)
        self.scorer = AnswerScorer(setup.reward, dict(setup.reward_options))

    def reset(self, record: EpisodeRecord) -> EpisodeStart:
        return EpisodeStart(record.messages, self.specs, state=record.answer)

    def step(self, state: Any, assistant_text: str) -> Step:
        parsed = self.parser.parse(assistant_text, self.tools)
        if not parsed:
            return Step.finish(self.scorer.score(assistant_text, state))
        calls = [p for p in parsed if isinstance(p, ToolCall)]
        ran = list(self.runner.run(calls)) if calls else []
        if len(ran) != len(calls):
            raise RuntimeError(f"the tool runner returned {len(ran)} results for {len(calls)} calls")
        results = iter(ran)  # in call order: the i-th well-formed call's result is the i-th
        answers = [next(results) if isinstance(p, ToolCall) else _error(p) for p in parsed]
        return Step(
            done=False,
            observation=tuple({"role": "tool", "content": a.observation} for a in answers),
            tool_calls=len(parsed),
            tool_errors=sum(a.status not in (OK, TIMEOUT) for a in answers),
            tool_timeouts=sum(a.status == TIMEOUT for a in answers),
        )

    def close(self) -> None:
        self.scorer.close()


def _error(call: ToolCallError) -> ToolResult:
    return ToolResult(ERROR_PREFIX + call.message, ERROR)
