"""Supervised fine-tuning (``algorithm.recipe=sft``): next-token loss on the assistant's turns.

The model is the actor (the policy an RL run trains), started from the base (model.hf_path
or the task's base), in the layout ``parallel`` names. A step is the supervised loop's
(trainer.supervised): the step's conversations -> one optimizer update on the mean
negative log-likelihood of their assistant tokens (schedules.supervised; the mask is the
chat template's own rendering, data.chat) -> metrics -> ``val/<set>/loss`` when eval is
due -> checkpoint. Its checkpoints are a policy's: exported to HF (``megatron-rl convert
megatron-to-hf``), an RL run starts from one with ``model.hf_path``. Data comes from a
JSONL/Parquet file of ``messages`` rows, or for ``task:<name>`` from files the task writes
into the run directory (tasks.chats) beside its base. Every conversation is read,
checked and encoded before the model is built.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megatron_rl.config import Config, ConfigError
from megatron_rl.config.schema import HELD_OUT
from megatron_rl.data.chat import EncodedChat, encode_chat, read_chats
from megatron_rl.data.sources import DatasetFormatError
from megatron_rl.from_config.sources import base_settings, task_name
from megatron_rl.launch.signals import StopSignals
from megatron_rl.models.hf_config import arch_from_hf
from megatron_rl.schedules.packing import Microbatching
from megatron_rl.schedules.runner import gathered_logprobs
from megatron_rl.schedules.supervised import TokenNLLLoss, chat_batch, masked_mean_nll
from megatron_rl.tasks.chats import HELD_OUT_CHATS, TRAIN_CHATS, write_task_chats
from megatron_rl.trainer.supervised import RunInputs, SupervisedTrainer

CHATS_DIR = "chats"
"""Where a ``task:<name>`` run writes its task's conversations, under the run directory."""
ROWS_PER_CALL = 64
"""Conversations per forward-only call of the eval loss (bounds its activations)."""


def chat_files(cfg: Config, run_dir: Path, rank: int) -> tuple[Path, dict[str, Path]]:
    """The training conversations file and each eval set's; for ``task:<name>`` rank 0
    writes the task's conversations into the run directory first."""
    held_out = None
    if task_name(cfg) is None:
        train = Path(cfg.data.source)
    else:
        if rank == 0:
            write_task_chats(base_settings(cfg), run_dir / CHATS_DIR)
        dist.barrier()
        train, held_out = run_dir / CHATS_DIR / TRAIN_CHATS, run_dir / CHATS_DIR / HELD_OUT_CHATS
    sets = {}
    if cfg.eval.enabled:
        sets = {name: held_out if s.source == HELD_OUT else Path(s.source) for name, s in cfg.eval.sets.items()}
    return train, sets


def load_chats(path: Path, tokenizer, seq_length: int, where: str) -> list[EncodedChat]:
    """Every conversation of ``path``, read, checked against the chat template and encoded;
    one ConfigError line for a bad file or a conversation longer than ``seq_length``."""
    try:
        encoded = [encode_chat(tokenizer, chat) for chat in read_chats(path)]
    except DatasetFormatError as err:
        raise ConfigError(f"{where}: {err}") from None
    too_long = [len(e.ids) for e in encoded if len(e.ids) > seq_length]
    if too_long:
        raise ConfigError(
            f"{where}: {len(too_long)} of {len(encoded)} conversations are longer than trainer.seq_length="
            f"{seq_length} tokens (the longest: {max(too_long)}); raise trainer.seq_length"
        )
    return encoded


class ChatRecipe:
    """The policy trained on the assistant's turns of conversations; ``val/<set>/loss``."""

    role, freeze_head_bias = "actor", False
    summary_metric = "loss"

    def __init__(self, cfg: Config, inputs: RunInputs):
        self.cfg = cfg
        tokenizer = inputs.tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        train, sets = chat_files(cfg, inputs.run_dir, inputs.rank)
        length = cfg.trainer.seq_length
        self.train = load_chats(train, tokenizer, length, f"data.source={cfg.data.source!r}")
        self.eval_sets = {name: load_chats(p, tokenizer, length, f"eval.sets.{name}") for name, p in sets.items()}
        self.micro = Microbatching(
            micro_batch_size=cfg.trainer.micro_batch_size, max_tokens=cfg.trainer.max_tokens_per_micro_batch
        )
        self.loss = TokenNLLLoss(arch_from_hf(inputs.base_dir).vocab_size)

    def checkpoint_extra(self) -> dict:
        """Nothing: an SFT checkpoint is a policy's, as an RL run's."""
        return {}

    def num_rows(self) -> int:
        return len(self.train)

    def batch(self, indices: list[int]):
        rows = [(self.train[i].ids, self.train[i].mask) for i in indices]
        return chat_batch(rows, self.cfg.trainer.seq_length, self.pad_token_id)

    def evaluate(self, model) -> dict:
        """val/<set>/loss: the mean NLL per assistant token of each eval set."""
        return {f"val/{name}/loss": self.mean_nll(model, chats) for name, chats in self.eval_sets.items()}

    def mean_nll(self, model, chats: list[EncodedChat]) -> float:
        """Mean -log p over the assistant tokens of ``chats``, on every rank. Each call's rows
        are padded to whole micro-batches of every DP rank with copies whose mask is empty."""
        multiple = self.cfg.parallel.dp(dist.get_world_size()) * self.cfg.trainer.micro_batch_size
        total, tokens = 0.0, 0
        for start in range(0, len(chats), ROWS_PER_CALL):
            part = [(c.ids, c.mask) for c in chats[start : start + ROWS_PER_CALL]]
            part += [(part[-1][0], [False] * len(part[-1][0]))] * (-len(part) % multiple)
            batch = chat_batch(part, self.cfg.trainer.seq_length, self.pad_token_id)
            logp, _ = gathered_logprobs(model.chunks, batch, self.micro, self.loss.vocab_size)
            count = int(batch.loss_mask.sum())
            total += float(masked_mean_nll(logp, batch.loss_mask)) * count
            tokens += count
        return total / max(tokens, 1)

    def progress_line(self, total: int):
        """Step, loss and step time, and each eval set's loss when one was measured."""

        def line(r: dict) -> str:
            parts = [f"step {r['step']:>4d}/{total}"]
            if "train/loss" in r:
                parts += [f"loss {r['train/loss']:.4f}", f"{r['timing/step_s']:.1f}s"]
            parts += [f"val/{k.split('/')[1]} {v:.4f}" for k, v in r.items() if k[:4] == "val/" and k.endswith("/loss")]
            return "  ".join(parts)

        return line


def sft_trainer(cfg: Config, stop_signals: StopSignals) -> SupervisedTrainer:
    """The run of ``algorithm.recipe=sft``."""
    return SupervisedTrainer(cfg, stop_signals, ChatRecipe)
