"""Reading with resharding: intersect what a rank needs with what was saved; read only that.

For every needed box, each saved chunk that overlaps it contributes the byte span covering
the overlap (widened to whole checksum blocks, which are verified). Reads run in a thread
pool; ``os.pread`` and crc32 release the GIL.
"""

from __future__ import annotations

import math
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from megatron_rl.checkpoint import boxes as bx
from megatron_rl.checkpoint import format as fmt
from megatron_rl.checkpoint.items import Item

MAX_MISSING_SHOWN = 8


class Reader:
    """Reads chunk bytes of one committed step, verifying checksums."""

    def __init__(self, directory: Path, metadata: fmt.Metadata, threads: int = 8):
        self.directory, self.metadata, self.threads = Path(directory), metadata, threads
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._disjoint: dict[str, bool] = {}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _fd(self, file: str) -> int:
        with self._lock:
            if file not in self._fds:
                path = fmt.confined(self.directory, file)
                try:
                    self._fds[file] = os.open(path, os.O_RDONLY)
                except OSError as err:
                    raise fmt.CheckpointError(f"{path}: cannot be read ({err.strerror})") from err
            return self._fds[file]

    def _check_block(self, name: str, chunk: fmt.Chunk, block: int, data) -> None:
        """Raise naming the file, tensor and byte range when ``data`` (block ``block`` of
        ``chunk``) does not match its stored crc32."""
        if zlib.crc32(data) != chunk.crc32[block]:
            start = chunk.byte_offset + block * fmt.BLOCK_BYTES
            raise fmt.CheckpointError(
                f"checksum mismatch in {self.directory / chunk.file}: tensor {name}, chunk at offsets "
                f"{chunk.offsets}, bytes {start}..{start + fmt.BLOCK_BYTES}"
            )

    def verify(self) -> None:
        """Read every stored byte once, block by block, and check it against its checksum
        (no tensor is built, so memory stays at one block per thread)."""

        def check(task) -> None:
            name, chunk = task
            for block in range(len(chunk.crc32)):
                start = block * fmt.BLOCK_BYTES
                size = max(0, min(fmt.BLOCK_BYTES, chunk.nbytes - start))
                raw = os.pread(self._fd(chunk.file), size, chunk.byte_offset + start)
                if len(raw) != size:
                    raise fmt.CheckpointError(f"{self.directory / chunk.file} is truncated (tensor {name})")
                self._check_block(name, chunk, block, raw)

        tasks = [(name, c) for name, entry in self.metadata.tensors.items() for c in entry.chunks]
        with ThreadPoolExecutor(max_workers=self.threads) as pool:
            for _ in pool.map(check, tasks):
                pass

    def read_overlap(self, name: str, chunk: fmt.Chunk, box: bx.Box) -> torch.Tensor:
        """The elements of ``box`` (global coordinates) stored in ``chunk``, as a tensor."""
        dtype = fmt.DTYPES[self.metadata.tensors[name].dtype]
        size = torch.empty((), dtype=dtype).element_size()
        local = bx.relative(box, chunk.offsets)
        first, last = bx.flat_span(local, chunk.shape)
        block0, block1 = first * size // fmt.BLOCK_BYTES, math.ceil(last * size / fmt.BLOCK_BYTES)
        start, end = block0 * fmt.BLOCK_BYTES, min(block1 * fmt.BLOCK_BYTES, chunk.nbytes)
        raw = os.pread(self._fd(chunk.file), end - start, chunk.byte_offset + start)
        where = f"{chunk.file} (tensor {name}, chunk at offsets {chunk.offsets})"
        if len(raw) != end - start:
            raise fmt.CheckpointError(f"{where}: file is truncated")
        view = memoryview(raw)
        for block in range(block0, block1):
            lo = (block - block0) * fmt.BLOCK_BYTES
            self._check_block(name, chunk, block, view[lo : lo + fmt.BLOCK_BYTES])
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)[first * size - start : last * size - start].view(
            dtype
        )
        return flat.as_strided(local[1], bx.row_major_strides(chunk.shape))

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

        def run(task) -> None:
            item, chunk, overlap = task
            data = self.read_overlap(item.name, chunk, overlap)
            with torch.no_grad():
                item.data[bx.as_slices(bx.relative(overlap, item.offsets))].copy_(data)

        with ThreadPoolExecutor(max_workers=self.threads) as pool:
            for _ in pool.map(run, tasks):
                pass

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
