"""The on-disk format: directory names, the metadata schema and the commit protocol's files.

    root/
      latest                  text: the newest committed step (for people; loading scans)
      step_<N>/               one committed checkpoint
        COMMIT                JSON {step, metadata_crc32}: written last; no COMMIT, no checkpoint
        metadata.json         every tensor's chunks (file, byte range, a checksum per 1 MiB
                              block) + state, and the host of each saving rank
        data_<rank>.bin       raw tensor bytes, row-major, no pickle (each rank writes its own,
                              on its own node: the root must be storage every node shares)
      .tmp_step_<N>/          a save in progress (or one that died): never read

Tensor names are the canonical, parallelism-free names of ``megatron_rl.parallel.shards``;
the saving layout is recorded for information only.

Format 2 names its block checksum (``Metadata.checksum``, xxh3_64 when written here: it
checks a block 3.5x faster than crc32 on a CPU core); format 1 checkpoints are read with
the crc32 they were written with. Any other format or checksum is refused in one line.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import zlib
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import xxhash

FORMAT = "megatron_rl.checkpoint/2"
FORMAT_1 = "megatron_rl.checkpoint/1"
"""Chunks list ``crc32`` block checksums; no ``checksum`` field."""
COMMIT = "COMMIT"
METADATA = "metadata.json"
LATEST = "latest"
BLOCK_BYTES = 1 << 20
"""Checksum granularity: a partial read verifies only the 1 MiB blocks it touches."""


def _crc32(parts: Sequence[memoryview]) -> int:
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def _xxh3_64(parts: Sequence[memoryview]) -> int:
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0])
    state = xxhash.xxh3_64()
    for part in parts:
        state.update(part)
    return state.intdigest()


CHECKSUMS: dict[str, Callable[[Sequence[memoryview]], int]] = {"crc32": _crc32, "xxh3_64": _xxh3_64}
"""Block checksums by metadata name: each maps the pieces of one block, laid end to end, to
an int (both release the GIL on large buffers, so reader threads check in parallel)."""
CHECKSUM = "xxh3_64"
"""What new checkpoints are written with."""

_STEP_DIR = re.compile(r"^step_(\d+)$")
_DATA_FILE = re.compile(r"^data_\d+\.bin$")

DTYPES = {
    str(t).removeprefix("torch."): t
    for t in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{int(step)}"


def step_of_dir(path: Path) -> Optional[int]:
    """The step a ``step_<N>`` directory's name gives, None for any other name."""
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def tmp_dir(root: Path, step: int) -> Path:
    return Path(root) / f".tmp_step_{int(step)}"


def data_file_name(rank: int) -> str:
    return f"data_{rank}.bin"


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise CheckpointError(f"dtype {dtype} cannot be stored; allowed: {sorted(DTYPES)}")
    return name


def confined(directory: Path, relative: str) -> Path:
    """``directory / relative`` after checking that it names a data file inside it."""
    if not _DATA_FILE.match(relative) or Path(relative).name != relative:
        raise CheckpointError(
            f"metadata names file {relative!r}: only data_<rank>.bin inside the checkpoint is allowed"
        )
    return directory / relative


@dataclasses.dataclass
class Chunk:
    """One saved box of one tensor: where it lies in the tensor and on disk."""

    offsets: list[int]
    shape: list[int]
    file: str
    byte_offset: int
    nbytes: int
    checksums: list[int]
    """The metadata's ``checksum`` of each BLOCK_BYTES block of the chunk's bytes."""


@dataclasses.dataclass
class TensorEntry:
    dtype: str
    shape: list[int]
    chunks: list[Chunk]


