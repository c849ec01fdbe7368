"""Per-token losses and their aggregation (docs/algorithms.md, "Losses").

Split-invariance contract (`norm`): every aggregation is "local numerator / denominator".
The schedule computes the denominator of the WHOLE mini-batch before it starts
(`LOSS_AGGREGATIONS[mode].local_norm(mask)` summed over microbatches and DP/CP ranks, when
`norm_is_additive`) and passes it as `norm`; summing the per-microbatch losses then gives
exactly the mini-batch loss, whatever the split. Without `norm` the local count is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch

from megatron_rl.algorithms._common import Tensor, as_float, masked_mean, masked_sum

__all__ = [
    "LossAggregation",
    "LOSS_AGGREGATIONS",
    "get_loss_aggregation",
    "aggregate",
    "policy_loss",
    "value_loss",
    "positive_example_nll",
    "KL_ESTIMATORS",
    "kl_penalty",
    "entropy_from_logits",
    "explained_variance",
]

Norm = Union[float, int, Tensor]
LOG_RATIO_CLAMP = 20.0  # exp(±20) stays finite in fp32; beyond that the ratio is meaningless


def _denominator(norm: Norm | None, local: Tensor) -> Tensor | float:
    if norm is None:
        return local.clamp_min(1)  # an empty part contributes 0, not nan
    if not isinstance(norm, Tensor) and norm <= 0:
        raise ValueError(f"norm must be > 0, got {norm}")
    return norm


def _token_count(mask: Tensor) -> Tensor:
    return mask.bool().sum()


def _seq_count(mask: Tensor) -> Tensor:
    # Rows without a real token (padding, filtered windows) are not sequences of this batch.
    return (mask.bool().sum(-1) > 0).sum()


def _seq_token_sums(loss: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.bool(), loss, 0.0).sum(-1)


def _token_mean(loss: Tensor, mask: Tensor, norm: Norm | None) -> Tensor:
    return masked_sum(loss, mask) / _denominator(norm, _token_count(mask))


def _seq_mean_token_mean(loss: Tensor, mask: Tensor, norm: Norm | None) -> Tensor:
    tokens = mask.bool().sum(-1)
    per_seq = _seq_token_sums(loss, mask) / tokens.clamp_min(1)
    return per_seq.sum() / _denominator(norm, _seq_count(mask))


def _seq_mean_token_sum(loss: Tensor, mask: Tensor, norm: Norm | None) -> Tensor:
    return _seq_token_sums(loss, mask).sum() / _denominator(norm, _seq_count(mask))


def _seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, norm: Norm | None) -> Tensor:
    # Dr. GRPO: divide by a constant L, not a count. `norm` carries L; default T (the
    # padded response length). Split-invariant as long as every part uses the same L.
    return masked_sum(loss, mask) / _denominator(norm, _padded_length(mask))


def _padded_length(mask: Tensor) -> Tensor:
    return torch.tensor(mask.shape[-1], device=mask.device)


@dataclass(frozen=True)
class LossAggregation:
    """One aggregation mode: how to reduce, and what `norm` means for it."""

    reduce: Callable[[Tensor, Tensor, Norm | None], Tensor]
    """(loss_tokens [B, T], response_mask [B, T], norm) -> scalar."""
    local_norm: Callable[[Tensor], Tensor]
    """response_mask -> this part's denominator (used when norm is None)."""
    norm_is_additive: bool
    """True: the whole-batch norm is the SUM of local_norm over all parts (a count).
    False: norm is a constant shared by all parts (seq-mean-token-sum-norm's L)."""


LOSS_AGGREGATIONS: dict[str, LossAggregation] = {
    "token-mean": LossAggregation(_token_mean, _token_count, True),
    "seq-mean-token-mean": LossAggregation(_seq_mean_token_mean, _seq_count, True),
    "seq-mean-token-sum": LossAggregation(_seq_mean_token_sum, _seq_count, True),
    "seq-mean-token-sum-norm": LossAggregation(_seq_mean_token_sum_norm, _padded_length, False),
}


def get_loss_aggregation(mode: str) -> LossAggregation:
    """Look up a mode; an unknown name raises ValueError listing the valid ones."""
    try:
        return LOSS_AGGREGATIONS[mode]
    except KeyError:
        valid = ", ".join(LOSS_AGGREGATIONS)
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid: {valid}") from None


def aggregate(loss_tokens: Tensor, response_mask: Tensor, mode: str, norm: Norm | None = None) -> Tensor:
    """Reduce per-token losses [B, T] to a scalar.

    token-mean: Σ m·ℓ / N_tok. seq-mean-token-mean: Σ_seq (Σ_t m·ℓ / Σ_t m) / N_seq.
    seq-mean-token-sum: Σ_seq Σ_t m·ℓ / N_seq. seq-mean-token-sum-norm: Σ m·ℓ / L.
    N_seq counts rows with at least one real token. `norm` replaces the denominator
    (N_tok, N_seq or L) with the whole mini-batch's (see the module docstring).
    """
    return get_loss_aggregation(mode).reduce(loss_tokens, response_mask, norm)


