"""The bookkeeping of rollouts that run ahead of training (trainer/ahead.py): how many
batches are in flight, the policy version each samples, the staleness bound, and the data
position a checkpoint saves. The rollout ranks are a scripted stand-in here (the subject is
the queue); the real bridge and vLLM run in tests/distributed/test_trainer_async.py."""

import json

import pytest

from megatron_rl.data import PromptDataset, PromptFields, PromptLoader
from megatron_rl.rollout import Sample, Sampling
from megatron_rl.rollout.commands import Generation
from megatron_rl.trainer.ahead import AheadGeneration, GroupRequests, StepTimes


class ScriptedRolloutRanks:
    """Answers each generate with one empty group per prompt, in the order submitted."""

    def __init__(self):
        self.version, self.sent, self.submitted, self.commands = 0, 0, [], []

    def submit(self, command, bucket=None, keep=True):
        self.commands.append(command)
        self.submitted.append((command.prompts.dataset_indices, self.version))
        self.sent += 1
        return self.sent - 1

    def result(self, number):
        return Generation([[] for _ in self.submitted[number][0]], seconds=0.5, idle_s=0.1)


@pytest.fixture
def loader(tmp_path, tokenizer):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(20)))
    return PromptLoader(PromptDataset(path, tokenizer, fields=PromptFields(answer="answer")), batch_size=2, seed=0)


def test_depth_one_keeps_the_next_batch_in_flight_one_version_old(loader):
    ranks = ScriptedRolloutRanks()
    ahead = AheadGeneration(ranks, loader, depth=1)
    first = ahead.draw(Sampling())
    assert first.version == 0 and len(ranks.submitted) == 2  # the next batch went out before training
    for _ in range(2, 5):
        ranks.version += 1  # the step's update is sent after the batch in flight
        drawn = ahead.draw(Sampling())
        assert ranks.version - drawn.version == 1 and len(ahead.queue) == 1
    assert [v for _, v in ranks.submitted] == [0, 0, 1, 2, 3]
    assert ahead.step_times.metrics()["rollout/dropped_stale"] == 0


def test_depth_zero_waits_for_each_batch(loader):
    ranks = ScriptedRolloutRanks()
    ahead = AheadGeneration(ranks, loader, depth=0)
    for _ in range(3):
        ranks.version += 1
        assert ahead.draw(Sampling()).version == ranks.version and not ahead.queue
    times = ahead.step_times.metrics()
    assert times["timing/generation_s"] == pytest.approx(1.5) and times["timing/rollout_idle_s"] == pytest.approx(0.3)
    assert ahead.step_times.metrics()["timing/generation_s"] == 0  # reset per step


def test_a_batch_staler_than_the_bound_is_dropped_and_counted(loader):
    ranks = ScriptedRolloutRanks()
    ahead = AheadGeneration(ranks, loader, depth=1)
    ahead.draw(Sampling())
    ranks.version += 2  # two updates while one batch was in flight
    drawn = ahead.draw(Sampling())
    assert drawn.version == 2 and drawn.prompts.dataset_indices == ranks.submitted[2][0]
    assert ahead.step_times.metrics()["rollout/dropped_stale"] == 2  # the 2 prompts of the stale batch


def test_the_saved_position_is_before_the_batches_in_flight(loader):
    reference = PromptLoader(loader.dataset, batch_size=2, seed=0)
    expected = [reference.next_batch().dataset_indices for _ in range(4)]
    ahead = AheadGeneration(ScriptedRolloutRanks(), loader, depth=2)
    taken = ahead.draw(Sampling()).prompts.dataset_indices
    assert taken == expected[0] and loader.prompts_drawn == 6 and ahead.prompts_drawn == 2
    state = json.loads(json.dumps(ahead.state_dict()))  # what a checkpoint holds
    resumed = AheadGeneration(ScriptedRolloutRanks(), PromptLoader(loader.dataset, batch_size=2, seed=0), depth=2)
    resumed.load_state_dict(state)
    assert resumed.prompts_drawn == 2
    assert [resumed.draw(Sampling()).prompts.dataset_indices for _ in range(3)] == expected[1:]


def test_partial_batches_are_judged_by_their_oldest_token(loader):
    """A partial rollout's batch (token versions recorded) is as stale as its oldest token,
    whatever version its later tokens came from; the generate command asks for chunks."""
    ranks = ScriptedRolloutRanks()
    answers = {}
    ranks.result = lambda number: answers.get(number, Generation([], 0.0, 0.0))
    ahead = AheadGeneration(ranks, loader, depth=1, requests=GroupRequests(chunk_tokens=3))

    def partial(oldest, newest):
        return Generation([[Sample([1], [5, 6], [-1.0, -1.0], "stop", versions=[oldest, newest])]], 0.1, 0.0)

    answers[0] = partial(0, 0)
    assert ahead.draw(Sampling()).version == 0
    ranks.version = 1
    answers[1] = partial(0, 1)  # continued under version 1 after its first token
    assert ahead.draw(Sampling()).version == 0
    ranks.version = 3
    answers[2], answers[3] = partial(1, 3), partial(3, 3)  # 2 behind at its oldest token: dropped
    assert ahead.draw(Sampling()).version == 3
    assert ahead.step_times.metrics()["rollout/dropped_stale"] == 2
    assert all(command.chunk_tokens == 3 for command in ranks.commands)


def test_hidden_generation_is_counted_batch_by_batch():
    """A batch that ran ahead (1.0 s generating, 0.3 s waited for) hides 0.7 s; a refill drawn
    on the spot (0.5 s, waited 0.55 s with the answer's latency) hides none. Summed first, the
    refill's latency would cut the step's hidden time to 0.65 s, and a few refills would
    cancel it entirely."""
    times = StepTimes()
    times.took(Generation([], seconds=1.0, idle_s=0.0), waited_s=0.3)
    times.took(Generation([], seconds=0.5, idle_s=0.0), waited_s=0.55)
    out = times.metrics()
    assert out["timing/generation_hidden_s"] == pytest.approx(0.7)
    assert (out["timing/generation_s"], out["timing/train_idle_s"]) == (pytest.approx(1.5), pytest.approx(0.85))
    assert times.metrics()["timing/generation_hidden_s"] == 0  # reset per step
