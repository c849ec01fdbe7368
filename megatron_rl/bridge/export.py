"""A sharded Megatron model -> full HF-named tensors, streamed (weight sync, HF export).

The global plan (which rank holds which main-replica piece of which tensor, and which
Megatron tensors make up which HF tensors) is computed once per model with one metadata
exchange and cached. After that, each step moves one *unit* (the smallest set of
Megatron tensors that closes over a set of HF tensors: a layer's linear_qkv -> q/k/v, one
expert's linear_fc1 -> gate/up, or all experts of a layer in the fused style): each owner
broadcasts its pieces of the unit as one flat tensor, every rank assembles the unit's HF
tensors, yields them, and drops them. Peak memory is one unit, whatever the layout.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import weakref
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl import platform
from megatron_rl.bridge.families import PER_EXPERT, canonical, rules_for
from megatron_rl.bridge.hf_files import write_checkpoint
from megatron_rl.bridge.mapping import BridgeError, TensorMap, expand
from megatron_rl.models.hf_config import ModelArch
from megatron_rl.parallel.shards import local_shards

DEFAULT_MAX_FILE_BYTES = 2 * 1024**3
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# (megatron name, offsets, local shape) of one piece an owner sends
_Part = tuple[str, tuple[int, ...], tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class Unit:
    megatron: tuple[str, ...]
    hf: tuple[str, ...]
    sources: tuple[tuple[int, tuple[_Part, ...]], ...]
    """(owner rank, the pieces it sends in packing order), owners ascending."""
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    tmap: TensorMap
    units: tuple[Unit, ...]

    def hf_specs(self, dtype: Optional[torch.dtype] = None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, shape, dtype) of every HF tensor, in the order the stream yields them."""
        return [(h, self.tmap.hf_shapes[h], dtype or u.dtype) for u in self.units for h in u.hf]


_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _root(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


def export_plan(chunks: Sequence[torch.nn.Module], arch: ModelArch, style: str = PER_EXPERT) -> ExportPlan:
    """The cached global plan of this model (collective on first use for this model/style)."""
    cache = _PLANS.setdefault(_root(chunks[0]), {})
    if (arch, style) not in cache:
        cache[arch, style] = _build_plan(chunks, arch, style)
    return cache[arch, style]


def _gather_metadata(chunks) -> list[list[tuple]]:
    """Every rank's main-replica pieces as (name, global shape, offsets, shape, dtype)."""
    mine = [
        (s.name, tuple(s.global_shape), tuple(s.offsets), tuple(s.data.shape), str(s.data.dtype).replace("torch.", ""))
        for s in local_shards(chunks)
        if s.is_main_replica
    ]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # once per model: metadata only, never tensor data
    return everyone


def _build_plan(chunks, arch: ModelArch, style: str) -> ExportPlan:
    metadata = _gather_metadata(chunks)
    owners: dict[str, list[tuple[int, tuple, tuple]]] = {}
    global_shape: dict[str, tuple] = {}
    dtype_of: dict[str, torch.dtype] = {}
    for rank, pieces in enumerate(metadata):
        for name, shape, offsets, local, dtype in pieces:
            name = canonical(name)
            owners.setdefault(name, []).append((rank, offsets, local))
            global_shape[name] = shape
            dtype_of[name] = getattr(torch, dtype)
    padded_vocab = global_shape.get("embedding.word_embeddings.weight", (arch.vocab_size,))[0]
    tmap = expand(rules_for(arch.family, style), arch, padded_vocab)
    _check_model(tmap, owners, global_shape, arch)
    units = [_unit(names, hf, owners, dtype_of) for names, hf in hf_groups(tmap)]
    return ExportPlan(tmap=tmap, units=tuple(units))


def _check_model(tmap: TensorMap, owners, global_shape, arch: ModelArch) -> None:
    unmapped = sorted(set(owners) - set(tmap.megatron_shapes))
    absent = sorted(set(tmap.megatron_shapes) - set(owners))
    if unmapped:
        raise BridgeError(f"{arch.family}: Megatron tensors with no HF mapping: {unmapped[:8]}")
    if absent:
        raise BridgeError(f"{arch.family}: the model lacks tensors the HF mapping needs: {absent[:8]}")
    for name, pieces in owners.items():
        if global_shape[name] != tmap.megatron_shapes[name]:
            raise BridgeError(
                f"{arch.family}: Megatron tensor {name} has shape {global_shape[name]}, "
                f"the HF mapping expects {tmap.megatron_shapes[name]}"
            )
        if sum(math.prod(local) for _, _, local in pieces) != math.prod(global_shape[name]):
            raise BridgeError(f"main-replica pieces of {name} do not tile it exactly: {pieces}")


def hf_groups(tmap: TensorMap) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """(Megatron names, HF names) groups, in stream order: each group's HF tensors are made
    of that group's Megatron tensors only (the unit of memory of every export)."""
    out = []
    for names in _components(tmap):
        hf: dict[str, None] = {}
        for m in names:
            hf.update((p.hf, None) for p in tmap.pieces_of_megatron[m])
        out.append((tuple(names), tuple(hf)))
    return out


def _components(tmap: TensorMap) -> list[list[str]]:
    """Megatron names grouped so that each group's HF tensors need only that group."""
    parent = {m: m for m in tmap.megatron_shapes}

    def find(m):
        while parent[m] != m:
            parent[m] = parent[parent[m]]
            m = parent[m]
        return m

    for pieces in tmap.pieces_of_hf.values():
        first = find(pieces[0].megatron)
        for p in pieces[1:]:
            parent[find(p.megatron)] = first
    groups: dict[str, list[str]] = {}
    for m in tmap.megatron_shapes:  # insertion order: deterministic on every rank
        groups.setdefault(find(m), []).append(m)
    position = {m: i for i, m in enumerate(tmap.megatron_shapes)}
    return sorted(groups.values(), key=lambda names: _order_key(names[0], position[names[0]]))


def _order_key(first: str, position: int) -> tuple:
    """Embeddings first, then layer by layer, then the final norm and LM head."""
    match = re.match(r"decoder\.layers\.(\d+)\.", first)
    if match:
        return (1, int(match.group(1)), position)
    return (0 if first.startswith("embedding.") else 2, 0, position)


def _unit(names, hf, owners, dtype_of) -> Unit:
    dtypes = {dtype_of[m] for m in names}
    if len(dtypes) != 1:
        raise BridgeError(f"tensors {names} that form one HF tensor have different dtypes {dtypes}")
    by_rank: dict[int, list[_Part]] = {}
    for m in names:
        for rank, offsets, local in sorted(owners[m]):
            by_rank.setdefault(rank, []).append((m, offsets, local))
    return Unit(
        megatron=tuple(names),
        hf=tuple(hf),
        sources=tuple((rank, tuple(parts)) for rank, parts in sorted(by_rank.items())),
        dtype=dtypes.pop(),
    )


def _index(offsets, shape) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, shape))


