"""The reasoning_gym reward gives what the dataset's own score_answer gives, in-process and
through the killable worker pool."""

import pytest

from megatron_rl.data.reasoning_gym import GymSpec, build_dataset, reference
from megatron_rl.rewards import build_verifier
from megatron_rl.rewards.reasoning_gym import score_response

SPECS = [
    GymSpec("chain_sum", {"min_terms": 2, "max_terms": 3}, seed=5, size=8),
    GymSpec("count_bits", {"max_n": 31}, seed=5, size=8),
    GymSpec("number_sorting", {"min_numbers": 3, "max_numbers": 4}, seed=5, size=8),
]


def _ref(spec, i):
    return reference(spec, i, str(build_dataset(spec)[i]["answer"]))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.dataset)
def test_scores_equal_the_datasets_own_score_answer(spec):
    dataset = build_dataset(spec)
    for i in range(spec.size):
        entry = dataset[i]
        for given in (entry["answer"], f" {entry['answer']} ", "7", entry["answer"] + "0"):
            expected = dataset.score_answer(given.strip(), entry)
            assert score_response(f"some work <answer>{given}</answer>", _ref(spec, i)) == (expected, "ok")


def test_the_last_answer_tag_counts_and_none_is_a_format_failure():
    spec = SPECS[1]
    truth = build_dataset(spec)[0]["answer"]
    assert score_response(f"<answer>9</answer> no, <answer>{truth}</answer>", _ref(spec, 0)) == (1.0, "ok")
    assert score_response(f"Answer: {truth}", _ref(spec, 0)) == (0.0, "format_failures")
    assert score_response(f"<answer>{truth}", _ref(spec, 0)) == (0.0, "format_failures")  # cut off


def test_a_reference_whose_entry_regenerates_differently_is_refused():
    with pytest.raises(ValueError, match="regenerated with another answer"):
        score_response("<answer>1</answer>", reference(SPECS[1], 0, "not the answer"))


def test_the_pool_verifier_scores_a_batch_and_counts_outcomes():
    spec = SPECS[0]
    dataset = build_dataset(spec)
    truths = [dataset[i]["answer"] for i in range(3)]
    responses = [f"<answer>{truths[0]}</answer>", f"<answer>{int(truths[1]) + 1}</answer>", "no tags"]
    with build_verifier("reasoning_gym", timeout_s=30.0) as verifier:
        scores, stats = verifier.score_batch(responses, [_ref(spec, i) for i in range(3)])
    assert scores == [1.0, dataset.score_answer(str(int(truths[1]) + 1), dataset[1]), 0.0]
    assert stats == {"total": 3, "correct": 1, "timeouts": 0, "format_failures": 1, "errors": 0}
