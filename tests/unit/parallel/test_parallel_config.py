"""ParallelConfig: derived sizes, one-sentence errors, rank map (no process group)."""

import dataclasses

import pytest

from megatron_rl.parallel import LayoutError, ModelShape, ParallelConfig, rank_map

MOE = ModelShape(
    num_layers=4,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    num_moe_experts=8,
    moe_ffn_hidden_size=32,
)
DENSE = ModelShape(num_layers=4, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128)


def test_derived_sizes_fold_dense_and_expert_mappings():
    c = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=4,
        expert_tensor_parallel_size=1,
    )
    c.validate(8, MOE)
    assert (c.dp(8), c.edp(8), c.etp) == (2, 1, 1)
    assert ParallelConfig(tensor_model_parallel_size=2).etp == 2  # ETP defaults to TP


@pytest.mark.parametrize(
    "kwargs, world, model, message",
    [
        (dict(expert_model_parallel_size=3), 3, MOE, "expert_model_parallel_size=3 does not divide num_moe_experts=8"),
        (dict(tensor_model_parallel_size=3), 4, MOE, "world size 4 is not divisible by tensor_model_parallel_size"),
        (
            dict(tensor_model_parallel_size=4, expert_model_parallel_size=1),
            8,
            DENSE,
            "does not divide num_query_groups",
        ),
        (
            dict(pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=2),
            2,
            DENSE,
            "needs pipeline_model_parallel_size >= 2",
        ),
        (
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4),
            2,
            DENSE,
            "num_layers=4 is not divisible",
        ),
        (dict(context_parallel_size=3), 4, DENSE, "context_parallel_size x pipeline_model_parallel_size = 1x3x1"),
        (dict(expert_model_parallel_size=2), 2, DENSE, "need a MoE model"),
        (dict(tensor_model_parallel_size=0), 1, None, "must be a positive integer"),
        (
            dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=False),
            4,
            MOE,
            "needs sequence_parallel=true",
        ),
        (
            dict(expert_model_parallel_size=2, expert_tensor_parallel_size=2),
            2,
            MOE,
            "is not divisible by expert_tensor_parallel_size",
        ),
    ],
)
def test_bad_layouts_fail_with_one_sentence(kwargs, world, model, message):
    with pytest.raises(LayoutError) as err:
        ParallelConfig(**kwargs).validate(world, model)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_rank_map_tp2_pp2_ep4_world8_by_hand():
    c = ParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=4,
        expert_tensor_parallel_size=1,
    )
    m = rank_map(c, 8)
    # Megatron order tp-cp-ep-dp-pp: TP fastest, then DP, PP slowest; experts: EP fastest.
    assert [(r.tp, r.dp, r.pp) for r in m] == [
        (0, 0, 0),
        (1, 0, 0),
        (0, 1, 0),
        (1, 1, 0),
        (0, 0, 1),
        (1, 0, 1),
        (0, 1, 1),
        (1, 1, 1),
    ]
    assert [(r.etp, r.ep, r.edp) for r in m] == [(0, e, 0) for e in range(4)] * 2


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ParallelConfig().tensor_model_parallel_size = 2
