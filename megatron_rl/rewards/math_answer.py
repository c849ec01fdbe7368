"""Scoring one math response against its ground truth with math-verify.

This module runs inside the verifier's worker processes (see ``timed_pool``), so it
turns math-verify's own signal-based timeouts off: the pool enforces the time limit by
killing the worker, which also stops hangs inside C code.
"""

from __future__ import annotations

import logging
import re
from typing import Optional

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

# Outcome kinds of one scored item (also the names of the counters in the batch stats).
OK = "ok"
NO_FINAL_ANSWER = "response_parse_failures"
BAD_GROUND_TRUTH = "answer_parse_failures"

# The pool enforces the time limit, so math-verify's "timeout is disabled" warning is noise.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_EXTRACTION = [LatexExtractionConfig(), ExprExtractionConfig()]
_ANSWER_LINE = re.compile(r"answer\s*[:：]\s*(.+)", re.IGNORECASE)


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced: the response was cut off inside the box


def extract_final_answer(response: str) -> Optional[str]:
    """The response's final answer: the last ``\\boxed{}``, else the last ``Answer: ...`` line.

    Returns None when the response states no final answer; only the stated answer is
    graded, never a number that happens to appear in the reasoning.
    """
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed.strip()
    matches = [m.group(1) for line in response.splitlines() if (m := _ANSWER_LINE.search(line))]
    if not matches:
        return None
    answer = matches[-1].strip().rstrip(".").strip()
    if len(answer) >= 2 and answer[0] == answer[-1] == "$":
        answer = answer.strip("$").strip()
    return answer or None


def _parse_boxed(expression: str) -> list:
    # Wrapping in \boxed lets math-verify read bare LaTeX ("\frac{1}{2}") and plain
    # expressions ("1/2", "0.5") alike.
    return parse("\\boxed{" + expression + "}", extraction_config=_EXTRACTION, parsing_timeout=None)


def score_math(response: str, ground_truth: str) -> tuple[float, str]:
    """``(1.0 or 0.0, outcome kind)`` for one response; raises nothing on bad input."""
    gold = _parse_boxed(ground_truth.strip())
    if not gold:
        return 0.0, BAD_GROUND_TRUTH
    final = extract_final_answer(response)
    if final is None:
        return 0.0, NO_FINAL_ANSWER
    predicted = _parse_boxed(final)
    if not predicted:
        return 0.0, NO_FINAL_ANSWER
    correct = verify(gold, predicted, timeout_seconds=None)
    return (1.0 if correct else 0.0), OK
