"""The reader on multi-block chunks, one process: every path it places bytes by (straight into
the destination, through a scratch buffer) gives the saved values on any number of threads;
a flipped byte anywhere in a block a read touches is caught, named by file and tensor; a
format-1 checkpoint (crc32 blocks) still loads and is still verified; an unknown format or
checksum is refused in one line."""

import json
import zlib

import pytest
import torch

from megatron_rl.checkpoint import Checkpointer, cli
from megatron_rl.checkpoint import format as fmt
from megatron_rl.checkpoint.items import Item
from megatron_rl.checkpoint.reader import Reader

HEADER = {"extra": {}, "layout": {"world_size": 1}}
RECORD = {"rng": None, "optimizer": None}
ROWS, COLS = 600, 1024
"""One float32 row is 4 KiB: a 1 MiB checksum block holds 256 rows, a 300-row chunk spans two
blocks, and the 600-row tensor saved as two chunks gives blocks that end mid-chunk."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    full = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))
    halves = [Item("w", (ROWS, COLS), (0, 0), full[:300]), Item("w", (ROWS, COLS), (300, 0), full[300:])]
    with Checkpointer() as ckpt:
        ckpt.save_items(root, 1, halves, HEADER, RECORD).wait()
    return root, full


def _fill(root, boxes, threads, dtype=torch.float32):
    """Each (offsets, shape) box of 'w' read into a new tensor, all in one ``fill``."""
    meta = fmt.read_metadata(root, 1)
    whole = tuple(meta.tensors["w"].shape)
    items = [Item("w", whole, offsets, torch.zeros(shape, dtype=dtype)) for offsets, shape in boxes]
    with Reader(fmt.step_dir(root, 1), meta, threads=threads) as reader:
        reader.fill(items)
    return [i.data for i in items]


def _copy_step(root, dest):
    """A copy of step 1 under ``dest`` (to damage without touching the shared one)."""
    (dest / "step_1").mkdir(parents=True)
    for f in (root / "step_1").iterdir():
        (dest / "step_1" / f.name).write_bytes(f.read_bytes())
    return dest


BOXES = [
    ((0, 0), (ROWS, COLS)),  # across both chunks, each read straight into place
    ((10, 0), (500, COLS)),  # mid-block at both ends: the widened head and tail are read apart
    ((250, 0), (20, COLS)),  # a few rows across a block boundary (row 256)
    ((0, 100), (ROWS, 7)),  # columns: strided in the chunk, read through a scratch buffer
    ((299, 3), (2, 5)),  # five elements of one row from each chunk
]


@pytest.mark.parametrize("threads", [1, 4])
def test_every_read_path_gives_the_saved_values(saved, threads):
    root, full = saved
    for (offsets, shape), got in zip(BOXES, _fill(root, BOXES, threads)):
        want = full[offsets[0] : offsets[0] + shape[0], offsets[1] : offsets[1] + shape[1]]
        assert got.equal(want), (offsets, shape)
    (converted,) = _fill(root, BOXES[1:2], threads, dtype=torch.float64)  # another dtype: copied, converted
    assert converted.equal(full[10:510].double())


def test_new_checkpoints_name_their_checksum(saved):
    meta = fmt.read_metadata(saved[0], 1)
    assert (meta.format, meta.checksum) == ("megatron_rl.checkpoint/2", "xxh3_64")


def test_a_flipped_byte_outside_the_box_but_inside_a_block_it_reads_is_caught(saved, tmp_path):
    root, _ = saved
    copy = _copy_step(root, tmp_path / "copy")
    data = copy / "step_1" / "data_0.bin"
    raw = bytearray(data.read_bytes())
    raw[3 * COLS * 4 + 11] ^= 0x01  # row 3: not in rows 10..509, but in their first block
    data.write_bytes(bytes(raw))
    with pytest.raises(fmt.CheckpointError, match=r"checksum mismatch in .*data_0\.bin: tensor w, chunk at offsets"):
        _fill(copy, [((10, 0), (20, COLS))], threads=4)
    assert _fill(copy, [((300, 0), (20, COLS))], threads=4)  # the other chunk's blocks are intact
    with Reader(fmt.step_dir(copy, 1), fmt.read_metadata(copy, 1)) as reader, pytest.raises(fmt.CheckpointError):
        reader.verify()


def _write_format_1(root, tensor):
    """One committed step as megatron_rl.checkpoint/1 wrote it: a ``crc32`` list per chunk."""
    step = root / "step_1"
    step.mkdir(parents=True)
    raw = tensor.numpy().tobytes()
    (step / "data_0.bin").write_bytes(raw)
    crcs = [zlib.crc32(raw[i : i + fmt.BLOCK_BYTES]) for i in range(0, len(raw), fmt.BLOCK_BYTES)]
    chunk = {"offsets": [0, 0], "shape": list(tensor.shape), "file": "data_0.bin", "byte_offset": 0}
    entry = {"dtype": "float32", "shape": list(tensor.shape), "chunks": [dict(chunk, nbytes=len(raw), crc32=crcs)]}
    meta = {"step": 1, "tensors": {"w": entry}, "extra": {}, "layout": {}, "rng": {}, "optimizer": None}
    text = json.dumps(dict(meta, format="megatron_rl.checkpoint/1")).encode()
    (step / "metadata.json").write_bytes(text)
    (step / "COMMIT").write_text(json.dumps({"step": 1, "metadata_crc32": zlib.crc32(text)}))
    return step


def _rewrite_metadata(step, change):
    meta = json.loads((step / "metadata.json").read_text())
    change(meta)
    text = json.dumps(meta).encode()
    (step / "metadata.json").write_bytes(text)
    (step / "COMMIT").write_text(json.dumps({"step": 1, "metadata_crc32": zlib.crc32(text)}))


def test_a_format_1_checkpoint_loads_verified_by_its_crc32(tmp_path, capsys):
    full = torch.randn(300, COLS, generator=torch.Generator().manual_seed(1))
    step = _write_format_1(tmp_path, full)
    assert fmt.read_metadata(tmp_path, 1).checksum == "crc32"
    (got,) = _fill(tmp_path, [((0, 0), (300, COLS))], threads=4)
    assert got.equal(full)
    raw = bytearray((step / "data_0.bin").read_bytes())
    raw[-5] ^= 0x40  # the second block
    (step / "data_0.bin").write_bytes(bytes(raw))
    with pytest.raises(fmt.CheckpointError, match=r"checksum mismatch in .*data_0\.bin: tensor w"):
        _fill(tmp_path, [((290, 0), (10, COLS))], threads=4)
    _rewrite_metadata(step, lambda m: m.update(format="megatron_rl.checkpoint/9"))
    assert cli.main(["inspect", str(tmp_path)]) == cli.BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown checkpoint format 'megatron_rl.checkpoint/9'" in err


def test_an_unknown_checksum_is_refused(saved, tmp_path, capsys):
    _copy_step(saved[0], tmp_path)
    _rewrite_metadata(tmp_path / "step_1", lambda m: m.update(checksum="sha3"))
    assert cli.main(["inspect", str(tmp_path), "--verify"]) == cli.BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown block checksum 'sha3'; this reader knows ['crc32', 'xxh3_64']" in err
