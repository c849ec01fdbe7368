"""Preference pairs a digit task writes itself: its correct solution against a wrong one.

For every prompt of the task base's train and held-out splits (``base_model.split_prompts``:
the same prompts, so the held-out pairs' prompts never occur in training), the chosen answer
is the reference solution; the rejected one is, in equal shares (seeded):

- ``wrong``: the same text with a wrong final answer, drawn uniformly from the other nine
  digits: a reward model must read the prompt to tell them apart;
- ``bare``: the right digit alone, without the answer's form;
- ``unfinished``: the solution's text up to, and without, its final answer.

The last two are what a policy trained on a reward model alone finds first when the
model has seen well-formed answers only: on ``wrong`` pairs alone, GRPO on the model's
score drifts to two-token answers the model scores above the right ones, and held-out
accuracy falls to 0.02 (docs/rewards.md). ``data.source=pairs:task:<name>`` writes these files into the run directory.
"""

from __future__ import annotations

import random
from pathlib import Path

from megatron_rl.data.pairs import write_pairs
from megatron_rl.tasks.base_model import BaseModelSettings, split_prompts
from megatron_rl.tasks.digits import ANSWER_SPACE, DigitTask, TaskExample

TRAIN_PAIRS = "train_pairs.jsonl"
HELD_OUT_PAIRS = "held_out_pairs.jsonl"


REJECTED_KINDS = ("wrong", "bare", "unfinished")
ANSWER_MARK = "Answer:"


def task_pair(task: DigitTask, example: TaskExample, rng: random.Random) -> dict:
    """One pair row (``prompt``, ``chosen``, ``rejected``) of ``example``."""
    kind = rng.choice(REJECTED_KINDS)
    if kind == "wrong":
        rejected = task.solution(example.digits, rng.choice([a for a in ANSWER_SPACE if a != example.answer]))
    elif kind == "bare":
        rejected = example.answer
    else:
        rejected = example.solution.rsplit(ANSWER_MARK, 1)[0].strip() or ANSWER_MARK
    return {"prompt": example.prompt, "chosen": example.solution, "rejected": rejected}


def write_task_pairs(settings: BaseModelSettings, out: Path) -> tuple[Path, Path]:
    """The task's train and held-out pairs as JSONL files in ``out``: (train, held-out)."""
    task, train, held_out = split_prompts(settings)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / TRAIN_PAIRS, out / HELD_OUT_PAIRS
    for path, examples, salt in ((paths[0], train, "train"), (paths[1], held_out, "held_out")):
        rng = random.Random(f"pairs-{task.seed_key()}-{settings.seed}-{salt}")
        write_pairs(path, (task_pair(task, e, rng) for e in examples))
    return paths
