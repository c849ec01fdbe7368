"""Eval sets: the prompts of each named set of the eval config, chat-templated like the
training prompts, and the check that training never draws any of them.

A set's source is the held-out split of the training task (the task base's eval.jsonl,
beside the train.jsonl the training loader reads) or a prompt file with the data
section's field names. ``max_prompts`` keeps the set's first prompts, so a set's prompt
ids (its row order) are the same at every evaluation and in every run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable, Sequence

from megatron_rl.config.schema import HELD_OUT, Config, ConfigError
from megatron_rl.tasks.base_model import HELD_OUT_FILE


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """One named set's prompts (chat-templated ids) and answers, in the set's order."""

    name: str
    prompt_ids: list[tuple[int, ...]]
    answers: list[str]

    def __len__(self) -> int:
        return len(self.prompt_ids)


def load_sets(cfg: Config, base_dir: Path, tokenizer, training_prompts: Iterable[Sequence[int]]) -> list[EvalSet]:
    """Every set of ``cfg.eval``; a ConfigError names a set that cannot be read or that
    shares a prompt with ``training_prompts`` (the training dataset's prompt ids)."""
    from megatron_rl.data import DatasetFormatError, PromptDataset, PromptFields

    fields = PromptFields(prompt=cfg.data.prompt_key, answer=cfg.data.answer_key)
    training = {tuple(ids) for ids in training_prompts}
    sets = []
    for name, spec in cfg.eval.sets.items():
        path = base_dir / HELD_OUT_FILE if spec.source == HELD_OUT else Path(spec.source)
        try:
            records = PromptDataset(path, tokenizer, fields=fields).records[: spec.max_prompts]
        except DatasetFormatError as err:
            raise ConfigError(f"eval.sets.{name}.source={spec.source!r}: {err}".replace("\n", " ")) from None
        shared = sum(r.prompt_ids in training for r in records)
        if shared:
            raise ConfigError(
                f"eval.sets.{name}: {shared} of its {len(records)} prompts are also training prompts "
                f"({path}); evaluate on prompts training never draws"
            )
        sets.append(EvalSet(name, [r.prompt_ids for r in records], [r.answer for r in records]))
    return sets