def _clip_ratio(ratio: Tensor, clip_low: float | Tensor, clip_high: float | Tensor) -> Tensor:
    lower = 1.0 - torch.as_tensor(clip_low, dtype=ratio.dtype, device=ratio.device)
    upper = 1.0 + torch.as_tensor(clip_high, dtype=ratio.dtype, device=ratio.device)
    return torch.minimum(torch.maximum(ratio, lower), upper)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float | Tensor = 0.2,
    clip_high: float | Tensor = 0.2,
    clip_c: float | None = None,
    agg: str = "token-mean",
    norm: Norm | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (with Clip-Higher and optional dual clip), aggregated.

    logp, old_logp, advantages, response_mask: [B, T]; clip_low/clip_high: float or
    [B, T] per-token bounds (HAPO). ℓ = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high));
    with clip_c and A < 0, ℓ = min(ℓ, −A·clip_c), which bounds the loss of a negative
    advantage whose ratio has exploded. token_weights [B, T] (rollout correction, no
    gradient) multiply ℓ before aggregation. Returns (loss scalar, stats): detached local
    metrics clipfrac, dual_clipfrac, approx_kl (mean old − new), ratio_mean, ratio_max.
    """
    if advantages.dim() != logp.dim():  # a [B] advantage would broadcast along T, silently
        raise ValueError(
            f"advantages must be shaped like logp {tuple(logp.shape)}, "
            f"got {tuple(advantages.shape)}; broadcast with adv[:, None]"
        )
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"clip_c (dual clip) must be > 1, got {clip_c}")
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * _clip_ratio(ratio, clip_low, clip_high)
    loss_tokens = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(loss_tokens, dtype=torch.bool)
    if clip_c is not None:
        bound = -advantages * clip_c
        dual_active = (advantages < 0) & (bound < loss_tokens)
        loss_tokens = torch.where(dual_active, bound, loss_tokens)
    if token_weights is not None:
        loss_tokens = loss_tokens * token_weights.detach().to(loss_tokens.dtype)
    loss = aggregate(loss_tokens, response_mask, agg, norm)
    with torch.no_grad():
        # masked tokens → 0; real ratios are > 0, so the max is a real token's
        ratio_real = torch.where(response_mask.bool(), ratio, 0.0)
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).float(), response_mask),
            "dual_clipfrac": masked_mean(dual_active.float(), response_mask),
            "approx_kl": masked_mean(old_logp - logp, response_mask),
            "ratio_mean": masked_mean(ratio, response_mask),
            "ratio_max": ratio_real.max() if ratio.numel() else ratio.new_zeros(()),
        }
    return loss, stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip_range: float | None = None,
    agg: str = "token-mean",
    norm: Norm | None = None,
) -> Tensor:
    """Critic loss 0.5·(V − R)², aggregated; all inputs [B, T].

    With clip_range c: 0.5·max((V − R)², (clip(V, V_old − c, V_old + c) − R)²), the
    PPO value clip that keeps the critic near the values used for the advantages.
    """
    error = (values - returns).square()
    if clip_range is not None:
        clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
        error = torch.maximum(error, (clipped - returns).square())
    return aggregate(0.5 * error, response_mask, agg, norm)


def positive_example_nll(logp: Tensor, response_mask: Tensor, is_positive: Tensor, norm: Norm | None = None) -> Tensor:
    """VAPO positive-example LM loss: −Σ logp over tokens of correct responses / their count.

    logp, response_mask: [B, T]; is_positive: [B] bool. Imitating its own correct samples
    makes better use of rare positives. `norm`: the whole mini-batch's count of positive
    tokens. No positive token gives 0 (still connected to the graph).
    """
    mask = response_mask.bool() & is_positive.bool().unsqueeze(-1)
    return -masked_sum(logp, mask) / _denominator(norm, mask.sum())


def _k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return logp - ref_logp


def _k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return 0.5 * (logp - ref_logp).square()


def _k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    # Clamp only guards exp overflow; it is inactive for |ref − logp| ≤ 20.
    log_ratio = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_ratio) - log_ratio - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}
"""Schulman's estimators of KL(π‖π_ref) from samples of π; all (logp, ref_logp) -> [B, T]."""


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL estimate [B, T]: k1 = logp − ref, k2 = ½(logp − ref)²,
    k3 = exp(ref − logp) − (ref − logp) − 1 (unbiased and ≥ 0)."""
    try:
        estimator = KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"unknown kl kind {kind!r}; valid: {', '.join(KL_ESTIMATORS)}") from None
    return estimator(logp, ref_logp)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-token entropy of softmax(logits): [..., V] -> [...], in float32 or wider.

    −Σ p·log p with 0·log 0 = 0, so −inf logits (masked vocabulary) are fine. Full
    vocabulary only: under tensor parallelism the schedule uses vocab-parallel reductions.
    """
    logp = torch.log_softmax(as_float(logits), dim=-1)
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, 0.0)).sum(-1)


def explained_variance(values: Tensor, returns: Tensor, response_mask: Tensor) -> Tensor:
    """1 − Var[R − V]/Var[R] over real tokens (critic quality metric; 1 is perfect)."""
    residual = as_float(returns) - as_float(values)
    var_returns = _masked_var(as_float(returns), response_mask)
    return 1.0 - _masked_var(residual, response_mask) / var_returns.clamp_min(1e-8)


def _masked_var(x: Tensor, mask: Tensor) -> Tensor:
    mean = masked_mean(x, mask)
    return masked_mean((x - mean).square(), mask)
