"""Responses that outlive a training step, end to end under torchrun/gloo: T-PPO's
generation windows (a dense actor and critic at TP2, world 2, resumed with its responses in
flight; the same windows continued on two rollout ranks of their own, world 4) and DAPO one
batch ahead with partial rollouts (world 3: one training rank, two rollout ranks), resumed
with a batch in flight."""

import pytest

from megatron_rl.rollout.server import CHUNK_PAUSE_ENV
from megatron_rl.tasks.base_model import BaseModelSettings
from tests.distributed.trainer_runs import FP32_PARITY_MAX, NOT_COMPARED, SMALL, cached_base, check_steps, train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


TPPO_TP2 = (
    "parallel.tensor_model_parallel_size=2",
    "algorithm.overrides={generation_window: 4}",
    "rollout.max_new_tokens=12",
)


@pytest.fixture(scope="module")
def tppo_tp2(tmp_path_factory, bases):
    """T-PPO, dense actor and critic at TP2, two colocated vLLM replicas (world 2): (run root, rows)."""
    root = tmp_path_factory.mktemp("tppo-tp2")
    rows, _ = train(root, 2, bases["qwen3"], "tppo", *TPPO_TP2)
    return root, rows


def test_tppo_windows_carry_responses_across_steps_tp2_world2_then_resume(tppo_tp2, bases):
    """T-PPO: 4-token windows of a 12-token budget; cut-off responses continue at the next step
    under the updated policy, the policy loss sees only tokens no earlier step trained on, and
    the critic learns from finished responses only. A resumed run gets the in-flight responses back."""
    tmp_path, rows = tppo_tp2
    tppo = TPPO_TP2
    check_steps(rows)  # includes logprob_abs_diff (this step's windows) and the parity after the sync
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
    resumed, out = train(
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
def steps_base():
    """The dense tiny base warmed up on digits_max_steps (digits, then the answer), on true
    answers only: ~19 % of its samples are right, so most groups of 4 have a reward spread and
    DAPO keeps them."""
    settings = BaseModelSettings(family="qwen3", **dict(SMALL, task="digits_max_steps", warmup_correct_fraction=1.0))
    return cached_base(settings)


def test_tppo_windows_continued_on_rollout_ranks_train_what_colocated_ones_do(tmp_path, tppo_tp2, bases):
    """T-PPO with vLLM on two rollout ranks of their own (world 4): the windows cut off at one
    step are continued over the bridge at the next, and every trained-on number equals the
    colocated run's (the same two replicas with the same seeds draw the same samples)."""
    _, colocated = tppo_tp2
    rows, _ = train(
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
    rows, _ = train(tmp_path, 3, steps_base, "dapo", *ASYNC, *PARTIAL, *small_eval, steps=4, env=SLOW_CHUNKS)
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
            hidden = r["timing/generation_hidden_s"]
            assert hidden > 0 and r["timing/overlap_fraction"] == pytest.approx(
                min(hidden / r["timing/step_s"], 1.0)
            ), r
    assert rows[0]["rollout/staleness_max"] == 0 and rows[0]["rollout/partial_samples"] == 0
    resumed, out = train(tmp_path, 3, steps_base, "dapo", *ASYNC, *PARTIAL, *small_eval, steps=6, env=SLOW_CHUNKS)
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
