"""The single-turn task as an environment: the first turn is the answer, scored at once.

This is what the trainer's one-turn rollouts already do (prompt, one response, a reward
function on its text), written as the one-turn case of :class:`Environment`, so a
multi-turn driver runs the existing tasks unchanged.
"""

from __future__ import annotations

import threading
from typing import Any

from megatron_rl.environments.interface import EnvironmentSetup, EpisodeRecord, EpisodeStart, Step
from megatron_rl.rewards.registry import Verifier, build_verifier


class AnswerScorer:
    """A reward function scoring one answer at a time from any thread: the verifiers keep
    running totals and some a worker pool, neither made for concurrent callers."""

    def __init__(self, name: str, options: dict[str, Any]):
        self.verifier: Verifier = build_verifier(name, **options)
        self._lock = threading.Lock()

    def score(self, text: str, answer: str) -> float:
        with self._lock:
            scores, _ = self.verifier.score_batch([text], [answer])
        return float(scores[0])

    def close(self) -> None:
        self.verifier.close()


class SingleTurn:
    """One turn, scored by the setup's reward function; the episode state is the answer."""

    def __init__(self, setup: EnvironmentSetup):
        if setup.tools:
            raise ValueError("the single_turn environment lists no tools; use the tools environment")
        self.scorer = AnswerScorer(setup.reward, dict(setup.reward_options))

    def reset(self, record: EpisodeRecord) -> EpisodeStart:
        return EpisodeStart(record.messages, state=record.answer)

    def step(self, state: Any, assistant_text: str) -> Step:
        return Step.finish(self.scorer.score(assistant_text, state))

    def close(self) -> None:
        self.scorer.close()
