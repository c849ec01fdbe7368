"""DAPO's dynamic sampling in `collect_rollouts`: groups whose rewards are all equal are
dropped and the batch is refilled from new prompts, up to max_gen_batches.

Generation is scripted here (a stand-in with the engine's replica attributes), because the
subject is the refill bookkeeping; vLLM generation itself is tested in
tests/distributed/test_weight_sync.py (the engine tests) and the whole loop in test_trainer.py. The
all-gather of groups runs on a real one-rank gloo group.
"""

import pytest
import torch.distributed as dist

from megatron_rl.algorithms.recipes import get_recipe
from megatron_rl.data import PromptBatch
from megatron_rl.rollout import EngineConfig, Sample, Sampling
from megatron_rl.rollout.replicas import Replicas
from megatron_rl.trainer.rollouts import collect_rollouts, lockstep_draw

# Each prompt is one token; each response's single token says whether it is correct.
CORRECT, WRONG = 1, 0
SCRIPT = {  # prompt token -> the 4 responses generated for it
    10: [CORRECT] * 4,  # all correct: no spread, dropped
    11: [CORRECT, WRONG, WRONG, CORRECT],  # kept
    12: [WRONG] * 4,  # all wrong: dropped
    13: [WRONG, CORRECT, WRONG, WRONG],  # kept
    14: [CORRECT, WRONG, CORRECT, CORRECT],  # would be kept, but the batch is full by then
}


class ScriptedGeneration:
    num_replicas, replica, tp = 1, 0, 1
    config = EngineConfig()

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling, seeds=None, on_group=None):
        self.calls.append([p[0] for p in prompts])
        return [
            [
                Sample(prompt_ids=list(p), token_ids=[t], logprobs=[-0.5], finish_reason=_reason(p[0]))
                for t in SCRIPT[p[0]]
            ]
            for p in prompts
        ]


def _reason(prompt_token: int) -> str:
    """Prompt 12's responses use up the response budget; the others stop."""
    return "length" if prompt_token == 12 else "stop"


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _batches(*tokens_per_batch):
    queue = [
        PromptBatch(
            prompt_ids=[[t] for t in tokens],
            answers=["1"] * len(tokens),
            dataset_indices=list(tokens),
            epochs=[0] * len(tokens),
            group_ids=list(range(len(tokens))),
        )
        for tokens in tokens_per_batch
    ]
    return lambda: queue.pop(0)


def _generate(engine):
    return Replicas(engine).generate_groups


def _score(responses):
    return [1.0 if text == "1" else 0.0 for text in responses.texts], {}


def test_groups_without_reward_spread_are_dropped_and_refilled(one_rank_group):
    engine = ScriptedGeneration()
    draw = lockstep_draw(_batches((10, 11), (12, 13), (14, 10)), _generate(engine))
    result = collect_rollouts(draw, Sampling(n=4), get_recipe("dapo"), _score, lambda ids: str(ids[0]), num_groups=2)
    assert [g.prompt_ids for g in result.groups] == [[11], [13]]
    assert engine.calls == [[10, 11], [12, 13]]  # the second batch filled the step: no third
    assert result.generation_batches == 2 and result.generated_groups == 4
    assert result.groups[0].correct == [1.0, 0.0, 0.0, 1.0]
    # The reward metric counts every generated sample, kept or dropped: (4 + 2 + 0 + 1) / 16.
    assert result.mean_correct_all == pytest.approx(7 / 16)
    assert result.truncated_all == pytest.approx(4 / 16)  # prompt 12's four, though dropped


def test_refill_stops_at_max_gen_batches(one_rank_group):
    engine = ScriptedGeneration()
    recipe = get_recipe("dapo", max_gen_batches=2)
    draw = lockstep_draw(_batches((10, 12), (12, 10), (11, 13)), _generate(engine))
    result = collect_rollouts(draw, Sampling(n=4), recipe, _score, lambda ids: str(ids[0]), num_groups=2)
    assert result.groups == [] and result.generation_batches == 2 and len(engine.calls) == 2


def test_without_dynamic_sampling_every_group_is_kept(one_rank_group):
    engine = ScriptedGeneration()
    draw = lockstep_draw(_batches((10, 11)), _generate(engine))
    result = collect_rollouts(draw, Sampling(n=4), get_recipe("grpo"), _score, lambda ids: str(ids[0]), num_groups=2)
    assert [g.prompt_ids for g in result.groups] == [[10], [11]] and result.generation_batches == 1
