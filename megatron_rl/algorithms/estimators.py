"""Advantage-estimator registry: every estimator takes one `AdvantageInputs` and returns
one `AdvantageOutputs`, so the trainer never branches on the estimator's name.

    inputs = AdvantageInputs(response_mask=mask, seq_rewards=r, group_index=g)
    out = compute_advantages("grpo", inputs)   # out.advantages [B, T], out.returns None
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megatron_rl.algorithms._common import Tensor, as_float, last_token_index
from megatron_rl.algorithms.advantages import (
    compute_egae,
    compute_gae,
    decoupled_gae,
    grpo_advantages,
    length_adaptive_lambda,
    masked_whiten,
    token_level_group_average_advantages,
)

__all__ = [
    "AdvantageInputs",
    "AdvantageOutputs",
    "ADVANTAGE_ESTIMATORS",
    "get_advantage_estimator",
    "compute_advantages",
    "seq_to_token_rewards",
]


def seq_to_token_rewards(seq_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Place each sequence reward [B] on its last real token -> [B, T] (0 elsewhere).

    The outcome reward is earned by the whole response, so GAE sees it at the final step.
    """
    last = last_token_index(response_mask)  # [B], −1 for rows without tokens
    positions = torch.arange(response_mask.shape[-1], device=response_mask.device)
    hit = positions == last.unsqueeze(-1)  # a row without tokens never hits
    rewards = as_float(seq_rewards)
    return torch.where(hit, rewards.unsqueeze(-1), 0.0)


@dataclass(frozen=True)
class AdvantageInputs:
    """Everything any estimator may read. Estimators raise if a tensor they need is None."""

    response_mask: Tensor
    """[B, T], 1 = real response token."""
    token_rewards: Tensor | None = None
    """[B, T] per-token rewards; derived from `seq_rewards` (last token) when None."""
    seq_rewards: Tensor | None = None
    """[B] sequence rewards; derived as the token-reward sum when None."""
    values: Tensor | None = None
    """[B, T] critic values V(s_t) (GAE family only)."""
    group_index: Tensor | None = None
    """[B] int prompt id of each sample (group estimators only)."""
    lengths: Tensor | None = None
    """[B] response lengths; `response_mask.sum(-1)` when None."""
    truncated: Tensor | None = None
    """[B] bool, response cut off by the generation window (EGAE); all False when None."""
    gamma: float = 1.0
    """Discount γ."""
    lam: float | Tensor = 0.95
    """GAE λ (float or [B]); the policy λ of decoupled GAE unless length-adaptive."""
    lam_critic: float = 1.0
    """λ for critic targets (decoupled_gae and egae); 1.0 = Monte-Carlo returns at γ = 1."""
    length_adaptive_alpha: float | None = None
    """decoupled_gae: α of λ_policy = 1 − 1/(α·l); None uses `lam` instead."""
    norm_by_std: bool = True
    """grpo: divide by the group std (False = Dr. GRPO)."""
    eps: float = 1e-6
    """Group estimators: std epsilon."""
    fallback: float = 5.0
    """token_level_group_average: |A| threshold that switches a group to GRPO."""
    whiten: bool = False
    """Whiten advantages over the mask after estimation (`compute_advantages` only)."""

    def require(self, field: str, estimator: str) -> Tensor:
        value = getattr(self, field)
        if value is None:
            raise ValueError(f"advantage estimator {estimator!r} needs AdvantageInputs.{field}")
        return value

    def token_level_rewards(self) -> Tensor:
        if self.token_rewards is not None:
            return self.token_rewards
        if self.seq_rewards is None:
            raise ValueError("AdvantageInputs needs token_rewards or seq_rewards")
        return seq_to_token_rewards(self.seq_rewards, self.response_mask)

    def sequence_rewards(self) -> Tensor:
        if self.seq_rewards is not None:
            return self.seq_rewards
        if self.token_rewards is None:
            raise ValueError("AdvantageInputs needs seq_rewards or token_rewards")
        mask = self.response_mask.bool()
        return torch.where(mask, as_float(self.token_rewards), 0.0).sum(-1)

    def response_lengths(self) -> Tensor:
        if self.lengths is not None:
            return self.lengths
        return self.response_mask.sum(-1)


