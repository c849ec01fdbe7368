"""Rollout correction: per-token loss weights for the gap between the rollout engine's
behaviour policy μ (vLLM's logprobs) and the trainer's π_old (Megatron's recomputation).

Even with the same weights, vLLM and Megatron differ numerically (bf16, kernels, MoE routes
that flip), so the tokens were sampled from μ ≠ π_old. With ρ_t = π_old(y_t)/μ(y_t) =
exp(log π_old − log μ) over the response tokens of the step:

- ``token_tis`` (truncated importance sampling, per token): w_t = min(ρ_t, C).
- ``token_mask`` (IcePop-style token mask): w_t = 1 if lo ≤ ρ_t ≤ hi, else 0.
- ``seq_mis`` (masked importance sampling, per sequence): ρ_seq = Π_t ρ_t over the
  sequence's tokens (summed in log space); w_t = ρ_seq for every token of a sequence with
  lo ≤ ρ_seq ≤ hi, 0 for every token of the others.

The policy loss multiplies its per-token terms by w (no gradient flows through w). A token
with w = 0 keeps its place in the loss's denominators: the weights are computed on the whole
step before it is split into mini- and micro-batches, so every split sums to the same loss.

One registry, one signature: ``(CorrectionInputs, RolloutCorrection) -> CorrectionOutputs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megatron_rl.algorithms.losses import LOG_RATIO_CLAMP

Tensor = torch.Tensor

__all__ = ["CORRECTIONS", "CorrectionInputs", "CorrectionOutputs", "RolloutCorrection", "correct_rollout"]

CORRECTIONS = ("token_tis", "token_mask", "seq_mis")


@dataclass(frozen=True)
class RolloutCorrection:
    """Recipe data: which correction, and its bounds (``algorithm.overrides.rollout_correction``)."""

    kind: str = "token_tis"
    """One of CORRECTIONS: token_tis | token_mask | seq_mis."""
    cap: float = 2.0
    """token_tis: C, the largest weight a token gets."""
    low: float = 0.5
    """token_mask, seq_mis: ratios below this are masked."""
    high: float = 2.0
    """token_mask, seq_mis: ratios above this are masked."""

    def __post_init__(self) -> None:
        if self.kind not in CORRECTIONS:
            raise ValueError(f"rollout_correction.kind={self.kind!r} is not allowed; choose one of {list(CORRECTIONS)}")
        if not self.cap > 0:
            raise ValueError(f"rollout_correction.cap={self.cap} must be > 0")
        if not 0 <= self.low <= 1 <= self.high:
            raise ValueError(f"rollout_correction.low={self.low}, high={self.high}: need 0 <= low <= 1 <= high")


@dataclass(frozen=True)
class CorrectionInputs:
    """The step's tokens, [N, S] each (the training layout)."""

    old_logprobs: Tensor
    """log π_old, recomputed by the trainer."""
    rollout_logprobs: Tensor
    """log μ, returned by the rollout engine for the tokens it sampled."""
    mask: Tensor
    """bool: the response tokens the policy loss sees."""


@dataclass(frozen=True)
class CorrectionOutputs:
    weights: Tensor
    """[N, S] float32 ≥ 0: multiplies the per-token policy loss; 0 off the mask."""
    tokens_affected: int
    """Response tokens whose weight the bounds changed (capped, or masked)."""
    sequences_masked: int
    """Sequences whose every token got weight 0 (seq_mis)."""


def _log_ratio(inputs: CorrectionInputs) -> Tensor:
    delta = inputs.old_logprobs.double() - inputs.rollout_logprobs.double()
    return torch.where(inputs.mask, delta, 0.0)


def _token_tis(inputs: CorrectionInputs, cfg: RolloutCorrection) -> CorrectionOutputs:
    ratio = torch.exp(_log_ratio(inputs).clamp(max=LOG_RATIO_CLAMP))
    capped = inputs.mask & (ratio > cfg.cap)
    weights = torch.where(inputs.mask, ratio.clamp(max=cfg.cap), 0.0)
    return CorrectionOutputs(weights.float(), int(capped.sum()), 0)


def _token_mask(inputs: CorrectionInputs, cfg: RolloutCorrection) -> CorrectionOutputs:
    ratio = torch.exp(_log_ratio(inputs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    outside = inputs.mask & ((ratio < cfg.low) | (ratio > cfg.high))
    weights = (inputs.mask & ~outside).float()
    return CorrectionOutputs(weights, int(outside.sum()), 0)


def _seq_mis(inputs: CorrectionInputs, cfg: RolloutCorrection) -> CorrectionOutputs:
    seq_log_ratio = _log_ratio(inputs).sum(dim=-1)
    seq_ratio = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    has_tokens = inputs.mask.any(dim=-1)
    outside = has_tokens & (
        (seq_log_ratio < torch.log(torch.tensor(cfg.low, dtype=torch.float64)))
        | (seq_log_ratio > torch.log(torch.tensor(cfg.high, dtype=torch.float64)))
    )
    weights = torch.where(inputs.mask & ~outside[:, None], seq_ratio[:, None], 0.0)
    return CorrectionOutputs(weights.float(), int((inputs.mask & outside[:, None]).sum()), int(outside.sum()))


_REGISTRY: dict[str, Callable[[CorrectionInputs, RolloutCorrection], CorrectionOutputs]] = {
    "token_tis": _token_tis,
    "token_mask": _token_mask,
    "seq_mis": _seq_mis,
}


def correct_rollout(inputs: CorrectionInputs, cfg: RolloutCorrection) -> CorrectionOutputs:
    """The per-token weights of ``cfg.kind`` (see the module docstring for the formulas)."""
    if inputs.old_logprobs.shape != inputs.rollout_logprobs.shape or inputs.mask.shape != inputs.old_logprobs.shape:
        raise ValueError(
            f"old_logprobs {tuple(inputs.old_logprobs.shape)}, rollout_logprobs "
            f"{tuple(inputs.rollout_logprobs.shape)} and mask {tuple(inputs.mask.shape)} must match"
        )
    return _REGISTRY[cfg.kind](inputs, cfg)
