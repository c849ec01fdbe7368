"""The episode source on a scripted engine (no vLLM): episodes become the single-turn path's
rows, the environment's tokens carry loss mask 0, the environment's reward is the row's,
a truncated episode scores 0, DAPO's dynamic sampling drops and refills groups, and the
episode metrics count what the episodes did."""

import dataclasses

import torch

from megatron_rl.algorithms.recipes import get_recipe
from megatron_rl.data.batching import PromptLoader
from megatron_rl.data.prompts import PromptRecord
from megatron_rl.environments.driver import DriverConfig, EpisodeDriver
from megatron_rl.environments.episode import EpisodeLimits, encode_prompt
from megatron_rl.environments.interface import EnvironmentSetup
from megatron_rl.environments.registry import get_environment
from megatron_rl.environments.replicas import EpisodeReplicas
from megatron_rl.environments.served import EpisodeGeneration, GenerateEpisodes
from megatron_rl.environments.tool_calls import ToolResult
from megatron_rl.environments.tools import PYTHON
from megatron_rl.rollout import EngineConfig, Sample, Sampling
from megatron_rl.rollout.replicas import Replicas
from megatron_rl.rollout.seeds import prompt_seed
from megatron_rl.trainer.assembly import assemble
from megatron_rl.trainer.episodes import EpisodeSource


class EvalRunner:
    """A stand-in for the sandbox: the code as a Python expression."""

    def run(self, calls):
        return [ToolResult(str(eval(c.arguments["code"], {"__builtins__": {}}))) for c in calls]


class PolicyEngine:
    """Answers prompt k (by its question) with scripted behaviour: a call then its answer,
    a direct right answer, or a turn that never ends (cut by the turn budget). One replica
    of one rank, as a colocated world of one has."""

    tp, num_replicas, replica = 1, 1, 0
    config = EngineConfig()

    def __init__(self, tokenizer, behaviour):
        self.tokenizer, self.behaviour = tokenizer, behaviour

    def generate(self, prompts, sampling, seeds=None, max_tokens=None):
        out = []
        for ids, budget in zip(prompts, max_tokens):
            text = self.tokenizer.decode(ids)
            question = text.rsplit("What is ", 1)[1].split("?")[0]
            kind = self.behaviour[question]
            called = "<tool_response>" in text
            if kind == "runaway":
                turn = self.tokenizer("1 " * 200, add_special_tokens=False).input_ids[:budget]
            else:
                value = str(eval(question)) if kind == "right" or called else "0"
                reply = f"Answer: {value}" if called or kind != "call" else _call(question)
                turn = self.tokenizer(reply, add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]
            finish = "stop" if turn[-1] == self.tokenizer.eos_token_id else "length"
            out.append([Sample(list(ids), turn, [-0.5] * len(turn), finish)])
        return out


def _call(question):
    return f'<tool_call>{{"name": "python", "arguments": {{"code": "{question}"}}}}</tool_call>'


class Dataset:
    def __init__(self, tokenizer, questions):
        messages = [({"role": "user", "content": f"What is {q}?"},) for q in questions]
        self.records = [
            PromptRecord(tuple(encode_prompt(tokenizer, m)), str(eval(q)), f"row {i}", m)
            for i, (q, m) in enumerate(zip(questions, messages))
        ]

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        return self.records[i]


def _episodes(tokenizer, behaviour):
    """A driver on a world of one replica, as a colocated world of one has."""
    env = get_environment("tools", EnvironmentSetup(reward="digits", tools=(PYTHON,), tool_runner=EvalRunner()))
    limits = EpisodeLimits(max_turns=3, max_tokens=1000, max_turn_tokens=40)
    engine = PolicyEngine(tokenizer, behaviour)
    return EpisodeReplicas(Replicas(engine), EpisodeDriver(engine, tokenizer, env, DriverConfig(limits=limits)))


def _source(tokenizer, behaviour, recipe, prompts_per_step=2, group_size=2, client=None, depth=0):
    loader = PromptLoader(Dataset(tokenizer, list(behaviour)), batch_size=prompts_per_step, seed=0, shuffle=False)
    where = {"client": client, "depth": depth} if client is not None else {"colocated": _episodes(tokenizer, behaviour)}
    counts = (prompts_per_step, group_size, 1)
    return EpisodeSource(loader, recipe, tokenizer.decode, *counts, max_turns=3, **where)


class ScriptedRolloutRanks:
    """The rollout ranks' side of GenerateEpisodes without a bridge: each command run on a
    driver of its own when answered, stamped with the weight updates sent before it."""

    def __init__(self, episodes):
        self.episodes, self.version, self.sent, self.commands = episodes, 0, 0, []

    def submit(self, command, bucket=None, keep=True):
        self.commands.append((command, self.version))
        self.sent += 1
        return self.sent - 1

    def result(self, number):
        command, version = self.commands[number]
        results, times = self.episodes.run(command.records, command.seeds, version)
        return EpisodeGeneration(results, times, seconds=0.5, idle_s=0.1)


