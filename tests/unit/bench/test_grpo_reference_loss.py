"""The plain GRPO reference's formulas on hand-computed examples."""

import math

import pytest
import torch

from megatron_rl_lab.bench.grpo_reference_loss import aggregate, clipped_surrogate, group_advantages, k3


def test_group_advantages_by_hand():
    # Group 0: rewards 1, 0, 0: mean 1/3, std (n - 1) sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = 1/sqrt(3).
    # Group 5 is one sample (mean 0, std 1); group 2 has equal rewards (A = 0).
    rewards = [1.0, 0.0, 0.0, 0.5, 1.0, 1.0]
    groups = [0, 0, 0, 5, 2, 2]
    got = group_advantages(rewards, groups)
    want = [2 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), 0.5, 0.0, 0.0]
    assert got == pytest.approx(want, abs=1e-5)
    assert group_advantages(rewards[:3], groups[:3], eps=0.0) == pytest.approx(want[:3], abs=1e-12)
    assert group_advantages(rewards, groups, eps=1e-6)[3] == pytest.approx(0.5 / (1 + 1e-6), abs=1e-15)
    assert group_advantages(rewards, groups, by_std=False) == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.5, 0, 0])


def test_clipped_surrogate_takes_the_pessimistic_term():
    # ratio 1.5 or 0.5 against advantage +1 or -1, bounds 0.8 / 1.2.
    logp = torch.log(torch.tensor([[1.5, 0.5, 0.5, 1.5]]))
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, clipped = clipped_surrogate(logp, old, adv, clip_low=0.2, clip_high=0.2)
    assert loss.tolist()[0] == pytest.approx([-1.2, -0.5, 0.8, 1.5])
    assert clipped.tolist() == [[True, False, True, False]]
    # Clip-Higher: a wider upper bound lets the positive advantage rise to 1.28.
    loss, _ = clipped_surrogate(logp, old, adv, clip_low=0.2, clip_high=0.28)
    assert float(loss[0, 0]) == pytest.approx(-1.28)


def test_aggregations_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    assert float(aggregate(loss, mask, "token-mean")) == pytest.approx(7 / 3)
    # Rows (1 + 2) / 2 and 4 / 1; the row without a token is not a sequence of the batch.
    assert float(aggregate(loss, mask, "seq-mean-token-mean")) == pytest.approx((1.5 + 4) / 2)
    assert float(aggregate(loss, mask, "seq-mean-token-sum")) == pytest.approx((3 + 4) / 2)
    with pytest.raises(ValueError, match="no reference"):
        aggregate(loss, mask, "seq-mean-token-sum-norm")


def test_k3_by_hand():
    logp = torch.tensor([-1.0, -1.0])
    ref = torch.tensor([-1.0, -1.0 + math.log(2.0)])
    assert k3(logp, ref).tolist() == pytest.approx([0.0, 2 - math.log(2.0) - 1])
