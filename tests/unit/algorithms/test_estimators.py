"""Advantage-estimator registry: one signature, hand-computed outputs, clear errors."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    AdvantageOutputs,
    compute_advantages,
    get_advantage_estimator,
    seq_to_token_rewards,
)


def t(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


MASK = t([[1, 1, 0], [1, 1, 1]])


def test_seq_to_token_rewards_puts_reward_on_last_real_token():
    mask = t([[1, 1, 0], [0, 1, 1], [0, 0, 0], [1, 0, 1]])
    out = seq_to_token_rewards(t([2.0, 3.0, 4.0, 5.0]), mask)
    torch.testing.assert_close(out, t([[0, 2.0, 0], [0, 0, 3.0], [0, 0, 0], [0, 0, 5.0]]))


def test_inputs_derive_sequence_and_token_rewards_and_lengths():
    inputs = AdvantageInputs(response_mask=MASK, token_rewards=t([[1.0, 2.0, 9.0], [0, 0, 3.0]]))
    torch.testing.assert_close(inputs.sequence_rewards(), t([3.0, 3.0]))  # 9 is masked
    assert inputs.response_lengths().tolist() == [2, 3]
    inputs = AdvantageInputs(response_mask=MASK, seq_rewards=t([1.0, 2.0]))
    torch.testing.assert_close(inputs.token_level_rewards(), t([[0, 1.0, 0], [0, 0, 2.0]]))


def test_every_estimator_has_the_same_signature():
    # one call shape for all names: the trainer never branches on the estimator
    inputs = AdvantageInputs(
        response_mask=MASK,
        seq_rewards=t([1.0, 0.0]),
        values=torch.zeros(2, 3),
        group_index=torch.tensor([0, 0]),
        truncated=torch.tensor([False, True]),
        length_adaptive_alpha=0.5,
    )
    names = {"gae", "decoupled_gae", "egae", "grpo", "token_level_group_average", "none"}
    assert set(ADVANTAGE_ESTIMATORS) == names
    for name in ADVANTAGE_ESTIMATORS:
        out = get_advantage_estimator(name)(inputs)
        assert isinstance(out, AdvantageOutputs)
        assert out.advantages.shape == (2, 3)
        assert out.advantages[0, 2] == 0  # masked position
        assert (out.returns is None) == (name in ("grpo", "token_level_group_average", "none"))  # no critic


def test_grpo_estimator_broadcasts_over_real_tokens():
    # R = [1, 0] in one group: mean 0.5, std √0.5 → A = ±0.707107 on every real token
    inputs = AdvantageInputs(MASK, seq_rewards=t([1.0, 0.0]), group_index=torch.tensor([3, 3]))
    out = compute_advantages("grpo", inputs)
    a = 0.5 / (0.5**0.5 + 1e-6)
    torch.testing.assert_close(out.advantages, t([[a, a, 0.0], [-a, -a, -a]]))
    assert out.returns is None


def test_token_level_estimator_uses_mask_lengths():
    # R = [1, 0], lengths from the mask [2, 3]: μ = 2/5 = 0.4,
    # σ² = (2·0.36 + 3·0.16)/5 = 0.24, σ = 0.4898979 → A = 0.6/σ = 1.2247449, −0.4/σ = −0.8164966
    inputs = AdvantageInputs(MASK, seq_rewards=t([1.0, 0.0]), group_index=torch.tensor([0, 0]))
    out = compute_advantages("token_level_group_average", inputs)
    torch.testing.assert_close(out.advantages[:, 0], t([1.2247449, -0.8164966]), atol=1e-5, rtol=0)


def test_gae_estimator_with_sequence_reward():
    # one row, reward 1 on the last token, V = [0.5, 0.5], γ = 1, λ = 0.5:
    # t=1: δ = 1 − 0.5 = 0.5; t=0: δ = 0.5 − 0.5 = 0, A = 0 + 0.5·0.5 = 0.25
    inputs = AdvantageInputs(response_mask=t([[1, 1]]), seq_rewards=t([1.0]), values=t([[0.5, 0.5]]), lam=0.5)
    out = compute_advantages("gae", inputs)
    torch.testing.assert_close(out.advantages, t([[0.25, 0.5]]))
    torch.testing.assert_close(out.returns, t([[0.75, 1.0]]))


def test_decoupled_estimator_length_adaptive_lambda():
    # l = 2, α = 1 → λ_policy = 1 − 1/2 = 0.5 (same numbers as the GAE case above);
    # λ_critic = 1: returns are MC → [1, 1]
    inputs = AdvantageInputs(
        response_mask=t([[1, 1]]),
        seq_rewards=t([1.0]),
        values=t([[0.5, 0.5]]),
        lam=0.9,
        lam_critic=1.0,
        length_adaptive_alpha=1.0,
    )
    out = compute_advantages("decoupled_gae", inputs)
    torch.testing.assert_close(out.advantages, t([[0.25, 0.5]]))
    torch.testing.assert_close(out.returns, t([[1.0, 1.0]]))


def test_egae_estimator_truncated_rows():
    # truncated row, no reward, V = [0.3, 0.5], λ = 0.5 → A = [0.2, 0] (see test_advantages);
    # returns with λ_critic = 1: t=1: δ = 0, t=0: 0.2 → A + V = [0.5, 0.5]
    inputs = AdvantageInputs(
        response_mask=t([[1, 1]]),
        token_rewards=t([[0.0, 0.0]]),
        values=t([[0.3, 0.5]]),
        truncated=torch.tensor([True]),
        lam=0.5,
    )
    out = compute_advantages("egae", inputs)
    torch.testing.assert_close(out.advantages, t([[0.2, 0.0]]))
    torch.testing.assert_close(out.returns, t([[0.5, 0.5]]))


def test_compute_advantages_whitens_when_asked():
    inputs = AdvantageInputs(
        response_mask=MASK,
        seq_rewards=t([1.0, 0.0]),
        group_index=torch.tensor([0, 0]),
        norm_by_std=False,
        whiten=True,
    )
    adv = compute_advantages("grpo", inputs).advantages
    # before whitening: [0.5, 0.5, −, −0.5, −0.5, −0.5]: mean −0.1,
    # Bessel var (2·0.6² + 3·0.4²)/4 = 0.3 → first token (0.5 + 0.1)/√0.3 = 1.0954451
    real = adv[MASK.bool()]
    assert real.mean().item() == pytest.approx(0.0, abs=1e-7)
    assert real.var().item() == pytest.approx(1.0, rel=1e-6)
    assert adv[0, 2].item() == 0.0
    torch.testing.assert_close(real[0], t(0.6 / 0.3**0.5), atol=1e-6, rtol=0)


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_advantage_estimator("rloo")
    for name in ADVANTAGE_ESTIMATORS:
        assert name in str(err.value)


@pytest.mark.parametrize("name,field", [("gae", "values"), ("grpo", "group_index")])
def test_missing_input_names_the_field(name, field):
    inputs = AdvantageInputs(response_mask=MASK, seq_rewards=t([1.0, 0.0]))
    with pytest.raises(ValueError, match=f"{name}.*{field}"):
        compute_advantages(name, inputs)


def test_missing_rewards_is_an_error():
    with pytest.raises(ValueError, match="rewards"):
        compute_advantages("grpo", AdvantageInputs(MASK, group_index=torch.tensor([0, 0])))


def test_none_gives_no_advantage_and_the_reverse_kl_is_the_teachers_minus_the_students():
    from megatron_rl.algorithms import mean_reverse_kl, reverse_kl_advantages

    inputs = AdvantageInputs(response_mask=MASK, seq_rewards=t([1.0, 0.0]))
    assert torch.equal(get_advantage_estimator("none")(inputs).advantages, torch.zeros(2, 3))
    teacher, old = t([[-0.5, -2.0, -9.0], [-1.0, -0.25, -3.0]]), t([[-1.0, -1.0, -1.0], [-2.0, -0.5, -1.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert torch.equal(reverse_kl_advantages(teacher, old, mask), t([[0.5, -1.0, 0.0], [1.0, 0.0, 0.0]]))
    assert mean_reverse_kl(teacher, old, mask) == pytest.approx((-0.5 + 1.0 - 1.0) / 3)  # hand-computed
