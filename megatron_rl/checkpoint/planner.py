"""Save planning: write each distinct chunk once, balancing bytes across the ranks holding it.

Every rank lists the chunks it holds as :class:`ChunkKey` (name, offsets, shape) plus dtype
and size. A chunk held by several ranks (DP replicas, TP-replicated norms, the expert-DP
copies) is written by exactly one of them: chunks are taken largest first and each goes to
the least-loaded rank that holds it (greedy LPT). Every rank computes the same plan from the
same gathered lists, so no plan is broadcast; the plan is cached while the lists do not
change (only a digest is exchanged then).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Optional, Sequence


@dataclasses.dataclass(frozen=True, order=True)
class ChunkKey:
    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ChunkInfo:
    key: ChunkKey
    global_shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Plan:
    writers: dict[ChunkKey, int]
    """Which rank writes each distinct chunk."""
    bytes_per_rank: list[int]


def digest(chunks: Sequence[ChunkInfo]) -> str:
    """A fingerprint of one rank's chunk list (decides whether a cached plan still holds)."""
    text = json.dumps([dataclasses.astuple(c) for c in chunks], separators=(",", ":"))
    return hashlib.sha1(text.encode()).hexdigest()


def check_consistent(per_rank: Sequence[Sequence[ChunkInfo]]) -> None:
    """Every rank must agree on each tensor's global shape and dtype."""
    seen: dict[str, tuple[tuple[int, ...], str, int]] = {}
    for rank, chunks in enumerate(per_rank):
        for c in chunks:
            first = seen.setdefault(c.key.name, (c.global_shape, c.dtype, rank))
            if first[:2] != (c.global_shape, c.dtype):
                raise ValueError(
                    f"tensor {c.key.name!r}: rank {first[2]} holds shape {list(first[0])} {first[1]}, "
                    f"rank {rank} holds shape {list(c.global_shape)} {c.dtype}"
                )


def balanced_plan(per_rank: Sequence[Sequence[ChunkInfo]]) -> Plan:
    """Greedy: distinct chunks by decreasing size, each to its least-loaded holder."""
    check_consistent(per_rank)
    holders: dict[ChunkKey, list[int]] = {}
    size: dict[ChunkKey, int] = {}
    for rank, chunks in enumerate(per_rank):
        for c in chunks:
            holders.setdefault(c.key, []).append(rank)
            size[c.key] = c.nbytes
    load = [0] * len(per_rank)
    writers: dict[ChunkKey, int] = {}
    for key in sorted(holders, key=lambda k: (-size[k], k)):
        rank = min(holders[key], key=lambda r: (load[r], r))
        writers[key] = rank
        load[rank] += size[key]
    return Plan(writers=writers, bytes_per_rank=load)


class PlanCache:
    """Remembers the last plan and the per-rank digests it was made from."""

    def __init__(self) -> None:
        self._digests: Optional[tuple[str, ...]] = None
        self._plan: Optional[Plan] = None

    def get(self, digests: Sequence[str]) -> Optional[Plan]:
        return self._plan if self._digests == tuple(digests) else None

    def guess(self, rank: int, own_digest: str) -> Optional[Plan]:
        """The cached plan if this rank's own list is unchanged: what it will most likely write,
        known before the other ranks' digests arrive (confirmed or discarded by :meth:`get`)."""
        if self._digests is None or rank >= len(self._digests) or self._digests[rank] != own_digest:
            return None
        return self._plan

    def put(self, digests: Sequence[str], plan: Plan) -> None:
        self._digests, self._plan = tuple(digests), plan
