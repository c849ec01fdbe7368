"""Math answer reward: math-verify equivalence under a per-item time limit.

A response that makes the checker hang scores 0 and is counted under ``timeouts``, so a
run can see how often it happens instead of stalling on it.
"""

from __future__ import annotations

from megatron_rl.rewards.math_answer import BAD_GROUND_TRUTH, NO_FINAL_ANSWER
from megatron_rl.rewards.pooled_verifier import PooledVerifier

STAT_KEYS = ("total", "correct", "timeouts", BAD_GROUND_TRUTH, NO_FINAL_ANSWER, "errors")


class MathVerifier(PooledVerifier):
    """Scores responses 1.0 when their final answer equals the ground truth, else 0.0.

    The final answer is the last ``\\boxed{...}`` or ``Answer: ...`` line; equality is
    math-verify's (``1/2`` == ``0.5`` == ``\\frac{1}{2}``). ``totals`` accumulates the
    batch stats over the verifier's life.
    """

    def __init__(self, *, timeout_s: float = 5.0, num_workers: int = 1):
        super().__init__(
            "megatron_rl.rewards.math_answer:score_math",
            ("\\boxed{\\frac{1}{2}}", "0.5"),  # sympy/antlr set-up is slow the first time
            STAT_KEYS,
            timeout_s=timeout_s,
            num_workers=num_workers,
        )

    def is_correct(self, score: float) -> bool:
        return score > 0
