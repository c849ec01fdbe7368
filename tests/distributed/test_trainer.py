"""The RL trainer end to end under torchrun/gloo: real vLLM rollouts, Megatron updates and
weight syncs for 3 steps, dense and MoE actors, with the train/inference logprob mismatch
measured before the first update.

Launches: GRPO with a dense actor at TP2 and two vLLM TP1 replicas (world 2), resumed in
DP2; the same run with vLLM on two rollout ranks of their own (world 4, evaluating there)
and with every sequence split over CP2 (world 2); bf16 MoE at EP2 (world 2), resumed at TP2;
DAPO with a MoE actor at TP2*EP2 and four vLLM TP1 replicas (world 4); VAPO's value
pre-training (world 2). Every recipe in the other layouts: test_trainer_recipes.py;
responses that outlive a step (T-PPO windows, partial rollouts): test_trainer_async.py;
rollout ranks that die, hang or start too slowly, and Ctrl-C: test_trainer_failures.py.
All start from the session's tiny supervised bases (trainer_runs.py).
"""

import json

import pytest

from tests.distributed.trainer_runs import (
    BF16_MISMATCH_K3,
    BF16_PARITY_MEDIAN,
    FP32_PARITY_MAX,
    FP32_ROUTER_AGREEMENT,
    NOT_COMPARED,
    check_steps,
    train,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def grpo_tp2(tmp_path_factory, bases):
    """GRPO, dense actor at TP2, two colocated vLLM replicas (world 2), prompts seeded one by
    one (the same samples whichever engine draws them), evaluated on the base's held-out
    prompts after steps 2 and 3: (run root, metric rows). The disaggregated run below, which
    evaluates at the start and after every step, must train exactly what this one does."""
    root = tmp_path_factory.mktemp("grpo-tp2")
    rows, _ = train(root, 2, bases["qwen3"], "grpo", *GRPO_TP2, *_eval_on(bases["qwen3"]))
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


def test_grpo_dense_tp2_world2_then_resume_in_dp2(grpo_tp2, bases):
    root, rows = grpo_tp2
    check_steps(rows)
    _check_eval(root / "run-grpo", rows, evaluated=[2, 3], prompts=32, n=4, pass_k=[1, 2, 4])
    # Resume from the step-3 checkpoint in another layout (DP2 instead of TP2) for one more step.
    resumed, out = train(root, 2, bases["qwen3"], "grpo", "rollout.seed_per_prompt=true", steps=4)
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
    rows, _ = train(tmp_path, 4, base, "grpo", *GRPO_TP2, *disaggregated, *every_step)
    assert rows[0]["step"] == 0 and "reward/mean" not in rows[0]  # the starting weights' row
    updates = 0
    for r in rows:
        updates += bool(r.get("actor/updated"))
        assert r["val/held_out/policy_version"] == updates, r
    trained = rows[1:]
    check_steps(trained)
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
    rows, _ = train(tmp_path, 2, bases["qwen3"], "grpo", "parallel.context_parallel_size=2", *GRPO_TP2[1:], steps=2)
    check_steps(rows, 2)
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
    rows, _ = train(tmp_path, 2, bases["qwen3_moe"], "grpo", *bf16, "parallel.expert_model_parallel_size=2")
    assert [r["step"] for r in rows] == [1, 2, 3]
    trained = [r for r in rows if r["actor/updated"]]
    assert trained, rows
    for r in trained:
        assert r["rollout/weight_check_elements"] > 0, r
        assert r["rollout/parity_median_abs_diff"] < BF16_PARITY_MEDIAN, r
        assert 0 <= r["rollout/mismatch_k3_kl"] < BF16_MISMATCH_K3, r
        assert r["rollout/correction_weight_mean"] <= 2.0, r  # weights capped at C
        assert 0.5 < r["rollout/router_agreement"] <= 1.0, r  # measured without replay too
    resumed, out = train(
        tmp_path, 2, bases["qwen3_moe"], "grpo", *bf16, "parallel.tensor_model_parallel_size=2", steps=4
    )
    assert "resumed from" in out, out[-2000:]
    assert resumed[:3] == rows
    assert resumed[3]["rollout/parity_median_abs_diff"] < BF16_PARITY_MEDIAN, resumed[3]
    assert resumed[3]["rollout/mismatch_k3_kl"] < BF16_MISMATCH_K3, resumed[3]


def test_dapo_moe_tp2_ep2_world4_with_router_replay_recompute_and_monitor(tmp_path, bases):
    """MoE with router replay (vLLM's routes in the old-logprob pass and in the training
    forward and its recompute, TP2 with sequence parallelism * EP2) and the monitor."""
    rows, _ = train(
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
    check_steps(rows)
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
    rows, _ = train(
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
