"""Writing one step: host snapshot, background write, and the atomic commit.

The training loop is blocked only while this rank's share of the chunks is copied into
host buffers (reused across saves; pinned on GPU). The rest runs on a background thread:
raw bytes into ``data_<rank>.bin`` with a crc32 per 1 MiB block, fsync, then a small
``rank_<r>.json`` listing what was written. Rank 0's thread waits for every rank's list,
writes ``metadata.json`` and the ``COMMIT`` marker, renames ``.tmp_step_<N>`` to
``step_<N>``, updates ``latest`` and prunes. The commit needs no collective (so a background
thread can do it while the training loop uses the process groups): ranks meet through the
checkpoint directory, which a multi-node job must share anyway.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import zlib
from pathlib import Path
from typing import Callable, Optional

import torch

from megatron_rl.checkpoint import format as fmt
from megatron_rl.checkpoint.items import Item
from megatron_rl.checkpoint.optimizer_state import merge_common_states

FAILED = "FAILED"
POLL_S = 0.005


class HostBuffers:
    """Host copies of the chunks this rank writes, reused while the chunk set is unchanged."""

    def __init__(self) -> None:
        self._buffers: dict = {}

    def snapshot(self, items: list[Item]) -> list[torch.Tensor]:
        cuda = any(i.data.is_cuda for i in items)
        wanted = {(i.key, i.data.dtype) for i in items}
        if set(self._buffers) != wanted:
            self._buffers = {
                (i.key, i.data.dtype): torch.empty(i.data.shape, dtype=i.data.dtype, pin_memory=i.data.is_cuda)
                for i in items
            }
        out = []
        for item in items:
            buffer = self._buffers[item.key, item.data.dtype]
            buffer.copy_(item.data.detach(), non_blocking=cuda)
            out.append(buffer)
        if cuda:
            torch.cuda.synchronize()
        return out


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_rank(tmp: Path, rank: int, items: list[Item], tensors: list[torch.Tensor], record: dict) -> None:
    """Write this rank's chunks and its record (what it wrote, RNG, optimizer groups)."""
    chunks = []
    if items:
        name = fmt.data_file_name(rank)
        with open(tmp / name, "wb") as f:
            offset = 0
            for item, tensor in zip(items, tensors):
                data = _as_bytes(tensor)
                f.write(data)
                chunks.append({
                    "name": item.name,
                    "dtype": fmt.dtype_name(tensor.dtype),
                    "global_shape": list(item.global_shape),
                    "chunk": fmt.Chunk(list(item.offsets), list(tensor.shape), name, offset, len(data), fmt.block_crcs(data)).__dict__,
                })
                offset += len(data)
            f.flush()
            os.fsync(f.fileno())
    record = dict(record, chunks=chunks)
    fmt.write_durably(tmp / f"rank_{rank}.json", json.dumps(record, separators=(",", ":")).encode())


def _wait_for_ranks(tmp: Path, world: int, timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    records: dict[int, dict] = {}
    while len(records) < world:
        for rank in range(world):
            if rank in records:
                continue
            failed = tmp / f"rank_{rank}.failed"
            if failed.exists():
                raise fmt.CheckpointError(f"rank {rank} failed to write its chunks: {failed.read_text()}")
            path = tmp / f"rank_{rank}.json"
            if path.exists():
                records[rank] = json.loads(path.read_text())
        if len(records) < world:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(records))
                raise fmt.CheckpointError(f"{tmp}: ranks {missing} did not finish writing within {timeout_s:.0f} s")
            time.sleep(POLL_S)
    return [records[r] for r in range(world)]


def merged_metadata(step: int, records: list[dict], header: dict) -> fmt.Metadata:
    tensors: dict[str, fmt.TensorEntry] = {}
    for record in records:
        for c in record["chunks"]:
            entry = tensors.setdefault(c["name"], fmt.TensorEntry(c["dtype"], c["global_shape"], []))
            entry.chunks.append(fmt.Chunk(**c["chunk"]))
    return fmt.Metadata(
        step=step,
        tensors=dict(sorted(tensors.items())),
        extra=header["extra"],
        layout=header["layout"],
        rng={str(r): rec["rng"] for r, rec in enumerate(records)},
        optimizer=merge_common_states([rec.get("optimizer") for rec in records]),
    )


