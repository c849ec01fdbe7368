"""trainer.reward_scorers.build_reward: no reward section is data.reward's verifier alone;
rule scorers share the run's verifier when they name its reward and score by their own
otherwise, weighted as configured."""

from pathlib import Path

from megatron_rl.config import load_config
from megatron_rl.rewards.digit_answer import DigitAnswerVerifier
from megatron_rl.rewards.digit_chain import DigitChainVerifier
from megatron_rl.rewards.scoring import Responses, SingleRule, WeightedReward
from megatron_rl.trainer.reward_scorers import build_reward

GRPO = str(Path(__file__).resolve().parents[3] / "examples" / "grpo.yaml")
PLACE = dict(base_dir=Path("."), run_dir=Path("."), dp_size=1, pad_token_id=0)


class Counting(DigitChainVerifier):
    """The run's verifier, counting its calls and whether it was closed."""

    def __init__(self):
        super().__init__()
        self.calls, self.closed = 0, False

    def score_batch(self, responses, answers):
        self.calls += 1
        return super().score_batch(responses, answers)

    def close(self):
        self.closed = True


def _responses():
    texts = ["3 max(3,7)=7 Answer: 7", "Answer: 7", "3 max(3,7)=7 Answer: 3"]
    return Responses(texts, ["3 max(3,7)=7 Answer: 7"] * 3, [[1]] * 3, [[2]] * 3)


def test_without_scorers_the_reward_is_the_verifier():
    verifier = Counting()
    reward = build_reward(load_config(GRPO, []), verifier, "digit_chain", **PLACE)
    assert isinstance(reward, SingleRule)
    assert reward.score_batch(_responses())[0] == [1.0, 0.0, 0.0] and verifier.calls == 1
    reward.close()
    assert not verifier.closed  # the run's verifier: eval shares it, the trainer closes it


def test_rules_are_weighted_and_the_run_verifier_is_shared():
    scorers = (
        "{chain: {kind: rule, weight: 2}, again: {kind: rule, reward: digit_chain, weight: 0.5},"
        " digits: {kind: rule, reward: digits, weight: 0}}"
    )
    verifier = Counting()
    reward = build_reward(load_config(GRPO, [f"reward.scorers={scorers}"]), verifier, "digit_chain", **PLACE)
    assert isinstance(reward, WeightedReward)
    total, stats = reward.score_batch(_responses())
    assert total == [2.5, 0.0, 0.0]  # 2 x chain + 0.5 x the same rule + 0 x digits
    assert verifier.calls == 2  # chain and again: the run's verifier, shared
    # digits gets a verifier of its own: the final answer against the chain reference, never equal
    assert stats["reward/digits/sum"] == 0.0 and stats["reward/digits/count"] == 3
    assert isinstance(reward.scorers[2].scorer.verifier, DigitAnswerVerifier)
    reward.close()
    assert not verifier.closed
