"""HF safetensors -> a sharded Megatron model, each rank reading only the slices it owns.

No collectives: every rank checks the checkpoint's names and shapes (headers only), then
fills each of its local shards from the HF rows that shard covers.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Optional, Sequence

import torch

from megatron_rl.bridge.families import canonical, detect_style, rules_for
from megatron_rl.bridge.hf_files import HFCheckpoint, SliceReader
from megatron_rl.bridge.mapping import BridgeError, Piece, TensorMap, expand
from megatron_rl.models.hf_config import ModelArch
from megatron_rl.parallel.shards import LocalShard, local_shards

_VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")
_SHOWN = 8  # names listed in an error before "... and N more"


def _listing(names) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def padded_vocab_of(shards: Sequence[LocalShard], arch: ModelArch) -> int:
    """Megatron's (TP-padded) vocabulary rows, read off the model's embedding/output shard."""
    for shard in shards:
        if shard.name in _VOCAB_TENSORS:
            return shard.global_shape[0]
    return arch.vocab_size  # this stage holds neither: the value is not used


def tensor_map(arch: ModelArch, style: str, padded_vocab: int) -> TensorMap:
    return expand(rules_for(arch.family, style), arch, padded_vocab)


VALUE_HEAD_PREFIX = "output_layer."


def check_megatron_side(shards: Sequence[LocalShard], tmap: TensorMap, arch: ModelArch) -> None:
    """Every model tensor has a rule and the shape the rule expects."""
    unmapped = sorted({s.name for s in shards if canonical(s.name) not in tmap.megatron_shapes})
    if unmapped:
        raise BridgeError(f"{arch.family}: Megatron tensors with no HF mapping: {_listing(unmapped)}")
    for shard in shards:
        expected = tmap.megatron_shapes[canonical(shard.name)]
        if tuple(shard.global_shape) != expected:
            raise BridgeError(
                f"{arch.family}: Megatron tensor {shard.name} has shape {tuple(shard.global_shape)}, "
                f"the HF mapping expects {expected} (model built from a different config?)"
            )


def check_hf_side(ckpt: HFCheckpoint, reader: SliceReader, tmap: TensorMap, arch: ModelArch) -> None:
    """The checkpoint holds exactly the expected tensors, with the expected shapes."""
    present = set(ckpt.names())
    expected = set(tmap.hf_shapes)
    missing = expected - present
    ignorable = {"lm_head.weight"} if arch.tie_word_embeddings else set()  # some tied checkpoints keep a copy
    unexpected = present - expected - ignorable
    if missing:
        raise BridgeError(f"{ckpt.path}: missing tensors for {arch.family}: {_listing(missing)}")
    if unexpected:
        raise BridgeError(f"{ckpt.path}: unexpected tensors for {arch.family}: {_listing(unexpected)}")
    for name, shape in tmap.hf_shapes.items():
        found = tuple(reader.slice(name).get_shape())
        if found != shape:
            raise BridgeError(f"{ckpt.path}: tensor {name} has shape {found}, expected {shape}")


def fill_shard(shard: LocalShard, pieces: Sequence[Piece], reader: SliceReader) -> None:
    """Copy the HF rows (and columns) under ``shard`` into it; rows no piece covers are
    vocabulary padding and become zero."""
    rows, *cols = shard.index
    start, stop = rows.start, rows.stop
    overlaps = []
    for p in pieces:
        lo, hi = max(start, p.rows[0]), min(stop, p.rows[1])
        if lo < hi:
            overlaps.append((p, lo, hi))
    with torch.no_grad():
        if sum(hi - lo for _, lo, hi in overlaps) < stop - start:
            shard.data.zero_()
        for p, lo, hi in overlaps:
            first = p.hf_rows[0] + lo - p.rows[0]
            part = reader.slice(p.hf)[(*p.hf_lead, slice(first, first + hi - lo), *cols)]
            shard.data[lo - start : hi - start].copy_(part)


def load_hf(
    chunks: Sequence[torch.nn.Module],
    hf_dir: str | os.PathLike,
    arch: ModelArch,
    progress: Optional[Callable[[Iterable], Iterable]] = None,
    backbone_only: bool = False,
) -> str:
    """Load an HF checkpoint into this rank's part of ``chunks`` (any layout); returns the
    checkpoint's expert style (``"per_expert"`` or ``"fused"``) so an export can match it.
    ``progress`` wraps the loop over local tensors (e.g. ``tqdm``). ``backbone_only`` loads a
    critic: every tensor but its value head (``output_layer.*``) comes from the checkpoint."""
    ckpt = HFCheckpoint(hf_dir)
    style = detect_style(ckpt.names())
    shards = local_shards(chunks)
    if backbone_only:  # a critic: its value head replaces the LM head and keeps its own init
        shards = [s for s in shards if not s.name.startswith(VALUE_HEAD_PREFIX)]
    tmap = tensor_map(arch, style, padded_vocab_of(shards, arch))
    check_megatron_side(shards, tmap, arch)
    with ckpt.reader() as reader:
        check_hf_side(ckpt, reader, tmap, arch)
    for shard in (progress or iter)(shards):
        # One reader per shard: the memory map of what it read is released right after.
        with ckpt.reader() as reader:
            fill_shard(shard, tmap.pieces_of_megatron[canonical(shard.name)], reader)
    return style
