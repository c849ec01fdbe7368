"""Reading with resharding: intersect what a rank needs with what was saved; read only that.

For every needed box, each saved chunk that overlaps it contributes the byte span covering
the overlap, widened to whole checksum blocks, every one of which is verified. Reads run in
one thread pool per reader, each thread reading, verifying and placing its own spans, so
reading one span overlaps placing another; ``os.preadv`` and the checksums release the GIL.
When the overlap is one contiguous run of the chunk and its place in the destination is
contiguous too (a same-layout load, a reshard along the first dimension), the bytes are read
straight into the destination (only the widening's head and tail go to a small buffer) and
verified there: no intermediate copy. Otherwise they are read into a scratch buffer,
verified, then copied into place. Either way a checksum mismatch raises before the load
returns, so a load that fails leaves a partly written model, never a silently wrong one.

Ranks that need the same bytes (DP replicas) each read them: on one machine a read from
the page cache and its checksum cost less than gloo broadcasting the bytes from one reader
(docs/benchmarks.md, checkpoints), so nothing is shared between ranks. Across nodes on a
slow shared file system a broadcast might pay; that is not measured, so not built.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from megatron_rl.checkpoint import boxes as bx
from megatron_rl.checkpoint import format as fmt
from megatron_rl.checkpoint.items import Item

MAX_MISSING_SHOWN = 8
READ_THREADS = 4
"""Reader threads per process: enough to keep reads, checksums and copies of several spans in
flight; more only contend for the cores with the other ranks of the machine."""
VERIFY_SPAN_BLOCKS = 16
"""Blocks one ``verify()`` read covers (16 MiB per thread in flight)."""
SCRATCH_KEPT_BYTES = 64 << 20
"""Scratch each reader thread keeps from span to span (first touches of new memory, page
faults, cost more than the copy); a larger span reads into a buffer of its own."""


def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def _blocks(pieces: Sequence[memoryview], block_bytes: int) -> Iterator[list[memoryview]]:
    """The consecutive ``block_bytes`` runs of the pieces laid end to end (the last may be
    shorter), each as the list of views it spans."""
    current, room = [], block_bytes
    for piece in pieces:
        while len(piece):
            part = piece[:room]
            current.append(part)
            piece, room = piece[len(part) :], room - len(part)
            if room == 0:
                yield current
                current, room = [], block_bytes
    if current:
        yield current


class Reader:
    """Reads chunk bytes of one committed step, verifying checksums."""

    def __init__(self, directory: Path, metadata: fmt.Metadata, threads: int = READ_THREADS):
        self.directory, self.metadata, self.threads = Path(directory), metadata, threads
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._disjoint: dict[str, bool] = {}
        self._pool: Optional[ThreadPoolExecutor] = None
        self._local = threading.local()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, fn, tasks: Sequence) -> None:
        """``fn`` over ``tasks`` on the reader's threads (started once, kept until close);
        the first failure is raised."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="ckpt-read")
        for _ in self._pool.map(fn, tasks):
            pass

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the calling thread's scratch, valid until its next call."""
        if nbytes > SCRATCH_KEPT_BYTES:
            return torch.empty(nbytes, dtype=torch.uint8)
        kept = getattr(self._local, "scratch", None)
        if kept is None or kept.numel() < nbytes:
            grown = max(nbytes, 2 * kept.numel()) if kept is not None else nbytes
            kept = self._local.scratch = torch.empty(min(grown, SCRATCH_KEPT_BYTES), dtype=torch.uint8)
        return kept[:nbytes]

    def _fd(self, file: str) -> int:
        with self._lock:
            if file not in self._fds:
                path = fmt.confined(self.directory, file)
                try:
                    self._fds[file] = os.open(path, os.O_RDONLY)
                except OSError as err:
                    raise fmt.CheckpointError(f"{path}: cannot be read ({err.strerror})") from err
            return self._fds[file]

    def _read_into(self, name: str, chunk: fmt.Chunk, start: int, pieces: Sequence[memoryview]) -> None:
        """Fill ``pieces`` (laid end to end) with the chunk's bytes from ``start`` on."""
        offset, pending = chunk.byte_offset + start, [p for p in pieces if len(p)]
        while pending:
            got = os.preadv(self._fd(chunk.file), pending, offset)
            if got == 0:
                where = f"tensor {name}, chunk at offsets {chunk.offsets}"
                raise fmt.CheckpointError(f"{self.directory / chunk.file} is truncated ({where})")
            offset += got
            while pending and got >= len(pending[0]):
                got -= len(pending.pop(0))
            if got:
                pending[0] = pending[0][got:]

    def _check_blocks(self, name: str, chunk: fmt.Chunk, block0: int, pieces: Sequence[memoryview]) -> None:
        """Raise naming the file, tensor and byte range unless each block, from ``block0`` on,
        of the pieces laid end to end matches its stored checksum."""
        checksum = fmt.CHECKSUMS[self.metadata.checksum]
        for block, parts in enumerate(_blocks(pieces, fmt.BLOCK_BYTES), start=block0):
            if checksum(parts) != chunk.checksums[block]:
                start = chunk.byte_offset + block * fmt.BLOCK_BYTES
                raise fmt.CheckpointError(
                    f"checksum mismatch in {self.directory / chunk.file}: tensor {name}, chunk at offsets "
                    f"{chunk.offsets}, bytes {start}..{start + fmt.BLOCK_BYTES}"
                )

    def verify(self) -> None:
        """Read every stored byte once and check it against its checksums (no tensor is
        built: memory stays at one span per thread)."""
        span = VERIFY_SPAN_BLOCKS * fmt.BLOCK_BYTES

        def check(task) -> None:
            name, chunk, start = task
            view = _writable_bytes(self._scratch(min(span, chunk.nbytes - start)))
            self._read_into(name, chunk, start, [view])
            self._check_blocks(name, chunk, start // fmt.BLOCK_BYTES, [view])

        tasks = [
            (name, c, start)
            for name, entry in self.metadata.tensors.items()
            for c in entry.chunks
            for start in range(0, max(c.nbytes, 1), span)
        ]
        self._run(check, tasks)

    def _place(self, item: Item, chunk: fmt.Chunk, box: bx.Box) -> None:
        """Read the elements of ``box`` (global coordinates) stored in ``chunk`` into their
        place in ``item.data``, verifying every block they touch."""
        dtype = fmt.DTYPES[self.metadata.tensors[item.name].dtype]
        size = torch.empty((), dtype=dtype).element_size()
        local = bx.relative(box, chunk.offsets)
        first, last = bx.flat_span(local, chunk.shape)
        block0, block1 = first * size // fmt.BLOCK_BYTES, math.ceil(last * size / fmt.BLOCK_BYTES)
        start, end = block0 * fmt.BLOCK_BYTES, min(block1 * fmt.BLOCK_BYTES, chunk.nbytes)
        lo, hi = first * size - start, last * size - start  # the box's bytes within the span
        with torch.no_grad():
            dest = item.data[bx.as_slices(bx.relative(box, item.offsets))]
        direct = (
            dest.device.type == "cpu"
            and dest.dtype == dtype
            and dest.is_contiguous()
            and last - first == bx.volume(local[1])  # the box is one contiguous run of the chunk
        )
        if direct:  # the widening's head and tail (under a block each) go to scratch
            spare = _writable_bytes(self._scratch(lo + end - start - hi))
            pieces = [spare[:lo], _writable_bytes(dest), spare[lo:]]
            self._read_into(item.name, chunk, start, pieces)
            self._check_blocks(item.name, chunk, block0, pieces)
            return
        raw = self._scratch(end - start)
        self._read_into(item.name, chunk, start, [_writable_bytes(raw)])
        self._check_blocks(item.name, chunk, block0, [_writable_bytes(raw)])
        data = raw[lo:hi].view(dtype).as_strided(local[1], bx.row_major_strides(chunk.shape))
        with torch.no_grad():
            dest.copy_(data)

    def _chunks_disjoint(self, name: str) -> bool:
        if name not in self._disjoint:
            chunks = self.metadata.tensors[name].chunks
            self._disjoint[name] = bx.disjoint([(tuple(c.offsets), tuple(c.shape)) for c in chunks])
        return self._disjoint[name]

    def _tasks_for(self, item: Item) -> list[tuple[Item, fmt.Chunk, bx.Box]]:
        entry = self.metadata.tensors[item.name]
        needed: Optional[bx.Box] = (tuple(item.offsets), tuple(item.data.shape))
        if tuple(entry.shape) != tuple(item.global_shape):
            if not item.allow_shape_mismatch or len(entry.shape) != len(item.global_shape):
                raise fmt.CheckpointError(
                    f"tensor {item.name}: checkpoint shape {entry.shape}, model shape {list(item.global_shape)}"
                )
            with torch.no_grad():
                item.data.zero_()  # padding beyond the saved shape (e.g. padded vocab rows)
            needed = bx.intersect(needed, (tuple([0] * len(entry.shape)), tuple(entry.shape)))
            if needed is None:
                return []
        tasks = []
        for chunk in entry.chunks:
            overlap = bx.intersect(needed, (tuple(chunk.offsets), tuple(chunk.shape)))
            if overlap is not None:
                tasks.append((item, chunk, overlap))
        covered, volume = sum(bx.volume(t[2][1]) for t in tasks), bx.volume(needed[1])
        exact = covered == volume and self._chunks_disjoint(item.name)
        if covered < volume or not (exact or self._covers(needed, tasks)):
            raise fmt.CheckpointError(
                f"tensor {item.name}: the checkpoint does not cover offsets {list(needed[0])} shape {list(needed[1])}"
            )
        return tasks

    @staticmethod
    def _covers(needed: bx.Box, tasks) -> bool:
        mask = torch.zeros(needed[1], dtype=torch.bool)
        for _, _, overlap in tasks:
            mask[bx.as_slices(bx.relative(overlap, needed[0]))] = True
        return bool(mask.all())

    def fill(self, items: Sequence[Item]) -> None:
        """Load every item's box in place (collective-free; any layout)."""
        missing = sorted({i.name for i in items if i.name not in self.metadata.tensors})
        if missing:
            shown = ", ".join(missing[:MAX_MISSING_SHOWN]) + (" ..." if len(missing) > MAX_MISSING_SHOWN else "")
            raise fmt.CheckpointError(f"the checkpoint has no tensor named {shown} ({len(missing)} missing)")
        tasks = [t for item in items for t in self._tasks_for(item)]
        tasks.sort(key=lambda t: -bx.volume(t[2][1]) * t[0].data.element_size())  # largest first: threads end together
        self._run(lambda task: self._place(*task), tasks)

    def full_tensor(self, name: str) -> torch.Tensor:
        entry = self.metadata.tensors[name]
        out = torch.empty(entry.shape, dtype=fmt.DTYPES[entry.dtype])
        self.fill([Item(name, tuple(entry.shape), tuple([0] * len(entry.shape)), out)])
        return out


def iter_tensors(
    directory: Path, metadata: fmt.Metadata, prefix_excluded: str = "optimizer."
) -> Iterator[tuple[str, torch.Tensor]]:
    with Reader(directory, metadata) as reader:
        for name in metadata.tensors:
            if not name.startswith(prefix_excluded):
                yield name, reader.full_tensor(name)
