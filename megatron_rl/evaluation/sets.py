"""Eval sets: the prompts of each named set of the eval config, chat-templated like the
training prompts, the reward each is scored with, and the check that training never draws
any of them.

A set's source is the held-out split of the training task (the task base's eval.jsonl,
beside the train.jsonl the training loader reads), a prompt file with the data section's
field names (both scored with the run's reward), or a reasoning-gym dataset with its own
options, seed and size (scored with the dataset's own score_answer, whatever the run's
reward). ``max_prompts`` keeps a file's first prompts, so a set's prompt ids (its row order)
are the same at every evaluation and in every run; a reasoning-gym set is the same for the
same config, since it skips the training prompts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable, Sequence

from megatron_rl.config.schema import HELD_OUT, Config, ConfigError, EvalSetConfig
from megatron_rl.from_config.sources import GYM_REWARD, verifier_name
from megatron_rl.tasks.base_model import HELD_OUT_FILE


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """One named set's prompts (chat-templated ids) and answers, in the set's order, and the
    reward that scores them (rewards.REWARDS)."""

    name: str
    prompt_ids: list[tuple[int, ...]]
    answers: list[str]
    reward: str

    def __len__(self) -> int:
        return len(self.prompt_ids)


def eval_rewards(cfg: Config) -> set[str]:
    """The rewards the eval sets of ``cfg`` are scored with."""
    return {GYM_REWARD if spec.gym else verifier_name(cfg) for spec in cfg.eval.sets.values()}


def load_sets(cfg: Config, base_dir: Path, tokenizer, training_prompts: Iterable[Sequence[int]]) -> list[EvalSet]:
    """Every set of ``cfg.eval``; a ConfigError names a set that cannot be read or that
    shares a prompt with ``training_prompts`` (the training dataset's prompt ids)."""
    training = {tuple(ids) for ids in training_prompts}
    sets = []
    for name, spec in cfg.eval.sets.items():
        if spec.gym:
            sets.append(_gym_set(name, spec, tokenizer, training))
        else:
            sets.append(_file_set(cfg, name, spec, base_dir, tokenizer, training))
    return sets


def _gym_set(name: str, spec: EvalSetConfig, tokenizer, training: set) -> EvalSet:
    from megatron_rl.data.reasoning_gym import SOURCE_PREFIX, GymSpec, eval_prompts

    gym = GymSpec(spec.source[len(SOURCE_PREFIX) :], dict(spec.options), spec.seed, spec.size)
    try:
        prompts = eval_prompts(gym, tokenizer, training)
    except ValueError as err:
        raise ConfigError(f"eval.sets.{name}.source={spec.source!r}: {err}") from None
    return EvalSet(name, [r.prompt_ids for r in prompts.records], [r.answer for r in prompts.records], GYM_REWARD)


def _file_set(cfg: Config, name: str, spec: EvalSetConfig, base_dir: Path, tokenizer, training: set) -> EvalSet:
    from megatron_rl.data import DatasetFormatError, PromptDataset, PromptFields

    fields = PromptFields(prompt=cfg.data.prompt_key, answer=cfg.data.answer_key)
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
    return EvalSet(name, [r.prompt_ids for r in records], [r.answer for r in records], verifier_name(cfg))
