"""Megatron's load-balanced context-parallel split of a row's positions, as index tensors.

A sequence of n positions (n a multiple of 2·CP) is cut into 2·CP equal chunks; CP rank r
holds chunk r and chunk 2·CP−1−r, so every rank gets the same causal-attention work. A row
is one or more such sequences (a padded row is one; a packed THD row several, each split on
its own, the local row being the sequences' local parts in order). The schedules split
tokens with these indices and the CP attention puts gathered keys and values back in row
order with them: both sides must agree, so they share this module. Pure torch, no groups.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from megatron_rl.parallel.config import sequence_multiple

Tensor = torch.Tensor

__all__ = ["gather_source", "local_positions", "row_order", "sequence_multiple"]


def local_positions(segment_lengths: Sequence[int], cp_size: int, cp_rank: int) -> Tensor:
    """[Σ n / CP] int64: the row positions CP rank `cp_rank` holds, in its local order.

    `segment_lengths` are the row's sequences in order (one entry for a padded row), each a
    multiple of 2·CP: chunk `cp_rank` and chunk 2·CP−1−`cp_rank` of each, sequence by sequence.
    """
    parts, start = [], 0
    for n in segment_lengths:
        if n % (2 * cp_size):
            raise ValueError(f"a sequence of {n} positions does not split into 2·CP = {2 * cp_size} chunks")
        chunk = n // (2 * cp_size)
        for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
        start += n
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def row_order(segment_lengths: Sequence[int], cp_size: int) -> Tensor:
    """[Σ n] int64: the row position of every entry of the CP ranks' local rows concatenated
    in rank order (what an all-gather over the CP group returns)."""
    return torch.cat([local_positions(segment_lengths, cp_size, r) for r in range(cp_size)])


@functools.lru_cache(maxsize=64)
def gather_source(segment_lengths: tuple[int, ...], cp_size: int) -> Tensor:
    """[Σ n] int64: for each row position, its entry in the CP ranks' local rows gathered in
    rank order; ``gathered.index_select(dim, gather_source(...))`` is the row in order.

    Both sides of CP read it, the attention of every layer and the loss side of every
    micro-batch, for the same few row layouts: it is computed once per layout (read-only: do
    not write into the returned tensor)."""
    return row_order(segment_lengths, cp_size).argsort()
