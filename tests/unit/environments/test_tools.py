"""The tools registry: names a run lists, the schema the prompt shows, one runner for all."""

import pytest

from megatron_rl.environments.tool_calls import ToolCall, ToolResult
from megatron_rl.environments.tools import PYTHON, TOOLS, ToolsByName, check_tool_names


class Echo:
    def __init__(self, tag):
        self.tag = tag

    def run(self, calls):
        return [ToolResult(f"{self.tag}:{c.arguments['x']}") for c in calls]


def test_each_call_goes_to_its_tools_runner_and_results_keep_call_order():
    runner = ToolsByName({"a": Echo("A"), "b": Echo("B")})
    calls = [ToolCall("b", {"x": 1}), ToolCall("a", {"x": 2}), ToolCall("b", {"x": 3})]
    assert [r.observation for r in runner.run(calls)] == ["B:1", "A:2", "B:3"]
    assert runner.run([]) == []


def test_python_is_listed_with_a_code_argument_and_unknown_names_list_the_known():
    assert TOOLS["python"].spec is PYTHON and PYTHON.schema()["function"]["parameters"]["required"] == ["code"]
    check_tool_names(["python"])
    with pytest.raises(ValueError, match=r"tool 'shell' is not known; allowed: \['python'\]"):
        check_tool_names(["python", "shell"])
