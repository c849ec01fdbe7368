"""A sharded Megatron model -> full HF-named tensors, streamed (weight sync, HF export).

The global plan (which rank holds which main-replica piece of which tensor, and which
Megatron tensors make up which HF tensors) is computed once per model with one metadata
exchange and kept, together with the collectives and copies derived from it, in an
:class:`ExportPlans` its caller owns (the weight sync keeps one for all its syncs; without
one, each call builds a fresh plan). Each step
then moves one group: a *unit* (the smallest set of Megatron tensors that closes over a
set of HF tensors: a layer's linear_qkv -> q/k/v, one expert's linear_fc1 -> gate/up) for
:func:`iter_hf_tensors`, or a whole decoder layer for :func:`iter_hf_buckets`. Each owner
packs its pieces of the group into its slice of one reusable receive buffer and broadcasts
it; every rank copies each received piece straight into the HF tensors it belongs to (no
full Megatron tensors in between). Peak memory is one group plus the HF tensors handed out.
"""

from __future__ import annotations

import dataclasses
import math
import os
import weakref
from typing import Iterator, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl import platform
from megatron_rl.bridge import host_arena
from megatron_rl.bridge.families import PER_EXPERT, canonical, rules_for
from megatron_rl.bridge.hf_files import TensorSpec, write_checkpoint
from megatron_rl.bridge.layer_names import megatron_layer_index
from megatron_rl.bridge.mapping import BridgeError, TensorMap, expand
from megatron_rl.models.hf_config import ModelArch
from megatron_rl.parallel.shards import local_shards
from megatron_rl.utils import dtypes
from megatron_rl.utils.alignment import CACHE_LINE_ALIGN, align_up

DEFAULT_MAX_FILE_BYTES = 2 * 1024**3

# The records below that the gather reads on every sync are NamedTuples: unpacked like the
# tuples they are, at no cost over plain tuples where it loops over every piece.


class ShardInfo(NamedTuple):
    """One main-replica piece as its rank describes it to the others (pickled: metadata only)."""

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str
    """The torch dtype's name without ``torch.``."""


class Holding(NamedTuple):
    """A piece of one Megatron tensor that one rank holds (orders by rank, then offsets)."""

    rank: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


class Part(NamedTuple):
    """One piece of a Megatron tensor that its owner sends."""

    name: str
    """Canonical Megatron name."""
    offsets: tuple[int, ...]
    """Where the piece starts in the full tensor, per dimension."""
    shape: tuple[int, ...]


PieceKey = tuple[str, tuple[int, ...]]
"""(canonical Megatron name, offsets): how this rank's pieces are looked up."""


class Source(NamedTuple):
    """What one owner sends of a unit."""

    owner: int
    parts: tuple[Part, ...]
    """In packing order."""


@dataclasses.dataclass(frozen=True)
class HFGroup:
    """Megatron tensors whose HF tensors are made of them alone (the unit of memory of every export)."""

    megatron: tuple[str, ...]
    hf: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Unit:
    """An :class:`HFGroup` with who owns which pieces of it."""

    megatron: tuple[str, ...]
    hf: tuple[str, ...]
    sources: tuple[Source, ...]
    """Owners ascending."""
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """The global plan of one model: its tensor map and its units in stream order."""

    tmap: TensorMap
    units: tuple[Unit, ...]

    def hf_specs(self, dtype: Optional[torch.dtype] = None) -> list[TensorSpec]:
        """Every HF tensor, in the order the stream yields them."""
        return [TensorSpec(h, self.tmap.hf_shapes[h], dtype or u.dtype) for u in self.units for h in u.hf]


TRANSPORTS = ("local", "shared_arena", "broadcast")
"""How a bucketed export gathers: one rank copies its own pieces; every rank on one CPU host
writes into a shared arena; otherwise (ranks on several hosts, a GPU, /dev/shm too small,
``MEGATRON_RL_GATHER=broadcast``) one broadcast per decoder layer and owner."""


