"""Algorithm recipes as data: which pieces of `megatron_rl.algorithms` each algorithm
turns on, with the papers' constants (docs/algorithms.md, "Recipes").

A recipe selects pieces; the trainer has one code path and reads these fields. Values
are validated when the recipe is built (raising, never rewriting):

    recipe = get_recipe("dapo", clip_high=0.3)
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

from megatron_rl.algorithms._common import Tensor
from megatron_rl.algorithms.estimators import (
    ADVANTAGE_ESTIMATORS,
    CRITIC_ESTIMATORS,
    AdvantageInputs,
)
from megatron_rl.algorithms.losses import KL_ESTIMATORS, LOSS_AGGREGATIONS
from megatron_rl.algorithms.rollout_correction import RolloutCorrection

__all__ = ["KLPenalty", "OverlongPenalty", "AlgorithmRecipe", "RECIPES", "get_recipe"]


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid; allowed: {allowed}")


def _type_ok(value: Any, hint: Any) -> bool:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_type_ok(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:  # ints are fine where floats are expected; bools are not numbers here
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _hint_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint)


def _check_types(obj: Any) -> None:
    """Type errors as ValueErrors naming the field, before any range check compares."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, hint = getattr(obj, f.name), hints[f.name]
        _check(_type_ok(value, hint), f.name, value, f"a value of type {_hint_name(hint)}")


@dataclass(frozen=True)
class KLPenalty:
    """KL(π‖π_ref) penalty added to the actor loss."""

    kind: str = "k3"
    """Estimator: one of KL_ESTIMATORS (k1, k2, k3)."""
    coef: float = 0.04
    """Weight of the per-token KL in the actor loss (DeepSeekMath GRPO: 0.04)."""

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.kind in KL_ESTIMATORS, "kl.kind", self.kind, ", ".join(KL_ESTIMATORS))
        _check(self.coef >= 0, "kl.coef", self.coef, ">= 0")


@dataclass(frozen=True)
class OverlongPenalty:
    """DAPO soft overlong punishment (see `overlong_penalty`)."""

    max_len: int = 20480
    """Length at which the penalty reaches −factor."""
    buffer_len: int = 4096
    """Length of the linear ramp before max_len."""
    factor: float = 1.0
    """Penalty at and beyond max_len (negated)."""

    def __post_init__(self) -> None:
        _check_types(self)
        _check(self.max_len > 0, "overlong.max_len", self.max_len, "> 0")
        _check(
            0 < self.buffer_len <= self.max_len,
            "overlong.buffer_len",
            self.buffer_len,
            f"in (0, max_len={self.max_len}]",
        )
        _check(self.factor >= 0, "overlong.factor", self.factor, ">= 0")


