"""Episodes as tokens, driven on a scripted engine (no vLLM): the observation tokens are
the chat template's, the sampled ids are kept as sampled, the flat arrays follow the
batch's prediction alignment, limits truncate, and a single-turn task is the one-turn case."""

import copy
import time

import pytest
import torch

from megatron_rl.data.prompts import encode_prompt as data_encode_prompt
from megatron_rl.environments.driver import DriverConfig, EpisodeDriver
from megatron_rl.environments.episode import NOT_SAMPLED, EpisodeLimits, ObservationEncoder, encode_prompt
from megatron_rl.environments.interface import EnvironmentSetup, EpisodeRecord, Step
from megatron_rl.environments.registry import get_environment
from megatron_rl.environments.tool_calls import ToolResult, ToolSpec
from megatron_rl.rollout.types import Sample
from megatron_rl.schedules.batch import pack_sequences

PYTHON = ToolSpec(
    "python",
    "Evaluate a Python expression",
    {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
)


class EvalRunner:
    """A deterministic stand-in for the sandbox (tests only): evaluates the code as an expression."""

    def run(self, calls):
        results = []
        for call in calls:
            if call.arguments["code"] == "loop()":
                results.append(ToolResult("timed out", "timeout"))
                continue
            try:
                results.append(ToolResult(str(eval(call.arguments["code"], {"__builtins__": {}}, {"max": max}))))
            except Exception as exc:  # the tool's own failure, reported to the policy
                results.append(ToolResult(f"{type(exc).__name__}: {exc}", "error"))
        return results


class ScriptedEngine:
    """Generates each episode's next scripted turn (ids), keyed by the episode's prompt ids,
    cut to the call's budget; logprobs -0.01, -0.02, ... so every token's value is known."""

    def __init__(self, scripts):
        self.scripts = {tuple(prompt): list(turns) for prompt, turns in scripts}
        self.budgets = []
        self.batches = []
        """Per engine call, which scripts (by their order) it generated for."""

    def generate(self, prompts, sampling, seeds=None, max_tokens=None):
        self.budgets.append(list(max_tokens))
        self.batches.append([])
        out = []
        for ids, budget in zip(prompts, max_tokens):
            key = next(k for k in self.scripts if tuple(ids[: len(k)]) == k)
            self.batches[-1].append(list(self.scripts).index(key))
            tokens = self.scripts[key].pop(0)[:budget]
            finish = "stop" if tokens[-1] in sampling.stop_token_ids else "length"
            out.append([Sample(list(ids), tokens, [-0.01 * (i + 1) for i in range(len(tokens))], finish)])
        return out


def ids(tokenizer, text, eos=True):
    return tokenizer(text, add_special_tokens=False).input_ids + ([tokenizer.eos_token_id] if eos else [])


def call(code):
    return f'<tool_call>{{"name": "python", "arguments": {{"code": "{code}"}}}}</tool_call>'


def tool_env():
    return get_environment("tools", EnvironmentSetup(reward="digits", tools=(PYTHON,), tool_runner=EvalRunner()))


LIMITS = EpisodeLimits(max_turns=4, max_tokens=2048, max_turn_tokens=512)


def run(tokenizer, env, records, turns, limits=LIMITS, overlap=True):
    prompts = [prompt_ids(tokenizer, env, r) for r in records]
    engine = ScriptedEngine(zip(prompts, turns))
    config = DriverConfig(limits=limits, env_threads=2, overlap=overlap)
    with EpisodeDriver(engine, tokenizer, env, config) as driver:
        return driver.run(records, policy_version=3), engine


def prompt_ids(tokenizer, env, record):
    start = env.reset(record)
    return encode_prompt(tokenizer, start.messages, start.tools)


RECORD = EpisodeRecord.from_messages([{"role": "user", "content": "max of 3 7 1"}], "7")


def expected_mask(result):
    mask = torch.zeros_like(result.loss_mask)
    for span in result.spans:
        if span.sampled:
            mask[span.start - 1 : span.stop - 1] = True
    return mask


def test_observation_tokens_are_the_templates_and_the_arrays_are_prediction_aligned(tokenizer):
    turns = [ids(tokenizer, call("max(3, 7, 1)")), ids(tokenizer, "Answer: 7")]
    (result,), _ = run(tokenizer, tool_env(), [RECORD], [[*turns]])
    conversation = [
        *RECORD.messages,
        {"role": "assistant", "content": call("max(3, 7, 1)")},
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "Answer: 7"},
    ]
    text = tokenizer.apply_chat_template(conversation, tools=[PYTHON.schema()], tokenize=False)
    assert result.tokens.tolist() == tokenizer(text, add_special_tokens=False).input_ids
    assert (result.reward, result.end, result.truncated) == (1.0, "done", False)
    c = result.counts
    assert (c.turns, c.tool_calls, c.tool_errors, c.tool_timeouts) == (2, 1, 0, 0)
    observation = tokenizer.decode(result.tokens[result.spans[2].start : result.spans[2].stop])
    assert observation == "<|user|><tool_response>\n7\n</tool_response><|end|><|assistant|>"
    assert c.observation_tokens == result.spans[2].stop - result.spans[2].start
    assert c.sampled_tokens == sum(map(len, turns)) == int(result.loss_mask.sum())
    assert [s.sampled for s in result.spans] == [False, True, False, True]
    assert torch.equal(result.loss_mask, expected_mask(result)) and not result.loss_mask[-1]
    for span, turn in zip([result.spans[1], result.spans[3]], turns):
        assert result.tokens[span.start : span.stop].tolist() == turn
        logprobs = result.old_logprobs[span.start - 1 : span.stop - 1]
        assert torch.allclose(logprobs, torch.tensor([-0.01 * (i + 1) for i in range(len(turn))]))
    assert torch.equal(result.versions >= 0, result.loss_mask) and set(result.versions.tolist()) == {3, NOT_SAMPLED}
    assert torch.equal(result.old_logprobs != 0, result.loss_mask)


