"""Math answer extraction and equivalence, scored in-process (no pool) on hand-made cases."""

import pytest

from megatron_rl.rewards.math_answer import extract_final_answer, last_boxed, score_math


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{3}.", "3"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces kept whole
        ("first \\boxed{1} then \\boxed{2}", "2"),  # the last box is the final answer
        ("cut off \\boxed{\\frac{1}{2", None),  # unbalanced: no answer
        ("no box here", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "response, expected",
    [
        ("Let me think.\nAnswer: 42", "42"),
        ("answer: $\\frac{1}{2}$.", "\\frac{1}{2}"),
        ("Answer: 1\nwait, no.\nAnswer: 2", "2"),
        ("The result is \\boxed{7}\nAnswer: 8", "7"),  # a box wins over an Answer line
        ("I think it is 7", None),  # a bare number in the reasoning is not a final answer
    ],
)
def test_extract_final_answer(response, expected):
    assert extract_final_answer(response) == expected


@pytest.mark.parametrize(
    "response, truth",
    [
        ("\\boxed{0.5}", "1/2"),
        ("Answer: 1/2", "0.5"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{\\frac{6}{2}}", "3"),
        ("Answer: \\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}"),
        ("\\boxed{x^2+2x+1}", "(x+1)^2"),
        ("The answer is \\boxed{3}.", "3"),
    ],
)
def test_equivalent_answers_score_one(response, truth):
    assert score_math(response, truth) == (1.0, "ok")


def test_wrong_answer_scores_zero():
    assert score_math("\\boxed{3}", "4") == (0.0, "ok")
    assert score_math("Answer: 0.49", "1/2") == (0.0, "ok")


def test_missing_final_answer_is_a_response_parse_failure():
    assert score_math("the answer is probably 3", "3") == (0.0, "response_parse_failures")


def test_unparsable_ground_truth_is_counted_separately():
    assert score_math("\\boxed{3}", "") == (0.0, "answer_parse_failures")
