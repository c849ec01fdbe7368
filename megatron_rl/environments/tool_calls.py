"""Tools the policy may call: their JSON schemas, the parsing of calls out of an assistant
turn, and the protocol of whatever runs them.

A tool is an OpenAI-style function schema (:class:`ToolSpec`); the chat template renders
the schemas into the prompt (``tokenizer.apply_chat_template(..., tools=...)``). A parser,
found by name in :data:`TOOL_PARSERS`, turns an assistant turn's text into calls. A call
the policy got wrong (bad JSON, an unknown tool, missing arguments) is a
:class:`ToolCallError`, never an exception: the policy is told what was wrong, as the
call's tool message, and the episode goes on. What runs the calls (the sandbox) is
injected as a :class:`ToolRunner`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, Union

_JSON_TYPES: dict[str, Union[type, tuple[type, ...]]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "array": list,
    "object": dict,
}
"""JSON-schema ``type`` -> the Python types ``json.loads`` gives for it."""


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """One tool: its name, what it does, and the JSON schema of its arguments object."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    """JSON schema of the arguments: ``{"type": "object", "properties": ..., "required": [...]}``."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a tool needs a non-empty name, got {self.name!r}")
        if self.parameters.get("type", "object") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be an object schema, got {self.parameters!r:.80}")

    @classmethod
    def from_schema(cls, schema: Mapping[str, Any]) -> ToolSpec:
        """From ``{"type": "function", "function": {"name", "description", "parameters"}}``
        (OpenAI's form) or the inner ``{"name", ...}`` alone."""
        function = schema.get("function", schema)
        if "name" not in function:
            raise ValueError(f"a tool schema needs a name: {dict(schema)!r:.120}")
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        return cls(function["name"], function.get("description", ""), parameters)

    def schema(self) -> dict:
        """OpenAI's form, what chat templates expect in ``tools``."""
        function = {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}
        return {"type": "function", "function": function}

    def argument_problem(self, arguments: Mapping[str, Any]) -> Optional[str]:
        """What is wrong with ``arguments`` (a missing required one, a wrong JSON type), or None."""
        properties = self.parameters.get("properties", {})
        missing = [name for name in self.parameters.get("required", ()) if name not in arguments]
        if missing:
            return f"tool {self.name!r} is missing required argument(s) {', '.join(missing)}"
        for name, value in arguments.items():
            expected = _JSON_TYPES.get(properties.get(name, {}).get("type"))
            if expected is None:
                continue
            # json gives True for true, and bool is an int to Python: only "boolean" takes it
            if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
                return f"tool {self.name!r}: argument {name!r} must be {properties[name]['type']}"
        return None


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A well-formed call of a known tool."""

    name: str
    arguments: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A call the policy wrote wrong; ``message`` is what it is told."""

    text: str
    """The call's text as written."""
    message: str


ParsedCall = Union[ToolCall, ToolCallError]


OK, ERROR, MEMORY, TIMEOUT, OUTPUT_LIMIT, KILLED, SANDBOX_ERROR = (
    "ok",
    "error",
    "memory",
    "timeout",
    "output_limit",
    "killed",
    "sandbox_error",
)
STATUSES = (OK, ERROR, MEMORY, TIMEOUT, OUTPUT_LIMIT, KILLED, SANDBOX_ERROR)
"""How a call ended (the Python tool's meanings are in environments.python_tool); an
episode counts ``timeout`` as a tool timeout and every status but ``ok`` as a tool error."""


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What running one call gave: what the policy reads next, and how it ended."""

    observation: str
    """What the model reads next."""
    status: str = OK
    """One of STATUSES."""
    seconds: float = 0.0
    """Wall-clock time of the call (a sandbox's included)."""


class ToolRunner(Protocol):
    """Runs well-formed calls (e.g. in a sandbox); one result per call, in order."""

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]: ...


class ToolParser(Protocol):
    """Finds the calls in an assistant turn's text, in the order written."""

    def parse(self, text: str, tools: Mapping[str, ToolSpec]) -> list[ParsedCall]: ...


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn
    (Hermes / Qwen). A ``<tool_call>`` never closed is an error too: the turn ended inside it."""

    _CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def parse(self, text: str, tools: Mapping[str, ToolSpec]) -> list[ParsedCall]:
        return [self._one(m.group(0), m.group(1), bool(m.group(2)), tools) for m in self._CALL.finditer(text)]

    @staticmethod
    def _one(written: str, body: str, closed: bool, tools: Mapping[str, ToolSpec]) -> ParsedCall:
        if not closed:
            return ToolCallError(written, "the tool call is not closed with </tool_call>")
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as exc:
            return ToolCallError(written, f"the tool call is not valid JSON ({exc.msg} at char {exc.pos})")
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return ToolCallError(written, 'a tool call must be a JSON object {"name": ..., "arguments": {...}}')
        name, arguments = payload["name"], payload.get("arguments")
        if name not in tools:
            return ToolCallError(written, f"unknown tool {name!r}; tools: {', '.join(sorted(tools))}")
        if isinstance(arguments, str):  # some models write the arguments object as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            return ToolCallError(written, f"tool {name!r} needs an 'arguments' JSON object")
        problem = tools[name].argument_problem(arguments)
        return ToolCallError(written, problem) if problem else ToolCall(name, arguments)


TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {"hermes": HermesParser}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool-call parser {name!r} is not known; allowed: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
