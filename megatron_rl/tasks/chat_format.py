"""The chat format of the tiny base model: special tokens and the Jinja chat template.

One template serves vLLM, transformers and the trainer (all read it from the saved
tokenizer directory). A turn is ``<|role|>content<|end|>``; ``<|end|>`` is the EOS token,
so generation stops where an assistant turn ends.
"""

from __future__ import annotations

from typing import Sequence

from megatron_rl.tasks.digits import TaskExample

END = "<|end|>"
PAD = "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, END) + ROLE_TOKENS

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def render_chat(messages: Sequence[dict], add_generation_prompt: bool) -> str:
    """The template's output in plain Python (used to train the tokenizer on exact text)."""
    text = "".join(f"<|{m['role']}|>{m['content']}{END}" for m in messages)
    return text + ("<|assistant|>" if add_generation_prompt else "")


def prompt_messages(example: TaskExample) -> list[dict]:
    return [{"role": "user", "content": example.prompt}]


def training_text(example: TaskExample, solution: str | None = None) -> tuple[str, str]:
    """``(prompt text, completion text)`` of one warm-up example, completion ending in EOS."""
    prompt = render_chat(prompt_messages(example), add_generation_prompt=True)
    return prompt, (example.solution if solution is None else solution) + END
