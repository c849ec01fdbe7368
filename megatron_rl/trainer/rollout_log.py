"""The step's training rows on disk (``trainer.save_rollouts``): what the policy wrote and
what the update then trained on, one JSON line per row.

``RUN_DIR/rollouts/step_NNNNNN.jsonl`` holds the rows in the order the trainer splits them
into mini-batches (``algorithm.shuffle_mini_batches`` reorders them from that order). Each
line has the row's tokens (``prompt_ids``, ``token_ids``: the response), vLLM's logprobs
(``rollout_logprobs``), Megatron's recomputed ones, which are the PPO ratio's denominator
(``old_logprobs``), the per-token ``advantages``, ``reward`` (shaped, what the advantages
come from), ``correct`` (the verifier's score), ``group_index``, ``loss_start`` (the first
response token in the policy loss), ``loss_mask`` (per response token, 1 = in the policy
loss), ``finish_reason``, and, where the recipe computes them, ``ref_logprobs``,
``teacher_logprobs``, ``values`` and ``is_weights``. Every per-token list is as long as ``token_ids``.

A reader can replay the update from these rows alone (``megatron-rl bench grpo-reference``
does) or read what the policy generated, as verl's ``rollout_data_dir`` dumps are read. A
file is written aside and renamed, so it is whole or absent; a resumed run rewrites the
steps it trains again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_rl.trainer.assembly import StepBatch

ROLLOUTS_DIR = "rollouts"
OPTIONAL_TOKEN_FIELDS = ("ref_logprobs", "teacher_logprobs", "values", "is_weights")
"""StepBatch fields written (under their own names) when the step computed them."""


def step_path(run_dir: Path, step: int) -> Path:
    """Where step ``step``'s rows go."""
    return Path(run_dir) / ROLLOUTS_DIR / f"step_{step:06d}.jsonl"


def rollout_records(batch: StepBatch) -> list[dict]:
    """One plain-JSON record per row of ``batch`` (after its advantages are set)."""
    per_token = {
        "old_logprobs": batch.gather(batch.old_logprobs),
        "advantages": batch.gather(batch.advantages),
        "loss_mask": batch.gather(batch.loss_mask),
    }
    for field in OPTIONAL_TOKEN_FIELDS:
        tensor = getattr(batch, field)
        if tensor is not None:
            per_token[field] = batch.gather(tensor)
    rows = batch.rows
    records = []
    for row, sample in enumerate(rows.samples):
        record = {
            "row": row,
            "group_index": int(rows.group_index[row]),
            "prompt_ids": list(sample.prompt_ids),
            "token_ids": list(sample.token_ids),
            "rollout_logprobs": [float(x) for x in sample.logprobs],
            "reward": float(rows.rewards[row]),
            "correct": float(rows.correct[row]),
            "loss_start": int(rows.loss_start[row]),
            "finish_reason": sample.finish_reason,
        }
        for key, values in per_token.items():
            record[key] = [int(x) for x in values[row].tolist()] if key == "loss_mask" else values[row].tolist()
        records.append(record)
    return records


def write_rollouts(run_dir: Path, step: int, batch: StepBatch) -> Path:
    """Write step ``step``'s rows atomically (aside, then renamed); the file's path."""
    path = step_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("w") as f:
        for record in rollout_records(batch):
            f.write(json.dumps(record) + "\n")
    os.replace(tmp, path)
    return path


def read_rollouts(path: Path) -> list[dict]:
    """The records of one step's file, in row order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
