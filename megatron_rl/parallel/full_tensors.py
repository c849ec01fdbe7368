"""Layout-free views of a sharded Megatron model: gather full tensors, scatter them back.

Every local shard has a canonical, parallelism-free name, global shape and offset
(:mod:`.shards`, from Megatron's ``sharded_state_dict()``). With that metadata a model in
any TP/PP/VPP/EP/ETP layout can be gathered into {key: full tensor} and loaded from it. The
same dict from two layouts is directly comparable, which is how layouts are tested against
the single-rank model.

This is a small-model tool (the gather goes through ``all_gather_object``); the
checkpoint store and the weight sync move data without materialising everything.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_rl.parallel.shards import local_shards


def gather_full(
    chunks: list[torch.nn.Module],
    group: Optional[dist.ProcessGroup] = None,
    only: Optional[Callable[[str], bool]] = None,
) -> dict[str, torch.Tensor]:
    """{canonical name: full tensor} on every rank (main replicas only); ``only``: of the
    names it accepts (the LoRA adapters, say), None: all."""
    local = [
        (s.name, s.global_shape, s.index, s.data.detach().float().cpu().clone())
        for s in local_shards(chunks)
        if s.is_main_replica and (only is None or only(s.name))
    ]
    world = dist.get_world_size(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, local, group=group)
    full: dict[str, torch.Tensor] = {}
    for pieces in gathered:
        for name, shape, index, data in pieces:
            if name not in full:
                full[name] = torch.zeros(shape)
            full[name][index] = data
    return full


def load_full(chunks: list[torch.nn.Module], full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's slices of ``full`` into the model parameters (in place)."""
    missing = []
    with torch.no_grad():
        for shard in local_shards(chunks):
            if shard.name not in full:
                missing.append(shard.name)
                continue
            shard.data.copy_(full[shard.name][shard.index].to(shard.data.dtype))
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
