"""Check a conversion by its outputs: tiny HF models of every family, and Megatron logits
to compare with transformers' on the same tokens.

The tiny models get weights of unit-scale activations (not the 0.02 init), so that every
tensor moves the logits and a mapping mistake cannot hide under the tolerance.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl import platform
from megatron_rl.bridge.families import FUSED, PER_EXPERT

_COMMON = dict(
    vocab_size=97,  # not a multiple of 2: TP=2 pads a vocabulary row
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=128,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)

#: family -> (transformers config class, family-specific fields); 4 experts, top-2
TINY_FAMILIES = {
    "llama": ("LlamaConfig", dict(rope_theta=500000.0)),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
}


def tiny_hf_config(family: str, **overrides):
    import transformers

    cls, fields = TINY_FAMILIES[family]
    kwargs = dict(_COMMON, tie_word_embeddings=False)
    kwargs.update(fields)
    kwargs.update(overrides)
    return getattr(transformers, cls)(**kwargs)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of unit-scale activations: norms near 1, matrices ~ 1/sqrt(fan_in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=g)
            if param.dim() == 1 and "bias" not in name:
                param.copy_(1.0 + 0.2 * noise)
            elif param.dim() == 1:
                param.copy_(0.2 * noise)
            elif "embed" in name:
                param.copy_(noise)
            else:
                param.copy_(noise / math.sqrt(param.shape[-1]))


def make_tiny_hf(family: str, out_dir: str | os.PathLike, style: str = PER_EXPERT, seed: int = 0, **overrides) -> Path:
    """A random tiny model of ``family`` saved as an HF directory.

    ``style=PER_EXPERT`` is what ``save_pretrained`` writes; ``FUSED`` saves the
    transformers-5 in-memory names (experts stacked) as another tool might.
    """
    import transformers
    from safetensors.torch import save_file

    cfg = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    randomize(model, seed)
    out = Path(out_dir)
    if style == PER_EXPERT:
        model.save_pretrained(out)
    elif style == FUSED:
        out.mkdir(parents=True, exist_ok=True)
        state = model.state_dict()
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
        cfg.save_pretrained(out)
    else:
        raise ValueError(f"style {style!r}; allowed: {PER_EXPERT!r}, {FUSED!r}")
    return out


def hf_logits(hf_dir: str | os.PathLike, tokens: torch.Tensor, device: str | torch.device = "cpu") -> torch.Tensor:
    """transformers' fp32 logits [batch, seq, vocab] for ``tokens``, computed on ``device``
    (and returned there), with the eager attention every install has."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    model.to(device).eval()
    with torch.no_grad():
        return model(input_ids=tokens.to(device)).logits.float()


def megatron_logits(chunks: Sequence[torch.nn.Module], tokens: torch.Tensor, tp_group) -> Optional[torch.Tensor]:
    """Megatron's logits [batch, seq, padded vocab] on last-stage ranks (None elsewhere), on
    the platform's device, run through Megatron's own schedule so that pipeline stages pass
    activations."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch, seq = tokens.shape
    tokens = tokens.to(platform.current().device)
    positions = torch.arange(seq, device=tokens.device).unsqueeze(0).expand_as(tokens)
    outputs = []

    def forward_step(data_iterator, model):
        out = model(next(data_iterator), positions, None)

        def keep(output):
            outputs.append(output.detach())
            return output.new_zeros(()), {}

        return out, keep

    for chunk in chunks:
        chunk.eval()
    with platform.megatron_scope(), torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter([tokens]) for _ in chunks] if len(chunks) > 1 else iter([tokens]),
            model=list(chunks) if len(chunks) > 1 else chunks[0],
            num_microbatches=1,
            seq_length=seq,
            micro_batch_size=batch,
            forward_only=True,
        )
    if not outputs:
        return None
    local = outputs[-1].float().contiguous()  # [b, s, vocab / tp], vocab-parallel
    if dist.get_world_size(tp_group) == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, local, group=tp_group)
    return torch.cat(parts, dim=-1)


def read_config(hf_dir: str | os.PathLike) -> dict:
    return json.loads((Path(hf_dir) / "config.json").read_text())
