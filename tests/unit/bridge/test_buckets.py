"""The weight sync's bucketing rule and the layer naming rules it and the in-place load rely on.

Buckets are size-bounded, never split a group (a decoder layer: vLLM's load needs whole
layers) and place every tensor on a cache line of its own.
"""

from megatron_rl.bridge.gather_plan import PackedGroup, pack_buckets
from megatron_rl.bridge.layer_names import hf_layer_prefix, megatron_layer_index
from megatron_rl.utils.alignment import CACHE_LINE_ALIGN, DTYPE_VIEW_ALIGN, align_up

# Embeddings, three layers of two 1 KiB tensors, final norm, LM head.
GROUPS = [[1024]] + [[1024, 1024]] * 3 + [[1024], [1024]]


def _indices(buckets):
    return [[packed.index for packed in bucket] for bucket in buckets]


def test_every_group_once_in_order_and_whole():
    buckets, largest = pack_buckets(GROUPS, bucket_bytes=1500)
    # 1500 B: a layer (2 KiB) is a bucket of its own; embeddings, norm and head are 1 KiB
    # groups that do not fit together in 1.5 KiB either.
    assert _indices(buckets) == [[0], [1], [2], [3], [4], [5]]
    assert largest == 2048
    buckets, largest = pack_buckets(GROUPS, bucket_bytes=4096)  # whole layers up to the size, never more
    assert _indices(buckets) == [[0, 1], [2, 3], [4, 5]]
    assert largest == 4096
    assert _indices(pack_buckets(GROUPS, bucket_bytes=1 << 30)[0]) == [list(range(len(GROUPS)))]


def test_tensors_start_on_cache_lines_from_each_bucket_start():
    buckets, largest = pack_buckets([[3, 100], [1], [64]], bucket_bytes=192)
    # 3 B and 100 B take 64 B and 128 B
    assert buckets == [[PackedGroup(0, [0, 64])], [PackedGroup(1, [0]), PackedGroup(2, [64])]]
    assert largest == 192


def test_alignment():
    assert [align_up(n, DTYPE_VIEW_ALIGN) for n in (0, 1, 8, 9)] == [0, 8, 8, 16]
    assert [align_up(n, CACHE_LINE_ALIGN) for n in (0, 1, 64, 65)] == [0, 64, 64, 128]


def test_megatron_layer_index():
    assert megatron_layer_index("decoder.layers.12.mlp.experts.linear_fc1.weight3") == 12
    assert megatron_layer_index("embedding.word_embeddings.weight") is None
    assert megatron_layer_index("decoder.final_layernorm.weight") is None
    assert megatron_layer_index("module.decoder.layers.0.x") is None  # only at the start of the name


def test_hf_layer_prefix():
    assert hf_layer_prefix("model.layers.12.mlp.experts.3.up_proj.weight") == "model.layers.12"
    assert hf_layer_prefix("language_model.model.layers.3.self_attn.qkv_proj.weight") == "language_model.model.layers.3"
    assert hf_layer_prefix("model.layers.3") is None  # a module name: callers append "."
    assert hf_layer_prefix("lm_head.weight") is None
    assert hf_layer_prefix("model.norm.weight") is None
