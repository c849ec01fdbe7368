"""Whole-checkpoint conversion between HF directories and megatron_rl checkpoints.

- HF -> Megatron: build the actor for the target layout, :func:`load_hf` (each rank reads
  its slices), and save with :mod:`megatron_rl.checkpoint`. Stored tensors are
  layout-free except for the vocabulary padding, which depends on TP; so a single
  process converts for any layout by padding the vocabulary as that TP would, and under
  torchrun with a matching world size the target layout itself is built.
- Megatron -> HF: one process, no Megatron model: read each group of canonical tensors
  from the checkpoint, map them to HF tensors and stream them into safetensors files.
  The HF config travels in the checkpoint's ``extra["hf_config"]``; the HF directory the
  weights came from in ``extra["hf_source_dir"]``, whose tokenizer and generation config
  the export copies (the checkpoint holds weights only). A reward model's checkpoint
  (``extra[MODEL_ROLE] == REWARD_MODEL``) is written as a one-label
  ``*ForSequenceClassification`` (:mod:`.sequence_classification`).

Both check their paths first (:mod:`.inputs`): a bad input fails in one line before any
model is built, and an output is never written over an existing one.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from megatron_rl.bridge import lora_export
from megatron_rl.bridge import sequence_classification as seq_cls
from megatron_rl.bridge.export import DEFAULT_MAX_FILE_BYTES, assemble_hf, config_dtype, config_with_dtype
from megatron_rl.bridge.export_plan import HFGroup, hf_groups
from megatron_rl.bridge.families import PER_EXPERT, canonical, rules_for, with_score_head
from megatron_rl.bridge.hf_files import (
    DTYPE_TAGS,
    HFCheckpoint,
    TensorSpec,
    side_files,
    weights_digest,
    write_checkpoint,
)
from megatron_rl.bridge.inputs import check_checkpoint, check_hf_model_dir, check_new_checkpoint_root, check_new_hf_dir
from megatron_rl.bridge.load import load_hf
from megatron_rl.bridge.mapping import BridgeError, expand
from megatron_rl.checkpoint import format as fmt
from megatron_rl.checkpoint.reader import Reader
from megatron_rl.config.schema import MODEL_ROLE, REWARD_MODEL
from megatron_rl.models.adapter_names import is_adapter_name, merged_weight
from megatron_rl.models.hf_config import ModelArch, arch_from_dict, arch_from_hf
from megatron_rl.parallel import ParallelConfig
from megatron_rl.utils import dtypes

Progress = Optional[Callable[[Iterable], Iterable]]


def hf_to_megatron(
    hf_dir: str | os.PathLike,
    out_root: str | os.PathLike,
    target: ParallelConfig,
    step: int = 0,
    progress: Progress = None,
) -> dict:
    """Collective (world 1 alone): convert ``hf_dir`` into a megatron_rl checkpoint at
    ``out_root``/step_``step`` meant for layout ``target``; returns the stored ``extra``."""
    import torch.distributed as dist

    from megatron_rl import checkpoint, platform
    from megatron_rl.models.builder import BuildOptions, build_model
    from megatron_rl.parallel import destroy, initialize

    hf_config = check_hf_model_dir(hf_dir)
    check_new_checkpoint_root(out_root)
    arch = arch_from_hf(hf_dir)
    platform.init_distributed()
    world = dist.get_world_size()
    if world == 1:
        build = ParallelConfig()  # same tensors; pad the vocabulary as target's TP does
        divisible_by = target.tp
    else:
        build, divisible_by = target, 1
    build.validate(world, arch.shape())
    dtype = config_dtype(hf_config) or torch.float32
    options = BuildOptions(dtype=dtypes.short_name(dtype), vocab_size_divisible_by=divisible_by)
    initialize(build, model=arch.shape())
    chunks = build_model("actor", arch, build, options)
    style = load_hf(chunks, hf_dir, arch, progress=progress)
    extra = {
        "hf_config": hf_config,
        "hf_expert_style": style,
        "hf_source_dir": str(Path(hf_dir).resolve()),
        "converted_for_layout": target.megatron_sizes(),
    }
    with checkpoint.Checkpointer() as ckpt:
        ckpt.save(out_root, step, model=chunks, extra=extra).wait()
    destroy()
    return extra


@dataclasses.dataclass
class HFExport:
    """What :func:`megatron_to_hf` wrote."""

    path: Path
    copied: list[str]
    """Tokenizer and generation-config files copied from the source HF directory."""
    no_tokenizer: Optional[str] = None
    """Why the export has no tokenizer, when it has none."""


def megatron_to_hf(
    ckpt_root: str | os.PathLike,
    out_dir: str | os.PathLike,
    step: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    style: Optional[str] = None,
    progress: Progress = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    merge: bool = False,
) -> HFExport:
    """One process: write the model of a megatron_rl checkpoint as an HF directory, with
    the tokenizer and generation config of the HF directory it came from when known. A
    reward model's checkpoint becomes a one-label ``*ForSequenceClassification``
    (:mod:`.sequence_classification`; refused when its head bias is not zero). A LoRA
    checkpoint becomes a PEFT adapter directory, or with ``merge`` a full HF directory with
    the adapters folded into the base (:mod:`.lora_export`).

    Tensors are written in ``dtype``, else the dtype the stored HF config names, else as
    stored; experts in ``style``, else the style of the HF checkpoint it came from.
    """
    root = Path(ckpt_root)
    step = check_checkpoint(root, step)
    check_new_hf_dir(out_dir)
    metadata = fmt.read_metadata(root, step)
    reward_model = metadata.extra.get(MODEL_ROLE) == REWARD_MODEL
    hf_config = metadata.extra.get("hf_config")
    if not hf_config:
        raise BridgeError(
            f"{root} step {step} has no extra['hf_config'] (it was not written by hf-to-megatron "
            "or a trainer that records the HF config), so the HF architecture is unknown"
        )
    arch = arch_from_dict(hf_config)
    style = style or metadata.extra.get("hf_expert_style", PER_EXPERT)
    stored = {canonical(n): n for n in metadata.tensors if not n.startswith("optimizer.")}
    adapters = {n: stored.pop(n) for n in list(stored) if is_adapter_name(n)}
    lora = metadata.extra.get("lora")
    if adapters and not lora:
        raise BridgeError(f"{root} step {step} holds LoRA adapters but no extra['lora'] (their rank and alpha)")
    dtype = dtype or config_dtype(hf_config)
    source = metadata.extra.get("hf_source_dir")
    if lora and lora.get("adapters_only"):  # a LoRA run's checkpoint: its base is the HF directory it records
        if merge:
            return _merged_onto_source(root, step, metadata, arch, adapters, lora, out_dir, dtype, max_file_bytes)
        return _peft_export(root, step, metadata, arch, adapters, lora, out_dir, dtype)
    vocab_rows = metadata.tensors[stored["embedding.word_embeddings.weight"]].shape[0]
    rules = rules_for(arch.family, style)
    head_bias = stored.pop(seq_cls.HEAD_BIAS, None) if reward_model else None
    tmap = expand(with_score_head(rules) if reward_model else rules, arch, vocab_rows)
    _check_stored(stored, metadata, tmap, arch)
    groups = hf_groups(tmap)
    if adapters and not merge:
        return _peft_export(root, step, metadata, arch, adapters, lora, out_dir, dtype)
    pairs = lora_export.adapter_pairs(adapters)
    scaling = float(lora["alpha"]) / int(lora["rank"]) if lora else 0.0
    copies, no_tokenizer = _source_side_files(source)
    if reward_model:
        hf_config = seq_cls.config(hf_config, seq_cls.pad_token_id(hf_config, None if no_tokenizer else source))

    def dtype_of(group: HFGroup) -> torch.dtype:
        return dtype or fmt.DTYPES[metadata.tensors[stored[group.megatron[0]]].dtype]

    specs = [TensorSpec(h, tmap.hf_shapes[h], dtype_of(group)) for group in groups for h in group.hf]
    with Reader(fmt.step_dir(root, step), metadata) as reader:
        if head_bias is not None:
            seq_cls.check_zero_bias(reader.full_tensor(head_bias), f"{root} step {step}")

        def stream():
            for group in (progress or iter)(groups):
                full = {m: reader.full_tensor(stored[m]) for m in group.megatron}
                for m in sorted(set(full) & set(pairs)):  # (pairs is empty unless merging)
                    a, b = (reader.full_tensor(adapters[n]) for n in pairs[m])
                    full[m] = merged_weight(full[m], a, b, scaling)
                for h in group.hf:
                    yield h, assemble_hf(h, tmap, full).to(dtype_of(group))

        out = write_checkpoint(
            out_dir, specs, stream(), config_with_dtype(hf_config, specs[0].dtype), max_file_bytes, copy_files=copies
        )
    return HFExport(out, [c.name for c in copies], no_tokenizer)


def _peft_tensors(root, step, metadata, arch: ModelArch, adapters: dict) -> dict[str, torch.Tensor]:
    """The PEFT adapter tensors of a LoRA checkpoint's ``adapters`` {canonical name: stored name}."""
    pairs = lora_export.adapter_pairs(adapters)
    with Reader(fmt.step_dir(root, step), metadata) as reader:
        return lora_export.peft_tensors(pairs, lora_export.linear_map(arch), lambda n: reader.full_tensor(adapters[n]))


