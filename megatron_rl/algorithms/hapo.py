"""HAPO token-aware pieces (docs/algorithms.md, "HAPO token-aware pieces").

High-entropy tokens are the "forks" of a reasoning path. HAPO normalises each token's
entropy to ĥ ∈ [−1, 1] around a batch quantile and uses it three ways: the sampling
temperature (`adaptive_temperature`), asymmetric clip bounds (`asymmetric_clip_bounds`)
and advantage redistribution (`redistribute_advantages`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.algorithms._common import Tensor, as_float
from megatron_rl.algorithms.losses import entropy_from_logits

__all__ = [
    "EntropyStats",
    "entropy_stats",
    "normalized_entropy",
    "adaptive_temperature",
    "asymmetric_clip_bounds",
    "redistribute_advantages",
]

ENTROPY_FLOOR = 1e-8  # log(max(H, floor)): a one-hot distribution has H = 0


@dataclass(frozen=True)
class EntropyStats:
    """The statistics that map log-entropy e to ĥ; computed on one training step's
    tokens and reused by the sampler on the next step. Scalars (0-d tensors or floats)."""

    pivot: Tensor | float
    """The `pivot_quantile` quantile of e over real tokens."""
    scale: Tensor | float
    """sqrt(mean((e − pivot)²)) over real tokens (floored at 1e-8)."""
    pos_max: Tensor | float
    """max(h) over real tokens: divides h > 0 so the highest entropy maps to 1."""
    neg_max: Tensor | float
    """|min(h)| over real tokens: divides h ≤ 0 so the lowest entropy maps to −1."""

    def as_floats(self) -> EntropyStats:
        """Plain-float copy (one host sync), for shipping to the rollout engine."""
        values = (self.pivot, self.scale, self.pos_max, self.neg_max)
        return EntropyStats(*(float(v) for v in values))


def _quantile(values: Tensor, q: float) -> Tensor:
    """Linear-interpolation quantile of a 1-D tensor (same as torch.quantile, which
    refuses inputs above 2**24 elements: a long-response batch can exceed that)."""
    ordered = values.sort().values
    position = q * (ordered.numel() - 1)
    lo = int(position)
    hi = min(lo + 1, ordered.numel() - 1)
    return ordered[lo] + (position - lo) * (ordered[hi] - ordered[lo])


def entropy_stats(entropy: Tensor, response_mask: Tensor, pivot_quantile: float = 0.8) -> EntropyStats:
    """Compute `EntropyStats` from per-token entropy [B, T] over the real tokens."""
    if not 0.0 <= pivot_quantile <= 1.0:
        raise ValueError(f"pivot_quantile must be in [0, 1], got {pivot_quantile}")
    log_entropy = torch.log(as_float(entropy).clamp_min(ENTROPY_FLOOR))
    real = log_entropy[response_mask.bool()]
    if real.numel() == 0:
        one = log_entropy.new_ones(())
        return EntropyStats(log_entropy.new_zeros(()), one, one, one)
    pivot = _quantile(real, pivot_quantile)
    scale = (real - pivot).square().mean().sqrt().clamp_min(1e-8)
    h = (real - pivot) / scale
    tiny = torch.finfo(h.dtype).tiny  # no h > 0 (or h < 0) at all: that branch is unused
    return EntropyStats(pivot, scale, h.max().clamp_min(tiny), (-h.min()).clamp_min(tiny))


def _h_hat(entropy: Tensor, stats: EntropyStats) -> Tensor:
    """ĥ for every element of `entropy` (any shape) under `stats`, clamped to [−1, 1]
    (clamping matters only when stats come from another batch)."""
    log_entropy = torch.log(as_float(entropy).clamp_min(ENTROPY_FLOOR))
    h = (log_entropy - stats.pivot) / stats.scale
    h_hat = torch.where(h > 0, h / stats.pos_max, h / stats.neg_max)
    return h_hat.clamp(-1.0, 1.0)


def normalized_entropy(
    entropy: Tensor,
    response_mask: Tensor,
    pivot_quantile: float = 0.8,
    stats: EntropyStats | None = None,
    return_stats: bool = False,
) -> Tensor | tuple[Tensor, EntropyStats]:
    """HAPO signed normalised entropy ĥ, [B, T] -> [B, T] in [−1, 1], 0 at masked positions.

    e = log(max(H, 1e-8)); pivot = `pivot_quantile` quantile of e over real tokens;
    h = (e − pivot)/sqrt(mean((e − pivot)²)); ĥ = h/max(h) for h > 0, h/|min(h)| for
    h ≤ 0: tokens above the pivot map into (0, 1], those below into [−1, 0].
    `stats`: reuse given statistics instead of computing them from this batch.
    `return_stats=True` returns (ĥ, stats) so the sampler can reuse them next step.
    """
    if stats is None:
        stats = entropy_stats(entropy, response_mask, pivot_quantile)
    h_hat = torch.where(response_mask.bool(), _h_hat(entropy, stats), 0.0)
    return (h_hat, stats) if return_stats else h_hat


def adaptive_temperature(
    logits: Tensor, temperature: float, stats: EntropyStats | None = None, tau: float = 0.05
) -> Tensor:
    """HAPO per-token sampling temperature T_t = T·(1 + τ·ĥ_t), logits [..., V] -> [...].

    ĥ_t comes from the entropy of the given logits under the previous training step's
    `stats`; with stats None (first step) every token gets the plain T. High-entropy
    forks are explored more, confident tokens sampled more greedily. The sampler
    divides the logits by the result (unsqueezed on the vocabulary dim).

    The trainer's statistics are of the entropy at the base temperature (Megatron's
    entropy at T), so pass ``logits / T`` to match them; the rollout engine's processor
    (rollout/adaptive_temperature.py) sees exactly those logits.
    """
    if not 0.0 <= tau < 1.0:
        raise ValueError(f"tau must be in [0, 1) so that T_t > 0, got {tau}")
    if stats is None:
        shape = logits.shape[:-1]
        return torch.full(shape, float(temperature), dtype=torch.float32, device=logits.device)
    h_hat = _h_hat(entropy_from_logits(logits), stats)
    return temperature * (1.0 + tau * h_hat)


def asymmetric_clip_bounds(
    h_hat: Tensor, clip_low: float = 0.2, clip_high: float = 0.2, alpha: float = 1.0
) -> tuple[Tensor, Tensor]:
    """HAPO per-token clip bounds from ĥ [B, T] -> (low [B, T], high [B, T]).

    ĥ ≤ 0: ε_low' = ε_low·(1 − α·ĥ), ε_high' = ε_high (confident tokens may drop more);
    ĥ > 0: ε_high' = ε_high·(1 + α·ĥ), ε_low' = ε_low (forks may rise more).
    """
    h_hat = as_float(h_hat)
    low = clip_low * (1.0 - alpha * h_hat.clamp(max=0.0))
    high = clip_high * (1.0 + alpha * h_hat.clamp(min=0.0))
    return low, high


def redistribute_advantages(
    advantages: Tensor,
    ratio: Tensor,
    h_hat: Tensor,
    low: float | Tensor,
    high: float | Tensor,
    beta: float = 1.0,
) -> Tensor:
    """HAPO advantage redistribution, all [B, T] (advantages may be [B, 1]) -> [B, T].

    A_ent = A·(1 + β·ĥ). Neutral zone: 1 − low/2 < r < 1 + high/2. Tokens with ĥ > 0
    keep A inside the zone and get A_ent outside; tokens with ĥ ≤ 0 get A_ent inside and
    keep A outside. Pass a detached ratio: it only selects, it carries no gradient.
    """
    boosted = advantages * (1.0 + beta * h_hat)
    in_zone = (ratio > 1.0 - low / 2) & (ratio < 1.0 + high / 2)
    use_boosted = torch.where(h_hat > 0, ~in_zone, in_zone)
    return torch.where(use_boosted, boosted, advantages)
