"""How one export stream moves the pieces of the global plan: units batched into groups (a
decoder layer, or one unit), each owner's pieces of a group packed into its slice of one
receive buffer, and each received piece copied straight into the HF tensors it belongs to;
and the weight sync's bucketing rule (:func:`pack_buckets`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.bridge.export_plan import ExportPlan, Part, PieceKey, Unit
from megatron_rl.bridge.layer_names import megatron_layer_index
from megatron_rl.bridge.mapping import BridgeError, TensorMap
from megatron_rl.utils.alignment import CACHE_LINE_ALIGN, align_up


@dataclasses.dataclass
class GatherBuffers:
    """The reusable buffers of one gather."""

    recv: dict[torch.dtype, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Receive buffer per dtype (:meth:`GatherPlan.fill`)."""
    arena: Optional[torch.Tensor] = None
    """This rank's own bucket buffer (:func:`megatron_rl.bridge.export.iter_hf_buckets` without a shared arena)."""
    shared_arena: Optional[torch.Tensor] = None
    """The bucket buffer every rank of this host maps (:mod:`megatron_rl.bridge.host_arena`)."""

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer held."""
        return [*self.recv.values(), *(t for t in (self.arena, self.shared_arena) if t is not None)]

    def clear(self) -> None:
        """Let go of every buffer."""
        self.recv.clear()
        self.arena = self.shared_arena = None


@dataclasses.dataclass(frozen=True)
class _Copy:
    """Rows of one owner's piece that land in one HF tensor: out[hf][dst] = piece[src]."""

    hf: str
    dst: tuple
    owner: int
    start: int
    """Element offset of the piece in the group's receive buffer."""
    local: PieceKey
    shape: tuple[int, ...]
    src: tuple


class HFTensor(NamedTuple):
    """An HF tensor a group makes."""

    name: str
    shape: tuple[int, ...]


class Segment(NamedTuple):
    """One owner's slice of a group's receive buffer."""

    owner: int
    start: int
    """Element offset in the buffer."""
    numel: int
    parts: tuple[Part, ...]
    """In packing order."""


@dataclasses.dataclass(frozen=True)
class Group:
    """Units moved together: one broadcast per owner (a decoder layer, or one unit)."""

    dtype: torch.dtype
    hf: tuple[HFTensor, ...]
    segments: tuple[Segment, ...]
    """Owners ascending."""
    numel: int
    copies: tuple[_Copy, ...]


class Placed(NamedTuple):
    """Where one HF tensor lies in the bucket buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    """Byte offset from the bucket start."""
    nbytes: int


class BucketEntry(NamedTuple):
    """One group of a bucket and where its HF tensors lie."""

    group: Group
    placed: tuple[Placed, ...]


Bucket = tuple[BucketEntry, ...]


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """The groups of a stream packed into buckets, and the largest bucket's size."""

    buckets: tuple[Bucket, ...]
    nbytes: int


@dataclasses.dataclass(frozen=True)
class SharedBucket:
    """One bucket's views into the shared arena, valid while the arena and the local pieces are."""

    arena: torch.Tensor
    local: dict[PieceKey, torch.Tensor]
    items: list[tuple[str, torch.Tensor]]
    """The bucket's HF tensors."""
    writes: list[tuple[torch.Tensor, torch.Tensor]]
    """(destination, source) of this rank's copies."""


class GatherPlan:
    """Precomputed collectives and copies: each received piece goes straight into the HF
    tensors it belongs to (no full Megatron tensors in between)."""

    def __init__(self, groups: tuple[Group, ...], rank: int, world: int):
        self.groups = groups
        self.rank = rank
        self.world = world
        self.same_host = False
        """All ranks share this host's memory: buckets go through a shared arena."""
        self.shared_views: dict[int, SharedBucket] = {}
        """By ``id`` of the bucket (:func:`megatron_rl.bridge.export.iter_hf_buckets`)."""
        self._layouts: dict[tuple[int, Optional[torch.dtype]], BucketLayout] = {}

    @classmethod
    def build(cls, plan: ExportPlan, by_layer: bool, rank: int, world: int) -> "GatherPlan":
        batches: list[list[Unit]] = []
        last_key = None
        for unit in plan.units:
            key = (megatron_layer_index(unit.megatron[0]), unit.dtype)
            if by_layer and batches and key == last_key and key[0] is not None:
                batches[-1].append(unit)
            else:
                batches.append([unit])
            last_key = key
        return cls(tuple(_group(units, plan.tmap) for units in batches), rank, world)

    def fill(
        self, group: Group, out: dict[str, torch.Tensor], local: dict[PieceKey, torch.Tensor], buffers: GatherBuffers
    ) -> None:
        """Gather ``group`` into the HF tensors ``out`` (collective)."""
        if self.world == 1:
            for c in group.copies:
                out[c.hf][c.dst].copy_(local[c.local][c.src])
            return
        device = next(iter(out.values())).device
        flat = buffers.recv.get(group.dtype)
        if flat is None or flat.numel() < group.numel or flat.device != device:
            flat = torch.empty(max(group.numel, self._max_numel(group.dtype)), dtype=group.dtype, device=device)
            buffers.recv[group.dtype] = flat
        for owner, start, numel, parts in group.segments:
            segment = flat[start : start + numel]
            if owner == self.rank:
                views = [local[m, offsets].reshape(-1) for m, offsets, _ in parts]
                if len(views) == 1:
                    segment.copy_(views[0])
                else:
                    torch.cat(views, out=segment)
            dist.broadcast(segment, src=owner)
        for c in group.copies:
            piece = flat[c.start : c.start + math.prod(c.shape)].view(c.shape)
            out[c.hf][c.dst].copy_(piece[c.src])

    def _max_numel(self, dtype: torch.dtype) -> int:
        return max((g.numel for g in self.groups if g.dtype == dtype), default=0)

    def bucket_layout(self, bucket_bytes: int, dtype: Optional[torch.dtype]) -> BucketLayout:
        """Groups packed into buckets of at most ``bucket_bytes`` (or one group, if larger)."""
        key = (bucket_bytes, dtype)
        if key not in self._layouts:
            self._layouts[key] = self._bucket_layout(bucket_bytes, dtype)
        return self._layouts[key]

    def _bucket_layout(self, bucket_bytes: int, dtype: Optional[torch.dtype]) -> BucketLayout:
        hf_bytes = [[math.prod(shape) * (dtype or g.dtype).itemsize for _, shape in g.hf] for g in self.groups]
        packing = pack_buckets(hf_bytes, bucket_bytes)
        buckets = []
        for bucket in packing.buckets:
            entries = []
            for index, offsets in bucket:
                group, dt = self.groups[index], dtype or self.groups[index].dtype
                hf = zip(group.hf, offsets, hf_bytes[index])
                entries.append(BucketEntry(group, tuple(Placed(h, shape, dt, o, n) for (h, shape), o, n in hf)))
            buckets.append(tuple(entries))
        return BucketLayout(tuple(buckets), packing.largest)


