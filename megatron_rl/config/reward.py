"""The ``reward`` section: the scorers a response's reward is the weighted sum of.

Without scorers the reward is ``data.reward`` alone, as it always was. With them, each
named scorer scores every response and the reward is the weighted sum; each scorer's
mean is logged as ``reward/<name>/mean`` beside ``reward/mean``. A scorer of weight 0 is
scored and logged but does not train: a rule verifier kept at weight 0 beside a reward
model shows, step by step, whether the policy is learning the task or gaming the model.
Evaluation sets are scored by ``data.reward`` (the rule), whatever the scorers are.

(Errors name the field alone; the loader puts ``reward.scorers.<name>.`` before them.)
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

from megatron_rl.config.errors import ConfigError

RULE = "rule"
MODEL = "model"
SCORER_KINDS = (RULE, MODEL)
"""Scorer kinds: a rule verifier (rewards.REWARDS), a trained scalar reward model."""
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclasses.dataclass(kw_only=True)
class ScorerConfig:
    """One named scorer."""

    kind: str = ""
    """rule: a verifier by name (``reward``); model: a reward model trained by
    algorithm.recipe=reward_model (``path``), run as a Megatron forward in the actor's layout."""
    weight: float = 1.0
    """Its share of the reward: reward = sum of weight x score over the scorers. 0: scored and
    logged (reward/<name>/mean, and a model's agreement with the rule), never trained on."""
    reward: str = "auto"
    """rule only: the verifier's name (math, digits, digit_chain, reasoning_gym); auto: data.reward's."""
    path: Optional[str] = None
    """model only: the reward model's run directory (its checkpoints/ are read) or a checkpoints
    directory itself."""
    step: Optional[int] = None
    """model only: the checkpoint step to load (null: the newest committed one)."""

    def __post_init__(self) -> None:
        if self.kind not in SCORER_KINDS:
            raise ConfigError(f"kind={self.kind!r} is not a scorer kind; allowed: {list(SCORER_KINDS)}")
        if not math.isfinite(self.weight):
            raise ConfigError(f"weight={self.weight!r} must be a finite number")
        if self.kind == MODEL and not self.path:
            raise ConfigError("path must name the reward model's run directory (kind: model)")
        misplaced = {
            RULE: [("path", self.path, None), ("step", self.step, None)],
            MODEL: [("reward", self.reward, "auto")],
        }[self.kind]
        for name, value, default in misplaced:
            if value != default:
                raise ConfigError(f"{name} does not apply to kind: {self.kind}")
        if self.step is not None and self.step < 1:
            raise ConfigError(f"step={self.step} must be >= 1 (or null: the newest)")


@dataclasses.dataclass(kw_only=True)
class RewardConfig:
    """How a response's reward is made (empty: data.reward alone)."""

    scorers: dict[str, ScorerConfig] = dataclasses.field(default_factory=dict)
    """Scorers by name (letters, digits, _ . -), e.g. {rm: {kind: model, path: runs/reward_model},
    verifier: {kind: rule, weight: 0}}."""

    def __post_init__(self) -> None:
        bad = [name for name in self.scorers if not _NAME.fullmatch(name)]
        if bad:
            raise ConfigError(f"reward.scorers name {bad[0]!r} must be letters, digits, '_', '.' or '-'")
        if self.scorers and not any(s.weight for s in self.scorers.values()):
            raise ConfigError(
                "reward.scorers: every weight is 0, so nothing would be trained on; give one scorer a nonzero weight"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.scorers)
