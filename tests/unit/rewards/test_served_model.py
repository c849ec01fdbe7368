"""rewards.served_model: a reward model behind a worker pool scores each response's whole
conversation ids in batches; a batch that failed, an answer of the wrong length and a score
that is not a finite number are failures, scored ``on_failure`` without the unfinished
penalty, and counted."""

import math

from megatron_rl.rewards.scoring import Responses
from megatron_rl.rewards.served_model import ServedModelScorer
from megatron_rl.rewards.timed_pool import ItemResult


class ScriptedPool:
    """Answers batch k with ``answers[k]`` (an ItemResult); records the rows it was given."""

    def __init__(self, answers):
        self.answers, self.items = answers, []

    def map(self, items):
        self.items += items
        return self.answers[: len(items)]

    def close(self):
        pass


def _responses(truncated):
    n = len(truncated)
    return Responses(["x"] * n, ["7"] * n, [[1, 2]] * n, [[10 + i] for i in range(n)], [""] * n, truncated)


def test_the_conversation_ids_are_scored_in_batches_and_failures_scored_as_configured():
    pool = ScriptedPool(
        [
            ItemResult("ok", [0.5, 2.0]),
            ItemResult("timeout"),
            ItemResult("ok", [math.nan, 1.5]),
            ItemResult("ok", [1.0, 2.0, 3.0]),  # three scores for two rows: garbage
        ]
    )
    scorer = ServedModelScorer(pool, batch_size=2, on_failure=-1.0, missing_eos_penalty=0.25)
    out = scorer.score(_responses([False, True, False, False, True, False, False, False]))
    assert pool.items == [([[1, 2, 10], [1, 2, 11]],), ([[1, 2, 12], [1, 2, 13]],),
                          ([[1, 2, 14], [1, 2, 15]],), ([[1, 2, 16], [1, 2, 17]],)]  # fmt: skip
    # the truncated second response loses 0.25; the truncated fifth failed, so on_failure as it is
    assert out.scores == [0.5, 1.75, -1.0, -1.0, -1.0, 1.5, -1.0, -1.0]
    assert out.failures == 5
