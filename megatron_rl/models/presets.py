"""Model architectures by name: one table, one model per name.

`model.preset` (the recipes in examples/), the tests' helpers (megatron_rl_lab.testing.tiny)
and the benchmarks (`--model`, `--preset`) all read :data:`PRESETS`, so a name in a recipe,
a test or docs/benchmarks.md denotes the same architecture wherever it appears. A name says
the kind and the size; a model that differs in any number gets a name of its own.

How a run builds its preset: `trainer.job=smoke` builds the architecture as it stands; RL on
``task:<name>`` data builds it as the task's supervised base (tasks.base_model), whose
vocabulary is the trained tokenizer's, at most ``vocab_size``.
"""

from __future__ import annotations

from megatron_rl.models.hf_config import FAMILIES, ModelArch


def _arch(
    family: str,
    hidden: int,
    layers: int,
    heads: int,
    groups: int,
    head_dim: int,
    ffn: int,
    vocab: int,
    *,
    max_positions: int = 2048,
    rope_theta: float = 10000.0,
    **moe,
) -> ModelArch:
    traits = FAMILIES[family]
    return ModelArch(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        ffn_hidden_size=ffn,
        norm_epsilon=1e-6,
        rope_theta=rope_theta,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        qkv_bias=traits.qkv_bias,
        qk_layernorm=traits.qk_layernorm,
        **moe,
    )


def _experts(count: int, ffn: int, top_k: int = 2, **shared) -> dict:
    return dict(num_moe_experts=count, moe_router_topk=top_k, moe_ffn_hidden_size=ffn, **shared)


# qwen2_moe's router takes the softmax over all experts before the top-k (no renormalisation).
_SHARED_EXPERT = dict(moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True, moe_router_pre_softmax=True)
_GPU = dict(max_positions=8192, rope_theta=500000.0)  # room for the 4096-token MFU runs

PRESETS: dict[str, ModelArch] = {
    # The digit tasks' supervised bases (examples/*.yaml; `make train` trains tiny-moe).
    "tiny-moe": _arch("qwen3_moe", 128, 2, 4, 2, 32, 256, 320, max_positions=256, **_experts(8, 128)),
    "tiny-dense": _arch("qwen3", 128, 2, 4, 2, 32, 256, 320, max_positions=256),
    # The tests' models: head size 32, the smallest vLLM's CPU attention accepts; GQA. The
    # smoke job (examples/smoke.yaml) trains tiny-moe-shared-4l.
    "tiny-dense-4l": _arch("qwen3", 64, 4, 4, 2, 32, 128, 96, max_positions=128),
    "tiny-moe-4l": _arch("qwen3_moe", 64, 4, 4, 2, 32, 128, 96, max_positions=128, **_experts(4, 32)),
    "tiny-moe-shared-4l": _arch(
        "qwen2_moe", 64, 4, 4, 2, 32, 128, 96, max_positions=128, **_experts(4, 32, **_SHARED_EXPERT)
    ),
    # The tool task's base (examples/tool_grpo.yaml): tiny-dense with room in the vocabulary
    # for the merges of the tool schema the prompt lists, so an episode fits its positions.
    "tiny-dense-tools": _arch("qwen3", 128, 2, 4, 2, 32, 256, 512, max_positions=256),
    # The benchmarks' sizes (docs/benchmarks.md); layers, heads, KV groups and experts divide
    # by 2, so each runs in TP2, PP2 and (MoE) EP2.
    "cpu-dense-5m": _arch("qwen3", 256, 4, 8, 4, 32, 768, 4096),
    "cpu-moe-9m": _arch("qwen3_moe", 256, 4, 8, 4, 32, 768, 4096, **_experts(8, 256)),
    "cpu-dense-9m": _arch("qwen3", 384, 4, 6, 2, 64, 1024, 4096),
    "cpu-moe-14m": _arch("qwen3_moe", 384, 4, 6, 2, 64, 1024, 4096, **_experts(8, 256)),
    # Qwen3-30B-A3B's routing shape (top-8 of many small experts), scaled to CPU: 64 experts.
    "cpu-moe-64e": _arch("qwen3_moe", 256, 4, 8, 4, 32, 768, 4096, **_experts(64, 64, top_k=8)),
    "cpu-dense-82m": _arch("qwen3", 1024, 4, 16, 4, 64, 3072, 16384),
    "cpu-dense-85m": _arch("qwen3", 768, 4, 12, 6, 64, 3072, 32000),
    "gpu-dense-1b": _arch("qwen3", 2048, 16, 16, 8, 128, 8192, 32768, **_GPU),
    "gpu-moe-2b": _arch("qwen3_moe", 2048, 16, 16, 8, 128, 8192, 32768, **_GPU, **_experts(8, 2048)),
}


def preset(name: str) -> ModelArch:
    """The architecture named ``name``; an unknown name lists the valid ones."""
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} is unknown; presets: {', '.join(PRESETS)}")
    return PRESETS[name]
