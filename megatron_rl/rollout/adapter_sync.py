"""The weight sync of a LoRA actor: the adapters alone into vLLM's LoRA slot, the base once.

A LoRA run trains a few million adapter numbers beside a frozen base, yet a merged sync
(:func:`megatron_rl.models.lora.merged_into_weights`, then the whole export) moves and
loads every base weight at every step. vLLM serves LoRA adapters itself (its punica kernels:
``y = W x + s · B (A x)``, the same sum the actor's forward computes, with W unrounded by a
merge), so here each sync gathers only the adapters' whole factors, cuts them into PEFT's
per-module tensors (:func:`megatron_rl.bridge.lora_export.peft_tensors`: the rows of each
fused linear's B that go to each HF module) and hands them to the engines'
:meth:`~megatron_rl.rollout.backend.RolloutBackend.load_adapter`. The base goes whole only
when vLLM's copy of it may differ from the actor's: at a resume.

vLLM 0.32 has LoRA kernels for linear layers on every backend, but an engine with a LoRA
slot runs every MoE layer on its Triton kernels (GPU only), and PEFT has no per-expert
modules for transformers' fused experts: MoE models sync merged. Which way a run takes is
``model.lora.sync`` (config.schema.LORA_SYNC_MODES, with the measurement behind its default).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.bridge.families import canonical
from megatron_rl.bridge.lora_export import adapter_config, adapter_pairs, linear_map, peft_tensors
from megatron_rl.models.adapter_names import is_adapter_name
from megatron_rl.models.hf_config import ModelArch
from megatron_rl.models.lora import merged_into_weights
from megatron_rl.parallel.full_tensors import PlannedGather
from megatron_rl.rollout.sync import SyncStats, WeightSync
from megatron_rl.utils import dtypes

if TYPE_CHECKING:
    from megatron_rl.rollout.backend import RolloutBackend


class AdapterSync:
    """Pushes the actor's LoRA adapters into the engines' LoRA slot (collective over the
    training world group). ``lora``: rank, alpha, dropout (the adapter's PEFT config)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], arch: ModelArch, engine: RolloutBackend, lora: dict):
        self.chunks, self.arch, self.engine, self.lora = list(chunks), arch, engine, dict(lora)
        self.gather = PlannedGather(self.chunks, only=is_adapter_name)
        self.tmap = linear_map(arch)
        """Which rows of each fused linear go to which HF module."""

    def sync(self) -> SyncStats:
        """One sync of every adapter."""
        start = time.perf_counter()
        full = {canonical(name): t for name, t in self.gather.gather().items()}
        dtype = dtypes.to_torch(self.engine.config.dtype)
        tensors = {k: v.to(dtype) for k, v in peft_tensors(adapter_pairs(full), self.tmap, full.__getitem__).items()}
        self.engine.load_adapter(tensors, adapter_config(self.lora, tensors, ""))
        self.engine.finish_weight_update()
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        return SyncStats(
            time.perf_counter() - start,
            size,
            len(tensors),
            1,
            size,
            transport="broadcast" if dist.get_world_size() > 1 else "local",
        )


class PolicySync:
    """The trainer's weight sync: the whole actor (a LoRA actor's adapters merged in), or
    for ``adapter`` mode the adapters alone after the base went once."""

    def __init__(self, weights: WeightSync, adapters: Optional[AdapterSync] = None):
        self.weights, self.adapters = weights, adapters

    def sync(self, check_weights: bool = False, whole: bool = False) -> SyncStats:
        """One sync. ``whole``: the base too (adapter mode; a resume, where vLLM's base may not
        be the checkpoint's). ``check_weights`` reads back what the whole sync loaded; the
        adapters are judged by the parity guard's logprobs."""
        if self.adapters is None:
            with merged_into_weights(self.weights.chunks):  # LoRA: vLLM serves base + adapters
                return self.weights.sync(check_weights=check_weights)
        base = self.weights.sync(check_weights=check_weights) if whole else None
        stats = self.adapters.sync()
        if base is None:
            return stats
        return SyncStats(
            base.seconds + stats.seconds,
            base.bytes + stats.bytes,
            base.tensors + stats.tensors,
            base.buckets + stats.buckets,
            max(base.largest_bucket_bytes, stats.largest_bucket_bytes),
            base.weight_check,
            base.transport,
        )
