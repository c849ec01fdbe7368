"""The chat format of the tiny base model: special tokens and the Jinja chat template.

One template serves vLLM, transformers and the trainer (all read it from the saved
tokenizer directory). A turn is ``<|role|>content<|end|>``; ``<|end|>`` is the EOS token,
so generation stops where an assistant turn ends.

Tools follow Qwen's Hermes format without new special tokens (a new token would change
every id of the trained tokenizer): with ``tools`` the template opens with a system turn
listing their JSON schemas in ``<tools>`` (the first system message's text before it), an
assistant's ``tool_calls`` are written as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``,
and consecutive ``tool`` messages become one user turn of ``<tool_response>`` blocks.
Without tools, tool calls or tool messages the output is what it always was.
"""

from __future__ import annotations

import json
from typing import Optional, Sequence

from megatron_rl.tasks.digits import TaskExample

END = "<|end|>"
PAD = "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, END) + ROLE_TOKENS
TOOLS_HEADER = "# Tools\n<tools>"
TOOLS_FOOTER = '\n</tools>\nCall a tool as <tool_call>{"name": <name>, "arguments": <arguments object>}</tool_call>'
"""The tools block of the system turn: header, one JSON schema per line, footer."""

CHAT_TEMPLATE = (
    "{% if tools %}<|system|>"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '" + TOOLS_HEADER.replace("\n", "\\n") + "' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '" + TOOLS_FOOTER.replace("\n", "\\n") + "' }}<|end|>{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|user|>{% else %}{{ '\\n' }}{% endif %}"
    "<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|end|>{% endif %}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "<|assistant|>{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] %}{% set f = call['function'] if call['function'] is defined else call %}"
    '<tool_call>{"name": {{ f[\'name\'] | tojson }}, "arguments": '
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}"
    "}</tool_call>{% endfor %}<|end|>"
    "{% else %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def render_chat(messages: Sequence[dict], add_generation_prompt: bool, tools: Optional[Sequence[dict]] = None) -> str:
    """The template's output in plain Python (used to train the tokenizer on exact text)."""
    text = ""
    if tools:
        system = f"{messages[0]['content']}\n\n" if messages and messages[0]["role"] == "system" else ""
        schemas = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        text = f"<|system|>{system}{TOOLS_HEADER}{schemas}{TOOLS_FOOTER}{END}"
        messages = messages[1:] if system else messages
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            first = i == 0 or messages[i - 1]["role"] != "tool"
            last = i == len(messages) - 1 or messages[i + 1]["role"] != "tool"
            text += ("<|user|>" if first else "\n") + f"<tool_response>\n{m['content']}\n</tool_response>"
            text += END if last else ""
        elif m["role"] == "assistant" and m.get("tool_calls"):
            text += f"<|assistant|>{m['content'] or ''}" + "".join(map(_tool_call_text, m["tool_calls"])) + END
        else:
            text += f"<|{m['role']}|>{m['content']}{END}"
    return text + ("<|assistant|>" if add_generation_prompt else "")


def _tool_call_text(call: dict) -> str:
    f = call.get("function", call)
    arguments = f["arguments"] if isinstance(f["arguments"], str) else json.dumps(f["arguments"], ensure_ascii=False)
    return f'<tool_call>{{"name": {json.dumps(f["name"], ensure_ascii=False)}, "arguments": {arguments}}}</tool_call>'


def prompt_messages(example: TaskExample) -> list[dict]:
    return [{"role": "user", "content": example.prompt}]


def training_text(example: TaskExample, solution: str | None = None) -> tuple[str, str]:
    """``(prompt text, completion text)`` of one warm-up example, completion ending in EOS."""
    prompt = render_chat(prompt_messages(example), add_generation_prompt=True)
    return prompt, (example.solution if solution is None else solution) + END
