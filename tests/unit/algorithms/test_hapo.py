"""HAPO pieces: normalised entropy, adaptive temperature, clip bounds, redistribution."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms import (
    EntropyStats,
    adaptive_temperature,
    asymmetric_clip_bounds,
    entropy_stats,
    normalized_entropy,
    redistribute_advantages,
)


def t(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


# log-entropies e = [0, 1, 2, 3, 4] on real tokens, plus a masked huge entropy
ENTROPY = torch.exp(t([[0.0, 1.0, 2.0, 3.0, 4.0, 50.0]]))
MASK = t([[1, 1, 1, 1, 1, 0]])
# pivot = 0.8-quantile of [0..4]: position 0.8·4 = 3.2 → 3 + 0.2·(4 − 3) = 3.2
# e − pivot = [−3.2, −2.2, −1.2, −0.2, 0.8]; scale = sqrt((10.24 + 4.84 + 1.44 + 0.04 + 0.64)/5)
#   = sqrt(3.44); ĥ divides positives by max = 0.8 and negatives by |min| = 3.2 (scale cancels)
EXPECTED_H_HAT = t([[-1.0, -2.2 / 3.2, -1.2 / 3.2, -0.2 / 3.2, 1.0, 0.0]])


def test_normalized_entropy_by_hand():
    torch.testing.assert_close(normalized_entropy(ENTROPY, MASK), EXPECTED_H_HAT)


def test_normalized_entropy_returns_stats():
    h_hat, stats = normalized_entropy(ENTROPY, MASK, return_stats=True)
    torch.testing.assert_close(h_hat, EXPECTED_H_HAT)
    scale = math.sqrt(3.44)
    assert float(stats.pivot) == pytest.approx(3.2)
    assert float(stats.scale) == pytest.approx(scale)
    assert float(stats.pos_max) == pytest.approx(0.8 / scale)
    assert float(stats.neg_max) == pytest.approx(3.2 / scale)
    floats = stats.as_floats()
    assert isinstance(floats.pivot, float) and floats.pivot == pytest.approx(3.2)


def test_normalized_entropy_with_given_stats_and_clamping():
    # stats: pivot 1, scale 2, pos_max 0.5, neg_max 1. e = [0, 2, 5]:
    # h = (e − 1)/2 = [−0.5, 0.5, 2] → ĥ = [−0.5/1, 0.5/0.5, 2/0.5 → clamped 1] = [−0.5, 1, 1]
    stats = EntropyStats(pivot=1.0, scale=2.0, pos_max=0.5, neg_max=1.0)
    entropy = torch.exp(t([[0.0, 2.0, 5.0]]))
    h_hat = normalized_entropy(entropy, t([[1, 1, 1]]), stats=stats)
    torch.testing.assert_close(h_hat, t([[-0.5, 1.0, 1.0]]))


def test_normalized_entropy_range_and_sign_convention():
    gen = torch.Generator().manual_seed(0)
    entropy = torch.rand(8, 16, generator=gen, dtype=torch.float64) * 3
    entropy[0, 0] = 0.0  # log(max(0, 1e-8)) is finite
    mask = (torch.rand(8, 16, generator=gen) > 0.2).to(torch.float64)
    h_hat, stats = normalized_entropy(entropy, mask, pivot_quantile=0.8, return_stats=True)
    real = mask.bool()
    assert bool((h_hat.abs() <= 1).all())
    assert h_hat[real].max().item() == pytest.approx(1.0)
    assert h_hat[real].min().item() == pytest.approx(-1.0)
    assert bool((h_hat[~real] == 0).all())
    log_e = torch.log(entropy.clamp_min(1e-8))
    # sign: above the pivot → positive; at or below → non-positive
    above = real & (log_e > stats.pivot)
    assert bool((h_hat[above] > 0).all()) and bool((h_hat[real & ~above] <= 0).all())
    # about 20% of real tokens lie above the 0.8 quantile
    assert above.sum().item() == pytest.approx(0.2 * real.sum().item(), abs=2)
    # monotone in the entropy
    order = log_e[real].argsort()
    assert bool((h_hat[real][order].diff() >= 0).all())


def test_quantile_matches_torch_quantile():
    gen = torch.Generator().manual_seed(3)
    entropy = torch.rand(1, 37, generator=gen, dtype=torch.float64) + 0.1
    mask = torch.ones(1, 37)
    for q in (0.0, 0.3, 0.8, 1.0):
        stats = entropy_stats(entropy, mask, q)
        expected = torch.quantile(torch.log(entropy.flatten()), q)
        assert float(stats.pivot) == pytest.approx(expected.item())


def test_normalized_entropy_degenerate_inputs():
    # all-equal entropies: no spread → ĥ = 0 everywhere; empty mask → zeros
    same = torch.full((2, 3), 0.7)
    assert torch.equal(normalized_entropy(same, torch.ones(2, 3)), torch.zeros(2, 3))
    assert torch.equal(normalized_entropy(same, torch.zeros(2, 3)), torch.zeros(2, 3))


# ----------------------------------------------------------------------------- temperature


def test_adaptive_temperature_first_step_is_plain():
    logits = torch.randn(3, 5, 11)
    temps = adaptive_temperature(logits, 0.7, stats=None)
    assert temps.shape == (3, 5)
    assert torch.equal(temps, torch.full((3, 5), 0.7))


def test_adaptive_temperature_by_hand():
    # uniform over 4: H = log 4, e = log(log 4) = 0.3266343; stats pivot 0, scale 1,
    # pos_max 0.5 → ĥ = 0.6532686 → T = 0.7·(1 + 0.05·0.6532686) = 0.7228644
    # near one-hot: H ≈ 0 → e = log(1e-8) = −18.42 → ĥ = −18.42 → clamped −1 → T = 0.7·0.95
    stats = EntropyStats(pivot=0.0, scale=1.0, pos_max=0.5, neg_max=1.0)
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    temps = adaptive_temperature(logits, 0.7, stats, tau=0.05)
    e = math.log(math.log(4))
    torch.testing.assert_close(temps, torch.tensor([0.7 * (1 + 0.05 * e / 0.5), 0.665]))


def test_adaptive_temperature_rejects_tau_of_one():
    with pytest.raises(ValueError, match="tau"):
        adaptive_temperature(torch.zeros(1, 2), 1.0, EntropyStats(0.0, 1.0, 1.0, 1.0), tau=1.0)


# ----------------------------------------------------------------------------- clip bounds


def test_asymmetric_clip_bounds_by_hand():
    h_hat = t([[-1.0, -0.5, 0.0, 0.5, 1.0]])
    low, high = asymmetric_clip_bounds(h_hat, clip_low=0.2, clip_high=0.28, alpha=1.0)
    # ĥ ≤ 0: low = 0.2·(1 − ĥ) = [0.4, 0.3, 0.2]; ĥ > 0: low stays 0.2
    torch.testing.assert_close(low, t([[0.4, 0.3, 0.2, 0.2, 0.2]]))
    # ĥ > 0: high = 0.28·(1 + ĥ) = [0.42, 0.56]; ĥ ≤ 0: high stays 0.28
    torch.testing.assert_close(high, t([[0.28, 0.28, 0.28, 0.42, 0.56]]))
    low, high = asymmetric_clip_bounds(h_hat, alpha=0.5)
    torch.testing.assert_close(low, t([[0.3, 0.25, 0.2, 0.2, 0.2]]))  # 0.2·(1 − 0.5·ĥ)
    torch.testing.assert_close(high, t([[0.2, 0.2, 0.2, 0.25, 0.3]]))  # 0.2·(1 + 0.5·ĥ)


# ----------------------------------------------------------------------------- redistribution


@pytest.mark.parametrize(
    "h_hat,ratio,expected",
    [
        (0.5, 1.0, 2.0),  # ĥ > 0 inside the zone (0.9, 1.1): A
        (0.5, 1.2, 3.0),  # ĥ > 0 outside: A·(1 + 0.5) = 3
        (0.5, 0.85, 3.0),  # ĥ > 0 outside below
        (-0.5, 1.0, 1.0),  # ĥ ≤ 0 inside: A·(1 − 0.5) = 1
        (-0.5, 0.85, 2.0),  # ĥ ≤ 0 outside: A
        (-0.5, 1.1, 2.0),  # the zone is open: r = 1 + high/2 is outside
        (0.5, 0.9, 3.0),  # r = 1 − low/2 is outside
        (0.0, 1.0, 2.0),  # ĥ = 0 counts as ≤ 0: A·(1 + 0) = A
    ],
)
def test_redistribute_advantages_by_hand(h_hat, ratio, expected):
    out = redistribute_advantages(t([[2.0]]), t([[ratio]]), t([[h_hat]]), 0.2, 0.2, beta=1.0)
    torch.testing.assert_close(out, t([[expected]]))


def test_redistribute_advantages_per_token_bounds_and_beta():
    # token 0: low 0.4 → zone (0.8, 1.1): r = 0.85 inside, ĥ = −0.5 → A·(1 − 2·0.5) = 0
    # token 1: high 0.6 → zone (0.9, 1.3): r = 1.2 inside, ĥ = 0.5 → A = −1
    low, high = t([[0.4, 0.2]]), t([[0.2, 0.6]])
    adv, ratio, h_hat = t([[3.0, -1.0]]), t([[0.85, 1.2]]), t([[-0.5, 0.5]])
    out = redistribute_advantages(adv, ratio, h_hat, low, high, beta=2.0)
    torch.testing.assert_close(out, t([[0.0, -1.0]]))


def test_redistribute_advantages_matches_reference():
    gen = torch.Generator().manual_seed(0)
    adv = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    ratio = 0.7 + 0.6 * torch.rand(4, 9, generator=gen, dtype=torch.float64)
    h_hat = 2 * torch.rand(4, 9, generator=gen, dtype=torch.float64) - 1
    low, high = asymmetric_clip_bounds(h_hat, 0.2, 0.28, 1.0)
    out = redistribute_advantages(adv, ratio, h_hat, low, high, beta=0.7)
    expected = []
    for a, r, h, lo, hi in zip(*(x.flatten().tolist() for x in (adv, ratio, h_hat, low, high))):
        inside = 1 - lo / 2 < r < 1 + hi / 2
        boosted = a * (1 + 0.7 * h)
        expected.append(a if inside == (h > 0) else boosted)
    torch.testing.assert_close(out, t(expected).reshape(4, 9))
