"""Pure tensor RL algorithms: advantages, reward shaping, losses, HAPO pieces, recipes.

Everything here is a function of tensors (formulas: docs/algorithms.md): no process groups, no
model, no `torch.distributed` (a unit test enforces it). `schedules/` owns the parallel
reductions and passes whole-mini-batch denominators in as `norm`.
"""

from megatron_rl.algorithms.advantages import (
    compute_egae,
    compute_gae,
    decoupled_gae,
    grpo_advantages,
    last_token_values,
    length_adaptive_lambda,
    masked_whiten,
    token_level_group_average_advantages,
)
from megatron_rl.algorithms.distillation import mean_reverse_kl, reverse_kl_advantages
from megatron_rl.algorithms.estimators import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    AdvantageOutputs,
    compute_advantages,
    get_advantage_estimator,
    seq_to_token_rewards,
)
from megatron_rl.algorithms.hapo import (
    EntropyStats,
    adaptive_temperature,
    asymmetric_clip_bounds,
    entropy_stats,
    normalized_entropy,
    redistribute_advantages,
)
from megatron_rl.algorithms.losses import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    LossAggregation,
    aggregate,
    entropy_from_logits,
    explained_variance,
    get_loss_aggregation,
    kl_penalty,
    policy_loss,
    positive_example_nll,
    value_loss,
)
from megatron_rl.algorithms.preference import bradley_terry_loss, pair_correct
from megatron_rl.algorithms.recipes import (
    RECIPES,
    AlgorithmRecipe,
    KLPenalty,
    OverlongPenalty,
    get_recipe,
)
from megatron_rl.algorithms.rollout_correction import (
    CORRECTIONS,
    CorrectionInputs,
    CorrectionOutputs,
    RolloutCorrection,
    correct_rollout,
)
from megatron_rl.algorithms.shaping import dynamic_sampling_keep, overlong_penalty

__all__ = [
    # advantages and returns
    "compute_gae",
    "masked_whiten",
    "decoupled_gae",
    "length_adaptive_lambda",
    "compute_egae",
    "last_token_values",
    "grpo_advantages",
    "token_level_group_average_advantages",
    # estimator registry
    "AdvantageInputs",
    "AdvantageOutputs",
    "ADVANTAGE_ESTIMATORS",
    "get_advantage_estimator",
    "compute_advantages",
    "seq_to_token_rewards",
    # reward shaping and sampling
    "overlong_penalty",
    "dynamic_sampling_keep",
    # losses
    "policy_loss",
    "aggregate",
    "LossAggregation",
    "LOSS_AGGREGATIONS",
    "get_loss_aggregation",
    "value_loss",
    "positive_example_nll",
    "mean_reverse_kl",
    "reverse_kl_advantages",
    "KL_ESTIMATORS",
    "kl_penalty",
    "entropy_from_logits",
    "explained_variance",
    # reward models
    "bradley_terry_loss",
    "pair_correct",
    # rollout correction
    "CORRECTIONS",
    "CorrectionInputs",
    "CorrectionOutputs",
    "RolloutCorrection",
    "correct_rollout",
    # HAPO
    "EntropyStats",
    "entropy_stats",
    "normalized_entropy",
    "adaptive_temperature",
    "asymmetric_clip_bounds",
    "redistribute_advantages",
    # recipes
    "AlgorithmRecipe",
    "KLPenalty",
    "OverlongPenalty",
    "RECIPES",
    "get_recipe",
]
