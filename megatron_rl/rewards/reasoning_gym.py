"""Reward of reasoning-gym prompts: the dataset's own ``score_answer``, in the killable pool.

A prompt's answer is a reference (``megatron_rl.data.reasoning_gym.reference``): the worker
rebuilds the dataset entry from it (datasets are cached per worker) and scores the text of
the response's last ``<answer>...</answer>``. Some datasets give partial credit (a score in
(0, 1)); only a score of 1 counts as ``correct``. A scorer that hangs (some datasets run
the answer, e.g. a program) is killed by the pool and scores 0.
"""

from __future__ import annotations

from megatron_rl.data.reasoning_gym import GymSpec, build_dataset, extract_answer, reference, resolve
from megatron_rl.rewards.pooled_verifier import OK, PooledVerifier

NO_ANSWER = "format_failures"
STAT_KEYS = ("total", "correct", "timeouts", NO_ANSWER, "errors")


def score_response(response: str, ref: str) -> tuple[float, str]:
    """``(score, outcome kind)`` of one response; the worker's entry point."""
    dataset, entry = resolve(ref)
    answer = extract_answer(response)
    if answer is None:
        return 0.0, NO_ANSWER
    return float(dataset.score_answer(answer, entry)), OK


class ReasoningGymVerifier(PooledVerifier):
    """Scores responses to reasoning-gym prompts with the dataset's ``score_answer``.

    Same interface as the other rewards; ``totals`` accumulates the batch stats.
    """

    def __init__(self, *, timeout_s: float = 5.0, num_workers: int = 1):
        warmup = GymSpec("chain_sum", {}, seed=0, size=1)  # any entry: importing reasoning-gym takes seconds
        super().__init__(
            "megatron_rl.rewards.reasoning_gym:score_response",
            ("", reference(warmup, 0, str(build_dataset(warmup)[0]["answer"]))),
            STAT_KEYS,
            timeout_s=timeout_s,
            num_workers=num_workers,
        )

    def is_correct(self, score: float) -> bool:
        return score >= 1.0  # partial credit counts in the reward, not as correct