def _peft_export(root, step, metadata, arch, adapters, lora, out_dir, dtype) -> HFExport:
    """A LoRA checkpoint's adapters as a PEFT adapter directory for the base it records."""
    tensors = _peft_tensors(root, step, metadata, arch, adapters)
    config = lora_export.adapter_config(lora, tensors, metadata.extra.get("hf_source_dir") or "")
    return HFExport(lora_export.write_peft_adapter(out_dir, tensors, config, dtype), [], None)


def _merged_onto_source(root, step, metadata, arch, adapters, lora, out_dir, dtype, max_file_bytes) -> HFExport:
    """A LoRA run's step (its adapters; the base is the HF directory it records, checked by
    its weights' digest) as that base with each adapted HF module's weight replaced by
    ``W + (alpha / rank) · B A`` (per HF module: the PEFT tensors, whose rows of B are cut
    from Megatron's fused linears)."""
    source = metadata.extra.get("hf_source_dir") or ""
    if not Path(source).is_dir() or weights_digest(source) != lora.get("base_digest"):
        raise BridgeError(
            f"{root} step {step} holds LoRA adapters only; --merge needs the base they were trained on, "
            f"{source or 'which it does not record'}, and that directory is gone or holds other weights"
        )
    scaling = float(lora["alpha"]) / int(lora["rank"])
    merged = lora_export.merged_hf_weights(_peft_tensors(root, step, metadata, arch, adapters), scaling)
    base = HFCheckpoint(source)
    with base.reader() as read:
        tags = {tag: torch_dtype for torch_dtype, tag in DTYPE_TAGS.items()}
        specs = [TensorSpec(n, base.shape(n), dtype or tags[read.slice(n).get_dtype()]) for n in base.names()]

        def stream():
            for spec in specs:
                weight = read.slice(spec.name)[:]
                yield spec.name, (merged[spec.name](weight) if spec.name in merged else weight).to(spec.dtype)

        copies, no_tokenizer = _source_side_files(source)
        hf_config = config_with_dtype(metadata.extra["hf_config"], specs[0].dtype)
        out = write_checkpoint(out_dir, specs, stream(), hf_config, max_file_bytes, copy_files=copies)
    return HFExport(out, [c.name for c in copies], no_tokenizer)


