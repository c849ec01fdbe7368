"""Reward-model training (``algorithm.recipe=reward_model``): Bradley-Terry on preference pairs.

The model is the critic's (models.value_head: the GPT backbone with a scalar head), started
from the base's backbone, in the layout ``parallel`` names. A step is the supervised loop's
(trainer.supervised): the step's pairs -> one optimizer update on the mean
-log sigmoid(r_chosen - r_rejected) through Megatron's schedules (schedules.preference) ->
metrics -> held-out pair accuracy when eval is due -> checkpoint. Data comes from
``pairs:PATH``, or for ``pairs:task:<name>`` from files the task writes into the run
directory (tasks.pairs) beside its base. Every pair is read and checked before the model
is built.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_rl.algorithms import bradley_terry_loss, pair_correct
from megatron_rl.config import Config, ConfigError
from megatron_rl.config.schema import HELD_OUT, MODEL_ROLE, PAIRS_PREFIX, REWARD_MODEL
from megatron_rl.data.pairs import PreferencePair, encode_conversation, read_pairs
from megatron_rl.data.sources import DatasetFormatError
from megatron_rl.from_config.sources import base_settings, pairs_file
from megatron_rl.launch.signals import StopSignals
from megatron_rl.schedules.batch import TrainBatch
from megatron_rl.schedules.preference import PAIR, PreferenceLoss, pair_batch, pair_microbatching, sequence_rewards
from megatron_rl.tasks.pairs import HELD_OUT_PAIRS, TRAIN_PAIRS, write_task_pairs
from megatron_rl.trainer.supervised import RunInputs, SupervisedTrainer

PAIRS_DIR = "pairs"
"""Where a ``pairs:task:<name>`` run writes its task's pairs, under the run directory."""
Encoded = list[tuple[list[int], list[int]]]


@dataclasses.dataclass(frozen=True)
class PairData:
    """The run's pairs as token ids: the training pairs and each eval set's."""

    train: Encoded
    eval_sets: dict[str, Encoded]


def pair_files(cfg: Config, run_dir: Path, rank: int) -> tuple[Path, dict[str, Path]]:
    """The training pairs file and each eval set's; for ``pairs:task:<name>`` rank 0 writes
    the task's pairs into the run directory first."""
    train = pairs_file(cfg)
    held_out = None
    if train is None:  # the task writes its own
        settings = base_settings(cfg)
        if rank == 0:
            write_task_pairs(settings, run_dir / PAIRS_DIR)
        dist.barrier()
        train, held_out = run_dir / PAIRS_DIR / TRAIN_PAIRS, run_dir / PAIRS_DIR / HELD_OUT_PAIRS
    sets = {}
    if cfg.eval.enabled:
        for name, spec in cfg.eval.sets.items():
            sets[name] = held_out if spec.source == HELD_OUT else Path(spec.source[len(PAIRS_PREFIX) :])
    return train, sets


def encode_pairs(pairs: Sequence[PreferencePair], tokenizer, seq_length: int, where: str) -> Encoded:
    """Both conversations of every pair as ids; one ConfigError line when any is longer than
    ``seq_length`` (cutting one would score another conversation's prefix)."""
    encoded = [(encode_conversation(tokenizer, p.chosen), encode_conversation(tokenizer, p.rejected)) for p in pairs]
    too_long = [
        (max(len(c), len(r)), p.location) for (c, r), p in zip(encoded, pairs) if max(len(c), len(r)) > seq_length
    ]
    if too_long:
        longest, location = max(too_long)
        raise ConfigError(
            f"{where}: {len(too_long)} of {len(pairs)} pairs are longer than trainer.seq_length={seq_length} "
            f"tokens (the longest, {longest}, at {location}); raise trainer.seq_length"
        )
    return encoded


def load_pair_data(cfg: Config, run_dir: Path, tokenizer, rank: int) -> PairData:
    """Every pair of the run, read, checked and encoded (before any model is built)."""
    train_file, set_files = pair_files(cfg, run_dir, rank)

    def read(path: Path, where: str) -> Encoded:
        try:
            pairs = read_pairs(path)
        except DatasetFormatError as err:
            raise ConfigError(f"{where}: {err}") from None
        return encode_pairs(pairs, tokenizer, cfg.trainer.seq_length, where)

    train = read(train_file, f"data.source={cfg.data.source!r}")
    sets = {name: read(path, f"eval.sets.{name}") for name, path in set_files.items()}
    return PairData(train, sets)


def pair_progress_line(total: int):
    """The progress line of a reward-model run's metrics row."""

    def line(r: dict) -> str:
        parts = [f"step {r['step']:>4d}/{total}"]
        if "train/loss" in r:
            parts += [
                f"loss {r['train/loss']:.4f}",
                f"acc {r['train/pair_accuracy']:.3f}",
                f"margin {r['train/reward_margin']:+.3f}",
                f"{r['timing/step_s']:.1f}s",
            ]
        parts += [
            f"val/{k.split('/')[1]} {v:.3f}" for k, v in r.items() if k.endswith("/pair_accuracy") and k[:4] == "val/"
        ]
        return "  ".join(parts)

    return line


class PairRecipe:
    """Bradley-Terry on preference pairs: a critic (a scalar head) whose head bias stays at
    0, since the loss reads reward differences only; held-out pair accuracy as ``val/``."""

    role, freeze_head_bias = "critic", True
    summary_metric = "pair_accuracy"

    def __init__(self, cfg: Config, inputs: RunInputs):
        self.cfg = cfg
        tokenizer = inputs.tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.data = load_pair_data(cfg, inputs.run_dir, tokenizer, inputs.rank)
        self.micro = pair_microbatching(cfg.trainer.micro_batch_size, cfg.trainer.max_tokens_per_micro_batch)
        self.loss = PreferenceLoss()

    def checkpoint_extra(self) -> dict:
        """Every checkpoint says it holds a reward model (a scalar head, not an LM head)."""
        return {MODEL_ROLE: REWARD_MODEL}

    def num_rows(self) -> int:
        return len(self.data.train)

    def batch(self, indices: list[int]) -> TrainBatch:
        return pair_batch([self.data.train[i] for i in indices], self.cfg.trainer.seq_length, self.pad_token_id)

    def evaluate(self, model) -> dict:
        """val/<set>/loss and val/<set>/pair_accuracy."""
        metrics = {}
        for name, pairs in self.data.eval_sets.items():
            chosen, rejected = self.rewards(model, pairs)
            metrics[f"val/{name}/loss"] = float(bradley_terry_loss(chosen, rejected).mean())
            metrics[f"val/{name}/pair_accuracy"] = float(pair_correct(chosen, rejected).mean())
        return metrics

    def rewards(self, model, pairs: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
        """[P] rewards of the chosen and of the rejected conversations, on every rank."""
        world = dist.get_world_size()
        multiple = self.cfg.parallel.dp(world) * self.cfg.trainer.micro_batch_size * PAIR
        rows = [ids for pair in pairs for ids in pair]
        rewards = sequence_rewards(
            model.chunks, rows, self.cfg.trainer.seq_length, self.pad_token_id, self.micro, multiple
        )
        return rewards[0::PAIR], rewards[1::PAIR]

    def progress_line(self, total: int):
        return pair_progress_line(total)


def reward_model_trainer(cfg: Config, stop_signals: StopSignals) -> SupervisedTrainer:
    """The run of ``algorithm.recipe=reward_model``."""
    return SupervisedTrainer(cfg, stop_signals, PairRecipe)
