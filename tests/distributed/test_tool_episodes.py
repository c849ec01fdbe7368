"""The tool recipe end to end at world 1: real vLLM episodes whose python calls run in the
sandbox, Megatron updates and weight syncs for 2 steps, on a small tool base built for the
module (a short warm-up that calls the tool on 90 % of its prompts, so steps hold calls).

What it checks: the episode metrics are logged and count calls and tool output; the
policy loss covers exactly the sampled tokens (``actor/loss_tokens`` is the episodes'
sampled tokens, the response is sampled + observation tokens), and vLLM's logprobs match
Megatron's on the tokens compared, which they would not if a tool token (logprob 0 from
vLLM) were among them."""

import json
import os
import sys

import pytest

from megatron_rl.tasks.base_model import BaseModelSettings, make_tiny_base
from megatron_rl.tasks.tool_products import ToolBaseSettings
from megatron_rl_lab.testing.torchrun import run_process_group

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SMALL = BaseModelSettings(
    family="qwen3",
    hidden_size=64,
    tokenizer_vocab_size=512,
    num_train_prompts=200,
    num_eval_prompts=8,
    warmup_steps=80,
)


@pytest.fixture(scope="module")
def tool_base(tmp_path_factory):
    settings = ToolBaseSettings(model=SMALL, call_fraction=0.9)
    return make_tiny_base(tmp_path_factory.mktemp("tool-base") / "base", settings, verbose=False)["directory"]


def test_tool_recipe_trains_two_steps_with_tool_output_out_of_the_loss(tmp_path, tool_base):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "megatron_rl",
        "train",
        "--config",
        "examples/tool_grpo.yaml",
        f"trainer.run_dir={run_dir}",
        f"model.hf_path={tool_base}",
        f"data.source={tool_base}/train.jsonl",
        "data.reward=digits",
        "trainer.max_steps=2",
        "rollout.prompts_per_step=4",
        "rollout.n_samples=4",
        "rollout.parity_every=1",
        "trainer.seq_length=232",  # the parity guard scores whole episodes in vLLM: one position to spare
        "trainer.loggers=[]",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = run_process_group(cmd, env, timeout_s=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert "tool sandbox:" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    episodes = 4 * 4
    for r in rows:
        for key in ("turns_mean", "tool_calls", "tool_errors", "tool_timeouts", "observation_tokens"):
            assert f"episode/{key}" in r, key
        assert r["timing/tool_s"] >= 0 and r["episode/turns_mean"] >= 1
        sampled, observed = r["episode/sampled_tokens"], r["episode/observation_tokens"]
        assert r["response_length/mean"] == pytest.approx(sampled + observed)
        if r["actor/updated"]:
            assert r["actor/loss_tokens"] == round(sampled * episodes), r
            assert r["rollout/logprob_abs_diff"] < 1e-5, r
            assert r["rollout/parity_max_abs_diff"] < 1e-4, r  # whole episodes of ~170 tokens
    assert sum(r["episode/tool_calls"] for r in rows) > 0
    assert sum(r["episode/observation_tokens"] for r in rows) > 0
