"""Packed sequences (THD) through Megatron's local attention, for machines without
Transformer Engine.

Megatron-Core 0.16.1 hands a packed row to the core attention as `[t, heads, dim]` with a
`PackedSeqParams(qkv_format="thd")`; only TE's attention accepts that (the local
`DotProductAttention` asserts it is None). Everything around it (rotary embeddings that
restart at every `cu_seqlens` boundary, the squeeze and reshape in `Attention.forward`) is
plain torch and already correct. This subclass closes the gap: it runs the same packed
row as a batch of one with a block-diagonal causal mask, so a token attends to the earlier
tokens of its own sequence only. With TE installed the layer spec uses TE's attention and
this module is not built.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

Tensor = torch.Tensor

__all__ = ["PackedDotProductAttention", "block_causal_mask"]


def block_causal_mask(cu_seqlens: Tensor) -> Tensor:
    """[1, 1, t, t] bool, True = masked: position i sees j iff j <= i in the same sequence."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    position = torch.arange(segment.numel(), device=lengths.device)
    masked = (segment[:, None] != segment[None, :]) | (position[None, :] > position[:, None])
    return masked[None, None]


class PackedDotProductAttention(DotProductAttention):
    """Megatron's local attention that also takes THD packed rows (see the module docstring)."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed rows must be qkv_format='thd', got {packed_seq_params.qkv_format!r}")
        mask = block_causal_mask(packed_seq_params.cu_seqlens_q.to(query.device))
        context = super().forward(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask,
                                  attn_mask_type, attention_bias)
        return context.squeeze(1)  # [t, heads·dim]; Attention.forward reshapes it to [t, 1, h]
