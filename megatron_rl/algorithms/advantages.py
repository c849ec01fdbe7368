"""Advantage and return estimators (docs/algorithms.md, "Advantages and returns").

Token-level tensors are [B, T] over response tokens, with `response_mask` [B, T]
(1 = real response token); sequence-level tensors are [B]; `group_index` [B] says which
prompt a sample came from (any integer labels). All functions are pure: no process
groups, no in-place changes to their inputs.
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms._common import (
    Tensor,
    as_float,
    group_count,
    group_ids,
    group_reduce,
    group_sum,
    last_token_index,
)

__all__ = [
    "compute_gae",
    "masked_whiten",
    "decoupled_gae",
    "length_adaptive_lambda",
    "compute_egae",
    "grpo_advantages",
    "token_level_group_average_advantages",
    "last_token_values",
]


def compute_gae(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    lam: float | Tensor = 0.95,
    bootstrap: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation, one backward pass over time.

    token_rewards, values, response_mask: [B, T]. lam: float or [B] (one λ per sequence).
    bootstrap: [B] value after the last real token (None: 0, i.e. the response ended).
    Returns (advantages [B, T], returns [B, T]); both are 0 at masked positions.

    δ_t = r_t + γ·V_next − V_t, A_t = δ_t + γ·λ·A_next, returns = A + V. A masked
    position gets A = 0 and passes V_next / A_next through unchanged, so gaps inside a
    row (filtered tokens) do not break the recursion; rewards placed at masked
    positions are ignored. No whitening here (see `masked_whiten`).
    """
    rewards, values = as_float(token_rewards), as_float(values)
    dtype, device = rewards.dtype, rewards.device
    batch, length = rewards.shape
    mask = response_mask.bool()
    gamma_lam = gamma * torch.as_tensor(lam, dtype=dtype, device=device)  # scalar or [B]
    next_value = torch.zeros(batch, dtype=dtype, device=device) if bootstrap is None else as_float(bootstrap).to(dtype)
    next_adv = torch.zeros(batch, dtype=dtype, device=device)
    advantages = torch.zeros_like(rewards)
    # The recursion is sequential in t; everything inside one step is vectorised over B.
    for t in reversed(range(length)):
        real = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma_lam * next_adv
        advantages[:, t] = torch.where(real, adv, 0.0)
        next_value = torch.where(real, values[:, t], next_value)
        next_adv = torch.where(real, adv, next_adv)
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x − mean)/sqrt(var + eps) over the masked entries (any shape, usually [B, T]).

    Variance is Bessel-corrected (divides by n − 1; by 1 when n ≤ 1, so a single entry
    whitens to 0). Masked-out entries return 0. Statistics are local to `x`: whitening
    a data-parallel shard gives shard statistics.
    """
    x = as_float(x)
    m = mask.bool()
    n = m.sum()
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    mean = torch.where(m, x, zero).sum() / n.clamp_min(1)
    centered = torch.where(m, x - mean, zero)
    var = centered.square().sum() / (n - 1).clamp_min(1)
    return centered * torch.rsqrt(var + eps)


def decoupled_gae(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float,
    lam_policy: float | Tensor,
    lam_critic: float,
) -> tuple[Tensor, Tensor]:
    """VAPO's decoupled GAE: advantages with `lam_policy`, critic targets with `lam_critic`.

    Shapes as `compute_gae`; lam_policy may be a [B] tensor (length-adaptive λ). With
    lam_critic = 1 and γ = 1 the returns are Monte-Carlo returns, which keeps the value
    target unbiased for long responses while the policy gets a lower-variance advantage.
    Returns (advantages [B, T], returns [B, T]).
    """
    advantages, _ = compute_gae(token_rewards, values, response_mask, gamma, lam_policy)
    _, returns = compute_gae(token_rewards, values, response_mask, gamma, lam_critic)
    return advantages, returns


def length_adaptive_lambda(lengths: Tensor, alpha: float = 0.05) -> Tensor:
    """VAPO's λ_policy = 1 − 1/(α·l) per sequence, clamped to [0, 1).

    lengths: [B] response lengths. Returns [B] float. Keeps the sum of GAE weights
    proportional to the length (l = 100 → 0.8, l = 1000 → 0.98; l ≤ 1/α → 0).
    """
    scaled = alpha * as_float(lengths)
    # clamp_min avoids 1/0 for empty responses; they land on λ = 0 like every l ≤ 1/α.
    lam = 1.0 - 1.0 / scaled.clamp_min(torch.finfo(scaled.dtype).tiny)
    return lam.clamp(min=0.0)  # finite l keeps λ < 1, so only the lower clamp can act


def last_token_values(values: Tensor, response_mask: Tensor) -> Tensor:
    """Value at each row's last real token: [B, T] -> [B] (0 for rows with no token)."""
    last = last_token_index(response_mask)  # [B]
    picked = as_float(values).gather(-1, last.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return torch.where(last >= 0, picked, 0.0)


def compute_egae(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    truncated: Tensor,
    gamma: float = 1.0,
    lam: float | Tensor = 0.95,
) -> tuple[Tensor, Tensor]:
    """T-PPO's extended GAE for responses cut off by the generation window.

    truncated: [B] bool. A truncated row has no terminal reward yet, so the value after
    its last generated token is bootstrapped with the value of that token
    (V(s_l) ≈ V(s_{l−1})); finished rows bootstrap 0. Shapes/outputs as `compute_gae`.
    """
    last_value = last_token_values(values, response_mask)
    bootstrap = torch.where(truncated.bool(), last_value, 0.0)
    return compute_gae(token_rewards, values, response_mask, gamma, lam, bootstrap)


def grpo_advantages(
    seq_rewards: Tensor,
    group_index: Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO group-relative advantage A_i = (R_i − mean_g)/(std_g + eps), [B] -> [B].

    std is unbiased (n − 1). A group of one gets mean 0 and std 1 (so A = R/(1 + eps)),
    following verl: a lone sample has no baseline. norm_by_std=False gives R_i − mean_g
    (Dr. GRPO, which drops the std to avoid favouring easy/hard prompts). All-equal
    rewards give A = 0. The caller broadcasts over tokens.
    """
    rewards = as_float(seq_rewards)
    ids, num_groups = group_ids(group_index)
    count = group_count(ids, num_groups, rewards.dtype)
    mean = group_sum(rewards, ids, num_groups) / count.clamp_min(1)
    centered_sq = (rewards - mean[ids]).square()
    std = (group_sum(centered_sq, ids, num_groups) / (count - 1).clamp_min(1)).sqrt()
    single = count == 1
    mean = torch.where(single, 0.0, mean)
    std = torch.where(single, 1.0, std)
    advantages = rewards - mean[ids]
    if norm_by_std:
        advantages = advantages / (std[ids] + eps)
    return advantages


def token_level_group_average_advantages(
    seq_rewards: Tensor,
    group_index: Tensor,
    lengths: Tensor,
    eps: float = 1e-6,
    fallback: float = 5.0,
) -> Tensor:
    """HAPO token-level group average advantage, [B] -> [B].

    Every token carries its sequence's reward, so the group statistics are
    length-weighted: μ_g = Σ l_i R_i / Σ l_i, σ_g = sqrt(Σ l_i (R_i − μ_g)² / Σ l_i),
    A_i = (R_i − μ_g)/(σ_g + eps). Length weighting can put a short outlier many σ
    away; a group in which any |A_i| ≥ `fallback` uses `grpo_advantages` instead (so
    does a group whose lengths are all 0 and rewards non-zero).
    """
    rewards = as_float(seq_rewards)
    weights = as_float(lengths).to(rewards.dtype)
    ids, num_groups = group_ids(group_index)
    total = group_sum(weights, ids, num_groups).clamp_min(torch.finfo(rewards.dtype).tiny)
    mu = group_sum(weights * rewards, ids, num_groups) / total
    var = group_sum(weights * (rewards - mu[ids]).square(), ids, num_groups) / total
    advantages = (rewards - mu[ids]) / (var.sqrt()[ids] + eps)
    worst = group_reduce(advantages.abs(), ids, num_groups, "amax")
    use_grpo = (worst >= fallback)[ids]
    return torch.where(use_grpo, grpo_advantages(rewards, group_index, True, eps), advantages)
