"""A response's reward from several scorers: the weighted sum, and what each one said.

A scorer is anything with ``score(responses) -> ScorerOutput`` and ``close()``: a rule
verifier (:class:`RuleScorer`), a reward model (trainer.reward_scorers: it needs the
model's layout, so it lives with the trainer). :class:`WeightedReward` calls each in turn
and keeps summable counts in its stats (a step may score several generation batches, as
DAPO's dynamic sampling does); :func:`reward_metrics` turns the step's sums into
``reward/<name>/mean``, ``reward/<name>/failures``, ``reward/<name>/agreement`` and
``timing/reward_s``.

**Agreement** of a scorer with the rule: over the pairs of responses to one prompt that
the rule tells apart (one right, one wrong), the share the scorer orders the same way
(a tie counts half). It needs no threshold on the scorer's scale, it is what a group's
advantages are made of, and it falls when the policy finds answers the model scores
above the right ones: a reward model being gamed shows here.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Protocol, Sequence

from megatron_rl.rewards.registry import Verifier


@dataclasses.dataclass(frozen=True)
class Responses:
    """What the scorers read of a batch of responses (policy token ids and decoded text)."""

    texts: Sequence[str]
    answers: Sequence[str]
    """The reference answer of each response's prompt (what a rule checks against)."""
    prompt_ids: Sequence[Sequence[int]]
    response_ids: Sequence[Sequence[int]]
    questions: Sequence[str] = ()
    """The prompts' text (what a judge is shown); empty: the prompts' ids alone."""
    truncated: Sequence[bool] = ()
    """Whether each response ran out of budget before its end of turn; empty: none did."""

    def __post_init__(self) -> None:
        sizes = {len(self.texts), len(self.answers), len(self.prompt_ids), len(self.response_ids)}
        for optional in (self.questions, self.truncated):
            if optional:
                sizes.add(len(optional))
        if len(sizes) != 1:
            raise ValueError(f"Responses fields differ in length: {sorted(sizes)}")

    def __len__(self) -> int:
        return len(self.texts)


@dataclasses.dataclass(frozen=True)
class ScorerOutput:
    scores: list[float]
    failures: int = 0
    """Responses the scorer could not score (a timeout, a malformed verdict): scored as it is
    configured to score them, and counted."""


class Scorer(Protocol):
    def score(self, responses: Responses) -> ScorerOutput: ...

    def close(self) -> None: ...


class RuleScorer:
    """A verifier (rewards.REWARDS) as a scorer: its timeouts are its failures. A borrowed
    verifier (``owns_verifier`` false) is left open for its owner to close."""

    def __init__(self, verifier: Verifier, owns_verifier: bool = True):
        self.verifier = verifier
        self.owns_verifier = owns_verifier

    def score(self, responses: Responses) -> ScorerOutput:
        scores, stats = self.verifier.score_batch(list(responses.texts), list(responses.answers))
        return ScorerOutput(list(map(float, scores)), int(stats.get("timeouts", 0)) + int(stats.get("errors", 0)))

    def close(self) -> None:
        if self.owns_verifier:
            self.verifier.close()


@dataclasses.dataclass(frozen=True)
class WeightedScorer:
    name: str
    scorer: Scorer
    weight: float
    is_rule: bool


