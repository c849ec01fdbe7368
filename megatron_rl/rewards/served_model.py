"""A reward model served in a worker process: each response's conversation ids scored by a
vLLM pooling engine (rewards.vllm_reward_model.RewardModelWorker) in a
:class:`~megatron_rl.rewards.timed_pool.TimedWorkerPool`.

Served, the model scores groups while the rest of the batch still generates
(trainer.overlapped_scoring), and a model that hangs or dies costs its batch alone: the
batch's responses score ``on_failure``, are counted as failures, the worker is replaced
and the step goes on. A score that is not a finite number is a failure too: NaN in an
advantage would poison the whole step.
"""

from __future__ import annotations

import math
from typing import Optional

from megatron_rl.rewards.judge import JudgePool
from megatron_rl.rewards.scoring import Responses, ScorerOutput, penalize_unfinished


class ServedModelScorer:
    """Scores responses with the reward model behind ``pool`` (items: one list of token id
    lists each, results: one score per list)."""

    def __init__(self, pool: JudgePool, batch_size: int, on_failure: float, missing_eos_penalty: float = 0.0):
        self.pool, self.batch_size = pool, batch_size
        self.on_failure, self.missing_eos_penalty = float(on_failure), missing_eos_penalty

    def score(self, responses: Responses) -> ScorerOutput:
        rows = [list(p) + list(r) for p, r in zip(responses.prompt_ids, responses.response_ids)]
        batches = [rows[i : i + self.batch_size] for i in range(0, len(rows), self.batch_size)]
        values: list[Optional[float]] = []
        for batch, result in zip(batches, self.pool.map([(batch,) for batch in batches])):
            values += _scores(result.value, len(batch)) if result.status == "ok" else [None] * len(batch)
        failures = sum(v is None for v in values)
        scores = [self.on_failure if v is None else v for v in values]
        penalized = penalize_unfinished(scores, responses.truncated, self.missing_eos_penalty)
        # a failed response scores on_failure as configured, never less a penalty
        return ScorerOutput([s if v is None else p for s, p, v in zip(scores, penalized, values)], failures)

    def close(self) -> None:
        self.pool.close()


def _scores(value: object, n: int) -> list[Optional[float]]:
    """A worker's answer for ``n`` rows: each finite number kept, anything else None."""
    if not isinstance(value, list) or len(value) != n:
        return [None] * n
    return [float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None for v in value]
