"""A sharded Megatron model -> full HF-named tensors, streamed (weight sync, HF export).

The global plan (:mod:`megatron_rl.bridge.export_plan`: which rank holds which main-replica
piece of which tensor, and which Megatron tensors make up which HF tensors) is computed once
per model with one metadata exchange and kept, together with the collectives and copies
derived from it (:mod:`megatron_rl.bridge.gather_plan`), in an
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
import os
import weakref
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl import platform
from megatron_rl.bridge import host_arena
from megatron_rl.bridge.export_plan import ExportPlan, PieceKey, build_plan
from megatron_rl.bridge.families import PER_EXPERT, canonical
from megatron_rl.bridge.gather_plan import Bucket, GatherBuffers, GatherPlan, Placed, SharedBucket
from megatron_rl.bridge.hf_files import write_checkpoint
from megatron_rl.bridge.mapping import TensorMap
from megatron_rl.models.adapter_names import is_adapter_name
from megatron_rl.models.hf_config import ModelArch
from megatron_rl.parallel.shards import local_shards
from megatron_rl.utils import dtypes

DEFAULT_MAX_FILE_BYTES = 2 * 1024**3

TRANSPORTS = ("local", "shared_arena", "broadcast")
"""How a bucketed export gathers: one rank copies its own pieces; every rank on one CPU host
writes into a shared arena; otherwise (ranks on several hosts, a GPU, /dev/shm too small,
``MEGATRON_RL_GATHER=broadcast``) one broadcast per decoder layer and owner."""


def _root(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


@dataclasses.dataclass(frozen=True)
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
    gathers: dict[tuple[ModelArch, str, bool], GatherPlan] = dataclasses.field(default_factory=dict)
    """By (arch, style, by_layer)."""
    buffers: dict[tuple[ModelArch, str], GatherBuffers] = dataclasses.field(default_factory=dict)
    """By (arch, style)."""
    local: Optional[_LocalPieces] = None
    """Replaced when a parameter's storage moved (:meth:`ExportPlans.local_pieces`)."""


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
            plans[arch, style] = build_plan(chunks, arch, style)
        return plans[arch, style]

    def gather_plan(self, chunks, arch: ModelArch, style: str = PER_EXPERT, by_layer: bool = False) -> GatherPlan:
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
                if s.is_main_replica and not is_adapter_name(s.name)  # LoRA adapters: merged in, not exported
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
    gather: GatherPlan, bucket: Bucket, arena: torch.Tensor, local: dict[PieceKey, torch.Tensor]
) -> "SharedBucket":
    """One bucket's HF items and this rank's copies in the shared arena, built once and
    reused by every later sync (slicing costs more than a small copy)."""
    cached = gather.shared_views.get(id(bucket))
    if cached is None or cached.arena is not arena or cached.local is not local:
        items, writes = [], []
        for group, placed in bucket:
            out = _views(arena, placed)
            writes += [(out[c.hf][c.dst], local[c.local][c.src]) for c in group.copies if c.owner == gather.rank]
            items.extend(out.items())
        cached = gather.shared_views[id(bucket)] = SharedBucket(arena, local, items, writes)
    return cached


def _shared_arena(gather: GatherPlan, buffers: GatherBuffers, nbytes: int, device) -> Optional[torch.Tensor]:
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
