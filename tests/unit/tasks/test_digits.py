"""The digit task's generator and verifier on hand-computed cases."""

import pytest

from megatron_rl.tasks import DigitAnswerVerifier, DigitTask, final_answer, get_task


def test_hand_computed_examples():
    e = DigitTask(op="max").example((3, 7, 1, 4))
    assert (e.prompt, e.answer, e.solution) == ("max of 3 7 1 4", "7", "Answer: 7")
    e = DigitTask(op="sum_mod10", reasoning=True).example((9, 2, 7))
    assert (e.prompt, e.answer, e.solution) == ("sum mod 10 of 9 2 7", "8", "9 1 8 Answer: 8")
    e = DigitTask(op="min", reasoning=True).example((5, 8, 2, 6))
    assert e.solution == "5 5 2 2 Answer: 2"
    e = DigitTask(op="max", reasoning="work").example((3, 7, 1))
    assert e.solution == "3 max(3,7)=7 max(7,1)=7 Answer: 7"
    e = DigitTask(op="sum_mod10", reasoning="work").example((9, 2, 7))
    assert e.solution == "9 9+2=1 1+7=8 Answer: 8"
    # the warm-up's random steps keep the format: each step starts from the previous value
    assert DigitTask(op="min", reasoning="work").solution((5, 8), answer="4", steps=[1, 2]) == "1 min(1,8)=2 Answer: 4"


def test_generator_is_deterministic_and_respects_lengths():
    task = get_task("digits_sum_steps")
    a, b = task.generate(200, seed=3), task.generate(200, seed=3)
    assert a == b
    assert a != task.generate(200, seed=4)
    lengths = {len(e.digits) for e in a}
    assert lengths == set(range(task.min_digits, task.max_digits + 1))  # all lengths occur
    # response length follows the prompt: one running value per digit, then the answer
    assert all(len(e.solution.split()) == len(e.digits) + 2 for e in a)
    assert all(e.answer == str(sum(e.digits) % 10) for e in a)


def test_answers_cover_the_answer_space():
    answers = {e.answer for e in get_task("digits_sum").generate(300, seed=0)}
    assert answers == {str(d) for d in range(10)}
    assert get_task("digits_sum").chance_accuracy == pytest.approx(0.1)


def test_bad_settings_name_what_is_allowed():
    with pytest.raises(ValueError, match=r"op='avg' is not known; allowed: \['max', 'min', 'sum_mod10'\]"):
        DigitTask(op="avg")
    with pytest.raises(ValueError, match=r"reasoning='long' is not known; allowed: \(False, True, 'work'\)"):
        DigitTask(reasoning="long")
    with pytest.raises(ValueError, match="min_digits <= max_digits"):
        DigitTask(min_digits=4, max_digits=2)
    with pytest.raises(ValueError, match="allowed"):
        get_task("nope")


@pytest.mark.parametrize(
    "response, given",
    [
        ("Answer: 7", "7"),
        ("3 7 7 Answer: 7", "7"),
        ("Answer: 7 ", "7"),
        ("Answer:7", "7"),
        ("Answer: 7 and more", None),
        ("7", None),
        ("", None),
        ("NoAnswer: 7", None),
    ],
)
def test_final_answer_must_end_the_response(response, given):
    assert final_answer(response) == given


def test_verifier_scores_and_counts():
    scores, stats = DigitAnswerVerifier().score_batch(
        ["Answer: 7", "1 7 Answer: 7", "Answer: 8", "seven", "Answer: 7 ok"], ["7", "7", "7", "7", "7"]
    )
    assert scores == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert stats == {"total": 5, "correct": 2, "format_failures": 2}
