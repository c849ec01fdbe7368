"""A plain next-token loss in the RL schedules' loss contract, for tests that train a model
through `megatron_rl.schedules` (any layout, context parallelism included) without a recipe."""

from __future__ import annotations

import torch

from megatron_rl.schedules.objectives import LossOutput
from megatron_rl.schedules.vocab_parallel import vocab_parallel_logprobs


class MeanCrossEntropy:
    """The mean cross-entropy of the mini-batch's masked next-token predictions (metric `ce/loss`)."""

    prefix = "ce"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def required_fields(self) -> tuple[str, ...]:
        return ()

    def metric_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ("loss",), ()

    def local_norms(self, batch) -> dict[str, torch.Tensor]:
        return {"tokens": batch.loss_mask.sum()}

    def __call__(self, logits, mb, norms, tp_group) -> LossOutput:
        logp, _ = vocab_parallel_logprobs(logits, mb.labels, self.vocab_size, tp_group, mb.temperature)
        mask = mb.row_batch.loss_mask.bool()
        loss = -torch.where(mask, mb.as_rows(logp), 0.0).sum() / norms["tokens"]
        return LossOutput(loss, {"loss": loss.detach()})


def all_but_last(rows: int, seq: int) -> torch.Tensor:
    """[rows, seq] bool: every position predicts the next token except the last (no label)."""
    mask = torch.ones(rows, seq, dtype=torch.bool)
    mask[:, -1] = False
    return mask
