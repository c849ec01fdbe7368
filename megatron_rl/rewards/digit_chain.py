"""Reward for the chain task: the right final answer, reached by a step for every digit.

The chain task's direct answer (the max of the prompt's digits in one go) is within reach
of attention without any working, so a final-answer check alone lets the policy drop the
chain within a few steps (docs/claims.md). Here the working is part of the answer, as a
grader asks a student to show it: the response must take one step per prompt digit, in
the prompt's order, each starting from the value the last one wrote, and end in the
answer the chain reached. The step's own values (``max(a,d)=v``'s ``v``) are not checked:
whether they are right is the policy's business, and a wrong one makes the answer wrong.

The reference each response is scored against is the task's reference solution (what
``train.jsonl``'s ``answer`` field holds for this task): its digits and its final answer.
"""

from __future__ import annotations

import re
from typing import Optional

from megatron_rl.rewards.digit_answer import DigitAnswerVerifier, final_answer

_STEP = re.compile(r"^(?:max|min)\((\d),(\d)\)=(\d)$|^(\d)\+(\d)=(\d)$")
"""One written step: ``max(a,d)=v`` / ``min(a,d)=v`` or ``a+d=v`` (the digit tasks' ``_WORK``)."""


def chain_steps(response: str) -> Optional[tuple[str, list[tuple[str, str, str]], str]]:
    """``(start, [(a, d, v), ...], answer)`` of a well-formed chain, None for anything else:
    a first value, then steps, then ``Answer: x`` as the last two words."""
    words = response.split()
    if len(words) < 3 or words[-2] != "Answer:" or not re.fullmatch(r"\d", words[0]):
        return None
    steps = []
    for word in words[1:-2]:
        match = _STEP.match(word)
        if match is None:
            return None
        groups = [g for g in match.groups() if g is not None]
        steps.append((groups[0], groups[1], groups[2]))
    return words[0], steps, words[-1]


def follows_the_prompt(response: str, reference: str) -> bool:
    """The response's chain walks the reference's digits: same first digit, one step per
    digit after it (each from the last value written), and it answers the last value."""
    ours, theirs = chain_steps(response), chain_steps(reference)
    if ours is None or theirs is None:
        return False
    (start, steps, answer), (ref_start, ref_steps, _) = ours, theirs
    if start != ref_start or [d for _, d, _ in steps] != [d for _, d, _ in ref_steps]:
        return False
    values = [start] + [v for _, _, v in steps]
    return all(a == prev for (a, _, _), prev in zip(steps, values)) and answer == values[-1]


class DigitChainVerifier(DigitAnswerVerifier):
    """1.0 for the reference's final answer reached by a chain that follows the prompt."""

    def grade(self, response: str, reference: str) -> tuple[float, bool]:
        well_formed = follows_the_prompt(response, reference)
        return float(well_formed and final_answer(response) == final_answer(reference)), well_formed