def _source_side_files(source: Optional[str]) -> tuple[list[Path], Optional[str]]:
    """The side files (tokenizer, generation config) of the recorded source HF directory,
    and why the export will have no tokenizer when there is none to copy."""
    if not source:
        return [], "the checkpoint does not record the HF directory it came from"
    if not Path(source).is_dir():
        return [], f"the HF directory it came from, {source}, no longer exists"
    files = side_files(source)
    if not any(f.name.startswith("tokenizer") or f.name == "vocab.json" for f in files):
        return files, f"the HF directory it came from, {source}, has no tokenizer files"
    return files, None


def _check_stored(stored: dict, metadata, tmap, arch: ModelArch) -> None:
    missing = sorted(set(tmap.megatron_shapes) - set(stored))
    unexpected = sorted(set(stored) - set(tmap.megatron_shapes))
    if missing:
        raise BridgeError(f"checkpoint lacks {arch.family} tensors: {missing[:8]}")
    if unexpected:
        raise BridgeError(f"checkpoint has tensors a {arch.family} HF model has no place for: {unexpected[:8]}")
    for name, shape in tmap.megatron_shapes.items():
        found = tuple(metadata.tensors[stored[name]].shape)
        if found != shape:
            raise BridgeError(f"checkpoint tensor {stored[name]} has shape {found}, expected {shape}")
