"""Reward of reasoning-gym prompts: the dataset's own ``score_answer``, in the killable pool.

A prompt's answer is a reference (``megatron_rl.data.reasoning_gym.reference``): the worker
rebuilds the dataset entry from it (datasets are cached per worker) and scores the text of
the response's last ``<answer>...</answer>``. Some datasets give partial credit (a score in
(0, 1)); only a score of 1 counts as ``correct``. A scorer that hangs (some datasets run
the answer, e.g. a program) is killed by the pool and scores 0.
"""

from __future__ import annotations

from typing import Any, Sequence

from megatron_rl.data.reasoning_gym import GymSpec, build_dataset, extract_answer, reference, resolve
from megatron_rl.rewards.timed_pool import TimedWorkerPool

OK = "ok"
NO_ANSWER = "format_failures"
STAT_KEYS = ("total", "correct", "timeouts", NO_ANSWER, "errors")


def score_response(response: str, ref: str) -> tuple[float, str]:
    """``(score, outcome kind)`` of one response; the worker's entry point."""
    dataset, entry = resolve(ref)
    answer = extract_answer(response)
    if answer is None:
        return 0.0, NO_ANSWER
    return float(dataset.score_answer(answer, entry)), OK


class ReasoningGymVerifier:
    """Scores responses to reasoning-gym prompts with the dataset's ``score_answer``.

    Same interface as the other rewards; ``totals`` accumulates the batch stats.
    """

    def __init__(self, *, timeout_s: float = 5.0, num_workers: int = 1):
        warmup = GymSpec("chain_sum", {}, seed=0, size=1)  # any entry: importing reasoning-gym takes seconds
        self._pool = TimedWorkerPool(
            "megatron_rl.rewards.reasoning_gym:score_response",
            num_workers=num_workers,
            timeout_s=timeout_s,
            warmup_args=("", reference(warmup, 0, str(build_dataset(warmup)[0]["answer"]))),
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
            score = 0.0
            if result.status == "ok":
                score, kind = result.value
                if kind != OK:
                    stats[kind] += 1
            else:
                stats["timeouts" if result.status == "timeout" else "errors"] += 1
            stats["correct"] += int(score >= 1.0)
            scores.append(float(score))
        for key, value in stats.items():
            self.totals[key] += value
        return scores, stats

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> "ReasoningGymVerifier":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
