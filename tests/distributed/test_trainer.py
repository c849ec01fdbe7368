"""The RL trainer end to end under torchrun/gloo: real vLLM rollouts, Megatron updates and
weight syncs for 3 steps, dense and MoE actors, with the train/inference logprob mismatch
measured before the first update.

Launches: a dense actor at TP2 with two vLLM TP1 replicas (world 2), the same with vLLM on
two rollout ranks of their own (world 4, disaggregated, evaluating there) and two rollout
ranks running a batch ahead with partial rollouts (world 3), and a MoE actor at
TP2*EP2 with four vLLM TP1 replicas (world 4); VAPO and T-PPO (generation windows carried
across steps, then resumed) with a dense actor and critic at world 2. Both start from a tiny supervised base built
once for the module.
"""

import json
import os
import sys
from pathlib import Path

import pytest

from megatron_rl.rollout.remote import CHUNK_PAUSE_ENV
from megatron_rl.tasks.base_model import BaseModelSettings, make_tiny_base
from megatron_rl_lab.testing.torchrun import _free_port, descendants, kill_tree, run_process_group

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

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


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    return {
        family: make_tiny_base(root / family, BaseModelSettings(family=family, **SMALL), verbose=False)["directory"]
        for family in ("qwen3", "qwen3_moe")
    }


