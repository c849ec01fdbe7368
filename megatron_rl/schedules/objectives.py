"""The recipe's actor and critic losses on one microbatch, as shares of the mini-batch loss.

A loss object names the denominators it needs (`local_norms`: additive counts such as
the response-token count). The runner sums them over the data-parallel group before the
mini-batch starts and passes the totals back in, so each microbatch's loss is its exact
share of the mini-batch loss and the shares add up to it under any split. All the math
is `megatron_rl.algorithms`; this module only composes it as the recipe says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.algorithms import (
    AlgorithmRecipe,
    aggregate,
    asymmetric_clip_bounds,
    get_loss_aggregation,
    kl_penalty,
    policy_loss,
    positive_example_nll,
    redistribute_advantages,
    value_loss,
)
from megatron_rl.algorithms.losses import LOG_RATIO_CLAMP
from megatron_rl.schedules.batch import TrainBatch
from megatron_rl.schedules.vocab_parallel import vocab_parallel_logprobs

Tensor = torch.Tensor
Norms = Optional[dict[str, Tensor]]

__all__ = ["LossOutput", "ActorLoss", "CriticLoss"]


@dataclass(frozen=True)
class LossOutput:
    """One microbatch's result: the loss function returns one small dataclass (docs/design.md, rules)."""

    loss: Tensor
    """This microbatch's share of the mini-batch loss (differentiable)."""
    sums: dict[str, Tensor] = field(default_factory=dict)
    """Detached shares of mini-batch metrics: summed over microbatches and DP ranks."""
    maxes: dict[str, Tensor] = field(default_factory=dict)
    """Detached metrics reduced with max over microbatches and DP ranks."""


def _masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, 0.0).sum()


def _clamped(norms: dict[str, Tensor]) -> dict[str, Tensor]:
    """An empty part (no response token) has loss 0, not nan."""
    return {name: count.clamp_min(1) for name, count in norms.items()}


def _share(local_mean: Tensor, local_count: Tensor, total: Tensor) -> Tensor:
    """A local masked mean turned into its share of the mini-batch mean."""
    return local_mean * local_count / total


