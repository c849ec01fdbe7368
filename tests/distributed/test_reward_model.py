"""The reward model's Bradley-Terry loss through Megatron's schedules (the shared world-4
launch, body_reward_model.py): in DP4 (TP1), TP2, PP2 and CP2, padded and packed, the loss,
the pair accuracy and every gradient equal plain single-process autograd on the whole
batch; under TP2 with the distributed optimizer a few steps lower the loss. `train` runs the
recipe end to end and resumes, and a GRPO run is rewarded by the model it trained."""

import json
import os
import subprocess
import sys

import pytest

from megatron_rl.tasks.base_model import BaseModelSettings
from megatron_rl.tasks.pairs import write_task_pairs
from tests.distributed.trainer_runs import SMALL, check_steps, train

TOL = 1e-6  # fp32

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(shared_launch4):
    return shared_launch4.results("body_reward_model")


def _result(results, case):
    outcome = results[case]
    assert outcome["ok"], outcome["error"]
    return outcome["result"]


@pytest.mark.parametrize("case", ["dp4", "tp2", "packed-tp2", "packed-pp2", "cp2"])
def test_the_pair_loss_and_its_gradient_equal_the_single_process_reference(results, case):
    r = _result(results, case)
    # the head's bias adds to both rewards of a pair and cancels in their difference
    assert r["params_without_grad"] == ["output_layer.bias"], "some parameter got no gradient"
    assert r["max_grad"] > 1e-3, "reference gradients too small to compare meaningfully"
    assert r["max_grad_diff"] < TOL, f"{r['worst_key']}: {r['max_grad_diff']}"
    assert r["loss_diff"] < TOL and r["accuracy_diff"] < TOL, r


def test_a_few_steps_lower_the_loss_from_the_references(results):
    r = _result(results, "train-packed-tp2")
    losses = r["losses"]
    assert abs(losses[0] - r["reference_loss"]) < TOL  # the first step's loss is the reference's, before any update
    assert losses[-1] < 0.5 * losses[0], losses
    assert r["accuracies"][-1] == 1.0, r["accuracies"]


def test_train_runs_the_recipe_saves_evaluates_and_resumes(tmp_path, bases):
    """`megatron-rl train` with algorithm.recipe=reward_model (world 1: the layouts are the
    cases above; a torchrun launch of two costs this module three times as much), on pairs
    files the task wrote for the session's small dense base: metrics rows with the recipe's
    names, held-out pair accuracy, committed checkpoints, and a resume that continues after
    the last step; GRPO then scores with the model it trained."""
    train_pairs, held_out = write_task_pairs(BaseModelSettings(family="qwen3", **SMALL), tmp_path / "pairs")
    run_dir = tmp_path / "run"
    overrides = [
        f"model.hf_path={bases['qwen3']}",
        f"data.source=pairs:{train_pairs}",
        f"eval.sets.held_out.source=pairs:{held_out}",
        f"trainer.run_dir={run_dir}",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=2",
        "eval.every=2",
        "checkpoint.save_interval=2",
        "trainer.loggers=[]",
    ]
    first = _train(overrides + ["trainer.max_steps=4"])
    assert "val/held_out/pair_accuracy" in first.stdout
    again = _train(overrides + ["trainer.max_steps=5"])
    assert f"resumed from {run_dir / 'checkpoints'} step 4" in again.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    for r in rows[1:]:
        assert {"train/loss", "train/pair_accuracy", "train/grad_norm", "timing/step_s"} <= set(r), r
    evaluated = [r["step"] for r in rows if "val/held_out/pair_accuracy" in r]
    assert evaluated == [0, 2, 4, 5] and all(0 <= r["val/held_out/loss"] for r in rows if r["step"] in evaluated)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_4", "step_5"]
    _rl_with_the_reward_model(tmp_path, bases["qwen3"], run_dir)
    # the served scorer exported the last step as an HF sequence classifier (the CLI's own
    # export: tests/unit/bridge/test_reward_model_export.py)
    config = json.loads((tmp_path / "run-grpo" / "scorers" / "served" / "step-5" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForSequenceClassification"] and config["num_labels"] == 1


def _rl_with_the_reward_model(tmp_path, base, rm_run_dir):
    """GRPO rewarded by the reward model just trained (its newest step, loaded beside the
    actor), the rule verifier kept at weight 0, the same reward model served by vLLM in its
    own process at weight 0, and a judge at weight 0 (the base itself, in vLLM in its own
    process, asked a question it answers with a digit, read as the verdict): every step logs
    each scorer, the models' and the judge's agreement with the rule, and trains on the
    model's score alone; the served scorers score groups as they finish, the served model
    as the Megatron forward does."""
    judge = (
        "{kind: judge, path: base, weight: 0, template: '{question} {response}', verdict_pattern: '([0-9])', "
        "verdict_scores: {}}"
    )
    served = f"{{kind: model, path: {rm_run_dir}, engine: vllm, weight: 0, timeout_s: 120}}"
    scorers = (
        f"{{rm: {{kind: model, path: {rm_run_dir}}}, verifier: {{kind: rule, weight: 0}}, judge: {judge}, "
        f"served: {served}}}"
    )
    rows, _ = train(
        tmp_path,
        1,
        base,
        "grpo",
        f"reward.scorers={scorers}",
        steps=2,
    )
    check_steps(rows, steps=2)
    for r in rows:
        assert r["reward/mean"] == pytest.approx(r["reward/rm/mean"], abs=1e-12)  # 1 x rm + 0 x the others
        assert 0.0 <= r["reward/verifier/mean"] <= 1.0 and r["reward/rm/failures"] == 0
        # vLLM's pooling engine and the Megatron forward score the same responses alike (fp32)
        assert r["reward/served/failures"] == 0 and r["reward/served/mean"] == pytest.approx(
            r["reward/rm/mean"], abs=1e-5
        )
        for scorer in ("rm", "served", "judge"):
            agreement = r[f"reward/{scorer}/agreement"]  # null (nan) in a step where the rule told no pair apart
            assert agreement is None or 0.0 <= agreement <= 1.0
        assert r["reward/judge/failures"] < 16, r  # the judge's engine answered, with a digit, at least once
        assert 0.0 <= r["reward/judge/mean"] <= 9.0
        assert r["timing/reward_s"] > 0.0
        # the judge is served: it scored groups as they finished, part of its time before the batch ended
        assert 0.0 < r["timing/reward_hidden_s"] and 0.0 < r["timing/reward_hidden_share"] <= 1.0, r


def _train(overrides):
    cmd = [sys.executable, "-m", "megatron_rl", "train", "--config", "examples/reward_model.yaml", *overrides]
    proc = subprocess.run(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc
