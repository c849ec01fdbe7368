"""The core attention of Megatron's local layer spec, on torch's ``scaled_dot_product_attention``.

Why it exists: without Transformer Engine, Megatron's local ``DotProductAttention`` builds the
whole ``[b, heads, s, s]`` score matrix (baddbmm, softmax, bmm): memory quadratic in the sequence
and no fused kernel. Through SDPA with ``is_causal=True`` a GPU without TE gets one of torch's fused
kernels (flash, cuDNN or memory-efficient attention: memory linear in the sequence), and a CPU gets
torch's CPU flash kernel: one code path, one kernel family, on every machine. It also takes packed
(THD) rows, which the local ``DotProductAttention`` refuses: each sequence of the row is a causal
SDPA call of its own, so no token attends across a ``cu_seqlens`` boundary and the cost is
quadratic in each sequence's length, not the row's.

What it computes is ``DotProductAttention``'s result up to rounding: the same softmax scale,
grouped-query key/value heads repeated as Megatron repeats them (query head ``j`` reads group
``j // (heads // groups)``), causal masking, and attention dropout in training only, drawn under
the same model-parallel RNG fork. Under context parallelism (CP > 1), padded or packed, it
exchanges keys and values over the CP group (``models.cp_attention``). What it does not support
(attention bias, explicit masks, mask types other than causal, sliding windows, softmax offsets,
cross-attention) it refuses with a ``ValueError``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from megatron_rl.models.cp_attention import context_parallel_attention

Tensor = torch.Tensor

__all__ = ["SdpaAttention"]


class SdpaAttention(MegatronModule):
    """Causal self-attention through SDPA; constructor and tensor layouts are ``DotProductAttention``'s.

    Padded rows: query ``[s, b, heads, dim]``, key and value ``[s, b, groups, dim]`` -> ``[s, b, heads*dim]``.
    Packed rows (``packed_seq_params.qkv_format == "thd"``): ``[t, heads, dim]`` -> ``[t, heads*dim]``.
    Heads and groups are this tensor-parallel rank's share.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        _refuse_unsupported_config(config, layer_number, attn_mask_type, attention_type)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.cp_group = getattr(pg_collection, "cp", None)
        if config.context_parallel_size > 1 and (self.cp_group is None or self.cp_group.size() == 1):
            raise ValueError(
                f"context_parallel_size={config.context_parallel_size} but the attention was built "
                "without a CP process group of that size"
            )
        tp_size = self.tp_group.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        # DotProductAttention divides this by layer_number under apply_query_key_layer_scaling and
        # multiplies the scores by layer_number again in its fp32 softmax: the net scale is this one.
        # SDPA applies the whole scale inside its kernel, so it needs no such split.
        self.softmax_scale = (
            1.0 / math.sqrt(self.hidden_size_per_attention_head) if softmax_scale is None else softmax_scale
        )
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
    ) -> Tensor:
        _refuse_unsupported_call(attention_mask, attn_mask_type, attention_bias)
        dropout_p = self.dropout_p if self.training else 0.0
        if self.config.context_parallel_size > 1:
            return self._context_parallel(query, key, value, packed_seq_params, dropout_p)
        key, value = _repeat_groups(key, query.size(-2)), _repeat_groups(value, query.size(-2))
        with self._dropout_rng(dropout_p):
            if packed_seq_params is None:
                return self._padded_rows(query, key, value, dropout_p)
            return self._packed_rows(query, key, value, packed_seq_params, dropout_p)

    def _dropout_rng(self, dropout_p: float):
        """DotProductAttention's RNG for dropout: the model-parallel fork (heads differ per TP rank),
        except under sequence parallelism, where it draws from the default generator."""
        if dropout_p == 0.0 or self.config.sequence_parallel:
            return contextlib.nullcontext()
        return tensor_parallel.get_cuda_rng_tracker().fork()

    def _padded_rows(self, query: Tensor, key: Tensor, value: Tensor, dropout_p: float) -> Tensor:
        """[s, b, heads, dim] queries, keys and values -> [s, b, heads*dim]."""
        if query.size(0) != key.size(0):
            raise ValueError(
                f"SdpaAttention is self-attention: query length {query.size(0)} != key length "
                f"{key.size(0)} (a KV cache needs another attention)"
            )
        context = self._causal_sdpa(*(x.permute(1, 2, 0, 3) for x in (query, key, value)), dropout_p)
        return context.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), -1)

    def _packed_rows(self, query: Tensor, key: Tensor, value: Tensor, packed_seq_params, dropout_p: float) -> Tensor:
        """[t, heads, dim] queries, keys and values -> [t, heads*dim], each sequence of the row on its own."""
        outputs = []
        for start, end in _sequence_bounds(packed_seq_params, query.size(0)):
            if end > start:  # cu_seqlens may repeat an offset: an empty sequence has no output rows
                per_sequence = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
                outputs.append(self._causal_sdpa(*per_sequence, dropout_p)[0].transpose(0, 1))
        if not outputs:  # a row of zero tokens
            return query.flatten(1)
        return torch.cat(outputs).flatten(1)

    def _context_parallel(self, query: Tensor, key: Tensor, value: Tensor, packed_seq_params, dropout_p: float):
        """This CP rank's share of the row: [s, b, heads, dim] (padded) or [t, heads, dim] (packed)
        queries, keys and values of the local groups -> [s, b, heads*dim] or [t, heads*dim]."""
        cp = self.cp_group.size()
        if packed_seq_params is None:
            segments = [query.size(0) * cp]
        else:
            segments = [end - start for start, end in _sequence_bounds(packed_seq_params, query.size(0) * cp)]
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
        if dropout_p > 0:
            raise ValueError(
                f"attention dropout ({dropout_p}) under context parallelism is not supported: the CP "
                "attention recomputes its forward in the backward; set attention_dropout=0"
            )
        context = context_parallel_attention(
            query, key, value, segments, self.cp_group, _repeat_groups, self.softmax_scale
        )
        context = context.reshape(context.size(0), context.size(1), -1)
        return context if packed_seq_params is None else context.squeeze(1)

    def _causal_sdpa(self, query: Tensor, key: Tensor, value: Tensor, dropout_p: float) -> Tensor:
        """[b, heads, s, dim] queries, keys and values -> [b, heads, s, dim]."""
        return F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout_p, is_causal=True, scale=self.softmax_scale
        )


