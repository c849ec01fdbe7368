"""Advantage/return estimators against hand-computed values and a per-element reference."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms import (
    compute_egae,
    compute_gae,
    decoupled_gae,
    grpo_advantages,
    last_token_values,
    length_adaptive_lambda,
    masked_whiten,
    token_level_group_average_advantages,
)


def t(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


def reference_gae(rewards, values, mask, gamma, lams, bootstrap=None):
    """Straightforward per-element GAE on Python lists (independent of the library)."""
    adv_rows, ret_rows = [], []
    for b, (r_row, v_row, m_row) in enumerate(zip(rewards, values, mask)):
        next_v = 0.0 if bootstrap is None else bootstrap[b]
        next_a = 0.0
        adv = [0.0] * len(r_row)
        for i in reversed(range(len(r_row))):
            if not m_row[i]:
                continue  # masked: A = 0, V_next and A_next pass through
            delta = r_row[i] + gamma * next_v - v_row[i]
            adv[i] = delta + gamma * lams[b] * next_a
            next_v, next_a = v_row[i], adv[i]
        adv_rows.append(adv)
        ret_rows.append([a + v if m else 0.0 for a, v, m in zip(adv, v_row, m_row)])
    return adv_rows, ret_rows


# ----------------------------------------------------------------------------- compute_gae


def test_gae_by_hand():
    # γ = 1, λ = 0.5, rewards [0, 0, 1], values [0.5, 0.6, 0.7]:
    # t=2: δ = 1 + 0 − 0.7 = 0.3, A = 0.3
    # t=1: δ = 0 + 0.7 − 0.6 = 0.1, A = 0.1 + 0.5·0.3 = 0.25
    # t=0: δ = 0 + 0.6 − 0.5 = 0.1, A = 0.1 + 0.5·0.25 = 0.225
    adv, ret = compute_gae(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]]), 1.0, 0.5)
    torch.testing.assert_close(adv, t([[0.225, 0.25, 0.3]]))
    torch.testing.assert_close(ret, t([[0.725, 0.85, 1.0]]))  # A + V


def test_gae_masked_gap_passes_next_value_and_advantage_through():
    # mask [1, 0, 1], γ = 0.9, λ = 0.5; the masked middle token (reward 5, value 9) is skipped:
    # t=2: δ = 1 − 0.7 = 0.3, A = 0.3
    # t=1: masked → A = 0; V_next = 0.7, A_next = 0.3 carried to t=0
    # t=0: δ = 0 + 0.9·0.7 − 0.5 = 0.13, A = 0.13 + 0.9·0.5·0.3 = 0.265
    adv, ret = compute_gae(t([[0.0, 5.0, 1.0]]), t([[0.5, 9.0, 0.7]]), t([[1, 0, 1]]), gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, t([[0.265, 0.0, 0.3]]))
    torch.testing.assert_close(ret, t([[0.765, 0.0, 1.0]]))


def test_gae_bootstrap_value_after_last_token():
    # γ = λ = 1, mask [1, 1, 0], bootstrap 2: t=1: δ = 1 + 2 − 0.4 = 2.6; t=0: δ = 0.4 − 0.2 = 0.2,
    # A = 0.2 + 2.6 = 2.8. Returns 3.0 = reward 1 + bootstrap 2 at both real tokens.
    adv, ret = compute_gae(t([[0.0, 1.0, 0.0]]), t([[0.2, 0.4, 7.0]]), t([[1, 1, 0]]), 1.0, 1.0, bootstrap=t([2.0]))
    torch.testing.assert_close(adv, t([[2.8, 2.6, 0.0]]))
    torch.testing.assert_close(ret, t([[3.0, 3.0, 0.0]]))


def test_gae_empty_mask_row_is_all_zero():
    adv, ret = compute_gae(t([[1.0, 2.0]]), t([[3.0, 4.0]]), t([[0, 0]]), 1.0, 0.95)
    assert torch.equal(adv, torch.zeros(1, 2, dtype=torch.float64))
    assert torch.equal(ret, torch.zeros(1, 2, dtype=torch.float64))


def _random_batch(seed, batch=5, length=7):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=gen) > 0.3).to(torch.float64)
    mask[0] = 0.0  # one empty row
    mask[1] = 1.0  # one full row
    return rewards, values, mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.7), (0.99, 1.0), (1.0, 0.0)])
def test_gae_matches_loop_reference(gamma, lam):
    rewards, values, mask = _random_batch(seed=int(gamma * 100 + lam * 10))
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = reference_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, [lam] * 5)
    torch.testing.assert_close(adv, t(ref_adv))
    torch.testing.assert_close(ret, t(ref_ret))


def test_gae_lam_per_sequence_tensor():
    rewards, values, mask = _random_batch(seed=3)
    lams = [0.0, 0.5, 0.8, 0.95, 1.0]
    adv, ret = compute_gae(rewards, values, mask, 0.97, t(lams))
    ref_adv, ref_ret = reference_gae(rewards.tolist(), values.tolist(), mask.tolist(), 0.97, lams)
    torch.testing.assert_close(adv, t(ref_adv))
    torch.testing.assert_close(ret, t(ref_ret))


def test_gae_low_precision_inputs_are_computed_in_float32():
    adv, _ = compute_gae(
        torch.tensor([[0.0, 1.0]], dtype=torch.bfloat16),
        torch.zeros(1, 2, dtype=torch.bfloat16),
        torch.ones(1, 2, dtype=torch.bool),
    )
    assert adv.dtype == torch.float32
    # t=1: A = 1; t=0: A = 0 + 0.95·1 = 0.95
    torch.testing.assert_close(adv, torch.tensor([[0.95, 1.0]]))


# ----------------------------------------------------------------------------- masked_whiten


def test_masked_whiten_by_hand():
    # real entries [1, 2, 3]: mean 2, Bessel var ((−1)² + 0 + 1²)/(3 − 1) = 1 → [−1, 0, 1];
    # the masked 100 neither shifts the statistics nor survives.
    out = masked_whiten(t([1.0, 2.0, 3.0, 100.0]), t([1, 1, 1, 0]))
    torch.testing.assert_close(out, t([-1.0, 0.0, 1.0, 0.0]))


def test_masked_whiten_matches_loop_reference():
    _, values, mask = _random_batch(seed=11)
    real = [v for v, m in zip(values.flatten().tolist(), mask.flatten().tolist()) if m]
    mean = sum(real) / len(real)
    var = sum((v - mean) ** 2 for v in real) / (len(real) - 1)
    expected = [
        [(v - mean) / math.sqrt(var + 1e-8) if m else 0.0 for v, m in zip(v_row, m_row)]
        for v_row, m_row in zip(values.tolist(), mask.tolist())
    ]
    torch.testing.assert_close(masked_whiten(values, mask), t(expected))


def test_masked_whiten_single_entry_and_empty_mask_give_zero():
    assert torch.equal(masked_whiten(t([5.0, 7.0]), t([0, 1])), t([0.0, 0.0]))
    assert torch.equal(masked_whiten(t([5.0, 7.0]), t([0, 0])), t([0.0, 0.0]))


# ----------------------------------------------------------------------------- decoupled / λ


def test_decoupled_gae_uses_lam_policy_for_advantages_and_lam_critic_for_returns():
    rewards, values, mask = _random_batch(seed=5)
    lam_policy = [0.2, 0.4, 0.6, 0.8, 0.9]
    adv, ret = decoupled_gae(rewards, values, mask, 1.0, t(lam_policy), 1.0)
    ref_adv, _ = reference_gae(rewards.tolist(), values.tolist(), mask.tolist(), 1.0, lam_policy)
    _, ref_ret = reference_gae(rewards.tolist(), values.tolist(), mask.tolist(), 1.0, [1.0] * 5)
    torch.testing.assert_close(adv, t(ref_adv))
    torch.testing.assert_close(ret, t(ref_ret))


def test_decoupled_gae_critic_lambda_one_is_monte_carlo():
    # γ = 1, λ_critic = 1: returns are the reward-to-go: rewards [0, 1, 2] → [3, 3, 2],
    # whatever the values are.
    rewards, values, mask = t([[0.0, 1.0, 2.0]]), t([[5.0, -3.0, 0.5]]), t([[1, 1, 1]])
    _, ret = decoupled_gae(rewards, values, mask, 1.0, 0.3, 1.0)
    torch.testing.assert_close(ret, t([[3.0, 3.0, 2.0]]))


def test_length_adaptive_lambda_values():
    # λ = 1 − 1/(0.05·l): l=100 → 1 − 1/5 = 0.8; l=1000 → 1 − 1/50 = 0.98;
    # l=20 = 1/α → 0; l=10, l=1 and l=0 → clamped to 0; l=21 → 1 − 1/1.05 = 0.0476190
    lam = length_adaptive_lambda(torch.tensor([100, 1000, 20, 10, 1, 0, 21]))
    expected = torch.tensor([0.8, 0.98, 0.0, 0.0, 0.0, 0.0, 1 - 1 / 1.05])
    torch.testing.assert_close(lam, expected)
    assert lam.dtype == torch.float32
    assert bool((lam < 1).all())


def test_length_adaptive_lambda_other_alpha():
    # α = 0.5: l = 4 → 1 − 1/2 = 0.5; l = 2 → 1 − 1 = 0
    torch.testing.assert_close(length_adaptive_lambda(t([4.0, 2.0]), alpha=0.5), t([0.5, 0.0]))


# ----------------------------------------------------------------------------- EGAE


def test_last_token_values():
    values = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = t([[1, 1, 0], [0, 1, 1], [0, 0, 0]])
    torch.testing.assert_close(last_token_values(values, mask), t([2.0, 6.0, 0.0]))


def test_egae_truncated_row_bootstraps_with_last_value():
    # λ = 0.5, γ = 1, values [0.3, 0.5, pad], no reward yet.
    # truncated: bootstrap V(s_l) ≈ 0.5: t=1: δ = 0 + 0.5 − 0.5 = 0;
    #   t=0: δ = 0.5 − 0.3 = 0.2 → A = [0.2, 0]
    # finished (same data): bootstrap 0: t=1: δ = −0.5; t=0: A = 0.2 + 0.5·(−0.5) = −0.05
    rewards = t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    values = t([[0.3, 0.5, 9.0], [0.3, 0.5, 9.0]])
    mask = t([[1, 1, 0], [1, 1, 0]])
    adv, ret = compute_egae(rewards, values, mask, torch.tensor([True, False]), 1.0, 0.5)
    torch.testing.assert_close(adv, t([[0.2, 0.0, 0.0], [-0.05, -0.5, 0.0]]))
    torch.testing.assert_close(ret, t([[0.5, 0.5, 0.0], [0.25, 0.0, 0.0]]))


def test_egae_matches_reference_with_last_value_bootstrap():
    rewards, values, mask = _random_batch(seed=7)
    truncated = torch.tensor([True, True, False, True, False])
    adv, ret = compute_egae(rewards, values, mask, truncated, gamma=0.95, lam=0.9)
    boot = []
    for b in range(5):
        real = [v for v, m in zip(values[b].tolist(), mask[b].tolist()) if m]
        boot.append(real[-1] if (truncated[b] and real) else 0.0)
    ref_adv, ref_ret = reference_gae(rewards.tolist(), values.tolist(), mask.tolist(), 0.95, [0.9] * 5, boot)
    torch.testing.assert_close(adv, t(ref_adv))
    torch.testing.assert_close(ret, t(ref_ret))


# ----------------------------------------------------------------------------- GRPO


def test_grpo_by_hand():
    # group 7: R = [1, 0, 0], mean 1/3, unbiased var = (4/9 + 1/9 + 1/9)/2 = 1/3, std = 0.577350
    #   A = (2/3)/0.577350 = 1.154701, (−1/3)/0.577350 = −0.577350
    # group 3: R = [2, 4], mean 3, var = (1 + 1)/1 = 2, std = 1.414214 → A = ∓0.707107
    # group 5: one sample → mean 0, std 1 → A = 3/(1 + 1e-6)
    rewards = t([1.0, 0.0, 0.0, 2.0, 4.0, 3.0])
    groups = torch.tensor([7, 7, 7, 3, 3, 5])
    adv = grpo_advantages(rewards, groups)
    expected = t([1.154701, -0.577350, -0.577350, -0.707107, 0.707107, 3.0])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_grpo_without_std_is_dr_grpo():
    # R − mean_g: [1 − 1/3, −1/3, −1/3], [2 − 3, 4 − 3], lone sample: 3 − 0
    rewards, groups = t([1.0, 0.0, 0.0, 2.0, 4.0, 3.0]), torch.tensor([7, 7, 7, 3, 3, 5])
    adv = grpo_advantages(rewards, groups, norm_by_std=False)
    torch.testing.assert_close(adv, t([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0, 3.0]))


def test_grpo_all_equal_rewards_give_zero():
    adv = grpo_advantages(t([1.0, 1.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 0, 1, 1]))
    assert torch.equal(adv, torch.zeros(5, dtype=torch.float64))


def test_grpo_matches_loop_reference():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, generator=gen, dtype=torch.float64)
    groups = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 3])
    expected = []
    for i in range(12):
        members = [rewards[j].item() for j in range(12) if groups[j] == groups[i]]
        n = len(members)
        mean = sum(members) / n if n > 1 else 0.0
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1)) if n > 1 else 1.0
        expected.append((rewards[i].item() - mean) / (std + 1e-6))
    torch.testing.assert_close(grpo_advantages(rewards, groups), t(expected))


# ----------------------------------------------------------------------------- HAPO token-level


def test_token_level_group_average_by_hand():
    # R = [1, 0], l = [1, 3]: μ = (1·1 + 3·0)/4 = 0.25
    # σ² = (1·0.75² + 3·0.25²)/4 = (0.5625 + 0.1875)/4 = 0.1875, σ = 0.4330127
    # A = 0.75/0.4330127 = 1.7320508, −0.25/0.4330127 = −0.5773503 (both < 5: no fallback)
    adv = token_level_group_average_advantages(t([1.0, 0.0]), torch.tensor([0, 0]), t([1.0, 3.0]))
    torch.testing.assert_close(adv, t([1.7320508, -0.5773503]), atol=1e-5, rtol=0)


def test_token_level_group_average_falls_back_to_grpo_per_group():
    # group 0: R = [1, 0], l = [1, 99]: μ = 0.01, σ² = (0.99² + 99·0.01²)/100 = 0.0099,
    #   σ = 0.0994987, A_0 = 0.99/0.0994987 = 9.9499 ≥ 5 → GRPO: mean 0.5, std √0.5 → ±0.707107
    # group 1 (R = [1, 0], l = [1, 3]) keeps its token-level values (see the test above).
    rewards = t([1.0, 0.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1])
    lengths = t([1.0, 99.0, 1.0, 3.0])
    adv = token_level_group_average_advantages(rewards, groups, lengths)
    expected = t([0.707107, -0.707107, 1.7320508, -0.5773503])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    # with a higher threshold group 0 keeps the length-weighted value
    adv = token_level_group_average_advantages(rewards, groups, lengths, fallback=10.0)
    torch.testing.assert_close(adv[:2], t([9.949874, -0.100504]), atol=1e-4, rtol=0)


def test_token_level_group_average_equal_lengths_is_population_std_grpo():
    # equal lengths: μ = mean, σ = population std. R = [1, 0, 0, 1]: μ = 0.5, σ = 0.5 → ±1
    adv = token_level_group_average_advantages(
        t([1.0, 0.0, 0.0, 1.0]), torch.tensor([2, 2, 2, 2]), t([5.0, 5.0, 5.0, 5.0])
    )
    torch.testing.assert_close(adv, t([1.0, -1.0, -1.0, 1.0]), atol=1e-5, rtol=0)


def test_token_level_group_average_edge_groups():
    # a group of one and an all-equal group: σ = 0 and R − μ = 0 → A = 0
    adv = token_level_group_average_advantages(t([3.0, 1.0, 1.0]), torch.tensor([0, 1, 1]), t([4.0, 2.0, 9.0]))
    assert torch.equal(adv, torch.zeros(3, dtype=torch.float64))


def test_token_level_group_average_matches_loop_reference():
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randint(0, 2, (10,), generator=gen).to(torch.float64)
    rewards[0], rewards[1] = 1.0, 0.0  # group 0 surely mixed
    lengths = torch.randint(1, 50, (10,), generator=gen).to(torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 1, 1])
    expected = []
    for i in range(10):
        idx = [j for j in range(10) if groups[j] == groups[i]]
        total = sum(lengths[j].item() for j in idx)
        mu = sum(lengths[j].item() * rewards[j].item() for j in idx) / total
        var = sum(lengths[j].item() * (rewards[j].item() - mu) ** 2 for j in idx) / total
        expected.append((rewards[i].item() - mu) / (math.sqrt(var) + 1e-6))
    assert max(abs(a) for a in expected) < 5.0  # this draw must not trigger the fallback
    adv = token_level_group_average_advantages(rewards, groups, lengths)
    torch.testing.assert_close(adv, t(expected))
