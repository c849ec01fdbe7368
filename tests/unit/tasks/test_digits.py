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


def test_the_first_tasks_keep_their_prompts():
    """Fields past the first four stay out of the generator's seed while they hold their
    defaults: the embedded default draws the prompts its base and reference curve came from."""
    assert get_task("digits_max").seed_key() == "DigitTask(op='max', min_digits=3, max_digits=5, reasoning=False)"
    assert get_task("digits_max").generate(3, seed=0)[0].prompt == "max of 8 4 4"
    assert "uniform_answer=True" in get_task("digits_max_chain").seed_key()


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
    with pytest.raises(ValueError, match="chained_answer and the digit_chain verifier need reasoning='work'"):
        DigitTask(chained_answer=True)
    with pytest.raises(ValueError, match="uniform_answer is defined for op='max' only"):
        DigitTask(op="sum_mod10", uniform_answer=True)


@pytest.mark.parametrize(
    "task", [DigitTask(op="max", min_digits=3, max_digits=20, uniform_answer=True), get_task("digits_max_uniform")]
)
def test_uniform_max_answers_are_uniform_and_come_from_the_digits(task):
    examples = task.generate(2000, seed=0)
    counts = [sum(e.answer == str(d) for e in examples) for d in range(10)]
    assert min(counts) > 150 and max(counts) < 250  # 200 each expected; plain max of 3-20 digits: 9 in >60%
    assert all(str(max(e.digits)) == e.answer for e in examples)
    assert all(task.min_digits <= len(e.digits) <= task.max_digits for e in examples)


def test_chain_verifier_grades_the_answer_and_the_working():
    from megatron_rl.rewards.digit_chain import DigitChainVerifier

    task = get_task("digits_max_chain")
    reference = task.reference(task.example((3, 7, 1)))
    assert reference == "3 max(3,7)=7 max(7,1)=7 Answer: 7"
    responses = [
        "3 max(3,7)=7 max(7,1)=7 Answer: 7",  # right
        "3 max(3,7)=9 max(9,1)=9 Answer: 9",  # follows the prompt, a wrong value: wrong answer, well-formed
        "Answer: 7",  # no working
        "3 max(3,7)=7 Answer: 7",  # a digit skipped
        "3 max(3,1)=3 max(3,7)=7 Answer: 7",  # digits out of order
        "3 max(3,7)=7 max(6,1)=7 Answer: 7",  # a step that does not start from the last value
        "3 max(3,7)=7 max(7,1)=1 Answer: 7",  # an answer that is not where the chain ended
        "3 max(3,7)=7 max(7,1)=7 max(7,1)=7 Answer: 7",  # a step too many
    ]
    verifier = DigitChainVerifier()
    scores, stats = verifier.score_batch(responses, [reference] * len(responses))
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert stats == {"total": 8, "correct": 1, "format_failures": 6}


def test_chained_warmup_is_a_true_chain_in_form_only():
    """The chained warm-up's random chain starts at the first digit, continues from each value
    it wrote and answers its last one."""
    import random

    from megatron_rl.tasks.warmup import warmup_solution

    task = DigitTask(op="sum_mod10", min_digits=2, max_digits=8, reasoning="work", chained_answer=True)
    rng = random.Random(0)
    right = 0
    examples = task.generate(400, seed=1)
    for e in examples:
        words = warmup_solution(task, e, rng, correct=False).split()
        steps = [w.replace("+", "=").split("=") for w in words[1:-2]]
        assert words[0] == str(e.digits[0]) and words[-1] == steps[-1][2]  # starts at the digit, answers the last value
        assert [int(s[1]) for s in steps] == list(e.digits[1:])  # every digit of the prompt, in order
        assert all(a[2] == b[0] for a, b in zip(steps, steps[1:]))  # each step starts where the last ended
        right += words[-1] == e.answer
    assert right / len(examples) < 0.2  # the values are random: about chance, 0.1


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


def test_cold_chain_task_is_the_chain_task_from_a_colder_base():
    from megatron_rl.tasks.base_model import TASK_BASE_SETTINGS

    assert get_task("digits_max_chain_cold") == get_task("digits_max_chain")
    assert get_task("digits_max_chain_cold").generate(5, seed=0) == get_task("digits_max_chain").generate(5, seed=0)
    cold, warm = TASK_BASE_SETTINGS["digits_max_chain_cold"], TASK_BASE_SETTINGS["digits_max_chain"]
    assert cold == {**warm, "warmup_correct_fraction": 0.1}
