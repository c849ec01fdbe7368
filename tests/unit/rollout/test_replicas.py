"""The colocated backend on a scripted engine (one rank): generation is dealt over the
replicas and gathered back, with per-prompt seeds where asked; the weight calls and the
prompt logprobs go to this rank's engine as they are; the engine itself only generates
what its rank is given (it has none of the backend's dealt calls)."""

import pytest
import torch
import torch.distributed as dist

from megatron_rl.data import PromptBatch
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.replicas import Replicas, contiguous_share
from megatron_rl.rollout.seeds import prompt_seeds
from megatron_rl.rollout.types import EngineConfig, Sample, Sampling


class ScriptedEngine:
    """Answers each prompt with its first token; records every call."""

    tp, num_replicas, replica = 1, 1, 0
    config = EngineConfig()

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling, seeds=None, on_group=None):
        self.calls.append(("generate", [list(p) for p in prompts], seeds))
        groups = [[Sample(list(p), [p[0]], [-0.5], "stop") for _ in range(sampling.n)] for p in prompts]
        for k in reversed(range(len(groups))) if on_group else ():  # the last finishes first
            on_group(k, groups[k])
        return groups

    def continue_(self, samples, sampling):
        self.calls.append(("continue_", len(samples)))
        return [Sample(s.prompt_ids, s.token_ids + [0], s.logprobs + [-0.5], "stop") for s in samples]

    def prompt_logprobs(self, sequences):
        self.calls.append(("prompt_logprobs", sequences))
        return [[-1.0] * (len(s) - 1) for s in sequences]

    def load_weights(self, named_tensors):
        self.calls.append(("load_weights", named_tensors))
        return "inplace"

    def check_weights(self, named_tensors):
        self.calls.append(("check_weights", named_tensors))
        return "checked"

    def finish_weight_update(self):
        self.calls.append(("finish_weight_update",))

    def close(self):
        self.calls.append(("close",))


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_groups_come_back_in_prompt_order_seeded_from_the_prompts(one_rank_group):
    engine = ScriptedEngine()
    prompts = PromptBatch([[5, 1], [7]], ["", ""], [3, 4], [0, 1], [0, 1])
    groups = Replicas(engine).generate_groups(prompts, Sampling(n=2, prompt_seed=11))
    assert [[s.token_ids for s in g] for g in groups] == [[[5], [5]], [[7], [7]]]
    assert engine.calls == [("generate", [[5, 1], [7]], prompt_seeds(11, [0, 1], [3, 4], 2))]


def test_each_finished_group_is_heard_by_its_index_in_the_batch(one_rank_group):
    heard = []
    prompts = PromptBatch([[5], [7]], ["", ""], [3, 4], [0, 0], [0, 1])
    groups = Replicas(ScriptedEngine()).generate_groups(
        prompts, Sampling(n=2), on_group=lambda i, g: heard.append((i, [s.token_ids for s in g]))
    )
    assert heard == [(1, [[7], [7]]), (0, [[5], [5]])] and len(groups) == 2


def test_a_continuation_extends_every_sample_on_the_replicas(one_rank_group):
    engine = ScriptedEngine()
    samples = [Sample([1], [2], [-0.5], "window"), Sample([3], [4], [-0.5], "window")]
    assert [s.token_ids for s in Replicas(engine).continue_samples(samples, Sampling())] == [[2, 0], [4, 0]]
    assert engine.calls == [("continue_", 2)]


def test_the_weight_calls_and_prompt_logprobs_go_to_this_ranks_engine():
    engine = ScriptedEngine()
    replicas = Replicas(engine)
    bucket = [("w", torch.zeros(2))]
    assert replicas.load_weights(bucket) == "inplace" and replicas.check_weights(bucket) == "checked"
    assert replicas.prompt_logprobs([[1, 2, 3]]) == [[-1.0, -1.0]]
    replicas.finish_weight_update(), replicas.close()
    names = [call[0] for call in engine.calls]
    assert names == ["load_weights", "check_weights", "prompt_logprobs", "finish_weight_update", "close"]
    assert replicas.config is engine.config


def test_the_engine_generates_only_its_own_ranks_prompts():
    for name in ("generate_groups", "generate_eval", "continue_samples"):
        assert not hasattr(RolloutEngine, name), name


def test_shares_are_contiguous_and_cover_every_item_once():
    shares = [list(contiguous_share(7, 3, part)) for part in range(3)]
    assert shares == [[0, 1, 2], [3, 4, 5], [6]]
    assert [list(contiguous_share(2, 4, part)) for part in range(4)] == [[0], [1], [], []]
