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
import math
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


class PlannedGather:
    """:func:`gather_full` of the same few tensors again and again (the LoRA adapters at
    every weight sync), each time at the cost of one ``all_gather`` of their bytes.

    Megatron's ``sharded_state_dict`` and pickling every piece cost far more than moving a
    few MB, so the first call exchanges what each rank holds (names, shapes, offsets) once
    and keeps live views of this rank's pieces (rebuilt only when a parameter's storage
    moved, which they would not follow); every call then packs those views into one flat
    float32 buffer, gathers the ranks' buffers and places the pieces into full tensors
    kept from call to call (the caller copies what it keeps). Collective over the default
    group on every call.
    """

    def __init__(self, chunks: list[torch.nn.Module], only: Callable[[str], bool]):
        self.chunks, self.only = list(chunks), only
        self._storage: Optional[list[int]] = None
        self._views: list[torch.Tensor] = []
        self._layout: Optional[list[list[tuple[str, tuple, tuple]]]] = None
        """Per rank, (name, shard index, shard shape) of each piece it sends, in order."""
        self._full: dict[str, torch.Tensor] = {}

    def _local(self) -> list:
        storage = [p.data_ptr() for chunk in self.chunks for p in chunk.parameters()]
        if storage == self._storage:
            return []
        shards = [s for s in local_shards(self.chunks) if s.is_main_replica and self.only(s.name)]
        self._storage, self._views = storage, [s.data.detach() for s in shards]
        return [(s.name, s.global_shape, s.index, tuple(s.data.shape)) for s in shards]

    def gather(self) -> dict[str, torch.Tensor]:
        """{canonical name: full float32 tensor} on every rank (the same tensors each call)."""
        described = self._local()
        if self._layout is None:
            self._plan(described)
        mine = [v.reshape(-1).float() for v in self._views]
        flat = torch.cat(mine) if mine else torch.zeros(0)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:
            received = [flat]
        else:
            longest = max(sum(math.prod(shape) for _, _, shape in pieces) for pieces in self._layout)
            padded = torch.zeros(longest)
            padded[: flat.numel()] = flat
            received = [torch.empty(longest) for _ in range(world)]
            dist.all_gather(received, padded)
        for pieces, data in zip(self._layout, received):
            offset = 0
            for name, index, shape in pieces:
                count = math.prod(shape)
                self._full[name][index] = data[offset : offset + count].view(shape)
                offset += count
        return self._full

    def _plan(self, described: list) -> None:
        everyone: list = [described]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, described)
        self._layout = [[(name, index, shape) for name, _, index, shape in pieces] for pieces in everyone]
        for pieces in everyone:
            for name, global_shape, _, _ in pieces:
                self._full.setdefault(name, torch.zeros(global_shape))