@dataclass(frozen=True)
class AdvantageOutputs:
    """What every estimator returns."""

    advantages: Tensor
    """[B, T], 0 at masked positions."""
    returns: Tensor | None
    """[B, T] critic targets, or None for critic-free estimators."""


def _gae(inputs: AdvantageInputs) -> AdvantageOutputs:
    values = inputs.require("values", "gae")
    adv, ret = compute_gae(inputs.token_level_rewards(), values, inputs.response_mask, inputs.gamma, inputs.lam)
    return AdvantageOutputs(adv, ret)


def _decoupled_gae(inputs: AdvantageInputs) -> AdvantageOutputs:
    values = inputs.require("values", "decoupled_gae")
    lam_policy = inputs.lam
    if inputs.length_adaptive_alpha is not None:
        lam_policy = length_adaptive_lambda(inputs.response_lengths(), inputs.length_adaptive_alpha)
    adv, ret = decoupled_gae(
        inputs.token_level_rewards(),
        values,
        inputs.response_mask,
        inputs.gamma,
        lam_policy,
        inputs.lam_critic,
    )
    return AdvantageOutputs(adv, ret)


def _egae(inputs: AdvantageInputs) -> AdvantageOutputs:
    values = inputs.require("values", "egae")
    mask = inputs.response_mask
    truncated = inputs.truncated
    if truncated is None:
        truncated = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    rewards = inputs.token_level_rewards()
    adv, _ = compute_egae(rewards, values, mask, truncated, inputs.gamma, inputs.lam)
    # T-PPO trains the critic on finished rows only (the trainer masks truncated ones).
    _, ret = compute_egae(rewards, values, mask, truncated, inputs.gamma, inputs.lam_critic)
    return AdvantageOutputs(adv, ret)


def _broadcast(seq_adv: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.bool(), seq_adv.unsqueeze(-1), 0.0)


def _grpo(inputs: AdvantageInputs) -> AdvantageOutputs:
    group_index = inputs.require("group_index", "grpo")
    adv = grpo_advantages(inputs.sequence_rewards(), group_index, inputs.norm_by_std, inputs.eps)
    return AdvantageOutputs(_broadcast(adv, inputs.response_mask), None)


def _token_level_group_average(inputs: AdvantageInputs) -> AdvantageOutputs:
    group_index = inputs.require("group_index", "token_level_group_average")
    adv = token_level_group_average_advantages(
        inputs.sequence_rewards(),
        group_index,
        inputs.response_lengths(),
        inputs.eps,
        inputs.fallback,
    )
    return AdvantageOutputs(_broadcast(adv, inputs.response_mask), None)


def _no_outcome(inputs: AdvantageInputs) -> AdvantageOutputs:
    """No advantage from the reward: on-policy distillation, whose signal is the teacher's
    per-token reverse KL alone (AlgorithmRecipe.distill_coef)."""
    return AdvantageOutputs(torch.zeros_like(inputs.response_mask, dtype=torch.float32), None)


AdvantageEstimator = Callable[[AdvantageInputs], AdvantageOutputs]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": _gae,
    "decoupled_gae": _decoupled_gae,
    "egae": _egae,
    "grpo": _grpo,
    "token_level_group_average": _token_level_group_average,
    "none": _no_outcome,
}
"""name -> estimator; all share the signature (AdvantageInputs) -> AdvantageOutputs."""

# Estimators that read `values` (and so need a critic); recipes validate against this.
CRITIC_ESTIMATORS = frozenset({"gae", "decoupled_gae", "egae"})


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """Look up an estimator; an unknown name raises ValueError listing the valid ones."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        valid = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {valid}") from None


def compute_advantages(name: str, inputs: AdvantageInputs) -> AdvantageOutputs:
    """Run estimator `name`, then whiten the advantages over the mask if `inputs.whiten`."""
    out = get_advantage_estimator(name)(inputs)
    if inputs.whiten:
        out = AdvantageOutputs(masked_whiten(out.advantages, inputs.response_mask), out.returns)
    return out
