"""Recipes as data: the spec's table, the papers' constants, validated overrides."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    LOSS_AGGREGATIONS,
    RECIPES,
    AlgorithmRecipe,
    KLPenalty,
    OverlongPenalty,
    compute_advantages,
    get_recipe,
)


def test_recipe_names():
    assert list(RECIPES) == ["ppo", "grpo", "dapo", "vapo", "tppo", "hapo", "opd"]
    for name, recipe in RECIPES.items():
        assert recipe.name == name
        assert recipe.advantage_estimator in ADVANTAGE_ESTIMATORS
        assert recipe.loss_agg in LOSS_AGGREGATIONS


# (estimator, critic, loss agg, clip low, clip high) from the spec's recipe table
TABLE = {
    "ppo": ("gae", True, "seq-mean-token-mean", 0.2, 0.2),
    "grpo": ("grpo", False, "seq-mean-token-mean", 0.2, 0.2),
    "dapo": ("grpo", False, "token-mean", 0.2, 0.28),
    "vapo": ("decoupled_gae", True, "token-mean", 0.2, 0.28),
    "tppo": ("egae", True, "token-mean", 0.2, 0.28),
    "hapo": ("token_level_group_average", False, "token-mean", 0.2, 0.2),
    "opd": ("none", False, "token-mean", 0.2, 0.2),
}


@pytest.mark.parametrize("name", list(TABLE))
def test_recipe_table(name):
    recipe = get_recipe(name)
    row = (recipe.advantage_estimator, recipe.use_critic, recipe.loss_agg, recipe.clip_low, recipe.clip_high)
    assert row == TABLE[name]


def test_recipe_extras():
    ppo, grpo, dapo = get_recipe("ppo"), get_recipe("grpo"), get_recipe("dapo")
    assert (ppo.gamma, ppo.lam, ppo.lam_critic, ppo.whiten_advantages) == (1.0, 0.95, 0.95, True)
    assert grpo.kl is None and dapo.kl is None  # KL off by default (optional for GRPO)
    assert dapo.dynamic_sampling and dapo.overlong == OverlongPenalty(20480, 4096, 1.0)
    vapo = get_recipe("vapo")
    assert (vapo.lam_critic, vapo.length_adaptive_alpha, vapo.positive_nll_coef) == (1.0, 0.05, 0.1)
    assert (vapo.critic_lr_multiplier, vapo.value_warmup_steps) == (2.0, 50)
    tppo = get_recipe("tppo")
    assert tppo.generation_window == 8192 and tppo.lam_critic == 1.0
    hapo = get_recipe("hapo")
    hapo_pieces = (hapo.temperature_tau, hapo.entropy_clip_alpha, hapo.redistribution_beta)
    assert hapo_pieces == (0.05, 1.0, 1.0)
    assert get_recipe("opd").distill_coef == 1.0 and all(get_recipe(n).distill_coef == 0 for n in TABLE if n != "opd")
    assert hapo.clip_c == 10.0 and hapo.dynamic_sampling and hapo.token_aware
    assert not any(get_recipe(n).token_aware for n in ("ppo", "grpo", "dapo", "vapo", "tppo"))


def test_recipes_are_frozen_and_overrides_do_not_leak():
    recipe = get_recipe("dapo", clip_high=0.3)
    assert recipe.clip_high == 0.3 and RECIPES["dapo"].clip_high == 0.28
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.clip_high = 0.5


def test_unknown_override_key_names_it_and_lists_allowed():
    with pytest.raises(ValueError) as err:
        get_recipe("grpo", clip_hgh=0.3)
    message = str(err.value)
    assert "clip_hgh" in message and "clip_high" in message and "loss_agg" in message


def test_unknown_recipe_lists_valid():
    with pytest.raises(ValueError, match="ppo, grpo, dapo, vapo, tppo, hapo"):
        get_recipe("reinforce")


@pytest.mark.parametrize(
    "overrides,key",
    [
        ({"clip_low": 0.0}, "clip_low"),
        ({"clip_high": 1.0}, "clip_high"),
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_high": "0.28"}, "clip_high"),
        ({"clip_c": 1.0}, "clip_c"),
        ({"lam": 1.5}, "lam"),
        ({"loss_agg": "sum"}, "loss_agg"),
        ({"advantage_estimator": "rloo"}, "advantage_estimator"),
        ({"use_critic": True}, "use_critic"),  # grpo reads no values
        ({"value_warmup_steps": 10}, "value_warmup_steps"),  # no critic to warm up
        ({"generation_window": 4096}, "generation_window"),  # needs egae
        ({"train_in_flight": False}, "train_in_flight"),  # needs a generation window
        ({"overlong_filter": 1}, "overlong_filter"),
        ({"kl": {"kind": "k5"}}, "kl.kind"),
        ({"kl": {"kind": "k3", "weight": 1}}, "kl.weight"),
        ({"overlong": {"max_len": 100, "buffer_len": 200}}, "overlong.buffer_len"),
        ({"temperature_tau": 1.0}, "temperature_tau"),
        ({"dynamic_sampling": 1}, "dynamic_sampling"),
        ({"max_gen_batches": 0}, "max_gen_batches"),
    ],
)
def test_bad_override_values_raise_naming_the_key(overrides, key):
    with pytest.raises(ValueError, match=key):
        get_recipe("grpo", **overrides)


def test_nested_overrides_from_dicts():
    recipe = get_recipe("grpo", kl={"kind": "k3", "coef": 0.04})
    assert recipe.kl == KLPenalty("k3", 0.04)
    recipe = get_recipe("dapo", overlong={"max_len": 4096, "buffer_len": 512})
    assert recipe.overlong == OverlongPenalty(4096, 512, 1.0)
    assert get_recipe("dapo", overlong=None).overlong is None


def test_consistent_estimator_critic_switch_is_allowed():
    recipe = get_recipe("grpo", advantage_estimator="gae", use_critic=True)
    assert recipe.use_critic


def test_direct_construction_validates_too():
    with pytest.raises(ValueError, match="clip_low"):
        AlgorithmRecipe(name="mine", advantage_estimator="grpo", clip_low=2.0)


def test_advantage_inputs_carry_recipe_hyperparameters():
    recipe = get_recipe("vapo")
    mask = torch.ones(1, 2)
    rewards, values = torch.tensor([1.0]), torch.zeros(1, 2)
    inputs = recipe.advantage_inputs(mask, seq_rewards=rewards, values=values)
    assert (inputs.lam_critic, inputs.length_adaptive_alpha, inputs.whiten) == (1.0, 0.05, False)
    # l = 2 ≤ 1/α → λ_policy = 0: A_t = δ_t: [0 + 0 − 0, 1 − 0] = [0, 1]; MC returns [1, 1]
    out = compute_advantages(recipe.advantage_estimator, inputs)
    torch.testing.assert_close(out.advantages, torch.tensor([[0.0, 1.0]]))
    torch.testing.assert_close(out.returns, torch.tensor([[1.0, 1.0]]))
