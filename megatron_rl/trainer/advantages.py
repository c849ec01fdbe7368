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
