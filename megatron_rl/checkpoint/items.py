"""What a rank saves and loads: boxes of canonical tensors, each a live view of local memory.

The model's pieces come from Megatron's ``sharded_state_dict()`` (factories built, e.g. the
SwiGLU fc1 split into its two halves), named by :mod:`megatron_rl.parallel.shards`. Each
piece also remembers which parameter it views and where inside that parameter's flat
storage it lies, which is what lets the distributed optimizer's flat slices be named too.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from megatron_rl import platform
from megatron_rl.checkpoint.format import dtype_name
from megatron_rl.checkpoint.planner import ChunkInfo, ChunkKey
from megatron_rl.parallel.shards import from_sharded_tensor


@dataclasses.dataclass
class Item:
    """One box of one canonical tensor held by this rank."""

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    data: torch.Tensor
    """Live view: loading writes into it."""
    allow_shape_mismatch: bool = False
    """Megatron's flag for tensors whose global shape depends on the layout (padded vocab)."""
    alias_of: Optional[str] = None
    """Name of a model tensor whose saved box holds these very bytes (the fp32 main params of an
    fp32 model are views of the model parameters): not written again, the metadata points at it."""

    @property
    def key(self) -> ChunkKey:
        return ChunkKey(self.name, tuple(self.offsets), tuple(self.data.shape))

    def info(self) -> ChunkInfo:
        nbytes = self.data.numel() * self.data.element_size()
        return ChunkInfo(self.key, tuple(self.global_shape), dtype_name(self.data.dtype), nbytes)


@dataclasses.dataclass
class ParamPiece:
    """A model item that views part of a parameter: flat elements [start, start+numel)."""

    item: Item
    start: int


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


def _flat_offset(view: torch.Tensor, base: torch.Tensor) -> int:
    if not view.is_contiguous():
        raise ValueError("a sharded-state-dict piece of a parameter is not contiguous")
    delta = view.data_ptr() - base.data_ptr()
    if delta % view.element_size() or not 0 <= delta // view.element_size() <= base.numel() - view.numel():
        raise ValueError("a sharded-state-dict piece does not lie inside its parameter")
    return delta // view.element_size()


def model_sharded_state_dict(chunks: Sequence[torch.nn.Module]) -> dict:
    """{'model0': ..., 'model1': ...} as Megatron's checkpointing builds it (keep_vars)."""
    with platform.megatron_scope():
        return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


def model_items(sharded_state_dict: dict) -> tuple[list[Item], dict[int, list[ParamPiece]]]:
    """The model's items, and for each parameter (keyed by ``id``) the pieces that view it."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    items: list[Item] = []
    pieces_of: dict[int, tuple[torch.Tensor, list[ParamPiece]]] = {}
    with platform.megatron_scope():
        for value in nested_values(sharded_state_dict):
            if isinstance(value, ShardedTensorFactory):
                built = value.build()
                built = nested_values(built) if isinstance(built, (dict, list)) else [built]
                base, built = value.data, [p for p in built if isinstance(p, ShardedTensor)]
            elif isinstance(value, ShardedTensor):
                base, built = value.data, [value]
            else:
                continue  # ShardedObjects (e.g. extra state): not tensors of the model
            for st in built:
                shard = from_sharded_tensor(st)
                item = Item(shard.name, shard.global_shape, shard.offsets, shard.data, st.allow_shape_mismatch)
                items.append(item)
                if isinstance(base, torch.Tensor):
                    entry = pieces_of.setdefault(id(base), (base, []))
                    entry[1].append(ParamPiece(item, _flat_offset(item.data, base)))
    return items, {id(base): pieces for base, pieces in pieces_of.values()}


def dedup_local(items: Sequence[Item]) -> list[Item]:
    """Drop repeated boxes on one rank (tied weights appear under two chunks' keys)."""
    seen, out = set(), []
    for item in items:
        if item.key not in seen:
            seen.add(item.key)
            out.append(item)
    return out
