"""Reward-model training (``algorithm.recipe=reward_model``): Bradley-Terry on preference pairs.

The model is the critic's (models.value_head: the GPT backbone with a scalar head), started
from the base's backbone, in the layout ``parallel`` names. A step reads as the algorithm:
the step's pairs (a seeded order over epochs, a function of the step alone, so a resumed
run trains what the uninterrupted one would have) -> one optimizer update on the mean
-log sigmoid(r_chosen - r_rejected) through Megatron's schedules (schedules.preference) ->
metrics -> held-out pair accuracy when eval is due -> checkpoint. Data comes from
``pairs:PATH``, or for ``pairs:task:<name>`` from files the task writes into the run
directory (tasks.pairs) beside its base. Every pair is read and checked before the model
is built.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_rl import platform
from megatron_rl.algorithms import bradley_terry_loss, pair_correct
from megatron_rl.checkpoint import Checkpointer
from megatron_rl.config import Config, ConfigError, dump_yaml, to_dict
from megatron_rl.config.schema import HELD_OUT, MODEL_ROLE, PAIRS_PREFIX, REWARD_MODEL
from megatron_rl.data.pairs import PreferencePair, encode_conversation, read_pairs
from megatron_rl.data.sources import DatasetFormatError
from megatron_rl.from_config import setup, validate
from megatron_rl.from_config.sources import base_settings, pairs_file
from megatron_rl.launch import exit_codes, startup_gc
from megatron_rl.launch.signals import StopSignals, stop_line
from megatron_rl.launch.slurm_env import SlurmEnv
from megatron_rl.launch.status import write_status
from megatron_rl.models.hf_config import arch_from_hf
from megatron_rl.parallel import initialize
from megatron_rl.schedules import epoch_order, local_batch, train_step
from megatron_rl.schedules.preference import PAIR, PreferenceLoss, pair_batch, pair_microbatching, sequence_rewards
from megatron_rl.tasks.pairs import HELD_OUT_PAIRS, TRAIN_PAIRS, write_task_pairs
from megatron_rl.trainer.loggers import open_loggers
from megatron_rl.trainer.metrics import MetricsLog
from megatron_rl.trainer.state import RunCheckpoint, choose_resume_step

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


def step_indices(step: int, pairs_per_step: int, num_pairs: int, seed: int) -> list[int]:
    """The pairs of ``step`` (1-based): the next ``pairs_per_step`` of a sequence of epochs,
    each a fresh permutation drawn from (seed, epoch)."""
    start = (step - 1) * pairs_per_step
    out, orders = [], {}
    for position in range(start, start + pairs_per_step):
        epoch, index = divmod(position, num_pairs)
        if epoch not in orders:
            orders[epoch] = epoch_order(num_pairs, seed, 0, epoch)
        out.append(int(orders[epoch][index]))
    return out


def progress_line(total: int):
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


class RewardModelTrainer:
    """A reward-model run, built once from its config; :meth:`run` trains to trainer.max_steps."""

    def __init__(self, cfg: Config, stop_signals: StopSignals):
        platform.init_distributed(cfg.trainer.dist_timeout_s)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.cfg = validate(cfg, self.world)
        self.stop_signals = stop_signals
        self.run_dir = Path(cfg.trainer.run_dir)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(dump_yaml(cfg))
        resume_step = choose_resume_step(self.run_dir / "checkpoints", cfg.checkpoint.on_corrupt)
        torch.manual_seed(cfg.trainer.seed)
        self.base_dir = setup.base_model_dir(cfg, self.rank)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(self.base_dir))
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.data = load_pair_data(cfg, self.run_dir, tokenizer, self.rank)
        arch = arch_from_hf(self.base_dir)
        layout = initialize(
            cfg.parallel, seed=cfg.trainer.seed, model=arch.shape(), timeout_s=cfg.trainer.dist_timeout_s
        )
        self.model = setup.build_trainable(  # the head's bias untrained: BT reads reward differences only
            "critic", arch, layout, setup.build_options(cfg), cfg.trainer.lr, self.base_dir, freeze_head_bias=True
        )
        self.micro = pair_microbatching(cfg.trainer.micro_batch_size, cfg.trainer.max_tokens_per_micro_batch)
        self.loss = PreferenceLoss()
        self.checkpoint = RunCheckpoint(Checkpointer(), self.run_dir / "checkpoints", cfg.checkpoint, self.base_dir)
        extra = self.checkpoint.resume(self.model, None, resume_step)
        self.first_step = 1 if extra is None else int(extra["step"]) + 1
        if extra is not None and self.rank == 0:
            print(f"resumed from {self.checkpoint.root} step {extra['step']}", flush=True)
        self.log = MetricsLog(
            self.run_dir,
            enabled=self.rank == 0,
            total_steps=cfg.trainer.max_steps,
            resume_after=self.first_step - 1,
            loggers=open_loggers(cfg.trainer.loggers, self.run_dir, cfg.trainer.project, to_dict(cfg))
            if self.rank == 0
            else (),
            line=progress_line(cfg.trainer.max_steps),
        )
        self.slurm = SlurmEnv.from_environ()
        self.history: list[dict] = []
        self.eval_history: list[dict] = []
        self.stop_signal = None

    def run(self) -> dict:
        """Train from the step after the newest checkpoint to trainer.max_steps, or until a stop signal."""
        startup_gc.resume()
        step = self.first_step - 1
        if step == 0 and self.cfg.eval.due(0, self.cfg.trainer.max_steps):  # the starting weights, as step 0
            self.log.write(self.evaluate(0, {"step": 0}))
        for step in range(self.first_step, self.cfg.trainer.max_steps + 1):
            if self.step(step):
                break
        return self.close(step)

    def step(self, step: int) -> bool:
        """One update on the step's pairs; True when a stop signal ends the run after it."""
        started = time.perf_counter()
        cfg = self.cfg
        indices = step_indices(step, cfg.trainer.global_batch_size, len(self.data.train), cfg.trainer.seed)
        batch = pair_batch([self.data.train[i] for i in indices], cfg.trainer.seq_length, self.pad_token_id)
        self.model.set_lr(self._lr(step))
        with self.model.active():
            metrics = train_step(
                self.model.chunks,
                self.model.optimizer,
                local_batch(self.model.chunks, batch, self.micro),
                self.loss,
                self.micro,
            )
        metrics = {"step": step, **metrics, "timing/step_s": time.perf_counter() - started}
        metrics["slurm/restart_count"] = self.slurm.restart_count
        self.stop_signal = self.stop_signals.agree()
        stopping = self.stop_signal is not None
        if not stopping:  # a stop saves first: eval must not delay a preemption
            self.evaluate(step, metrics)
        self.history.append(metrics)
        self.log.write(metrics)
        if stopping or self.checkpoint.due(step, cfg.trainer.max_steps):
            self.checkpoint.save(step, self.model, None, {MODEL_ROLE: REWARD_MODEL})
        if stopping and self.rank == 0:
            print(stop_line(self.stop_signal, step, self.checkpoint.root), flush=True)
        return stopping

    def evaluate(self, step: int, metrics: dict) -> dict:
        """val/<set>/loss and val/<set>/pair_accuracy of the weights after ``step``, when due."""
        if not self.cfg.eval.due(step, self.cfg.trainer.max_steps):
            return metrics
        started = time.perf_counter()
        for name, pairs in self.data.eval_sets.items():
            chosen, rejected = self.rewards(pairs)
            metrics[f"val/{name}/loss"] = float(bradley_terry_loss(chosen, rejected).mean())
            metrics[f"val/{name}/pair_accuracy"] = float(pair_correct(chosen, rejected).mean())
        metrics["timing/eval_s"] = time.perf_counter() - started
        self.eval_history.append(metrics)
        return metrics

    def rewards(self, pairs: Encoded) -> tuple[torch.Tensor, torch.Tensor]:
        """[P] rewards of the chosen and of the rejected conversations, on every rank."""
        multiple = self.cfg.parallel.dp(self.world) * self.cfg.trainer.micro_batch_size * PAIR
        rows = [ids for pair in pairs for ids in pair]
        with self.model.active():
            rewards = sequence_rewards(
                self.model.chunks, rows, self.cfg.trainer.seq_length, self.pad_token_id, self.micro, multiple
            )
        return rewards[0::PAIR], rewards[1::PAIR]

    def _lr(self, step: int) -> float:
        """Linear warm-up over trainer.lr_warmup_steps, then constant."""
        warm = self.cfg.trainer.lr_warmup_steps
        return self.cfg.trainer.lr * (min(1.0, step / warm) if warm else 1.0)

    def close(self, step: int) -> dict:
        """Commit the saves in flight, write the run's status; the run's summary."""
        self.checkpoint.close()
        code = exit_codes.DONE if step >= self.cfg.trainer.max_steps else exit_codes.STOPPED
        if self.rank == 0:
            write_status(
                self.run_dir, code, step, None if self.stop_signal is None else self.stop_signal.name, self.slurm
            )
        self.log.close()
        return summary(self.run_dir, self.history, self.eval_history, step, code)


def summary(run_dir: Path, history: list[dict], eval_history: list[dict], last_step: int, code: int) -> dict:
    """What ``train`` returns for a reward model: its place and end, the mean training loss
    of its first and last five steps, and the first and last pair accuracy of every eval set."""
    out = {"run_dir": str(run_dir), "steps": len(history), "last_step": last_step, "exit_code": code, "error": None}
    losses = [r["train/loss"] for r in history if math.isfinite(r["train/loss"])]
    if losses:
        out.update(first_loss=sum(losses[:5]) / len(losses[:5]), last_loss=sum(losses[-5:]) / len(losses[-5:]))
    if eval_history:
        first, last = eval_history[0], eval_history[-1]
        out["val_pair_accuracy"] = {
            key.split("/")[1]: ((first["step"], first[key]), (last["step"], last[key]))
            for key in first
            if key.startswith("val/") and key.endswith("/pair_accuracy")
        }
    return out
