"""Writing one step: host snapshot, background write, and the atomic commit.

The training loop is blocked only while this rank's share of the chunks is copied into host
buffers (reused across saves; pinned on GPU), or, with a deferred snapshot, not at all until
its next optimizer update (``update_gate``). The rest runs on the checkpointer's long-lived,
lower-priority background thread (:class:`BackgroundWriter`): raw bytes into
``data_<rank>.bin`` with a checksum (``format.CHECKSUM``) per 1 MiB block, fsync, then a small ``rank_<r>.json``
listing what was written. Rank 0's thread waits for every rank's list, writes
``metadata.json`` and the ``COMMIT`` marker, renames ``.tmp_step_<N>`` to ``step_<N>``,
updates ``latest`` and prunes. The commit needs no collective (so a background thread can do
it while the training loop uses the process groups): ranks meet through the checkpoint
directory, which a multi-node job must share anyway.
Tensors that alias a model tensor's bytes (fp32 main params) are not written: rank 0 lists
that tensor's chunks for them in the metadata.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import socket
import threading
import time
import zlib
from pathlib import Path
from typing import Callable, Optional

import torch

from megatron_rl.checkpoint import format as fmt
from megatron_rl.checkpoint.items import Item
from megatron_rl.checkpoint.optimizer_state import merge_common_states
from megatron_rl.checkpoint.planner import ChunkKey

FAILED = "FAILED"
POLL_S = 0.005
BACKGROUND_NICE = 10
"""Niceness of the background writer thread: under CPU contention it yields to training
(about 1/10 of a core's share), when the CPU is free it writes at full speed."""


class HostBuffers:
    """Host copies of the chunks this rank writes, reused across saves (the steady state copies
    into memory that is already mapped: first-touch page faults cost more than the copy)."""

    def __init__(self) -> None:
        self._buffers: dict = {}
        self._retired: list[torch.Tensor] = []

    def release_retired(self) -> None:
        """Free the buffers the last snapshot no longer needed (call off the training thread:
        unmapping hundreds of MB is not free)."""
        self._retired = []

    def snapshot(self, items: list[Item], after=None) -> dict[ChunkKey, torch.Tensor]:
        """Copy ``items`` into host buffers. ``after``: a CUDA event recorded on the training
        stream at save time; the copy then runs on a side stream once it has passed (the
        background thread of a deferred snapshot), not on the training stream."""
        device = next((i.data.device for i in items if i.data.is_cuda), None)
        cuda = device is not None
        stream = None
        if cuda and after is not None:
            # On this rank's GPU: a thread's current device starts at GPU 0, whatever the
            # training thread set, so a plain Stream() would copy (and wait) on another GPU.
            stream = torch.cuda.Stream(device=device)
            stream.wait_event(after)
        kept, out = {}, {}
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for item in items:
                key = (item.key, item.data.dtype)
                buffer = self._buffers.get(key)
                if buffer is None:
                    buffer = torch.empty(item.data.shape, dtype=item.data.dtype, pin_memory=item.data.is_cuda)
                buffer.copy_(item.data.detach(), non_blocking=cuda)
                kept[key] = out[item.key] = buffer
        self._retired = [b for key, b in self._buffers.items() if key not in kept]
        self._buffers = kept
        if stream is not None:
            stream.synchronize()
        elif cuda:
            torch.cuda.synchronize(device)
        return out


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_rank(tmp: Path, rank: int, items: list[Item], tensors: list[torch.Tensor], record: dict) -> None:
    """Write this rank's chunks and its record (what it wrote, where, RNG, optimizer groups)."""
    chunks = []
    if items:
        name = fmt.data_file_name(rank)
        with open(tmp / name, "wb") as f:
            offset = 0
            for item, tensor in zip(items, tensors):
                data = _as_bytes(tensor)
                f.write(data)
                chunks.append(
                    {
                        "name": item.name,
                        "dtype": fmt.dtype_name(tensor.dtype),
                        "global_shape": list(item.global_shape),
                        "chunk": fmt.Chunk(
                            list(item.offsets), list(tensor.shape), name, offset, len(data), fmt.block_checksums(data)
                        ).__dict__,
                    }
                )
                offset += len(data)
            f.flush()
            os.fsync(f.fileno())
    record = dict(record, chunks=chunks, host=socket.gethostname())
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


def _add_aliases(tensors: dict[str, fmt.TensorEntry], records: list[dict]) -> None:
    """Tensors saved as aliases (same bytes as a model tensor) list that tensor's chunks."""
    aliases: dict[str, str] = {}
    for record in records:
        for name, target in record.get("aliases", {}).items():
            if aliases.setdefault(name, target) != target:
                raise fmt.CheckpointError(f"tensor {name}: ranks alias it to both {aliases[name]} and {target}")
    for name, target in sorted(aliases.items()):
        source = tensors.get(target)
        if source is None:
            raise fmt.CheckpointError(f"tensor {name} aliases {target}, which no rank wrote")
        entry = tensors.setdefault(name, fmt.TensorEntry(source.dtype, source.shape, []))
        if (entry.dtype, entry.shape) != (source.dtype, source.shape):
            raise fmt.CheckpointError(
                f"tensor {name} ({entry.dtype} {entry.shape}) cannot alias {target} ({source.dtype} {source.shape})"
            )
        entry.chunks = list(source.chunks) + entry.chunks


def merged_metadata(step: int, records: list[dict], header: dict) -> fmt.Metadata:
    tensors: dict[str, fmt.TensorEntry] = {}
    for record in records:
        for c in record["chunks"]:
            entry = tensors.setdefault(c["name"], fmt.TensorEntry(c["dtype"], c["global_shape"], []))
            entry.chunks.append(fmt.Chunk(**c["chunk"]))
    _add_aliases(tensors, records)
    return fmt.Metadata(
        step=step,
        tensors=dict(sorted(tensors.items())),
        extra=header["extra"],
        layout=header["layout"],
        rng={str(r): rec["rng"] for r, rec in enumerate(records)},
        optimizer=merge_common_states([rec.get("optimizer") for rec in records]),
        hosts={str(r): rec["host"] for r, rec in enumerate(records)},
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


def _lower_priority() -> None:
    """Renice the calling thread only (Linux: a thread id is a valid PRIO_PROCESS target)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), BACKGROUND_NICE))
    except (AttributeError, OSError):  # other platforms: the writer just runs at normal priority
        pass


class BackgroundWriter:
    """One long-lived background thread that runs saves in the order they were handed over.
    Handing it a save does not wait for a new thread to be scheduled (under CPU contention
    that alone took 100+ ms of the blocking time). A checkpointer owns one and stops it on close."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._loop, name="ckpt-writer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        _lower_priority()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    def usable(self) -> bool:
        return self._pid == os.getpid() and self._thread.is_alive()  # a forked child has no thread

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def stop(self, wait: bool = True) -> None:
        """End the thread after the jobs already handed over; ``wait``: until it has ended."""
        self._jobs.put(None)
        if wait and self.usable() and threading.current_thread() is not self._thread:
            self._thread.join()


class SaveHandle:
    """A save in flight. ``wait()`` returns once the step is committed (on every rank)."""

    def __init__(
        self,
        work: Callable[[], None],
        root: Path,
        step: int,
        rank: int,
        timeout_s: float,
        writer: Optional[BackgroundWriter],
    ):
        """Runs ``work`` on ``writer``'s thread, or here and now (a sync save) when it is None."""
        self.root, self.step, self.rank = Path(root), step, rank
        self._timeout_s = timeout_s
        self._error: Optional[BaseException] = None
        self._finished = threading.Event()
        self._waited = False
        if writer is not None:
            writer.submit(lambda: self._run(work))
        else:
            self._run(work)
            self.wait()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as e:  # reported by wait(), and to rank 0 through the directory
            self._error = e
            tmp = fmt.tmp_dir(self.root, self.step)
            try:
                tmp.mkdir(parents=True, exist_ok=True)
                name = FAILED if self.rank == 0 else f"rank_{self.rank}.failed"
                (tmp / name).write_text(f"{type(e).__name__}: {e}")
            except OSError:
                pass
            if not isinstance(e, Exception) and threading.current_thread() is threading.main_thread():
                raise  # KeyboardInterrupt / SystemExit during a synchronous save
        finally:
            self._finished.set()

    def done(self) -> bool:
        return self._waited or self._finished.is_set()

    def failed(self) -> bool:
        """This rank's part finished with an error (``wait()`` raises it)."""
        return self._finished.is_set() and self._error is not None

    def wait(self) -> None:
        if self._waited:
            return
        self._finished.wait()
        if self._error is not None:
            self._waited = True
            raise fmt.CheckpointError(
                f"saving step {self.step} failed on rank {self.rank}: {self._error}"
            ) from self._error
        if self.rank != 0:
            wait_committed(self.root, self.step, self._timeout_s)
        self._waited = True
