"""Tiny random Hugging Face models on disk, built locally (there is no model hub here).

Tests of the rollout engine and the weight sync need the same model in three places:
an HF directory vLLM loads, transformers as the reference, and Megatron. Head size 32 is
the smallest vLLM's CPU attention accepts; Qwen3 and Qwen3-MoE take ``head_dim``
explicitly, so the tiny archs use them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl.models.hf_config import ModelArch

_EOS, _BOS, _PAD = 2, 1, 0


def hf_config(arch: ModelArch):
    """The transformers config of a tiny qwen3 / qwen3_moe :class:`ModelArch`."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_query_groups,
        head_dim=arch.head_dim,
        intermediate_size=arch.ffn_hidden_size,
        max_position_embeddings=arch.max_position_embeddings,
        rms_norm_eps=arch.norm_epsilon,
        rope_theta=arch.rope_theta,
        tie_word_embeddings=arch.tie_word_embeddings,
        bos_token_id=_BOS,
        eos_token_id=_EOS,
        pad_token_id=_PAD,
    )
    if arch.family == "qwen3":
        return Qwen3Config(**common)
    if arch.family == "qwen3_moe":
        return Qwen3MoeConfig(
            num_experts=arch.num_moe_experts,
            num_experts_per_tok=arch.moe_router_topk,
            moe_intermediate_size=arch.moe_ffn_hidden_size,
            norm_topk_prob=not arch.moe_router_pre_softmax,
            **common,
        )
    raise ValueError(f"tiny HF models exist for qwen3 and qwen3_moe, not {arch.family!r}")


def save_tiny_model(arch: ModelArch, path: Path, seed: int = 0, std: float = 0.1) -> Path:
    """Write a random model of ``arch`` to ``path`` (safetensors + config.json).

    A larger init std than HF's default makes the logits far from uniform, so parity
    checks compare distributions that actually differ between tokens.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    config = hf_config(arch)
    config.initializer_range = std
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


def save_tiny_model_on_rank0(arch: ModelArch, path: Path, seed: int = 0) -> Path:
    """Collective over the default group: rank 0 writes :func:`save_tiny_model`'s model, and
    every rank returns once it is there (ranks of one host share the directory)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        save_tiny_model(arch, path, seed=seed)
    dist.barrier()
    return Path(path)


def load_reference(path: Path):
    """The transformers model of ``path`` in fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def token_logprobs(model, sequence: list[int]) -> list[float]:
    """log p(token_i | tokens_<i) for i >= 1 under a transformers model."""
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(sequence[1:])[:, None])[:, 0].tolist()
