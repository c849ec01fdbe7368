"""The tiny chat template with tools (Hermes-like, no new special tokens) renders exactly the
documented text, agrees with render_chat, and leaves every tool-free conversation as it was."""

import pytest

from megatron_rl.tasks.chat_format import render_chat

TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "max of 3 7"},
    {"role": "assistant", "content": '<tool_call>{"name": "python", "arguments": {"code": "max(3, 7)"}}</tool_call>'},
    {"role": "tool", "content": "7"},
    {"role": "tool", "content": "oops"},
    {"role": "assistant", "content": "Answer: 7"},
]
SCHEMA_LINE = (
    '{"type": "function", "function": {"name": "python", "description": "Run Python", "parameters": '
    '{"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}'
)
EXPECTED = (
    "<|system|>Be brief.\n\n# Tools\n<tools>\n" + SCHEMA_LINE + "\n</tools>\n"
    'Call a tool as <tool_call>{"name": <name>, "arguments": <arguments object>}</tool_call><|end|>'
    "<|user|>max of 3 7<|end|>"
    '<|assistant|><tool_call>{"name": "python", "arguments": {"code": "max(3, 7)"}}</tool_call><|end|>'
    "<|user|><tool_response>\n7\n</tool_response>\n<tool_response>\noops\n</tool_response><|end|>"
    "<|assistant|>Answer: 7<|end|><|assistant|>"
)


def test_tools_render_in_a_system_turn_and_tool_messages_in_a_user_turn(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATION, tools=[TOOL], tokenize=False, add_generation_prompt=True)
    assert text == EXPECTED == render_chat(CONVERSATION, True, tools=[TOOL])


def test_tools_without_a_system_message_open_their_own_system_turn(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tools=[TOOL], tokenize=False)
    assert text.startswith("<|system|># Tools\n<tools>\n" + SCHEMA_LINE) and text.endswith("<|end|><|user|>hi<|end|>")
    assert text == render_chat(messages, False, tools=[TOOL])


def test_assistant_tool_calls_are_written_in_the_format_the_parser_reads(tokenizer):
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "python", "arguments": {"code": "1"}}},
                {"type": "function", "function": {"name": "python", "arguments": '{"code": "2"}'}},
            ],
        },
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|user|>q<|end|><|assistant|>"
        '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>'
        '<tool_call>{"name": "python", "arguments": {"code": "2"}}</tool_call><|end|>'
    )
    assert text == render_chat(messages, False)


@pytest.mark.parametrize("generation_prompt", [False, True])
def test_tool_free_conversations_render_as_before(tokenizer, generation_prompt):
    """The template before tools: ``<|role|>content<|end|>`` per message, byte for byte."""
    messages = [m for m in CONVERSATION if m["role"] != "tool"]
    before = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
    before += "<|assistant|>" if generation_prompt else ""
    for tools in (None, []):
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert text == before == render_chat(messages, generation_prompt)
