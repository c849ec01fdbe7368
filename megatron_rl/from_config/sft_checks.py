"""The SFT recipe's part of the validation pass (``algorithm.recipe=sft``).

What a fine-tuning run needs beyond the layouts: conversations (a JSONL/Parquet file of
``messages`` rows whose first rows parse, or ``task:<name>`` of a known task, whose
solutions the run writes as conversations), whole conversations per micro-batch and per
data-parallel rank, and eval sets of conversations. What it has no use for (rollouts of
their own ranks, a critic layout, recipe overrides, reward scorers, tool episodes) is
refused rather than ignored. Every problem is one :class:`ConfigError` line; nothing here
imports torch.
"""

from __future__ import annotations

from pathlib import Path

from megatron_rl.config.schema import HELD_OUT, PAIRS_PREFIX, SFT, Config, ConfigError
from megatron_rl.data.chat import read_chats
from megatron_rl.data.reasoning_gym import SOURCE_PREFIX as GYM_PREFIX
from megatron_rl.from_config import sources
from megatron_rl.from_config.pair_checks import check_rows_file, refuse_rl_settings
from megatron_rl.tasks import get_task


def check_sft(config: Config, world_size: int) -> None:
    """The fine-tuning run can start on ``world_size`` training ranks (layouts checked before)."""
    refuse_rl_settings(config, "it trains no critic", [(config.reward.scorers, "reward.scorers (it scores nothing)")])
    trainer = config.trainer
    dp = config.parallel.dp(world_size)
    if trainer.global_batch_size % (trainer.micro_batch_size * dp):
        raise ConfigError(
            f"trainer.global_batch_size={trainer.global_batch_size} conversations must be a multiple of "
            f"trainer.micro_batch_size x data-parallel size = {trainer.micro_batch_size}x{dp}"
        )
    _check_source(config)
    _check_eval_sets(config)


def _check_source(config: Config) -> None:
    source = config.data.source
    if source.startswith((PAIRS_PREFIX, GYM_PREFIX)):
        raise ConfigError(
            f"algorithm.recipe={SFT} needs data.source=PATH (a JSONL/Parquet file of 'messages' rows) or "
            f"task:<name>, got {source!r}"
        )
    name = sources.task_name(config)
    if name is not None:
        try:
            get_task(name)
        except ValueError as err:  # lists the valid ones
            raise ConfigError(f"data.source={source!r}: {err}") from None
        return
    check_chats_file(Path(source), f"data.source={source!r}")


def check_chats_file(path: Path, where: str) -> None:
    """The file exists and its first rows are conversations (the data module's own reader)."""
    check_rows_file(path, where, read_chats)


def _check_eval_sets(config: Config) -> None:
    """Each eval set is the task's held-out conversations (task:<name> data) or a file of
    conversations other than the training one."""
    if not config.eval.enabled:
        return
    training = None if sources.task_name(config) is not None else Path(config.data.source)
    for name, spec in config.eval.sets.items():
        where = f"eval.sets.{name}.source={spec.source!r}"
        if spec.source == HELD_OUT:
            if training is not None:
                raise ConfigError(
                    f"{where} needs data.source=task:<name>; for a file name held-out conversations "
                    f"(eval.sets.{name}.source=PATH)"
                )
            continue
        if spec.max_prompts is not None:
            raise ConfigError(f"eval.sets.{name}.max_prompts applies to prompt sets, not to conversations")
        path = Path(spec.source)
        if training is not None and path.resolve() == training.resolve():
            raise ConfigError(f"{where} is the training data; evaluate on conversations training never reads")
        check_chats_file(path, where)
