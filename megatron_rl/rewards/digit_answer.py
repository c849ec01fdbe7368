"""Reward for the digit task: 1.0 when the response ends in ``Answer: <the right digit>``.

Only the final answer is graded (the running values are the policy's own business), and
only when it is the response's last word, so a response that keeps talking after its
answer, or never gives one, scores 0 and is counted as a format failure.
"""

from __future__ import annotations

import re
from typing import Sequence

_FINAL_ANSWER = re.compile(r"(?:^|\s)Answer:\s*(\S+)\s*$")


def final_answer(response: str) -> str | None:
    """The word after the last ``Answer:`` when it ends the response, else None."""
    match = _FINAL_ANSWER.search(response)
    return match.group(1) if match else None


class DigitAnswerVerifier:
    """Exact-match verifier with the same ``score_batch`` signature as the math verifier.
    A verifier with another rule for one response overrides :meth:`grade` alone."""

    def __init__(self) -> None:
        self.totals = {"total": 0, "correct": 0, "format_failures": 0}

    def grade(self, response: str, answer: str) -> tuple[float, bool]:
        """(score, well-formed) of one response against its answer."""
        given = final_answer(response)
        return float(given is not None and given == str(answer).strip()), given is not None

    def score_batch(self, responses: Sequence[str], answers: Sequence[str]) -> tuple[list[float], dict[str, int]]:
        if len(responses) != len(answers):
            raise ValueError(f"got {len(responses)} responses but {len(answers)} answers")
        stats = {"total": len(responses), "correct": 0, "format_failures": 0}
        scores = []
        for response, answer in zip(responses, answers):
            score, well_formed = self.grade(response, answer)
            stats["format_failures"] += int(not well_formed)
            stats["correct"] += int(score)
            scores.append(score)
        for key, value in stats.items():
            self.totals[key] += value
        return scores, stats

    def close(self) -> None:
        pass

    def __enter__(self) -> "DigitAnswerVerifier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
