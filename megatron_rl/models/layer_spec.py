"""Which Megatron modules make up a transformer layer: Transformer Engine when importable,
else Megatron's local (pure torch) modules with a norm that supports sequence parallelism
and an attention that takes packed (THD) rows.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from megatron_rl.models.hf_config import ModelArch


class SequenceParallelRMSNorm:
    """torch RMSNorm whose params are marked for the TP gradient all-reduce.

    Megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel=True``, yet MoE with TP>1
    and EP>1 requires it. A norm is per token, so it works on a sequence shard as it is;
    only its weight gradient must be summed over the TP group, which
    ``finalize_model_grads`` does for params carrying ``sequence_parallel=True``.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def has_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def block_spec(config, arch: ModelArch, vp_stage: Optional[int]):
    """TransformerBlockSubmodules for the layers this rank builds (this VPP chunk)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    num_experts = arch.num_moe_experts if arch.is_moe else None
    if has_transformer_engine():
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
        _replace_torch_norms(layer)
        _use_packed_local_attention(layer)
        final_norm = SequenceParallelRMSNorm
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=final_norm)


def _use_packed_local_attention(layer) -> None:
    """Local specs: the core attention that also takes THD packed rows (models.packed_attention)."""
    from megatron_rl.models.packed_attention import PackedDotProductAttention

    layer.submodules.self_attention.submodules.core_attention = PackedDotProductAttention


def _replace_torch_norms(spec) -> None:
    """Swap every WrappedTorchNorm in a local spec tree for SequenceParallelRMSNorm."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    sub = getattr(spec, "submodules", None)
    if sub is None:
        return
    for name, value in list(vars(sub).items()):
        if value is WrappedTorchNorm:
            setattr(sub, name, SequenceParallelRMSNorm)
        elif isinstance(value, ModuleSpec):
            if value.module is WrappedTorchNorm:
                value.module = SequenceParallelRMSNorm
            _replace_torch_norms(value)
