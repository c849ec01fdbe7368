"""trainer.overlapped_scoring: a served scorer (a judge in a worker process; the stub of
tests/unit/rewards/judge_stubs.py stands in for its engine) scores each group the moment
generation tells of it, the groups never told of (other replicas') once the batch is whole;
the result equals scoring the whole batch at the end, and the seconds it spent before the
batch ended are counted as hidden."""

import time
import types

import pytest

from megatron_rl.config.reward import DEFAULT_TEMPLATE, DEFAULT_VERDICT
from megatron_rl.rewards import TimedWorkerPool
from megatron_rl.rewards.judge import JudgeScorer, Verdicts
from megatron_rl.rewards.scoring import RuleScorer, WeightedReward, WeightedScorer, reward_metrics
from megatron_rl.rollout import Sample
from megatron_rl.trainer.overlapped_scoring import OverlappedScoring
from megatron_rl.trainer.rollouts import responses_of

TEXTS = {7: "Answer: 7 slow", 3: "Answer: 3 slow", 9: "garbage slow"}
GROUPS = [[7, 3], [3, 3], [9, 7], [7, 9]]
"""Each group's responses (one token each, decoded by TEXTS); the reference is 7."""


class ExactSeven:
    """A rule: 1 for a response that answers 7."""

    def score_batch(self, texts, answers):
        return [float(t.startswith(f"Answer: {a} ")) for t, a in zip(texts, answers)], {}

    def close(self):
        pass


def decode(ids):
    return TEXTS[ids[0]] if len(ids) == 1 else "max of 3 7"


def groups():
    return [[Sample(prompt_ids=[1, g], token_ids=[t], logprobs=[0.0], finish_reason="stop") for t in tokens]
            for g, tokens in enumerate(GROUPS)]  # fmt: skip


@pytest.fixture(scope="module")
def reward():
    pool = TimedWorkerPool("tests.unit.rewards.judge_stubs:ScriptedJudge", timeout_s=5.0, init_args=["Answer: 7"])
    judge = JudgeScorer(pool, DEFAULT_TEMPLATE, Verdicts(DEFAULT_VERDICT, {"yes": 1.0, "no": 0.0}), -1.0, 64)
    rule = RuleScorer(ExactSeven())
    weighted = WeightedReward(
        [WeightedScorer("rule", rule, 0.0, True), WeightedScorer("judge", judge, 1.0, False, True)]
    )
    yield weighted
    weighted.close()


def _wait_for(condition, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the served scorer never scored the groups it was told of"
        time.sleep(0.01)


def test_groups_told_of_are_scored_while_generating_and_the_result_is_the_whole_batchs(reward):
    batch = groups()
    responses = responses_of([s for g in batch for s in g], ["7"] * 8, decode)
    at_the_end, end_stats = reward.score_batch(responses)
    overlapped = OverlappedScoring(reward, lambda samples, answers: responses_of(samples, answers, decode))
    on_group = overlapped.begin(types.SimpleNamespace(answers=["7"] * 4))
    for index in (1, 0, 2):  # finishing out of order; group 3 is another replica's
        on_group(index, batch[index])
    _wait_for(lambda: set(overlapped._batch.scored) == {0, 1, 2})
    scores, stats = overlapped.score_batch(responses)
    assert scores == at_the_end == [1.0, 0.0, 0.0, 0.0, -1.0, 1.0, 1.0, -1.0]
    metrics, end = reward_metrics(stats), reward_metrics(end_stats)
    assert metrics["reward/judge/failures"] == end["reward/judge/failures"] == 2  # the two garbage verdicts
    assert metrics["reward/judge/agreement"] == end["reward/judge/agreement"]
    # three groups were scored before the batch ended, the fourth after: hidden, but not all
    assert 0.0 < metrics["timing/reward_hidden_s"] < stats["timing/reward_served_s"] <= stats["timing/reward_s"]
    assert 0.0 < metrics["timing/reward_hidden_share"] < 1.0
    assert end["timing/reward_hidden_s"] == 0.0  # scored whole at the end: nothing hidden


def test_a_batch_not_begun_is_scored_whole(reward):
    overlapped = OverlappedScoring(reward, lambda samples, answers: responses_of(samples, answers, decode))
    batch = groups()
    scores, stats = overlapped.score_batch(responses_of([s for g in batch for s in g], ["7"] * 8, decode))
    assert scores == [1.0, 0.0, 0.0, 0.0, -1.0, 1.0, 1.0, -1.0] and stats["timing/reward_hidden_s"] == 0.0