def test_episodes_become_rows_whose_tool_tokens_are_out_of_the_loss(tokenizer):
    source = _source(tokenizer, {"12 * 34": "call", "56 * 78": "runaway"}, get_recipe("grpo"))
    rollout = source.collect(Sampling(n=2))
    rows = rollout.rows
    assert len(rows) == 4 and rows.group_index == [0, 0, 1, 1]
    assert rows.correct == [1.0, 1.0, 0.0, 0.0]  # the call's answer is right; the runaway turn is truncated
    m = rollout.metrics
    assert m["reward/mean"] == 0.5 and m["episode/turns_mean"] == 1.5 and m["episode/tool_calls"] == 0.5
    assert m["episode/tool_errors"] == 0 and m["episode/truncated"] == 0.5 and m["timing/tool_s"] >= 0
    # one call for every first turn, then the two callers' answers: together, or each as its tool answers (overlap)
    assert m["rollout/engine_calls"] in (2, 3) and m["timing/tool_wait_s"] >= 0
    called = rows.samples[0]
    observation = [t for t, s in zip(called.token_ids, called.sampled) if not s]
    assert tokenizer.decode(observation) == "<|user|><tool_response>\n408\n</tool_response><|end|><|assistant|>"
    assert m["episode/observation_tokens"] == len(observation) / 2
    assert rollout.generated_tokens == sum(sum(s.sampled) for s in rows.samples)

    batch = assemble(rows, seq_length=1000, pad_token_id=0, temperature=1.0)
    p = len(called.prompt_ids)
    expected = torch.zeros(1000, dtype=torch.bool)
    expected[p - 1 : p - 1 + len(called.token_ids)] = torch.tensor(called.sampled)
    assert torch.equal(batch.loss_mask[0], expected) and torch.equal(batch.fresh_mask[0], expected)
    assert int(batch.response_mask[0].sum()) == len(called.token_ids)  # the critic still sees every token
    logprobs = batch.scatter([s.logprobs for s in rows.samples])
    assert torch.all(logprobs[0][batch.loss_mask[0]] == -0.5) and torch.all(logprobs[0][~expected] == 0)
    source.close()


def test_dynamic_sampling_keeps_only_groups_whose_episodes_differ(tokenizer):
    behaviour = {"11 * 11": "right", "12 * 12": "call", "13 * 13": "runaway", "14 * 14": "call"}
    recipe = dataclasses.replace(get_recipe("dapo"), overlong=None)
    source = _source(tokenizer, behaviour, recipe, prompts_per_step=2, group_size=2)
    rollout = source.collect(Sampling(n=2))
    # every group's episodes agree (all right or all truncated): nothing is kept, every batch refills
    assert rollout.metrics["rollout/kept_groups"] == 0 and len(rollout.rows) == 0
    assert rollout.metrics["rollout/generation_batches"] == recipe.max_gen_batches
    assert source.state_dict()["data"] == source.prompts.loader.state_dict()
    source.close()


def test_seeded_episodes_take_their_seeds_from_the_prompt_and_the_turn(tokenizer):
    """rollout.seed_per_prompt: episode j of the prompt at dataset index i samples turn t with
    prompt_seed(run, epoch, i) + j * max_turns + t, whatever batch it is drawn in (a resumed
    run's engine gets the seeds the uninterrupted run's did)."""
    source = _source(tokenizer, {"12 * 34": "call", "56 * 78": "right"}, get_recipe("grpo"))
    asked = []
    generate = source.colocated.driver.engine.generate

    def recording(prompts, sampling, seeds=None, max_tokens=None):
        asked.append((tokenizer.decode(prompts[0]).count("<tool_response>"), list(seeds)))
        return generate(prompts, sampling, seeds, max_tokens)

    source.colocated.driver.engine.generate = recording
    source.collect(Sampling(n=2, prompt_seed=7))
    first, second = prompt_seed(7, 0, 0), prompt_seed(7, 0, 1)  # max_turns=3 in _source
    assert asked[0] == (0, [first, first + 3, second, second + 3])  # every episode's first turn
    assert asked[1] == (1, [first + 1, first + 4])  # the two calling episodes' second turns
    source.close()


def test_episodes_run_ahead_on_the_rollout_ranks_become_the_rows_colocated_ones_do(tokenizer):
    """Disaggregated: each batch's records and seeds go to the rollout ranks as one
    GenerateEpisodes command, a batch ahead at max_staleness 1; their answer becomes the
    rows, metrics and data position a colocated source gives, plus the staleness."""
    behaviour = {"12 * 34": "call", "56 * 78": "runaway", "11 * 11": "right", "13 * 13": "call"}
    sampling = Sampling(n=2, prompt_seed=7)
    here = _source(tokenizer, behaviour, get_recipe("grpo"))
    ranks = ScriptedRolloutRanks(_episodes(tokenizer, behaviour))
    ahead = _source(tokenizer, behaviour, get_recipe("grpo"), client=ranks, depth=1)

    local, remote = here.collect(sampling), ahead.collect(sampling)
    assert [type(c) for c, _ in ranks.commands] == [GenerateEpisodes, GenerateEpisodes]  # the next batch in flight
    first = ranks.commands[0][0]
    assert [r.location for r in first.records] == ["row 0", "row 0", "row 1", "row 1"]
    assert first.seeds == [
        prompt_seed(7, 0, 0),
        prompt_seed(7, 0, 0) + 3,
        prompt_seed(7, 0, 1),
        prompt_seed(7, 0, 1) + 3,
    ]
    assert [s.token_ids for s in remote.rows.samples] == [s.token_ids for s in local.rows.samples]
    assert [s.sampled for s in remote.rows.samples] == [s.sampled for s in local.rows.samples]
    assert remote.rows.correct == local.rows.correct == [1.0, 1.0, 0.0, 0.0]
    for name in ("episode/turns_mean", "episode/tool_calls", "episode/truncated", "reward/mean", "data/prompts_drawn"):
        assert remote.metrics[name] == local.metrics[name], name
    assert remote.metrics["rollout/staleness_max"] == 0 and remote.metrics["timing/generation_s"] == 0.5
    assert ahead.state_dict()["data"] == here.state_dict()["data"]  # before the batch in flight

    ranks.version = 1  # the step's weights went out after the second batch was submitted
    second = ahead.collect(sampling)
    assert second.metrics["rollout/staleness_max"] == 1 and second.rows.correct == [1.0, 1.0, 1.0, 1.0]
    here.close(), ahead.close()
