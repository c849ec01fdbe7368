"""Tiny architectures the runtime builds by name (the smoke job) and the tests use.

Head size 32 (the smallest vLLM's CPU attention accepts), GQA.
"""

from megatron_rl.models.hf_config import ModelArch

_COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    num_layers=4,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=32,
    norm_epsilon=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)

TINY_DENSE = ModelArch(family="qwen3", ffn_hidden_size=128, qkv_bias=False, qk_layernorm=True, **_COMMON)

TINY_MOE = ModelArch(
    family="qwen2_moe",
    ffn_hidden_size=128,
    qkv_bias=True,
    qk_layernorm=False,
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=64,
    moe_shared_expert_gate=True,
    moe_router_pre_softmax=True,
    **_COMMON,
)

TINY_ARCHS = {"dense": TINY_DENSE, "moe": TINY_MOE}

# Qwen3-MoE takes head_dim explicitly, so this one also exists as a transformers/vLLM model
# (megatron_rl_lab.testing.hf_models writes it); qwen2_moe derives head_dim = hidden / heads.
TINY_QWEN3_MOE = ModelArch(
    family="qwen3_moe",
    ffn_hidden_size=128,
    qkv_bias=False,
    qk_layernorm=True,
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_router_pre_softmax=False,
    **_COMMON,
)
