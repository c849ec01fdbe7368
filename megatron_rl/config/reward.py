"""The ``reward`` section: the scorers a response's reward is the weighted sum of.

Without scorers the reward is ``data.reward`` alone. With them, each
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
import string
from typing import Optional

from megatron_rl.config.errors import ConfigError

RULE = "rule"
MODEL = "model"
JUDGE = "judge"
SCORER_KINDS = (RULE, MODEL, JUDGE)
"""Scorer kinds: a rule verifier (rewards.REWARDS), a trained scalar reward model, an LLM judge."""
MEGATRON = "megatron"
VLLM = "vllm"
MODEL_ENGINES = (MEGATRON, VLLM)
"""Where a model scorer runs: a Megatron forward in the actor's layout, or a vLLM engine of its own."""
BASE = "base"
"""A judge's ``path`` that names the run's own base model (the policy's starting weights)."""
DEFAULT_TEMPLATE = (
    "Question: {question}\nResponse: {response}\nIs the response a correct answer to the question? Answer yes or no."
)
DEFAULT_VERDICT = r"(?i)\b(yes|no)\b"
TEMPLATE_FIELDS = ("question", "response", "reference")
"""A judge template's placeholders: the prompt's text, the response, the reference answer."""
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclasses.dataclass(kw_only=True)
class ScorerConfig:
    """One named scorer."""

    kind: str = ""
    """rule: a verifier by name (``reward``); model: a reward model trained by
    algorithm.recipe=reward_model (``path``), run where ``engine`` says."""
    weight: float = 1.0
    """Its share of the reward: reward = sum of weight x score over the scorers. 0: scored and
    logged (reward/<name>/mean, and a model's agreement with the rule), never trained on."""
    reward: str = "auto"
    """rule only: the verifier's name (math, digits, digit_chain, reasoning_gym); auto: data.reward's."""
    path: Optional[str] = None
    """model: the reward model's run directory (its checkpoints/ are read) or a checkpoints
    directory itself; judge: the judge's HF directory, or ``base`` for the run's own base."""
    step: Optional[int] = None
    """model only: the checkpoint step to load (null: the newest committed one)."""
    engine: str = MEGATRON
    """model only: megatron, a forward in the actor's layout on every rank (colocated, every
    score on every rank at once); vllm, the reward model exported to HF and served by a
    vLLM engine in a worker process beside rank 0, which scores each group as it finishes
    while the rest still generate (timeout_s, batch_size, on_malformed and
    gpu_memory_utilization then apply)."""
    missing_eos_penalty: float = 0.0
    """model only: subtracted from the model's score of a response that ran out of budget
    before its end of turn. A reward model trained on finished conversations has never seen
    an unfinished one, and a policy can find cut-off answers it scores high (as TRL's
    missing_eos_penalty)."""
    template: str = DEFAULT_TEMPLATE
    """judge only: the judge's prompt, with {question} (the prompt's text), {response} and
    optionally {reference} (the prompt's reference answer); write a literal brace as {{ or }}."""
    verdict_pattern: str = DEFAULT_VERDICT
    """judge only: a regular expression whose first group, at its first match in the judge's
    answer, is the verdict."""
    verdict_scores: dict = dataclasses.field(default_factory=lambda: {"yes": 1.0, "no": 0.0})
    """judge only: verdict (lower-cased) -> score; empty: the verdict is read as a number."""
    on_malformed: float = 0.0
    """judge, and model on vllm: the score of a response whose verdict cannot be read (a
    reward model's: a score that is not a finite number), or whose scoring failed or ran
    out of time (each counted in reward/<name>/failures)."""
    timeout_s: float = 60.0
    """judge, and model on vllm: the longest one batch may take (its responses then score
    on_malformed); start-up does not count."""
    max_new_tokens: int = 8
    """judge only: the judge's answer budget (greedy)."""
    batch_size: int = 64
    """judge, and model on vllm: responses per request to the scorer's engine (a timeout costs a batch)."""
    gpu_memory_utilization: float = 0.15
    """judge, and model on vllm, GPU: the share of rank 0's GPU the scorer's engine takes for
    its weights and KV cache, beside the policy's colocated engine and training (untested on GPUs)."""

    def __post_init__(self) -> None:
        if self.kind not in SCORER_KINDS:
            raise ConfigError(f"kind={self.kind!r} is not a scorer kind; allowed: {list(SCORER_KINDS)}")
        if not math.isfinite(self.weight):
            raise ConfigError(f"weight={self.weight!r} must be a finite number")
        if self.kind == MODEL and not self.path:
            raise ConfigError("path must name the reward model's run directory (kind: model)")
        if self.kind == JUDGE and not self.path:
            raise ConfigError(f"path must name the judge's HF directory, or {BASE} for the run's base (kind: judge)")
        misplaced = _misplaced(self)
        if misplaced:
            raise ConfigError(f"{misplaced[0]} does not apply to kind: {self.kind}")
        if not math.isfinite(self.missing_eos_penalty):
            raise ConfigError(f"missing_eos_penalty={self.missing_eos_penalty!r} must be a finite number")
        if self.step is not None and self.step < 1:
            raise ConfigError(f"step={self.step} must be >= 1 (or null: the newest)")
        if self.kind == MODEL and self.engine not in MODEL_ENGINES:
            raise ConfigError(f"engine={self.engine!r} is not allowed; choose one of {list(MODEL_ENGINES)}")
        if self.kind == JUDGE:
            _check_judge(self)
        if self.kind == JUDGE or self.engine == VLLM:
            _check_served(self)


