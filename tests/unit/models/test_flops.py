"""Model FLOPs against arithmetic written out by hand and against the published formulas.

Every expected number below is computed in the test from the architecture numbers, term by
term, without calling the implementation's helpers.
"""

import dataclasses

import pytest

from megatron_rl.models.flops import forward_flops, gemm_shape, training_flops, training_flops_per_token
from megatron_rl.models.hf_config import ModelArch

# The numbers the hand arithmetic below uses (the shape of testing.tiny's archs, copied here so
# that the expectations stay tied to the numbers they were computed from).
_SMALL = dict(
    vocab_size=96,
    hidden_size=64,
    num_layers=4,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=32,
    ffn_hidden_size=128,
    norm_epsilon=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
TINY_DENSE = ModelArch(family="qwen3", qkv_bias=False, qk_layernorm=True, **_SMALL)
TINY_MOE = ModelArch(
    family="qwen2_moe",
    qkv_bias=True,
    qk_layernorm=False,
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=64,
    moe_shared_expert_gate=True,
    moe_router_pre_softmax=True,
    **_SMALL,
)


def test_dense_training_flops_by_hand():
    # TINY_DENSE: hidden 64, 4 layers, 4 heads x head_dim 32 (q = 128), 2 KV groups (kv = 64),
    # SwiGLU ffn 128, vocab 96. Batch: 8 sequences of 16 tokens.
    # Multiply-adds per token and layer:
    #   Q 64*128 = 8192, K 64*64 = 4096, V 4096, out 128*64 = 8192       -> 24576
    #   MLP gate+up+down 3*64*128                                         -> 24576
    #   core attention (causal, QK^T and AV, each q*s/2): 128*16          ->  2048
    # LM head 64*96 = 6144 per token.
    # Per token: 4 layers * (24576 + 24576 + 2048) + 6144 = 204800 + 6144 = 210944 MACs,
    # x 6 (fwd + 2 bwd GEMMs, 2 FLOPs per MAC) = 1265664 FLOPs; 128 tokens -> 162004992.
    f = training_flops(TINY_DENSE, [16] * 8)
    assert f.tokens == 128
    assert f.attention_projections == 6 * 4 * 24576 * 128
    assert f.mlp == 6 * 4 * 24576 * 128
    assert f.core_attention == 6 * 4 * 2048 * 128
    assert f.head == 6 * 6144 * 128
    assert f.router == 0
    assert f.total == 162004992
    assert f.per_token == 1265664
    assert training_flops_per_token(TINY_DENSE, 16) == 1265664


def test_moe_training_flops_by_hand():
    # TINY_MOE: same attention as TINY_DENSE (24576 MACs per token and layer, 2048 core at
    # s=16); 4 experts, top-2, expert ffn 32, shared expert 64 with a sigmoid gate.
    #   routed experts 2 * 3*64*32 = 12288, shared expert 3*64*64 = 12288 -> MLP 24576
    #   router 64*4 = 256, shared gate 64*1 = 64                          -> 320
    # Per token: 4 * (24576 + 24576 + 320 + 2048) + 6144 = 206080 + 6144 = 212224 MACs
    # x 6 = 1273344 FLOPs per token.
    f = training_flops(TINY_MOE, [16] * 8)
    assert f.mlp == 6 * 4 * 24576 * 128
    assert f.router == 6 * 4 * 320 * 128
    assert f.per_token == 1273344
    # Megatron-LM leaves the router and the gate out: 6 * (4 * (24576 + 24576 + 2048) + 6144).
    assert f.megatron_lm_total == 6 * (4 * (24576 + 24576 + 2048) + 6144) * 128


def test_moe_without_shared_expert_counts_only_routed_experts():
    # Qwen3-MoE style: 8 experts top-2, expert ffn 48, no shared expert (so no gate).
    arch = dataclasses.replace(
        TINY_MOE,
        family="qwen3_moe",
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=48,
        moe_shared_expert_intermediate_size=None,
        moe_shared_expert_gate=False,
    )
    shape = gemm_shape(arch)
    assert shape.mlp == 2 * 3 * 64 * 48  # 18432
    assert shape.router == 64 * 8  # 512


def test_forward_only_is_a_third_of_training():
    # Forward: 2 FLOPs per MAC instead of 6 -> 210944 * 2 = 421888 per token (dense above).
    assert forward_flops(TINY_DENSE, [16] * 8).per_token == 421888
    assert forward_flops(TINY_MOE, [16]).total * 3 == training_flops(TINY_MOE, [16]).total


def test_packed_sequences_use_sum_of_squares():
    # Two segments of 10 and 6 tokens packed in one row of 16: the causal core attention is
    # q * (10^2 + 6^2) = 128 * 136 MACs per layer, not 128 * 16^2 as for one 16-token sequence.
    packed = training_flops(TINY_DENSE, [10, 6])
    whole = training_flops(TINY_DENSE, [16])
    assert packed.core_attention == 6 * 4 * 128 * 136
    assert whole.core_attention == 6 * 4 * 128 * 256
    assert packed.total - packed.core_attention == whole.total - whole.core_attention  # same GEMMs
    # Only real tokens count: padding is not passed in, so 10 real tokens of a padded
    # 16-token row cost what a 10-token sequence costs.
    assert training_flops(TINY_DENSE, [10]).tokens == 10


def test_critic_head_and_padded_vocab():
    # The critic's value head is hidden -> 1: 64 MACs per token instead of 64*96.
    assert gemm_shape(TINY_DENSE, "critic").head == 64
    # With TP padding the LM head multiplies the padded vocabulary (e.g. 96 -> 128).
    assert gemm_shape(TINY_DENSE, "actor", vocab_size=128).head == 64 * 128
    assert training_flops(TINY_DENSE, [16], role="critic").head == 6 * 64 * 16


def _megatron_lm_reference(arch: ModelArch, batch: int, seq: int, vocab: int) -> float:
    """Megatron-LM training.py `num_floating_point_operations` (GQA/MoE branch, no MTP, no
    MLA), transcribed with its own variable names."""
    forward_backward_expansion_factor, fma_expansion_factor, ffn_expansion_factor = 3, 2, 3
    query_projection_size = arch.head_dim * arch.num_attention_heads
    key_projection_size = value_projection_size = arch.head_dim * arch.num_query_groups
    self_attn_term = (
        forward_backward_expansion_factor
        * fma_expansion_factor
        * (
            arch.hidden_size * (query_projection_size + key_projection_size + value_projection_size)
            + query_projection_size * seq / 2 * 2
            + query_projection_size * arch.hidden_size
        )
    )
    if arch.is_moe:
        num_dense_layers, num_moe_layers, routed = 0, arch.num_layers, arch.moe_router_topk
    else:
        num_dense_layers, num_moe_layers, routed = arch.num_layers, 0, 0
    moe_ffn = arch.moe_ffn_hidden_size or arch.ffn_hidden_size
    shared = arch.moe_shared_expert_intermediate_size or 0
    return (
        batch
        * seq
        * (
            forward_backward_expansion_factor
            * fma_expansion_factor
            * arch.hidden_size
            * (
                arch.ffn_hidden_size * ffn_expansion_factor * num_dense_layers
                + moe_ffn * routed * ffn_expansion_factor * num_moe_layers
                + shared * ffn_expansion_factor * num_moe_layers
            )
            + self_attn_term * arch.num_layers
            + forward_backward_expansion_factor * fma_expansion_factor * arch.hidden_size * vocab  # logit
        )
    )


QWEN3_30B_A3B = ModelArch(  # published config numbers of Qwen3-30B-A3B
    family="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    num_layers=48,
    num_attention_heads=32,
    num_query_groups=4,
    head_dim=128,
    ffn_hidden_size=6144,
    norm_epsilon=1e-6,
    rope_theta=1e6,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
    qkv_bias=False,
    qk_layernorm=True,
    num_moe_experts=128,
    moe_router_topk=8,
    moe_ffn_hidden_size=768,
)
LLAMA3_8B = ModelArch(
    family="llama",
    vocab_size=128256,
    hidden_size=4096,
    num_layers=32,
    num_attention_heads=32,
    num_query_groups=8,
    head_dim=128,
    ffn_hidden_size=14336,
    norm_epsilon=1e-5,
    rope_theta=5e5,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    qkv_bias=False,
    qk_layernorm=False,
)


@pytest.mark.parametrize("arch", [LLAMA3_8B, QWEN3_30B_A3B, TINY_MOE], ids=["llama3-8b", "qwen3-30b-a3b", "tiny-moe"])
def test_matches_megatron_lm_formula(arch):
    f = training_flops(arch, [4096] * 2)
    reference = _megatron_lm_reference(arch, batch=2, seq=4096, vocab=arch.vocab_size)
    assert f.megatron_lm_total == pytest.approx(reference, rel=1e-12)  # float rounding only


def test_dense_matches_narayanan_2021():
    # Narayanan et al. 2021 (eq. 3, no recomputation): F = 72 B s l h^2 (1 + s/(6h) + V/(12 l h))
    # for MHA, a 4h non-gated MLP and full (non-causal) attention scores. A SwiGLU MLP of
    # width 8h/3 has the same 8h^2 weights; the paper counts the whole s x s score matrix
    # where the causal count takes half, so the paper's number is ours plus that half:
    # 6 * q * s^2 * l * B with q = h.
    h, l, s, B, V = 3072, 24, 2048, 4, 50304  # noqa: E741 - the paper's symbols, as in its formula above
    arch = dataclasses.replace(
        LLAMA3_8B,
        hidden_size=h,
        num_layers=l,
        num_attention_heads=24,
        num_query_groups=24,
        head_dim=128,
        ffn_hidden_size=8 * h // 3,
        vocab_size=V,
    )
    paper = 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))
    ours = training_flops(arch, [s] * B).total
    assert ours + 6 * h * s * s * l * B == pytest.approx(paper, rel=1e-12)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="seq_lengths"):
        training_flops(TINY_DENSE, [])
    with pytest.raises(ValueError, match="seq_lengths"):
        training_flops(TINY_DENSE, [4, -1])
    with pytest.raises(ValueError, match="role='reward'.*actor"):
        training_flops(TINY_DENSE, [4], role="reward")
