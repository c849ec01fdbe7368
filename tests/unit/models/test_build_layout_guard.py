"""A model is built only in the layout Megatron's groups hold now (parallel.state.require_current).

Megatron builds from its current groups whatever sizes the config names; a model made for
TP2 at a current TP1 would be split for TP2 and run with TP1's groups. Refused by name."""

import pytest

from megatron_rl.models.builder import build_model
from megatron_rl.parallel import ParallelConfig
from megatron_rl_lab.testing.tiny import TINY_DENSE


def test_a_model_for_another_layout_is_refused_naming_the_sizes(world_of_one):
    other = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    with pytest.raises(RuntimeError) as refused:
        build_model("actor", TINY_DENSE, other)
    message = str(refused.value)
    assert "tensor_model_parallel_size=2 (current 1)" in message
    assert "pipeline_model_parallel_size=2 (current 1)" in message
    assert "ParallelContext.active()" in message
    (model,) = build_model("actor", TINY_DENSE, ParallelConfig())  # the current layout builds
    assert sum(p.numel() for p in model.parameters()) > 0
