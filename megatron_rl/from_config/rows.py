"""How many rollout rows a step trains: the rule the trainer applies and validation checks.

Every mini-batch splits evenly over the data-parallel ranks of actor and critic and into
micro-batches, so a step trains a multiple of :func:`train_row_multiple` rows. Without a
generation window the rows come in whole groups (:func:`usable_groups`); T-PPO's pool
(trainer.windows) trains any rows once it holds a group and a batch
(:func:`check_window_pool`). Pure integer arithmetic: no torch, no process group.
"""

from __future__ import annotations

import math

from megatron_rl.config.schema import Config


def train_row_multiple(config: Config, world_size: int, uses_critic: bool) -> int:
    """DP (lcm of actor's and critic's) x trainer.micro_batch_size x algorithm.mini_batches_per_step;
    with a token budget (packing) micro-batches hold any number of rows: no micro_batch_size."""
    dp = config.parallel.dp(world_size)
    if uses_critic:
        dp = math.lcm(dp, config.critic_layout.dp(world_size))
    rows = 1 if config.trainer.max_tokens_per_micro_batch is not None else config.trainer.micro_batch_size
    return dp * rows * config.algorithm.mini_batches_per_step


def usable_groups(num_groups: int, group_size: int, multiple: int) -> int:
    """Most of ``num_groups`` groups whose rows are a multiple of ``multiple`` (0: none)."""
    while num_groups and (num_groups * group_size) % multiple:
        num_groups -= 1
    return num_groups


def check_window_pool(capacity: int, group_size: int, row_multiple: int) -> None:
    """Raise ValueError unless T-PPO's window pool of these sizes can train: it holds a whole
    group and one training batch (config validation runs this before anything is built)."""
    if group_size < 1 or capacity < group_size:
        raise ValueError(
            f"window pool: capacity={capacity} rows must hold at least one group of group_size={group_size} >= 1"
        )
    if row_multiple < 1 or capacity < row_multiple:
        raise ValueError(
            f"window pool: capacity={capacity} rows cannot fill one training batch of "
            f"{row_multiple} rows (DP x micro_batch_size x mini_batches); raise "
            "rollout.prompts_per_step or rollout.n_samples"
        )
