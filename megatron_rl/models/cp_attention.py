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
per position, against the per-token activations, hidden and MLP, that CP divides); the causal
work is the same on every rank (the early chunk sees (r+1) chunks, the late one 2·CP−r).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rl.parallel.sequence_split import row_order

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
    dropout_p: float,
) -> Tensor:
    """[s, b, heads, dim] local queries, [s, b, groups, dim] local keys and values -> [s, b, heads, dim].

    `segments`: the whole row's sequences in order, in positions (one entry for a padded row;
    every sequence's slot for a packed row, `b` = 1), each a multiple of 2·CP.
    `repeat_groups(kv, heads)` turns KV groups into per-query-head keys or values.
    """
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    order = row_order(segments, cp_size).to(query.device)
    heads = query.size(-2)
    whole = []
    for local in (key, value):
        gathered = gather_from_sequence_parallel_region(
            local.contiguous(), tensor_parallel_output_grad=True, group=cp_group
        )
        in_row = gathered.new_empty(gathered.shape).index_copy(0, order, gathered)
        whole.append(repeat_groups(in_row, heads))
    keys, values = whole
    outputs, local_start, row_start = [], 0, 0
    for length in segments:
        chunk = length // (2 * cp_size)
        for half, index in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
            begin = local_start + half * chunk
            seen = row_start + (index + 1) * chunk
            outputs.append(
                _prefix_attention(
                    query[begin : begin + chunk], keys[row_start:seen], values[row_start:seen], scale, dropout_p
                )
            )
        local_start += 2 * chunk
        row_start += length
    return torch.cat(outputs) if outputs else query


def _prefix_attention(query: Tensor, key: Tensor, value: Tensor, scale: float, dropout_p: float) -> Tensor:
    """[c, b, heads, dim] queries at the last c positions of a [p, b, heads, dim] prefix: each
    query sees every earlier position and itself (causal, aligned to the prefix's end)."""
    if query.size(0) == 0:
        return query
    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
    c, p = query.size(0), key.size(0)
    if c == p:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)
    else:
        visible = torch.ones(c, p, dtype=torch.bool, device=query.device).tril(diagonal=p - c)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=dropout_p, scale=scale)
    return out.permute(2, 0, 1, 3)
