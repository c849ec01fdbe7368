"""Reward shaping and rollout filtering (docs/algorithms.md, "Reward shaping and sampling")."""

from __future__ import annotations

from megatron_rl.algorithms._common import (
    Tensor,
    as_float,
    group_count,
    group_ids,
    group_reduce,
)

__all__ = ["overlong_penalty", "dynamic_sampling_keep"]


def overlong_penalty(lengths: Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment, [B] lengths -> [B] penalty (≤ 0), added to R.

    0 for l ≤ max_len − buffer_len, then a linear ramp down to −factor at l = max_len,
    and −factor beyond. The ramp tells the policy "too long" before the hard cut-off
    turns a correct answer into a truncated one. (DAPO: max_len 20480, buffer 4096.)
    """
    if buffer_len <= 0 or buffer_len > max_len:
        raise ValueError(f"overlong_penalty needs 0 < buffer_len <= max_len, got {buffer_len}, {max_len}")
    expected = max_len - buffer_len
    excess = (as_float(lengths) - expected) / buffer_len
    return -factor * excess.clamp(0.0, 1.0)


def dynamic_sampling_keep(metric: Tensor, group_index: Tensor) -> Tensor:
    """DAPO dynamic sampling: which samples to keep, [B] -> bool [B].

    A group whose metric (e.g. accuracy) is the same for every sample has zero
    group-relative advantage and only dilutes the batch: drop it. Groups of one are
    kept (nothing to compare against, and dropping them would starve group size 1 runs).
    """
    values = as_float(metric)
    ids, num_groups = group_ids(group_index)
    highest = group_reduce(values, ids, num_groups, "amax")
    spread = highest > group_reduce(values, ids, num_groups, "amin")
    single = group_count(ids, num_groups, values.dtype) == 1
    return (spread | single)[ids]
