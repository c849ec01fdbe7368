"""A task the tiny model cannot do without its tool: the product of two 3-digit numbers.

Prompt ``What is 347 * 812?``, answer ``281764``, scored by the digit task's verifier (the
response must end in ``Answer: 281764``). A 2-layer model cannot multiply: answering
directly is right about never (chance 0). Calling the ``python`` tool with the product
(``<tool_call>{"name": "python", "arguments": {"code": "print(347 * 812)"}}</tool_call>``) and
copying its output into the answer is the way to be right.

What the warm-up teaches, exactly:

- the call format and the answer format after an observation: on a share
  ``call_fraction`` of the warm-up prompts the first turn is the right call (the prompt's
  two numbers copied into ``print(a * b)``), and after every call's observation the turn is
  ``Answer: <the observation's number>``;
- not *when* to call: on the other prompts the first turn is a direct, wrong answer (the
  first factor repeated: ``Answer: 347``), so the base calls the tool on about
  ``call_fraction`` of its samples and answers wrong otherwise. (A fixed wrong answer, not
  a random number: the warm-up's steps go to copying digits, not to fitting noise.)

RL has to move the first turn from guessing to calling. The base's report gives its call
rate, its right-call rate (sampled first turns) and how often it copies an observation
right (greedy), so what RL adds is measured against them.

The base is built like the digit task's (``base_model``): a byte-level BPE tokenizer on
the task's text (digits one token each), a random tiny model of the preset's architecture,
the supervised warm-up (loss on the assistant turns only: a two-turn example is two
prompt/completion pairs, the second's prompt holding the call and its observation).
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path
from typing import Any, Sequence

from megatron_rl.environments.tools import PYTHON
from megatron_rl.parallel.config import ModelShape
from megatron_rl.rewards.digit_answer import final_answer
from megatron_rl.tasks.base_model import HELD_OUT_FILE, BaseModelSettings, settings_hash
from megatron_rl.tasks.chat_format import END, render_chat

BUILD_VERSION = 2
"""Bump when the generated artefacts change for the same settings (invalidates caches)."""
TOOL_TASKS = ("tool_products",)
"""task:<name> data of this module (the digit tasks are tasks.digits.TASKS)."""
TOOLS = [PYTHON.schema()]


@dataclasses.dataclass(frozen=True)
class Product:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"What is {self.a} * {self.b}?"

    @property
    def answer(self) -> str:
        return str(self.a * self.b)

    def call_turn(self) -> str:
        code = json.dumps({"code": f"print({self.a} * {self.b})"})
        return f'<tool_call>{{"name": "python", "arguments": {code}}}</tool_call>'

    def messages(self, *, called: bool) -> list[dict]:
        """The conversation up to the answer turn: the question, and with ``called`` the call
        and the tool's output (what the sandbox prints: the product and a newline)."""
        user = [{"role": "user", "content": self.prompt}]
        if not called:
            return user
        call = {"name": "python", "arguments": {"code": f"print({self.a} * {self.b})"}}
        return user + [
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
            {"role": "tool", "content": self.answer + "\n"},
        ]


