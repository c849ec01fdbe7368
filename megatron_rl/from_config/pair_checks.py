"""The reward-model recipe's part of the validation pass (``algorithm.recipe=reward_model``).

What a reward-model run needs beyond the layouts: preference-pair data (``pairs:PATH`` whose
first rows parse, or ``pairs:task:<name>`` of a known task), whole pairs per micro-batch and
per data-parallel rank, and eval sets of pairs. What it has no use for (rollouts of their own
ranks, a critic layout, recipe overrides, tool episodes) is refused rather than ignored.
Every problem is one :class:`ConfigError` line; nothing here imports torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from megatron_rl.config.schema import HELD_OUT, PAIRS_PREFIX, REWARD_MODEL, TASK_PREFIX, Config, ConfigError
from megatron_rl.data.pairs import read_pairs
from megatron_rl.data.sources import DatasetFormatError
from megatron_rl.from_config import sources
from megatron_rl.tasks import get_task

FIRST_ROWS = 8
"""Rows of a data file read by the check (the trainer reads all of them before building a model)."""


def refuse_pairs_for_rl(config: Config) -> None:
    """Preference pairs train a reward model only."""
    if sources.pairs_source(config) is not None and not config.algorithm.trains_reward_model:
        raise ConfigError(
            f"data.source={config.data.source!r} holds preference pairs: they train a reward model "
            f"(algorithm.recipe={REWARD_MODEL}), not algorithm.recipe={config.algorithm.recipe}"
        )


def refuse_rl_settings(config: Config, critic_why: str, extra: Sequence[tuple[object, str]] = ()) -> None:
    """A supervised recipe (reward_model, sft) generates nothing: the RL settings it would
    ignore are refused, each in one line naming the key (``critic_why``: why critic_parallel
    does not apply; ``extra``: the recipe's own (set?, what) pairs)."""
    refusals = [
        (config.algorithm.overrides, "algorithm.overrides (they set RL recipe fields)"),
        (config.rollout.placement != "colocated", "rollout.placement=disaggregated (it generates nothing)"),
        (config.critic_parallel is not None, f"critic_parallel ({critic_why})"),
        (config.trainer.save_rollouts, "trainer.save_rollouts (it has no rollouts)"),
        (config.environment.episodes, f"environment.name={config.environment.name} (it runs no episodes)"),
        (config.algorithm.teacher is not None, "algorithm.teacher (it samples nothing to distill)"),
        *extra,
    ]
    for refused, what in refusals:
        if refused:
            raise ConfigError(f"algorithm.recipe={config.algorithm.recipe} does not take {what}")


def check_reward_model(config: Config, world_size: int) -> None:
    """The reward-model run can start on ``world_size`` training ranks (layouts checked before)."""
    refuse_rl_settings(config, "the reward model trains in parallel")
    _check_batch(config, world_size)
    _check_source(config)
    _check_eval_sets(config)


def _check_batch(config: Config, world_size: int) -> None:
    """Whole pairs per micro-batch and DP rank; a pair fits one packed row."""
    trainer = config.trainer
    dp = config.parallel.dp(world_size)
    if trainer.global_batch_size % (trainer.micro_batch_size * dp):
        raise ConfigError(
            f"trainer.global_batch_size={trainer.global_batch_size} pairs must be a multiple of "
            f"trainer.micro_batch_size x data-parallel size = {trainer.micro_batch_size}x{dp} "
            f"(algorithm.recipe={REWARD_MODEL}: both counted in pairs)"
        )
    budget = trainer.max_tokens_per_micro_batch
    if budget is not None and budget < 2 * trainer.seq_length:
        raise ConfigError(
            f"trainer.max_tokens_per_micro_batch={budget} must be >= 2 x trainer.seq_length={trainer.seq_length}: "
            "a packed row holds a preference pair's two conversations together"
        )


def _check_source(config: Config) -> None:
    source = sources.pairs_source(config)
    if source is None:
        raise ConfigError(
            f"algorithm.recipe={REWARD_MODEL} needs data.source=pairs:PATH (a JSONL/Parquet file of "
            f"preference pairs) or pairs:task:<name>, got {config.data.source!r}"
        )
    name = sources.task_name(config)
    if name is not None:
        try:
            get_task(name)
        except ValueError as err:  # lists the valid ones
            raise ConfigError(f"data.source={config.data.source!r}: {err}") from None
        return
    check_pairs_file(Path(source), f"data.source={config.data.source!r}")


def check_pairs_file(path: Path, where: str) -> None:
    """The file exists and its first rows are pairs (the data module's own reader)."""
    check_rows_file(path, where, read_pairs)


def check_rows_file(path: Path, where: str, read: Callable[..., object]) -> None:
    """The file exists and its first FIRST_ROWS rows parse with ``read(path, limit=...)``
    (a data module's own reader); one ConfigError line otherwise."""
    try:
        read(path, limit=FIRST_ROWS)
    except DatasetFormatError as err:
        raise ConfigError(f"{where}: {err}") from None
    except (ValueError, OSError) as err:  # unreadable, not Parquet after all (pyarrow's ArrowInvalid)
        raise ConfigError(f"{where}: {path} cannot be read: {err}") from None


def _check_eval_sets(config: Config) -> None:
    """Each eval set is the task's held-out pairs (pairs:task:<name> data) or a pairs file
    other than the training one."""
    if not config.eval.enabled:
        return
    training = sources.pairs_file(config)
    for name, spec in config.eval.sets.items():
        where = f"eval.sets.{name}.source={spec.source!r}"
        if spec.source == HELD_OUT:
            if sources.task_name(config) is None:
                raise ConfigError(
                    f"{where} needs data.source=pairs:task:<name>; for a pairs file name held-out pairs "
                    f"(eval.sets.{name}.source=pairs:PATH)"
                )
            continue
        if not spec.source.startswith(PAIRS_PREFIX) or spec.source[len(PAIRS_PREFIX) :].startswith(TASK_PREFIX):
            raise ConfigError(f"{where}: a reward model is evaluated on pairs: use {HELD_OUT} or pairs:PATH")
        if spec.max_prompts is not None:
            raise ConfigError(f"eval.sets.{name}.max_prompts applies to prompt sets, not to pairs")
        path = Path(spec.source[len(PAIRS_PREFIX) :])
        if training is not None and path.resolve() == training.resolve():
            raise ConfigError(f"{where} is the training data; evaluate on pairs training never reads")
        check_pairs_file(path, where)
