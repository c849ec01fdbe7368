"""Bradley-Terry preference loss for reward models (pure tensor functions).

A reward model r scores a conversation; under the Bradley-Terry model the probability
that the chosen answer is preferred over the rejected one is sigmoid(r_c - r_r), so the
loss of a pair is its negative log-likelihood, -log sigmoid(r_c - r_r) (Ouyang et al.
2022, eq. 1, with K = 2). ``logsigmoid`` keeps it finite for large margins.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_rl.algorithms._common import Tensor

__all__ = ["bradley_terry_loss", "pair_correct"]


def bradley_terry_loss(chosen: Tensor, rejected: Tensor) -> Tensor:
    """[P] rewards of the chosen and the rejected answers -> [P] losses -log sigmoid(r_c - r_r)."""
    if chosen.shape != rejected.shape:
        raise ValueError(f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} rewards differ in shape")
    return -F.logsigmoid(chosen.float() - rejected.float())


def pair_correct(chosen: Tensor, rejected: Tensor) -> Tensor:
    """[P] float: 1 where the chosen answer scores strictly higher (a tie counts as wrong:
    a model that scores everything alike has accuracy 0, not 0.5)."""
    return (chosen > rejected).to(torch.float32)