def _tiny_run(run_dir, base) -> list[str]:
    """The overrides every run of this module shares: the module's tiny base and its prompts,
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


def _train(tmp_path, world, base, recipe, *overrides, steps=3, env=None):
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
        *_tiny_run(run_dir, base),
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


def _check(rows):
    _check_steps(rows, 3)


def _check_steps(rows, steps):
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


@pytest.fixture(scope="module")
def grpo_tp2(tmp_path_factory, bases):
    """GRPO, dense actor at TP2, two colocated vLLM replicas (world 2), prompts seeded one by
    one (the same samples whichever engine draws them), evaluated on the base's held-out
    prompts after steps 2 and 3: (run root, metric rows). The disaggregated run below, which
    evaluates at the start and after every step, must train exactly what this one does."""
    root = tmp_path_factory.mktemp("grpo-tp2")
    rows, _ = _train(root, 2, bases["qwen3"], "grpo", *GRPO_TP2, *_eval_on(bases["qwen3"]))
    return root, rows


def _eval_on(base):
    """Evaluation of the base's 32 held-out prompts (a file: these runs read the base's train.jsonl)."""
    return (
        f"eval.sets.held_out.source={base}/eval.jsonl",
        "eval.at_start=false",  # one row per step: the resumed run below compares them
        "eval.every=2",
        "eval.at_end=true",
        "eval.pass_k=[1,2,4]",
    )


GRPO_TP2 = ("parallel.tensor_model_parallel_size=2", "rollout.seed_per_prompt=true")
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


def test_grpo_dense_tp2_world2_then_resume_in_dp2(grpo_tp2, bases):
    root, rows = grpo_tp2
    _check(rows)
    _check_eval(root / "run-grpo", rows, evaluated=[2, 3], prompts=32, n=4, pass_k=[1, 2, 4])
    # Resume from the step-3 checkpoint in another layout (DP2 instead of TP2) for one more step.
    resumed, out = _train(root, 2, bases["qwen3"], "grpo", "rollout.seed_per_prompt=true", steps=4)
    assert "step 3" in out and "resumed from" in out, out[-2000:]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert resumed[:3] == rows  # the first run's rows are kept as they were
    # vLLM sampled step 4 with the loaded weights: its logprobs match Megatron's recomputation.
    assert resumed[3]["rollout/logprob_abs_diff"] < 1e-3, resumed[3]


def _check_eval(run_dir, rows, evaluated, prompts, n, pass_k):
    """val/ metrics after the evaluated steps only, each recomputed from eval/step_<N>.jsonl
    (pass@k independently, from the binomials)."""
    import math

    assert [r["step"] for r in rows if "val/held_out/accuracy" in r] == evaluated
    for r in rows:
        if r["step"] not in evaluated:
            continue
        records = [json.loads(line) for line in (run_dir / "eval" / f"step_{r['step']}.jsonl").read_text().splitlines()]
        assert [x["prompt_id"] for x in records] == list(range(prompts)) and {x["n"] for x in records} == {n}
        samples = prompts * n
        assert r["val/held_out/accuracy"] == pytest.approx(sum(x["mean_score"] * n for x in records) / samples)
        assert r["val/held_out/response_length"] == pytest.approx(sum(x["mean_length"] * n for x in records) / samples)
        assert r["val/held_out/truncated"] == pytest.approx(sum(x["truncated"] for x in records) / samples)
        for k in pass_k:
            exact = sum(1 - math.comb(n - x["correct"], k) / math.comb(n, k) for x in records) / prompts
            assert r[f"val/held_out/pass@{k}"] == pytest.approx(exact, abs=1e-12), (k, r)
        assert r["timing/eval_s"] > 0


def test_disaggregated_rollouts_train_and_evaluate_what_colocated_ones_do(tmp_path, grpo_tp2, bases):
    """The same GRPO run with vLLM on ranks of their own (world 4: TP2 training ranks + two
    rollout ranks, two vLLM replicas; weights over the bridge), evaluating on the rollout
    ranks at the start and after every step: every trained-on number equals the colocated
    run's, in fp32, which evaluated only after steps 2 and 3 (so the evaluations before steps
    1 and 2 changed nothing trained), and the parity guard holds on the rollout ranks'
    engines. Each evaluation is stamped with the policy version the rollout ranks served,
    the weights of the step (one update per step that trained), and after steps 2 and 3 its
    val/ numbers and per-prompt records equal the colocated run's (the same weights and
    per-sample seeds on two replicas)."""
    colocated_root, colocated = grpo_tp2
    base = bases["qwen3"]
    disaggregated = ("rollout.placement=disaggregated", "rollout.num_ranks=2")
    every_step = (*_eval_on(base), "eval.at_start=true", "eval.every=1")
    rows, _ = _train(tmp_path, 4, base, "grpo", *GRPO_TP2, *disaggregated, *every_step)
    assert rows[0]["step"] == 0 and "reward/mean" not in rows[0]  # the starting weights' row
    updates = 0
    for r in rows:
        updates += bool(r.get("actor/updated"))
        assert r["val/held_out/policy_version"] == updates, r
    trained = rows[1:]
    _check(trained)
    _check_eval(tmp_path / "run-grpo", trained, evaluated=[1, 2, 3], prompts=32, n=4, pass_k=[1, 2, 4])
    for got, want in zip(trained, colocated, strict=True):
        compared = {k for k in want if not k.startswith(NOT_COMPARED)}
        assert {k: got[k] for k in compared} == {k: want[k] for k in compared}, (got, want)
        if "val/held_out/accuracy" in want:
            val = {k: v for k, v in want.items() if k.startswith("val/")}
            assert {k: got[k] for k in val} == val, (got, want)
            records = [root / "run-grpo" / "eval" / f"step_{want['step']}.jsonl" for root in (tmp_path, colocated_root)]
            assert records[0].read_text() == records[1].read_text()


CP_REDUCTION_ORDER = {"actor/pg_loss": 1e-6, "actor/entropy": 1e-5, "actor/grad_norm": 1e-5}
"""fp32 sums in another order (tokens split over two ranks, then gathered): pg_loss near 1e-2
and entropy near 1.4 moved by <= 1.5e-8 and 1.5e-7, grad norm 2.5 by 1.8e-7 (CP2 vs DP2, 2 steps)."""


def test_grpo_with_every_sequence_split_over_cp2_trains_what_cp1_does(tmp_path, grpo_tp2, bases):
    """The same GRPO run with context parallelism (world 2, CP2: the recipe's packed rows hold
    whole sequences in slots of a multiple of 4, each split over both ranks): its first two steps
    sample, score and train on what the TP2 run (CP1) does, rewards, lengths and advantages
    exactly, the actor's loss, entropy and grad norm up to fp32 summation order; the parity
    guard holds after a sync from the CP layout (_check_steps)."""
    _, cp1 = grpo_tp2
    rows, _ = _train(tmp_path, 2, bases["qwen3"], "grpo", "parallel.context_parallel_size=2", *GRPO_TP2[1:], steps=2)
    _check_steps(rows, 2)
    for got, want in zip(rows, cp1):
        compared = {k for k in want if not k.startswith(NOT_COMPARED) and not k.startswith("train/")}
        close = {k: abs(got[k] - want[k]) for k in CP_REDUCTION_ORDER if k in want}
        assert all(close[k] <= CP_REDUCTION_ORDER[k] * max(1.0, abs(want[k])) for k in close), close
        assert {k: got[k] for k in compared - set(close)} == {k: want[k] for k in compared - set(close)}


def test_bf16_moe_ep2_world2_with_rollout_correction_then_resume_in_tp2(tmp_path, bases):
    """bf16 end to end: bf16 weights with fp32 main params in the distributed optimizer,
    vLLM in bf16, the weight sync and its guard (weights read back exactly, logprobs within
    bf16's limits), token-level truncated IS; then a resume in another layout from the bf16
    checkpoint (fp32 main params resharded)."""
    bf16 = ("model.dtype=bf16", "algorithm.overrides={rollout_correction: {kind: token_tis, cap: 2.0}}")
    rows, _ = _train(tmp_path, 2, bases["qwen3_moe"], "grpo", *bf16, "parallel.expert_model_parallel_size=2")
    assert [r["step"] for r in rows] == [1, 2, 3]
    trained = [r for r in rows if r["actor/updated"]]
    assert trained, rows
    for r in trained:
        assert r["rollout/weight_check_elements"] > 0, r
        assert r["rollout/parity_median_abs_diff"] < BF16_PARITY_MEDIAN, r
        assert 0 <= r["rollout/mismatch_k3_kl"] < BF16_MISMATCH_K3, r
        assert r["rollout/correction_weight_mean"] <= 2.0, r  # weights capped at C
        assert 0.5 < r["rollout/router_agreement"] <= 1.0, r  # measured without replay too
    resumed, out = _train(
        tmp_path, 2, bases["qwen3_moe"], "grpo", *bf16, "parallel.tensor_model_parallel_size=2", steps=4
    )
    assert "resumed from" in out, out[-2000:]
    assert resumed[:3] == rows
    assert resumed[3]["rollout/parity_median_abs_diff"] < BF16_PARITY_MEDIAN, resumed[3]
    assert resumed[3]["rollout/mismatch_k3_kl"] < BF16_MISMATCH_K3, resumed[3]


def test_dapo_moe_tp2_ep2_world4_with_router_replay_recompute_and_monitor(tmp_path, bases):
    """MoE with router replay (vLLM's routes in the old-logprob pass and in the training
    forward and its recompute, TP2 with sequence parallelism * EP2) and the monitor."""
    rows, _ = _train(
        tmp_path,
        4,
        bases["qwen3_moe"],
        "dapo",
        "parallel.tensor_model_parallel_size=2",
        "parallel.expert_model_parallel_size=2",
        "monitor.enabled=true",
        "monitor.detect_every_steps=1",
        "monitor.interval_s=0.2",
        "rollout.router_replay=true",
        "model.recompute_activations=true",
    )
    _check(rows)
    for r in rows:  # fp32: Megatron's own routers pick vLLM's experts nearly everywhere
        assert r["rollout/router_agreement"] > FP32_ROUTER_AGREEMENT and r["rollout/router_missing_routes"] == 0, r
    # The monitor sampled this machine and ran the detector each step: a healthy box, no alerts.
    assert all(r["monitor/declared_machines"] == 0 for r in rows)
    traces = list((tmp_path / "run-dapo" / "monitor" / "traces").glob("*.csv"))
    assert len(traces) == 1 and len(traces[0].read_text().splitlines()) > 2


def test_vapo_value_pretraining_then_policy_world2(tmp_path, bases):
    """Critic-only steps on the frozen initial policy lower the value loss; then PPO starts."""
    # An overlong limit below every response's length shifts all returns by -1: a critic that
    # starts near 0 has a large error it can only lose by learning the return level.
    rows, _ = _train(
        tmp_path,
        2,
        bases["qwen3"],
        "vapo",
        "algorithm.overrides={value_warmup_steps: 4, overlong: {max_len: 2, buffer_len: 1}}",
        "rollout.prompts_per_step=8",
        steps=5,
    )
    assert [r["actor/updated"] for r in rows] == [False] * 4 + [True]
    assert all(r["timing/weight_sync_s"] == 0.0 for r in rows[:4])  # frozen policy: nothing to sync
    # The critic's error on the first warm-up batch, before step 1 and after step 4.
    before, after = rows[0]["critic/warmup_probe_loss"], rows[3]["critic/warmup_probe_loss"]
    assert after < 0.5 * before, (before, after)
    assert "critic/explained_var" in rows[-1] and "actor/pg_loss" in rows[-1]
    assert rows[-1]["rollout/parity_max_abs_diff"] < FP32_PARITY_MAX


TPPO_TP2 = (
    "parallel.tensor_model_parallel_size=2",
    "algorithm.overrides={generation_window: 4}",
    "rollout.max_new_tokens=12",
)


@pytest.fixture(scope="module")
def tppo_tp2(tmp_path_factory, bases):
    """T-PPO, dense actor and critic at TP2, two colocated vLLM replicas (world 2): (run root, rows)."""
    root = tmp_path_factory.mktemp("tppo-tp2")
    rows, _ = _train(root, 2, bases["qwen3"], "tppo", *TPPO_TP2)
    return root, rows


def test_tppo_windows_carry_responses_across_steps_tp2_world2_then_resume(tppo_tp2, bases):
    """T-PPO: 4-token windows of a 12-token budget; cut-off responses continue at the next step
    under the updated policy, the policy loss sees only tokens no earlier step trained on, and
    the critic learns from finished responses only. A resumed run gets the in-flight responses back."""
    tmp_path, rows = tppo_tp2
    tppo = TPPO_TP2
    _check(rows)  # includes logprob_abs_diff (this step's windows) and the parity after the sync
    first, later = rows[0], rows[1:]
    assert first["rollout/carried_samples"] == 0 and first["rollout/new_prompts"] == 4  # 4 prompts x 4 samples
    assert first["rollout/context_response_tokens"] == 0 and first["rollout/max_windows"] == 1
    assert first["rollout/truncated_rows"] > 0, first  # some responses outgrow one window
    for prev, r in zip(rows, later):
        # Every response the window cut off at the previous step is continued (none is dropped) ...
        assert r["rollout/carried_samples"] >= prev["rollout/truncated_rows"] > 0, (prev, r)
        # ... and trained again on top of the tokens an earlier step already trained on.
        assert r["rollout/context_response_tokens"] >= 4 * prev["rollout/truncated_rows"], (prev, r)
        assert r["rollout/max_windows"] >= 2
        if prev["rollout/held_rows"] == 0:  # no row waited: each loss covers at most one window
            assert r["actor/loss_tokens"] <= 4 * r["rollout/trained_rows"], r
    for r in rows:
        # The critic's rows are exactly the finished ones; it trains whenever there are any.
        assert r["critic/rows"] == r["rollout/trained_rows"] - r["rollout/truncated_rows"], r
        assert ("critic/value_loss" in r) == (r["critic/rows"] > 0), r
        # rows come in multiples of DP1 x 2 mini-batches (packed micro-batches take any number)
        assert r["rollout/trained_rows"] % 2 == 0 and r["rollout/trained_rows"] >= 16, r
    assert any(r["rollout/finished_samples"] > 0 and r["reward/mean"] is not None for r in later)
    # The critic and its optimizer are saved beside the actor, at the same steps.
    from megatron_rl.checkpoint import committed_steps

    ckpts = tmp_path / "run-tppo" / "checkpoints"
    assert committed_steps(ckpts / "critic") == committed_steps(ckpts) == [3]
    # Resume for one more step: the checkpoint's pool comes back and its cut-off responses go on.
    # The critic, saved in the actor's TP2 layout, resumes in a layout of its own (DP2).
    resumed, out = _train(
        tmp_path, 2, bases["qwen3"], "tppo", *tppo, "critic_parallel.tensor_model_parallel_size=1", steps=4
    )
    assert "critic layout: dense TP1·CP1·DP2·PP1" in out, out[-2000:]
    assert committed_steps(ckpts / "critic")[-1] == 4
    last = rows[-1]
    in_flight = last["rollout/truncated_rows"] + last["rollout/held_rows"]
    assert f"step 3 with {in_flight} in-flight responses" in out, out[-2000:]
    assert resumed[:3] == rows
    assert resumed[3]["rollout/carried_samples"] >= last["rollout/truncated_rows"], resumed[3]
    assert resumed[3]["rollout/context_response_tokens"] >= 4 * last["rollout/truncated_rows"], resumed[3]
    assert resumed[3]["rollout/logprob_abs_diff"] < 1e-3, resumed[3]


def _check_packing(rows, packed: bool, context_parallel: bool = False):
    """Padded: micro-batches of 2 rows x 48 positions, ~13 real tokens a row (prompt ~9,
    answer ~4), so under 0.5 real. Packed: a row of at most 96 tokens loses at most 1 token
    to the TP2 multiple (> 0.95 with rows of >= 26 tokens), under PP too (each micro-batch
    keeps its own length). Under CP2 each sequence takes a slot of a multiple of 4: at most 3
    padding positions per ~13 tokens (measured 0.89-0.91), so > 0.8."""
    trained = [r for r in rows if "train/packing_efficiency" in r]
    assert trained, rows
    for r in trained:
        if not packed:
            assert r["train/packing_efficiency"] < 0.5 and r["train/tokens_per_micro_batch_max"] == 2 * 48, r
        else:
            assert r["train/packing_efficiency"] > (0.8 if context_parallel else 0.95), r
            assert r["train/tokens_per_micro_batch_max"] <= 96, r


# The rest of "every recipe at world 2 and 4", dense and MoE, in layouts the tests above do
# not use: (recipe, world, base, layout and recipe overrides).
# PACKED: sequence packing (96-token micro-batches, a multiple of TP2) in most of them:
# packed critic under PP, packed routes for the replay, the reference's and HAPO's passes.
# The examples pack by default (384 tokens); PADDED turns it off (rows of seq_length 48).
PACKED, PADDED = "trainer.max_tokens_per_micro_batch=96", "trainer.max_tokens_per_micro_batch=null"
# CP: HAPO, VAPO's critic and T-PPO run with context parallelism (EP folded over the CP ranks).
# Not here, covered elsewhere: a MoE critic in the actor's layout (VAPO below has its own
# EP4 layout; the T-PPO test above shares the actor's), padded HAPO (test_schedules and
# test_adaptive_temperature run its passes on padded rows).
MATRIX = [
    # The critic in a layout of its own beside the actor (its own process groups).
    (
        "ppo",
        4,
        "qwen3",
        (
            "parallel.tensor_model_parallel_size=2",
            "rollout.tensor_parallel_size=2",
            "critic_parallel.pipeline_model_parallel_size=2",
            PACKED,
        ),
    ),
    (
        "grpo",
        4,
        "qwen3_moe",
        (
            "parallel.expert_model_parallel_size=4",
            "algorithm.overrides={kl: {kind: k3, coef: 0.04}}",
            "rollout.router_replay=true",
            PACKED,
        ),
    ),
    ("dapo", 2, "qwen3", ("parallel.pipeline_model_parallel_size=2", PACKED)),
    (
        "vapo",
        4,
        "qwen3_moe",
        (
            "parallel.tensor_model_parallel_size=2",
            "parallel.expert_model_parallel_size=2",
            "critic_parallel.context_parallel_size=2",  # the critic's own CP: value pre-training split
            "critic_parallel.expert_model_parallel_size=2",
            "algorithm.overrides={value_warmup_steps: 1}",
            PADDED,
        ),
    ),
    # Router replay through T-PPO windows: a continued response's routes span its windows,
    # split over CP ranks with the tokens.
    (
        "tppo",
        4,
        "qwen3_moe",
        (
            "parallel.context_parallel_size=2",
            "parallel.expert_model_parallel_size=2",
            "algorithm.overrides={generation_window: 4}",
            "rollout.max_new_tokens=12",
            "rollout.router_replay=true",
            PACKED,
        ),
    ),
    (
        "hapo",
        4,
        "qwen3_moe",
        (
            "parallel.context_parallel_size=2",  # HAPO's temperature pass on split sequences
            "parallel.expert_model_parallel_size=2",
            "algorithm.overrides={temperature_tau: 0.5}",
            PACKED,
        ),
    ),
]


@pytest.mark.parametrize("recipe,world,base,overrides", MATRIX, ids=[f"{r}-world{w}-{b}" for r, w, b, _ in MATRIX])
def test_recipe_runs_three_steps(tmp_path, bases, recipe, world, base, overrides):
    rows, out = _train(tmp_path, world, bases[base], recipe, *overrides)
    _check(rows)
    _check_packing(rows, PACKED in overrides, "parallel.context_parallel_size=2" in overrides)
    if base == "qwen3_moe":  # vLLM's routes reach the trainer for every input token
        # T-PPO trains rows whose earlier windows vLLM routed under older weights.
        agreement = 0.9 if recipe == "tppo" else FP32_ROUTER_AGREEMENT
        assert all(
            r["rollout/router_missing_routes"] == 0 and r["rollout/router_agreement"] > agreement
            for r in rows
            if r["rollout/kept_groups"] > 0
        ), rows
    critic_layout = {
        "ppo": "critic layout: dense TP1·CP1·DP2·PP2",
        "vapo": "critic layout: dense TP1·CP2·DP2·PP1 | MoE ETP1·EP2·EDP2·PP1",
    }.get(recipe)
    if any(o.startswith("critic_parallel.") for o in overrides):
        assert critic_layout in out, out[-3000:]
    updated = [r for r in rows if r.get("actor/updated")]
    assert updated, rows
    if recipe in ("ppo", "vapo", "tppo"):  # the critic trains beside the actor
        assert any("critic/value_loss" in r for r in rows), rows
    if recipe == "grpo":  # the KL penalty against the frozen initial policy grows once the actor moves
        assert all(r["actor/kl_loss"] >= 0 for r in updated)
        assert updated[-1]["actor/kl_loss"] > 0, updated
    if recipe == "hapo":
        # Step 1 samples at plain T; later steps at T(1 + 0.5 h) per token inside vLLM. Megatron
        # recomputes those temperatures; had vLLM sampled at plain T, its logprobs would be far off.
        trained = [r for r in rows if r["rollout/kept_groups"] > 0]
        assert trained[0]["rollout/temperature_std"] == 0.0, trained[0]
        later = [r for r in trained[1:] if "rollout/temperature_std" in r]
        assert later and all(r["rollout/temperature_std"] > 0.05 for r in later), later
        assert all(r["rollout/logprob_abs_diff"] < 1e-3 for r in later), later


ASYNC = (
    "rollout.placement=disaggregated",
    "rollout.num_ranks=2",
    "rollout.max_staleness=1",
    "rollout.seed_per_prompt=true",
    "checkpoint.save_interval=2",
    "algorithm.overrides={rollout_correction: {kind: token_tis, cap: 2.0}}",
)
PARTIAL = ("rollout.partial=true", "rollout.partial_chunk_tokens=1", "rollout.max_new_tokens=24")
"""Partial rollouts one token at a time, on the steps task (answers of 5-14 tokens; the digits
task's ~4 tokens are done long before any weights arrive)."""
SLOW_CHUNKS = {CHUNK_PAUSE_ENV: "0.05"}
"""The rollout rank waits 50 ms after each chunk, so a batch takes 0.3-1 s against the
training step's ~0.15 s (training plus sync): the batch running ahead is still generating
when the step's weights arrive. Without it the two take about as long on this tiny model,
and which is done first is a race (a CI run once saw no trained sample span two versions)."""


@pytest.fixture(scope="module")
def steps_base(tmp_path_factory):
    """The dense tiny base warmed up on digits_max_steps (digits, then the answer), on true
    answers only: ~19 % of its samples are right, so most groups of 4 have a reward spread and
    DAPO keeps them."""
    root = tmp_path_factory.mktemp("steps-base")
    settings = BaseModelSettings(family="qwen3", **dict(SMALL, task="digits_max_steps", warmup_correct_fraction=1.0))
    return make_tiny_base(root / "qwen3", settings, verbose=False)["directory"]


def test_tppo_windows_continued_on_rollout_ranks_train_what_colocated_ones_do(tmp_path, tppo_tp2, bases):
    """T-PPO with vLLM on two rollout ranks of their own (world 4): the windows cut off at one
    step are continued over the bridge at the next, and every trained-on number equals the
    colocated run's (the same two replicas with the same seeds draw the same samples)."""
    _, colocated = tppo_tp2
    rows, _ = _train(
        tmp_path, 4, bases["qwen3"], "tppo", *TPPO_TP2, "rollout.placement=disaggregated", "rollout.num_ranks=2"
    )
    assert rows[1]["rollout/carried_samples"] > 0, rows[1]
    for got, want in zip(rows, colocated, strict=True):
        compared = {k for k in want if not k.startswith(NOT_COMPARED)}
        assert {k: got[k] for k in compared} == {k: want[k] for k in compared}, (got, want)


def test_dapo_one_batch_ahead_with_partial_rollouts_then_resume_with_a_batch_in_flight(tmp_path, steps_base):
    """DAPO with rollout.max_staleness=1 and partial rollouts (world 3: one training rank, two
    rollout ranks, each an engine of its own): each step takes the batch generated during the
    step before, and that batch, still generating when the step's weights arrived, went on
    under them, so samples hold tokens of two versions. The two rollout ranks receive the
    weights at their own pace and agree (the fewest commands either holds) on the chunk
    boundary where both load them: the collective weight check and the replicas' gathers
    would hang otherwise, and a replica that loaded them a chunk later would stamp old
    tokens new (|dlogp| below would be the update's size). Dynamic sampling refills from
    batches drawn on the spot. The tokens the current weights sampled are exactly what
    Megatron computes (|dlogp| ~1e-7 on them), and the parity guard, served between two
    chunks, finds vLLM serving the synced weights. The step-4 checkpoint is saved
    while step 5's batch is in flight: the resumed run draws those prompts again, so the prompt
    count goes on without a gap or a repeat. Every other step the rollout ranks evaluate
    after the batch running ahead, on the step's weights: the version they stamp is the
    training ranks' (the updates sent in this launch; a resume's load is the first), and
    the prompt count above shows that evaluating drew no training prompt."""
    small_eval = (
        f"eval.sets.held_out.source={steps_base}/eval.jsonl",
        "eval.sets.held_out.max_prompts=8",
        "eval.n_samples=2",
        "eval.pass_k=[1,2]",
        "eval.every=2",
        "eval.at_start=false",
        "eval.at_end=true",
    )
    rows, _ = _train(tmp_path, 3, steps_base, "dapo", *ASYNC, *PARTIAL, *small_eval, steps=4, env=SLOW_CHUNKS)
    _check_versions_evaluated(rows, evaluated=[2, 4], loaded=0)
    prompts = 4  # rollout.prompts_per_step
    drawn = 0
    for step, r in enumerate(rows, start=1):
        drawn += prompts * r["rollout/generation_batches"]
        assert r["data/prompts_drawn"] == drawn, r  # refills counted, the batch in flight not
        assert r["rollout/dropped_stale"] == 0 and r["rollout/staleness_max"] <= 1, r
        assert r["rollout/parity_max_abs_diff"] < FP32_PARITY_MAX, r  # after the sync, between two chunks
        assert r.get("rollout/logprob_abs_diff", 0.0) < 1e-5, r  # fresh tokens: of the current version
        if step > 1:  # generated during the previous step's training: not waited for in full
            assert r["timing/overlap_fraction"] > 0 and r["timing/train_idle_s"] < r["timing/generation_s"], r
    assert rows[0]["rollout/staleness_max"] == 0 and rows[0]["rollout/partial_samples"] == 0
    resumed, out = _train(tmp_path, 3, steps_base, "dapo", *ASYNC, *PARTIAL, *small_eval, steps=6, env=SLOW_CHUNKS)
    assert "resumed from" in out and "step 4" in out, out[-2000:]
    assert resumed[:4] == rows
    _check_versions_evaluated(resumed[4:], evaluated=[6], loaded=1)
    step5, step6 = resumed[4:]
    assert step5["data/prompts_drawn"] == drawn + prompts * step5["rollout/generation_batches"]
    assert step5["rollout/staleness_max"] == 0 and step5["rollout/partial_samples"] == 0  # nothing in flight
    assert step6["rollout/staleness_max"] <= 1 and step6.get("rollout/logprob_abs_diff", 0.0) < 1e-5, step6
    # Trained-on samples began under the previous version and went on under the new one (which
    # steps keep a group of the batch that ran ahead is fixed by the seeds; the per-prompt seeds
    # keep ~1 in 2 here, and of those some samples outlast the training step).
    assert any(r["rollout/partial_samples"] > 0 and r["actor/updated"] for r in [*rows[1:], step6]), resumed


def _check_versions_evaluated(rows, evaluated, loaded):
    """The steps of ``rows`` (one launch's) evaluated, each stamped with the weight updates the
    launch sent by then: ``loaded`` at its start (1: a resume's), then one per updated step."""
    assert [r["step"] for r in rows if "val/held_out/accuracy" in r] == evaluated
    version = loaded
    for r in rows:
        version += bool(r["actor/updated"])
        if r["step"] in evaluated:
            assert r["val/held_out/policy_version"] == version, r
            assert 0 <= r["val/held_out/accuracy"] <= 1 and r["timing/eval_s"] > 0, r


def _launch_rank_pids(launcher: int, rank: int) -> list[int]:
    """Processes below a launch started as launch rank ``rank`` (torchrun's RANK)."""
    found = []
    for pid in descendants(launcher):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if f"RANK={rank}".encode() in environ:
            found.append(pid)
    return found


def _disaggregated_grpo(run_dir, base, *overrides) -> list[str]:
    """The torchrun command of a world-2 GRPO run with its vLLM on rank 1 (one training rank,
    one rollout rank), for the rollout-rank failure tests."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={_free_port()}",
        "-m",
        "megatron_rl",
        "train",
        "--config",
        "examples/grpo.yaml",
        *_tiny_run(run_dir, base),
        "rollout.placement=disaggregated",
        "rollout.num_ranks=1",
        *overrides,
    ]


def _signal_rollout_rank_after_step_2(tmp_path, base, signum, *overrides):
    """A disaggregated GRPO run (world 2, a checkpoint every step) whose rollout rank gets
    ``signum`` once step 2 is logged: (exit code, output, seconds from the signal to the
    end, steps logged, newest intact checkpoint)."""
    import subprocess
    import time

    from megatron_rl.checkpoint.recovery import newest_intact_step

    run_dir = tmp_path / "run"
    cmd = _disaggregated_grpo(run_dir, base, "trainer.max_steps=200", "checkpoint.save_interval=1", *overrides)
    proc = subprocess.Popen(
        cmd,
        env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 900
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 2"
            time.sleep(0.5)
        rollout = _launch_rank_pids(proc.pid, rank=1)
        assert len(rollout) == 1, rollout
        os.kill(rollout[0], signum)
        signalled = time.monotonic()
        out, _ = proc.communicate(timeout=300)
        ended_after = time.monotonic() - signalled
    finally:
        kill_tree(proc.pid)
    logged = len(metrics.read_text().splitlines())
    return proc.returncode, out, ended_after, logged, newest_intact_step([run_dir / "checkpoints"], "fail")


def test_rollout_engines_slower_to_start_than_the_start_timeout_end_the_launch_naming_it(tmp_path, bases):
    """rollout.start_timeout_s bounds the wait for the rollout ranks' engines (command 0) on
    its own: at 1 s (a vLLM start takes several) the launch ends with one error line naming
    the rollout rank and that setting, exit 1, before any step."""
    run_dir = tmp_path / "run"
    cmd = _disaggregated_grpo(run_dir, bases["qwen3"], "rollout.start_timeout_s=1")
    proc = run_process_group(cmd, dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"), timeout_s=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    line = next((x for x in out.splitlines() if x.startswith("megatron-rl: error:")), out[-3000:])
    assert line == (
        "megatron-rl: error: rollout rank 1 of the launch did not answer command 0 within "
        "rollout.start_timeout_s=1 s: hung, or slower than that; nothing was trained"
    ), line
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text()


def test_a_killed_rollout_rank_ends_the_launch_and_the_checkpoints_stay(tmp_path, bases):
    """SIGKILL of the rollout rank after step 2: the launch ends at once with a requeue-able
    exit code and the rollout rank named, and the checkpoints committed before stay intact (a
    requeue resumes from the newest). Who names it is a race: the trainer (its bridge
    breaks) or torchrun (it saw the rank die first and ended the others)."""
    import re
    import signal

    code, out, ended_after, logged, intact = _signal_rollout_rank_after_step_2(tmp_path, bases["qwen3"], signal.SIGKILL)
    assert code not in (0, 2, 75), out[-3000:]  # a failure the Slurm script may requeue
    by_trainer = "megatron-rl: error: rollout rank 1 of the launch " in out  # its bridge broke on a send or receive
    by_torchrun = re.search(r"Root Cause.*?rank\s*: 1 \(local_rank: 1\)\s*exitcode\s*: -9", out, re.S)
    assert by_trainer or by_torchrun, out[-3000:]
    assert ended_after < 120, ended_after
    assert intact is not None and 2 <= intact <= logged, (intact, logged)


def test_a_hung_rollout_rank_ends_the_run_with_its_name_within_the_timeout(tmp_path, bases):
    """SIGSTOP of the rollout rank after step 2 (alive, answering nothing): the training ranks
    stop after rollout.timeout_s with one error line naming the rollout rank, exit 1 (which
    the Slurm script requeues), the checkpoints committed before intact. The engine's start
    (command 0, over 15 s on a loaded 2-core machine) has its own bound,
    rollout.start_timeout_s (default an hour), so 15 s only has to cover a step's batch."""
    import signal

    code, out, ended_after, logged, intact = _signal_rollout_rank_after_step_2(
        tmp_path, bases["qwen3"], signal.SIGSTOP, "rollout.timeout_s=15"
    )
    assert code == 1, out[-3000:]
    line = next((x for x in out.splitlines() if x.startswith("megatron-rl: error:")), out[-3000:])
    assert (
        line.startswith("megatron-rl: error: rollout rank 1 of the launch did not") and "rollout.timeout_s=15 s" in line
    ), line
    assert 15 <= ended_after < 120, ended_after
    assert intact is not None and 2 <= intact <= logged, (intact, logged)


def _world1_dapo(run_dir, base, steps: int) -> list[str]:
    """`megatron-rl train` alone (world 1, no torchrun): how a person runs it at a terminal."""
    return [
        sys.executable,
        "-m",
        "megatron_rl",
        "train",
        "--config",
        "examples/dapo.yaml",
        *_tiny_run(run_dir, base),
        f"trainer.max_steps={steps}",
        "eval.sets={}",  # the recipe's held-out split is a task's; this run reads a prompt file
    ]


def test_ctrl_c_finishes_the_step_saves_it_and_the_same_run_dir_resumes(tmp_path, bases):
    """Ctrl-C at a terminal reaches the whole foreground process group: SIGINT to the group
    once step 2 is logged. The step in progress finishes, its checkpoint is committed, one
    line says so and how to go on, exit 75 (stopped after a checkpoint) without a
    traceback; a rerun on the same run dir resumes after that step."""
    import signal
    import subprocess
    import time

    from megatron_rl.checkpoint.recovery import newest_intact_step

    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        _world1_dapo(run_dir, bases["qwen3"], 50),
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 2"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        kill_tree(proc.pid)
    stopped_at = len(metrics.read_text().splitlines())
    assert proc.returncode == 75, (out + err)[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert f"stopped on SIGINT after step {stopped_at} (Ctrl-C); checkpoint saved in " in out, out[-2000:]
    assert newest_intact_step([run_dir / "checkpoints"], "fail") == stopped_at
    resumed, out = _train_world1(run_dir, bases["qwen3"], stopped_at + 1, env)
    assert "resumed from" in out and [r["step"] for r in resumed] == list(range(1, stopped_at + 2)), out[-2000:]


def _train_world1(run_dir, base, steps, env):
    proc = run_process_group(_world1_dapo(run_dir, base, steps), env, timeout_s=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()], proc.stdout
