"""The benchmarks' model presets: one name, one model, for every bench.

``bench mfu --model``, ``bench weight-sync --preset``, ``bench checkpoint --model`` and
tools/bench_rollout_speed.py all read this table, so a number in docs/benchmarks.md names
exactly one model whichever bench produced it. Each name says the family kind and the
size, so a renamed or resized model cannot silently take an old name. All are qwen3 /
qwen3_moe: the families :func:`megatron_rl_lab.testing.hf_models.save_tiny_model` writes,
so every bench (the weight sync and rollout benches write the model as an HF directory)
takes every preset. Head sizes 32 / 64 / 128 suit vLLM's CPU attention; layers, heads,
KV groups and experts divide by 2, so every preset runs in TP2, PP2 and (MoE) EP2.

The table "Model presets" in docs/benchmarks.md gives each one's size and the numbers it
produced; tests/unit/bench/test_presets.py checks that table against this one.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

from megatron_rl.models.hf_config import ModelArch, arch_from_hf
from megatron_rl_lab.testing.tiny import TINY_DENSE, TINY_QWEN3_MOE


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
        qkv_bias=False,
        qk_layernorm=True,
        **moe,
    )


def _experts(ffn: int) -> dict:
    return dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=ffn)


_GPU = dict(max_positions=8192, rope_theta=500000.0)  # room for the 4096-token MFU runs

PRESETS: dict[str, ModelArch] = {
    "tiny-dense": TINY_DENSE,
    "tiny-moe": TINY_QWEN3_MOE,
    "cpu-dense-5m": _arch("qwen3", 256, 4, 8, 4, 32, 768, 4096),
    "cpu-moe-9m": _arch("qwen3_moe", 256, 4, 8, 4, 32, 768, 4096, **_experts(256)),
    "cpu-dense-9m": _arch("qwen3", 384, 4, 6, 2, 64, 1024, 4096),
    "cpu-moe-14m": _arch("qwen3_moe", 384, 4, 6, 2, 64, 1024, 4096, **_experts(256)),
    # Qwen3-30B-A3B's routing shape (top-8 of many small experts), scaled to CPU: 64 experts.
    "cpu-moe-64e": _arch(
        "qwen3_moe", 256, 4, 8, 4, 32, 768, 4096, num_moe_experts=64, moe_router_topk=8, moe_ffn_hidden_size=64
    ),
    "cpu-dense-82m": _arch("qwen3", 1024, 4, 16, 4, 64, 3072, 16384),
    "cpu-dense-85m": _arch("qwen3", 768, 4, 12, 6, 64, 3072, 32000),
    "gpu-dense-1b": _arch("qwen3", 2048, 16, 16, 8, 128, 8192, 32768, **_GPU),
    "gpu-moe-2b": _arch("qwen3_moe", 2048, 16, 16, 8, 128, 8192, 32768, **_GPU, **_experts(2048)),
}


def resolve_model(name_or_path: str) -> ModelArch:
    """A preset name, or an HF model directory / config.json (read without transformers)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        raise ValueError(
            f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor an HF model directory / config.json"
        )
    return arch_from_hf(types.SimpleNamespace(**json.loads(config.read_text())))


def model_label(name_or_path: str) -> str:
    """A short name for file names: the preset, or the model directory's name."""
    if name_or_path in PRESETS:
        return name_or_path
    path = Path(name_or_path)
    return (path if path.is_dir() else path.parent).name or "model"
