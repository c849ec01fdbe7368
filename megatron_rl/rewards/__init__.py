"""Rule-based rewards: math answers checked by math-verify and reasoning-gym answers by the
dataset's own scorer, both under a time limit, and the synthetic digit task's exact-match
verifier, found by name through ``build_verifier``.

No process groups here (docs/design.md, rules): scoring is per response; the trainer decides
which rank scores what.
"""

from megatron_rl.rewards.math_answer import extract_final_answer, last_boxed
from megatron_rl.rewards.math_verifier import MathVerifier
from megatron_rl.rewards.registry import REWARDS, Verifier, build_verifier
from megatron_rl.rewards.timed_pool import ItemResult, TimedWorkerPool

__all__ = [
    "MathVerifier",
    "REWARDS",
    "Verifier",
    "build_verifier",
    "extract_final_answer",
    "last_boxed",
    "ItemResult",
    "TimedWorkerPool",
]
