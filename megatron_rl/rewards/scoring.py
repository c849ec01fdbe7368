"""A response's reward from several scorers: the weighted sum, and what each one said.

A scorer is anything with ``score(responses) -> ScorerOutput`` and ``close()``: a rule
verifier (:class:`RuleScorer`), a reward model (trainer.reward_scorers: it needs the
model's layout, so it lives with the trainer). :class:`WeightedReward` calls each in turn
and keeps summable counts in its stats (a step may score several generation batches, as
DAPO's dynamic sampling does); :func:`reward_metrics` turns the step's sums into
``reward/<name>/mean``, ``reward/<name>/failures``, ``reward/<name>/agreement`` and
``timing/reward_s``; with a served scorer (a judge's engine in a process of its own) also
``timing/reward_hidden_s`` and ``timing/reward_hidden_share``: how much of its time passed
while the batch still generated (trainer.overlapped_scoring starts it on each group as the
group finishes).

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

    def part(self, start: int, stop: int) -> "Responses":
        """Responses ``start`` to ``stop`` (one group of a batch)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return Responses(**{k: list(v[start:stop]) if v else v for k, v in fields.items()})

    @classmethod
    def joined(cls, parts: Sequence["Responses"]) -> "Responses":
        """``parts`` one after another (groups as one batch)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{k: [x for p in parts for x in getattr(p, k)] for k in names})


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
    scorer: Optional[Scorer]
    """None on the ranks a served scorer does not live on (its scores reach them by ``share``)."""
    weight: float
    is_rule: bool
    served: bool = False
    """Served by a process of its own (a judge's engine), beside rank 0 alone: it can score
    a batch's groups while the rest still generate (:class:`Prescored`)."""


@dataclasses.dataclass
class Prescored:
    """What the served scorers said of a batch before it reached :meth:`WeightedReward.score_batch`
    (trainer.overlapped_scoring: groups scored as they finished)."""

    outputs: dict[str, ScorerOutput]
    busy_s: float
    """Seconds the served scorers spent on the batch."""
    hidden_s: float
    """Of those, the seconds spent while the batch was still generating."""


def _identity(outputs: dict) -> dict:
    return outputs


_TIMING = " timing"
"""The key the served scorers' seconds travel under beside their outputs (no scorer's name has a space)."""


class WeightedReward:
    """reward = sum of weight x score over ``scorers``; each one's scores kept as stats.

    ``score_batch`` has the trainer's scoring signature: (rewards, stats), stats summable
    over the batches of a step. The first rule scorer is what the others' agreement is
    measured against. ``share`` hands the served scorers' outputs (on the rank that has
    them) to every rank: a collective every rank calls in every ``score_batch``.
    """

    def __init__(self, scorers: Sequence[WeightedScorer], share=_identity):
        if not scorers:
            raise ValueError("a WeightedReward needs at least one scorer")
        self.scorers = list(scorers)
        self.share = share
        rules = [s for s in self.scorers if s.is_rule]
        self.rule: Optional[WeightedScorer] = rules[0] if rules else None
        self.served = [s for s in self.scorers if s.served]

    def score_served(self, responses: Responses) -> dict[str, ScorerOutput]:
        """The served scorers' outputs where they live (none elsewhere)."""
        return {s.name: s.scorer.score(responses) for s in self.served if s.scorer is not None}

    def score_batch(self, responses: Responses, prescored: Optional[Prescored] = None) -> tuple[list[float], dict]:
        started = time.perf_counter()
        if prescored is None:
            prescored = Prescored(self.score_served(responses), 0.0, 0.0)
            prescored.busy_s = time.perf_counter() - started
        busy_s = hidden_s = 0.0
        outputs: dict = {}
        if self.served:  # one collective: the outputs and the time they took, as rank 0 measured it
            outputs = self.share({**prescored.outputs, _TIMING: ScorerOutput([prescored.busy_s, prescored.hidden_s])})
            busy_s, hidden_s = outputs.pop(_TIMING).scores
        local_started = time.perf_counter()
        outputs.update({s.name: s.scorer.score(responses) for s in self.scorers if not s.served})
        local_s = time.perf_counter() - local_started
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
        stats["timing/reward_s"] = local_s + busy_s
        if self.served:
            stats["timing/reward_served_s"] = busy_s
            stats["timing/reward_hidden_s"] = hidden_s
        return total, stats

    def close(self) -> None:
        for s in self.scorers:
            if s.scorer is not None:
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
    reward/<name>/agreement (nan when no pair of responses was told apart by the rule),
    timing/reward_s and, with served scorers, timing/reward_hidden_s and
    timing/reward_hidden_share (of the served scorers' seconds, the share spent while the
    batch was still generating)."""
    metrics = {}
    if "timing/reward_s" in stats:
        metrics["timing/reward_s"] = stats["timing/reward_s"]
    if "timing/reward_hidden_s" in stats:
        hidden, served = stats["timing/reward_hidden_s"], stats["timing/reward_served_s"]
        metrics["timing/reward_hidden_s"] = hidden
        metrics["timing/reward_hidden_share"] = hidden / served if served else float("nan")
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