def _remove(path: Path) -> None:
    """Rename out of sight first, so a half-deleted step never looks committed."""
    doomed = path.with_name(f".deleting{path.name}.{os.getpid()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def commit(root: Path, step: int, world: int, header: dict, keep_last: Optional[int], timeout_s: float) -> None:
    """Rank 0: merge the ranks' records, write metadata + COMMIT, publish, prune."""
    root, tmp = Path(root), fmt.tmp_dir(root, step)
    records = _wait_for_ranks(tmp, world, timeout_s)
    text = merged_metadata(step, records, header).to_json().encode()
    fmt.write_durably(tmp / fmt.METADATA, text)
    for rank in range(world):
        (tmp / f"rank_{rank}.json").unlink()
    fmt.write_durably(tmp / fmt.COMMIT, json.dumps({"step": step, "metadata_crc32": zlib.crc32(text)}).encode())
    fmt.fsync_path(tmp)
    final = fmt.step_dir(root, step)
    if final.exists():  # saving a step again replaces it
        _remove(final)
    os.replace(tmp, final)
    fmt.fsync_path(root)
    fmt.write_durably(root / fmt.LATEST, f"{step}\n".encode())
    fmt.fsync_path(root)
    prune(root, keep_last, step)


def prune(root: Path, keep_last: Optional[int], newest: int) -> None:
    """Keep the newest ``keep_last`` committed steps; drop dead temporaries of older steps."""
    if keep_last is not None:
        for step in fmt.committed_steps(root)[:-keep_last]:
            _remove(fmt.step_dir(root, step))
    for entry in Path(root).iterdir():
        if entry.name.startswith(".tmp_step_") and entry.name[10:].isdigit() and int(entry.name[10:]) < newest:
            _remove(entry)


def wait_committed(root: Path, step: int, timeout_s: float) -> None:
    """Ranks other than 0: block until rank 0 has published ``step`` (or failed)."""
    deadline = time.monotonic() + timeout_s
    final, tmp = fmt.step_dir(root, step) / fmt.COMMIT, fmt.tmp_dir(root, step) / FAILED
    while not final.exists():
        if tmp.exists():
            raise fmt.CheckpointError(f"save of step {step} failed on rank 0: {tmp.read_text()}")
        if time.monotonic() > deadline:
            raise fmt.CheckpointError(f"step {step} was not committed under {root} within {timeout_s:.0f} s")
        time.sleep(POLL_S)


class SaveHandle:
    """A save in flight. ``wait()`` returns once the step is committed (on every rank)."""

    def __init__(self, work: Callable[[], None], root: Path, step: int, rank: int, timeout_s: float, background: bool):
        self.root, self.step, self.rank = Path(root), step, rank
        self._timeout_s = timeout_s
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"ckpt-save-{step}", daemon=True)
        self._thread.start()
        self._waited = False
        if not background:
            self.wait()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # reported by wait(), and to rank 0 through the directory
            self._error = e
            tmp = fmt.tmp_dir(self.root, self.step)
            try:
                name = FAILED if self.rank == 0 else f"rank_{self.rank}.failed"
                (tmp / name).write_text(f"{type(e).__name__}: {e}")
            except OSError:
                pass

    def done(self) -> bool:
        return self._waited or not self._thread.is_alive()

    def wait(self) -> None:
        if self._waited:
            return
        self._thread.join()
        if self._error is not None:
            self._waited = True
            raise fmt.CheckpointError(f"saving step {self.step} failed on rank {self.rank}: {self._error}") from self._error
        if self.rank != 0:
            wait_committed(self.root, self.step, self._timeout_s)
        self._waited = True
