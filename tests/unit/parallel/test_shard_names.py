"""Canonical names unstack Megatron's layer/expert axes into the parallelism-free name."""

import pytest

from megatron_rl.parallel.shards import canonical_name


def test_unstacked_keys_keep_their_name():
    assert canonical_name("embedding.word_embeddings.weight", ()) == "embedding.word_embeddings.weight"


def test_layer_index_goes_after_layers():
    assert (
        canonical_name("decoder.layers.self_attention.linear_qkv.weight", (3,))
        == "decoder.layers.3.self_attention.linear_qkv.weight"
    )


def test_expert_index_replaces_the_stacked_experts_segment():
    assert (
        canonical_name("decoder.layers.mlp.experts.experts.linear_fc1.weight", (2, 7))
        == "decoder.layers.2.mlp.experts.7.linear_fc1.weight"
    )


@pytest.mark.parametrize(
    "key,index",
    [("output_layer.weight", (1,)), ("decoder.layers.mlp.router.weight", (1, 2)), ("decoder.layers.x", (1, 2, 3))],
)
def test_unknown_stacking_is_an_error(key, index):
    with pytest.raises(ValueError, match="stacked"):
        canonical_name(key, index)
