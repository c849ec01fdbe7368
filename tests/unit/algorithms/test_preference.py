"""The Bradley-Terry loss and pair accuracy against values computed by hand."""

import math

import pytest
import torch

from megatron_rl.algorithms import bradley_terry_loss, pair_correct
from megatron_rl.schedules.preference import PreferenceLoss


def test_bradley_terry_loss_is_minus_log_sigmoid_of_the_margin():
    chosen, rejected = torch.tensor([2.0, 0.0, 40.0]), torch.tensor([1.0, 0.5, -40.0])
    # -log sigmoid(1) = log(1 + e^-1), -log sigmoid(-0.5) = log(1 + e^0.5), and ~0 (finite) at +80
    expected = [math.log(1 + math.exp(-1)), math.log(1 + math.exp(0.5)), 0.0]
    assert bradley_terry_loss(chosen, rejected).tolist() == pytest.approx(expected, abs=1e-7)
    assert pair_correct(chosen, rejected).tolist() == [1.0, 0.0, 1.0]
    assert pair_correct(torch.ones(2), torch.ones(2)).tolist() == [0.0, 0.0]  # a tie is not a win


def test_the_micro_batch_loss_is_its_share_of_the_mean_over_all_pairs():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.5])
    whole = PreferenceLoss().objective(chosen, rejected, None)
    assert float(whole.loss) == pytest.approx((0.31326169 + 0.97407698) / 2, abs=1e-7)
    assert float(whole.sums["pair_accuracy"]) == 0.5
    assert float(whole.sums["reward_margin"]) == pytest.approx(0.25)
    # two micro-batches of one pair each, normalised by the mini-batch's two pairs, add up to it
    norms = {"pairs": torch.tensor(2)}
    parts = [PreferenceLoss().objective(chosen[i : i + 1], rejected[i : i + 1], norms) for i in range(2)]
    assert float(sum(p.loss for p in parts)) == pytest.approx(float(whole.loss), abs=1e-7)
