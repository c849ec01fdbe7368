"""The tool recipe end to end at world 1: real vLLM episodes whose python calls run in the
sandbox, Megatron updates and weight syncs, on a small MoE tool base built for the module
(a short warm-up that calls the tool on 90 % of its prompts, so steps hold calls), with
router replay: Megatron's forward passes use the experts vLLM chose, turn after turn.

What it checks: the episode metrics are logged and count calls and tool output; the
policy loss covers exactly the sampled tokens (``actor/loss_tokens`` is the episodes'
sampled tokens, the response is sampled + observation tokens); every input position of
every episode has vLLM's routes, and vLLM's logprobs match Megatron's (fp32, replayed
routes) on the tokens compared, which they would not if a tool token (logprob 0 from
vLLM) were among them or one turn's routes were shifted. The run saves after each step:
resumed from its step-1 checkpoint, step 2 is the uninterrupted run's step 2, every
sampled, scored and trained metric equal. The same recipe in bf16 trains a step with
vLLM's and Megatron's logprobs within bf16's limits.

The small base never answers right (its calls copy the factors wrong: reward 0 on every
episode), so these runs shape the reward by length (DAPO's overlong ramp over 32-96
tokens): groups have reward spread and the updates real gradients.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from megatron_rl.tasks.base_model import BaseModelSettings, make_tiny_base
from megatron_rl.tasks.tool_products import ToolBaseSettings
from megatron_rl_lab.testing.torchrun import _free_port, run_process_group

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SMALL = BaseModelSettings(
    family="qwen3_moe",
    hidden_size=64,
    tokenizer_vocab_size=512,
    num_train_prompts=200,
    num_eval_prompts=8,
    warmup_steps=80,
)
EPISODES = 4 * 4
"""rollout.prompts_per_step x rollout.n_samples of every run here."""
NOT_COMPARED = ("timing/", "throughput/")
"""Wall-clock times; everything sampled, scored and trained on is compared exactly."""
FP32_LOGPROB = 1e-5
"""|logprob(vLLM) - logprob(Megatron)| of the sampled tokens in fp32 (docs/episodes.md)."""
BF16_PARITY_MEDIAN = 0.015
BF16_MISMATCH_K3 = 5e-3
"""bf16 tiny MoE (test_trainer's limits; docs/benchmarks.md, "bf16 end to end")."""


@pytest.fixture(scope="module")
def tool_base(tmp_path_factory):
    settings = ToolBaseSettings(model=SMALL, call_fraction=0.9)
    return make_tiny_base(tmp_path_factory.mktemp("tool-base") / "base", settings, verbose=False)["directory"]


def _train(run_dir, base, *overrides, steps=2, world=1):
    launcher = ["-m", "torch.distributed.run", f"--nproc-per-node={world}", f"--master-port={_free_port()}"]
    cmd = [
        sys.executable,
        *(launcher if world > 1 else []),
        "-m",
        "megatron_rl",
        "train",
        "--config",
        "examples/tool_grpo.yaml",
        f"trainer.run_dir={run_dir}",
        f"model.hf_path={base}",
        f"data.source={base}/train.jsonl",
        "data.reward=digits",
        f"trainer.max_steps={steps}",
        "rollout.prompts_per_step=4",
        "rollout.n_samples=4",
        "rollout.parity_every=1",
        "trainer.seq_length=232",  # the parity guard scores whole episodes in vLLM: one position to spare
        "trainer.loggers=[]",
        "rollout.router_replay=true",
        "algorithm.overrides={overlong: {max_len: 96, buffer_len: 64}}",  # reward spread (module docstring)
        *overrides,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = run_process_group(cmd, env, timeout_s=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, proc.stdout


SAVED = ("checkpoint.save_interval=1", "checkpoint.keep_last=2", "environment.overlap=false")
"""Saved every step; lockstep rounds (with overlap, which turns share an engine call, and so
the generator's draws, follow the tools' timing)."""


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, tool_base):
    """The tool recipe for 2 steps, saved after each: (run dir, rows, stdout)."""
    run_dir = tmp_path_factory.mktemp("tool-run") / "run"
    rows, out = _train(run_dir, tool_base, *SAVED)
    return run_dir, rows, out


def test_tool_recipe_trains_two_steps_with_tool_output_out_of_the_loss(saved_run):
    _, rows, out = saved_run
    assert "tool sandbox:" in out
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("turns_mean", "tool_calls", "tool_errors", "tool_timeouts", "observation_tokens"):
            assert f"episode/{key}" in r, key
        assert r["timing/tool_s"] >= 0 and r["episode/turns_mean"] >= 1
        sampled, observed = r["episode/sampled_tokens"], r["episode/observation_tokens"]
        assert r["response_length/mean"] == pytest.approx(sampled + observed)
        assert r["rollout/router_missing_routes"] == 0, r  # every position of every turn routed
        assert r["actor/updated"] and r["actor/grad_norm"] > 0, r
        assert r["actor/loss_tokens"] == round(sampled * EPISODES), r
        assert r["rollout/logprob_abs_diff"] < FP32_LOGPROB, r
        assert r["rollout/parity_max_abs_diff"] < 1e-4, r  # whole episodes of ~170 tokens
    assert sum(r["episode/tool_calls"] for r in rows) > 0
    assert sum(r["episode/observation_tokens"] for r in rows) > 0


def test_a_run_resumed_from_its_step_1_checkpoint_trains_the_uninterrupted_step_2(tmp_path, saved_run, tool_base):
    """The step-1 checkpoint (no episode in flight: a step's episodes end within it) and the
    metrics up to it, in a run dir of their own; resumed, the run's step 2 samples the same
    episodes (vLLM samples from torch's generator, whose state the checkpoint holds), calls
    the same tools and trains the same update from the same optimizer state."""
    run_dir, rows, _ = saved_run
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(run_dir / "checkpoints" / "step_1", resumed_dir / "checkpoints" / "step_1")
    shutil.copy(run_dir / "metrics.jsonl", resumed_dir / "metrics.jsonl")  # the resume drops the step-2 row
    resumed, out = _train(resumed_dir, tool_base, *SAVED)
    assert "resumed from" in out and "step 1" in out, out[-2000:]
    assert [r["step"] for r in resumed] == [1, 2] and resumed[0] == rows[0]
    got, want = resumed[1], rows[1]
    assert set(got) == set(want)
    compared = {k for k in want if not k.startswith(NOT_COMPARED)}
    assert {k: got[k] for k in compared} == {k: want[k] for k in compared}, (got, want)


def test_the_tool_recipe_in_bf16_trains_within_bf16s_limits(tmp_path, tool_base):
    """bf16 weights (fp32 main parameters), vLLM in bf16: the step's update is synced, read
    back, and vLLM then scores the episodes within bf16's limits of Megatron."""
    (r,), _ = _train(tmp_path / "bf16", tool_base, "model.dtype=bf16", steps=1)
    assert r["actor/updated"] and r["actor/grad_norm"] > 0 and r["rollout/weight_check_elements"] > 0, r
    assert r["episode/tool_calls"] > 0 and r["rollout/router_missing_routes"] == 0, r
    assert r["rollout/parity_median_abs_diff"] < BF16_PARITY_MEDIAN, r
    assert 0 <= r["rollout/mismatch_k3_kl"] < BF16_MISMATCH_K3, r


AHEAD = (
    "rollout.placement=disaggregated",
    "rollout.max_staleness=1",
    "algorithm.overrides={overlong: {max_len: 96, buffer_len: 64}, rollout_correction: {kind: token_tis, cap: 2.0}}",
    "rollout.seed_per_prompt=true",
    "checkpoint.save_interval=1",
)
"""Episodes on rollout ranks of their own, one batch ahead of training (max_staleness 1
needs a rollout correction), seeded from their prompts so that which replica runs an
episode does not change it."""
SAMPLED = ("reward/mean", "response_length/mean", "episode/", "data/prompts_drawn", "rollout/kept_groups")
"""What seeded episodes sampled and the environment scored: equal wherever they ran."""


def _sampled(row):
    return {k: v for k, v in row.items() if k.startswith(SAMPLED)}


def test_episodes_on_two_rollout_ranks_one_batch_ahead_then_resumed_with_a_batch_in_flight(tmp_path, tool_base):
    """World 3: one training rank, two rollout ranks whose drivers each run half of every
    batch (their tools on their ranks), one batch ahead. Expected from a colocated world-2
    run of the same seeded episodes (two replicas on the training ranks, data parallel)
    without running ahead: step 1 (generated by the start weights in both) samples, scores
    and trains the same episodes (the loss up to the order of the data-parallel sum); step 2
    here trains episodes the start weights generated (staleness 1). Resumed at world 2 (one
    rollout rank) from the step-1 checkpoint, whose data position comes before the batch
    that was in flight, step 2 draws that batch again, now generated by the step-1 weights:
    the colocated run's step 2."""
    colocated, _ = _train(tmp_path / "colocated", tool_base, "rollout.seed_per_prompt=true", world=2)
    ahead_dir = tmp_path / "ahead"
    ahead, _ = _train(ahead_dir, tool_base, *AHEAD, "rollout.num_ranks=2", world=3)
    assert _sampled(ahead[0]) == _sampled(colocated[0])
    assert ahead[0]["actor/pg_loss"] == pytest.approx(colocated[0]["actor/pg_loss"], rel=1e-4, abs=1e-6)
    assert [r["rollout/staleness_max"] for r in ahead] == [0, 1]
    assert ahead[0]["rollout/logprob_abs_diff"] < FP32_LOGPROB  # a stale batch differs by its update
    assert all(r["rollout/router_missing_routes"] == 0 and r["episode/tool_calls"] > 0 for r in ahead), ahead

    resumed_dir = tmp_path / "resumed"
    shutil.copytree(ahead_dir / "checkpoints" / "step_1", resumed_dir / "checkpoints" / "step_1")
    shutil.copy(ahead_dir / "metrics.jsonl", resumed_dir / "metrics.jsonl")
    resumed, out = _train(resumed_dir, tool_base, *AHEAD, "rollout.num_ranks=1", world=2)
    assert "resumed from" in out and "step 1" in out, out[-2000:]
    assert resumed[1]["rollout/staleness_max"] == 0
    assert _sampled(resumed[1]) == _sampled(colocated[1])
    assert resumed[1]["data/prompts_drawn"] == ahead[1]["data/prompts_drawn"]  # no prompt lost or repeated


def test_the_tool_bench_runs_on_a_base_it_is_given(tmp_path, tool_base):
    """`megatron-rl bench tools` end to end on this module's base (a short service-tool run):
    every mode generates and the summary's ratio is the modes' own tokens/s over each other."""
    out = tmp_path / "bench.json"
    cmd = [
        *(os.path.join(os.path.dirname(sys.executable), "megatron-rl"), "bench", "tools"),
        *("--base", tool_base, "--dir", str(tmp_path), "--batches", "2"),
        *("--set", "rollout.prompts_per_step=2", "--tool", "service", "--tool-seconds", "0.01,0.02"),
        *("--json", str(out)),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(out.read_text())
    modes = result["modes"]  # the timed batches' sums (the first batch warms the engine up)
    assert set(modes) == {"overlap", "lockstep", "single_turn"} and result["timed_batches"] == 1
    for name, mode in modes.items():
        assert mode["tokens"] > 0 and mode["tokens_per_s"] == pytest.approx(mode["tokens"] / mode["seconds"]), name
    assert (
        modes["overlap"]["episodes"] == modes["lockstep"]["episodes"] == result["episodes_per_batch"] == 2 * 8
    )  # the recipe's 8 per prompt
    ratio = modes["overlap"]["tokens_per_s"] / modes["single_turn"]["tokens_per_s"]
    assert result["overlap_vs_single_turn"] == pytest.approx(ratio)
