"""Supervised warm-up of the tiny base model, and greedy accuracy on held-out prompts.

The warm-up teaches the FORMAT, not the task: by default every answer (and every
running value) in the warm-up data is drawn uniformly at random, so the model learns to
end with ``Answer: <digit>`` but gains nothing about which digit. RL must then lift
accuracy from chance. ``correct_fraction`` > 0 mixes in true solutions for a warmer start.
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from megatron_rl.rewards import build_verifier
from megatron_rl.tasks.chat_format import prompt_messages, training_text
from megatron_rl.tasks.digits import ANSWER_SPACE, DigitTask, TaskExample


def warmup_solution(task: DigitTask, example: TaskExample, rng: random.Random, correct: bool) -> str:
    """The completion the warm-up trains on: the true one, or the same shape with random digits.

    A task with ``chained_answer`` starts its random chain from the prompt's first digit and
    answers the chain's last value: the form of a true chain, none of its arithmetic.
    """
    if correct:
        return example.solution
    steps = [rng.randrange(10) for _ in example.digits]
    if task.chained_answer:
        steps[0] = example.digits[0]
        return task.solution(example.digits, answer=str(steps[-1]), steps=steps)
    return task.solution(example.digits, answer=rng.choice(ANSWER_SPACE), steps=steps)


def encode_warmup(
    tokenizer, task: DigitTask, examples: Sequence[TaskExample], seed: int, correct_fraction: float
) -> list[tuple[list[int], list[int]]]:
    """``(prompt ids, completion ids)`` per example; completion ends in EOS."""
    rng = random.Random(f"warmup-labels-{seed}")
    encoded = []
    for example in examples:
        solution = warmup_solution(task, example, rng, correct=rng.random() < correct_fraction)
        prompt, completion = training_text(example, solution)
        encoded.append(
            (
                tokenizer(prompt, add_special_tokens=False).input_ids,
                tokenizer(completion, add_special_tokens=False).input_ids,
            )
        )
    return encoded


def _collate(pairs: Sequence[tuple[list[int], list[int]]], pad_id: int):
    length = max(len(p) + len(c) for p, c in pairs)
    ids = torch.full((len(pairs), length), pad_id, dtype=torch.long)
    labels = torch.full((len(pairs), length), -100, dtype=torch.long)
    mask = torch.zeros((len(pairs), length), dtype=torch.long)
    for row, (prompt, completion) in enumerate(pairs):
        seq = prompt + completion
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, len(prompt) : len(seq)] = torch.tensor(completion)  # loss on the completion only
        mask[row, : len(seq)] = 1
    return ids, labels, mask


def supervised_warmup(model, encoded, *, steps: int, batch_size: int, lr: float, seed: int, pad_id: int) -> list[float]:
    """Plain AdamW on the completion tokens; returns the loss of every step."""
    rng = random.Random(f"warmup-order-{seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    model.train()
    losses = []
    for _ in range(steps):
        ids, labels, mask = _collate(rng.sample(encoded, batch_size), pad_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def generate_responses(
    model,
    tokenizer,
    examples: Sequence[TaskExample],
    max_new_tokens: int,
    *,
    sample: bool = False,
    seed: int = 0,
    batch_size: int = 64,
) -> list[str]:
    """Greedy (or temperature-1 sampled) completions with transformers, stopping at EOS."""
    if sample:
        torch.manual_seed(seed)
    responses = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        prompts = [
            tokenizer.apply_chat_template(prompt_messages(e), tokenize=False, add_generation_prompt=True) for e in chunk
        ]
        batch = tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
        out = model.generate(
            **batch,
            do_sample=sample,
            max_new_tokens=max_new_tokens,
            **({"temperature": 1.0, "top_p": 1.0} if sample else {}),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        new_tokens = out[:, batch["input_ids"].shape[1] :]
        responses += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    return responses


def accuracy(
    model,
    tokenizer,
    task: DigitTask,
    examples: Sequence[TaskExample],
    max_new_tokens: int,
    *,
    sample: bool = False,
    seed: int = 0,
) -> dict:
    """Accuracy and well-formed rate of greedy (or sampled) answers, by the task's verifier.

    Greedy is what the brief asks for, but a format-only base answers the same digit to
    every prompt under greedy decoding; the sampled accuracy is what RL starts from.
    """
    responses = generate_responses(model, tokenizer, examples, max_new_tokens, sample=sample, seed=seed)
    with build_verifier(task.verifier) as verifier:
        scores, stats = verifier.score_batch(responses, [task.reference(e) for e in examples])
    return {
        "accuracy": sum(scores) / len(scores),
        "format_rate": 1.0 - stats["format_failures"] / stats["total"],
        "responses": responses,
    }
