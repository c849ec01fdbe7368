"""Math answer reward: math-verify equivalence under a per-item time limit.

A response that makes the checker hang scores 0 and is counted under ``timeouts``, so a
run can see how often it happens instead of stalling on it.
"""

from __future__ import annotations

from typing import Any, Sequence

from megatron_rl.rewards.math_answer import BAD_GROUND_TRUTH, NO_FINAL_ANSWER, OK
from megatron_rl.rewards.timed_pool import TimedWorkerPool

STAT_KEYS = ("total", "correct", "timeouts", BAD_GROUND_TRUTH, NO_FINAL_ANSWER, "errors")


class MathVerifier:
    """Scores responses 1.0 when their final answer equals the ground truth, else 0.0.

    The final answer is the last ``\\boxed{...}`` or ``Answer: ...`` line; equality is
    math-verify's (``1/2`` == ``0.5`` == ``\\frac{1}{2}``). ``totals`` accumulates the
    batch stats over the verifier's life.
    """

    def __init__(self, *, timeout_s: float = 5.0, num_workers: int = 1):
        self._pool = TimedWorkerPool(
            "megatron_rl.rewards.math_answer:score_math",
            num_workers=num_workers,
            timeout_s=timeout_s,
            warmup_args=("\\boxed{\\frac{1}{2}}", "0.5"),  # sympy/antlr set-up is slow the first time
        )
        self.totals = dict.fromkeys(STAT_KEYS, 0)

    def score_batch(self, responses: Sequence[str], answers: Sequence[str]) -> tuple[list[float], dict[str, int]]:
        """Scores (one float per response) and counts of each outcome in this batch."""
        if len(responses) != len(answers):
            raise ValueError(f"got {len(responses)} responses but {len(answers)} answers")
        results = self._pool.map([(str(r), str(a)) for r, a in zip(responses, answers)])
        stats = dict.fromkeys(STAT_KEYS, 0)
        stats["total"] = len(results)
        scores = []
        for result in results:
            if result.status == "ok":
                score, kind = result.value
                if kind != OK:
                    stats[kind] += 1
            else:
                score = 0.0
                stats["timeouts" if result.status == "timeout" else "errors"] += 1
            stats["correct"] += int(score > 0)
            scores.append(float(score))
        for key, value in stats.items():
            self.totals[key] += value
        return scores, stats

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> "MathVerifier":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
