"""The RL trainer end to end under torchrun/gloo: real vLLM rollouts, Megatron updates and
weight syncs for 3 steps, dense and MoE actors, with the train/inference logprob mismatch
measured before the first update.

Launches: a dense actor at TP2 with two vLLM TP1 replicas (world 2), and a MoE actor at
TP2*EP2 with four vLLM TP1 replicas (world 4). Both start from a tiny supervised base built
once for the module.
"""

import json
import os
import subprocess
import sys

import pytest

from megatron_rl.tasks.base_model import BaseModelSettings, make_tiny_base
from megatron_rl.testing.torchrun import _free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# A warm-up with some true answers: rewards vary within groups from the first step.
SMALL = dict(task="digits_max", num_train_prompts=300, num_eval_prompts=32, warmup_steps=30, hidden_size=64,
             warmup_correct_fraction=0.5)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    return {
        family: make_tiny_base(root / family, BaseModelSettings(family=family, **SMALL), verbose=False)["directory"]
        for family in ("qwen3", "qwen3_moe")
    }


def _train(tmp_path, world, base, recipe, *overrides, steps=3):
    run_dir = tmp_path / f"run-{recipe}"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
           f"--master-port={_free_port()}", "-m", "megatron_rl", "train", "--config", "examples/dapo.yaml",
           f"trainer.run_dir={run_dir}", f"model.hf_path={base}", f"data.source={base}/train.jsonl",
           "data.reward=digits", f"algorithm.recipe={recipe}", "algorithm.overrides={}",
           f"trainer.max_steps={steps}", "rollout.prompts_per_step=4", "rollout.n_samples=4",
           "trainer.micro_batch_size=2", "rollout.parity_every=1", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, proc.stdout


def _check(rows):
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("reward/mean", "response_length/mean", "timing/step_s", "timing/rollout_s", "timing/train_s",
                "timing/weight_sync_s", "throughput/tokens_per_s"):
        assert all(key in r for r in rows), key
    trained = [r for r in rows if r["rollout/kept_groups"] > 0]
    assert trained, "no step had a group with reward spread; nothing was trained"
    for r in trained:
        assert r["rollout/logprob_abs_diff"] < 1e-3, r
        assert r["rollout/parity_max_abs_diff"] < 1e-3, r  # vLLM == Megatron after the sync
        for key in ("actor/pg_loss", "actor/clipfrac", "actor/entropy", "actor/grad_norm"):
            assert key in r


def test_grpo_dense_tp2_world2_then_resume_in_dp2(tmp_path, bases):
    rows, _ = _train(tmp_path, 2, bases["qwen3"], "grpo", "parallel.tensor_model_parallel_size=2")
    _check(rows)
    # Resume from the step-3 checkpoint in another layout (DP2 instead of TP2) for one more step.
    resumed, out = _train(tmp_path, 2, bases["qwen3"], "grpo", steps=4)
    assert "step 3" in out and "resumed from" in out, out[-2000:]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert resumed[:3] == rows  # the first run's rows are kept as they were
    # vLLM sampled step 4 with the loaded weights: its logprobs match Megatron's recomputation.
    assert resumed[3]["rollout/logprob_abs_diff"] < 1e-3, resumed[3]


def test_dapo_moe_tp2_ep2_world4_with_monitor(tmp_path, bases):
    rows, _ = _train(tmp_path, 4, bases["qwen3_moe"], "dapo", "parallel.tensor_model_parallel_size=2",
                     "parallel.expert_model_parallel_size=2", "monitor.enabled=true",
                     "monitor.detect_every_steps=1", "monitor.interval_s=0.2")
    _check(rows)
    # The monitor sampled this machine and ran the detector each step: a healthy box, no alerts.
    assert all(r["monitor/declared_machines"] == 0 for r in rows)
    traces = list((tmp_path / "run-dapo" / "monitor" / "traces").glob("*.csv"))
    assert len(traces) == 1 and len(traces[0].read_text().splitlines()) > 2


def test_vapo_value_pretraining_then_policy_world2(tmp_path, bases):
    """Critic-only steps on the frozen initial policy lower the value loss; then PPO starts."""
    # An overlong limit below every response's length shifts all returns by -1: a critic that
    # starts near 0 has a large error it can only lose by learning the return level.
    rows, _ = _train(tmp_path, 2, bases["qwen3"], "vapo",
                     "algorithm.overrides={value_warmup_steps: 4, overlong: {max_len: 2, buffer_len: 1}}",
                     "rollout.prompts_per_step=8", steps=5)
    assert [r["actor/updated"] for r in rows] == [False] * 4 + [True]
    assert all(r["timing/weight_sync_s"] == 0.0 for r in rows[:4])  # frozen policy: nothing to sync
    # The critic's error on the first warm-up batch, before step 1 and after step 4.
    before, after = rows[0]["critic/warmup_probe_loss"], rows[3]["critic/warmup_probe_loss"]
    assert after < 0.5 * before, (before, after)
    assert "critic/explained_var" in rows[-1] and "actor/pg_loss" in rows[-1]
    assert rows[-1]["rollout/parity_max_abs_diff"] < 1e-3
