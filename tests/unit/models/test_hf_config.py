"""HF configs of every supported family map to the right Megatron architecture numbers."""

import pytest
import transformers

from megatron_rl.models import UnsupportedModelError, arch_from_hf

SMALL = dict(
    vocab_size=96,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=128,
)


def test_dense_families():
    llama = arch_from_hf(transformers.LlamaConfig(**SMALL, tie_word_embeddings=True))
    assert (llama.family, llama.head_dim, llama.num_query_groups, llama.qkv_bias, llama.qk_layernorm) == (
        "llama",
        16,
        2,
        False,
        False,
    )
    assert llama.tie_word_embeddings and not llama.is_moe
    qwen2 = arch_from_hf(transformers.Qwen2Config(**SMALL))
    assert qwen2.qkv_bias and not qwen2.qk_layernorm  # Qwen2 attention has q/k/v biases
    qwen3 = arch_from_hf(transformers.Qwen3Config(**SMALL, head_dim=32))
    assert qwen3.qk_layernorm and qwen3.head_dim == 32  # explicit head_dim wins over hidden/heads


def test_moe_families_router_and_experts():
    q2 = arch_from_hf(
        transformers.Qwen2MoeConfig(
            **SMALL,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=False,
        )
    )
    assert (q2.num_moe_experts, q2.moe_router_topk, q2.moe_ffn_hidden_size) == (4, 2, 32)
    assert q2.moe_shared_expert_intermediate_size == 64 and q2.moe_shared_expert_gate
    assert q2.moe_router_pre_softmax  # softmax over all experts, no renormalisation
    q3 = arch_from_hf(
        transformers.Qwen3MoeConfig(
            **SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
        )
    )
    assert q3.num_moe_experts == 8 and not q3.moe_router_pre_softmax and q3.qk_layernorm
    assert q3.moe_shared_expert_intermediate_size is None
    mx = arch_from_hf(transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2))
    assert (mx.num_moe_experts, mx.moe_ffn_hidden_size, mx.moe_router_pre_softmax) == (4, 128, False)


def test_unsupported_family_lists_supported_ones():
    with pytest.raises(UnsupportedModelError, match=r"model_type='gpt2' is not supported; supported: \['llama'"):
        arch_from_hf(transformers.GPT2Config())
