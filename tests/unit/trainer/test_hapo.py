"""trainer.hapo's formula pieces against hand-computed values. The Megatron path
(hapo_token_fields on a real actor, checked against transformers and vLLM) runs in
tests/distributed/test_adaptive_temperature.py::megatron_temperatures."""

import math

import pytest
import torch

from megatron_rl.algorithms.hapo import EntropyStats
from megatron_rl.trainer.hapo import sampled_temperature, token_fields


def test_sampled_temperature_by_hand():
    # log H = [1, −2, 0, 5, 1]; pivot 0, scale 1 -> h = log H; ĥ = h/2 (h > 0), h/4 (h ≤ 0), clamped.
    entropy = torch.tensor([[math.e, math.exp(-2), 1.0, math.exp(5), math.e]])
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    stats = EntropyStats(0.0, 1.0, 2.0, 4.0)
    got = sampled_temperature(entropy, mask, temperature=0.8, tau=0.1, stats=stats)
    want = torch.tensor([[0.8 * 1.05, 0.8 * 0.95, 0.8, 0.8 * 1.1, 0.8]])  # last: off the response
    torch.testing.assert_close(got, want)


def test_first_step_and_tau_zero_give_plain_temperature():
    entropy, mask = torch.rand(2, 5) + 0.1, torch.ones(2, 5, dtype=torch.bool)
    stats = EntropyStats(0.0, 1.0, 1.0, 1.0)
    assert torch.equal(sampled_temperature(entropy, mask, 0.7, 0.05, None), torch.full((2, 5), 0.7))
    assert torch.equal(sampled_temperature(entropy, mask, 0.7, 0.0, stats), torch.full((2, 5), 0.7))


def test_token_fields_by_hand():
    # log H = [0, 1, 2, 3, 4] on the response (+ one prompt position): quantile 0.5 -> pivot 2,
    # scale sqrt(mean([4, 1, 0, 1, 4])) = sqrt(2), h = [−2, −1, 0, 1, 2]/sqrt(2),
    # pos_max = neg_max = sqrt(2) -> ĥ = [−1, −0.5, 0, 0.5, 1].
    entropy = torch.tensor([[7.0, *[math.exp(v) for v in range(5)]]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    prev = EntropyStats(2.0, 1.0, 1.0, 1.0)
    fields = token_fields(entropy, mask, temperature=1.0, tau=0.05, prev_stats=prev, pivot_quantile=0.5)
    torch.testing.assert_close(fields.h_hat, torch.tensor([[0.0, -1.0, -0.5, 0.0, 0.5, 1.0]]))
    root2 = math.sqrt(2)
    got = (fields.stats.pivot, fields.stats.scale, fields.stats.pos_max, fields.stats.neg_max)
    assert got == pytest.approx((2.0, root2, root2, root2), abs=1e-6)
    assert all(type(v) is float for v in got)  # ready for the next rollout's Sampling
    # Temperatures use the PREVIOUS stats: h = log H − 2, clamped to [−1, 1].
    torch.testing.assert_close(fields.temperature, torch.tensor([[1.0, 0.95, 0.95, 1.0, 1.05, 1.05]]))


def test_bad_input_raises():
    entropy, mask = torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="tau must be in"):
        sampled_temperature(entropy, mask, 1.0, 1.0, None)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sampled_temperature(entropy, mask, 0.0, 0.05, None)
