"""The rows a step trains (trainer.rows): the trainer's whole-group cut and row multiple,
which config validation uses to refuse a rollout that can never fill a training batch."""

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.from_config import validate
from megatron_rl.from_config.rows import train_row_multiple, usable_groups


def test_usable_groups_keeps_the_most_whole_groups_that_split_evenly():
    assert usable_groups(16, 8, 16) == 16
    assert usable_groups(5, 3, 4) == 4  # 12 rows
    assert usable_groups(7, 8, 48) == 6  # 48 rows
    assert usable_groups(3, 3, 4) == 0  # 9, 6, 3 rows: none a multiple of 4


def test_row_multiple_is_the_lcm_of_actor_and_critic_dp():
    cfg = load_config(
        None,
        [
            "parallel.tensor_model_parallel_size=2",
            "critic_parallel.pipeline_model_parallel_size=1",
            "trainer.micro_batch_size=2",
            "algorithm.mini_batches_per_step=3",
        ],
    )
    assert train_row_multiple(cfg, 4, uses_critic=False) == 2 * 2 * 3  # actor DP 2
    assert train_row_multiple(cfg, 4, uses_critic=True) == 4 * 2 * 3  # lcm(2, critic DP 4)


@pytest.mark.parametrize("prompts", range(1, 7))
def test_validation_accepts_exactly_the_rollouts_the_trainer_can_train(prompts):
    # n_samples 3 and 4-row batches (DP 1 x micro-batch 4): the trainer needs 4 whole groups.
    cfg = load_config(
        None,
        [
            "algorithm.recipe=grpo",
            f"rollout.prompts_per_step={prompts}",
            "rollout.n_samples=3",
            "trainer.micro_batch_size=4",
        ],
    )
    assert bool(usable_groups(prompts, 3, train_row_multiple(cfg, 1, uses_critic=False))) == (prompts >= 4)
    if prompts >= 4:
        validate(cfg, 1)
    else:
        with pytest.raises(ConfigError, match="cannot fill one training batch of 4 rows in whole groups"):
            validate(cfg, 1)
