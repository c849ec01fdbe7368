"""Tool schemas and the Hermes parser: good calls, several per turn, and every kind of
malformed call as a ToolCallError with a message for the policy (never an exception)."""

import pytest

from megatron_rl.environments.tool_calls import (
    HermesParser,
    ToolCall,
    ToolCallError,
    ToolSpec,
    get_tool_parser,
)

PYTHON = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code and return what it prints",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string"}, "timeout": {"type": "integer"}},
            "required": ["code"],
        },
    },
}
TOOLS = {"python": ToolSpec.from_schema(PYTHON)}


def parse(text):
    return HermesParser().parse(text, TOOLS)


def test_spec_round_trips_the_openai_schema():
    spec = TOOLS["python"]
    assert (spec.name, spec.description) == ("python", "Run Python code and return what it prints")
    assert spec.schema() == PYTHON
    assert ToolSpec.from_schema(PYTHON["function"]) == spec
    with pytest.raises(ValueError, match="needs a name"):
        ToolSpec.from_schema({"function": {"description": "x"}})
    with pytest.raises(ValueError, match="must be an object schema"):
        ToolSpec("f", "", {"type": "string"})


def test_one_good_call_among_text():
    text = 'Let me compute. <tool_call>{"name": "python", "arguments": {"code": "print(1+1)"}}</tool_call>'
    assert parse(text) == [ToolCall("python", {"code": "print(1+1)"})]


def test_several_calls_in_order_with_newlines_and_string_arguments():
    text = (
        '<tool_call>\n{"name": "python", "arguments": {"code": "a"}}\n</tool_call> and '
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"b\\", \\"timeout\\": 3}"}</tool_call>'
    )
    assert parse(text) == [ToolCall("python", {"code": "a"}), ToolCall("python", {"code": "b", "timeout": 3})]


def test_no_call_is_an_answer():
    assert parse("Answer: 7") == []


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"name": "python", "arguments": {"code": "1"}', "not valid JSON"),
        ('["python"]', "must be a JSON object"),
        ('{"name": "shell", "arguments": {"cmd": "ls"}}', "unknown tool 'shell'; tools: python"),
        ('{"name": "python"}', "needs an 'arguments' JSON object"),
        ('{"name": "python", "arguments": {}}', "missing required argument(s) code"),
        ('{"name": "python", "arguments": {"code": 5}}', "argument 'code' must be string"),
        ('{"name": "python", "arguments": {"code": "x", "timeout": true}}', "argument 'timeout' must be integer"),
    ],
)
def test_malformed_calls_become_errors(body, message):
    text = f"<tool_call>{body}</tool_call>"
    (error,) = parse(text)
    assert isinstance(error, ToolCallError) and error.text == text
    assert message in error.message


def test_a_call_cut_off_by_the_end_of_the_turn_is_an_error_after_the_good_ones():
    text = '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call><tool_call>{"name": "py'
    good, cut = parse(text)
    assert good == ToolCall("python", {"code": "1"})
    assert isinstance(cut, ToolCallError) and "not closed" in cut.message


def test_unknown_parser_lists_the_known_ones():
    assert isinstance(get_tool_parser("hermes"), HermesParser)
    with pytest.raises(ValueError, match=r"allowed: \['hermes'\]"):
        get_tool_parser("mistral")
