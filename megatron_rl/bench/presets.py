"""Model sizes for the MFU benchmark, by name, or any HF config.json turned into a ModelArch.

The CPU presets are sized so a training step takes about a second on two cores; the GPU
presets are what a one-H100 session runs to check the MFU targets (dense >= 50%,
MoE >= 40%). Parameter counts (untied embeddings and LM head included):
  gpu-dense-1b   1.14 B  (Llama-style: hidden 2048, 16 layers, 16 heads, 8 KV groups, ffn 8192)
  gpu-moe-2b     1.95 B total, 0.74 B active  (Qwen3-MoE-style: 8 experts top-2, ffn 2048)
"""

from __future__ import annotations

import json
import types
from pathlib import Path

from megatron_rl.models.hf_config import ModelArch, arch_from_hf
from megatron_rl.testing.tiny import TINY_DENSE, TINY_MOE


def _cpu(family: str, **moe) -> ModelArch:
    return ModelArch(
        family=family, vocab_size=4096, hidden_size=256, num_layers=4, num_attention_heads=8,
        num_query_groups=4, head_dim=32, ffn_hidden_size=768, norm_epsilon=1e-6, rope_theta=10000.0,
        max_position_embeddings=2048, tie_word_embeddings=False, qkv_bias=False, qk_layernorm=True,
        **moe,
    )


def _gpu(family: str, **moe) -> ModelArch:
    return ModelArch(
        family=family, vocab_size=32768, hidden_size=2048, num_layers=16, num_attention_heads=16,
        num_query_groups=8, head_dim=128, ffn_hidden_size=8192, norm_epsilon=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=False, qkv_bias=False,
        qk_layernorm=family == "qwen3_moe", **moe,
    )


PRESETS: dict[str, ModelArch] = {
    "tiny-dense": TINY_DENSE,
    "tiny-moe": TINY_MOE,
    "cpu-dense": _cpu("qwen3"),
    "cpu-moe": _cpu("qwen3_moe", num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=256),
    "gpu-dense-1b": _gpu("llama"),
    "gpu-moe-2b": _gpu("qwen3_moe", num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=2048),
}


def resolve_model(name_or_path: str) -> ModelArch:
    """A preset name, or an HF model directory / config.json (read without transformers)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        raise ValueError(
            f"--model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) "
            "nor an HF model directory / config.json"
        )
    return arch_from_hf(types.SimpleNamespace(**json.loads(config.read_text())))


def model_label(name_or_path: str) -> str:
    """A short name for file names: the preset, or the model directory's name."""
    if name_or_path in PRESETS:
        return name_or_path
    path = Path(name_or_path)
    return (path if path.is_dir() else path.parent).name or "model"
