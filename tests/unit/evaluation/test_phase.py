"""The eval phase on a scripted engine (one rank): per-sample seeds from eval.seed, set and
prompt; the random generators put back; the prefix cache dropped; records written whole;
the policy version stamped where rollout ranks of their own sampled; held-out sets loaded
and refused when they share a prompt with the training data."""

import dataclasses
import json
import random

import pytest
import torch
import torch.distributed as dist

from megatron_rl.config import ConfigError, load_config
from megatron_rl.evaluation import PromptResult, pass_at_k
from megatron_rl.evaluation.phase import Evaluator, sample_seed
from megatron_rl.evaluation.sets import EvalSet, load_sets
from megatron_rl.rollout.replicas import Replicas
from megatron_rl.rollout.seeds import MAX_SAMPLES, prompt_seed
from megatron_rl.rollout.types import EngineConfig, Sample, Sampling


class ScriptedEngine:
    """Answers prompt p's sample i with the digit (p + i) % 3 (as a token id); draws from
    torch's and python's global generators as vLLM's CPU sampler does."""

    replica, num_replicas, tp = 0, 1, 1
    config = EngineConfig()

    def __init__(self):
        self.calls, self.cache_drops = [], 0

    def generate(self, prompts, sampling, seeds=None, on_group=None):
        self.calls.append((prompts, sampling, seeds))
        torch.rand(3), random.random()
        return [
            [
                Sample(
                    prompt_ids=list(p),
                    token_ids=[(p[0] + i) % 3] * (1 + i),
                    logprobs=[],
                    finish_reason="length" if i == sampling.n - 1 else "stop",
                )
                for i in range(sampling.n)
            ]
            for p in prompts
        ]

    def drop_prefix_cache(self):
        self.cache_drops += 1


class ScriptedBackend:
    """The eval generation of one scripted engine (Replicas.generate_eval, as the colocated
    engines and the rollout ranks run it); ``version``: the stamp of rollout ranks of their
    own (None: colocated)."""

    def __init__(self, version=None):
        self.engine, self.version = ScriptedEngine(), version

    def generate_eval(self, prompt_ids, sampling, seeds):
        samples = Replicas(self.engine).generate_eval(prompt_ids, sampling, seeds)
        return dataclasses.replace(samples, policy_version=self.version)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _score(texts, answers):
    return [float(t.split()[-1] == a) for t, a in zip(texts, answers)], {}


def _length_score(texts, answers):
    """Another reward: a third per token, whatever the answer."""
    return [min(1.0, len(t.split()) / 3) for t in texts], {}


def test_evaluates_every_prompt_writes_its_record_and_leaves_the_generators_alone(tmp_path, one_rank_group):
    cfg = load_config(None, ["eval.sets.a.source=held_out", "eval.every=1", "eval.n_samples=3", "eval.pass_k=[1,3]"])
    sets = [EvalSet("a", [(0,), (1,), (2,), (5,)], ["0", "0", "0", "0"], "last"), EvalSet("b", [(2,)], ["1"], "len")]
    backend = ScriptedBackend()
    engine = backend.engine
    sampling = Sampling(n=3, max_tokens=3, logprobs=False)
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    scores = {"last": _score, "len": _length_score}
    evaluator = Evaluator(cfg.eval, sets, backend, scores, decode, sampling, tmp_path / "eval", write=True)
    torch.manual_seed(0), random.seed(0)
    before = torch.get_rng_state(), random.getstate()
    metrics = evaluator.evaluate(7)
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert engine.cache_drops == 2  # once per set
    assert not any(k.endswith("/policy_version") for k in metrics)  # colocated: the training ranks' weights
    # Seeds: one per prompt, from eval.seed, the set and the prompt's index; apart from training's.
    prompts, used, seeds = engine.calls[0]
    assert used is sampling and seeds == [sample_seed(0, "a", i) for i in range(4)]
    assert len(set(seeds)) == 4 and all(s % MAX_SAMPLES == 0 for s in seeds)
    assert sample_seed(0, "b", 0) != sample_seed(0, "a", 0) != sample_seed(1, "a", 0) != prompt_seed(0, 0, 0)
    # Prompt p, sample i answers (p + i) % 3: prompts 0, 1, 2 have one "0" each, prompt 5 one too.
    assert metrics["val/a/accuracy"] == pytest.approx(4 / 12)
    assert metrics["val/a/pass@1"] == pytest.approx(1 / 3) and metrics["val/a/pass@3"] == 1.0
    assert metrics["val/a/response_length"] == 2.0 and metrics["val/a/truncated"] == pytest.approx(1 / 3)
    # Set b is scored by its own reward: samples of 1, 2 and 3 tokens score 1/3, 2/3 and 1;
    # only the last is correct.
    assert metrics["val/b/accuracy"] == pytest.approx(2 / 3) and metrics["val/b/pass@1"] == pytest.approx(1 / 3)
    assert metrics["timing/eval_s"] >= 0
    # The records recompute the metrics; nothing but the finished file is left.
    assert [p.name for p in (tmp_path / "eval").iterdir()] == ["step_7.jsonl"]
    rows = [json.loads(line) for line in (tmp_path / "eval" / "step_7.jsonl").read_text().splitlines()]
    assert [(r["set"], r["prompt_id"]) for r in rows] == [("a", 0), ("a", 1), ("a", 2), ("a", 3), ("b", 0)]
    a = [PromptResult(**{k: v for k, v in r.items() if k != "set"}) for r in rows if r["set"] == "a"]
    assert sum(pass_at_k(r.n, r.correct, 3) for r in a) / len(a) == metrics["val/a/pass@3"]


