"""Sequence packing: whole sequences concatenated into token-budget micro-batches.

A padded batch spends compute on every position up to `seq_length`; RL responses are
long-tailed, so most of it is padding. Here a data-parallel rank's sequences are packed
into rows of at most `max_tokens` tokens (`PackedMicroBatch`): one `[1, T]` row with
`cu_seqlens`, run by Megatron as THD (`PackedSeqParams`): rotary positions restart at
every sequence and attention never crosses a boundary (Transformer Engine's attention, or
`models.sdpa_attention` without it). Model outputs come back as the sequences' `[k, s]` rows
(`as_rows`), so the losses, their exact mini-batch denominators and every per-token field
are the padded path's, unchanged.

Placement (`Microbatching`): sequences go to DP ranks in equal numbers with the token
load balanced (longest first, to the least-loaded rank with room; every rank computes the
same split from the lengths it holds), then to micro-batches, as few as fit with their loads balanced. Every
DP rank runs the same number of micro-batches (expert-parallel all-to-alls and pipeline
schedules pair them up), the short ones padded with empty micro-batches whose loss is 0.
A packed row is padded only to the layout's multiple (TP under sequence parallelism). Under
PP every micro-batch keeps its own length too: the runner turns on Megatron-Core's
`variable_seq_lengths`, so the stages exchange each activation's shape before it. The
interleaved schedule (VPP) is the exception: every row of a call is padded to the longest
(`uniform_length`): with shapes exchanged, Megatron-Core 0.16.1's interleaved schedule
deadlocked at PP2 x VPP2 on gloo (measured). Its shape exchange posts the receives from
the previous and the next stage in one fixed order, and at PP=2 both are the same peer, so
a forward shape can meet a backward receive.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence, Union

import torch

from megatron_rl.schedules.batch import TrainBatch

Tensor = torch.Tensor

__all__ = ["PackedMicroBatch", "Microbatching", "balanced_partition", "first_fit_decreasing", "balanced_bins"]


@dataclass(frozen=True)
class PackedMicroBatch:
    """Whole sequences of one DP rank in one row of `padded_length` tokens."""

    row_batch: TrainBatch
    """[k, s] the sequences as rows (s = the longest of them): what the losses read."""
    padded_length: int
    """T >= the sequences' slots; the tail is one padding segment of its own."""
    sequence_multiple: int = 1
    """Each sequence takes a slot of its length rounded up to this (2·CP under context
    parallelism, whose split cuts every sequence into 2·CP chunks); padding ends the slot."""

    def __post_init__(self) -> None:
        if self.padded_length < max(sum(self._slots), 1):
            raise ValueError(f"padded_length={self.padded_length} < the {sum(self._slots)} positions of its sequences")

    @property
    def num_rows(self) -> int:
        return self.row_batch.num_rows

    @cached_property
    def num_tokens(self) -> int:
        return int(self._lengths.sum())

    @cached_property
    def _lengths(self) -> Tensor:
        """[k] int64 on the CPU: each sequence's real tokens (read once: it syncs a device)."""
        return self.row_batch.sequence_lengths().cpu()

    @property
    def cu_seqlens(self) -> Tensor:
        """[k + 1] int32 (+1 when there is padding): offsets of the sequences in the row."""
        return self._cu_seqlens.to(self.row_batch.tokens.device)

    @cached_property
    def _slots(self) -> list[int]:
        """Each sequence's positions in the row: its length rounded up to `sequence_multiple`."""
        return [_round_up(n, self.sequence_multiple) for n in self._lengths.tolist()]

    def segment_lengths(self) -> list[int]:
        """The row's segments in order: every sequence's slot, then the tail's padding (if any)."""
        tail = self.padded_length - sum(self._slots)
        return self._slots + ([tail] if tail else [])

    @cached_property
    def _cu_seqlens(self) -> Tensor:
        return torch.tensor([0, *self.segment_lengths()], dtype=torch.int32).cumsum(0, dtype=torch.int32)

    @cached_property
    def max_seqlen(self) -> int:
        return int((self._cu_seqlens[1:] - self._cu_seqlens[:-1]).max())

    @property
    def tokens(self) -> Tensor:
        return self.pack(self.row_batch.tokens, fill=0)

    @property
    def labels(self) -> Tensor:
        """Packed row shifted left; at a sequence's last token it reads the next sequence's
        first, which no loss sees (loss_mask is 0 there)."""
        tokens = self.tokens
        return torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)

    @property
    def position_ids(self) -> Tensor:
        """[1, T]: 0 .. len-1 within every sequence (RoPE ignores it: it reads cu_seqlens)."""
        cu = self._cu_seqlens
        starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
        positions = (torch.arange(self.padded_length) - starts)[None].long()
        return positions.to(self.row_batch.tokens.device)

    @property
    def temperature(self) -> Optional[Tensor]:
        t = self.row_batch.temperature
        return None if t is None else self.pack(t, fill=1.0)

    @property
    def routes(self) -> Optional[Tensor]:
        r = self.row_batch.routes
        return None if r is None else self.pack(r, fill=-1)

    def pack(self, x: Tensor, fill: Union[int, float]) -> Tensor:
        """[k, s, ...] rows -> [1, T, ...]: each sequence's real positions, then `fill`."""
        flat = x.reshape(-1, *x.shape[2:]).index_select(0, self._flat_index(x.device))
        out = x.new_full((self.padded_length, *x.shape[2:]), fill)
        out[self._row_positions.to(x.device)] = flat
        return out[None]

    def as_rows(self, y: Tensor) -> Tensor:
        """[1, T, ...] model output -> [k, s, ...] rows, 0 beyond each sequence (differentiable)."""
        k, s = self.row_batch.num_rows, self.row_batch.seq_length
        index = self._flat_index(y.device)
        rows = y.new_zeros((k * s, *y.shape[2:]))
        rows = rows.index_copy(0, index, y[0].index_select(0, self._row_positions.to(y.device)))
        return rows.reshape(k, s, *y.shape[2:])

    def to(self, device: torch.device) -> "PackedMicroBatch":
        return dataclasses.replace(self, row_batch=self.row_batch.to(device))

    def _flat_index(self, device) -> Tensor:
        return self._cpu_flat_index.to(device)

    @cached_property
    def _row_positions(self) -> Tensor:
        """Position in the packed row of each real token, in packed order (slots may end in padding)."""
        lengths = self._lengths
        slot_starts = torch.tensor([0, *self._slots], dtype=torch.long).cumsum(0)[:-1]
        token_starts = torch.cumsum(lengths, 0) - lengths
        within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(token_starts, lengths)
        return torch.repeat_interleave(slot_starts, lengths) + within

    @cached_property
    def _cpu_flat_index(self) -> Tensor:
        """Positions of the real tokens in the flattened [k·s] rows, in packed order."""
        s, lengths = self.row_batch.seq_length, self._lengths
        row_of = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths)
        return row_of * s + within


