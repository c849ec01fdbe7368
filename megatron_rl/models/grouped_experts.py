"""Megatron's SequentialMLP experts computed as two grouped GEMMs.

Without Transformer Engine (and without the ``grouped_gemm`` package) Megatron's local spec
runs its experts one after another: per expert and micro-batch two GEMMs forward and four
backward, each on a slice of the tokens. On a GPU one grouped kernel over all local experts
does the same work in one launch with better tile occupancy (measured on one H200: the
expert GEMMs of an 8-expert layer, forward and backward, 309 -> 443 TFLOP/s).

The module keeps SequentialMLP's parameters (``local_experts.<i>.linear_fc1.weight`` and
``linear_fc2.weight``), so checkpoints, the HF bridge and the weight sync see the same model;
only the forward differs: the experts' weights are stacked per call (a copy of the expert
weights, small beside the activations) and the activation is MLP's own gated SiLU, scaled by
each token's routing probability and rounded back to the activation dtype as MLP does
(compiled when the config asks for the activation fusion, as Megatron's MLP does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_rl.models.fused_elementwise import compiled_scaled_gated_silu, scaled_gated_silu
from megatron_rl.platform.torch_internals import GROUPED_MM_ALIGNMENT, grouped_mm


def row_bytes(config) -> int:
    """The narrowest row the grouped GEMMs stride over: the hidden size or this rank's share of
    an expert's FFN width, whichever is smaller, in bytes of the parameter dtype."""
    ffn_shard = config.moe_ffn_hidden_size // config.expert_tensor_parallel_size
    return min(config.hidden_size, ffn_shard) * config.params_dtype.itemsize


class GroupedGemmExperts(SequentialMLP):
    """SequentialMLP with the experts' GEMMs grouped (gated SiLU experts without bias)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        row = row_bytes(config)
        unsupported = {
            "add_bias_linear": config.add_bias_linear,
            "gated_linear_unit is off": not config.gated_linear_unit,
            "activation is not silu": config.activation_func is not F.silu,
            "moe_apply_probs_on_input": config.moe_apply_probs_on_input,
            "fp8/fp4": bool(config.fp8 or config.fp4),
            "activation_func_clamp_value": config.activation_func_clamp_value is not None,
            "glu_linear_offset": bool(config.glu_linear_offset),
            f"rows of {row} bytes (a multiple of {GROUPED_MM_ALIGNMENT} needed)": row % GROUPED_MM_ALIGNMENT,
        }
        refused = [name for name, on in unsupported.items() if on]
        if refused:
            raise ValueError(f"grouped experts compute gated SiLU experts without bias; not: {', '.join(refused)}")

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if self.num_local_experts == 1:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        tokens = permuted_local_hidden_states
        group_ends = torch.cumsum(tokens_per_expert, 0).to(device=tokens.device, dtype=torch.int32, non_blocking=True)
        fc1 = torch.stack([e.linear_fc1.weight for e in self.local_experts]).transpose(1, 2)
        fc2 = torch.stack([e.linear_fc2.weight for e in self.local_experts]).transpose(1, 2)
        activation = compiled_scaled_gated_silu() if self.config.bias_activation_fusion else scaled_gated_silu
        hidden = activation(grouped_mm(tokens, fc1, group_ends), permuted_probs)
        return grouped_mm(hidden, fc2, group_ends), None
