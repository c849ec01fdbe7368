"""A reward whose scorer runs in the killable worker pool and reports what happened.

The worker returns ``(score, outcome kind)``; a verifier counts each outcome kind other
than ``"ok"``, the pool's timeouts and errors (which score 0), and the correct answers, per
batch and over its life (``totals``). The math and reasoning-gym rewards differ only in
their worker, its warm-up call, their outcome kinds and what counts as correct.
"""

from __future__ import annotations

from typing import Any, Sequence

from megatron_rl.rewards.timed_pool import TimedWorkerPool

OK = "ok"
"""The outcome kind of a response that was scored normally."""


class PooledVerifier:
    def __init__(
        self,
        worker: str,
        warmup_args: tuple,
        stat_keys: Sequence[str],
        *,
        timeout_s: float,
        num_workers: int,
    ):
        self._pool = TimedWorkerPool(worker, num_workers=num_workers, timeout_s=timeout_s, warmup_args=warmup_args)
        self.stat_keys = tuple(stat_keys)
        self.totals = dict.fromkeys(self.stat_keys, 0)

    def is_correct(self, score: float) -> bool:
        raise NotImplementedError

    def score_batch(self, responses: Sequence[str], answers: Sequence[str]) -> tuple[list[float], dict[str, int]]:
        """Scores (one float per response) and counts of each outcome in this batch."""
        if len(responses) != len(answers):
            raise ValueError(f"got {len(responses)} responses but {len(answers)} answers")
        results = self._pool.map([(str(r), str(a)) for r, a in zip(responses, answers)])
        stats = dict.fromkeys(self.stat_keys, 0)
        stats["total"] = len(results)
        scores = []
        for result in results:
            score = 0.0
            if result.status == "ok":
                score, kind = result.value
                if kind != OK:
                    stats[kind] += 1
            else:
                stats["timeouts" if result.status == "timeout" else "errors"] += 1
            stats["correct"] += int(self.is_correct(score))
            scores.append(float(score))
        for key, value in stats.items():
            self.totals[key] += value
        return scores, stats

    def close(self) -> None:
        self._pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
