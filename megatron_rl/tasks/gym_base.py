"""The tiny supervised base for a reasoning-gym dataset, built like the digit task's base.

Same recipe as ``base_model`` (read its docstring for why): a byte-level BPE tokenizer
trained on the dataset's own prompt and answer text, a random tiny model of the preset's
architecture, and a short supervised warm-up on the answer format. The warm-up completion
is ``<answer>A</answer>``, where A is the entry's true answer for a share
``warmup_correct_fraction`` of the examples and otherwise the answer of another training
entry drawn at random: the base learns the format and the answers' distribution, not the
task, so it starts near :func:`chance_accuracy` and RL has to lift it.

The directory holds what ``base_model`` writes for a digit task: the HF model, the
tokenizer with the chat template, ``train.jsonl``/``eval.jsonl`` (fields ``prompt``, the
user message, and ``answer``, the entry's answer) and ``tiny_base.json``.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from megatron_rl.data.reasoning_gym import GymSpec, build_dataset, held_out_indices, reference, user_message
from megatron_rl.parallel.config import ModelShape
from megatron_rl.tasks.base_model import BaseModelSettings, settings_hash
from megatron_rl.tasks.chat_format import END, render_chat

BUILD_VERSION = 2
"""Bump when the generated artefacts change for the same settings (invalidates caches)."""
WARMUP_CORRECT_FRACTION = 0.25
"""Share of warm-up examples with the true answer. On count_bits (1..31) the base stays at
chance with it (sampled accuracy 0.250, chance 0.262), and DAPO lifts the reward to 0.46 in
40 steps; with none, DAPO collapsed onto the most frequent answer and then onto a malformed
answer (docs/benchmarks.md)."""


def completion(answer: str) -> str:
    """The warm-up target: the answer in reasoning-gym's tags, then the end of the turn."""
    return f"<answer>{answer}</answer>{END}"


@dataclasses.dataclass(frozen=True)
class GymExample:
    """One entry as the warm-up and the report use it (``prompt`` is the user message)."""

    prompt: str
    answer: str
    ref: str


def examples(spec: GymSpec, indices: Sequence[int]) -> list[GymExample]:
    dataset = build_dataset(spec)
    found = []
    for i in indices:
        entry = dataset[i]
        answer = str(entry["answer"])
        found.append(GymExample(user_message(entry["question"]), answer, reference(spec, i, answer)))
    return found


def chance_accuracy(train: Sequence[GymExample], held_out: Sequence[GymExample]) -> float:
    """Exact-match accuracy on ``held_out`` of a policy that ignores the question and draws an
    answer from the training set's answers (what a format-only warm-up learns)."""
    counts = Counter(e.answer for e in train)
    return sum(counts[e.answer] for e in held_out) / (len(train) * len(held_out))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GymBaseSettings:
    """Everything that determines a reasoning-gym base; its hash names the cache entry."""

    model: BaseModelSettings
    """Architecture, seed and warm-up hyperparameters (its ``task`` and
    ``num_train_prompts`` are not used: the spec gives the prompts)."""
    spec: GymSpec
    """The training set: warm-up examples, tokenizer corpus and RL prompts alike."""

    def model_shape(self) -> ModelShape:
        return self.model.model_shape()

    def content_hash(self) -> str:
        return settings_hash(self, "gym_build", BUILD_VERSION)

    def build(self, out: Path) -> dict[str, Any]:
        return _build(self, out)


def _held_out(settings: GymBaseSettings) -> tuple[str, list[GymExample]]:
    """Held-out entries for the report, or the training entries when the dataset has too few
    distinct questions (the report says which)."""
    spec = settings.spec
    try:
        # spec.seed + spec.size: the first generator seed the training set does not use.
        eval_spec, indices = held_out_indices(spec, spec.seed + spec.size, settings.model.num_eval_prompts)
    except ValueError:
        return "train", examples(spec, range(min(spec.size, settings.model.num_eval_prompts)))
    return "held_out", examples(eval_spec, indices)


def _accuracy(model, tokenizer, items: Sequence[GymExample], max_new_tokens: int, **sampling) -> dict:
    from megatron_rl.rewards.reasoning_gym import NO_ANSWER, score_response
    from megatron_rl.tasks.warmup import generate_responses

    responses = generate_responses(model, tokenizer, items, max_new_tokens, **sampling)
    scored = [score_response(r, e.ref) for r, e in zip(responses, items)]
    return {
        "accuracy": sum(s for s, _ in scored) / len(scored),
        "format_rate": 1.0 - sum(kind == NO_ANSWER for _, kind in scored) / len(scored),
        "responses": responses,
    }


def _build(settings: GymBaseSettings, out: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_rl.tasks.base_model import hf_config, save_base, warm_up
    from megatron_rl.tasks.tokenizer import train_tokenizer

    started, cpu_started = time.perf_counter(), time.process_time()
    base = settings.model
    train = examples(settings.spec, range(settings.spec.size))
    eval_set, held_out = _held_out(settings)
    prompts = [render_chat([{"role": "user", "content": e.prompt}], add_generation_prompt=True) for e in train]
    tokenizer = train_tokenizer([p + completion(e.answer) for p, e in zip(prompts, train)], base.tokenizer_vocab_size)
    vocab = -(-len(tokenizer) // base.vocab_multiple) * base.vocab_multiple

    rng = random.Random(f"gym-warmup-labels-{base.seed}")
    answers = [e.answer for e in train]
    encoded = []
    for prompt, e in zip(prompts, train):
        label = e.answer if rng.random() < base.warmup_correct_fraction else rng.choice(answers)
        encoded.append(
            (
                tokenizer(prompt, add_special_tokens=False).input_ids,
                tokenizer(completion(label), add_special_tokens=False).input_ids,
            )
        )
    max_new_tokens = max(len(c) for _, c in encoded) + 2

    torch.manual_seed(base.seed)
    model = AutoModelForCausalLM.from_config(
        hf_config(base, vocab, tokenizer.eos_token_id, tokenizer.pad_token_id), dtype=torch.float32
    )
    losses = warm_up(model, encoded, base, tokenizer.pad_token_id)
    warmup_seconds = time.perf_counter() - started
    greedy = _accuracy(model, tokenizer, held_out, max_new_tokens)
    sampled = _accuracy(model, tokenizer, held_out, max_new_tokens, sample=True, seed=base.seed)

    save_base(model, tokenizer, out)
    for name, items in (("train.jsonl", train), ("eval.jsonl", held_out)):
        (out / name).write_text("".join(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n" for e in items))
    return {
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": vocab,
        "tokenizer_size": len(tokenizer),
        "max_prompt_tokens": max(len(p) for p, _ in encoded),
        "max_new_tokens": max_new_tokens,
        "eval_set": eval_set,
        "chance_accuracy": chance_accuracy(train, held_out),
        "majority_answer_accuracy": Counter(e.answer for e in held_out).most_common(1)[0][1] / len(held_out),
        "accuracy_after_warmup": greedy["accuracy"],
        "format_rate_after_warmup": greedy["format_rate"],
        "sampled_accuracy_after_warmup": sampled["accuracy"],
        "sampled_format_rate_after_warmup": sampled["format_rate"],
        "greedy_responses": greedy["responses"][:4],
        "sampled_responses": sampled["responses"][:4],
        "warmup_first_loss": losses[0],
        "warmup_final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "warmup_seconds": warmup_seconds,
        "seconds": time.perf_counter() - started,
        "cpu_seconds": time.process_time() - cpu_started,
        "torch_threads": torch.get_num_threads(),
    }
