"""The reader on multi-block chunks, one process: every path it places bytes by (straight into
the destination, through a scratch buffer) gives the saved values on any number of threads,
and a flipped byte anywhere in a block a read touches is caught, named by file and tensor."""

import pytest
import torch

from megatron_rl.checkpoint import Checkpointer
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
    items = [Item("w", (ROWS, COLS), offsets, torch.zeros(shape, dtype=dtype)) for offsets, shape in boxes]
    with Reader(fmt.step_dir(root, 1), meta, threads=threads) as reader:
        reader.fill(items)
    return [i.data for i in items]


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


def test_a_flipped_byte_outside_the_box_but_inside_a_block_it_reads_is_caught(saved, tmp_path):
    root, _ = saved
    copy = tmp_path / "copy"
    (copy / "step_1").mkdir(parents=True)
    for f in (root / "step_1").iterdir():
        (copy / "step_1" / f.name).write_bytes(f.read_bytes())
    data = copy / "step_1" / "data_0.bin"
    raw = bytearray(data.read_bytes())
    raw[3 * COLS * 4 + 11] ^= 0x01  # row 3: not in rows 10..509, but in their first block
    data.write_bytes(bytes(raw))
    with pytest.raises(fmt.CheckpointError, match=r"checksum mismatch in .*data_0\.bin: tensor w, chunk at offsets"):
        _fill(copy, [((10, 0), (20, COLS))], threads=4)
    assert _fill(copy, [((300, 0), (20, COLS))], threads=4)  # the other chunk's blocks are intact
    with Reader(fmt.step_dir(copy, 1), fmt.read_metadata(copy, 1)) as reader, pytest.raises(fmt.CheckpointError):
        reader.verify()
