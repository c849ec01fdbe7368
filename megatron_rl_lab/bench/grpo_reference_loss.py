"""GRPO written from its formulas in plain torch, for ``megatron-rl bench grpo-reference``.

Nothing here imports :mod:`megatron_rl.algorithms`: the point of the reference is a second,
independent writing of the same learner, checked against ours on the same samples. The
formulas are those of docs/algorithms.md:

    A_i   = (R_i − mean_g) / (std_g + eps)      std with the n − 1 divisor; a group of one
                                                 has mean 0 and std 1
    r_t   = exp(logp_t − old_t)
    ℓ_t   = max(−A·r_t, −A·clip(r_t, 1 − ε_low, 1 + ε_high))
    k3_t  = exp(ref_t − logp_t) − (ref_t − logp_t) − 1

and the loss aggregations over a mini-batch's [B, T] token grid with mask m:

    token-mean               Σ m·ℓ / Σ m
    seq-mean-token-mean      mean over rows with a token of (Σ_t m·ℓ / Σ_t m)
    seq-mean-token-sum       mean over rows with a token of Σ_t m·ℓ

(Dr. GRPO's seq-mean-token-sum-norm divides by the trainer's sequence length, a constant of
the run rather than of the rows; the reference does not write it.)

Rows are Python lists where a loop over groups reads more plainly than a scatter.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

Tensor = torch.Tensor
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
"""The loss aggregations the reference writes (:func:`aggregate`)."""


def group_advantages(rewards: Sequence[float], groups: Sequence[int], eps: float = 1e-6, by_std: bool = True):
    """GRPO's advantage of each row, from the rewards of the rows that share its group."""
    members: dict[int, list[float]] = {}
    for reward, group in zip(rewards, groups):
        members.setdefault(group, []).append(float(reward))
    stats = {}
    for group, values in members.items():
        n = len(values)
        if n == 1:
            stats[group] = (0.0, 1.0)
            continue
        mean = sum(values) / n
        stats[group] = (mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)))
    out = []
    for reward, group in zip(rewards, groups):
        mean, std = stats[group]
        out.append((reward - mean) / (std + eps) if by_std else reward - mean)
    return out


def clipped_surrogate(logp: Tensor, old: Tensor, advantages: Tensor, clip_low: float, clip_high: float):
    """Per-token PPO loss ℓ [B, T] and where the clipped term won (the clip fraction's tokens)."""
    ratio = torch.exp(logp - old)
    plain = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(plain, clipped), clipped > plain


def k3(logp: Tensor, ref: Tensor) -> Tensor:
    """Schulman's k3 estimate of KL(π‖π_ref) per token."""
    d = ref - logp
    return torch.exp(d) - d - 1.0


def aggregate(loss: Tensor, mask: Tensor, mode: str) -> Tensor:
    """One mini-batch's loss from per-token losses [B, T] and a bool mask [B, T]."""
    m = mask.float()
    per_row_tokens = m.sum(-1)
    rows = (per_row_tokens > 0).float()
    row_sums = (loss * m).sum(-1)
    if mode == "token-mean":
        return row_sums.sum() / m.sum()
    if mode == "seq-mean-token-mean":
        return (row_sums / per_row_tokens.clamp_min(1)).sum() / rows.sum()
    if mode == "seq-mean-token-sum":
        return row_sums.sum() / rows.sum()
    raise ValueError(f"loss aggregation {mode!r} has no reference")
