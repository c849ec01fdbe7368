"""Reward functions by name. Every entry builds an object with one signature:
``score_batch(responses, answers) -> (scores, stats)`` and ``close()``."""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from megatron_rl.rewards.digit_answer import DigitAnswerVerifier
from megatron_rl.rewards.digit_chain import DigitChainVerifier
from megatron_rl.rewards.math_verifier import MathVerifier
from megatron_rl.rewards.reasoning_gym import ReasoningGymVerifier


class Verifier(Protocol):
    totals: dict[str, int]

    def score_batch(self, responses: Sequence[str], answers: Sequence[str]) -> tuple[list[float], dict[str, int]]: ...

    def close(self) -> None: ...


REWARDS: dict[str, Callable[..., Verifier]] = {
    "math": MathVerifier,
    "digits": DigitAnswerVerifier,
    "digit_chain": DigitChainVerifier,
    "reasoning_gym": ReasoningGymVerifier,
}


def build_verifier(name: str, **options: Any) -> Verifier:
    """``options`` go to the verifier (e.g. ``timeout_s``, ``num_workers`` for ``math``)."""
    if name not in REWARDS:
        raise ValueError(f"reward {name!r} is not known; allowed: {sorted(REWARDS)}")
    try:
        return REWARDS[name](**options)
    except TypeError as exc:
        raise ValueError(f"bad options for reward {name!r}: {exc}") from None
