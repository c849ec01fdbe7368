"""Which Megatron modules make up a transformer layer: Transformer Engine when importable,
else Megatron's local (pure torch) modules with a norm that supports sequence parallelism
and a core attention on torch's SDPA kernels that also takes packed (THD) rows.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from megatron_rl.models.fused_elementwise import CompiledRMSNorm
from megatron_rl.models.hf_config import ModelArch


class SequenceParallelRMSNorm:
    """torch RMSNorm whose params are marked for the TP gradient all-reduce.

    Megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel=True``, yet MoE with TP>1
    and EP>1 requires it. A norm is per token, so it works on a sequence shard as it is;
    only its weight gradient must be summed over the TP group, which
    ``finalize_model_grads`` does for params carrying ``sequence_parallel=True``.
    """

    norm_class = torch.nn.RMSNorm

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm = cls.norm_class(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


class CompiledSequenceParallelRMSNorm(SequenceParallelRMSNorm):
    """The same norm computed by one compiled kernel per direction (models.fused_elementwise)."""

    norm_class = CompiledRMSNorm


def has_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


ATTENTIONS = ("auto", "sdpa", "unfused")
"""auto: Transformer Engine's layers when importable, else the local spec with SDPA attention;
sdpa: the local spec with SDPA attention even where TE is installed; unfused: the local spec
with Megatron's own ``DotProductAttention`` (the score matrix in memory, padded rows only),
kept as the reference the SDPA attention is measured against."""


EXPERTS = ("auto", "sequential", "grouped")
"""How the local spec computes a MoE layer's experts. sequential: Megatron's SequentialMLP, one
expert after another; grouped: the same parameters in two grouped GEMMs per call
(models.grouped_experts); auto: grouped where its kernel is fast (bf16 on a CUDA device of
compute capability 9.0 or later), else sequential. Transformer Engine's spec keeps its own."""


def grouped_experts_pay(config) -> bool:
    """Whether ``auto`` picks the grouped experts: torch's grouped kernel is a CUTLASS kernel
    for bf16 on Hopper and later, a per-group loop (no faster than SequentialMLP) elsewhere."""
    from megatron_rl.models.grouped_experts import row_bytes
    from megatron_rl.platform.torch_internals import GROUPED_MM_ALIGNMENT, has_grouped_mm

    return (
        has_grouped_mm()
        and row_bytes(config) % GROUPED_MM_ALIGNMENT == 0
        and config.params_dtype == torch.bfloat16
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability() >= (9, 0)
    )


def uses_transformer_engine(attention: str) -> bool:
    return attention == "auto" and has_transformer_engine()


def describe_attention(attention: str) -> str:
    """What a model built with ``attention`` computes its attention with, for reports."""
    if uses_transformer_engine(attention):
        return "transformer_engine"
    return "megatron local, unfused attention" if attention == "unfused" else "megatron local, SDPA attention"


def block_spec(config, arch: ModelArch, vp_stage: Optional[int], options):
    """TransformerBlockSubmodules for the layers this rank builds (this VPP chunk), from
    ``options`` (models.builder.BuildOptions: attention, experts, fusion, dispatcher). Fusion
    compiled picks the compiled norm here; its RoPE and SiLU fusions follow the config's
    flags (models.fused_elementwise.transformer_config_fields)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    attention, experts = options.attention, options.experts

    if attention == "unfused" and config.context_parallel_size > 1:
        raise ValueError(
            f"attention 'unfused' (Megatron's DotProductAttention) has no context parallelism "
            f"(context_parallel_size={config.context_parallel_size}); use auto or sdpa"
        )
    num_experts = arch.num_moe_experts if arch.is_moe else None
    if uses_transformer_engine(attention):
        layer = specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_layernorm
        )
        from megatron.core.extensions.transformer_engine import TENorm as final_norm
    else:
        layer = specs.get_gpt_layer_local_spec(
            num_experts=num_experts,
            moe_grouped_gemm=False,
            qk_layernorm=arch.qk_layernorm,
            normalization="RMSNorm",
        )
        norm = CompiledSequenceParallelRMSNorm if options.fusion == "compiled" else SequenceParallelRMSNorm
        _replace_torch_norms(layer, norm)
        if attention != "unfused":
            _use_sdpa_attention(layer)
        if num_experts and (experts == "grouped" or (experts == "auto" and grouped_experts_pay(config))):
            _use_grouped_experts(layer)
        final_norm = norm
    if num_experts and options.moe_token_dispatcher_type == "local":
        _use_local_dispatch(layer, config)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=final_norm)


def _use_sdpa_attention(layer) -> None:
    """Local specs: SDPA's fused kernels instead of the unfused local attention, and THD packed rows
    (models.sdpa_attention)."""
    from megatron_rl.models.sdpa_attention import SdpaAttention

    layer.submodules.self_attention.submodules.core_attention = SdpaAttention


def _use_grouped_experts(layer) -> None:
    """Local MoE specs: the experts' GEMMs grouped, same parameters (models.grouped_experts)."""
    from megatron_rl.models.grouped_experts import GroupedGemmExperts

    layer.submodules.mlp.submodules.experts.module = GroupedGemmExperts


def _use_local_dispatch(layer, config) -> None:
    """Local MoE specs: the sync-free single-rank dispatcher (models.local_dispatch)."""
    from megatron_rl.models.local_dispatch import LocallyDispatchedMoELayer, local_dispatch_problem

    problem = local_dispatch_problem(config)
    if problem:
        raise ValueError(problem)
    layer.submodules.mlp.module = LocallyDispatchedMoELayer


def _replace_torch_norms(spec, norm=SequenceParallelRMSNorm) -> None:
    """Swap every WrappedTorchNorm in a local spec tree for ``norm`` (a SequenceParallelRMSNorm)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    sub = getattr(spec, "submodules", None)
    if sub is None:
        return
    for name, value in list(vars(sub).items()):
        if value is WrappedTorchNorm:
            setattr(sub, name, norm)
        elif isinstance(value, ModuleSpec):
            if value.module is WrappedTorchNorm:
                value.module = norm
            _replace_torch_norms(value, norm)
