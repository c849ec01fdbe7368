"""The math verifier's worker pool: batch scoring, and a hanging item that is killed,
scored 0 and counted while the rest of the batch is scored normally."""

import time

import pytest

from megatron_rl.rewards import MathVerifier, TimedWorkerPool

# sympy evaluates (10^100)! while checking equality: it runs for minutes in C code that
# math-verify's signal-based timeout cannot interrupt (measured: still running at 6 s).
HANGING_RESPONSE = "\\boxed{(10^{100})!}"


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(timeout_s=3.0, num_workers=2) as v:
        yield v


def test_batch_scores_and_stats(verifier):
    scores, stats = verifier.score_batch(
        ["\\boxed{1/2}", "Answer: 3", "no answer", "\\boxed{5}"], ["0.5", "\\frac{6}{2}", "3", "4"]
    )
    assert scores == [1.0, 1.0, 0.0, 0.0]
    assert stats == {
        "total": 4,
        "correct": 2,
        "timeouts": 0,
        "answer_parse_failures": 0,
        "response_parse_failures": 1,
        "errors": 0,
    }


def test_hanging_item_scores_zero_within_the_timeout_and_is_counted(verifier):
    verifier.score_batch(["\\boxed{1}"], ["1"])  # workers started: only scoring is timed
    before = dict(verifier.totals)
    started = time.monotonic()
    scores, stats = verifier.score_batch(["\\boxed{2}", HANGING_RESPONSE, "Answer: 0.25"], ["2", "5", "1/4"])
    elapsed = time.monotonic() - started
    assert scores == [1.0, 0.0, 1.0]
    assert stats["timeouts"] == 1 and stats["correct"] == 2
    assert elapsed < 3.0 + 5.0, elapsed  # the 3 s limit plus slack for a loaded machine
    assert verifier.totals["timeouts"] == before["timeouts"] + 1
    # the killed worker was replaced: the next batch is scored normally
    assert verifier.score_batch(["\\boxed{7}"] * 3, ["7"] * 3)[0] == [1.0, 1.0, 1.0]


def test_mismatched_lengths_are_refused(verifier):
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        verifier.score_batch(["a", "b"], ["1"])


def test_pool_reports_errors_and_timeouts_per_item():
    with TimedWorkerPool("math:sqrt", timeout_s=5.0) as pool:
        ok, bad = pool.map([(4.0,), (-1.0,)])
    assert (ok.status, ok.value) == ("ok", 2.0)
    assert bad.status == "error" and "ValueError" in bad.message
    with TimedWorkerPool("time:sleep", timeout_s=0.3) as pool:
        assert [r.status for r in pool.map([(30,), (0,)])] == ["timeout", "ok"]


def test_pool_rejects_an_unknown_target_before_starting():
    with pytest.raises(AttributeError):
        TimedWorkerPool("math:no_such_function")
