"""models.local_dispatch against Megatron's alltoall dispatcher at EP1 (single process, CPU):
the same MoE model built with each, same weights, logits and every parameter's gradient,
with SequentialMLP and with the grouped experts, and with most experts receiving no token.

Both dispatchers hand each expert the same tokens in the same order and scatter the outputs
back with the same ``unpermute``, so the results are equal bit for bit (measured) and the test
asks for equality. A token sent to the wrong expert, a probability paired with the wrong token
or a lost top-k slot changes the logits by more than their own size.
"""

import copy

import pytest
import torch

from megatron_rl.models.local_dispatch import LocalTokenDispatcher
from megatron_rl.parallel import ParallelConfig
from megatron_rl_lab.testing.model_grads import assert_builds_agree


def build(arch, dispatcher: str, experts: str):
    from megatron_rl.models.builder import BuildOptions, build_model

    torch.manual_seed(7)
    options = BuildOptions(moe_token_dispatcher_type=dispatcher, experts=experts)
    (model,) = build_model("actor", arch, ParallelConfig(), options)
    return model


@pytest.mark.parametrize("experts", ["sequential", "grouped"])
@pytest.mark.parametrize("tokens_per_row", [2, 48], ids=["most-experts-empty", "every-expert-used"])
def test_local_dispatch_equals_megatrons_alltoall_dispatch(world_of_one, experts, tokens_per_row):
    from megatron_rl_lab.testing.tiny import TINY_QWEN3_MOE

    megatron = build(TINY_QWEN3_MOE, "alltoall", experts)
    local = build(TINY_QWEN3_MOE, "local", experts)
    local.load_state_dict(copy.deepcopy(megatron.state_dict()))
    dispatchers = [m.token_dispatcher for m in local.modules() if hasattr(m, "token_dispatcher")]
    assert len(dispatchers) == TINY_QWEN3_MOE.num_layers
    assert all(isinstance(d, LocalTokenDispatcher) for d in dispatchers)
    seeded = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, TINY_QWEN3_MOE.vocab_size, (2, tokens_per_row), generator=seeded)
    assert_builds_agree(local, megatron, tokens)


def test_local_dispatch_refuses_experts_on_other_ranks(world_of_one):
    import dataclasses

    from megatron_rl.models import layer_spec
    from megatron_rl.models.builder import BuildOptions, transformer_config
    from megatron_rl_lab.testing.tiny import TINY_QWEN3_MOE

    options = BuildOptions(moe_token_dispatcher_type="local")
    config = dataclasses.replace(
        transformer_config(TINY_QWEN3_MOE, ParallelConfig(), options), expert_model_parallel_size=2
    )
    refusal = "keeps every expert on one rank without drops; not: expert_model_parallel_size 2"
    with pytest.raises(ValueError, match=refusal):
        layer_spec.block_spec(config, TINY_QWEN3_MOE, vp_stage=None, options=options)
    with pytest.raises(ValueError, match="moe_token_dispatcher_type 'flex' is not one of alltoall, allgather, local"):
        BuildOptions(moe_token_dispatcher_type="flex")
