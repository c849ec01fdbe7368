"""An LLM judge as a scorer: each response rendered into the judge's prompt, its verdict
parsed into a score.

The judge runs in a worker process of a :class:`~megatron_rl.rewards.timed_pool.TimedWorkerPool`
(megatron_rl.rollout.judge builds its vLLM engine there), one batch of prompts per item:
a judge that hangs costs at most ``timeout_s`` per batch and is replaced, one that dies is
replaced, and either way the batch's responses score ``on_malformed`` and are counted as
failures, as is every verdict the pattern cannot read. The step goes on.
"""

from __future__ import annotations

import re
from typing import Optional, Protocol, Sequence

from megatron_rl.rewards.scoring import Responses, ScorerOutput
from megatron_rl.rewards.timed_pool import ItemResult


class JudgePool(Protocol):
    def map(self, items: Sequence[Sequence]) -> list[ItemResult]: ...

    def close(self) -> None: ...


class Verdicts:
    """The first group of ``pattern``'s first match -> a score (``scores``, lower-cased keys),
    or read as a number when ``scores`` is empty; None when it cannot be read."""

    def __init__(self, pattern: str, scores: dict):
        self.pattern = re.compile(pattern)
        self.scores = {str(k).lower(): float(v) for k, v in scores.items()}

    def score(self, answer: str) -> Optional[float]:
        match = self.pattern.search(answer)
        if match is None or match.group(1) is None:
            return None
        verdict = match.group(1).strip()
        if self.scores:
            return self.scores.get(verdict.lower())
        try:
            return float(verdict)
        except ValueError:
            return None


class JudgeScorer:
    """Scores responses with a judge served by ``pool`` (items: one list of prompts each,
    results: one answer string per prompt)."""

    def __init__(self, pool: JudgePool, template: str, verdicts: Verdicts, on_malformed: float, batch_size: int):
        self.pool, self.template, self.verdicts = pool, template, verdicts
        self.on_malformed, self.batch_size = float(on_malformed), batch_size

    def prompts(self, responses: Responses) -> list[str]:
        return [
            self.template.format(question=q, response=r, reference=a)
            for q, r, a in zip(responses.questions, responses.texts, responses.answers)
        ]

    def score(self, responses: Responses) -> ScorerOutput:
        prompts = self.prompts(responses)
        batches = [prompts[i : i + self.batch_size] for i in range(0, len(prompts), self.batch_size)]
        answers: list[Optional[str]] = []
        for batch, result in zip(batches, self.pool.map([(batch,) for batch in batches])):
            ok = result.status == "ok" and isinstance(result.value, list) and len(result.value) == len(batch)
            answers += [str(a) for a in result.value] if ok else [None] * len(batch)
        scores, failures = [], 0
        for answer in answers:
            score = None if answer is None else self.verdicts.score(answer)
            failures += score is None
            scores.append(self.on_malformed if score is None else score)
        return ScorerOutput(scores, failures)

    def close(self) -> None:
        self.pool.close()
