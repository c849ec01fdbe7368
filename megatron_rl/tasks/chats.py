"""Conversations a digit task writes itself for SFT: each prompt answered by its reference solution.

The prompts are the task base's train and held-out splits (``base_model.split_prompts``:
the held-out conversations' prompts never occur in training), each a user message answered
by the assistant with the solution the task's verifier accepts. ``data.source=task:<name>``
with ``algorithm.recipe=sft`` writes these files into the run directory.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_rl.tasks.base_model import BaseModelSettings, split_prompts

TRAIN_CHATS = "train_chats.jsonl"
HELD_OUT_CHATS = "held_out_chats.jsonl"


def write_task_chats(settings: BaseModelSettings, out: Path) -> tuple[Path, Path]:
    """The task's train and held-out conversations as JSONL files in ``out``: (train, held-out)."""
    _, train, held_out = split_prompts(settings)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / TRAIN_CHATS, out / HELD_OUT_CHATS
    for path, examples in ((paths[0], train), (paths[1], held_out)):
        with path.open("w", encoding="utf-8") as f:
            for e in examples:
                messages = [{"role": "user", "content": e.prompt}, {"role": "assistant", "content": e.solution}]
                f.write(json.dumps({"messages": messages}) + "\n")
    return paths
