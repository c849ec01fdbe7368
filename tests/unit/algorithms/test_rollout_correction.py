"""Rollout correction against hand-computed values, and its effect on the policy loss."""

import math

import pytest
import torch

from megatron_rl.algorithms import get_recipe, policy_loss
from megatron_rl.algorithms.rollout_correction import CorrectionInputs, RolloutCorrection, correct_rollout

# Row 0: three response tokens with log π_old − log μ = (0.5, −1.0, 0.0); row 1: two with (−0.8, 0.0).
OLD = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, 0.0, 0.0]])
ROLLOUT = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-0.2, -1.0, 0.0, 0.0]])
MASK = torch.tensor([[True, True, True, False], [True, True, False, False]])
INPUTS = CorrectionInputs(OLD, ROLLOUT, MASK)


def test_token_tis_caps_each_token_ratio():
    out = correct_rollout(INPUTS, RolloutCorrection(kind="token_tis", cap=1.5))
    expected = torch.tensor([[1.5, math.exp(-1.0), 1.0, 0.0], [math.exp(-0.8), 1.0, 0.0, 0.0]])
    assert torch.allclose(out.weights, expected, atol=1e-6)
    assert (out.tokens_affected, out.sequences_masked) == (1, 0)  # only e^0.5 = 1.65 > 1.5


def test_token_mask_drops_tokens_outside_the_bounds():
    out = correct_rollout(INPUTS, RolloutCorrection(kind="token_mask", low=0.4, high=1.6))
    # e^0.5 = 1.649 > 1.6 and e^-1 = 0.368 < 0.4 are masked; e^-0.8 = 0.449 and 1 are kept.
    assert out.weights.tolist() == [[0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    assert (out.tokens_affected, out.sequences_masked) == (2, 0)


def test_seq_mis_weights_whole_sequences_and_masks_outliers():
    out = correct_rollout(INPUTS, RolloutCorrection(kind="seq_mis", low=0.5, high=2.0))
    # Row 0: Π ρ = e^(0.5 − 1 + 0) = 0.607, kept; row 1: e^-0.8 = 0.449 < 0.5, masked.
    w0 = math.exp(-0.5)
    assert torch.allclose(out.weights, torch.tensor([[w0, w0, w0, 0.0], [0.0, 0.0, 0.0, 0.0]]), atol=1e-6)
    assert (out.tokens_affected, out.sequences_masked) == (2, 1)


def test_bad_settings_and_shapes_are_refused():
    with pytest.raises(ValueError, match="kind='is'.*token_tis"):
        RolloutCorrection(kind="is")
    with pytest.raises(ValueError, match="low <= 1 <= high"):
        RolloutCorrection(kind="token_mask", low=1.2, high=2.0)
    with pytest.raises(ValueError, match="cap=0"):
        RolloutCorrection(cap=0)
    with pytest.raises(ValueError, match="must match"):
        correct_rollout(CorrectionInputs(OLD, ROLLOUT[:, :3], MASK), RolloutCorrection())


def test_recipe_override_builds_the_correction():
    recipe = get_recipe("grpo", rollout_correction={"kind": "seq_mis", "low": 0.25})
    assert recipe.rollout_correction == RolloutCorrection(kind="seq_mis", low=0.25, high=2.0)
    with pytest.raises(ValueError, match="unknown key rollout_correction.bound"):
        get_recipe("grpo", rollout_correction={"bound": 3})


def test_policy_loss_terms_are_scaled_by_the_weights():
    logp = torch.tensor([[-1.0, -1.0, -1.0]])
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    weights = torch.tensor([[2.0, 0.0, 1.0]])
    # ratio 1 everywhere: ℓ = −A per token = (−1, 2, −0.5); weighted (−2, 0, −0.5); token-mean over 3 tokens.
    loss, _ = policy_loss(logp, logp, adv, mask, token_weights=weights)
    assert float(loss) == pytest.approx((-2.0 + 0.0 - 0.5) / 3, abs=1e-7)
    plain, _ = policy_loss(logp, logp, adv, mask)
    assert float(plain) == pytest.approx((-1.0 + 2.0 - 0.5) / 3, abs=1e-7)
