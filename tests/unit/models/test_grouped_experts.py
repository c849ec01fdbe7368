"""models.grouped_experts against Megatron's SequentialMLP, the independent reference (single
process, CPU): the same MoE model built both ways with the same weights, logits and every
parameter's gradient, in fp32 and bf16, with and without experts that receive no token.

On a CPU torch's grouped kernel is a loop of one GEMM per group over the same rows that
SequentialMLP hands each expert, so the two agree bit for bit (measured: every logit and
gradient equal, fp32 and bf16) and the test asks for equality. A wrong expert order, a missing
routing probability or a transposed weight moves the logits by more than their own size.
"""

import copy

import pytest
import torch

from megatron_rl.models import layer_spec
from megatron_rl.models.grouped_experts import GroupedGemmExperts
from megatron_rl.parallel import ParallelConfig
from megatron_rl_lab.testing.model_grads import assert_builds_agree


def build(arch, dtype: str, experts: str):
    from megatron_rl.models.builder import BuildOptions, build_model

    torch.manual_seed(7)
    (model,) = build_model("actor", arch, ParallelConfig(), BuildOptions(dtype=dtype, experts=experts))
    return model


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("tokens_per_row", [2, 48], ids=["most-experts-empty", "every-expert-used"])
def test_grouped_experts_equal_sequential_experts(world_of_one, dtype, tokens_per_row):
    from megatron_rl_lab.testing.tiny import TINY_QWEN3_MOE

    sequential = build(TINY_QWEN3_MOE, dtype, "sequential")
    grouped = build(TINY_QWEN3_MOE, dtype, "grouped")
    grouped.load_state_dict(copy.deepcopy(sequential.state_dict()))
    assert sum(isinstance(m, GroupedGemmExperts) for m in grouped.modules()) == TINY_QWEN3_MOE.num_layers
    assert not any(isinstance(m, GroupedGemmExperts) for m in sequential.modules())
    seeded = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, TINY_QWEN3_MOE.vocab_size, (2, tokens_per_row), generator=seeded)
    assert_builds_agree(grouped, sequential, tokens)


def test_auto_keeps_sequential_experts_where_the_grouped_kernel_is_a_loop(world_of_one):
    from megatron_rl.models.builder import BuildOptions, transformer_config
    from megatron_rl_lab.testing.tiny import TINY_QWEN3_MOE

    config = transformer_config(TINY_QWEN3_MOE, ParallelConfig(), BuildOptions(dtype="bf16"))
    assert not layer_spec.grouped_experts_pay(config)  # no CUDA device here
    spec = layer_spec.block_spec(config, TINY_QWEN3_MOE, vp_stage=None, options=BuildOptions(attention="sdpa"))
    assert spec.layer_specs[0].submodules.mlp.submodules.experts.module is not GroupedGemmExperts
    with pytest.raises(ValueError, match="BuildOptions.experts 'fused' is not one of auto, sequential, grouped"):
        BuildOptions(experts="fused")
