"""HAPO's token-aware batch fields, computed by the trainer after each rollout.

vLLM sampled token t at T_t = T·(1 + τ·ĥ_t) (rollout/adaptive_temperature.py) but does not
return T_t. The processor took ĥ_t from the entropy H_T of softmax(logits / T) under the
PREVIOUS step's `EntropyStats`; Megatron's `compute_logprobs` at the base temperature T
returns that same H_T for every position, so one forward pass at T gives:

(a) `temperature` [N, S]: the T_t each response token was sampled at (same formula, the
    previous stats), for old logprobs / the PPO ratio at the sampling distribution;
(b) `h_hat` [N, S]: ĥ of THIS step's tokens under THIS step's statistics, for the
    entropy-asymmetric clip bounds and advantage redistribution (TrainBatch.h_hat);
(c) `stats`: this step's statistics (floats), which the next rollout samples with.

Up to float noise between vLLM's and Megatron's logits, (a) equals the temperatures used
by the sampler. Prompt and padding positions get T and ĥ = 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from megatron_rl.algorithms.hapo import EntropyStats, _h_hat, normalized_entropy

if TYPE_CHECKING:
    from megatron_rl.schedules import TrainBatch

__all__ = ["HapoTokenFields", "sampled_temperature", "token_fields", "hapo_token_fields"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class HapoTokenFields:
    temperature: Tensor
    """[N, S] float32: the temperature token t + 1 was sampled at (T off the response)."""
    h_hat: Tensor
    """[N, S] float32 in [−1, 1]: ĥ under this step's stats, 0 off the response."""
    stats: EntropyStats
    """This step's statistics as floats: pass them to the next rollout's Sampling."""


def sampled_temperature(
    entropy: Tensor, loss_mask: Tensor, temperature: float, tau: float, stats: Optional[EntropyStats]
) -> Tensor:
    """T·(1 + τ·ĥ(entropy; stats)) on response positions, T elsewhere; [N, S] -> [N, S].

    `entropy` is that of softmax(logits / T). stats None (first step) or τ = 0: plain T.
    """
    if not 0.0 <= tau < 1.0:
        raise ValueError(f"tau must be in [0, 1) so that T_t > 0, got {tau}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for adaptive sampling, got {temperature}")
    base = torch.full(entropy.shape, float(temperature), dtype=torch.float32, device=entropy.device)
    if stats is None or tau == 0:
        return base
    adaptive = base * (1.0 + tau * _h_hat(entropy, stats))
    return torch.where(loss_mask.bool().to(entropy.device), adaptive, base)


def token_fields(
    entropy: Tensor,
    loss_mask: Tensor,
    temperature: float,
    tau: float,
    prev_stats: Optional[EntropyStats],
    pivot_quantile: float = 0.8,
) -> HapoTokenFields:
    """(a), (b), (c) of the module docstring from the whole mini-batch's entropy at T [N, S]."""
    mask = loss_mask.to(entropy.device)
    h_hat, stats = normalized_entropy(entropy, mask, pivot_quantile, return_stats=True)
    return HapoTokenFields(
        temperature=sampled_temperature(entropy, mask, temperature, tau, prev_stats),
        h_hat=h_hat.float(),
        stats=stats.as_floats(),
    )


def hapo_token_fields(
    actor_chunks: list[torch.nn.Module],
    batch: TrainBatch,
    micro,
    vocab_size: int,
    *,
    temperature: float,
    tau: float,
    prev_stats: Optional[EntropyStats],
    pivot_quantile: float = 0.8,
) -> HapoTokenFields:
    """Forward the whole packed mini-batch `batch` (every rank holds it) at the base T on
    the actor; [N, S] results on every rank. `batch.temperature` is ignored (T is used);
    `batch.loss_mask` is the response mask. One extra forward-only pass per step."""
    from megatron_rl.schedules import gathered_logprobs

    at_base = dataclasses.replace(
        batch, temperature=torch.full(batch.tokens.shape, float(temperature), device=batch.tokens.device)
    )
    _, entropy = gathered_logprobs(actor_chunks, at_base, micro, vocab_size)
    return token_fields(entropy, batch.loss_mask, temperature, tau, prev_stats, pivot_quantile)
