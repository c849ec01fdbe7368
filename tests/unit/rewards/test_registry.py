import pytest

from megatron_rl.rewards import REWARDS, build_verifier


def test_names_and_one_signature():
    assert set(REWARDS) == {"math", "digits", "digit_chain", "reasoning_gym"}
    with build_verifier("digits") as v:
        assert v.score_batch(["Answer: 3", "Answer: 4"], ["3", "3"]) == (
            [1.0, 0.0],
            {"total": 2, "correct": 1, "format_failures": 0},
        )


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"'nope' is not known; allowed: \['digit_chain', 'digits', 'math', 'reasoning_gym'\]"
    ):
        build_verifier("nope")


def test_bad_options_name_the_reward():
    with pytest.raises(ValueError, match="bad options for reward 'digits'"):
        build_verifier("digits", timeout_s=3)
