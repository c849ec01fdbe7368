"""Layout-free views of a sharded Megatron model: gather full tensors, scatter them back.

Megatron's ``sharded_state_dict()`` already knows, for every local shard, its
parallelism-free key (layers and experts stacked on leading axes), the global shape and
the offset of this shard. With that metadata a model in any TP/PP/VPP/EP/ETP layout can be
gathered into {key: full tensor} and loaded from it. The same dict from two layouts is
directly comparable, which is how layouts are tested against the single-rank model.

This is a small-model tool (the gather goes through ``all_gather_object``); the
checkpoint store and the weight sync move data without materialising everything.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_rl import platform


def _shards(chunks: list[torch.nn.Module]):
    """Every ShardedTensor of the model chunks, factories built."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = []
    with platform.megatron_scope():
        for chunk in chunks:
            module = _unwrap(chunk)
            for value in module.sharded_state_dict().values():
                pieces = [value]
                if isinstance(value, ShardedTensorFactory):
                    pieces = list(_flatten(value.build()))
                out.extend(p for p in pieces if isinstance(p, ShardedTensor))
    return out


def _flatten(tree) -> Iterator:
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _flatten(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _flatten(value)
    else:
        yield tree


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


def _index(shard) -> tuple:
    """Index of this shard inside the global tensor."""
    n = shard.prepend_axis_num
    lead = tuple(shard.global_offset[:n])
    rest = tuple(
        slice(o, o + s) for o, s in zip(shard.global_offset[n:], shard.local_shape)
    )
    return lead + rest


def gather_full(chunks: list[torch.nn.Module], group: Optional[dist.ProcessGroup] = None) -> dict[str, torch.Tensor]:
    """{parallelism-free key: full tensor} on every rank (main replicas only)."""
    local = [
        (s.key, tuple(s.global_shape), _index(s), s.data.detach().float().cpu().clone())
        for s in _shards(chunks)
        if all(r == 0 for r in _replica(s))
    ]
    world = dist.get_world_size(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, local, group=group)
    full: dict[str, torch.Tensor] = {}
    for pieces in gathered:
        for key, shape, index, data in pieces:
            if key not in full:
                full[key] = torch.zeros(shape)
            full[key][index] = data
    return full


def _replica(shard) -> tuple:
    rid = shard.replica_id
    return rid if isinstance(rid, tuple) else (rid,)


def load_full(chunks: list[torch.nn.Module], full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's slices of ``full`` into the model parameters (in place)."""
    missing = []
    with torch.no_grad():
        for shard in _shards(chunks):
            if shard.key not in full:
                missing.append(shard.key)
                continue
            shard.data.copy_(full[shard.key][_index(shard)].to(shard.data.dtype))
    if missing:
        raise KeyError(f"full state has no tensor for {sorted(set(missing))}")


@contextlib.contextmanager
def params_as(chunks: list[torch.nn.Module], value: Callable[[torch.nn.Parameter], torch.Tensor]):
    """Temporarily let each parameter's data be ``value(param)`` (e.g. its gradient), so
    :func:`gather_full` can gather gradients with the parameters' sharding metadata."""
    saved = []
    for chunk in chunks:
        for param in chunk.parameters():
            saved.append((param, param.data))
            param.data = value(param).view_as(param.data)
    try:
        yield
    finally:
        for param, data in saved:
            param.data = data


def main_grad(param: torch.nn.Parameter) -> torch.Tensor:
    """The gradient Megatron DDP accumulated for ``param`` (zeros when it got none)."""
    grad = getattr(param, "main_grad", None)
    if grad is None:
        grad = param.grad
    return grad if grad is not None else torch.zeros_like(param.data)
