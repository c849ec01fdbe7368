"""rewards.scoring: the weighted reward of several scorers, each one's stats summed over a
step's batches, and a scorer's agreement with the rule, against hand-computed values."""

import math

import pytest

from megatron_rl.rewards.digit_answer import DigitAnswerVerifier
from megatron_rl.rewards.scoring import (
    Responses,
    RuleScorer,
    ScorerOutput,
    SingleRule,
    WeightedReward,
    WeightedScorer,
    ordered_pairs,
    penalize_unfinished,
    reward_metrics,
)


class Fixed:
    """A scorer that answers given scores (and failures) in order, one list per call."""

    def __init__(self, *calls, failures=0):
        self.calls = list(calls)
        self.failures = failures
        self.closed = False

    def score(self, responses):
        return ScorerOutput(self.calls.pop(0), self.failures)

    def close(self):
        self.closed = True


def _responses(prompts, texts=None):
    texts = texts or ["x"] * len(prompts)
    return Responses(texts, ["7"] * len(prompts), [[p] for p in prompts], [[1]] * len(prompts))


def test_the_reward_is_the_weighted_sum_and_each_scorer_is_kept():
    rule = Fixed([1.0, 0.0, 0.0, 1.0])
    model = Fixed([2.0, -1.0, 0.5, 0.5], failures=1)
    reward = WeightedReward(
        [WeightedScorer("rule", rule, 0.0, is_rule=True), WeightedScorer("rm", model, 0.5, is_rule=False)]
    )
    total, stats = reward.score_batch(_responses([5, 5, 6, 6]))
    assert total == [1.0, -0.5, 0.25, 0.25]  # 0 x rule + 0.5 x model
    assert stats["reward/rule/sum"] == 2.0 and stats["reward/rule/count"] == 4
    assert stats["reward/rm/sum"] == 2.0 and stats["reward/rm/failures"] == 1
    # prompt 5: rule 1 > 0, rm 2 > -1: a hit; prompt 6: rule 0 < 1, rm ties at 0.5: half a hit
    assert stats["reward/rm/agreement_hits"] == 1.5 and stats["reward/rm/agreement_pairs"] == 2
    assert "reward/rule/agreement_pairs" not in stats  # the rule is what agreement is measured against
    reward.close()
    assert rule.closed and model.closed


def test_agreement_counts_pairs_within_a_prompt_only():
    rule = [1, 0, 0, 1, 1, 0]
    other = [0.9, 0.1, 0.8, 0.2, 0.3, 0.3]
    prompts = [[1], [1], [1], [2], [2], [2]]
    # prompt 1: (0,1) hit, (0,2) hit, (1,2) same rule; prompt 2: (3,4) same rule, (3,5) 0.2<0.3 miss, (4,5) tie
    assert ordered_pairs(rule, other, prompts) == (2.5, 4)
    assert ordered_pairs([1, 0], [0.0, 1.0], [[1], [2]]) == (0.0, 0)  # different prompts: no pair


def test_a_response_cut_by_the_budget_loses_the_penalty():
    assert penalize_unfinished([1.0, 2.0, -1.0], [False, True, True], 5.0) == [1.0, -3.0, -6.0]
    assert penalize_unfinished([1.0, 2.0], [], 5.0) == [1.0, 2.0]  # no finish reasons: nothing is cut


def test_metrics_of_a_step_of_two_batches():
    model = Fixed([1.0, 0.0], [3.0, 3.0])
    rule = Fixed([1.0, 0.0], [1.0, 1.0])
    reward = WeightedReward(
        [WeightedScorer("rm", model, 1.0, is_rule=False), WeightedScorer("v", rule, 0.0, is_rule=True)]
    )
    totals: dict = {}
    for _ in range(2):  # as collect_rollouts sums the stats of a step's generation batches
        for key, value in reward.score_batch(_responses([4, 4]))[1].items():
            totals[key] = totals.get(key, 0) + value
    metrics = reward_metrics(totals)
    assert metrics["reward/rm/mean"] == 7.0 / 4 and metrics["reward/v/mean"] == 0.75
    assert metrics["reward/rm/agreement"] == 1.0  # one told-apart pair (first batch), ordered alike
    assert metrics["reward/rm/failures"] == 0 and metrics["timing/reward_s"] >= 0.0
    assert set(metrics) == {
        "reward/rm/mean",
        "reward/rm/failures",
        "reward/rm/agreement",
        "reward/v/mean",
        "reward/v/failures",
        "timing/reward_s",
    }


def test_agreement_is_nan_when_the_rule_tells_no_pair_apart():
    reward = WeightedReward(
        [WeightedScorer("v", Fixed([1.0, 1.0]), 0.0, True), WeightedScorer("rm", Fixed([0.1, 0.2]), 1.0, False)]
    )
    assert math.isnan(reward_metrics(reward.score_batch(_responses([3, 3]))[1])["reward/rm/agreement"])


def test_a_rule_scorer_and_the_plain_reward_score_as_the_verifier():
    texts = ["Answer: 7", "Answer: 3", "no answer"]
    responses = Responses(texts, ["7", "7", "7"], [[1], [1], [1]], [[2], [2], [2]])
    expected, _ = DigitAnswerVerifier().score_batch(texts, ["7"] * 3)
    assert RuleScorer(DigitAnswerVerifier()).score(responses).scores == expected
    scores, stats = SingleRule(DigitAnswerVerifier()).score_batch(responses)
    assert scores == expected and set(stats) == {"timing/reward_s"}


def test_a_scorer_with_the_wrong_number_of_scores_is_an_error():
    reward = WeightedReward([WeightedScorer("rm", Fixed([1.0]), 1.0, False)])
    with pytest.raises(RuntimeError, match="scorer 'rm' returned 1 scores for 2 responses"):
        reward.score_batch(_responses([1, 1]))
    with pytest.raises(ValueError, match="differ in length"):
        Responses(["a"], ["1", "2"], [[1]], [[1]])


def test_prompt_and_response_ids_are_the_conversation_a_reward_model_was_trained_on(tokenizer):
    """A model scorer reads prompt ids + response ids as generated (the answer's tokens, then
    EOS where the turn ends): with the tiny base's chat template these are exactly the ids of
    the whole conversation that reward-model training encodes."""
    from megatron_rl.data.pairs import encode_conversation
    from megatron_rl.data.prompts import encode_prompt

    for prompt, answer in (("max of 1 2 6", "Answer: 6"), ("max of 9 0 3 3", "9 max(9,0)=9 Answer: 9")):
        messages = [{"role": "user", "content": prompt}]
        response = tokenizer(answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        conversation = encode_conversation(tokenizer, [*messages, {"role": "assistant", "content": answer}])
        assert encode_prompt(tokenizer, messages) + response == conversation
