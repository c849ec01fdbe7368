"""Supervised fine-tuning's loss on one micro-batch, and its batch of conversations.

A conversation is one row: its token ids and, per token, whether the loss reads it (the
assistant's tokens, data.chat). In the prediction-aligned layout (schedules.batch) the
mask moves one position left: position t predicts token t + 1. The loss is the mean
negative log-likelihood over every masked token of the mini-batch (token-mean: a long
answer weighs as its tokens do, as SFT trainers usually do); the token count is summed
over DP first (the runner's contract, schedules.runner), so each micro-batch returns its
exact share.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.schedules.batch import TrainBatch
from megatron_rl.schedules.objectives import LossOutput, Norms
from megatron_rl.schedules.vocab_parallel import vocab_parallel_logprobs

Tensor = torch.Tensor

__all__ = ["TokenNLLLoss", "chat_batch", "masked_mean_nll"]


def chat_batch(rows: Sequence[tuple[Sequence[int], Sequence[bool]]], seq_length: int, pad_token_id: int) -> TrainBatch:
    """[N, S] conversations (ids, per-token loss mask), right-padded, prediction-aligned:
    loss_mask[n, t] says whether token t + 1 of row n is learned."""
    tokens = torch.full((len(rows), seq_length), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), seq_length), dtype=torch.bool)
    for n, (ids, mask) in enumerate(rows):
        if not 1 < len(ids) <= seq_length or len(mask) != len(ids):
            raise ValueError(f"row {n}: {len(ids)} tokens with {len(mask)} mask entries; need 2..{seq_length}")
        tokens[n, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
        loss_mask[n, : len(ids) - 1] = torch.tensor(list(mask[1:]), dtype=torch.bool)
    lengths = torch.tensor([len(ids) for ids, _ in rows], dtype=torch.long)
    return TrainBatch(tokens=tokens, loss_mask=loss_mask, lengths=lengths)


def masked_mean_nll(logp: Tensor, mask: Tensor) -> Tensor:
    """The mean of -logp over the masked positions (0 when none is)."""
    mask = mask.bool()
    return -torch.where(mask, logp, 0.0).sum() / mask.sum().clamp_min(1)


class TokenNLLLoss:
    """Mean over the mini-batch's learned tokens of -log p(token), on vocab-parallel logits."""

    prefix = "train"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def required_fields(self) -> tuple[str, ...]:
        return ("lengths",)

    def metric_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ("loss",), ()

    def local_norms(self, batch: TrainBatch) -> dict[str, Tensor]:
        return {"tokens": batch.loss_mask.bool().sum()}

    def __call__(self, logits: Tensor, mb, norms: Norms, tp_group: Optional[dist.ProcessGroup] = None) -> LossOutput:
        """logits: [b, s, V/tp] this TP rank's vocabulary shard; ``mb`` a TrainBatch, a packed
        micro-batch or a context shard, whose logprobs are read back as its rows."""
        logp, _ = vocab_parallel_logprobs(logits, mb.labels, self.vocab_size, tp_group)
        return self.objective(mb.as_rows(logp), mb.row_batch, norms)

    def objective(self, logp: Tensor, mb: TrainBatch, norms: Norms) -> LossOutput:
        """This micro-batch's share of the mini-batch loss (norms None: it is the whole mini-batch)."""
        mask = mb.loss_mask.bool()
        tokens = norms["tokens"] if norms is not None else mask.sum().clamp_min(1)
        loss = -torch.where(mask, logp, 0.0).sum() / tokens.clamp_min(1)
        return LossOutput(loss, {"loss": loss.detach()})