@dataclass(frozen=True, kw_only=True)
class AlgorithmRecipe:
    """Which algorithm pieces are on, and their hyperparameters."""

    name: str
    """Recipe name (a key of RECIPES, or a user's own)."""
    # --- advantages ---
    advantage_estimator: str
    """Key of ADVANTAGE_ESTIMATORS."""
    gamma: float = 1.0
    """Discount γ (GAE family)."""
    lam: float = 0.95
    """GAE λ for advantages (policy λ of decoupled GAE unless length-adaptive)."""
    lam_critic: float = 1.0
    """λ of the critic targets for decoupled_gae / egae (1.0 = Monte-Carlo)."""
    length_adaptive_alpha: float | None = None
    """VAPO α of λ_policy = 1 − 1/(α·l); None = fixed `lam`. decoupled_gae only."""
    norm_by_std: bool = True
    """grpo: divide by the group std (False = Dr. GRPO)."""
    group_fallback: float = 5.0
    """token_level_group_average: |A| at which a group falls back to GRPO."""
    whiten_advantages: bool = False
    """Whiten advantages over the batch's real tokens after estimation."""
    # --- critic ---
    use_critic: bool = False
    """Train a value model (required by the GAE-family estimators)."""
    value_clip: float | None = None
    """PPO value clip range c; None = unclipped value loss."""
    critic_lr_multiplier: float = 1.0
    """Critic learning rate = this × actor learning rate (VAPO: 2)."""
    value_warmup_steps: int = 0
    """Critic-only steps on Monte-Carlo returns from the frozen initial policy (VAPO: 50)."""
    # --- actor loss ---
    loss_agg: str = "token-mean"
    """Key of LOSS_AGGREGATIONS."""
    clip_low: float = 0.2
    """ε_low: ratio lower bound 1 − ε_low."""
    clip_high: float = 0.2
    """ε_high: ratio upper bound 1 + ε_high (Clip-Higher when > ε_low)."""
    clip_c: float | None = None
    """Dual-clip constant (> 1) for negative advantages; None = off."""
    kl: KLPenalty | None = None
    """KL penalty against the reference policy; None = no reference model at all."""
    positive_nll_coef: float = 0.0
    """μ of VAPO's positive-example NLL term (0 = off)."""
    distill_coef: float = 0.0
    """On-policy distillation: each response token's advantage gains distill_coef x
    (log π_teacher(y_t) − log π_old(y_t)), the negative of the sampled per-token reverse KL
    to the teacher (algorithm.teacher); 0 = off, no teacher. With advantage_estimator
    'none' it is the whole signal (recipe opd); beside another estimator, a term next to
    the reward's."""
    rollout_correction: RolloutCorrection | None = None
    """Weights of the per-token policy loss for the vLLM/Megatron mismatch (truncated or
    masked importance sampling, token masks); None = off. See rollout_correction.py."""
    # --- rollouts and rewards ---
    dynamic_sampling: bool = False
    """DAPO: drop groups with zero reward spread and refill the batch."""
    max_gen_batches: int = 10
    """Dynamic sampling: at most this many generation batches per training step."""
    overlong: OverlongPenalty | None = None
    """DAPO soft overlong punishment; None = off."""
    overlong_filter: bool = False
    """DAPO overlong filtering: responses that used up rollout.max_new_tokens are out of the
    policy loss (their reward still counts in their group's baseline; a critic still learns
    from them)."""
    generation_window: int | None = None
    """T-PPO: new tokens per sequence per step (paper: 8192 of 24K); None = whole response."""
    train_in_flight: bool = True
    """T-PPO: train each window the step it is generated (the paper: EGAE bootstraps the
    in-flight ones from the critic); False: a response's windows wait for its end and are
    trained together with its outcome (windowed generation, PPO's advantages)."""
    # --- HAPO (0 = off) ---
    temperature_tau: float = 0.0
    """τ of the adaptive sampling temperature T·(1 + τ·ĥ)."""
    entropy_clip_alpha: float = 0.0
    """α of the entropy-asymmetric clip bounds."""
    redistribution_beta: float = 0.0
    """β of the advantage redistribution A·(1 + β·ĥ)."""
    entropy_pivot_quantile: float = 0.8
    """Quantile of log-entropy used as ĥ's pivot."""

    def __post_init__(self) -> None:
        _check_types(self)
        self._check_advantages()
        self._check_losses()
        self._check_rollouts()

    def _check_advantages(self) -> None:
        estimators = ", ".join(ADVANTAGE_ESTIMATORS)
        _check(
            self.advantage_estimator in ADVANTAGE_ESTIMATORS,
            "advantage_estimator",
            self.advantage_estimator,
            estimators,
        )
        for name in ("gamma", "lam", "lam_critic"):
            value = getattr(self, name)
            _check(0.0 <= value <= 1.0, name, value, "[0, 1]")
        alpha = self.length_adaptive_alpha
        _check(alpha is None or alpha > 0, "length_adaptive_alpha", alpha, "None or > 0")
        _check(
            alpha is None or self.advantage_estimator == "decoupled_gae",
            "length_adaptive_alpha",
            alpha,
            "None unless advantage_estimator='decoupled_gae'",
        )
        _check(self.group_fallback > 0, "group_fallback", self.group_fallback, "> 0")
        needs_critic = self.advantage_estimator in CRITIC_ESTIMATORS
        _check(
            self.use_critic == needs_critic,
            "use_critic",
            self.use_critic,
            f"{needs_critic} for advantage_estimator={self.advantage_estimator!r}",
        )

    def _check_losses(self) -> None:
        for name in ("clip_low", "clip_high"):
            value = getattr(self, name)
            _check(0.0 < value < 1.0, name, value, "(0, 1)")
        _check(self.clip_c is None or self.clip_c > 1.0, "clip_c", self.clip_c, "None or > 1")
        _check(self.loss_agg in LOSS_AGGREGATIONS, "loss_agg", self.loss_agg, ", ".join(LOSS_AGGREGATIONS))
        _check(
            self.kl is None or isinstance(self.kl, KLPenalty),
            "kl",
            self.kl,
            "None, a KLPenalty or a dict of its fields",
        )
        _check(self.positive_nll_coef >= 0, "positive_nll_coef", self.positive_nll_coef, ">= 0")
        _check(math.isfinite(self.distill_coef) and self.distill_coef >= 0, "distill_coef", self.distill_coef, ">= 0")
        _check(
            self.advantage_estimator != "none" or self.distill_coef > 0,
            "distill_coef",
            self.distill_coef,
            "> 0 with advantage_estimator='none' (else nothing trains)",
        )
        _check(self.value_clip is None or self.value_clip > 0, "value_clip", self.value_clip, "None or > 0")
        _check(self.critic_lr_multiplier > 0, "critic_lr_multiplier", self.critic_lr_multiplier, "> 0")
        _check(self.value_warmup_steps >= 0, "value_warmup_steps", self.value_warmup_steps, ">= 0")
        _check(
            self.use_critic or self.value_warmup_steps == 0,
            "value_warmup_steps",
            self.value_warmup_steps,
            "0 when use_critic is False",
        )
        _check(
            self.use_critic or self.value_clip is None, "value_clip", self.value_clip, "None when use_critic is False"
        )

    def _check_rollouts(self) -> None:
        _check(self.max_gen_batches >= 1, "max_gen_batches", self.max_gen_batches, ">= 1")
        _check(
            self.overlong is None or isinstance(self.overlong, OverlongPenalty),
            "overlong",
            self.overlong,
            "None, an OverlongPenalty or a dict of its fields",
        )
        window = self.generation_window
        _check(window is None or window >= 1, "generation_window", window, "None or >= 1")
        # A cut-off response treated as finished would be scored as if it had ended.
        _check(
            window is None or self.advantage_estimator == "egae",
            "generation_window",
            window,
            "None unless advantage_estimator='egae'",
        )
        _check(
            window is not None or self.train_in_flight,
            "train_in_flight",
            self.train_in_flight,
            "True unless generation_window is set",
        )
        _check(0.0 <= self.temperature_tau < 1.0, "temperature_tau", self.temperature_tau, "[0, 1)")
        for name in ("entropy_clip_alpha", "redistribution_beta"):
            _check(getattr(self, name) >= 0, name, getattr(self, name), ">= 0")
        _check(0.0 < self.entropy_pivot_quantile < 1.0, "entropy_pivot_quantile", self.entropy_pivot_quantile, "(0, 1)")

    @property
    def token_aware(self) -> bool:
        """True when any HAPO entropy piece is on (the trainer then computes ĥ)."""
        pieces = (self.entropy_clip_alpha, self.redistribution_beta, self.temperature_tau)
        return any(value > 0 for value in pieces)

    def advantage_inputs(self, response_mask: Tensor, **tensors: Tensor) -> AdvantageInputs:
        """AdvantageInputs carrying this recipe's hyperparameters and the given tensors
        (token_rewards, seq_rewards, values, group_index, lengths, truncated)."""
        return AdvantageInputs(
            response_mask=response_mask,
            gamma=self.gamma,
            lam=self.lam,
            lam_critic=self.lam_critic,
            length_adaptive_alpha=self.length_adaptive_alpha,
            norm_by_std=self.norm_by_std,
            fallback=self.group_fallback,
            whiten=self.whiten_advantages,
            **tensors,
        )