def test_the_episode_keeps_sampled_ids_that_the_text_would_tokenize_otherwise(tokenizer):
    """A turn sampled as one byte-level token per character: its text is "Answer: 7", whose
    own tokenization merges characters. Re-tokenizing the conversation would train on ids
    the policy never sampled; the episode keeps the sampled ones."""
    text = "Answer: 7"
    by_bytes = [tokenizer.convert_tokens_to_ids("Ġ" if ch == " " else ch) for ch in text] + [tokenizer.eos_token_id]
    assert tokenizer.decode(by_bytes, skip_special_tokens=True) == text and by_bytes != ids(tokenizer, text)
    env = get_environment("single_turn", EnvironmentSetup(reward="digits"))
    (result,), _ = run(tokenizer, env, [RECORD], [[by_bytes]])
    prompt = data_encode_prompt(tokenizer, RECORD.messages)
    assert result.tokens.tolist() == prompt + by_bytes
    retokenized = tokenizer(tokenizer.decode(result.tokens), add_special_tokens=False).input_ids
    assert retokenized == prompt + ids(tokenizer, text) != result.tokens.tolist()
    assert result.reward == 1.0


def test_a_single_turn_task_is_the_one_turn_case(tokenizer):
    """The existing reward function, as an environment: one turn, reward at once, and the
    arrays the trainer's one-turn batch has (pack_sequences' tokens and loss mask)."""
    from megatron_rl.tasks import DigitAnswerVerifier, get_task

    examples = get_task("digits_max").generate(3, seed=5)
    records = [EpisodeRecord.from_messages([{"role": "user", "content": e.prompt}], e.answer) for e in examples]
    responses = [f"Answer: {examples[0].answer}", "Answer: 0", "no answer"]
    env = get_environment("single_turn", EnvironmentSetup(reward="digits"))
    results, _ = run(tokenizer, env, records, [[ids(tokenizer, r)] for r in responses])
    expected, _ = DigitAnswerVerifier().score_batch(responses, [e.answer for e in examples])
    assert [r.reward for r in results] == expected and expected[0] == 1.0
    for record, response, result in zip(records, responses, results):
        prompt = data_encode_prompt(tokenizer, record.messages)
        tokens, mask = pack_sequences([prompt], [ids(tokenizer, response)], len(result.tokens))
        assert torch.equal(result.tokens, tokens[0]) and torch.equal(result.loss_mask, mask[0])
        assert result.counts.turns == 1 and result.counts.observation_tokens == 0


def test_malformed_calls_failures_and_timeouts_are_answered_and_counted(tokenizer):
    bad_json = '<tool_call>{"name": "python", "arguments": {"code": "1"}</tool_call>'
    turn = call("max(2, 5)") + bad_json + call("1/0") + call("loop()")
    (result,), _ = run(tokenizer, tool_env(), [RECORD], [[ids(tokenizer, turn), ids(tokenizer, "Answer: 5")]])
    c = result.counts
    assert (c.turns, c.tool_calls, c.tool_errors, c.tool_timeouts) == (2, 4, 2, 1)
    observation = tokenizer.decode(result.tokens[result.spans[2].start : result.spans[2].stop])
    assert observation.startswith("<|user|><tool_response>\n5\n</tool_response>\n<tool_response>\nError: ")
    assert "ZeroDivisionError" in observation and "timed out" in observation
    assert result.reward == 0.0


