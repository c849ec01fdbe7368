"""Small tensor helpers shared by the algorithm modules (masked reductions, group sums).

Private: the public API is re-exported from `megatron_rl.algorithms`.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def as_float(x: Tensor) -> Tensor:
    """Promote to at least float32 (bf16/fp16/int inputs), keeping float64 as is."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Σ x over mask (any shape). `torch.where`, not `x * mask`, so inf/nan at padded
    positions (e.g. logprobs of pad tokens) cannot leak into the sum."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over mask; 0 when the mask is empty."""
    count = mask.bool().sum().clamp_min(1)
    return masked_sum(x, mask) / count


def group_ids(group_index: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group labels [B] to dense ids 0..G-1. Returns (ids [B], G)."""
    labels, ids = torch.unique(group_index, return_inverse=True)
    return ids, labels.numel()


def group_sum(x: Tensor, ids: Tensor, num_groups: int) -> Tensor:
    """Per-group sum of x [B] -> [G]."""
    out = torch.zeros(num_groups, dtype=x.dtype, device=x.device)
    return out.index_add(0, ids, x)


def group_reduce(x: Tensor, ids: Tensor, num_groups: int, reduce: str) -> Tensor:
    """Per-group "amax" or "amin" of x [B] -> [G]."""
    fill = float("-inf") if reduce == "amax" else float("inf")
    out = torch.full((num_groups,), fill, dtype=x.dtype, device=x.device)
    return out.scatter_reduce(0, ids, x, reduce=reduce, include_self=True)


def group_count(ids: Tensor, num_groups: int, dtype: torch.dtype) -> Tensor:
    """Number of members of each group -> [G]."""
    return torch.bincount(ids, minlength=num_groups).to(dtype)


def last_token_index(response_mask: Tensor) -> Tensor:
    """Index of each row's last real token: [B, T] -> [B] long, −1 for rows with none."""
    length = response_mask.shape[-1]
    positions = torch.arange(length, device=response_mask.device).expand_as(response_mask)
    return torch.where(response_mask.bool(), positions, -1).max(dim=-1).values
