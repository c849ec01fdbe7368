"""rewards.judge: responses rendered into the judge's template, verdicts parsed into scores,
and a judge that hangs, dies or answers garbage costs at most its timeout per batch, is
counted and scored ``on_malformed``, with the other batches scored and the pool usable after."""

import time

import pytest

from megatron_rl.config.reward import DEFAULT_TEMPLATE, DEFAULT_VERDICT
from megatron_rl.rewards import TimedWorkerPool
from megatron_rl.rewards.judge import JudgeScorer, Verdicts
from megatron_rl.rewards.scoring import Responses

TARGET = "tests.unit.rewards.judge_stubs:ScriptedJudge"
TIMEOUT_S = 1.0


def _responses(texts):
    n = len(texts)
    return Responses(texts, ["7"] * n, [[1]] * n, [[2]] * n, ["max of 3 7"] * n)


@pytest.fixture(scope="module")
def pool():
    with TimedWorkerPool(TARGET, timeout_s=TIMEOUT_S, init_args=["Response: Answer: 7"]) as pool:
        yield pool


def _scorer(pool, batch_size=2):
    return JudgeScorer(pool, DEFAULT_TEMPLATE, Verdicts(DEFAULT_VERDICT, {"yes": 1.0, "no": 0.0}), -1.0, batch_size)


def test_the_template_holds_the_question_the_response_and_the_reference():
    scorer = JudgeScorer(None, "{question} | {response} | {reference} {{x}}", Verdicts(DEFAULT_VERDICT, {}), 0.0, 1)
    assert scorer.prompts(_responses(["Answer: 3"])) == ["max of 3 7 | Answer: 3 | 7 {x}"]


def test_verdicts_by_name_or_as_numbers():
    named = Verdicts(DEFAULT_VERDICT, {"yes": 1.0, "no": 0.0})
    assert [named.score(a) for a in ("Yes.", "no, wrong", "maybe", "")] == [1.0, 0.0, None, None]
    numeric = Verdicts(r"score: (\S+)", {})
    assert [numeric.score(a) for a in ("score: 7.5", "score: high", "7")] == [7.5, None, None]


def test_a_healthy_judge_scores_every_response(pool):
    out = _scorer(pool).score(_responses(["Answer: 7", "Answer: 3", "Answer: 7"]))
    assert out.scores == [1.0, 0.0, 1.0] and out.failures == 0


def test_a_garbage_verdict_is_scored_on_malformed_and_counted(pool):
    out = _scorer(pool).score(_responses(["Answer: 7", "garbage", "Answer: 3"]))
    assert out.scores == [1.0, -1.0, 0.0] and out.failures == 1


@pytest.mark.parametrize("fault", ["sleep", "die"])
def test_a_judge_that_hangs_or_dies_costs_its_batch_and_the_pool_goes_on(pool, fault):
    started = time.monotonic()
    # batches of two: [7, fault] fails whole, [3, 7] is judged by the replacement worker
    out = _scorer(pool).score(_responses(["Answer: 7", fault, "Answer: 3", "Answer: 7"]))
    elapsed = time.monotonic() - started
    assert out.scores == [-1.0, -1.0, 0.0, 1.0] and out.failures == 2
    if fault == "sleep":
        assert TIMEOUT_S <= elapsed < TIMEOUT_S + 15.0  # the timeout, then a new worker's start-up
    assert _scorer(pool).score(_responses(["Answer: 7"])).scores == [1.0]
