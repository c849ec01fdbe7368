"""RL losses as extensions of Megatron-Core's schedules.

`batch` (the [N, S] training batch and its alignment), `packing` (token-budget micro-
batches of whole sequences, THD rows, DP load balancing), `vocab_parallel` (logprobs and
entropy without gathering the vocabulary), `objectives` (the recipe's actor and critic
losses as exact shares of the mini-batch loss), `preference` (the reward model's
Bradley-Terry loss on whole pairs) and `runner` (compute_logprobs,
compute_values, forward_backward, train_step through `get_forward_backward_func`).
"""

from megatron_rl.schedules.batch import TrainBatch, epoch_order, gather_response, pack_sequences, scatter_response
from megatron_rl.schedules.objectives import ActorLoss, CriticLoss, LossOutput
from megatron_rl.schedules.packing import Microbatching, PackedMicroBatch
from megatron_rl.schedules.runner import (
    compute_logprobs,
    compute_values,
    forward_backward,
    gather_data_parallel,
    gathered_logprobs,
    gathered_values,
    local_batch,
    model_groups,
    train_step,
)
from megatron_rl.schedules.vocab_parallel import vocab_parallel_logprobs

__all__ = [
    "TrainBatch",
    "Microbatching",
    "PackedMicroBatch",
    "epoch_order",
    "pack_sequences",
    "scatter_response",
    "gather_response",
    "vocab_parallel_logprobs",
    "LossOutput",
    "ActorLoss",
    "CriticLoss",
    "model_groups",
    "local_batch",
    "gather_data_parallel",
    "gathered_logprobs",
    "gathered_values",
    "compute_logprobs",
    "compute_values",
    "forward_backward",
    "train_step",
]
