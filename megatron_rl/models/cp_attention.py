"""Causal self-attention over a context-parallel group without Transformer Engine: all-gather K/V.

Each CP rank holds two chunks of every sequence (`parallel.sequence_split`): chunk r and chunk
2·CP−1−r of 2·CP. Its queries need the keys and values of every earlier position, most of
which live on other ranks. As in the Llama 3 paper's context parallelism and slime's
all-gather CP, every rank all-gathers the keys and values of the whole row (before the
grouped-query heads are repeated, so a GQA model moves only its KV heads), puts them back in
row order, and attends each of its query chunks to the prefix that chunk sees, the diagonal
block masked causally by global position. Packed (THD) rows do the same per sequence, so no
token attends across a sequence boundary.

The backward of the exchange reduce-scatters dK and dV over the group: a rank's keys were read
by the queries of every rank, so their gradient is the sum of all ranks' contributions. That
autograd pair (all-gather forward, reduce-scatter backward along the first dimension) is
Megatron's `gather_from_sequence_parallel_region`, used here with the CP group.

Cost: every rank keeps the whole row's K and V of a layer for its backward (2·groups·dim values
per position, against the per-token activations, hidden and MLP, that CP divides), and the
backward recomputes the attention of the rank's chunks (`_PrefixAttention`: no [chunk, prefix]
mask is kept); the causal work is the same on every rank (the early chunk sees r+1 chunks, the
late one 2·CP−r). Attention dropout is refused under CP (the recomputation would draw other
masks); RL models train without it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rl.parallel.sequence_split import gather_source

Tensor = torch.Tensor

__all__ = ["context_parallel_attention"]


def context_parallel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    segments: Sequence[int],
    cp_group: dist.ProcessGroup,
    repeat_groups: Callable[[Tensor, int], Tensor],
    scale: float,
) -> Tensor:
    """[s, b, heads, dim] local queries, [s, b, groups, dim] local keys and values -> [s, b, heads, dim].

    `segments`: the whole row's sequences in order, in positions (one entry for a padded row;
    every sequence's slot for a packed row, `b` = 1), each a multiple of 2·CP.
    `repeat_groups(kv, heads)` turns KV groups into per-query-head keys or values.
    """
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    # index_select keeps only the index for its backward (index_copy would keep a second copy
    # of the gathered keys and values)
    source = gather_source(tuple(segments), cp_group.size()).to(query.device)
    whole = []
    for local in (key, value):
        gathered = gather_from_sequence_parallel_region(
            local.contiguous(), tensor_parallel_output_grad=True, group=cp_group
        )
        whole.append(gathered.index_select(0, source))
    layout = _ChunkLayout(tuple(segments), cp_group.size(), cp_group.rank(), repeat_groups, scale)
    return _PrefixAttention.apply(query, whole[0], whole[1], layout)


class _ChunkLayout(NamedTuple):
    segments: tuple[int, ...]
    cp_size: int
    cp_rank: int
    repeat_groups: Callable[[Tensor, int], Tensor]
    scale: float


class _PrefixAttention(torch.autograd.Function):
    """This rank's query chunks against the row's keys and values, recomputed in the backward.

    Why a Function of its own: a chunk that does not start the sequence attends to a prefix
    longer than itself, which SDPA takes only with an explicit mask, and SDPA keeps that mask
    (as a float [chunk, prefix] matrix) for its backward: at 8k positions and CP2 four times
    the layer's keys and values. Here the forward keeps only its inputs, and the backward
    recomputes the chunks' attention (one more attention forward per layer) to differentiate
    it, the mask living only inside each call.
    """

    @staticmethod
    def forward(ctx, query: Tensor, keys: Tensor, values: Tensor, layout: _ChunkLayout) -> Tensor:
        ctx.save_for_backward(query, keys, values)
        ctx.layout = layout
        with torch.no_grad():
            return _chunk_attention(query, keys, values, layout)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        query, keys, values = (x.detach().requires_grad_() for x in ctx.saved_tensors)
        with torch.enable_grad():
            out = _chunk_attention(query, keys, values, ctx.layout)
        grads = torch.autograd.grad(out, (query, keys, values), grad_output)
        return (*grads, None)


def _chunk_attention(query: Tensor, keys: Tensor, values: Tensor, layout: _ChunkLayout) -> Tensor:
    """[s, b, heads, dim] local queries, the row's [S, b, groups, dim] keys and values in row order."""
    heads = query.size(-2)
    keys, values = layout.repeat_groups(keys, heads), layout.repeat_groups(values, heads)
    outputs, local_start, row_start = [], 0, 0
    for length in layout.segments:
        chunk = length // (2 * layout.cp_size)
        for half, index in enumerate((layout.cp_rank, 2 * layout.cp_size - 1 - layout.cp_rank)):
            begin = local_start + half * chunk
            seen = row_start + (index + 1) * chunk
            prefix = slice(row_start, seen)
            outputs.append(_prefix_attention(query[begin : begin + chunk], keys[prefix], values[prefix], layout.scale))
        local_start += 2 * chunk
        row_start += length
    return torch.cat(outputs) if outputs else query


def _prefix_attention(query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
    """[c, b, heads, dim] queries at the last c positions of a [p, b, heads, dim] prefix: each
    query sees every earlier position and itself (causal, aligned to the prefix's end)."""
    if query.size(0) == 0:
        return query
    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
    c, p = query.size(0), key.size(0)
    if c == p:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        visible = torch.ones(c, p, dtype=torch.bool, device=query.device).tril(diagonal=p - c)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
    return out.permute(2, 0, 1, 3)