def _root(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


@dataclasses.dataclass
class GatherBuffers:
    """The reusable buffers of one gather."""

    recv: dict[torch.dtype, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Receive buffer per dtype (:meth:`GatherPlan.fill`)."""
    arena: Optional[torch.Tensor] = None
    """This rank's own bucket buffer (:func:`iter_hf_buckets` without a shared arena)."""
    shared_arena: Optional[torch.Tensor] = None
    """The bucket buffer every rank of this host maps (:mod:`megatron_rl.bridge.host_arena`)."""

    def tensors(self) -> list[torch.Tensor]:
        return [*self.recv.values(), *(t for t in (self.arena, self.shared_arena) if t is not None)]

    def clear(self) -> None:
        self.recv.clear()
        self.arena = self.shared_arena = None


@dataclasses.dataclass
class _LocalPieces:
    """Live views of this rank's main-replica pieces, and the parameter storage they view."""

    storage: list[int]
    """``data_ptr()`` of every parameter, in order, when the views were made."""
    pieces: dict[PieceKey, torch.Tensor]


@dataclasses.dataclass
class _ModelEntries:
    """What :class:`ExportPlans` keeps for one model."""

    plans: dict[tuple[ModelArch, str], ExportPlan] = dataclasses.field(default_factory=dict)
    """By (arch, style)."""
    gathers: dict[tuple[ModelArch, str, bool], "GatherPlan"] = dataclasses.field(default_factory=dict)
    """By (arch, style, by_layer)."""
    buffers: dict[tuple[ModelArch, str], GatherBuffers] = dataclasses.field(default_factory=dict)
    """By (arch, style)."""
    local: Optional[_LocalPieces] = None


class ExportPlans:
    """What exporting a model keeps from one call to the next, per model: the global plan,
    the gather plans derived from it, the views of this rank's pieces and the reusable gather
    buffers. Entries go with their model (weakly keyed on it).

    Building a plan is collective (one metadata exchange), so every rank must use its
    ``ExportPlans`` for the same calls.
    """

    def __init__(self) -> None:
        self._models: "weakref.WeakKeyDictionary[torch.nn.Module, _ModelEntries]" = weakref.WeakKeyDictionary()
        self.transport: Optional[str] = None
        """How the last :func:`iter_hf_buckets` call gathered: one of :data:`TRANSPORTS`."""

    def _of(self, chunks: Sequence[torch.nn.Module]) -> _ModelEntries:
        root = _root(chunks[0])
        entries = self._models.get(root)
        if entries is None:
            entries = self._models[root] = _ModelEntries()
        return entries

    def export_plan(self, chunks: Sequence[torch.nn.Module], arch: ModelArch, style: str = PER_EXPERT) -> ExportPlan:
        """The global plan of this model (collective on first use for this model/style)."""
        plans = self._of(chunks).plans
        if (arch, style) not in plans:
            plans[arch, style] = _build_plan(chunks, arch, style)
        return plans[arch, style]

    def gather_plan(self, chunks, arch: ModelArch, style: str = PER_EXPERT, by_layer: bool = False) -> "GatherPlan":
        """The collectives and copies of one stream (collective on first use)."""
        gathers = self._of(chunks).gathers
        key = (arch, style, by_layer)
        if key not in gathers:
            rank = dist.get_rank() if dist.is_initialized() else 0
            world = dist.get_world_size() if dist.is_initialized() else 1
            plan = GatherPlan.build(self.export_plan(chunks, arch, style), by_layer, rank, world)
            if by_layer and world > 1:  # only the bucketed stream can use a shared arena
                plan.same_host = host_arena.all_ranks_on_this_host()
            gathers[key] = plan
        return gathers[key]

    def buffers(self, chunks, arch: ModelArch, style: str) -> GatherBuffers:
        """Reusable gather buffers of this model (receive buffer, bucket arena)."""
        buffers = self._of(chunks).buffers
        if (arch, style) not in buffers:
            buffers[arch, style] = GatherBuffers()
        return buffers[arch, style]

    def local_pieces(self, chunks) -> dict[PieceKey, torch.Tensor]:
        """Live view of this rank's main-replica pieces by (canonical name, offsets).

        Megatron's ``sharded_state_dict`` costs more than moving a small model's bytes, so
        the views are kept per model and rebuilt only when a parameter's storage moved
        (views of the old storage would export stale weights).
        """
        entries = self._of(chunks)
        storage = [p.data_ptr() for chunk in chunks for p in chunk.parameters()]
        if entries.local is None or entries.local.storage != storage:
            pieces = {
                (canonical(s.name), tuple(s.offsets)): s.data.detach()
                for s in local_shards(chunks)
                if s.is_main_replica
            }
            entries.local = _LocalPieces(storage, pieces)
        return entries.local.pieces

    def release_buffers(self, chunks: Sequence[torch.nn.Module]) -> None:
        """Free the gather buffers kept for this model (:func:`iter_hf_buckets`)."""
        entries = self._of(chunks)
        for buffers in entries.buffers.values():
            buffers.clear()
        for gather in entries.gathers.values():
            gather.shared_views.clear()  # views that hold the shared arena


def _gather_metadata(chunks) -> list[list[ShardInfo]]:
    """Every rank's main-replica pieces."""
    mine = [
        ShardInfo(
            s.name,
            tuple(s.global_shape),
            tuple(s.offsets),
            tuple(s.data.shape),
            str(s.data.dtype).replace("torch.", ""),
        )
        for s in local_shards(chunks)
        if s.is_main_replica
    ]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # once per model: metadata only, never tensor data
    return everyone


def _build_plan(chunks, arch: ModelArch, style: str) -> ExportPlan:
    metadata = _gather_metadata(chunks)
    owners: dict[str, list[Holding]] = {}
    global_shape: dict[str, tuple[int, ...]] = {}
    dtype_of: dict[str, torch.dtype] = {}
    for rank, shards in enumerate(metadata):
        for shard in shards:
            name = canonical(shard.name)
            owners.setdefault(name, []).append(Holding(rank, shard.offsets, shard.shape))
            global_shape[name] = shard.global_shape
            dtype_of[name] = getattr(torch, shard.dtype)
    padded_vocab = global_shape.get("embedding.word_embeddings.weight", (arch.vocab_size,))[0]
    tmap = expand(rules_for(arch.family, style), arch, padded_vocab)
    _check_model(tmap, owners, global_shape, arch)
    units = [_unit(group, owners, dtype_of) for group in hf_groups(tmap)]
    return ExportPlan(tmap=tmap, units=tuple(units))


def _check_model(
    tmap: TensorMap, owners: dict[str, list[Holding]], global_shape: dict[str, tuple[int, ...]], arch: ModelArch
) -> None:
    unmapped = sorted(set(owners) - set(tmap.megatron_shapes))
    absent = sorted(set(tmap.megatron_shapes) - set(owners))
    if unmapped:
        raise BridgeError(f"{arch.family}: Megatron tensors with no HF mapping: {unmapped[:8]}")
    if absent:
        raise BridgeError(f"{arch.family}: the model lacks tensors the HF mapping needs: {absent[:8]}")
    for name, pieces in owners.items():
        if global_shape[name] != tmap.megatron_shapes[name]:
            raise BridgeError(
                f"{arch.family}: Megatron tensor {name} has shape {global_shape[name]}, "
                f"the HF mapping expects {tmap.megatron_shapes[name]}"
            )
        if sum(math.prod(held.shape) for held in pieces) != math.prod(global_shape[name]):
            raise BridgeError(f"main-replica pieces of {name} do not tile it exactly: {pieces}")


def hf_groups(tmap: TensorMap) -> list[HFGroup]:
    """The model's groups in stream order: each group's HF tensors are made of that group's
    Megatron tensors only (the unit of memory of every export)."""
    out = []
    for names in _components(tmap):
        hf: dict[str, None] = {}
        for m in names:
            hf.update((p.hf, None) for p in tmap.pieces_of_megatron[m])
        out.append(HFGroup(megatron=tuple(names), hf=tuple(hf)))
    return out


def _components(tmap: TensorMap) -> list[list[str]]:
    """Megatron names grouped so that each group's HF tensors need only that group."""
    parent = {m: m for m in tmap.megatron_shapes}

    def find(m):
        while parent[m] != m:
            parent[m] = parent[parent[m]]
            m = parent[m]
        return m

    for pieces in tmap.pieces_of_hf.values():
        first = find(pieces[0].megatron)
        for p in pieces[1:]:
            parent[find(p.megatron)] = first
    groups: dict[str, list[str]] = {}
    for m in tmap.megatron_shapes:  # insertion order: deterministic on every rank
        groups.setdefault(find(m), []).append(m)
    position = {m: i for i, m in enumerate(tmap.megatron_shapes)}
    return sorted(groups.values(), key=lambda names: _order_key(names[0], position[names[0]]))


def _order_key(first: str, position: int) -> tuple:
    """Embeddings first, then layer by layer, then the final norm and LM head."""
    layer = megatron_layer_index(first)
    if layer is not None:
        return (1, layer, position)
    return (0 if first.startswith("embedding.") else 2, 0, position)


def _unit(group: HFGroup, owners: dict[str, list[Holding]], dtype_of: dict[str, torch.dtype]) -> Unit:
    dtypes = {dtype_of[m] for m in group.megatron}
    if len(dtypes) != 1:
        raise BridgeError(f"tensors {group.megatron} that form one HF tensor have different dtypes {dtypes}")
    by_rank: dict[int, list[Part]] = {}
    for m in group.megatron:
        for held in sorted(owners[m]):
            by_rank.setdefault(held.rank, []).append(Part(m, held.offsets, held.shape))
    return Unit(
        megatron=group.megatron,
        hf=group.hf,
        sources=tuple(Source(rank, tuple(parts)) for rank, parts in sorted(by_rank.items())),
        dtype=dtypes.pop(),
    )


def _index(offsets, shape) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, shape))