def test_a_rank_that_does_not_write_writes_nothing(tmp_path, one_rank_group):
    cfg = load_config(None, ["eval.sets.a.source=held_out", "eval.every=1", "eval.n_samples=1"])
    evaluator = Evaluator(
        cfg.eval,
        [EvalSet("a", [(1,)], ["1"], "last")],
        ScriptedBackend(),
        {"last": _score},
        lambda ids: str(ids[-1]),
        Sampling(n=1, logprobs=False),
        tmp_path / "eval",
        write=False,
    )
    assert evaluator.evaluate(1)["val/a/accuracy"] == 1.0
    assert not (tmp_path / "eval").exists()


def test_rollout_ranks_of_their_own_stamp_each_set_with_the_version_they_served(tmp_path, one_rank_group):
    cfg = load_config(None, ["eval.sets.a.source=held_out", "eval.every=1", "eval.n_samples=2", "eval.pass_k=[1]"])
    sets = [EvalSet("a", [(0,), (1,)], ["0", "0"], "last"), EvalSet("b", [(2,)], ["1"], "last")]
    evaluator = Evaluator(
        cfg.eval,
        sets,
        ScriptedBackend(version=5),
        {"last": _score},
        lambda ids: " ".join(map(str, ids)),
        Sampling(n=2, logprobs=False),
        tmp_path / "eval",
        write=True,
    )
    metrics = evaluator.evaluate(5)
    assert metrics["val/a/policy_version"] == 5 and metrics["val/b/policy_version"] == 5
    # Prompt 0 answers 0 then 1, prompt 1 answers 1 then 2: one "0" of four samples.
    assert metrics["val/a/accuracy"] == 0.25 and metrics["val/a/pass@1"] == 0.25
    records = (tmp_path / "eval" / "step_5.jsonl").read_text()
    assert "version" not in records  # the records are the weights' alone (megatron-rl eval reproduces them)


def test_eval_generation_refuses_a_seed_count_other_than_the_prompts(one_rank_group):
    with pytest.raises(ValueError, match="1 seeds for 2 prompts"):
        Replicas(ScriptedEngine()).generate_eval([[1], [2]], Sampling(n=1), [0])


def _jsonl(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))


def test_held_out_split_and_files_load_and_must_not_share_a_training_prompt(tmp_path, tokenizer):
    from megatron_rl.data import PromptDataset, PromptFields

    _jsonl(tmp_path / "train.jsonl", ["max of 1 2", "max of 3 4"])
    _jsonl(tmp_path / "eval.jsonl", ["max of 5 6", "max of 7 8", "max of 9 1"])
    _jsonl(tmp_path / "leaky.jsonl", ["max of 5 6", "max of 3 4"])
    fields = PromptFields(prompt="prompt", answer="answer")
    training = [r.prompt_ids for r in PromptDataset(tmp_path / "train.jsonl", tokenizer, fields=fields).records]
    cfg = load_config(None, ["eval.sets.held.max_prompts=2", f"eval.sets.file.source={tmp_path / 'eval.jsonl'}"])
    sets = load_sets(cfg, tmp_path, tokenizer, training)
    assert [(s.name, len(s)) for s in sets] == [("held", 2), ("file", 3)]
    assert sets[0].prompt_ids == sets[1].prompt_ids[:2] and sets[0].answers == ["1", "1"]
    assert {s.reward for s in sets} == {"digits"}  # the run's reward (task:digits_max)
    leaky = load_config(None, [f"eval.sets.leaky.source={tmp_path / 'leaky.jsonl'}"])
    with pytest.raises(ConfigError, match="eval.sets.leaky: 1 of its 2 prompts are also training prompts"):
        load_sets(leaky, tmp_path, tokenizer, training)


def test_a_reasoning_gym_set_is_its_seeds_first_questions_that_training_does_not_draw(tokenizer):
    from megatron_rl.data.reasoning_gym import GymPrompts, GymSpec, build_dataset, resolve

    bits = {"max_n": 15}  # 15 questions in all
    training = GymPrompts(GymSpec("count_bits", bits, seed=0, size=8), tokenizer)
    seen = {json.loads(r.answer)["index"] for r in training.records}
    train_questions = {build_dataset(training.spec)[i]["question"] for i in seen}
    gym = ["eval.sets.gym.source=reasoning_gym:count_bits", "eval.sets.gym.options={max_n: 15}"]
    cfg = load_config(None, [*gym, "eval.sets.gym.seed=7", "eval.sets.gym.size=4"])
    (gym_set,) = load_sets(cfg, None, tokenizer, (r.prompt_ids for r in training.records))
    expected = []  # seed 7's questions in order, skipping training's and repeats
    for entry in build_dataset(GymSpec("count_bits", bits, seed=7, size=40)):
        if entry["question"] not in train_questions and entry["question"] not in expected:
            expected.append(entry["question"])
    assert gym_set.reward == "reasoning_gym" and len(gym_set) == 4
    entries = [resolve(answer)[1] for answer in gym_set.answers]  # references the reward rebuilds
    assert [e["question"] for e in entries] == expected[:4]
    assert [tokenizer.decode(ids).split("\n")[0] for ids in gym_set.prompt_ids] == [
        f"<|user|>{q}" for q in expected[:4]
    ]
    left = 15 - len(train_questions)
    too_many = load_config(None, [*gym, f"eval.sets.gym.size={left + 1}"])
    with pytest.raises(ConfigError, match=rf"eval.sets.gym.source='reasoning_gym:count_bits': .* gave only {left} "):
        load_sets(too_many, None, tokenizer, (r.prompt_ids for r in training.records))
