"""The one name space every layout shares: canonical, parallelism-free tensor names.

Megatron's ``sharded_state_dict()`` describes each local shard by a key in which layers
(and experts) are stacked on leading "prepended" axes, plus the shard's global offset.
We unstack those axes into names, so that layer 3's expert 7 is always
``decoder.layers.3.mlp.experts.7.linear_fc1.weight`` whatever TP/PP/VPP/EP/ETP saved or
loads it. The bridge (HF mapping), the checkpoint store and the weight sync all speak
these names; a tensor's name and global shape never depend on the layout.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import torch

from megatron_rl import platform

_LAYERS = "decoder.layers."
_EXPERTS = ".experts.experts."


@dataclasses.dataclass(frozen=True)
class LocalShard:
    """One piece of one canonical tensor held by this rank."""

    name: str
    global_shape: tuple[int, ...]
    """Shape of the full tensor ``name`` (no stacked layer/expert axes)."""
    offsets: tuple[int, ...]
    """Where this piece starts inside the full tensor."""
    data: torch.Tensor
    """The live local view: writing into it writes the parameter."""
    is_main_replica: bool
    """False for copies that other ranks (DP, or TP for replicated norms) also hold."""

    @property
    def index(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.data.shape))


def canonical_name(key: str, stacked_index: Sequence[int]) -> str:
    """Insert the stacked (layer[, expert]) indices of a sharded key into its name."""
    if not stacked_index:
        return key
    if not key.startswith(_LAYERS):
        raise ValueError(f"sharded key {key!r} has stacked axes but is not under {_LAYERS!r}")
    layer, *rest = stacked_index
    name = f"{_LAYERS}{layer}.{key[len(_LAYERS) :]}"
    if rest:
        if len(rest) != 1 or _EXPERTS not in name:
            raise ValueError(f"sharded key {key!r}: cannot name stacked axes {tuple(stacked_index)}")
        name = name.replace(_EXPERTS, f".experts.{rest[0]}.", 1)
    return name


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


def _flatten(tree) -> Iterator:
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _flatten(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _flatten(value)
    else:
        yield tree


def _is_main(replica_id) -> bool:
    ids = replica_id if isinstance(replica_id, tuple) else (replica_id,)
    return all(r == 0 for r in ids)


def from_sharded_tensor(shard) -> LocalShard:
    """A Megatron ``ShardedTensor`` as a :class:`LocalShard`."""
    n = shard.prepend_axis_num
    return LocalShard(
        name=canonical_name(shard.key, tuple(shard.global_offset[:n])),
        global_shape=tuple(shard.global_shape[n:]),
        offsets=tuple(shard.global_offset[n:]),
        data=shard.data,
        is_main_replica=_is_main(shard.replica_id),
    )


def sharded_tensors(sharded_state_dict: dict) -> list:
    """Every ``ShardedTensor`` of a (model or optimizer) sharded state dict, factories built."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = []
    for value in _flatten(sharded_state_dict):
        pieces = list(_flatten(value.build())) if isinstance(value, ShardedTensorFactory) else [value]
        out.extend(p for p in pieces if isinstance(p, ShardedTensor))
    return out


def local_shards(chunks: Sequence[torch.nn.Module]) -> list[LocalShard]:
    """This rank's pieces of the model, in canonical names (all VPP chunks)."""
    out = []
    with platform.megatron_scope():
        for chunk in chunks:
            for shard in sharded_tensors(_unwrap(chunk).sharded_state_dict()):
                out.append(from_sharded_tensor(shard))
    return out