def products(n: int, seed: int, low: int = 100, high: int = 999) -> list[Product]:
    rng = random.Random(f"tool-products-{seed}")
    return [Product(rng.randint(low, high), rng.randint(low, high)) for _ in range(n)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolBaseSettings:
    """Everything that determines the tool task's base; its hash names the cache entry."""

    model: BaseModelSettings
    """Architecture, seed, prompt counts and warm-up hyperparameters (its ``task`` and
    ``warmup_correct_fraction`` are not used)."""
    call_fraction: float = 0.3
    """Share of warm-up prompts whose first turn calls the tool (the rest guess directly)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.call_fraction <= 1.0:
            raise ValueError(f"call_fraction={self.call_fraction} is not in [0, 1]")

    def model_shape(self) -> ModelShape:
        return self.model.model_shape()

    def content_hash(self) -> str:
        return settings_hash(self, "tool_build", BUILD_VERSION)

    def build(self, out: Path) -> dict[str, Any]:
        return _build(self, out)


def warmup_pairs(items: Sequence[Product], call_fraction: float, seed: int) -> list[tuple[str, str]]:
    """(prompt text, completion text) pairs of the warm-up (module docstring)."""
    rng = random.Random(f"tool-warmup-{seed}")
    pairs = []
    for item in items:
        prompt = render_chat(item.messages(called=False), add_generation_prompt=True, tools=TOOLS)
        if rng.random() < call_fraction:
            pairs.append((prompt, item.call_turn() + END))
        else:
            pairs.append((prompt, f"Answer: {item.a}{END}"))
        after = render_chat(item.messages(called=True), add_generation_prompt=True, tools=TOOLS)
        pairs.append((after, f"Answer: {item.answer}{END}"))
    return pairs


def _generate(model, tokenizer, prompts: list[str], max_new_tokens: int, sample: bool, seed: int) -> list[str]:
    import torch

    torch.manual_seed(seed)
    out = []
    for start in range(0, len(prompts), 64):
        batch = tokenizer(prompts[start : start + 64], add_special_tokens=False, padding=True, return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(
                **batch,
                do_sample=sample,
                max_new_tokens=max_new_tokens,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                **({"temperature": 1.0, "top_p": 1.0} if sample else {}),
            )
        out += tokenizer.batch_decode(ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return out


def measure(model, tokenizer, held_out: Sequence[Product], max_new_tokens: int, seed: int) -> dict:
    """The base's first turns (sampled at T=1: what RL starts from) and its answers after a
    true observation (greedy)."""
    first = [render_chat(p.messages(called=False), add_generation_prompt=True, tools=TOOLS) for p in held_out]
    turns = _generate(model, tokenizer, first, max_new_tokens, sample=True, seed=seed)
    after = [render_chat(p.messages(called=True), add_generation_prompt=True, tools=TOOLS) for p in held_out]
    answers = _generate(model, tokenizer, after, max_new_tokens, sample=False, seed=seed)
    n = len(held_out)
    return {
        "sampled_call_rate": sum("<tool_call>" in t for t in turns) / n,
        "sampled_right_call_rate": sum(t.strip() == p.call_turn() for t, p in zip(turns, held_out)) / n,
        "sampled_direct_accuracy": sum(final_answer(t) == p.answer for t, p in zip(turns, held_out)) / n,
        "copy_accuracy_after_observation": sum(final_answer(a) == p.answer for a, p in zip(answers, held_out)) / n,
        "sampled_first_turns": turns[:4],
    }


def _build(settings: ToolBaseSettings, out: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_rl.tasks.base_model import hf_config, save_base, warm_up
    from megatron_rl.tasks.tokenizer import train_tokenizer

    started, cpu_started = time.perf_counter(), time.process_time()
    base = settings.model
    train = products(base.num_train_prompts, base.seed)
    seen = {(p.a, p.b) for p in train}
    held_out = [p for p in products(base.num_eval_prompts * 2, base.seed + 1) if (p.a, p.b) not in seen]
    held_out = held_out[: base.num_eval_prompts]
    pairs = warmup_pairs(train, settings.call_fraction, base.seed)
    tokenizer = train_tokenizer([p + c for p, c in pairs], base.tokenizer_vocab_size, individual_digits=True)
    vocab = -(-len(tokenizer) // base.vocab_multiple) * base.vocab_multiple
    encoded = [
        (tokenizer(p, add_special_tokens=False).input_ids, tokenizer(c, add_special_tokens=False).input_ids)
        for p, c in pairs
    ]
    max_new_tokens = max(len(c) for _, c in encoded) + 2

    torch.manual_seed(base.seed)
    model = AutoModelForCausalLM.from_config(
        hf_config(base, vocab, tokenizer.eos_token_id, tokenizer.pad_token_id), dtype=torch.float32
    )
    losses = warm_up(model, encoded, base, tokenizer.pad_token_id)
    warmup_seconds = time.perf_counter() - started
    measured = measure(model, tokenizer, held_out, max_new_tokens, base.seed)

    save_base(model, tokenizer, out)
    for name, items in (("train.jsonl", train), (HELD_OUT_FILE, held_out)):
        (out / name).write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in items))
    return {
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": vocab,
        "tokenizer_size": len(tokenizer),
        "max_prompt_tokens": max(len(p) for p, _ in encoded),
        "max_new_tokens": max_new_tokens,
        "chance_accuracy": 0.0,
        "majority_answer_accuracy": 1 / len(held_out),
        "accuracy_after_warmup": measured["sampled_right_call_rate"] * measured["copy_accuracy_after_observation"],
        "format_rate_after_warmup": 1.0,
        "sampled_accuracy_after_warmup": measured["sampled_direct_accuracy"],
        "sampled_format_rate_after_warmup": 1.0,
        **measured,
        "warmup_first_loss": losses[0],
        "warmup_final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "warmup_seconds": warmup_seconds,
        "seconds": time.perf_counter() - started,
        "cpu_seconds": time.process_time() - cpu_started,
        "torch_threads": torch.get_num_threads(),
    }
