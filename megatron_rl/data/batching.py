"""Prompt batches, group expansion (each prompt -> G samples) and padding to tensors."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

from megatron_rl.data.prompts import PromptDataset
from megatron_rl.data.sampler import EpochSampler

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """Prompts as token ids (unpadded, what vLLM takes) with their answers.

    ``group_ids[i]`` says which prompt of the original batch row ``i`` came from: all rows
    of one group share it (GRPO-style advantages are computed per group).
    """

    prompt_ids: list[list[int]]
    answers: list[str]
    dataset_indices: list[int]
    epochs: list[int]
    group_ids: list[int]

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def group_size(self) -> int:
        return len(self) // len(set(self.group_ids))

    def expand_groups(self, group_size: int) -> "PromptBatch":
        """Each prompt repeated ``group_size`` times, consecutively: [p0]*G + [p1]*G + ..."""
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")

        def repeat(values: Sequence[Any]) -> list[Any]:
            return [v for v in values for _ in range(group_size)]

        return PromptBatch(
            prompt_ids=[list(ids) for ids in repeat(self.prompt_ids)],
            answers=repeat(self.answers),
            dataset_indices=repeat(self.dataset_indices),
            epochs=repeat(self.epochs),
            group_ids=repeat(self.group_ids),
        )

    def padded(self, pad_id: int, *, side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [B, L], attention_mask [B, L])``; left padding keeps prompts ending together."""
        import torch  # here, so that a config check can read prompt rows without loading torch

        if side not in ("left", "right"):
            raise ValueError(f"side={side!r}; allowed: 'left', 'right'")
        length = max(len(ids) for ids in self.prompt_ids)
        ids = torch.full((len(self), length), pad_id, dtype=torch.long)
        mask = torch.zeros((len(self), length), dtype=torch.long)
        for row, seq in enumerate(self.prompt_ids):
            span = slice(length - len(seq), length) if side == "left" else slice(0, len(seq))
            ids[row, span] = torch.tensor(seq, dtype=torch.long)
            mask[row, span] = 1
        return ids, mask


class PromptLoader:
    """Batches of prompts in a seeded, epoch-by-epoch order; resumable from ``state_dict``.

    Batches run on across epoch boundaries (no prompt is dropped or repeated within an
    epoch); ``epochs`` in each batch says which epoch each prompt belongs to.
    """

    def __init__(self, dataset: PromptDataset, *, batch_size: int, seed: int, shuffle: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = EpochSampler(len(dataset), seed=seed, shuffle=shuffle)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def prompts_drawn(self) -> int:
        """Prompts handed out so far in the whole run (the `data/prompts_drawn` metric)."""
        return self.sampler.drawn

    def next_batch(self) -> PromptBatch:
        picks = self.sampler.take(self.batch_size)
        records = [self.dataset[i] for _, i in picks]
        return PromptBatch(
            prompt_ids=[list(r.prompt_ids) for r in records],
            answers=[r.answer for r in records],
            dataset_indices=[i for _, i in picks],
            epochs=[e for e, _ in picks],
            group_ids=list(range(len(records))),
        )

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