RECIPES: dict[str, AlgorithmRecipe] = {
    # PPO (Ouyang et al. / verl defaults): GAE γ = 1, λ = 0.95 for policy and critic.
    "ppo": AlgorithmRecipe(
        name="ppo",
        advantage_estimator="gae",
        lam=0.95,
        lam_critic=0.95,
        whiten_advantages=True,
        use_critic=True,
        loss_agg="seq-mean-token-mean",
    ),
    # GRPO (DeepSeekMath): group-normalised outcome reward; KL k3 optional, off here.
    "grpo": AlgorithmRecipe(
        name="grpo",
        advantage_estimator="grpo",
        loss_agg="seq-mean-token-mean",
    ),
    # DAPO: Clip-Higher 0.2/0.28, token-level loss, dynamic sampling, soft overlong, no KL.
    "dapo": AlgorithmRecipe(
        name="dapo",
        advantage_estimator="grpo",
        loss_agg="token-mean",
        clip_low=0.2,
        clip_high=0.28,
        dynamic_sampling=True,
        overlong=OverlongPenalty(max_len=20480, buffer_len=4096, factor=1.0),
    ),
    # VAPO: decoupled GAE (λ_critic 1, length-adaptive λ_policy α = 0.05), value
    # pretraining 50 steps, critic lr 2×, positive-example NLL μ = 0.1.
    "vapo": AlgorithmRecipe(
        name="vapo",
        advantage_estimator="decoupled_gae",
        lam_critic=1.0,
        length_adaptive_alpha=0.05,
        use_critic=True,
        value_warmup_steps=50,
        critic_lr_multiplier=2.0,
        loss_agg="token-mean",
        clip_low=0.2,
        clip_high=0.28,
        positive_nll_coef=0.1,
    ),
    # T-PPO: EGAE on an 8K window of a 24K budget; critic on finished rows, MC targets.
    "tppo": AlgorithmRecipe(
        name="tppo",
        advantage_estimator="egae",
        lam=0.95,
        lam_critic=1.0,
        use_critic=True,
        loss_agg="token-mean",
        clip_low=0.2,
        clip_high=0.28,
        generation_window=8192,
    ),
    # HAPO: token-level group average, adaptive temperature τ = 0.05, entropy-asymmetric
    # clip α = 1, redistribution β = 1, dual clip 10, dynamic sampling.
    "hapo": AlgorithmRecipe(
        name="hapo",
        advantage_estimator="token_level_group_average",
        loss_agg="token-mean",
        clip_low=0.2,
        clip_high=0.2,
        clip_c=10.0,
        dynamic_sampling=True,
        temperature_tau=0.05,
        entropy_clip_alpha=1.0,
        redistribution_beta=1.0,
    ),
    # On-policy distillation (Agarwal et al. GKD; Thinking Machines' OPD): the student samples,
    # a teacher scores each sampled token, the per-token reverse KL is the advantage.
    "opd": AlgorithmRecipe(
        name="opd",
        advantage_estimator="none",
        distill_coef=1.0,
        loss_agg="token-mean",
        clip_low=0.2,
        clip_high=0.2,
    ),
}


