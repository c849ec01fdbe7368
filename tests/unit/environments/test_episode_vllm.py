"""Multi-turn tool-using episodes on a real vLLM engine (tiny tool-trained base, a
deterministic tool runner): the episodes hold exactly the tokens and logprobs vLLM
returned, observation tokens are never trained on, and the logprobs the trainer recomputes
with Megatron on an episode's sampled tokens equal vLLM's (fp32)."""

from pathlib import Path

import pytest

from megatron_rl_lab.testing.torchrun import launch

BODY = Path(__file__).with_name("episode_probe.py")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    results = launch(BODY, 1, args=[str(tmp_path_factory.mktemp("episodes"))], timeout_s=900)
    for case, outcome in results.items():
        assert outcome["ok"], f"{case}: {outcome['error']}"
    return {case: outcome["result"] for case, outcome in results.items()}


def sampled_positions(episode):
    return [t for t, m in enumerate(episode["loss_mask"]) if m]


def test_the_base_calls_the_tool_and_episodes_take_several_turns(probe):
    episodes = probe["episodes"]["episodes"]
    assert all(e["end"] == "done" and e["reward"] in (0.0, 1.0) for e in episodes)
    assert sum(e["counts"]["turns"] >= 2 for e in episodes) >= len(episodes) // 2
    assert sum(e["counts"]["tool_calls"] - e["counts"]["tool_errors"] for e in episodes) >= 1
    assert any("<tool_response>" in e["text"] for e in episodes)


def test_sampled_tokens_and_logprobs_are_what_vllm_returned(probe):
    """Every engine result, in order, is one turn of one episode: its prompt is the episode's
    tokens so far (token in), its tokens and logprobs the turn's (token out)."""
    out = probe["episodes"]
    turns = [(e, s) for e in out["episodes"] for s in e["spans"] if s[2]]
    assert len(turns) == len(out["samples"]) == sum(e["counts"]["turns"] for e in out["episodes"])
    for sample in out["samples"]:
        matches = [
            (e, s)
            for e, s in turns
            if e["tokens"][: s[0]] == sample["prompt"] and e["tokens"][s[0] : s[1]] == sample["tokens"]
        ]
        assert len(matches) == 1, sample
        e, (start, stop, _) = matches[0]
        assert e["old_logprobs"][start - 1 : stop - 1] == sample["logprobs"]
        assert all(v == 1 for v in e["versions"][start - 1 : stop - 1])


def test_observation_and_prompt_tokens_are_never_trained_on(probe):
    for e in probe["episodes"]["episodes"]:
        for start, stop, sampled in e["spans"]:
            predicted = e["loss_mask"][max(start - 1, 0) : stop - 1]
            assert all(predicted) if sampled else not any(predicted)
        observed = sum(stop - start for start, stop, sampled in e["spans"][1:] if not sampled)
        assert observed == e["counts"]["observation_tokens"]
        assert sum(e["loss_mask"]) == e["counts"]["sampled_tokens"] and not e["loss_mask"][-1]


def test_recomputed_logprobs_equal_vllms_on_the_sampled_tokens(probe):
    """T = 1: vLLM's sampled logprobs against Megatron's compute_logprobs (what the trainer
    uses as the current policy), transformers and vLLM's own prefill on the whole episode."""
    worst = {"megatron": 0.0, "transformers": 0.0, "vllm_prefill": 0.0}
    megatron = probe["megatron"]["logprobs"]
    for n, e in enumerate(probe["episodes"]["episodes"]):
        for t in sampled_positions(e):
            for name, values in (
                ("megatron", megatron[n]),
                ("transformers", e["transformers"]),
                ("vllm_prefill", e["vllm_prefill"]),
            ):
                worst[name] = max(worst[name], abs(values[t] - e["old_logprobs"][t]))
    assert max(worst.values()) < 1e-5, worst  # measured: Megatron and transformers 9.5e-7, prefill 0
