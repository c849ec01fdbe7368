"""Context parallelism in the schedules: each sequence split over the CP ranks, per-token
outputs gathered back before any loss reads them.

The split is Megatron's load-balanced one. A sequence of n tokens (n a multiple of 2·CP) is
cut into 2·CP equal chunks and CP rank r holds chunks r and 2·CP−1−r, so every rank has the
same causal-attention work: the early chunk attends to little, the late one to almost all.
A padded row is one sequence. A packed (THD) row is several: each sequence is padded to a
multiple of 2·CP (times TP under sequence parallelism; `packing.Microbatching.for_layout`)
and split on its own, and the local row is the sequences' local parts in row order. That is
the layout Megatron's rotary embedding (`get_pos_emb_on_this_cp_rank`, and per sequence for
THD) and Transformer Engine's CP attention expect, and the one `models.cp_attention` reads;
the index arithmetic is `parallel.sequence_split`.

Tokens, positions and MoE router-replay routes are split this way (`ContextShard`); the
loss side never is. The model's per-token outputs (logprobs and entropies computed on the
rank's own vocabulary shard, or values) are all-gathered over CP and put back in row order
(`ContextShard.as_rows`), so every CP rank computes the same micro-batch loss from whole
rows, with the same global denominators as CP=1. The gather's backward gives each rank the
gradient of its own tokens only (Megatron's `gather_from_sequence_parallel_region` with
``tensor_parallel_output_grad=False``): the sum over CP that DDP's gradient reduction over
DP×CP performs makes it the whole gradient, and the schedule's CP factor on the loss cancels
DDP's 1/(DP·CP) (see `runner`'s normalisation contract).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Union

import torch
import torch.distributed as dist

from megatron_rl.parallel.sequence_split import gather_source, local_positions
from megatron_rl.schedules.batch import TrainBatch
from megatron_rl.schedules.packing import PackedMicroBatch

Tensor = torch.Tensor

__all__ = ["ContextShard"]


Inner = Union[TrainBatch, PackedMicroBatch]


@dataclass(frozen=True)
class ContextShard:
    """One micro-batch as CP rank `cp_rank` of `cp_size` runs it: the model reads the
    rank's share (`tokens`, `position_ids`, `labels`, `temperature`, `routes`); the losses
    read whole rows (`row_batch`, `as_rows`), as for CP=1."""

    inner: Inner
    cp_group: dist.ProcessGroup

    @property
    def cp_size(self) -> int:
        return self.cp_group.size()

    @cached_property
    def _segments(self) -> tuple[int, ...]:
        if isinstance(self.inner, PackedMicroBatch):
            return tuple(self.inner.segment_lengths())
        return (self.inner.seq_length,)

    @cached_property
    def _local(self) -> Tensor:
        return local_positions(self._segments, self.cp_size, self.cp_group.rank())

    def _split(self, x: Optional[Tensor]) -> Optional[Tensor]:
        return None if x is None else x.index_select(1, self._local.to(x.device))

    @property
    def tokens(self) -> Tensor:
        return self._split(self.inner.tokens)

    @property
    def labels(self) -> Tensor:
        """The whole row's labels, split: a chunk's last label is the next chunk's first token."""
        return self._split(self.inner.labels)

    @property
    def position_ids(self) -> Tensor:
        return self._split(self.inner.position_ids)

    @property
    def temperature(self) -> Optional[Tensor]:
        return self._split(self.inner.temperature)

    @property
    def routes(self) -> Optional[Tensor]:
        return self._split(self.inner.routes)

    @property
    def row_batch(self) -> TrainBatch:
        return self.inner.row_batch

    @property
    def packed(self) -> Optional[PackedMicroBatch]:
        """The THD micro-batch this shard splits (None: padded rows)."""
        return self.inner if isinstance(self.inner, PackedMicroBatch) else None

    def as_rows(self, y: Tensor) -> Tensor:
        """[b, s/CP, ...] per-token output of this rank -> the whole micro-batch's rows
        (differentiable; the backward keeps this rank's own positions, see the module)."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        gathered = gather_from_sequence_parallel_region(
            y.transpose(0, 1).contiguous(), tensor_parallel_output_grad=False, group=self.cp_group
        ).transpose(0, 1)
        source = gather_source(self._segments, self.cp_size).to(y.device)
        return self.inner.as_rows(gathered.index_select(1, source))

    def to(self, device: torch.device) -> "ContextShard":
        return dataclasses.replace(self, inner=self.inner.to(device))
