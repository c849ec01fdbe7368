"""What the trainer's end-to-end modules share (test_trainer*.py): the tiny bases, the
overrides of a tiny run, the launch and the per-step checks.

The bases are built once per test session, in the session's base cache
(``MEGATRON_RL_BASE_CACHE``, tests/conftest.py) and under its lock, so that modules on
either pytest-xdist worker use one build."""

import json
import os
import sys
from pathlib import Path

from megatron_rl.tasks.base_model import BaseModelSettings, make_tiny_base
from megatron_rl_lab.testing.torchrun import _free_port, run_process_group

FP32_ROUTER_AGREEMENT = 0.99
"""Share of (token, layer) where Megatron's top-k equals vLLM's in fp32 (ties are rare)."""
FP32_PARITY_MAX = 1e-5
"""Largest fp32 |logprob(vLLM) - logprob(Megatron)| after a sync (measured <= 2e-6)."""
BF16_PARITY_MEDIAN = 0.015
BF16_MISMATCH_K3 = 5e-3
"""bf16 tiny MoE: median |dlogp| after a sync (measured 0.008 on the weight-sync test's
model) and the k3 KL(vLLM || Megatron) of the sampled tokens (docs/benchmarks.md, "bf16")."""

# A warm-up with some true answers: rewards vary within groups from the first step.
SMALL = dict(
    task="digits_max",
    num_train_prompts=300,
    num_eval_prompts=32,
    warmup_steps=30,
    hidden_size=64,
    warmup_correct_fraction=0.5,
)

FAMILIES = ("qwen3", "qwen3_moe")


def cached_base(settings) -> str:
    """The base ``settings`` build, in this session's base cache (built on first use)."""
    directory = Path(os.environ["MEGATRON_RL_BASE_CACHE"]) / settings.content_hash()  # trainer.setup's layout
    return make_tiny_base(directory, settings, verbose=False)["directory"]


def small_base(family: str) -> str:
    """The SMALL base of ``family`` (qwen3 or qwen3_moe)."""
    return cached_base(BaseModelSettings(family=family, **SMALL))


def small_bases() -> dict[str, str]:
    """{family: base directory} of the SMALL bases, dense and MoE."""
    return {family: small_base(family) for family in FAMILIES}


def tiny_run(run_dir, base) -> list[str]:
    """The overrides every run of these modules shares: a tiny base and its prompts,
    small steps (4 prompts x 4 samples), micro-batches of 2."""
    return [
        f"trainer.run_dir={run_dir}",
        f"model.hf_path={base}",
        f"data.source={base}/train.jsonl",
        "data.reward=digits",
        "rollout.prompts_per_step=4",
        "rollout.n_samples=4",
        "trainer.micro_batch_size=2",
    ]


def train(tmp_path, world, base, recipe, *overrides, steps=3, env=None):
    run_dir, port = tmp_path / f"run-{recipe}", _free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={world}",
        f"--master-port={port}",
        "-m",
        "megatron_rl",
        "train",
        "--config",
        "examples/dapo.yaml",
        *tiny_run(run_dir, base),
        f"algorithm.recipe={recipe}",
        "algorithm.overrides={}",
        f"trainer.max_steps={steps}",
        "rollout.parity_every=1",
        "eval.sets={}",  # the recipe's held-out split is the task base's; named again where a test evaluates
        *overrides,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **(env or {}))
    proc = run_process_group(cmd, env, timeout_s=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    # The ranks end without vLLM's shutdown (launch.process_exit) and free its shared memory
    # themselves: no CPU communicator segment of this job is left, no queue for the tracker.
    assert not [p.name for p in Path("/dev/shm").glob(f"mrl*_{port}-*")]
    assert "leaked shared_memory" not in proc.stderr, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, proc.stdout


def check_steps(rows, steps=3):
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for key in (
        "reward/mean",
        "response_length/mean",
        "timing/step_s",
        "timing/rollout_s",
        "timing/train_s",
        "timing/weight_sync_s",
        "throughput/tokens_per_s",
    ):
        assert all(key in r for r in rows), key
    trained = [r for r in rows if r["rollout/kept_groups"] > 0]
    assert trained, "no step had a group with reward spread; nothing was trained"
    for r in trained:
        assert r["rollout/logprob_abs_diff"] < 1e-3, r
        assert r["rollout/parity_max_abs_diff"] < FP32_PARITY_MAX, r  # vLLM == Megatron after the sync
        if r["actor/updated"]:  # a step that synced: vLLM's weights were read back
            assert r["rollout/weight_check_elements"] > 0, r
        for key in ("actor/pg_loss", "actor/clipfrac", "actor/entropy", "actor/grad_norm"):
            assert key in r or not r["actor/updated"]


NOT_COMPARED = (
    "val/",
    "timing/",
    "throughput/",
    "rollout/logprob_abs_diff",
    "rollout/mismatch_k3_kl",
    "rollout/parity_",
    "rollout/weight_check_elements",
    "rollout/weight_sync_broadcast",
)
"""Times, how the weight sync gathered, what vLLM's logprobs enter (they may differ in the
last bits with the batch an engine runs a prompt in) and the evaluation one run does;
everything trained on is compared exactly."""
