"""The global export plan of a sharded model: which rank holds which main-replica piece of
which Megatron tensor, and which Megatron tensors make up which HF tensors, from one
metadata exchange (:func:`build_plan`). The gathers (:mod:`megatron_rl.bridge.gather_plan`)
and the checkpoint converter (:mod:`megatron_rl.bridge.convert`) read it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from megatron_rl.bridge.families import canonical, rules_for
from megatron_rl.bridge.hf_files import TensorSpec
from megatron_rl.bridge.layer_names import megatron_layer_index
from megatron_rl.bridge.mapping import BridgeError, TensorMap, expand
from megatron_rl.models.adapter_names import is_adapter_name
from megatron_rl.models.hf_config import ModelArch
from megatron_rl.parallel.shards import local_shards

# Records the gather unpacks on every sync are NamedTuples: unpacked like the plain tuples
# they are, at no extra cost. So is ShardInfo, which all_gather_object pickles: a few bytes
# more than a plain tuple each.


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
        if s.is_main_replica and not is_adapter_name(s.name)  # LoRA adapters: merged in, not exported
    ]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # once per model: metadata only, never tensor data
    return everyone


def build_plan(chunks, arch: ModelArch, style: str) -> ExportPlan:
    """The global plan of the model ``chunks`` (collective: one metadata exchange)."""
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
