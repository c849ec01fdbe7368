"""`megatron-rl bench grpo-reference` without a trainer or a model: bad arguments refused in one
line with exit code 2, the runs' commands, the summary over seeds by hand, a second invocation
replaying without training again."""

import argparse
import json

import pytest

from megatron_rl_lab.bench import grpo_reference
from megatron_rl_lab.bench.compare_runs import MARKER

STEPS = 2


def _args(tmp_path, *argv):
    config = tmp_path / "grpo.yaml"
    config.write_text("trainer: {}\n")
    sub = argparse.ArgumentParser().add_subparsers()
    parser = grpo_reference.add_parser(sub)
    return parser.parse_args(["--config", str(config), "--out", str(tmp_path / "out"), "--steps", str(STEPS), *argv])


def _no_check(config, overrides):
    return None


class StandIn:
    """Writes the metrics rows a finished run has; records each command."""

    def __init__(self):
        self.commands = []

    def __call__(self, command, run_dir, env):
        self.commands.append(list(command))
        rows = [{"step": s} for s in range(1, STEPS + 1)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return 0, 1.0


def _replay(plan, seed, say):
    # |Δ logp| means of 1e-6 and 3e-6 at step 1 for seeds 1 and 2, growing 10x by step 2.
    return [
        {
            "step": step,
            "logp_abs_diff_mean": seed * 2e-6 - 1e-6 if step == 1 else (seed * 2e-6 - 1e-6) * 10,
            "logp_abs_diff_max": 1e-5,
            "advantage_max_abs_diff": 1e-7 * seed,
            "loss_mask_mismatch": 0,
            "ref_grad_norm": 1.01,
            "ours_grad_norm": 1.0,
            "ref_pg_loss": 0.5,
            "ours_pg_loss": 0.5,
            "ref_clipfrac": 0.0,
            "ours_clipfrac": None,  # a metric the run did not log
        }
        for step in range(1, STEPS + 1)
    ]


def test_arguments_the_bench_owns_or_a_missing_config_are_refused(tmp_path, capsys):
    args = _args(tmp_path, "--set", "trainer.seed=7")
    assert grpo_reference.run_args(args, run_one=StandIn(), check=_no_check) == 2
    assert "the bench sets trainer.seed itself" in capsys.readouterr().err
    args = _args(tmp_path)
    args.config = str(tmp_path / "missing.yaml")
    assert grpo_reference.run_args(args, run_one=StandIn(), check=_no_check) == 2


def test_the_runs_save_their_rollouts_and_share_a_base_only_when_asked(tmp_path):
    plan = grpo_reference.make_plan(_args(tmp_path, "--set", "trainer.lr=0.1"), check=_no_check)
    command = plan.run(2).command()
    assert command[6:] == [
        "trainer.lr=0.1",
        f"trainer.max_steps={STEPS}",
        "trainer.save_rollouts=true",
        "trainer.seed=2",
        f"trainer.run_dir={tmp_path / 'out/runs/grpo/seed2'}",
    ]
    shared = grpo_reference.make_plan(_args(tmp_path, "--base-seed", "0"), check=_no_check)
    assert "data.seed=0" in shared.run(1).command()


def test_the_summary_over_seeds_by_hand_and_a_second_invocation_trains_nothing(tmp_path):
    plan = grpo_reference.make_plan(_args(tmp_path, "--seeds", "1,2"), check=_no_check)
    runner, lines = StandIn(), []
    assert grpo_reference.run(plan, run_one=runner, replay=_replay, say=lines.append) == 0
    assert len(runner.commands) == 2
    assert all(json.loads((plan.run(s).run_dir / MARKER).read_text())["status"] == "done" for s in (1, 2))
    result = json.loads((tmp_path / "out" / grpo_reference.RESULT).read_text())
    summary = result["summary"]
    step1, step2 = summary["per_step"]["logp_abs_diff_mean"]
    # Seeds 1e-6 and 3e-6: mean 2e-6, sd sqrt(2)·1e-6, t(0.975, 1) = 12.7062.
    assert step1["mean"] == pytest.approx(2e-6) and step1["half_width"] == pytest.approx(12.7062e-6)
    assert step2["mean"] == pytest.approx(2e-5)
    assert summary["advantage_max_abs_diff"] == pytest.approx(2e-7)
    assert summary["grad_norm_max_rel_diff"] == pytest.approx(0.01)
    assert summary["pg_loss_max_abs_diff"] == 0.0 and summary["clipfrac_max_abs_diff"] is None
    assert any(line.startswith("step   2  logp_abs_diff_mean 2.00e-05") for line in lines)
    again = StandIn()
    assert grpo_reference.run(plan, run_one=again, replay=_replay, say=lines.append) == 0
    assert again.commands == []  # finished runs are replayed, not trained again