class ActorLoss:
    """The recipe's actor loss: clipped policy loss (Clip-Higher, dual clip, HAPO bounds and
    redistribution) + KL penalty + VAPO positive-example NLL, on vocab-parallel logits."""

    prefix = "actor"

    def __init__(self, recipe: AlgorithmRecipe, vocab_size: int):
        self.recipe = recipe
        self.vocab_size = vocab_size
        self._agg = get_loss_aggregation(recipe.loss_agg)

    def required_fields(self) -> tuple[str, ...]:
        r = self.recipe
        fields = ["old_logprobs", "advantages"]
        fields += ["ref_logprobs"] if r.kl is not None else []
        fields += ["is_positive"] if r.positive_nll_coef > 0 else []
        fields += ["is_weights"] if r.rollout_correction is not None else []
        fields += ["h_hat"] if (r.entropy_clip_alpha > 0 or r.redistribution_beta > 0) else []
        return tuple(fields)

    def metric_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(names summed over microbatches and DP, names reduced with max)."""
        sums = ["loss", "pg_loss", "clipfrac", "dual_clipfrac", "approx_kl", "ratio_mean", "entropy"]
        sums += ["kl_loss"] if self.recipe.kl is not None else []
        sums += ["nll_loss"] if self.recipe.positive_nll_coef > 0 else []
        return tuple(sums), ("ratio_max",)

    def local_norms(self, batch: TrainBatch) -> dict[str, Tensor]:
        """Additive denominators of this batch (int64 counts), to be summed over DP."""
        mask = batch.loss_mask.bool()
        norms = {"tokens": mask.sum()}
        if self._agg.norm_is_additive:  # else the norm is a constant every part shares
            norms["policy"] = self._agg.local_norm(mask)
        if self.recipe.positive_nll_coef > 0:
            norms["positive_tokens"] = (mask & batch.is_positive.bool().unsqueeze(-1)).sum()
        return norms

    def __call__(self, logits: Tensor, mb, norms: Norms, tp_group: Optional[dist.ProcessGroup] = None) -> LossOutput:
        """logits: [b, s, V/tp] this TP rank's vocabulary shard; `mb` a TrainBatch or a
        packed micro-batch (schedules.packing), whose logprobs are read back as its rows."""
        logp, entropy = vocab_parallel_logprobs(logits, mb.labels, self.vocab_size, tp_group, mb.temperature)
        return self.objective(mb.as_rows(logp), mb.as_rows(entropy), mb.row_batch, norms)

    def objective(self, logp: Tensor, entropy: Tensor, mb: TrainBatch, norms: Norms) -> LossOutput:
        """The loss from per-token logprobs [b, s] (and entropy, for the metric only).
        norms None = this batch alone is the mini-batch (single-process use)."""
        r = self.recipe
        norms = norms if norms is not None else _clamped(self.local_norms(mb))
        mask = mb.loss_mask.bool()
        policy_norm = norms.get("policy")
        advantages = mb.advantages.to(logp.dtype)
        clip_low, clip_high = r.clip_low, r.clip_high
        if r.entropy_clip_alpha > 0:
            clip_low, clip_high = asymmetric_clip_bounds(mb.h_hat, r.clip_low, r.clip_high, r.entropy_clip_alpha)
        if r.redistribution_beta > 0:
            log_ratio = (logp.detach() - mb.old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            advantages = redistribute_advantages(
                advantages, log_ratio.exp(), mb.h_hat, clip_low, clip_high, r.redistribution_beta
            )
        pg_loss, stats = policy_loss(
            logp,
            mb.old_logprobs,
            advantages,
            mask,
            clip_low,
            clip_high,
            r.clip_c,
            r.loss_agg,
            policy_norm,
            token_weights=mb.is_weights if r.rollout_correction else None,
        )
        total = pg_loss
        tokens, local_tokens = norms["tokens"], mask.sum()
        sums = {"pg_loss": pg_loss.detach()}
        if r.kl is not None:
            kl = aggregate(kl_penalty(logp, mb.ref_logprobs, r.kl.kind), mask, r.loss_agg, policy_norm)
            total = total + r.kl.coef * kl
            sums["kl_loss"] = kl.detach()
        if r.positive_nll_coef > 0:
            nll = positive_example_nll(logp, mask, mb.is_positive, norms["positive_tokens"])
            total = total + r.positive_nll_coef * nll
            sums["nll_loss"] = nll.detach()
        sums["loss"] = total.detach()
        for name in ("clipfrac", "dual_clipfrac", "approx_kl", "ratio_mean"):
            sums[name] = _share(stats[name], local_tokens, tokens)
        sums["entropy"] = _masked_sum(entropy.detach(), mask) / tokens
        return LossOutput(total, sums, {"ratio_max": stats["ratio_max"]})


class CriticLoss:
    """0.5·(V − R)², optionally PPO-value-clipped, on the critic's [b, s, 1] output."""

    prefix = "critic"

    def __init__(self, value_clip: Optional[float] = None, agg: str = "token-mean"):
        self.value_clip = value_clip
        self.agg = agg
        self._agg = get_loss_aggregation(agg)

    @classmethod
    def from_recipe(cls, recipe: AlgorithmRecipe, agg: str = "token-mean") -> "CriticLoss":
        return cls(recipe.value_clip, agg)

    def required_fields(self) -> tuple[str, ...]:
        return ("returns", "old_values") if self.value_clip is not None else ("returns",)

    def metric_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return ("value_loss", "value_clipfrac", "values_mean"), ()

    def local_norms(self, batch: TrainBatch) -> dict[str, Tensor]:
        mask = batch.loss_mask.bool()
        norms = {"tokens": mask.sum()}
        if self._agg.norm_is_additive:
            norms["value"] = self._agg.local_norm(mask)
        return norms

    def __call__(self, output: Tensor, mb, norms: Norms, tp_group: Optional[dist.ProcessGroup] = None) -> LossOutput:
        """output: [b, s, 1] values (replicated over TP); `mb` as for ActorLoss."""
        return self.objective(mb.as_rows(output.squeeze(-1).float()), mb.row_batch, norms)

    def objective(self, values: Tensor, mb: TrainBatch, norms: Norms) -> LossOutput:
        norms = norms if norms is not None else _clamped(self.local_norms(mb))
        mask = mb.loss_mask.bool()
        old_values = mb.old_values if mb.old_values is not None else values.detach()
        loss = value_loss(values, old_values, mb.returns, mask, self.value_clip, self.agg, norms.get("value"))
        with torch.no_grad():
            clipped = torch.zeros_like(mask)
            if self.value_clip is not None:
                moved = old_values + (values - old_values).clamp(-self.value_clip, self.value_clip)
                clipped = (moved - mb.returns).square() > (values - mb.returns).square()
            sums = {
                "value_loss": loss.detach(),
                "value_clipfrac": _masked_sum(clipped.float(), mask) / norms["tokens"],
                "values_mean": _masked_sum(values, mask) / norms["tokens"],
            }
        return LossOutput(loss, sums)