SERVED = {"on_malformed", "timeout_s", "batch_size", "gpu_memory_utilization"}
"""The fields of a scorer served by an engine in a worker process (a judge, a model on vllm)."""
_APPLIES = {
    RULE: {"reward"},
    MODEL: {"path", "step", "engine", "missing_eos_penalty"},
    JUDGE: {"path", "template", "verdict_pattern", "verdict_scores", "max_new_tokens", *SERVED},
}  # fmt: skip
"""The kind-specific fields each kind reads (kind and weight apply to all; a model on vllm
reads SERVED too)."""


def _misplaced(scorer: ScorerConfig) -> list[str]:
    """Fields set away from their defaults that the scorer's kind does not read."""
    applies = _APPLIES[scorer.kind] | (SERVED if scorer.kind == MODEL and scorer.engine == VLLM else set())
    names = []
    for f in dataclasses.fields(ScorerConfig):
        if f.name in ("kind", "weight") or f.name in applies:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if getattr(scorer, f.name) != default:
            names.append(f.name)
    return names


def _check_judge(scorer: ScorerConfig) -> None:
    """The template's placeholders, the verdict's pattern and scores, the limits."""
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(scorer.template) if name is not None}
    except ValueError as err:
        raise ConfigError(f"template is not a valid template ({err}); write a literal brace as {{{{ or }}}}") from None
    unknown = sorted(fields - set(TEMPLATE_FIELDS))
    if unknown:
        raise ConfigError(f"template has the placeholder {{{unknown[0]}}}; allowed: {list(TEMPLATE_FIELDS)}")
    missing = [name for name in ("question", "response") if name not in fields]
    if missing:
        raise ConfigError(f"template has no {{{missing[0]}}}: a judge must see the question and the response")
    try:
        groups = re.compile(scorer.verdict_pattern).groups
    except re.error as err:
        raise ConfigError(f"verdict_pattern={scorer.verdict_pattern!r} is not a regular expression: {err}") from None
    if groups < 1:
        raise ConfigError(f"verdict_pattern={scorer.verdict_pattern!r} needs a group ( ... ): the verdict it captures")
    if not isinstance(scorer.verdict_scores, dict):
        raise ConfigError(f"verdict_scores must be a mapping of verdicts to scores, got {scorer.verdict_scores!r}")
    keys = [k for k in scorer.verdict_scores if not isinstance(k, str)]
    if keys:  # YAML reads an unquoted yes/no as a boolean
        raise ConfigError(f"verdict_scores key {keys[0]!r} is not a string: quote it, e.g. 'yes': 1")
    bad = [k for k, v in scorer.verdict_scores.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
    if bad:
        raise ConfigError(f"verdict_scores[{bad[0]!r}]={scorer.verdict_scores[bad[0]]!r} must be a number")


def _check_served(scorer: ScorerConfig) -> None:
    """The settings of a scorer served in a worker process: its failure score and limits."""
    if not math.isfinite(scorer.on_malformed):
        raise ConfigError(f"on_malformed={scorer.on_malformed!r} must be a finite number")
    if not 0 < scorer.gpu_memory_utilization < 1:
        raise ConfigError(f"gpu_memory_utilization={scorer.gpu_memory_utilization} must be in (0, 1)")
    if not scorer.timeout_s > 0 or scorer.max_new_tokens < 1 or scorer.batch_size < 1:
        raise ConfigError(
            f"timeout_s={scorer.timeout_s}, max_new_tokens={scorer.max_new_tokens} and batch_size="
            f"{scorer.batch_size} must be > 0"
        )


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