class WeightedReward:
    """reward = sum of weight x score over ``scorers``; each one's scores kept as stats.

    ``score_batch`` has the trainer's scoring signature: (rewards, stats), stats summable
    over the batches of a step. The first rule scorer is what the others' agreement is
    measured against.
    """

    def __init__(self, scorers: Sequence[WeightedScorer]):
        if not scorers:
            raise ValueError("a WeightedReward needs at least one scorer")
        self.scorers = list(scorers)
        rules = [s for s in self.scorers if s.is_rule]
        self.rule: Optional[WeightedScorer] = rules[0] if rules else None

    def score_batch(self, responses: Responses) -> tuple[list[float], dict]:
        started = time.perf_counter()
        outputs = {s.name: s.scorer.score(responses) for s in self.scorers}
        total = [0.0] * len(responses)
        stats: dict = {}
        for s in self.scorers:
            out = outputs[s.name]
            if len(out.scores) != len(responses):
                raise RuntimeError(
                    f"scorer {s.name!r} returned {len(out.scores)} scores for {len(responses)} responses"
                )
            total = [t + s.weight * v for t, v in zip(total, out.scores)]
            stats[f"reward/{s.name}/sum"] = sum(out.scores)
            stats[f"reward/{s.name}/count"] = len(out.scores)
            stats[f"reward/{s.name}/failures"] = out.failures
            if self.rule is not None and not s.is_rule:
                hits, pairs = ordered_pairs(outputs[self.rule.name].scores, out.scores, responses.prompt_ids)
                stats[f"reward/{s.name}/agreement_hits"] = hits
                stats[f"reward/{s.name}/agreement_pairs"] = pairs
        stats["timing/reward_s"] = time.perf_counter() - started
        return total, stats

    def close(self) -> None:
        for s in self.scorers:
            s.scorer.close()


class SingleRule:
    """No reward section: data.reward's verifier alone, its scores unweighted, and the time it took."""

    def __init__(self, verifier: Verifier):
        self.verifier = verifier

    def score_batch(self, responses: Responses) -> tuple[list[float], dict]:
        started = time.perf_counter()
        scores, _ = self.verifier.score_batch(list(responses.texts), list(responses.answers))
        return list(scores), {"timing/reward_s": time.perf_counter() - started}

    def close(self) -> None:
        pass  # the verifier is the run's (eval shares it); its owner closes it


def penalize_unfinished(scores: Sequence[float], truncated: Sequence[bool], penalty: float) -> list[float]:
    """``scores`` less ``penalty`` where a response ran out of budget (``truncated`` empty: none did)."""
    if not truncated:
        return list(scores)
    return [s - penalty * bool(cut) for s, cut in zip(scores, truncated, strict=True)]


def ordered_pairs(rule: Sequence[float], other: Sequence[float], prompts: Sequence[Sequence[int]]) -> tuple[float, int]:
    """(hits, pairs): over pairs of responses to the same prompt with different rule scores,
    how many ``other`` orders as the rule does (a tie in ``other`` is half a hit)."""
    by_prompt: dict[tuple, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_prompt.setdefault(tuple(prompt), []).append(i)
    hits, pairs = 0.0, 0
    for members in by_prompt.values():
        for a_pos, a in enumerate(members):
            for b in members[a_pos + 1 :]:
                if rule[a] == rule[b]:
                    continue
                pairs += 1
                same_order = (rule[a] - rule[b]) * (other[a] - other[b])
                hits += 1.0 if same_order > 0 else 0.5 if other[a] == other[b] else 0.0
    return hits, pairs


def reward_metrics(stats: dict) -> dict:
    """A step's summed scoring stats as metrics: reward/<name>/mean, reward/<name>/failures,
    reward/<name>/agreement (nan when no pair of responses was told apart by the rule) and
    timing/reward_s."""
    metrics = {}
    if "timing/reward_s" in stats:
        metrics["timing/reward_s"] = stats["timing/reward_s"]
    for key in stats:
        if not key.endswith("/count"):
            continue
        prefix = key[: -len("/count")]
        count = stats[key]
        metrics[f"{prefix}/mean"] = stats[f"{prefix}/sum"] / count if count else float("nan")
        metrics[f"{prefix}/failures"] = stats[f"{prefix}/failures"]
        if f"{prefix}/agreement_pairs" in stats:
            pairs = stats[f"{prefix}/agreement_pairs"]
            metrics[f"{prefix}/agreement"] = stats[f"{prefix}/agreement_hits"] / pairs if pairs else float("nan")
    return metrics