def _repeat_groups(key_or_value: Tensor, num_heads: int) -> Tensor:
    """[..., groups, dim] -> [..., heads, dim] in Megatron's order: group g serves heads g*r .. g*r + r - 1.

    Not SDPA's ``enable_gqa``: on CUDA no fused kernel takes it in fp32 (SDPA falls back to its
    quadratic-memory math path there), while repeated heads reach the memory-efficient kernel."""
    repeats = num_heads // key_or_value.size(-2)
    return key_or_value.repeat_interleave(repeats, dim=-2) if repeats > 1 else key_or_value


def _sequence_bounds(packed_seq_params, num_tokens: int) -> list[tuple[int, int]]:
    """(start, end) of each sequence in a packed row of ``num_tokens``, from ``cu_seqlens_q``.

    Reading the offsets waits for the device once per call: SDPA takes one sequence per call."""
    if packed_seq_params.qkv_format != "thd":
        raise ValueError(f"SdpaAttention takes packed rows as qkv_format='thd', got {packed_seq_params.qkv_format!r}")
    if packed_seq_params.cu_seqlens_q_padded is not None or packed_seq_params.cu_seqlens_kv_padded is not None:
        raise ValueError("SdpaAttention does not support padded cu_seqlens (cu_seqlens_q_padded/cu_seqlens_kv_padded)")
    cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
    if cu_kv is not None and cu_kv is not cu_q and not torch.equal(cu_kv, cu_q):
        raise ValueError("SdpaAttention is self-attention: cu_seqlens_kv must equal cu_seqlens_q")
    offsets = cu_q.tolist()
    if offsets[0] != 0 or offsets[-1] != num_tokens or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens_q must rise from 0 to the row's {num_tokens} tokens, got {offsets}")
    return list(zip(offsets[:-1], offsets[1:]))


def _refuse_unsupported_config(config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str) -> None:
    """ValueError for a layer this module would not compute as DotProductAttention does."""
    if attn_mask_type != AttnMaskType.causal:
        raise ValueError(f"SdpaAttention supports only the causal mask type, got {attn_mask_type}.")
    if attention_type != "self":
        raise ValueError(f"SdpaAttention supports only self-attention, got attention_type={attention_type!r}.")
    if config.softmax_type != "vanilla":
        raise ValueError(f"SdpaAttention supports only softmax_type='vanilla', got {config.softmax_type!r}.")
    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        raise ValueError(f"SdpaAttention does not support sliding-window attention (window_size={config.window_size}).")


def _refuse_unsupported_call(
    attention_mask: Optional[Tensor], attn_mask_type: Optional[AttnMaskType], attention_bias: Optional[Tensor]
) -> None:
    """ValueError for call arguments DotProductAttention would honour and this module would not."""
    if attention_bias is not None:
        raise ValueError("SdpaAttention does not support attention_bias.")
    if attention_mask is not None:
        raise ValueError("SdpaAttention takes attention_mask=None: the mask is causal, from attn_mask_type.")
    if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
        raise ValueError(f"SdpaAttention supports only the causal mask type, got {attn_mask_type}.")