def _gather_unit(unit: Unit, tmap: TensorMap, local: dict, rank: int, world: int, device) -> dict[str, torch.Tensor]:
    """The unit's full Megatron tensors on every rank: one broadcast per owner."""
    full = {m: torch.empty(tmap.megatron_shapes[m], dtype=unit.dtype, device=device) for m in unit.megatron}
    for owner, parts in unit.sources:
        if owner == rank:
            flat = torch.cat([local[m, offsets].reshape(-1).to(device, unit.dtype) for m, offsets, _ in parts])
        else:
            flat = torch.empty(sum(math.prod(shape) for _, _, shape in parts), dtype=unit.dtype, device=device)
        if world > 1:
            dist.broadcast(flat, src=owner)
        cursor = 0
        for m, offsets, shape in parts:
            n = math.prod(shape)
            full[m][_index(offsets, shape)] = flat[cursor : cursor + n].view(shape)
            cursor += n
    return full


def assemble_hf(h: str, tmap: TensorMap, full: dict[str, torch.Tensor]) -> torch.Tensor:
    """HF tensor ``h`` from the full Megatron tensors of its group."""
    pieces = tmap.pieces_of_hf[h]
    shape = tmap.hf_shapes[h]
    p = pieces[0]
    source = full[p.megatron]
    if len(pieces) == 1 and not p.hf_lead and tuple(source.shape) == shape:
        return source  # the HF tensor is the Megatron tensor (no padding)
    out = torch.empty(shape, dtype=source.dtype, device=source.device)
    for p in pieces:
        out[(*p.hf_lead, slice(*p.hf_rows))] = full[p.megatron][p.rows[0] : p.rows[1]]
    return out


def iter_hf_tensors(
    chunks: Sequence[torch.nn.Module],
    arch: ModelArch,
    dtype: Optional[torch.dtype] = None,
    style: str = PER_EXPERT,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the whole model, identical on every rank.

    Collective over the default group: every rank must call it and consume it fully, in
    the same order. ``style`` picks per-expert (``save_pretrained``) or fused expert names.
    """
    plan = export_plan(chunks, arch, style)
    local = {
        (canonical(s.name), tuple(s.offsets)): s.data.detach()
        for s in local_shards(chunks)
        if s.is_main_replica
    }
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = platform.current().device
    with torch.no_grad():
        for unit in plan.units:
            full = _gather_unit(unit, plan.tmap, local, rank, world, device)
            for h in unit.hf:
                tensor = assemble_hf(h, plan.tmap, full)
                yield h, tensor if dtype is None else tensor.to(dtype)
            del full


def config_dtype(hf_config: Optional[dict]) -> Optional[torch.dtype]:
    """The dtype an HF config names (``dtype`` or the older ``torch_dtype``), if any."""
    for key in ("dtype", "torch_dtype"):
        value = (hf_config or {}).get(key)
        if value in _DTYPES:
            return _DTYPES[value]
    return None


def config_with_dtype(hf_config: dict, dtype: torch.dtype) -> dict:
    """``hf_config`` saying the dtype the tensors are written in."""
    config = dict(hf_config, dtype=str(dtype).replace("torch.", ""))
    config.pop("torch_dtype", None)
    return config


def save_hf(
    chunks: Sequence[torch.nn.Module],
    arch: ModelArch,
    out_dir: str | os.PathLike,
    hf_config: Optional[dict],
    style: str = PER_EXPERT,
    dtype: Optional[torch.dtype] = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> None:
    """Write the model as an HF checkpoint directory (collective; rank 0 writes).

    Tensors are written in ``dtype``, else the dtype named in ``hf_config``, else the
    model's. The directory appears atomically (written under a temporary name, renamed).
    """
    dtype = dtype or config_dtype(hf_config)
    plan = export_plan(chunks, arch, style)
    specs = plan.hf_specs(dtype)
    rank = dist.get_rank() if dist.is_initialized() else 0
    problem = [None]
    if rank == 0 and os.path.exists(out_dir) and os.listdir(out_dir):
        problem[0] = f"output directory {os.fspath(out_dir)!r} exists and is not empty"
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise FileExistsError(problem[0])
    config = None if hf_config is None else config_with_dtype(hf_config, specs[0][2])
    stream = iter_hf_tensors(chunks, arch, dtype, style)
    if rank == 0:
        write_checkpoint(out_dir, specs, stream, config, max_file_bytes)
    else:
        for _ in stream:
            pass
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
