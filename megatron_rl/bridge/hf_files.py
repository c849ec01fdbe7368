"""HF safetensors directories: find which file holds a tensor, read slices, write shards.

Reading goes through ``safe_open(...).get_slice`` so a rank reads only the rows and columns
it owns. Writing streams: the header of each shard file is written first from the known
names, shapes and dtypes, then tensor bytes are appended as they arrive, so the writer
never holds more than one tensor.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, NamedTuple, Optional, Sequence

import torch

INDEX_FILE = "model.safetensors.index.json"
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
"""Files of an HF model directory besides its weights and config that a user of the model
needs (tokenizer, chat template, generation defaults): an export carries them over."""


def side_files(hf_dir: str | os.PathLike) -> list[Path]:
    """The :data:`SIDE_FILES` present in ``hf_dir``."""
    return [Path(hf_dir) / name for name in SIDE_FILES if (Path(hf_dir) / name).is_file()]


#: torch dtype <-> safetensors dtype tag
DTYPE_TAGS = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


DIGEST_BLOCKS, DIGEST_BLOCK_BYTES = 8, 4096
"""What :func:`weights_digest` reads of a tensor: all of it up to 8 x 4 KiB, else 8 blocks
of 4 KiB spread evenly over its bytes (a fine-tune or another seed changes every block)."""


def weights_digest(hf_dir: str | os.PathLike) -> str:
    """A SHA-256 hex digest of an HF directory's weights, read in seconds for any size: every
    tensor's name, dtype and shape, and :data:`DIGEST_BLOCKS` blocks of its bytes. The same
    weights sharded into other files give the same digest; what a LoRA checkpoint records of
    the base its adapters belong to (a base with other weights differs in every block)."""
    import hashlib

    digest = hashlib.sha256()
    for name, file, entry, data_start in sorted(_safetensors_entries(Path(hf_dir))):
        begin, end = (data_start + offset for offset in entry["data_offsets"])
        digest.update(json.dumps([name, entry["dtype"], entry["shape"]]).encode())
        with open(file, "rb") as f:
            if end - begin <= DIGEST_BLOCKS * DIGEST_BLOCK_BYTES:
                f.seek(begin)
                digest.update(f.read(end - begin))
                continue
            step = (end - begin - DIGEST_BLOCK_BYTES) // (DIGEST_BLOCKS - 1)
            for k in range(DIGEST_BLOCKS):
                f.seek(begin + k * step)
                digest.update(f.read(DIGEST_BLOCK_BYTES))
    return digest.hexdigest()


def _safetensors_entries(hf_dir: Path) -> list[tuple[str, Path, dict, int]]:
    """(tensor name, file, header entry, where the file's data starts) of every tensor."""
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(hf_dir)!r}")
    out = []
    for file in files:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        out.extend((name, file, entry, 8 + length) for name, entry in header.items() if name != "__metadata__")
    return out


class HFCheckpoint:
    """The tensors of one HF checkpoint directory, read lazily by name."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"HF checkpoint directory {str(self.path)!r} does not exist")
        self.file_of = self._locate()

    def _locate(self) -> dict[str, Path]:
        from safetensors import safe_open

        index = self.path / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.path / file for name, file in weight_map.items()}
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {str(self.path)!r}")
        out = {}
        for file in files:
            with safe_open(file, "pt") as f:
                out.update({name: file for name in f.keys()})
        return out

    def names(self) -> list[str]:
        return list(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        from safetensors import safe_open

        with safe_open(self.file_of[name], "pt") as f:
            return tuple(f.get_slice(name).get_shape())

    @contextlib.contextmanager
    def reader(self) -> Iterator["SliceReader"]:
        """Open files on demand for a batch of reads; closed (unmapped) on exit."""
        reader = SliceReader(self.file_of)
        try:
            yield reader
        finally:
            reader.close()


class SliceReader:
    def __init__(self, file_of: dict[str, Path]):
        self._file_of = file_of
        self._open: dict[Path, object] = {}
        self._stack = contextlib.ExitStack()

    def slice(self, name: str):
        """safetensors' lazy slice of ``name``: index it to read only that part."""
        from safetensors import safe_open

        file = self._file_of[name]
        if file not in self._open:
            self._open[file] = self._stack.enter_context(safe_open(file, "pt"))
        return self._open[file].get_slice(name)

    def close(self) -> None:
        self._stack.close()
        self._open.clear()


# ---- writing


class TensorSpec(NamedTuple):
    """A tensor to write, known before its data arrives (the header is written first)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.tensor([], dtype=dtype).element_size()


def plan_files(specs: Sequence[TensorSpec], max_file_bytes: int) -> list[list[int]]:
    """Split tensors (in order) into files of at most ``max_file_bytes`` (one big tensor
    alone may exceed it)."""
    files: list[list[int]] = [[]]
    size = 0
    for i, (_, shape, dtype) in enumerate(specs):
        n = _nbytes(shape, dtype)
        if files[-1] and size + n > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(i)
        size += n
    return files


class StreamingSafetensorsWriter:
    """Writes one safetensors file whose tensors are known in advance, one at a time."""

    def __init__(self, path: Path, specs: Sequence[TensorSpec]):
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        self._expected = []
        for name, shape, dtype in specs:
            n = _nbytes(shape, dtype)
            header[name] = {"dtype": DTYPE_TAGS[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._expected.append(TensorSpec(name, tuple(shape), dtype))
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want = self._expected[self._next]
        got = TensorSpec(name, tuple(tensor.shape), tensor.dtype)
        if got != want:
            raise RuntimeError(f"safetensors writer expected {want}, got {got}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self._expected):
            missing = [spec.name for spec in self._expected[self._next :]]
            raise RuntimeError(f"safetensors file closed before tensors {missing[:5]} were written")


def write_checkpoint(
    out_dir: str | os.PathLike,
    specs: Sequence[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: Optional[dict],
    max_file_bytes: int,
    copy_files: Sequence[Path] = (),
) -> Path:
    """Stream ``tensors`` (in ``specs`` order) into a new HF directory, atomically.

    Everything, ``copy_files`` (e.g. the tokenizer) included, goes to a temporary sibling
    directory that is renamed to ``out_dir`` at the end, so a crash never leaves a
    half-written checkpoint under the final name.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"output directory {str(out)!r} exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        groups = plan_files(specs, max_file_bytes)
        names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        weight_map = {}
        stream = iter(tensors)
        for file, members in zip(names, groups):
            writer = StreamingSafetensorsWriter(tmp / file, [specs[i] for i in members])
            for _ in members:
                name, tensor = next(stream)
                writer.write(name, tensor)
                weight_map[name] = file
            writer.close()
        if next(stream, None) is not None:
            raise RuntimeError("more tensors than planned for the HF checkpoint")
        total = sum(_nbytes(shape, dtype) for _, shape, dtype in specs)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        for file in copy_files:
            shutil.copyfile(file, tmp / Path(file).name)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
