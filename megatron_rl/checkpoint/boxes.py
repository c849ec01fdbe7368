"""Box arithmetic on n-D tensors: the geometry behind saving irregular shards and resharding.

A box is (offsets, shape) inside a global tensor. Saved chunks and needed regions are boxes;
loading intersects them. The distributed optimizer holds a flat, DP-split slice of each
parameter shard; :func:`flat_range_boxes` turns such a slice into boxes that are each
contiguous in row-major order, so every piece is a plain view of the flat state and is
named by global offsets alone (no saving layout needed to read it back).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


def volume(shape: Sequence[int]) -> int:
    return math.prod(shape)


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[tuple[int, Box]]:
    """Row-major-contiguous boxes covering flat elements [start, end) of a tensor of ``shape``.

    Returns (flat start of the box, box) pairs in flat order; at most 2*ndim-1 boxes.
    """
    shape = tuple(int(s) for s in shape)
    if not 0 <= start <= end <= volume(shape):
        raise ValueError(f"flat range [{start}, {end}) is outside a tensor of shape {shape}")
    if start == end:
        return []
    if len(shape) <= 1:
        return [(start, ((start,), (end - start,)))] if shape else [(0, ((), ()))]
    inner = volume(shape[1:])
    first, first_rem = divmod(start, inner)
    last, last_rem = divmod(end, inner)
    out: list[tuple[int, Box]] = []

    def nested(row: int, lo: int, hi: int) -> None:
        for flat, (offs, shp) in flat_range_boxes(shape[1:], lo, hi):
            out.append((row * inner + flat, ((row, *offs), (1, *shp))))

    if first == last:
        nested(first, first_rem, last_rem)
        return out
    if first_rem:
        nested(first, first_rem, inner)
        first += 1
    if last > first:
        out.append((first * inner, ((first, *([0] * (len(shape) - 1))), (last - first, *shape[1:]))))
    if last_rem:
        nested(last, 0, last_rem)
    return out


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The common box of two boxes in the same tensor, or None."""
    offsets, shape = [], []
    for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        offsets.append(lo)
        shape.append(hi - lo)
    return tuple(offsets), tuple(shape)


def relative(box: Box, origin: Sequence[int]) -> Box:
    """``box`` in the coordinates of a box that starts at ``origin``."""
    return tuple(o - p for o, p in zip(box[0], origin)), box[1]


def as_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(*box))


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(tuple(shape)):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


def flat_span(box: Box, container_shape: Sequence[int]) -> tuple[int, int]:
    """[first, last+1) flat indices (row-major) that ``box`` touches inside its container."""
    strides = row_major_strides(container_shape)
    first = sum(o * s for o, s in zip(box[0], strides))
    last = sum((o + n - 1) * s for o, n, s in zip(box[0], box[1], strides))
    return first, last + 1


def disjoint(boxes: Sequence[Box]) -> bool:
    """True when no two boxes share an element (quadratic; chunks per tensor are few)."""
    return all(intersect(boxes[i], boxes[j]) is None for i in range(len(boxes)) for j in range(i))