def balanced_partition(costs: Sequence[float], parts: int) -> list[list[int]]:
    """`len(costs) / parts` indices per part, the summed costs balanced: longest first, each
    to the least-loaded part that still has room (deterministic: ties go to the lower index)."""
    if len(costs) % parts:
        raise ValueError(f"{len(costs)} sequences do not split evenly over {parts} ranks")
    room = len(costs) // parts
    loads, members = [0.0] * parts, [[] for _ in range(parts)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        part = min((p for p in range(parts) if len(members[p]) < room), key=lambda p: (loads[p], p))
        loads[part] += costs[i]
        members[part].append(i)
    return [sorted(m) for m in members]


def first_fit_decreasing(lengths: Sequence[int], indices: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of `indices` whose lengths sum to <= capacity, longest first into the first bin
    with room; a sequence longer than the capacity is refused."""
    bins: list[list[int]] = []
    used: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        if lengths[i] > capacity:
            raise ValueError(f"a sequence of {lengths[i]} tokens does not fit max_tokens_per_micro_batch={capacity}")
        slot = next((b for b, u in enumerate(used) if u + lengths[i] <= capacity), None)
        if slot is None:
            bins.append([])
            used.append(0)
            slot = len(bins) - 1
        bins[slot].append(i)
        used[slot] += lengths[i]
    return bins


def balanced_bins(lengths: Sequence[int], indices: Sequence[int], capacity: int) -> list[list[int]]:
    """As few bins as fit (at most first-fit-decreasing's count), their loads balanced:
    longest first into the least-loaded bin. Even bins matter under pipeline parallelism,
    where every row of a call is padded to the longest, and they balance attention cost."""
    greedy = first_fit_decreasing(lengths, indices, capacity)  # refuses a too-long sequence
    total = sum(lengths[i] for i in indices)
    for count in range(max(1, -(-total // capacity)), len(greedy) + 1):
        bins, loads = [[] for _ in range(count)], [0] * count
        for i in sorted(indices, key=lambda i: (-lengths[i], i)):
            slot = min(range(count), key=lambda b: (loads[b], b))
            bins[slot].append(i)
            loads[slot] += lengths[i]
        if max(loads) <= capacity:
            return bins
    return greedy


@dataclass(frozen=True)
class Microbatching:
    """How a mini-batch becomes each DP rank's micro-batches.

    `max_tokens` None: contiguous DP slices of padded rows, `micro_batch_size` rows each
    (the padded path). Else packed micro-batches of at most `max_tokens` tokens, each
    padded to `multiple`, and under `uniform_length` (the interleaved pipeline schedule)
    to the call's longest.
    """

    micro_batch_size: int = 1
    max_tokens: Optional[int] = None
    multiple: int = 1
    uniform_length: bool = False
    sequence_multiple: int = 1
    """Packed: each sequence's slot in a row is its length rounded up to this (context
    parallelism splits every sequence into 2·CP chunks; see `for_layout`)."""
    group_size: int = 1
    """Consecutive rows of a batch that stay together, in order, in one micro-batch of one
    DP rank: a preference pair's chosen and rejected rows (2), whose loss reads both. The
    DP split and the packing then place groups, weighed by their summed lengths."""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={self.micro_batch_size} must be >= 1")
        if self.group_size < 1 or self.micro_batch_size % self.group_size:
            raise ValueError(
                f"micro_batch_size={self.micro_batch_size} rows must be a multiple of group_size={self.group_size}"
            )
        if self.max_tokens is not None and (self.max_tokens < 1 or self.max_tokens % self.multiple):
            raise ValueError(
                f"max_tokens_per_micro_batch={self.max_tokens} must be a positive "
                f"multiple of {self.multiple} (the layout's sequence multiple)"
            )

    @property
    def packed(self) -> bool:
        return self.max_tokens is not None

    def for_layout(self, multiple: int, interleaved: bool, cp_size: int = 1) -> "Microbatching":
        """This placement as a layout runs it: packed rows a multiple of `multiple` (TP under
        sequence parallelism), one row length per call under the interleaved pipeline
        schedule, and under context parallelism every sequence in a slot of a multiple of
        2·CP·`multiple` (each CP rank's local row is then again a multiple of `multiple`).
        The runner and the trainer's packing metrics both ask here."""
        slot = 2 * cp_size * multiple if cp_size > 1 else 1
        return dataclasses.replace(
            self,
            multiple=math.lcm(self.multiple, multiple, slot),
            uniform_length=interleaved,
            sequence_multiple=math.lcm(self.sequence_multiple, slot),
        )

    def dp_split(self, batch: TrainBatch, dp_size: int) -> list[Tensor]:
        """Every DP rank's rows of `batch` ([N / dp_size] int64 each, ascending). Packed: the
        token load balanced over ranks; else contiguous slices. Computed once per call site:
        the balanced split is O(N x dp_size)."""
        if batch.num_rows % (dp_size * self.group_size):
            raise ValueError(
                f"mini-batch of {batch.num_rows} rows does not split over "
                f"data_parallel_size={dp_size}"
                + (f" in groups of {self.group_size}" if self.group_size > 1 else "")
                + "; use a multiple of it"
            )
        if not self.packed:
            return list(torch.arange(batch.num_rows).reshape(dp_size, -1))
        parts = balanced_partition(self._group_costs(batch.sequence_lengths().tolist()), dp_size)
        return [torch.tensor(self._group_rows(sorted(p)), dtype=torch.long) for p in parts]

    def rank_rows(self, batch: TrainBatch, dp_rank: int, dp_size: int) -> Tensor:
        """[N / dp_size] int64: the rows of `batch` DP rank `dp_rank` trains on, ascending."""
        return self.dp_split(batch, dp_size)[dp_rank]

    def gather_order(self, batch: TrainBatch, dp_size: int) -> Tensor:
        """[N]: the row of `batch` at each position of the DP ranks' outputs concatenated."""
        return torch.cat(self.dp_split(batch, dp_size))

    def bins(self, local: TrainBatch) -> list[list[int]]:
        """This rank's micro-batches as lists of local row indices (before DP agreement)."""
        if not self.packed:
            if local.num_rows % self.micro_batch_size:
                raise ValueError(
                    f"micro_batch_size={self.micro_batch_size} must divide this rank's {local.num_rows} rows"
                )
            return [list(range(i, i + self.micro_batch_size)) for i in range(0, local.num_rows, self.micro_batch_size)]
        if local.num_rows % self.group_size:
            raise ValueError(f"this rank's {local.num_rows} rows are not whole groups of {self.group_size}")
        costs = self._group_costs(self._slot_lengths(local))
        return [self._group_rows(b) for b in balanced_bins(costs, range(len(costs)), self.max_tokens)]

    def row_lengths(self, local: TrainBatch, bins: list[list[int]]) -> list[int]:
        """Each bin's packed row: its tokens rounded up to the multiple (an empty bin: one
        multiple; under `uniform_length` every row is padded to their maximum)."""
        lengths = self._slot_lengths(local)
        rows = [_round_up(max(sum(lengths[i] for i in b), 1), self.multiple) for b in bins]
        return [max(rows)] * len(rows) if self.uniform_length and rows else rows

    def micro_batches(
        self, local: TrainBatch, bins: list[list[int]], count: int, length: Optional[int] = None
    ) -> list[Union[TrainBatch, PackedMicroBatch]]:
        """The bins as micro-batches, padded with empty ones to `count` (packed only);
        `length` (uniform_length): the row length all DP ranks agreed on."""
        if not self.packed:
            return [local.select(torch.tensor(b, dtype=torch.long)) for b in bins]
        bins = bins + [[] for _ in range(count - len(bins))]
        return [self._packed(local, b, length) for b in bins]

    def cost(self, batch: TrainBatch, dp_size: int) -> dict:
        """What one pass over `batch` computes, without running it (the runner's placement,
        given `for_layout`): real and computed tokens (padding included) over all DP ranks,
        micro-batches per rank, the largest micro-batch in tokens."""
        locals_ = [batch.select(rows) for rows in self.dp_split(batch, dp_size)]
        bins = [self.bins(local) for local in locals_]
        count = max(len(b) for b in bins)
        if not self.packed:
            sizes = [self.micro_batch_size * batch.seq_length] * count
            return {
                "real_tokens": int(batch.sequence_lengths().sum()),
                "computed_tokens": dp_size * sum(sizes),
                "micro_batches": count,
                "tokens_per_micro_batch_max": max(sizes),
            }
        rows = [self.row_lengths(local, b + [[]] * (count - len(b))) for local, b in zip(locals_, bins)]
        longest = max(max(r) for r in rows)
        sizes = [longest if self.uniform_length else n for r in rows for n in r]
        return {
            "real_tokens": int(batch.sequence_lengths().sum()),
            "computed_tokens": sum(sizes),
            "micro_batches": count,
            "tokens_per_micro_batch_max": max(sizes),
        }

    def _packed(self, local: TrainBatch, rows: list[int], length: Optional[int]) -> PackedMicroBatch:
        chosen = local.select(torch.tensor(rows, dtype=torch.long))
        longest = int(chosen.sequence_lengths().max()) if rows else 1
        padded = length if length is not None else self.row_lengths(local, [rows])[0]
        return PackedMicroBatch(chosen.columns(longest), padded, self.sequence_multiple)

    def _group_costs(self, lengths: list[int]) -> list[int]:
        """Each group's summed length (each row's own without groups)."""
        k = self.group_size
        return [sum(lengths[i : i + k]) for i in range(0, len(lengths), k)]

    def _group_rows(self, groups: Sequence[int]) -> list[int]:
        """The rows of ``groups``, each group's in order."""
        k = self.group_size
        return [g * k + j for g in groups for j in range(k)]

    def _slot_lengths(self, local: TrainBatch) -> list[int]:
        """Each row's positions once packed: its length rounded up to `sequence_multiple`."""
        return [_round_up(n, self.sequence_multiple) for n in local.sequence_lengths().tolist()]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
