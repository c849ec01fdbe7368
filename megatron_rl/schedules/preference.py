"""The reward model's Bradley-Terry loss on one micro-batch, as its share of the mini-batch loss.

A preference batch holds each pair as two consecutive rows, chosen then rejected, each a
whole conversation (``lengths`` says where it ends). The reward of a conversation is the
scalar head's value at its last token, which has read all of it. Pairs never straddle
micro-batches or DP ranks: the batch is placed with ``Microbatching(group_size=2)``, so
every micro-batch's rows come in (chosen, rejected) order. The pair count of the whole
mini-batch is summed over DP first (the runner's contract, schedules.runner), so each
micro-batch returns its exact share of the mean over pairs.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.algorithms import bradley_terry_loss, pair_correct
from megatron_rl.schedules.batch import TrainBatch
from megatron_rl.schedules.objectives import LossOutput, Norms
from megatron_rl.schedules.packing import Microbatching
from megatron_rl.schedules.runner import gathered_values

Tensor = torch.Tensor
PAIR = 2
"""Rows per preference pair: chosen, then rejected."""

__all__ = ["PAIR", "PreferenceLoss", "last_token_rewards", "pair_batch", "pair_microbatching", "sequence_rewards"]
ROWS_PER_CALL = 64
"""Conversations per forward-only call of :func:`sequence_rewards` (bounds its activations)."""


def pair_microbatching(pairs_per_micro_batch: int, max_tokens: Optional[int]) -> Microbatching:
    """The placement of a preference batch: whole pairs per micro-batch (padded rows), or
    packed rows of whole pairs under a token budget."""
    return Microbatching(micro_batch_size=PAIR * pairs_per_micro_batch, max_tokens=max_tokens, group_size=PAIR)


def pair_batch(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], seq_length: int, pad_token_id: int) -> TrainBatch:
    """[2P, S] rows of (chosen, rejected) token ids, right-padded, with their lengths (no
    loss_mask: the loss reads one value per row, at its last token)."""
    return row_batch([ids for pair in pairs for ids in pair], seq_length, pad_token_id)


def row_batch(rows: Sequence[Sequence[int]], seq_length: int, pad_token_id: int) -> TrainBatch:
    """[N, S] conversations' token ids, right-padded, with their lengths."""
    tokens = torch.full((len(rows), seq_length), pad_token_id, dtype=torch.long)
    for n, ids in enumerate(rows):
        if not 0 < len(ids) <= seq_length:
            raise ValueError(f"row {n}: {len(ids)} tokens must be non-empty and fit seq_length={seq_length}")
        tokens[n, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
    lengths = torch.tensor([len(ids) for ids in rows], dtype=torch.long)
    return TrainBatch(tokens=tokens, loss_mask=torch.zeros_like(tokens, dtype=torch.bool), lengths=lengths)


def last_token_rewards(values: Tensor, batch: TrainBatch) -> Tensor:
    """[N, S] per-position values -> [N] the value at each row's last real token."""
    last = (batch.sequence_lengths() - 1).to(values.device)
    return values.gather(1, last.unsqueeze(1)).squeeze(1)


def sequence_rewards(
    chunks: list, rows: Sequence[Sequence[int]], seq_length: int, pad_token_id: int, micro: Microbatching, multiple: int
) -> Tensor:
    """[N] the reward model's score of each conversation (its value at the last token), on
    every rank. Each call's rows are padded with copies of its last row to a multiple of
    ``multiple`` (whole micro-batches of every DP rank, whole pairs); the copies are dropped."""
    scores = []
    for start in range(0, len(rows), ROWS_PER_CALL):
        part = list(rows[start : start + ROWS_PER_CALL])
        real = len(part)
        part += [part[-1]] * (-real % multiple)
        batch = row_batch(part, seq_length, pad_token_id)
        scores.append(last_token_rewards(gathered_values(chunks, batch, micro), batch)[:real].cpu())
    return torch.cat(scores) if scores else torch.zeros(0)


class PreferenceLoss:
    """Mean over pairs of -log sigmoid(r_chosen - r_rejected), on the scalar head's [b, s, 1]."""

    prefix = "train"

    def required_fields(self) -> tuple[str, ...]:
        return ("lengths",)

    def metric_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ("loss", "pair_accuracy", "reward_margin"), ()

    def local_norms(self, batch: TrainBatch) -> dict[str, Tensor]:
        if batch.num_rows % PAIR:
            raise ValueError(f"a preference batch holds whole pairs; got {batch.num_rows} rows")
        return {"pairs": torch.tensor(batch.num_rows // PAIR)}

    def __call__(self, output: Tensor, mb, norms: Norms, tp_group: Optional[dist.ProcessGroup] = None) -> LossOutput:
        """output: [b, s, 1] values (replicated over TP); ``mb`` a TrainBatch, a packed
        micro-batch or a context shard, whose whole rows the values are read back as."""
        rows = mb.row_batch
        rewards = last_token_rewards(mb.as_rows(output.squeeze(-1).float()), rows)
        return self.objective(rewards[0::PAIR], rewards[1::PAIR], norms)

    def objective(self, chosen: Tensor, rejected: Tensor, norms: Norms) -> LossOutput:
        """The share of the mini-batch loss from this micro-batch's [p] chosen and rejected
        rewards (norms None: these pairs are the whole mini-batch)."""
        pairs = norms["pairs"] if norms is not None else torch.tensor(max(chosen.numel(), 1))
        loss = bradley_terry_loss(chosen, rejected).sum() / pairs
        with torch.no_grad():
            sums = {
                "loss": loss.detach(),
                "pair_accuracy": pair_correct(chosen, rejected).sum() / pairs,
                "reward_margin": (chosen - rejected).sum() / pairs,
            }
        return LossOutput(loss, sums)