def _coerce(key: str, value: Any) -> Any:
    """YAML gives dicts for the nested settings; build the dataclass (keys validated)."""
    nested = {"kl": KLPenalty, "overlong": OverlongPenalty, "rollout_correction": RolloutCorrection}
    if key in nested and isinstance(value, dict):
        allowed = {f.name for f in dataclasses.fields(nested[key])}
        unknown = sorted(set(value) - allowed)
        if unknown:
            listed = ", ".join(sorted(allowed))
            raise ValueError(f"unknown key {key}.{unknown[0]}; allowed: {listed}")
        return nested[key](**value)
    return value


def get_recipe(name: str, **overrides: Any) -> AlgorithmRecipe:
    """The named recipe with `overrides` applied, validated.

    Unknown recipe names and unknown override keys raise one ValueError naming the key
    and listing the allowed ones; bad values raise from the recipe's validation.
    """
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; valid: {', '.join(RECIPES)}")
    allowed = [f.name for f in dataclasses.fields(AlgorithmRecipe) if f.name != "name"]
    for key in overrides:
        if key not in allowed:
            raise ValueError(f"unknown recipe key {key!r}; allowed: {', '.join(allowed)}")
    coerced = {key: _coerce(key, value) for key, value in overrides.items()}
    return dataclasses.replace(RECIPES[name], **coerced)