@dataclasses.dataclass
class Metadata:
    step: int
    tensors: dict[str, TensorEntry]
    extra: dict
    layout: dict
    """The saving layout (world size and Megatron parallel sizes): information only."""
    rng: dict[str, dict]
    """Per saving rank (str key): RNG states, see :mod:`.rng`."""
    optimizer: Optional[dict] = None
    """Non-tensor optimizer state: param groups (with step) and grad scaler."""
    hosts: dict[str, str] = dataclasses.field(default_factory=dict)
    """Per saving rank (str key): the host it ran on, whose writer wrote its ``data_<rank>.bin``
    if it had chunks to write (information only; empty in checkpoints written before it was
    recorded)."""
    format: str = FORMAT
    checksum: str = CHECKSUM
    """The block checksum's name in :data:`CHECKSUMS` (crc32 for format 1)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Metadata":
        raw = json.loads(text)
        if raw.get("format") == FORMAT_1:
            raw["checksum"] = "crc32"
            for entry in raw["tensors"].values():
                for chunk in entry["chunks"]:
                    chunk["checksums"] = chunk.pop("crc32")
        elif raw.get("format") != FORMAT:
            raise CheckpointError(
                f"unknown checkpoint format {raw.get('format')!r}; this reader knows {FORMAT!r} and {FORMAT_1!r}"
            )
        if raw.get("checksum") not in CHECKSUMS:
            raise CheckpointError(
                f"unknown block checksum {raw.get('checksum')!r}; this reader knows {sorted(CHECKSUMS)}"
            )
        raw["tensors"] = {
            name: TensorEntry(e["dtype"], e["shape"], [Chunk(**c) for c in e["chunks"]])
            for name, e in raw["tensors"].items()
        }
        return cls(**raw)


def block_checksums(data: memoryview, checksum: str = CHECKSUM) -> list[int]:
    """``checksum`` of each BLOCK_BYTES block of ``data`` (one for empty data)."""
    of = CHECKSUMS[checksum]
    return [of([data[i : i + BLOCK_BYTES]]) for i in range(0, max(len(data), 1), BLOCK_BYTES)]


# --- JSON for small non-tensor state (RNG states, grad scaler): tensors as base64 --------


def encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"__tensor__": base64.b64encode(raw).decode(), "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
    if isinstance(value, dict):
        return {"__dict__": [[encode(k), encode(v)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # numpy arrays and scalars
        return {"__numpy__": value.tolist(), "dtype": str(value.dtype)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"cannot store a {type(value).__name__} in checkpoint metadata")


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        raw = bytearray(base64.b64decode(value["__tensor__"]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(DTYPES[value["dtype"]]).reshape(value["shape"]).clone()
    if "__dict__" in value:
        return {_hashable(decode(k)): decode(v) for k, v in value["__dict__"]}
    if "__tuple__" in value:
        return tuple(decode(v) for v in value["__tuple__"])
    if "__numpy__" in value:
        import numpy as np

        return np.asarray(value["__numpy__"], dtype=value["dtype"])
    return {k: decode(v) for k, v in value.items()}


def _hashable(key):
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


# --- steps on disk --------------------------------------------------------------------


def committed_steps(root: Path) -> list[int]:
    """Steps whose directory holds a COMMIT marker, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / COMMIT).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_step(root: Path) -> Optional[int]:
    """The newest committed step. Scanning decides: ``latest`` is written for people and
    tools, but a crash between the commit rename and its update must not hide a step."""
    steps = committed_steps(root)
    return steps[-1] if steps else None


WHAT_IS_A_CHECKPOINT = "a checkpoint root holds step_<N>/ directories with a COMMIT marker"


def resolve_step(root: Path, step: Optional[int] = None) -> int:
    """``step``, or the newest committed step, after checking that ``root`` holds it.

    Every reader (load, inspect, export) asks here first, so a path that is not a
    checkpoint is refused with one line naming what is wrong before anything is built.
    """
    root = Path(root)
    if not root.exists():
        raise CheckpointError(f"{root} does not exist ({WHAT_IS_A_CHECKPOINT})")
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory ({WHAT_IS_A_CHECKPOINT})")
    steps = committed_steps(root)
    if not steps:
        pending = sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp_step_"))
        unfinished = f"; unfinished saves: {', '.join(pending)}" if pending else ""
        raise CheckpointError(
            f"{root} is not a checkpoint: no committed step in it{unfinished} ({WHAT_IS_A_CHECKPOINT})"
        )
    if step is None:
        return steps[-1]
    if step not in steps:
        raise CheckpointError(f"step {step} is not a committed checkpoint under {root}; committed steps: {steps}")
    return step


def read_metadata(root: Path, step: int) -> Metadata:
    """The metadata of a committed step, checked against the crc in its COMMIT marker."""
    directory = step_dir(root, step)
    try:
        commit = json.loads((directory / COMMIT).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{directory} is not a committed checkpoint ({e})") from e
    text = (directory / METADATA).read_bytes()
    if zlib.crc32(text) != commit["metadata_crc32"]:
        raise CheckpointError(f"{directory / METADATA}: checksum mismatch (file corrupt)")
    return Metadata.from_json(text.decode())


def fsync_path(path: Path) -> None:
    """fsync a file or directory (directories make renames and new entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary name, fsync, rename."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
