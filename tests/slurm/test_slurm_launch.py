"""scripts/slurm/*.sbatch against a real Slurm (.ci/slurm_up.sh): run, stop + requeue, crash + requeue.

The first three jobs are the smoke trainer at world size 2 on gloo, 12 steps, a checkpoint every 3.
Its data is a function of the step and the run is fp32 on CPU, so any interrupted and
resumed run must reproduce the uninterrupted run's metrics exactly. The uninterrupted run
uses the srun template (2 tasks); the USR1 run uses the torchrun template (1 task, 2
workers), so the equality also checks that the two launch paths train the same way.
The last job is the RL trainer (the embedded DAPO default, vLLM rollouts with per-prompt
seeds): a rank killed after a checkpoint, the job requeued, the steps after the checkpoint
computed again exactly as the killed attempt had, and the data position continued.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess

import pytest

from tests.slurm.jobs import Job
from tests.slurm.jobs import committed_step as _committed
from tests.slurm.jobs import exit_status as _status

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 12
SAVE_INTERVAL = 3
SMOKE = (f"trainer.max_steps={STEPS}", f"checkpoint.save_interval={SAVE_INTERVAL}")


def _same_training(rows: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), [r["step"] for r in rows]
    for got, want in zip(rows, reference):
        assert (got["lm_loss"], got["grad_norm"]) == (want["lm_loss"], want["grad_norm"]), (got, want)


@pytest.fixture(scope="module")
def reference(slurm_env, tmp_path_factory) -> dict:
    """The uninterrupted run: srun template, 2 tasks on the node."""
    run_dir = tmp_path_factory.mktemp("slurm") / "uninterrupted"
    job = Job(slurm_env, "train_srun.sbatch", run_dir, ["--ntasks-per-node=2"], overrides=SMOKE)
    rc = job.finish()
    print(f"uninterrupted job: {job.seconds:.1f} s")
    return {"rc": rc, "rows": job.rows(), "log": job.text(), "run_dir": run_dir}


def test_sbatch_runs_two_tasks_to_completion(reference):
    assert reference["rc"] == 0, reference["log"]
    log = reference["log"]
    assert "(2 ranks)" in log and "restart 1" not in log, log
    assert log.count("run dir:") == 2, log  # both srun tasks ran the trainer to its end
    rows = reference["rows"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert abs(rows[0]["lm_loss"] - math.log(96)) < 0.3 and rows[-1]["lm_loss"] < rows[0]["lm_loss"] - 1.0, rows
    assert {r["slurm/restart_count"] for r in rows} == {0}
    assert _status(reference["run_dir"])["code"] == 0 and _committed(reference["run_dir"]) == STEPS


def test_usr1_checkpoints_requeues_and_resumes_exactly(slurm_env, reference, tmp_path):
    run_dir = tmp_path / "usr1"
    # The monitor has declared a (spare, never used) node faulty: the requeue must exclude it.
    (run_dir / "monitor").mkdir(parents=True)
    (run_dir / "monitor" / "exclude_hosts.txt").write_text("# from the monitor\nmrl-spare\n")
    job = Job(
        slurm_env,
        "train_torchrun.sbatch",
        run_dir,
        ["--ntasks-per-node=1"],
        {"MRL_NPROC_PER_NODE": "2"},
        overrides=SMOKE,
    )
    job.wait_for("step 3 in metrics.jsonl", lambda: len(job.rows()) >= 3)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job.job_id], env=job.env, check=True)
    assert job.finish() == 0, job.text()
    print(f"USR1 job: {job.seconds:.1f} s")
    log = job.text()
    stopped = re.search(r"stopped on SIGUSR1 after step (\d+)", log)
    assert stopped, log
    stop_step = int(stopped.group(1))
    assert 3 <= stop_step < STEPS, log
    assert f"trainer status 75 at step {stop_step}: stopped after a checkpoint, requeue" in log, log
    restart = re.search(r"job \d+ restart 1 on .*ExcNodeList=(\S+)", log)
    assert restart and restart.group(1) == "mrl-spare", log
    assert f"resumed from {run_dir / 'checkpoints'} at step {stop_step} (restart 1)" in log, log
    rows = job.rows()
    _same_training(rows, reference["rows"])
    assert [r["slurm/restart_count"] for r in rows] == [0] * stop_step + [1] * (STEPS - stop_step)
    assert _status(run_dir)["code"] == 0 and _status(run_dir)["attempt"] == f"{job.job_id}.1"


def test_sigkill_of_a_rank_requeues_and_loses_nothing_committed(slurm_env, reference, tmp_path):
    run_dir = tmp_path / "sigkill"
    job = Job(slurm_env, "train_srun.sbatch", run_dir, ["--ntasks-per-node=2"], overrides=SMOKE)
    # Kill once a checkpoint is committed and training has moved past it.
    job.wait_for(
        "a committed checkpoint and a step past it",
        lambda: _committed(run_dir) >= SAVE_INTERVAL and len(job.rows()) > _committed(run_dir),
    )
    ranks = job.wait_for("two trainer ranks", lambda: (lambda p: p if len(p) == 2 else None)(job.pids()), 10)
    committed = _committed(run_dir)
    os.kill(ranks[-1], signal.SIGKILL)
    assert job.finish() == 0, job.text()
    print(f"SIGKILL job: {job.seconds:.1f} s (killed after committed step {committed})")
    log = job.text()
    assert re.search(r"attempt \d+\.0: launcher exit [1-9]\d*: .*; restart 1 of 3", log), log
    resumed = re.search(r"resumed from \S+ at step (\d+) \(restart 1\)", log)
    assert resumed and int(resumed.group(1)) >= committed, log
    rows = job.rows()
    _same_training(rows, reference["rows"])
    assert rows[-1]["slurm/restart_count"] == 1


RL_STEPS, RL_SAVE_INTERVAL = 10, 4
RUN_DEPENDENT = ("timing/", "throughput/", "slurm/", "monitor/")
"""Metrics that depend on the attempt (times, restarts), not on what was trained."""


def _trained(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(RUN_DEPENDENT)}


def test_rl_trainer_killed_after_a_checkpoint_requeues_and_recomputes_the_same_steps(slurm_env, tmp_path):
    """DAPO with vLLM under train_srun.sbatch (one rank). The rank is SIGKILLed once a
    checkpoint is committed and at least one later step is logged; the requeued attempt
    resumes from the checkpoint and, with per-prompt seeds and exact resume, computes those
    later steps again with every metric equal. No step is lost or repeated in metrics.jsonl,
    and no prompt is repeated or skipped: the loader's count goes on from the checkpoint."""
    run_dir = tmp_path / "rl"
    overrides = (
        f"trainer.max_steps={RL_STEPS}",
        f"checkpoint.save_interval={RL_SAVE_INTERVAL}",
        "rollout.seed_per_prompt=true",
        "eval.sets={}",  # one row per training step, as the checks below count them
    )
    job = Job(slurm_env, "train_srun.sbatch", run_dir, ["--ntasks-per-node=1"], config="dapo.yaml", overrides=overrides)
    job.wait_for(
        "a committed checkpoint and a step past it",
        lambda: _committed(run_dir) >= RL_SAVE_INTERVAL and len(job.rows()) > _committed(run_dir),
        240,
    )
    ranks = job.wait_for("the trainer rank", lambda: job.pids() or None, 10)
    os.kill(ranks[0], signal.SIGKILL)
    before = job.rows()  # what the killed attempt logged, steps past the checkpoint included
    committed = _committed(run_dir)
    assert job.finish() == 0, job.text()
    print(f"RL SIGKILL job: {job.seconds:.1f} s (killed after committed step {committed}, {len(before)} steps logged)")
    log = job.text()
    resumed = re.search(r"resumed from \S+ step (\d+)", log)
    assert resumed and int(resumed.group(1)) >= committed and "restart 1" in log, log
    rows = job.rows()
    assert [r["step"] for r in rows] == list(range(1, RL_STEPS + 1)), [r["step"] for r in rows]
    assert len(before) > int(resumed.group(1)), "no step past the checkpoint was logged before the kill"
    for got, want in zip(rows, before):  # the recomputed steps equal the killed attempt's
        assert _trained(got) == _trained(want), (got["step"], got, want)
    assert [r["slurm/restart_count"] for r in rows[int(resumed.group(1)) :]] == [1] * (RL_STEPS - int(resumed.group(1)))
    drawn, per_batch = 0, 16  # examples/dapo.yaml: rollout.prompts_per_step
    for r in rows:  # dynamic sampling draws whole batches of prompts, none twice
        drawn += r["rollout/generation_batches"] * per_batch
        assert r["data/prompts_drawn"] == drawn, (r["step"], r["data/prompts_drawn"], drawn)
