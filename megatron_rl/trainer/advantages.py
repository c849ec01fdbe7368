"""The step's advantages (and critic targets) from its rows, by the recipe's estimator."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from megatron_rl.algorithms import compute_advantages, masked_whiten
from megatron_rl.algorithms.recipes import AlgorithmRecipe
from megatron_rl.trainer.assembly import response_span
from megatron_rl.trainer.rollouts import TrainRows


def estimate_advantages(
    recipe: AlgorithmRecipe, rows: TrainRows, max_len: int, values: Optional[Sequence[torch.Tensor]] = None
):
    """Per-response-token (advantages, returns or None), [rows, max_len].

    Estimated over whole responses (a T-PPO window's advantages need the values after it);
    whitening uses only the tokens of the policy loss (all of them without windows)."""
    lengths = [len(s.token_ids) for s in rows.samples]
    mask = response_span(lengths, [0] * len(lengths), max_len)
    extra = {}
    if values is not None:
        padded = torch.zeros(len(lengths), max_len)
        for row, v in enumerate(values):
            padded[row, : v.numel()] = v
        extra["values"] = padded
    if any(rows.truncated):
        extra["truncated"] = torch.tensor(rows.truncated)
    inputs = recipe.advantage_inputs(
        mask,
        seq_rewards=torch.tensor(rows.rewards, dtype=torch.float32),
        group_index=torch.tensor(rows.group_index),
        lengths=torch.tensor(lengths),
        **extra,
    )
    out = compute_advantages(recipe.advantage_estimator, dataclasses.replace(inputs, whiten=False))
    advantages = out.advantages
    if recipe.whiten_advantages:
        advantages = masked_whiten(advantages, response_span(lengths, rows.loss_start, max_len))
    return advantages, out.returns


def window_metrics(rows: TrainRows, advantages: torch.Tensor, values: Sequence[torch.Tensor]) -> dict:
    """T-PPO's balance of stopping against continuing, for metrics.jsonl.

    advantages: [rows, ≥ longest response] from :func:`estimate_advantages`; values: each
    row's critic values. A finished row's window carries its outcome against the critic
    (R − V at its last token); an in-flight row's window carries only differences of values
    (EGAE bootstraps V(s_l) ≈ V(s_{l−1})), so an offset in the critic moves the first and
    not the second. ``critic/terminal_error`` (mean V(s_last) − R over finished rows) is
    that offset: above 0 every stop costs about that much against continuing."""
    lengths = [len(s.token_ids) for s in rows.samples]
    in_loss = response_span(lengths, rows.loss_start, advantages.shape[1])
    in_flight = torch.tensor(rows.truncated)[:, None]
    metrics = {}
    for name, mask in (("inflight", in_loss & in_flight), ("finished", in_loss & ~in_flight)):
        if mask.any():
            metrics[f"advantage/{name}_mean"] = float(advantages[mask].mean())
    finished = [row for row, cut in enumerate(rows.truncated) if not cut and lengths[row] > 0]
    if finished:
        errors = [float(values[row][lengths[row] - 1]) - rows.rewards[row] for row in finished]
        metrics["critic/terminal_error"] = sum(errors) / len(errors)
    return metrics