class PackedGroup(NamedTuple):
    """One group's place in a bucket."""

    index: int
    """The group's position in the stream."""
    offsets: list[int]
    """Byte offset of each of its tensors from the bucket start."""


class Packing(NamedTuple):
    """Groups packed into buckets, and the largest bucket's size in bytes."""

    buckets: list[list[PackedGroup]]
    largest: int


def pack_buckets(groups: Sequence[Sequence[int]], bucket_bytes: int) -> Packing:
    """The weight sync's bucketing rule, over the byte sizes of each group's tensors.

    Groups stay whole and in order (a group is a decoder layer or one unit: a consumer may
    need a whole layer at once); a bucket closes before the group that would take it past
    ``bucket_bytes``, so a larger group makes a bucket of its own. Each tensor starts at a
    multiple of :data:`CACHE_LINE_ALIGN`.
    """
    buckets: list[list[PackedGroup]] = []
    current: list[PackedGroup] = []
    size = largest = 0
    for index, sizes in enumerate(groups):
        if current and size + sum(align_up(n, CACHE_LINE_ALIGN) for n in sizes) > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        offsets = []
        for n in sizes:
            offsets.append(size)
            size += align_up(n, CACHE_LINE_ALIGN)
        current.append(PackedGroup(index, offsets))
        largest = max(largest, size)
    if current:
        buckets.append(current)
    return Packing(buckets, largest)


def _group(units: Sequence[Unit], tmap: TensorMap) -> Group:
    by_owner: dict[int, list[Part]] = {}
    for unit in units:
        for source in unit.sources:
            by_owner.setdefault(source.owner, []).extend(source.parts)
    segments, copies, start = [], [], 0
    for owner in sorted(by_owner):
        parts = tuple(by_owner[owner])
        numel = sum(math.prod(part.shape) for part in parts)
        cursor = start
        for part in parts:
            copies.extend(_copies_of_piece(tmap, part, owner, cursor))
            cursor += math.prod(part.shape)
        segments.append(Segment(owner, start, numel, parts))
        start += numel
    hf = tuple(HFTensor(h, tuple(tmap.hf_shapes[h])) for unit in units for h in unit.hf)
    covered: dict[str, int] = {}
    for c in copies:
        covered[c.hf] = covered.get(c.hf, 0) + math.prod(_extent(c.dst, tmap.hf_shapes[c.hf]))
    for h, shape in hf:
        if covered.get(h, 0) != math.prod(shape):
            raise BridgeError(f"the export plan covers {covered.get(h, 0)} of {math.prod(shape)} elements of {h}")
    return Group(units[0].dtype, hf, tuple(segments), start, tuple(copies))


def _copies_of_piece(tmap: TensorMap, part: Part, owner: int, start: int) -> list[_Copy]:
    """Where the rows of one owner's piece go in the HF tensors."""
    m, offsets, shape = part
    out = []
    first, count = offsets[0], shape[0]
    rest_dst = tuple(slice(o, o + n) for o, n in zip(offsets[1:], shape[1:]))
    for p in tmap.pieces_of_megatron[m]:
        a, b = max(first, p.rows[0]), min(first + count, p.rows[1])
        if a >= b:
            continue
        hf_a = p.hf_rows[0] + a - p.rows[0]
        dst = (*p.hf_lead, slice(hf_a, hf_a + b - a), *rest_dst)
        out.append(_Copy(p.hf, dst, owner, start, (m, tuple(offsets)), tuple(shape), (slice(a - first, b - first),)))
    return out


def _extent(index: tuple, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape selected by ``index`` (ints and slices) in a tensor of ``shape``."""
    dims = []
    for i, size in enumerate(shape):
        if i >= len(index):
            dims.append(size)
        elif isinstance(index[i], slice):
            dims.append(len(range(*index[i].indices(size))))
    return tuple(dims)