def assemble_hf(h: str, tmap: TensorMap, full: dict[str, torch.Tensor]) -> torch.Tensor:
    """HF tensor ``h`` from the full Megatron tensors of its group."""
    pieces = tmap.pieces_of_hf[h]
    shape = tmap.hf_shapes[h]
    p = pieces[0]
    source = full[p.megatron]
    if len(pieces) == 1 and not p.hf_lead and tuple(source.shape) == shape:
        return source  # the HF tensor is the Megatron tensor (no padding)
    out = torch.empty(shape, dtype=source.dtype, device=source.device)
    for p in pieces:
        out[(*p.hf_lead, slice(*p.hf_rows))] = full[p.megatron][p.rows[0] : p.rows[1]]
    return out


def iter_hf_tensors(
    chunks: Sequence[torch.nn.Module],
    arch: ModelArch,
    dtype: Optional[torch.dtype] = None,
    style: str = PER_EXPERT,
    plans: Optional[ExportPlans] = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the whole model, identical on every rank.

    Collective over the default group: every rank must call it and consume it fully, in
    the same order. ``style`` picks per-expert (``save_pretrained``) or fused expert names.
    ``plans``: the caller's plans to reuse and extend (None: a fresh plan for this call).
    Each tensor is newly allocated (the caller may keep it); extra memory is one unit.
    """
    plans = plans if plans is not None else ExportPlans()
    gather = plans.gather_plan(chunks, arch, style, by_layer=False)
    device = platform.current().device
    local = plans.local_pieces(chunks)
    buffers = GatherBuffers()  # the receive buffer lives as long as this stream
    with torch.no_grad():
        for group in gather.groups:
            out = {h: torch.empty(shape, dtype=dtype or group.dtype, device=device) for h, shape in group.hf}
            gather.fill(group, out, local, buffers)
            yield from out.items()
            del out


def iter_hf_buckets(
    chunks: Sequence[torch.nn.Module],
    arch: ModelArch,
    bucket_bytes: int,
    dtype: Optional[torch.dtype] = None,
    style: str = PER_EXPERT,
    keep_buffers: bool = True,
    plans: Optional[ExportPlans] = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield the model as buckets of (HF name, full tensor) of at most ``bucket_bytes``.

    A bucket ends only between decoder layers (a consumer may need a whole layer at once),
    so a layer larger than ``bucket_bytes`` makes a bucket of its own.
    The tensors are views into one buffer reused for every bucket: valid only until the
    next bucket is requested. Collective like :func:`iter_hf_tensors`, with one broadcast
    per decoder layer and owner instead of one per unit and owner; when every rank is on
    this CPU host, through a shared arena instead (:mod:`megatron_rl.bridge.host_arena`:
    each owner writes its pieces in place, no broadcasts, one bucket per host).
    ``keep_buffers`` keeps the bucket buffer and the receive buffer in ``plans`` for the
    next call (no fresh pages to map then); otherwise they are freed at the end. ``plans``:
    as for :func:`iter_hf_tensors`. Extra memory: one bucket plus one layer.
    """
    plans = plans if plans is not None else ExportPlans()
    gather = plans.gather_plan(chunks, arch, style, by_layer=True)
    layout = gather.bucket_layout(bucket_bytes, dtype)
    buffers = plans.buffers(chunks, arch, style)
    device = platform.current().device
    local = plans.local_pieces(chunks)
    shared = _shared_arena(gather, buffers, layout.nbytes, device)
    plans.transport = "local" if gather.world == 1 else "shared_arena" if shared is not None else "broadcast"
    arena = shared
    if arena is None:
        arena = buffers.arena
        if arena is None or arena.numel() < layout.nbytes or arena.device != torch.device(device):
            arena = buffers.arena = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    try:
        with torch.no_grad():
            for bucket in layout.buckets:
                if shared is not None:
                    views = _shared_bucket(gather, bucket, arena, local)
                    dist.barrier()  # every rank is done reading the previous bucket
                    for dst, src in views.writes:
                        dst.copy_(src)
                    dist.barrier()  # every owner's pieces are in
                    yield views.items
                    continue
                items = []
                for group, placed in bucket:
                    out = _views(arena, placed)
                    gather.fill(group, out, local, buffers)
                    items.extend(out.items())
                yield items
    finally:
        if not keep_buffers:
            buffers.clear()
            gather.shared_views.clear()


def _views(arena: torch.Tensor, placed: tuple[Placed, ...]) -> dict[str, torch.Tensor]:
    """The HF tensors of one group of a bucket layout, as views into the bucket buffer."""
    return {h: arena[o : o + n].view(dt).view(shape) for h, shape, dt, o, n in placed}


def _shared_bucket(
    gather: "GatherPlan", bucket: Bucket, arena: torch.Tensor, local: dict[PieceKey, torch.Tensor]
) -> "_SharedBucket":
    """One bucket's HF items and this rank's copies in the shared arena, built once and
    reused by every later sync (slicing costs more than a small copy)."""
    cached = gather.shared_views.get(id(bucket))
    if cached is None or cached.arena is not arena or cached.local is not local:
        items, writes = [], []
        for group, placed in bucket:
            out = _views(arena, placed)
            writes += [(out[c.hf][c.dst], local[c.local][c.src]) for c in group.copies if c.owner == gather.rank]
            items.extend(out.items())
        cached = gather.shared_views[id(bucket)] = _SharedBucket(arena, local, items, writes)
    return cached


def _shared_arena(gather: "GatherPlan", buffers: GatherBuffers, nbytes: int, device) -> Optional[torch.Tensor]:
    """The host-shared bucket buffer (:mod:`megatron_rl.bridge.host_arena`) when every rank
    is on this CPU host, else None (collective; the same answer on every rank)."""
    if not gather.same_host or torch.device(device).type != "cpu" or host_arena.transport_setting() != "auto":
        return None
    arena = buffers.shared_arena
    if arena is None or arena.numel() < nbytes:
        buffers.shared_arena = None
        gather.shared_views.clear()
        arena = host_arena.open_shared(nbytes, "sync")
        if arena is None:
            gather.same_host = False  # /dev/shm too small: broadcasts from now on
            return None
        buffers.shared_arena = arena
    return arena


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
class _SharedBucket:
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
        self.shared_views: dict[int, _SharedBucket] = {}
        """By ``id`` of the bucket (:func:`_shared_bucket`)."""
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


def config_dtype(hf_config: Optional[dict]) -> Optional[torch.dtype]:
    """The dtype an HF config names (``dtype`` or the older ``torch_dtype``), if any."""
    for key in ("dtype", "torch_dtype"):
        value = (hf_config or {}).get(key)
        if value in dtypes.LONG_NAMES:
            return dtypes.to_torch(value)
    return None


def config_with_dtype(hf_config: dict, dtype: torch.dtype) -> dict:
    """``hf_config`` saying the dtype the tensors are written in."""
    config = dict(hf_config, dtype=dtypes.long_name(dtype))
    config.pop("torch_dtype", None)
    return config


def save_hf(
    chunks: Sequence[torch.nn.Module],
    arch: ModelArch,
    out_dir: str | os.PathLike,
    hf_config: Optional[dict],
    style: str = PER_EXPERT,
    dtype: Optional[torch.dtype] = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    plans: Optional[ExportPlans] = None,
) -> None:
    """Write the model as an HF checkpoint directory (collective; rank 0 writes).

    Tensors are written in ``dtype``, else the dtype named in ``hf_config``, else the
    model's. The directory appears atomically (written under a temporary name, renamed).
    ``plans``: as for :func:`iter_hf_tensors`.
    """
    dtype = dtype or config_dtype(hf_config)
    plans = plans if plans is not None else ExportPlans()
    plan = plans.export_plan(chunks, arch, style)
    specs = plan.hf_specs(dtype)
    rank = dist.get_rank() if dist.is_initialized() else 0
    problem = [None]
    if rank == 0 and os.path.exists(out_dir) and os.listdir(out_dir):
        problem[0] = f"output directory {os.fspath(out_dir)!r} exists and is not empty"
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise FileExistsError(problem[0])
    config = None if hf_config is None else config_with_dtype(hf_config, specs[0].dtype)
    stream = iter_hf_tensors(chunks, arch, dtype, style, plans)
    if rank == 0:
        write_checkpoint(out_dir, specs, stream, config, max_file_bytes)
    else:
        for _ in stream:
            pass
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