@pytest.mark.parametrize(
    "limits, end, turns",
    [
        (EpisodeLimits(max_turns=2, max_tokens=2048, max_turn_tokens=256), "max_turns", 2),
        (EpisodeLimits(max_turns=4, max_tokens=2048, max_turn_tokens=10), "turn_length", 1),
        (EpisodeLimits(max_turns=4, max_tokens=560, max_turn_tokens=256), "max_tokens", 3),
        (EpisodeLimits(max_turns=4, max_tokens=500, max_turn_tokens=256), "max_tokens", 2),
    ],
)
def test_limits_truncate_after_a_sampled_turn(tokenizer, limits, end, turns):
    """The prompt (tools listed) is 317 tokens with this tokenizer, a call turn 68 and its
    observation 37: two rounds end at 527 tokens, so at 560 the episode's budget cuts the third
    turn (33 tokens left), and at 500 the second observation finds no room."""
    endless = [ids(tokenizer, call("max(3, 7, 1)"))] * 4
    (result,), engine = run(tokenizer, tool_env(), [RECORD], [endless], limits)
    assert (result.end, result.truncated, result.reward) == (end, True, None)
    assert result.counts.turns == turns
    assert result.spans[-1].sampled and len(result.tokens) <= limits.max_tokens
    assert all(b <= limits.max_turn_tokens for call_budgets in engine.budgets for b in call_budgets)
    assert torch.equal(result.loss_mask, expected_mask(result))


class SlowRunner(EvalRunner):
    """The eval runner, taking ``SLOW_S`` on calls whose code starts with ``max``."""

    def run(self, calls):
        if any(c.arguments["code"].startswith("max") for c in calls):
            time.sleep(SLOW_S)
        return super().run(calls)


SLOW_S = 0.5


@pytest.mark.parametrize("overlap", [True, False])
def test_turns_are_generated_while_other_episodes_tools_run(tokenizer, overlap):
    """Episode 0 calls a slow tool once; episode 1 calls two fast ones, then answers. With
    overlap episode 1's later turns are generated while episode 0's tool runs (engine calls
    of episode 1 alone before episode 0's answer), the driver waits only for the slow tool
    once nothing else is left; without, every round waits for it. The episodes are the same."""
    env = get_environment("tools", EnvironmentSetup(reward="digits", tools=(PYTHON,), tool_runner=SlowRunner()))
    other = EpisodeRecord.from_messages([{"role": "user", "content": "9 plus 1"}], "10")
    turns = [
        [ids(tokenizer, call("max(3, 7, 1)")), ids(tokenizer, "Answer: 7")],
        [ids(tokenizer, call("9 + 1")), ids(tokenizer, call("10 * 1")), ids(tokenizer, "Answer: 10")],
    ]
    prompts = [prompt_ids(tokenizer, env, r) for r in (RECORD, other)]
    engine = ScriptedEngine(zip(prompts, turns))
    with EpisodeDriver(engine, tokenizer, env, DriverConfig(limits=LIMITS, env_threads=2, overlap=overlap)) as d:
        started = time.perf_counter()
        results = d.run([RECORD, other])
        seconds, times = time.perf_counter() - started, d.times
    assert [r.reward for r in results] == [1.0, 1.0] and [r.counts.turns for r in results] == [2, 3]
    expected = [[0, 1], [1], [1], [0]] if overlap else [[0, 1], [0, 1], [1]]
    assert engine.batches == expected and times.engine_calls == len(expected)
    assert SLOW_S <= seconds and SLOW_S / 2 < times.wait_s <= seconds  # no turn to generate but episode 0's
    lockstep, _ = run(tokenizer, tool_env(), [RECORD, other], turns, overlap=False)
    assert [r.tokens.tolist() for r in results] == [r.tokens.tolist() for r in lockstep]


def test_the_encoder_refuses_a_template_whose_turns_change_once_followed(tokenizer):
    changing = copy.deepcopy(tokenizer)
    changing.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>"
        "{% if m['role'] == 'assistant' and not loop.last %}(earlier) {% endif %}{{ m['content'] }}<|end|>"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    with pytest.raises(ValueError, match="renders an assistant turn differently"):
        ObservationEncoder(changing).encode([{"role": "user", "content": "more"}])


def test_registry_and_step_contracts():
    with pytest.raises(ValueError, match=r"allowed: \['single_turn', 'tools'\]"):
        get_environment("chess", EnvironmentSetup())
    with pytest.raises(ValueError, match="needs tools and a tool_runner"):
        get_environment("tools", EnvironmentSetup(tools=(PYTHON,)))
    with pytest.raises(ValueError, match="lists no tools"):
        get_environment("single_turn", EnvironmentSetup(tools=(PYTHON,), tool_runner=EvalRunner()))
    with pytest.raises(ValueError, match="reward exactly when done"):
        Step(done=True)
    with pytest.raises(ValueError, match="needs observation messages"):
        Step(done=False)
