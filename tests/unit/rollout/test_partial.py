"""Partial rollouts' per-token versions (rollout/partial.py) and what the trainer derives from
them: the fresh tokens of a row (trainer/rollouts.py TrainRows) and the staleness and
partial-sample counts of a step (trainer/sources.py). Hand-computed values; the real
chunked generation on a rollout rank runs in tests/distributed/test_trainer_async.py."""

import pytest

from megatron_rl.rollout import Sample
from megatron_rl.rollout.partial import fresh_start, oldest_version, spans_versions, with_versions
from megatron_rl.trainer.rollouts import Group, TrainRows
from megatron_rl.trainer.sources import staleness_metrics


def _sample(tokens, reason="window", versions=None):
    return Sample(
        prompt_ids=[1, 2],
        token_ids=list(tokens),
        logprobs=[-0.5] * len(tokens),
        finish_reason=reason,
        versions=versions,
    )


def test_each_chunk_stamps_only_its_new_tokens():
    first = with_versions(None, _sample([7, 8]), version=3)  # chunk 1 under version 3
    assert first.versions == [3, 3]
    second = with_versions(first, _sample([7, 8, 9, 10]), version=4)  # weights arrived: version 4
    third = with_versions(second, _sample([7, 8, 9, 10, 11], reason="stop"), version=4)
    assert third.versions == [3, 3, 4, 4, 4] and third.finish_reason == "stop"
    assert spans_versions(third) and not spans_versions(first)
    assert oldest_version([third, with_versions(None, _sample([5]), 4)]) == 3
    assert oldest_version([_sample([5])]) is None  # not a partial rollout
    # Tokens before the trainer's version are not fresh: 2 behind version 4, 5 behind 5.
    assert [fresh_start(third, v) for v in (3, 4, 5)] == [0, 2, 5]


def test_a_continuation_must_extend_its_sample():
    first = with_versions(None, _sample([7, 8]), version=0)
    with pytest.raises(ValueError, match="does not extend"):
        with_versions(first, _sample([7, 9, 10]), version=1)
    with pytest.raises(ValueError, match="0 versions for 2 response tokens"):
        with_versions(_sample([7, 8]), _sample([7, 8, 9]), version=1)


def test_rows_and_step_metrics_follow_the_token_versions():
    # Trainer at version 5. Group A was submitted at 4: one sample finished under 4, one was
    # continued under 5 after its third token. Group B is a whole-version batch of version 5.
    a = Group(
        [1],
        "x",
        [_sample([1, 2], "stop", [4, 4]), _sample([1, 2, 3, 4, 5], "stop", [4, 4, 4, 5, 5])],
        [1.0, 0.0],
        [1.0, 0.0],
        version=4,
    )
    b = Group([2], "y", [_sample([6, 7, 8], "stop"), _sample([9], "stop")], [0.0, 1.0], [0.0, 1.0], version=5)
    rows = TrainRows.from_groups([a, b], version=5)
    assert rows.fresh_start == [2, 3, 0, 0]  # tokens of version 4 are not fresh, the rest are
    assert rows.group_index == [0, 0, 1, 1]
    assert staleness_metrics([a, b], version=5) == {
        "rollout/staleness_mean": 0.5,
        "rollout/staleness_max": 1,
        "rollout/partial_samples": 1,
    }
    # A whole-version group of an older version has no fresh token, as before.
    old = Group([3], "z", [_sample([1, 2, 3], "stop")], [0.0], [0.0], version=4)
    assert TrainRows.from_groups([old], version=5).fresh_start == [3]
