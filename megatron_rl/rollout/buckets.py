"""A weight bucket as one byte tensor, and back: what carries new weights over the bridge.

The training side packs the HF-named tensors of a bucket into one contiguous byte tensor
(:func:`pack_bucket`), which travels beside its :class:`~megatron_rl.rollout.commands.LoadBucket`
or :class:`~megatron_rl.rollout.commands.CheckBucket` command, described by the command's
``specs``; the rollout side cuts it back into views of the right names, shapes and dtypes
(:func:`unpack_bucket`) without copying. Each tensor starts at an offset aligned so that it
can be viewed in its dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from megatron_rl.utils.alignment import DTYPE_VIEW_ALIGN, align_up


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of a weight bucket's byte tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _layout(specs: Sequence[TensorSpec]) -> tuple[list[tuple[int, int]], int]:
    """(offset, bytes) of every tensor in the byte buffer, and the buffer's size."""
    slots, offset = [], 0
    for spec in specs:
        size = int(torch.Size(spec.shape).numel()) * torch.empty(0, dtype=spec.dtype).element_size()
        slots.append((offset, size))
        offset += align_up(size, DTYPE_VIEW_ALIGN)  # so each can be viewed in its dtype
    return slots, offset


def pack_bucket(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[TensorSpec], torch.Tensor]:
    """One byte tensor holding every tensor of a bucket, and what to cut it back into."""
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in named]
    slots, total = _layout(specs)
    flat = torch.zeros(total, dtype=torch.uint8)
    for (_, tensor), (offset, size) in zip(named, slots):
        flat[offset : offset + size] = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return specs, flat


def unpack_bucket(specs: Sequence[TensorSpec], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views into ``flat`` with the names, shapes and dtypes of :func:`pack_bucket`."""
    slots, _ = _layout(specs)
    return [
        (spec.name, flat[offset : offset + size].view(spec.dtype).reshape(spec.shape))
        for spec, (offset, size) in zip(specs, slots)
    ]


def bucket_bytes(specs: Sequence[TensorSpec]) -> int:
    """The size of the byte tensor that carries a bucket of ``specs``."""
    return _layout(specs)[1]
